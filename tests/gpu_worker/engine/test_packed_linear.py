"""The CPU linear swap: nn.Linear's outputs up to summation order, every linear swapped, each weight once; the
panel kernel only where oneDNN's bytes are its panels, a row's result the same whatever shares its step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

import kernels
from gpu_worker import LLM
from gpu_worker.engine.llama_forward import LlamaForward
from gpu_worker.engine.packed_linear import (
    PANEL_WIDTHS,
    PackedLinear,
    bf16_panels,
    can_pack,
    cpu_has_bf16,
    onednn_packs,
    own_bf16_panels,
    pack_linears,
    packed_bytes,
    packing_supported,
    panel_width,
)

TINY = dict(
    vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 8, 33, 128, 129, 300])
@pytest.mark.parametrize("out_features", [1000, 1024])  # 1024: panels of 64 (AVX2), the panel kernel
def test_matches_linear_in_fp32(num_rows: int, bias: bool, out_features: int) -> None:
    torch.manual_seed(num_rows)
    linear = nn.Linear(200, out_features, bias=bias)
    x = torch.randn(1, num_rows, 200)
    expected = linear(x)
    out = PackedLinear(linear)(x)
    assert out.shape == (1, num_rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def panelled(linear: nn.Linear) -> PackedLinear:
    packed = PackedLinear(linear)
    if not packed.panel:
        pytest.skip("no panel kernel here: not built with AVX2, or oneDNN lays float32 weights out otherwise")
    return packed


def test_a_weight_is_panelled_only_where_onednns_bytes_are_its_panels() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=False)
    packed = panelled(linear)
    width = packed.panel
    assert width in PANEL_WIDTHS
    weight = linear.weight.detach()
    panels = weight.view(960 // width, width, 576).transpose(1, 2)
    assert torch.equal(packed_bytes(packed.weight).view(960 // width, 576, width), panels)
    # The check compares bytes: another weight's, or the same in another dtype, is no match.
    assert panel_width(weight + 1, packed.weight) == 0
    assert panel_width(weight.to(torch.bfloat16), packed.weight) == 0


def test_without_the_panel_kernel_every_weight_stays_with_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_PANEL_KERNEL", "0")
    assert not kernels.panel_kernel_ready()
    assert PackedLinear(nn.Linear(576, 960)).panel == 0


# Runs of rows taken out of 128: one, a few, and from 16 rows (32; 33, split 16 and 17) where a panel's rows
# may be shared by two threads.
ROW_SLICES = (
    slice(0, 1), slice(5, 6), slice(0, 7), slice(60, 73), slice(0, 32), slice(3, 36), slice(0, 128, 2),
)  # fmt: skip


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}-threads")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Thread counts that split 9 panels every way: whole panels (1), and from 16 rows a panel's rows in
    halves between two threads (2: 4.5 panels each; 4: halves at both ends of a thread's run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bias: bool, threads: int) -> None:
    torch.manual_seed(1)
    packed = panelled(nn.Linear(1536, 576, bias=bias))  # 9 panels of 64
    x = torch.randn(128, 1536)
    together = packed(x)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], "")
    torch.testing.assert_close(together, onednn, atol=1e-4, rtol=1e-4)
    for rows in ROW_SLICES:
        assert torch.equal(packed(x[rows]), together[rows]), rows


@pytest.mark.parametrize("num_threads", [1, 2, 3])  # 3: 16 panels of 64 do not share out, so halves of rows
def test_rows_4_kib_apart_summed_aside_keep_their_bits(num_threads: int) -> None:
    """1024 outputs a row, rows 4 KiB apart: from 16 rows each panel is summed in a scratch and copied out
    (in place they would share L1's sets); every row gets the bits it gets alone, its sums kept in place."""
    torch.manual_seed(4)
    packed = panelled(nn.Linear(576, 1024, bias=True))
    x = torch.randn(64, 576)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        together = packed(x)
        onednn = torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], "")
        torch.testing.assert_close(together, onednn, atol=1e-4, rtol=1e-4)
        for rows in (slice(0, 16), slice(3, 36), slice(33, 64)):
            assert torch.equal(together[rows], packed(x[rows])), rows
        for row in (0, 15, 16, 40, 63):
            assert torch.equal(together[row : row + 1], packed(x[row : row + 1])), row
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU's oneDNN has no bf16")
@pytest.mark.parametrize("num_rows", [8, 200])  # 200: past the panel kernel's rows, oneDNN alone
def test_matches_linear_in_bf16(num_rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    x = torch.randn(num_rows, 576, dtype=torch.bfloat16)
    out = PackedLinear(linear)(x)
    assert out.dtype == torch.bfloat16
    # Both accumulate in fp32 and round once to bf16: at most one bf16 step apart.
    torch.testing.assert_close(out.float(), linear(x).float(), atol=0.05, rtol=2**-7)


def bf16_panelled(linear: nn.Linear) -> PackedLinear:
    """The bf16 panel kernel's weight: oneDNN's panels of pairs where the CPU has AVX512_BF16, else its
    own."""
    if not kernels.panel_kernel_ready(torch.bfloat16):
        pytest.skip("no bf16 panel kernel here: not built with AVX2, and no AVX-512")
    packed = PackedLinear(linear.to(torch.bfloat16))
    assert packed.panel, "oneDNN lays bf16 weights out other than as panels of pairs on this CPU"
    return packed


def weight_bytes(packed: PackedLinear) -> Tensor:
    return packed_bytes(packed.weight) if packed.weight.is_mkldnn else packed.weight.flatten()


def test_a_bf16_weight_is_panelled_in_pairs_of_its_inputs() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=False)
    packed = bf16_panelled(linear)
    width, weight = packed.panel, linear.weight.detach()
    pairs = weight.view(960 // width, width, 288, 2).transpose(1, 2)
    assert torch.equal(weight_bytes(packed).view(960 // width, 288, width, 2), pairs)
    if packed.weight.is_mkldnn:
        assert panel_width(weight + 1, packed.weight) == 0


def rounded_once(x: Tensor, linear: PackedLinear | nn.Linear, weight: Tensor) -> Tensor:
    """x times weight plus the bias, summed in float64 and rounded to float32, then to bf16."""
    bias = 0 if linear.bias is None else linear.bias.double()
    return (x.double() @ weight.double().T + bias).float().to(torch.bfloat16)


def one_step_apart(out: Tensor, expected: Tensor) -> None:
    """Both are float32 sums rounded once to bf16, summed in other orders: at most one bf16 step apart, and
    only a few apart at all (ties crossed), not a different product."""
    step = expected.float().abs().clamp(min=2**-100) * 2**-7  # one bf16 step at each output
    assert ((out.float() - expected.float()).abs() <= step + 1e-6).all()
    assert (out != expected).sum() <= 0.05 * out.numel()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 2, 7, 33, 128])
def test_the_bf16_panel_kernel_rounds_float32_sums_once(num_rows: int, bias: bool) -> None:
    """Each output is its float32 sum (bias included) rounded once to bf16, as oneDNN's is: it differs from
    the exact sum rounded only where float32's summation crosses a rounding boundary, by one bf16 step."""
    torch.manual_seed(num_rows)
    linear = nn.Linear(1536, 1024, bias=bias).to(torch.bfloat16)
    packed = bf16_panelled(linear)
    x = torch.randn(num_rows, 1536, dtype=torch.bfloat16)
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 1024)
    one_step_apart(out, rounded_once(x, packed, linear.weight))


