"""Quantized HF weights: FP8 block-scaled (DeepSeek-V3) and MXFP4 (GPT-OSS) read dequantized to bf16,
or kept as stored with ``--keep-fp8``; their inconsistencies are named errors.

The references here are written plainly, block by block, and independently of pgconvert.formats.hf_quantized;
the MXFP4 reference is transformers' own ``convert_moe_packed_tensors``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.cli_helpers import assert_clean_refusal, run_cli
from support.fp8_checkpoints import fp8_checkpoint, quantize_fp8
from support.hf_helpers import edit_json, load_hf_tensors, rewrite_as_single_file
from safetensors.torch import save_file

from pgconvert.run.convert import convert
from pgconvert.formats import LoadOptions
from pgconvert.formats import hf_quantized
from pgconvert.formats.hf_quantized import (
    BlockSizeError,
    MissingScaleError,
    QuantizedTensors,
    ScaleDtypeError,
    ScaleShapeError,
    dequantize_fp8,
    dequantize_mxfp4,
)
from pgconvert.formats.registry import get_loader
from pgconvert.formats.hf import tensor_region
from pgconvert.io import reuse
from pgconvert.io import threads as threads_module
from pgconvert.io.reuse import ReusedMemory
from pgconvert.formats.stream import TensorMeta, all_finite

def reference_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight.float() * scale, block by block, each block cut at the edges, cast to ``dtype``."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = weight[rows, cols].float() * scale[i, j]
    return out.to(dtype)


def expected_dequantized(stored: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    expected = {}
    for key, tensor in stored.items():
        if key.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            expected[key] = reference_dequantize(tensor, stored[key + "_scale_inv"], block)
        else:
            expected[key] = tensor
    return expected


def assert_tensors_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((257, 129), (128, 128)), ((70, 45), (16, 32)),
                                         ((128, 256), (128, 128))])
def test_fp8_dequantization_equals_the_plain_reference(shape: tuple[int, int], block: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(shape[0])
    weight, scale = quantize_fp8(torch.randn(shape, generator=generator), block)
    expected = reference_dequantize(weight, scale, block)

    assert torch.equal(dequantize_fp8(weight, scale, block), expected)


def test_fp8_dequantization_of_stacked_experts_scales_each_expert_by_its_own_blocks() -> None:
    block = (16, 32)
    generator = torch.Generator().manual_seed(9)
    pairs = [quantize_fp8(torch.randn(70, 45, generator=generator), block) for _ in range(3)]
    weight, scale = torch.stack([w.view(torch.uint8) for w, _ in pairs]).view(torch.float8_e4m3fn), torch.stack(
        [s for _, s in pairs])

    out = dequantize_fp8(weight, scale, block)

    for expert, (w, s) in enumerate(pairs):
        assert torch.equal(out[expert], reference_dequantize(w, s, block))


def test_fp8_dequantization_of_windows_reads_the_blocks_they_cover(tmp_path: Path) -> None:
    block = (16, 32)
    weight, scale = quantize_fp8(torch.randn(70, 75, generator=torch.Generator().manual_seed(3)), block)
    save_file({"w": weight, "w_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    files = {"w": tmp_path / "model.safetensors", "w_scale_inv": tmp_path / "model.safetensors"}
    stored = {"w": _meta(weight), "w_scale_inv": _meta(scale)}
    doc = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    quantized = QuantizedTensors.find(doc, tmp_path / "config.json", files, stored)
    expected = reference_dequantize(weight, scale, block)

    assert torch.equal(quantized.read("w"), expected)
    for dim, start, stop in ((0, 0, 70), (0, 5, 37), (0, 16, 32), (1, 7, 75), (1, 31, 33), (0, 69, 70)):
        assert torch.equal(quantized.read_range("w", dim, start, stop), expected.narrow(dim, start, stop - start))


def _meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(tensor.shape), tensor.dtype)


@pytest.mark.parametrize("block", [(32, 48), (128, 128)])
def test_fp8_checkpoint_converts_to_its_bf16_dequantization(tmp_path: Path, block: tuple[int, int]) -> None:
    stored = fp8_checkpoint(tmp_path / "src", block)

    report = convert(tmp_path / "src", tmp_path / "dst", max_shard_size=200_000)

    assert_tensors_equal(expected_dequantized(stored, block), load_hf_tensors(tmp_path / "dst"))
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert "quantization_config" not in config
    assert any("guess:" in notice and "dequantized to bfloat16" in notice for notice in report.notices)
    assert any("quantization_config (quant_method='fp8') is dropped" in notice for notice in report.notices)


def test_dequantizing_is_refused_under_strict(tmp_path: Path) -> None:
    fp8_checkpoint(tmp_path / "src")

    result = run_cli("convert", tmp_path / "src", tmp_path / "dst", "--strict")

    assert_clean_refusal(result, 2, "--strict", "dequantized to bfloat16", "--keep-fp8")
    assert run_cli("convert", tmp_path / "src", tmp_path / "dst", "--strict", "--keep-fp8").exit_code == 0


def test_fp8_checkpoint_through_megatron_tp2_reads_windows_and_comes_back_dequantized(tmp_path: Path) -> None:
    block = (32, 48)
    stored = fp8_checkpoint(tmp_path / "src", block)

    convert(tmp_path / "src", tmp_path / "mg", dst_format="megatron", dst_tp=2)
    convert(tmp_path / "mg", tmp_path / "back", dst_format="hf", dst_tp=1)

    assert_tensors_equal(expected_dequantized(stored, block), load_hf_tensors(tmp_path / "back"))
    # The carried config.json still says fp8; the hf target written from bf16 weights drops it.
    assert "quantization_config" in json.loads((tmp_path / "mg" / "hf" / "config.json").read_text())
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def test_keep_fp8_reshards_the_stored_bytes_and_scales(tmp_path: Path) -> None:
    block = (32, 48)
    stored = fp8_checkpoint(tmp_path / "src", block)
    source_config = json.loads((tmp_path / "src" / "config.json").read_text())

    result = run_cli("convert", tmp_path / "src", tmp_path / "dst", "--keep-fp8", "--max-shard-size", "50KB")

    assert result.exit_code == 0, result.output
    written = load_hf_tensors(tmp_path / "dst")
    assert len(list((tmp_path / "dst").glob("model-*.safetensors"))) > 1
    assert sorted(written) == sorted(stored)
    for key, tensor in stored.items():
        assert written[key].dtype == tensor.dtype, key
        if tensor.dtype == torch.float8_e4m3fn:
            assert torch.equal(written[key].view(torch.uint8), tensor.view(torch.uint8)), key
        else:
            assert torch.equal(written[key], tensor), key
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"] == source_config["quantization_config"]
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    # A weight and its scale land in the same shard.
    assert all(index["weight_map"][key + "_scale_inv"] == index["weight_map"][key]
               for key in stored if stored[key].dtype == torch.float8_e4m3fn)


def test_keep_fp8_is_refused_for_a_megatron_target(tmp_path: Path) -> None:
    fp8_checkpoint(tmp_path / "src")

    result = run_cli("convert", tmp_path / "src", tmp_path / "dst", "--keep-fp8", "--dst-format", "megatron")

    assert_clean_refusal(result, 2, "--keep-fp8", "hf -> megatron", "hf -> hf")
    assert not (tmp_path / "dst").exists()


KEY = "model.layers.1.self_attn.k_proj.weight"


@pytest.mark.parametrize("breakage,error,fragments", [
    (lambda t: t.update({KEY + "_scale_inv": t[KEY + "_scale_inv"][:, :1].contiguous()}), ScaleShapeError,
     (KEY + "_scale_inv", "has shape [1, 1]", "[32, 64]", "blocks of [32, 48]", "needs [1, 2]")),
    (lambda t: t.pop(KEY + "_scale_inv"), MissingScaleError,
     (KEY, "float8_e4m3fn [32, 64]", KEY + "_scale_inv", "not in the checkpoint")),
    (lambda t: t.update({KEY + "_scale_inv": t[KEY + "_scale_inv"].to(torch.bfloat16)}), ScaleDtypeError,
     (KEY + "_scale_inv", "dtype bfloat16", "must be float32")),
])
def test_inconsistent_scales_are_named_errors(tmp_path: Path, breakage: Callable[[dict[str, torch.Tensor]], object],
                                             error: type[Exception], fragments: tuple[str, ...]) -> None:
    fp8_checkpoint(tmp_path / "src")
    rewrite_as_single_file(tmp_path / "src", breakage)

    with pytest.raises(error) as raised:
        get_loader("hf").open(tmp_path / "src", LoadOptions())
    assert "model.safetensors" in str(raised.value)
    result = run_cli("convert", tmp_path / "src", tmp_path / "dst")
    assert_clean_refusal(result, 1, "model.safetensors", *fragments)


def test_another_quant_method_is_a_named_error(tmp_path: Path) -> None:
    fp8_checkpoint(tmp_path / "src")
    edit_json(tmp_path / "src" / "config.json", lambda doc: doc["quantization_config"].update(quant_method="gptq"))

    result = run_cli("convert", tmp_path / "src", tmp_path / "dst")

    assert_clean_refusal(result, 1, "config.json", "quant_method='gptq'", "fp8 (block-scaled) and mxfp4")


@pytest.mark.parametrize("block", [[128], [0, 128], ["128", 128], [True, 128], None, [128, -1, 3]])
def test_a_block_size_that_is_not_two_positive_ints_is_a_named_error(tmp_path: Path, block: object) -> None:
    fp8_checkpoint(tmp_path / "src")
    edit_json(tmp_path / "src" / "config.json", lambda doc: doc["quantization_config"].update(weight_block_size=block))

    with pytest.raises(BlockSizeError, match="weight_block_size"):
        get_loader("hf").open(tmp_path / "src", LoadOptions())
    result = run_cli("convert", tmp_path / "src", tmp_path / "dst")
    assert_clean_refusal(result, 1, "config.json", "weight_block_size=", "two positive integers")


# --- MXFP4 (GPT-OSS) ---------------------------------------------------------------------------
def test_fp8_is_dequantized_straight_to_float32_when_float32_is_asked_for(tmp_path: Path) -> None:
    """--dtype fp32: the float32 product itself, not the product rounded to bf16 and widened back."""
    one, scale = torch.tensor([[1.125]]).to(torch.float8_e4m3fn), torch.tensor([[1.0078125]])  # 1 + 2**-7
    block = (32, 48)
    stored = fp8_checkpoint(tmp_path / "src", block)
    names = sorted(key for key, tensor in stored.items() if tensor.dtype == torch.float8_e4m3fn)

    report = convert(tmp_path / "src", tmp_path / "dst", dtype="fp32")
    convert(tmp_path / "src", tmp_path / "mg", dst_format="megatron", dst_tp=2, dtype="fp32")  # windows of rows/cols
    convert(tmp_path / "mg", tmp_path / "back", dst_format="hf", dst_tp=1)

    # 1.125 * (1 + 2**-7) = 1.1337890625 needs 10 significant bits; bf16 keeps 8.
    assert dequantize_fp8(one, scale, (1, 1), dtype=torch.float32).item() == 1.1337890625
    assert dequantize_fp8(one, scale, (1, 1)).float().item() != 1.1337890625
    for out in (load_hf_tensors(tmp_path / "dst"), load_hf_tensors(tmp_path / "back")):
        for name in names:
            expected = reference_dequantize(stored[name], stored[name + "_scale_inv"], block, torch.float32)
            assert out[name].dtype == torch.float32 and torch.equal(out[name], expected), name
        bf16_route = {name: reference_dequantize(stored[name], stored[name + "_scale_inv"], block).float()
                      for name in names}
        assert not any(torch.equal(out[name], bf16_route[name]) for name in names)
    assert any("dequantized to float32" in notice for notice in report.notices), report.notices


def test_mxfp4_is_dequantized_straight_to_the_dtype_asked_for(tmp_path: Path) -> None:
    """MXFP4 values (e2m1 times a power of two) are exact in bf16 and float32 alike: the float32 read
    equals transformers' float32 conversion and the widened bf16 one."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = mxfp4_parts(4, 64, 1, 6)
    files, stored = mxfp4_file(tmp_path / "model.safetensors", {DOWN + "_blocks": blocks, DOWN + "_scales": scales})

    quantized = QuantizedTensors.find({}, tmp_path / "config.json", files, stored, dtype=torch.float32)

    expected = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    assert quantized.logical()[1][DOWN].dtype == torch.float32
    assert torch.equal(quantized.read(DOWN), expected) and torch.equal(quantized.read_range(DOWN, 0, 1, 3), expected[1:3])
    assert torch.equal(dequantize_mxfp4(blocks, scales).float(), expected)


GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def mxfp4_parts(experts: int, rows: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed bytes, and E8M0 exponents over their whole finite range (255 is NaN in E8M0)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(0, 255, (experts, rows, groups), generator=generator, dtype=torch.uint8)
    scales[0, :2, 0] = torch.tensor([0, 254], dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_decoder_equals_transformers_convert_moe_packed_tensors() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for shape, seed in (((2, 12, 2), 0), ((4, 6, 3), 1), ((1, 64, 1), 2)):
        blocks, scales = mxfp4_parts(*shape, seed)

        ours = dequantize_mxfp4(blocks, scales)
        theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)

        assert ours.dtype == theirs.dtype == torch.bfloat16
        assert ours.shape == theirs.shape == (shape[0], shape[2] * 32, shape[1])
        assert torch.equal(ours, theirs)


def test_mxfp4_strips_and_the_nan_exponent_equal_transformers_bit_for_bit() -> None:
    """Rows over several strips (the last one partial), and E8M0 code 255 in one strip: transformers' ldexp
    keeps zeros zero and makes the rest infinite; a table's infinite power would turn the zeros into NaN."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    groups = 90
    rows_per_strip = hf_quantized.MXFP4_STRIP_VALUES // (groups * 32)
    blocks, scales = mxfp4_parts(2, 2 * rows_per_strip + 7, groups, 3)
    blocks[1, rows_per_strip + 2, 5] = torch.tensor([0x00, 0x80, 0x71, 0x0F] * 4, dtype=torch.uint8)
    scales[1, rows_per_strip + 2, 5] = 255

    for dtype in (torch.bfloat16, torch.float32):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)

        assert torch.isinf(ours).any() and not torch.isnan(ours).any()
        assert torch.equal(ours, theirs)
        assert torch.equal(torch.signbit(ours), torch.signbit(theirs))


def mxfp4_file(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Path], dict[str, TensorMeta]]:
    save_file(tensors, str(path))
    return {name: path for name in tensors}, {name: _meta(tensor) for name, tensor in tensors.items()}


def test_mxfp4_tensors_of_a_safetensors_file_read_by_their_logical_names(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gate_up, down = mxfp4_parts(4, 16, 2, 5), mxfp4_parts(4, 64, 1, 6)
    bias = torch.randn(4, 16)
    files, stored = mxfp4_file(tmp_path / "model.safetensors", {
        GATE_UP + "_blocks": gate_up[0], GATE_UP + "_scales": gate_up[1], GATE_UP + "_bias": bias,
        DOWN + "_blocks": down[0], DOWN + "_scales": down[1]})
    doc = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}

    quantized = QuantizedTensors.find(doc, tmp_path / "config.json", files, stored)
    logical_files, metas = quantized.logical()

    assert sorted(metas) == sorted([GATE_UP, GATE_UP + "_bias", DOWN]) == sorted(logical_files)
    assert metas[GATE_UP].shape == (4, 64, 16) and metas[GATE_UP].dtype == torch.bfloat16
    for name, (blocks, scales) in ((GATE_UP, gate_up), (DOWN, down)):
        expected = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
        assert torch.equal(quantized.read(name), expected)
        assert torch.equal(quantized.read_range(name, 0, 1, 3), expected[1:3])
        assert torch.equal(quantized.read_range(name, 1, 5, 30), expected[:, 5:30])
    assert [part for part, _ in quantized.stored_parts(DOWN)] == [DOWN + "_blocks", DOWN + "_scales"]


@pytest.mark.parametrize("change,error,fragment", [
    (lambda t: t.pop(DOWN + "_scales"), MissingScaleError, DOWN + "_scales are not in the checkpoint"),
    (lambda t: t.pop(DOWN + "_blocks"), MissingScaleError, "their blocks " + DOWN + "_blocks"),
    (lambda t: t.update({DOWN + "_scales": t[DOWN + "_scales"][:, :3].contiguous()}), ScaleShapeError,
     "has shape [4, 3, 1]"),
    (lambda t: t.update({DOWN + "_scales": t[DOWN + "_scales"].to(torch.int32)}), ScaleDtypeError, "dtype int32"),
])
def test_inconsistent_mxfp4_parts_are_named_errors(tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], object],
                                                   error: type[Exception], fragment: str) -> None:
    blocks, scales = mxfp4_parts(4, 64, 1, 6)
    tensors = {DOWN + "_blocks": blocks, DOWN + "_scales": scales}
    change(tensors)
    files, stored = mxfp4_file(tmp_path / "model.safetensors", tensors)

    with pytest.raises(error) as raised:
        QuantizedTensors.find({}, tmp_path / "config.json", files, stored)
    assert fragment in str(raised.value) and "model.safetensors" in str(raised.value)


def test_a_kept_tensor_shared_by_several_units_is_written_once_with_the_last() -> None:
    from savers.hf import _Unit, kept_once

    from pgconvert.families.table import IDENTITY, TensorMapping

    stacked = "model.layers.0.mlp.experts.down_proj"
    parts = ((stacked + "_blocks", TensorMeta((2, 8, 1, 16), torch.uint8)),
             (stacked + "_scales", TensorMeta((2, 8, 1), torch.uint8)))
    row = TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight",
                        ("model.layers.{}.mlp.experts.{}.down_proj",), IDENTITY)
    units = [_Unit(f"expert{j}", row, (stacked,), ((8, 32),), torch.bfloat16, {stacked: parts}) for j in range(2)]
    plain = _Unit("norm", row, ("model.norm.weight",), ((8,),), torch.bfloat16)

    once = kept_once([units[0], plain, units[1]])

    assert [[name for name, _, _ in unit.entries()] for unit in once] == [
        [], ["model.norm.weight"], [stacked + "_blocks", stacked + "_scales"]]


def test_a_batch_rerun_tells_a_kept_fp8_output_from_a_dequantized_one(tmp_path: Path) -> None:
    from pgconvert.run.batch import skip_reason
    from pgconvert.run.convert import ConvertRequest

    fp8_checkpoint(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", keep_fp8=True)

    kept, _ = skip_reason(ConvertRequest(src=tmp_path / "src", dst=tmp_path / "dst", keep_fp8=True), False)
    dequantized, reason = skip_reason(ConvertRequest(src=tmp_path / "src", dst=tmp_path / "dst"), False)

    assert kept and not dequantized
    assert "keep_fp8" in reason


# ------------------------------------------------------------------------------------ non-finite parts


SCALE = KEY + "_scale_inv"


def _nan_at_the_first(name: str) -> Callable[[dict[str, torch.Tensor]], object]:
    def plant(tensors: dict[str, torch.Tensor]) -> None:
        tensor = tensors[name].clone()
        tensor.view(-1)[0] = float("nan")  # FP8 e4m3fn has a NaN (0x7f), no Inf
        tensors[name] = tensor
    return plant


@pytest.mark.parametrize("keep", [False, True], ids=["dequantized", "kept"])
def test_a_nan_scale_is_refused_by_check_finite_naming_the_scale(tmp_path: Path, keep: bool) -> None:
    fp8_checkpoint(tmp_path / "src")
    rewrite_as_single_file(tmp_path / "src", _nan_at_the_first(SCALE))
    keep_flag = ("--keep-fp8",) if keep else ()

    result = run_cli("convert", tmp_path / "src", tmp_path / "dst", "--check-finite", *keep_flag)

    assert_clean_refusal(result, 1, SCALE, "NaN", "refused by --check-finite")
    assert not (tmp_path / "dst").exists()
    report = convert(tmp_path / "src", tmp_path / "dst", keep_fp8=keep)  # by default: converted, and said
    assert [notice for notice in report.notices if "NaN" in notice and SCALE in notice]


def test_a_nan_in_kept_fp8_data_is_refused_by_check_finite_naming_the_weight(tmp_path: Path) -> None:
    fp8_checkpoint(tmp_path / "src")
    rewrite_as_single_file(tmp_path / "src", _nan_at_the_first(KEY))

    result = run_cli("convert", tmp_path / "src", tmp_path / "dst", "--check-finite", "--keep-fp8")

    assert_clean_refusal(result, 1, f"{KEY}: 1 of", "NaN", "refused by --check-finite")
    assert SCALE + ":" not in result.output  # the scale is finite: not blamed


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])
def test_the_finiteness_check_of_fp8_bytes_agrees_with_float32_on_every_byte(dtype: torch.dtype) -> None:
    every_byte = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = [all_finite(every_byte[index:index + 1]) for index in range(256)]

    assert finite == torch.isfinite(every_byte.float()).tolist()
    assert all_finite(every_byte) == all(finite)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_code_table_holds_the_bits_torch_converts_each_code_to(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    assert torch.equal(hf_quantized._fp8_table(dtype).view(torch.int32), codes.float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_dequantization_in_many_strips_of_a_window_equals_the_reference(dtype: torch.dtype,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_quantized, "STRIP_ELEMENTS", 7 * 45)  # strips of 7 rows: they cut across blocks
    block = (16, 32)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(0, 256, (70, 45), generator=generator, dtype=torch.int32).to(torch.uint8).view(dtype)
    scale = torch.rand(5, 2, generator=generator) * 3
    expected = reference_dequantize(weight, scale, block)
    assert torch.equal(dequantize_fp8(weight, scale, block).view(torch.int16), expected.view(torch.int16))
    window = dequantize_fp8(weight[19:61, 5:40], scale[1:, :], block, row0=19, col0=5)
    assert torch.equal(window.view(torch.int16), expected[19:61, 5:40].view(torch.int16))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_dequantization_spread_over_threads_equals_the_reference(threads: int, dtype: torch.dtype,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Strips taken by one, two or three threads (fewer strips than threads for the small weight), of stacked
    experts and of a window, in each dtype asked for: the reference's bits."""
    monkeypatch.setattr(hf_quantized, "STRIP_ELEMENTS", 7 * 45 * 3)
    monkeypatch.setattr(threads_module, "SPREAD_THREADS", threads)
    block = (16, 32)
    generator = torch.Generator().manual_seed(threads)
    pairs = [quantize_fp8(torch.randn(70, 45, generator=generator), block) for _ in range(3)]
    weight = torch.stack([w.view(torch.uint8) for w, _ in pairs]).view(torch.float8_e4m3fn)
    scale = torch.stack([s for _, s in pairs])
    out = dequantize_fp8(weight, scale, block, dtype=dtype)
    for expert, (w, s) in enumerate(pairs):
        assert torch.equal(out[expert], reference_dequantize(w, s, block, dtype)), expert
    tiny = dequantize_fp8(pairs[0][0][:2, 3:9], pairs[0][1][:1, :1], block, col0=3, dtype=dtype)
    assert torch.equal(tiny, reference_dequantize(pairs[0][0], pairs[0][1], block, dtype)[:2, 3:9])


def test_fp8_dequantization_over_more_than_256_column_blocks_equals_the_reference() -> None:
    """More column blocks than 16-bit indices reach (257 tables of 256 codes): the indices are 32-bit."""
    block = (4, 2)
    generator = torch.Generator().manual_seed(11)
    weight, scale = quantize_fp8(torch.randn(6, 2 * 257 + 1, generator=generator), block)
    assert torch.equal(dequantize_fp8(weight, scale, block), reference_dequantize(weight, scale, block))


def test_fp8_dequantization_into_a_given_tensor_fills_it_and_refuses_one_that_does_not_fit() -> None:
    block = (16, 32)
    weight, scale = quantize_fp8(torch.randn(40, 64, generator=torch.Generator().manual_seed(2)), block)
    fused = torch.full((2, 40, 64), 7.0, dtype=torch.bfloat16)
    assert dequantize_fp8(weight, scale, block, out=fused[1]).data_ptr() == fused[1].data_ptr()
    assert torch.equal(fused[1], reference_dequantize(weight, scale, block)) and bool((fused[0] == 7).all())
    for wrong in (torch.empty(40, 63, dtype=torch.bfloat16), torch.empty(40, 64), fused.transpose(1, 2)[0]):
        with pytest.raises(ValueError, match="dequantize_fp8: out is"):
            dequantize_fp8(weight, scale, block, out=wrong)


@pytest.mark.parametrize("kv_heads", [1, 4, 8], ids=["mqa", "gqa", "mha"])
def test_a_fused_tensor_of_fp8_parts_is_dequantized_into_its_rows_as_its_parts_fused(
        tmp_path: Path, kv_heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF reader makes a tensor of several FP8 parts by dequantizing each part straight into its rows of the
    fused tensor (each query group's rows on their own for q, k and v): bit for bit the tensor the transform fuses
    from the parts' own dequantizations, and with no part made apart for a gate/up pair."""
    fp8_checkpoint(tmp_path / "fp8", num_key_value_heads=kv_heads)
    source = get_loader("hf").open(tmp_path / "fp8", LoadOptions())
    made: list[tuple[int, ...]] = []
    real_dequantize = hf_quantized.dequantize_fp8

    def watched(*args: object, **kwargs: object) -> torch.Tensor:
        made.append(kwargs.get("out") is None)
        return real_dequantize(*args, **kwargs)

    for name in ("decoder.layers.1.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.linear_fc1.weight"):
        row, hf_names = source._rows[name]
        expected = row.transform.fuse([source._read(hf) for hf in hf_names], source.config)
        made.clear()
        monkeypatch.setattr(hf_quantized, "dequantize_fp8", watched)
        assert source._reads_whole_into(name)
        assert torch.equal(source.load(name).view(torch.int16), expected.view(torch.int16)), name
        monkeypatch.setattr(hf_quantized, "dequantize_fp8", real_dequantize)
        assert made and not any(made), (name, made)  # every part dequantized into its place


@pytest.mark.parametrize("threads", [1, 2])
def test_a_lending_left_open_is_never_taken_by_a_strip_read_from_the_file(tmp_path: Path, threads: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Strips read from the file (on this thread or a helper) are never made in the memory lent to the record
    being produced, even when a strip has the record's size: that memory may hold the record itself."""
    monkeypatch.setattr(reuse, "SMALLEST", 1)
    monkeypatch.setattr(threads_module, "SPREAD_THREADS", threads)
    monkeypatch.setattr(hf_quantized, "STRIP_ELEMENTS", 4 * 75)  # strips of 4 rows of 75 fp8 bytes
    block = (16, 32)
    weight, scale = quantize_fp8(torch.randn(70, 75, generator=torch.Generator().manual_seed(4)), block)
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    region = tensor_region(tmp_path / "model.safetensors", "w")
    out = torch.empty(70, 75, dtype=torch.bfloat16)
    with ReusedMemory().lending(4 * 75):  # a strip's bytes
        dequantize_fp8(region, scale, block, out=out)
        assert reuse._LENT.get() is not None  # not taken
    assert torch.equal(out, reference_dequantize(weight, scale, block))
