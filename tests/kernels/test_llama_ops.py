"""The fused elementwise ops of the Llama forward (kernels.rms_norm, add_rms_norm, silu_and_mul,
rotary_write_kv): the C++ kernels and their torch twins against transformers' own modules, in float32 and in
bfloat16, where they must round as transformers does."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import kernels
from kernels import reference
from kernels.build import load_cpu_extension

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


@pytest.fixture(params=["cpu-kernel", "torch"])
def ops(request: pytest.FixtureRequest) -> object:
    """kernels' dispatching functions (the C++ kernels on the CPU), or the torch twins themselves."""
    if request.param == "cpu-kernel":
        if load_cpu_extension() is None:
            pytest.skip("no C++ compiler: the CPU kernels are not built")
        return kernels
    return reference


def close(actual: Tensor, expected: Tensor) -> None:
    """float32: equal up to summation order; bfloat16: at most one bf16 step apart (a sum rounded once)."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_rms_norm_is_transformers_rms_norm(ops: object, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=EPS).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    x = torch.randn(rows, 576, dtype=dtype) * 3
    out = torch.empty_like(x)
    ops.rms_norm(out, x, norm.weight.data, EPS)  # type: ignore[attr-defined]
    close(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_add_rms_norm_is_the_sum_then_the_norm(ops: object, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(320, eps=EPS).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    x, residual = torch.randn(rows, 320, dtype=dtype), torch.randn(rows, 320, dtype=dtype) * 4
    expected_sum = residual + x
    expected = norm(expected_sum)
    ops.add_rms_norm(x, residual, norm.weight.data, EPS)  # type: ignore[attr-defined]
    assert torch.equal(residual, expected_sum)  # one rounded sum, as transformers' residual + hidden
    close(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_the_mlps_product(ops: object, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(9, 2 * 200, dtype=dtype) * 4
    gate, up = gate_up[:, :200], gate_up[:, 200:]
    out = torch.empty(9, 200, dtype=dtype)
    ops.silu_and_mul(out, gate_up)  # type: ignore[attr-defined]
    close(out, ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_holds_at_the_ends_of_the_exponential(ops: object, dtype: torch.dtype) -> None:
    """Gates far past where e^-x overflows or vanishes, every residue of the row's length against the
    vectorized exponential's width, and a NaN, which stays a NaN."""
    ends = torch.tensor([-88.5, -87.5, 87.5, 88.5, 0.0])
    gate = torch.cat([torch.linspace(-200, 200, 397), ends]).to(dtype)
    up = torch.linspace(-3, 3, gate.numel()).to(dtype)
    for n in (gate.numel(), 7, 1):
        gate_up = torch.cat([gate[:n], up[:n]]).unsqueeze(0)
        out = torch.empty(1, n, dtype=dtype)
        ops.silu_and_mul(out, gate_up)  # type: ignore[attr-defined]
        close(out[0], ACT2FN["silu"](gate[:n]) * up[:n])
    gate_up = torch.tensor([[float("nan"), 1.0, 2.0, 2.0]], dtype=dtype)
    out = torch.empty(1, 2, dtype=dtype)
    ops.silu_and_mul(out, gate_up)  # type: ignore[attr-defined]
    assert out[0, 0].isnan() and not out[0, 1].isnan()


def _same_bits(a: Tensor, b: Tensor) -> bool:
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.view(bits), b.view(bits))


# Floats below the smallest normal one (about 1.18e-38), which bfloat16 holds too.
SUBNORMALS = torch.tensor([1e-39, -3e-39, 5e-40, 1.1e-38, -7e-41])


def assert_avx512_gives_avx2_bits(run: Callable[[], tuple[Tensor, ...]]) -> None:
    """run() (fresh outputs each call) in the ops' AVX2 loops, then in their AVX-512 loops: the same bits."""
    if load_cpu_extension() is None or not torch.cpu._is_avx512_supported():
        pytest.skip("no AVX-512 CPU kernels here")
    results = []
    for wide in (False, True):
        with kernels.avx512(wide):
            results.append(run())
    assert all(_same_bits(a, b) for a, b in zip(*results, strict=True))


