"""The CUDA ops against their pure-torch twins on the GPU, and the engine on CUDA against transformers."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kernels
from kernels import reference
from kernels.build import build, load_extension
from tests.support.kernel_batches import make_batch, mixed_specs

pytestmark = pytest.mark.gpu

# Output tolerance per dtype (absolute and relative): fp32 accumulation, then one rounding to the dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CONTEXTS = [1, 15, 16, 17, 511, 4096]


@pytest.fixture(scope="module")
def ops() -> Any:
    """torch.ops.pagedserve, built here so that a compile error fails the tests instead of falling back."""
    build()
    return torch.ops.pagedserve


@dataclass
class DecodeBatch:
    """One query token per sequence over a shuffled paged pool whose unowned slots hold NaN."""

    query: torch.Tensor  # [num_seqs, num_heads, head_size]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32, -1 padded
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32

    def args(self, scale: float) -> tuple[Any, ...]:
        """The arguments of paged_attention after out."""
        tables = (self.block_table, self.seq_lens, self.query_start_loc)
        return (self.query, self.k_cache, self.v_cache, *tables, scale)


def make_decode_batch(
    ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
    dtype: torch.dtype, seed: int,
) -> DecodeBatch:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq) + 2  # -1 padding past every row's end
    rows = []
    for n in per_seq:
        rows.append(physical[:n] + [-1] * (width - n))
        physical = physical[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    cuda_gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache = torch.randn(shape, generator=cuda_gen, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=cuda_gen, device="cuda").to(dtype)
    # NaN in every slot no sequence owns: a read past a context (or through -1 padding) poisons the output.
    table = torch.tensor(rows, dtype=torch.int64)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for row, n in zip(table, ctx_lens):
        pos = torch.arange(n)
        owned[row[pos // block_size] * block_size + pos % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_size)[~owned.cuda()] = float("nan")
    num_seqs = len(ctx_lens)
    return DecodeBatch(
        query=torch.randn(num_seqs, num_heads, head_size, generator=cuda_gen, device="cuda").to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=table.to(torch.int32).cuda(),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32).cuda(),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32).cuda(),
    )


def twin_output(batch: DecodeBatch, scale: float) -> torch.Tensor:
    """The torch twin in fp32 on the same (already rounded) inputs."""
    q, k, v = (t.float() for t in (batch.query, batch.k_cache, batch.v_cache))
    out = torch.empty_like(q)
    reference.paged_attention(out, q, k, v, batch.block_table, batch.seq_lens, batch.query_start_loc, scale)
    return out


def check_decode(ops: Any, batch: DecodeBatch, split: int) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_attention_decode(out, *batch.args(scale), split)
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float(), twin_output(batch, scale), atol=tol, rtol=tol)


def decode_grid() -> list[Any]:
    """Each dtype x head size x block size x GQA ratio once, with a sampled batch, KV heads and split."""
    rng = random.Random(0)
    cases = []
    for i, (dtype, head_size, block_size, group) in enumerate(
        itertools.product(TOLERANCE, (64, 128), (8, 16, 32), (1, 3, 8))
    ):
        batch = rng.choice([1, 3, 8, 24])
        ctx_lens = [CONTEXTS[(i + j) % len(CONTEXTS)] for j in range(batch)]
        num_kv_heads = rng.choice([1, 2, 4])
        split = rng.choice([-1, 0, 1])
        case_id = (
            f"{str(dtype)[6:]}-d{head_size}-bs{block_size}-g{group}-kv{num_kv_heads}-b{batch}-split{split}"
        )
        cases.append(
            pytest.param(dtype, head_size, block_size, group, num_kv_heads, ctx_lens, split, id=case_id)
        )
    return cases


@pytest.mark.parametrize(
    ("dtype", "head_size", "block_size", "group", "num_kv_heads", "ctx_lens", "split"), decode_grid()
)
def test_decode_matches_twin(
    ops: Any, dtype: torch.dtype, head_size: int, block_size: int, group: int, num_kv_heads: int,
    ctx_lens: list[int], split: int,
) -> None:  # fmt: skip
    batch = make_decode_batch(
        ctx_lens, group * num_kv_heads, num_kv_heads, head_size, block_size, dtype, seed=len(ctx_lens)
    )
    check_decode(ops, batch, split)


@pytest.mark.parametrize("split", [-1, 0, 1])
@pytest.mark.parametrize(("dtype", "group"), [(torch.bfloat16, 8), (torch.float32, 1), (torch.float16, 3)])
def test_long_contexts(ops: Any, dtype: torch.dtype, group: int, split: int) -> None:
    """32k-token contexts, unsplit and in 64 partitions, beside a short one."""
    batch = make_decode_batch([32768, 4097, 1], 2 * group, 2, 128, 16, dtype, seed=group)
    check_decode(ops, batch, split)


@pytest.mark.parametrize("split", [-1, 1])
def test_large_batch(ops: Any, split: int) -> None:
    """256 sequences of random lengths in one launch."""
    ctx_lens = [random.Random(n).randint(1, 2000) for n in range(256)]
    check_decode(ops, make_decode_batch(ctx_lens, 32, 8, 128, 16, torch.bfloat16, seed=256), split)


@pytest.mark.parametrize("head_size", [80, 96, 112, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_head_sizes(ops: Any, head_size: int, dtype: torch.dtype) -> None:
    batch = make_decode_batch([1, 17, 600, 1300], 12, 4, head_size, 32, dtype, seed=head_size)
    for split in (0, 1):
        check_decode(ops, batch, split)


def test_strided_query_and_out(ops: Any) -> None:
    """query and out as the attention layer passes them: [num_tokens, num_heads, head_size] views of
    [1, num_heads, num_tokens, head_size]."""
    batch = make_decode_batch([5, 300, 2000], 16, 4, 128, 16, torch.bfloat16, seed=9)
    strided = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    batch.query = strided
    for split in (0, 1):
        out = torch.empty_like(strided)
        ops.paged_attention_decode(out, *batch.args(0.1), split)
        torch.testing.assert_close(out.float(), twin_output(batch, 0.1), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2)])
def test_mixed_batch_dispatch(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    """kernels.paged_attention on CUDA (decodes through the kernel, prefill chunks through the twin) equals
    the twin alone."""
    batch = make_batch(mixed_specs(block_size, 1), num_heads, num_kv_heads, 64, block_size, seed=block_size)
    k_cache, v_cache = batch.k_cache.cuda(), batch.v_cache.cuda()
    kernels.write_kv_cache(batch.key.cuda(), batch.value.cuda(), k_cache, v_cache, batch.slot_mapping.cuda())
    args = (batch.query.cuda(), k_cache, v_cache, batch.block_table.cuda(), batch.seq_lens.cuda(),
            batch.query_start_loc.cuda(), 0.125)  # fmt: skip
    out, expected = torch.full_like(args[0], float("nan")), torch.full_like(args[0], float("nan"))
    kernels.paged_attention(out, *args)
    reference.paged_attention(expected, *args)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_size", [128, 64, 5])  # 5: rows not a multiple of 16 bytes
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_write_kv_cache_matches_twin(ops: Any, dtype: torch.dtype, head_size: int) -> None:
    """Strided key/value as the attention layer passes them, -1 slots skipped, one layer of a pool."""
    gen = torch.Generator().manual_seed(head_size)
    num_tokens, num_kv_heads, num_blocks, block_size = 40, 3, 12, 16
    pool = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype).cuda()
    new = torch.randn(2, num_kv_heads, num_tokens, head_size, generator=gen).to(dtype).cuda()
    key, value = new[0].transpose(0, 1), new[1].transpose(0, 1)  # [num_tokens, num_kv_heads, head_size]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.tensor([0, 7, 8, 39])] = -1
    expected = pool.clone()
    reference.write_kv_cache(key, value, expected[1, 0], expected[1, 1], slots.cuda())
    ops.write_kv_cache(key, value, pool[1, 0], pool[1, 1], slots.cuda())
    assert torch.equal(pool, expected)
    kernels.write_kv_cache(key[:0], value[:0], pool[0, 0], pool[0, 1], slots[:0].cuda())  # no tokens
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_copy_blocks_matches_twin(ops: Any, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(3, 2, 20, 16, 2, 128, generator=gen).to(dtype).cuda()
    mapping = torch.tensor([[1, 7], [4, 2], [1, 9], [19, 0]], dtype=torch.int64).cuda()
    expected = pool.clone()
    reference.copy_blocks(expected, mapping)
    ops.copy_blocks(pool, mapping)
    assert torch.equal(pool, expected)
    kernels.copy_blocks(pool, torch.empty(0, 2, dtype=torch.int64).cuda())
    assert torch.equal(pool, expected)


def test_bad_inputs_fail_loudly(ops: Any) -> None:
    batch = make_decode_batch([20], 4, 2, 128, 16, torch.bfloat16, seed=0)
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="block_table must be Int"):
        ops.paged_attention_decode(out, *batch.args(0.1)[:3], batch.block_table.long(), *batch.args(0.1)[4:])
    k32 = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16, device="cuda")
    q32 = torch.zeros(1, 4, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="not compiled for head size 32"):
        ops.paged_attention_decode(torch.empty_like(q32), q32, k32, k32, *batch.args(0.1)[3:])


# -- the engine on CUDA ------------------------------------------------------------------------------------

ENGINE_PROMPT_LENS = [1, 17, 100, 600, 1500]  # the long ones take the split-K path, and get chunked
ENGINE_NEW_TOKENS = 16
VOCAB = 32000


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Llama of realistic width (hidden 2048, 16 query and 8 KV heads of 128) with a
    word-level tokenizer made here: nothing to download or unpack on the GPU machine."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("llama-2048")
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", pad_token="t0", bos_token="t1", eos_token="t2"
    )
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
        # Wide enough weights that greedy choices are rarely near-ties, narrow enough that attention
        # stays soft (a saturated softmax would hide a wrong weighting).
        initializer_range=0.05, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return str(path)


def engine_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in ENGINE_PROMPT_LENS]


def hf_greedy(
    path: str, dtype: torch.dtype, prompts: list[list[int]]
) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' generate() on the GPU, one prompt at a time: the tokens and the logits of each step."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.cuda().eval()
    results = []
    for ids in prompts:
        input_ids = torch.tensor([ids], device="cuda")
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=ENGINE_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        results.append((out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits).float().cpu()))
    del model
    torch.cuda.empty_cache()
    return results


def paged_greedy(path: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    from gpu_worker import LLM, SamplingParams

    assert load_extension() is not None, "the engine would run the torch ops"
    llm = LLM(
        path, dtype=dtype, device="cuda", num_kv_blocks=1024, block_size=16, max_num_batched_tokens=1024
    )
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=ENGINE_NEW_TOKENS), use_tqdm=False
    )
    stats = llm.stats
    assert stats.num_free_blocks == stats.num_total_blocks
    return [o.outputs[0].token_ids for o in outputs]


def test_engine_fp32_matches_transformers(llama_path: str) -> None:
    prompts = engine_prompts()
    expected = [tokens for tokens, _ in hf_greedy(llama_path, torch.float32, prompts)]
    assert paged_greedy(llama_path, "float32", prompts) == expected


def test_engine_bf16_agrees_up_to_near_ties(llama_path: str) -> None:
    """In bf16 the two attention paths round differently, so greedy paths may part at a near-tie; they must
    agree up to the first step where transformers' own top two logits are that close."""
    prompts = engine_prompts()
    for (expected, logits), got in zip(
        hf_greedy(llama_path, torch.bfloat16, prompts), paged_greedy(llama_path, "bfloat16", prompts)
    ):
        step = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if step is None:
            assert len(got) == len(expected)
            continue
        row = logits[step]
        gap = float(row[expected[step]] - row[got[step]])
        assert gap <= 0.03 * float(row.abs().max()) + 0.05, f"parted at step {step} with a logit gap of {gap}"
