"""Paged KV-cache ops checked against dense attention computed from scratch."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

import kernels
from kernels import copy_blocks, paged_attention, reference, write_kv_cache
from kernels.build import cpu_flags, load_cpu_extension
from tests.support.kernel_batches import Batch, make_batch, mixed_specs

HEADS = [(4, 4), (9, 3), (8, 2)]  # (num_heads, num_kv_heads): GQA ratios 1, 3, 4


TWIN_DECODE = reference._decode_batch


@pytest.fixture(autouse=True, params=["torch", "cpu-kernel", "cpu-kernel-avx2"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test runs on the pure-torch ops and again with decode attention in the CPU C++ kernel: in AVX-512
    where the CPU has it, and in its AVX2 passes (kernels.avx512(False)) on such a CPU too."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "_cpu_ops", lambda t: None)
        yield str(request.param)
        return
    if request.param == "cpu-kernel-avx2" and not torch.cpu._is_avx512_supported():
        pytest.skip("the CPU has no AVX-512: cpu-kernel runs the AVX2 passes already")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    assert load_cpu_extension() is not None, "the CPU kernel failed to build (see the log)"

    def no_twin(*args: object) -> None:
        raise AssertionError("float32 and bfloat16 decodes on the CPU must run in the C++ kernel")

    # float16 stays on the twin; float32 and bfloat16 decodes must never reach it.
    monkeypatch.setattr(reference, "_decode_batch", no_twin)
    with kernels.avx512(request.param == "cpu-kernel"):
        yield str(request.param)


def kernel_passes(implementation: str) -> bool:
    """Whether the CPU kernel runs its passes (AVX-512's, or AVX2's where the build has AVX2) in this run of a
    test, which take prefill chunks too; a build without AVX2 runs plain loops over the decodes alone."""
    return implementation != "torch" and "-mavx2" in cpu_flags()


def dense_attention(
    q: Tensor,  # [q_len, num_heads, head_size]
    k: Tensor,  # [ctx, num_kv_heads, head_size]
    v: Tensor,  # [ctx, num_kv_heads, head_size]
    scale: float,
) -> Tensor:
    """Float64 softmax(QK^T * scale + causal-with-offset mask) V for one sequence; returns [q_len, Hq, D]."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(ctx - q_len, ctx)
    future = torch.arange(ctx)[None, :] > q_pos[:, None]  # [q_len, ctx]
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_and_check(batch: Batch, scale: float, atol: float, rtol: float) -> None:
    """Write the new tokens, run paged_attention and compare every sequence against dense attention."""
    write_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(
        out,
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
    )
    # paged_attention must only read the cache.
    torch.testing.assert_close(batch.k_cache, k_before, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, v_before, atol=0, rtol=0, equal_nan=True)
    starts = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v, strict=True)):
        q = batch.query[starts[s] : starts[s + 1]]
        expected = dense_attention(q, k, v, scale).to(out.dtype)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 32, 80, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_mixed_batch_matches_dense(
    num_heads: int, num_kv_heads: int, head_size: int, block_size: int
) -> None:
    """A shuffled batch of decodes and prefill chunks over random non-contiguous block tables."""
    seed = num_heads * 1000 + head_size * 10 + block_size
    batch = make_batch(mixed_specs(block_size, seed), num_heads, num_kv_heads, head_size, block_size, seed)
    run_and_check(batch, head_size**-0.5, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param([(4, 1), (0, 1), (40, 1), (15, 1)], id="decodes-ragged"),
        pytest.param([(15, 1), (31, 1), (47, 1)], id="decodes-block-aligned"),
        pytest.param([(0, 1)], id="single-token-prompt"),
        pytest.param([(0, 37)], id="single-prefill"),
        pytest.param([(0, 20), (17, 9), (0, 2)], id="prefills-only"),
        pytest.param([(100, 1), (0, 3)], id="long-decode-short-prefill"),
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_batch_shapes(num_heads: int, num_kv_heads: int, specs: list[tuple[int, int]]) -> None:
    """Batches that take only one path (all decodes, only prefills) or sit exactly on block boundaries."""
    batch = make_batch(specs, num_heads, num_kv_heads, 32, 16, seed=len(specs) * 7 + num_heads)
    run_and_check(batch, 0.125, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_takes_prefill_chunks_up_to_its_limit(
    implementation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the kernel's passes take every token of the prefill chunks up to CPU_PREFILL_KERNEL_TOKENS,
    each over its context up to itself; longer chunks, in the same batch, go to the twin's SDPA and their rows
    are left to it. A build without AVX2 takes the decodes alone."""
    if implementation == "torch":
        pytest.skip("the pure-torch ops take every chunk")
    monkeypatch.setattr(kernels, "CPU_PREFILL_KERNEL_TOKENS", 8)
    to_twin: list[int] = []
    prefill_each = reference._prefill_each

    def counting(*args: Any) -> None:
        starts, prefills = args[6], args[8]
        to_twin.extend(starts[s + 1] - starts[s] for s in prefills)
        prefill_each(*args)

    monkeypatch.setattr(reference, "_prefill_each", counting)
    specs = [(5, 1), (0, 8), (17, 3), (0, 37), (9, 20), (30, 2)]
    batch = make_batch(specs, 9, 3, 64, 16, seed=11)
    run_and_check(batch, 0.125, atol=1e-5, rtol=1e-5)
    taken = 8 if kernel_passes(implementation) else 1
    assert sorted(to_twin) == sorted(new for _, new in specs if new > taken)

    out = torch.full_like(batch.query, float("nan"))
    ops = load_cpu_extension()
    meta = (batch.block_table, batch.seq_lens, batch.query_start_loc, 0.125)
    assert ops.paged_attention(out, batch.query, batch.k_cache, batch.v_cache, *meta, 8) == taken
    starts = batch.query_start_loc.tolist()
    for s, (_, new) in enumerate(specs):
        rows = out[starts[s] : starts[s + 1]]
        assert bool(rows.isnan().all()) == (new > taken), f"chunk {s} of {new} tokens"
    with pytest.raises(RuntimeError, match="longest must be at least 1"):
        ops.paged_attention(out, batch.query, batch.k_cache, batch.v_cache, *meta, 0)


def test_avx2_passes_leave_chunks_past_128_tokens_to_the_twin(implementation: str) -> None:
    """The AVX2 passes take prefill chunks of up to 128 tokens, past which SDPA catches up on such CPUs,
    whatever longer chunk the caller allows; the rows of a longer chunk are left as they are."""
    avx2 = implementation == "cpu-kernel-avx2" or (
        implementation == "cpu-kernel" and not torch.cpu._is_avx512_supported()
    )
    if not (avx2 and kernel_passes(implementation)):
        pytest.skip("the AVX2 passes do not run here")
    specs = [(0, 129), (3, 128), (40, 1)]
    batch = make_batch(specs, 9, 3, 64, 16, seed=3)
    write_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    meta = (batch.block_table, batch.seq_lens, batch.query_start_loc, 0.125)
    ops = load_cpu_extension()
    assert ops.paged_attention(out, batch.query, batch.k_cache, batch.v_cache, *meta, 1024) == 128
    assert bool(out[:129].isnan().all()) and not bool(out[129:].isnan().any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_tokens_give_their_decodes_bits(implementation: str, dtype: torch.dtype) -> None:
    """In the CPU kernel a prefill chunk's token gives the bits it gives as a decode over its own context:
    taken with the tokens after it (whose positions it gives weight 0), none of its sums changes."""
    if not kernel_passes(implementation):
        pytest.skip("no kernel passes in this run: the twin, or a build without AVX2")
    specs = [(0, 11), (21, 6), (5, 1), (0, 3)]
    batch = make_batch(specs, 9, 3, 64, 16, seed=5, dtype=dtype)
    write_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    caches = (batch.k_cache, batch.v_cache)
    ops = load_cpu_extension()
    together = torch.empty_like(batch.query)
    meta = (batch.block_table, batch.seq_lens, batch.query_start_loc, 0.125)
    ops.paged_attention(together, batch.query, *caches, *meta, 64)
    # Every token as a decode of its own, over the sequence's blocks up to itself.
    rows = [(s, prefix + i + 1) for s, (prefix, new) in enumerate(specs) for i in range(new)]
    table = batch.block_table[[s for s, _ in rows]].contiguous()
    contexts = torch.tensor([ctx for _, ctx in rows], dtype=torch.int32)
    alone = torch.empty_like(batch.query)
    ops.paged_attention_decode(alone, batch.query, *caches, table, contexts,
                               torch.arange(len(rows) + 1, dtype=torch.int32), 0.125)  # fmt: skip
    assert torch.equal(together, alone)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision(dtype: torch.dtype, atol: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops run in the input dtype; results stay close to the float64 reference. bfloat16 decodes run in
    the C++ kernel (reading bf16, accumulating in fp32); float16 stays on the twin."""
    if dtype == torch.float16:
        monkeypatch.setattr(reference, "_decode_batch", TWIN_DECODE)
    batch = make_batch(mixed_specs(16, 3), 9, 3, 64, 16, seed=3, dtype=dtype)
    run_and_check(batch, 64**-0.5, atol=atol, rtol=2e-2)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128])
def test_bf16_head_sizes(head_size: int) -> None:
    """bfloat16 at every head size the AVX-512 loops take: the scores by the pair dot product where the head
    is whole chunks of 32 (and the CPU has AVX512_BF16), else by widened rows; both close to the reference."""
    batch = make_batch(mixed_specs(16, head_size), 8, 2, head_size, 16, seed=head_size, dtype=torch.bfloat16)
    run_and_check(batch, head_size**-0.5, atol=3e-2, rtol=2e-2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6),
    heads=st.sampled_from(HEADS),
    block_size=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    specs: list[tuple[int, int]], heads: tuple[int, int], block_size: int, seed: int
) -> None:
    """Arbitrary mixes of prefix lengths and chunk sizes agree with dense attention."""
    batch = make_batch(specs, heads[0], heads[1], 32, block_size, seed)
    run_and_check(batch, 0.2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_skips", [False, True])
def test_write_kv_cache(with_skips: bool) -> None:
    """Every token lands in its slot; -1 slots and all other slots are left untouched."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, heads, size, num_tokens = 6, 8, 3, 16, 20
    k_cache = torch.randn(num_blocks, block_size, heads, size, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, heads, size, generator=gen)
    k_orig, v_orig = k_cache.clone(), v_cache.clone()
    key = torch.randn(num_tokens, heads, size, generator=gen)
    value = torch.randn(num_tokens, heads, size, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if with_skips:
        slots[torch.tensor([0, 5, 6, 19])] = -1

    write_kv_cache(key, value, k_cache, v_cache, slots)

    keep = slots >= 0
    k_exp, v_exp = k_orig.view(-1, heads, size).clone(), v_orig.view(-1, heads, size).clone()
    k_exp[slots[keep]] = key[keep]
    v_exp[slots[keep]] = value[keep]
    assert torch.equal(k_cache.view(-1, heads, size), k_exp)
    assert torch.equal(v_cache.view(-1, heads, size), v_exp)


def test_write_kv_cache_edge_cases() -> None:
    """An empty or all -1 slot mapping writes nothing; writes go through per-layer views of the pool."""
    kv_cache = torch.zeros(2, 2, 4, 8, 2, 4)
    key = torch.ones(3, 2, 4)
    write_kv_cache(key[:0], key[:0], kv_cache[0, 0], kv_cache[0, 1], torch.empty(0, dtype=torch.int64))
    write_kv_cache(key, key, kv_cache[0, 0], kv_cache[0, 1], torch.full((3,), -1, dtype=torch.int64))
    assert not kv_cache.any()
    write_kv_cache(key, 2 * key, kv_cache[1, 0], kv_cache[1, 1], torch.tensor([0, 9, 31]))
    flat = kv_cache[1].view(2, -1, 2, 4)
    assert torch.equal(flat[0, [0, 9, 31]], key) and torch.equal(flat[1, [0, 9, 31]], 2 * key)
    assert kv_cache.count_nonzero() == 2 * key.numel()


def test_copy_blocks() -> None:
    """Each dst equals its src in every layer for K and V; every other block is untouched."""
    gen = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(3, 2, 10, 8, 2, 16, generator=gen)
    orig = kv_cache.clone()
    mapping = torch.tensor([[1, 7], [4, 2], [1, 9]], dtype=torch.int64)

    copy_blocks(kv_cache, mapping)

    for src, dst in mapping.tolist():
        assert torch.equal(kv_cache[:, :, dst], orig[:, :, src])
    others = [b for b in range(10) if b not in (7, 2, 9)]
    assert torch.equal(kv_cache[:, :, others], orig[:, :, others])


def test_copy_blocks_empty_mapping() -> None:
    """Zero pairs is a no-op."""
    kv_cache = torch.randn(2, 2, 4, 8, 2, 16)
    orig = kv_cache.clone()
    copy_blocks(kv_cache, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(kv_cache, orig)
