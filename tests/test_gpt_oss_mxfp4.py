"""GPT-OSS with its expert weights stored as the released checkpoints store them: MXFP4
``*_blocks`` (uint8, two e2m1 values a byte) and ``*_scales`` (E8M0 exponents).

The tiny model's expert weights are replaced by seeded MXFP4 parts; the reference is transformers'
own ``convert_moe_packed_tensors``. HF -> Megatron TP2/EP2 -> HF comes back dequantized and equal to
it; ``--keep-fp8`` on HF -> HF writes the blocks and scales byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli_helpers import run_cli
from support.hf_helpers import edit_json, load_hf_tensors, rewrite_as_single_file
from support.glm4_moe_gpt_oss_helpers import save_gpt_oss

import pgconvert

PACKED = ("gate_up_proj", "down_proj")


def _mxfp4(shape: torch.Size, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded parts for a weight [E, in, out]: blocks [E, out, in / 32, 16], scales [E, out, in / 32]."""
    experts, inputs, outputs = shape
    blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(122, 128, (experts, outputs, inputs // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "src", seed=5)
    generator = torch.Generator().manual_seed(7)

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        for name in sorted(tensors):
            if name.endswith(tuple(f"mlp.experts.{part}" for part in PACKED)):
                tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4(tensors.pop(name).shape, generator)

    rewrite_as_single_file(path, quantize)
    edit_json(path / "config.json", lambda doc: doc.update(quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}))
    return path


def test_mxfp4_gpt_oss_through_megatron_tp2_ep2_equals_transformers_dequantization(source: Path,
                                                                                  tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    pgconvert.convert(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf")

    stored, written = load_hf_tensors(source), load_hf_tensors(tmp_path / "hf")
    packed = sorted(name.removesuffix("_blocks") for name in stored if name.endswith("_blocks"))
    assert len(packed) == 2 * json.loads((source / "config.json").read_text())["num_hidden_layers"]
    for name in packed:
        expected = convert_moe_packed_tensors(stored[name + "_blocks"].clone(), stored[name + "_scales"].clone(),
                                              dtype=torch.bfloat16)
        assert written[name].dtype == torch.bfloat16, name
        assert torch.equal(written[name], expected), name
    plain = {name for name in stored if not name.endswith(("_blocks", "_scales"))}
    assert set(written) == plain | set(packed)
    for name in plain:
        assert torch.equal(written[name], stored[name]), name
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_keep_fp8_keeps_the_mxfp4_blocks_and_scales_byte_for_byte(source: Path, tmp_path: Path) -> None:
    result = run_cli("convert", source, tmp_path / "dst", "--keep-fp8", "--max-shard-size", "100KB")

    assert result.exit_code == 0, result.output
    stored, written = load_hf_tensors(source), load_hf_tensors(tmp_path / "dst")
    assert len(list((tmp_path / "dst").glob("model-*.safetensors"))) > 1
    assert sorted(written) == sorted(stored)
    for name, tensor in stored.items():
        assert written[name].dtype == tensor.dtype, name
        assert torch.equal(written[name], tensor), name
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((source / "config.json").read_text())["quantization_config"]
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    assert all(index["weight_map"][name.replace("_blocks", "_scales")] == index["weight_map"][name]
               for name in stored if name.endswith("_blocks"))