def _silu_of(gate_up: Tensor) -> tuple[Tensor, ...]:
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    kernels.silu_and_mul(out, gate_up)
    return (out,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_has_the_same_bits_in_its_avx512_and_avx2_loops(dtype: torch.dtype) -> None:
    """The AVX-512 loop takes 16 values a step and leaves the rest of a row to the eight-lane one; NaN, the
    infinities, the exponential's ends and both zeros in the lanes, products too small for a normal float
    (which AVX512_BF16's rounding would flush to zero), rows of every length around 16."""
    torch.manual_seed(3)
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 0.0, -0.0, 88.5, -88.5]
    )
    for n in (1, 15, 16, 17, 40, 1536):
        gate_up = (torch.randn(5, 2 * n) * 6).to(dtype)
        gate_up[0, : min(n, specials.numel())] = specials[:n].to(dtype)
        k = min(n, SUBNORMALS.numel())
        gate_up[1, :k] = 1.0
        gate_up[1, n : n + k] = SUBNORMALS[:k].to(dtype)  # up: silu(1) times each, subnormal too
        assert_avx512_gives_avx2_bits(functools.partial(_silu_of, gate_up))


def _rotary_inputs(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int
) -> tuple[Tensor, ...]:
    positions = torch.randint(0, 4000, (tokens,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = qkv[:, : heads * dim].reshape(
        tokens, heads, dim
    )  # a strided view, as the forward's fused matmul gives
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return q, k, v, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_rotary_write_kv_rotates_the_query_and_writes_the_rotated_key(
    ops: object, dtype: torch.dtype, tokens: int
) -> None:
    torch.manual_seed(tokens)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 64, 16, 8
    q, k, v, cos, sin = _rotary_inputs(dtype, tokens, heads, kv_heads, dim)
    # transformers' layout: [batch, heads, tokens, head_size], cos and sin [batch, tokens, head_size].
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)
    )
    expected_q, expected_k = expected_q[0].transpose(0, 1), expected_k[0].transpose(0, 1)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[0] = -1  # a token that is not written (its slot is another sequence's)
    expected_v = v.clone()
    ops.rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)  # type: ignore[attr-defined]
    close(q, expected_q)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    written = slots >= 0
    close(flat_k[slots[written]], expected_k[written])
    assert torch.equal(flat_v[slots[written]], expected_v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_the_kernels_refuse_what_they_cannot_take() -> None:
    if load_cpu_extension() is None:
        pytest.skip("no C++ compiler: the CPU kernels are not built")
    ops = torch.ops.pagedserve_cpu
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.silu_and_mul(torch.empty(2, 3), x)
    q, k, v, cos, sin = _rotary_inputs(torch.float32, 2, 2, 1, 8)
    cache = torch.zeros(1, 8, 1, 8)
    with pytest.raises(RuntimeError, match="maps to slot"):
        ops.rotary_write_kv(q, k, v, cos, sin, cache, cache.clone(), torch.tensor([0, 8]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [8, 20, 64, 576])
def test_the_norms_have_the_same_bits_in_their_avx512_and_avx2_loops(dtype: torch.dtype, n: int) -> None:
    """Rows of 16 values a step and the rest by eight or one: the sum, its squares and the scaled row; sums
    and products below the smallest normal float among them."""
    torch.manual_seed(n)
    x, residual, weight = (
        (torch.randn(5, n) * 3).to(dtype),
        torch.randn(5, n).to(dtype),
        torch.randn(n).to(dtype),
    )
    k = SUBNORMALS.numel()
    x[1, :k], residual[1, :k] = SUBNORMALS.to(dtype), 0.0  # subnormal sums
    weight[-k:] = SUBNORMALS.to(dtype)  # subnormal products

    def norms() -> tuple[Tensor, ...]:
        out, x_i, residual_i = torch.empty_like(x), x.clone(), residual.clone()
        kernels.rms_norm(out, x, weight, EPS)
        kernels.add_rms_norm(x_i, residual_i, weight, EPS)
        return out, x_i, residual_i

    assert_avx512_gives_avx2_bits(norms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 32, 64, 128])
def test_rotary_has_the_same_bits_in_its_avx512_and_avx2_loops(dtype: torch.dtype, dim: int) -> None:
    """Heads whose halves are a multiple of 16 rotate 16 lanes a step; the others go the other way."""
    torch.manual_seed(dim)
    q, k, v, cos, sin = _rotary_inputs(dtype, 9, 3, 1, dim)

    def rotary() -> tuple[Tensor, ...]:
        q_i, k_cache = q.clone(), torch.zeros(2, 16, 1, dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        kernels.rotary_write_kv(q_i, k, v, cos, sin, k_cache, v_cache, torch.arange(9))
        return q_i, k_cache, v_cache

    assert_avx512_gives_avx2_bits(rotary)