@pytest.mark.parametrize("num_rows", [4, 33])  # blocks of K of 64 pairs, and of 288 (from 16 rows)
def test_the_bf16_panel_kernel_rounds_sums_as_a_tensor_rounds_them(num_rows: int) -> None:
    """Sums exact in float32 come out as `Tensor.to(torch.bfloat16)` gives them: halfway cases to even, a sum
    past float32's range as infinity, a NaN as a NaN. K spans several blocks, so each sum is carried across
    blocks before the last one rounds it."""
    weight = torch.zeros(128, 1536)
    weight[0::4, 0], weight[0::4, 1000] = 1.0, 2.0**-8  # 1 + 2^-8: halfway between 1 and 1 + 2^-7, to 1
    weight[1::4, 0], weight[1::4, 1000] = 1.0 + 2.0**-7, 2.0**-8  # 1 + 3 * 2^-8: to 1 + 2^-6
    weight[2::4, 1535] = -3.0
    weight[3::4, 700] = 2.0**100  # 2^200: past float32's range
    linear = nn.Linear(1536, 128, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    packed = bf16_panelled(linear)
    x = torch.zeros(num_rows, 1536)
    x[:, 0], x[:, 1000], x[:, 1535], x[:, 700] = 1.0, 1.0, 2.0**-60, 2.0**100
    x[-1, 5] = float("nan")
    with kernels.amx(False):
        out = packed(x.to(torch.bfloat16))
    expected = (x.double() @ weight.double().T).float().to(torch.bfloat16)
    assert torch.equal(out[:-1], expected[:-1])
    assert out[:-1, 0].eq(1.0).all() and out[:-1, 1].eq(1.0 + 2.0**-6).all() and out[:-1, 3].isinf().all()
    assert out[-1].isnan().all()


@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_rows_result_does_not_depend_on_the_rows_beside_it(bias: bool, threads: int) -> None:
    torch.manual_seed(2)
    packed = bf16_panelled(nn.Linear(1536, 576, bias=bias))  # 9 panels of 64
    x = torch.randn(128, 1536, dtype=torch.bfloat16)
    with kernels.amx(False):  # the AVX512_BF16 tiles, up to 128 rows
        together = packed(x)
        for rows in ROW_SLICES:
            assert torch.equal(packed(x[rows]), together[rows]), rows
    if kernels.amx_ready():  # AMX tiles up to 64 rows (oneDNN's sums beyond are in another order)
        together = packed(x[:64])
        for rows in (
            slice(0, 1),
            slice(3, 7),
            slice(5, 12),
            slice(15, 32),
            slice(0, 32, 2),
            slice(0, 33),
            slice(9, 64),
        ):
            assert torch.equal(packed(x[rows]), together[rows]), rows


def amx_panelled(linear: nn.Linear) -> PackedLinear:
    if not kernels.amx_ready():
        pytest.skip("no AMX-BF16 here")
    return bf16_panelled(linear)


@pytest.mark.parametrize("bias", [False, True])
# Tiles of 16 rows: whole, partial, both; one pass over the weights, or two over chunks of K.
@pytest.mark.parametrize("num_rows", [1, 5, 15, 16, 17, 31, 32, 33, 48, 63, 64])
def test_the_amx_tiles_agree_with_the_avx512_bf16_tiles(num_rows: int, bias: bool) -> None:
    """Both round each output's float32 sum once; they add the pairs in another order, so they differ only
    where that crosses a rounding boundary, by one bf16 step."""
    torch.manual_seed(num_rows)
    packed = amx_panelled(nn.Linear(1536, 1024, bias=bias))
    x = torch.randn(num_rows, 1536, dtype=torch.bfloat16)
    with kernels.amx(True):
        amx = packed(x)
    with kernels.amx(False):
        dot = packed(x)
    one_step_apart(amx, dot)
    # A row of zeros multiplies to zeros (plus bias): the partial tile's padding does not leak into real rows.
    x[-1] = 0
    with kernels.amx(True):
        last = packed(x)[-1]
    expected = packed.bias.to(torch.bfloat16) if bias else torch.zeros(1024, dtype=torch.bfloat16)
    assert torch.equal(last, expected)


def test_the_amx_tiles_read_rows_with_a_stride() -> None:
    torch.manual_seed(4)
    packed = amx_panelled(nn.Linear(576, 960, bias=False))
    wide = torch.randn(30, 1152, dtype=torch.bfloat16)
    x = wide[:, :576]  # rows 1152 values apart
    with kernels.amx(True):
        assert torch.equal(packed(x), packed(x.contiguous()))


def test_the_avx512_tiles_give_the_avx2_tiles_bits() -> None:
    """Both add one product per step of k, in order: the same bits, whichever tiles the CPU runs."""
    if not kernels.panel_kernel_ready() or not torch.cpu._is_avx512_supported():
        pytest.skip("needs the panel kernel and an AVX-512 CPU")
    torch.manual_seed(3)
    packed = PackedLinear(nn.Linear(1536, 960))
    assert packed.panel
    x = torch.randn(37, 1536)
    with kernels.avx512(True):
        avx512 = packed(x)
    with kernels.avx512(False):
        assert torch.equal(packed(x), avx512)


def test_engine_packs_every_linear(tiny_model_path: str) -> None:
    forward = LLM(tiny_model_path, num_kv_blocks=64).engine.runner.model
    assert isinstance(forward, LlamaForward)
    linears = [
        module for _, module in forward.named_modules() if isinstance(module, (nn.Linear, PackedLinear))
    ]
    assert linears and all(isinstance(module, PackedLinear) for module in linears)
    # transformers' forward, where the runner keeps the model's own modules.
    model = LLM(tiny_model_path, num_kv_blocks=64, model_impl="transformers").engine.runner.model
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear]
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_keeps_its_logits_and_one_copy_of_each_weight(tied: bool) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied)).eval()
    ids = torch.randint(0, 100, (1, 12))
    with torch.inference_mode():
        expected = model(ids).logits
    params = sum(p.numel() for p in model.parameters())
    assert pack_linears(model) == 2 * 7 + 1
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    # Untied, each packed weight replaces its plain one; a tied head adds one copy beside the embeddings.
    head = 100 * 16 if tied else 0
    assert sum(p.numel() for p in model.parameters()) == params + head
    assert model.get_input_embeddings().weight.layout == torch.strided


def test_other_devices_and_dtypes_are_left_alone() -> None:
    half = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.float16)
    with torch.device("meta"):
        elsewhere = LlamaForCausalLM(LlamaConfig(**TINY))
    for model in (half, elsewhere):
        assert pack_linears(model) == 0
        assert isinstance(model.get_output_embeddings(), nn.Linear)


@pytest.fixture
def own_panels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """bf16 weights packed as the panel kernel's own panels of pairs, multiplied with the pairs widened to
    float32, as on a CPU without AVX512_BF16 (also on one with it)."""
    if not kernels.panel_kernel_ready(torch.bfloat16):
        pytest.skip("no bf16 panel kernel here: not built with AVX2, and no AVX-512")
    monkeypatch.setattr("gpu_worker.engine.packed_linear.cpu_has_bf16", lambda: False)
    assert own_bf16_panels()
    with kernels.avx512_bf16_tiles(False):
        yield


@pytest.mark.usefixtures("own_panels")
def test_without_avx512_bf16_a_bf16_weight_is_its_own_panels_of_pairs() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert not packed.weight.is_mkldnn and packed.panel == 64
    assert packed.weight.shape == (15, 288, 64, 2)
    assert torch.equal(packed.weight[2, 5, 7], linear.weight[2 * 64 + 7, 10:12])
    assert torch.equal(packed.weight, bf16_panels(linear.weight.detach(), 64))
    # An output count no panel width divides stays with oneDNN (where its oneDNN has bf16).
    odd = nn.Linear(576, 100).to(torch.bfloat16)
    assert can_pack(odd) == onednn_packs(torch.bfloat16)
    # Nothing but the panel kernel reads these bytes: a float32 row is refused, not multiplied as [N, K].
    with pytest.raises(RuntimeError, match="panels of pairs"):
        kernels.packed_linear(torch.randn(2, 576), packed.weight, None, packed.panel)


@pytest.mark.usefixtures("own_panels")
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_bf16_sums_are_the_float32_kernels_bits(bias: bool, avx512: bool, threads: int) -> None:
    """Widened, a pair of bf16 weights is multiplied as two float32 values, k in order: each output is the
    float32 panel kernel's sum over the same values (products of bf16 values are exact), rounded once."""
    torch.manual_seed(3)
    linear = nn.Linear(1536, 576, bias=bias).to(torch.bfloat16)  # 9 panels of 64
    packed = PackedLinear(linear)
    as_float = panelled(nn.Linear(1536, 576, bias=bias))
    with torch.no_grad():
        as_float.weight.copy_(torch.ops.mkldnn._reorder_linear_weight(linear.weight.float(), None))
        if bias:
            as_float.bias.copy_(linear.bias.float())
    x = torch.randn(128, 1536).to(torch.bfloat16)
    with kernels.avx512(avx512):
        for rows in (*ROW_SLICES, slice(0, 128)):
            out = packed(x[rows])
            assert torch.equal(out, as_float(x[rows].float()).to(torch.bfloat16)), rows


@pytest.mark.usefixtures("own_panels")
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
@pytest.mark.parametrize("num_rows", [0, 1, 129, 300])
def test_own_bf16_panels_take_any_number_of_rows(num_rows: int, avx512: bool) -> None:
    """No oneDNN past 128 rows (a prefill's chunk): the panel kernel takes them all, each row as alone."""
    torch.manual_seed(num_rows)
    linear = nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(1, num_rows, 576).to(torch.bfloat16)
    with kernels.avx512(avx512):
        out = packed(x)
        assert out.shape == (1, num_rows, 1536) and out.dtype == torch.bfloat16
        one_step_apart(out[0], rounded_once(x[0], linear, linear.weight))
        if num_rows:
            assert torch.equal(packed(x[:, -1:]), out[:, -1:])


@pytest.mark.usefixtures("own_panels")
def test_a_model_on_own_bf16_panels_runs_the_cpp_layers() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 128})
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    forward = LlamaForward(model)
    assert forward.use_cpp_layers
    assert all(not m.weight.is_mkldnn for m in forward.modules() if isinstance(m, PackedLinear))


def test_bf16_instructions_without_onednn_bf16_fall_to_own_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with bf16 instructions whose oneDNN has no bf16 does not multiply bf16 natively here: its bf16
    weights become the panel kernel's own panels, where the kernel takes them."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr("gpu_worker.engine.packed_linear.onednn_packs", lambda dtype: False)
    assert not cpu_has_bf16()
    assert own_bf16_panels() == kernels.panel_kernel_ready(torch.bfloat16)
    assert packing_supported(torch.bfloat16) == own_bf16_panels()
