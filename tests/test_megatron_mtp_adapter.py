"""A Megatron-Bridge LoRA adapter that adapts a model's MTP layer too: merged by ``--merge-adapter``; its export to
PEFT refused by name (transformers builds no MTP module, so PEFT would drop those pairs).

The adapter is made by megatron-core 0.16.1 as Megatron-Bridge makes one (``support/mcore_bridge_lora.py`` names the
source lines): a tiny DeepSeek-V3 with one MTP layer (``support/mtp_models.py``) converted to a TP1 Megatron
checkpoint, loaded into megatron-core's GPTModel with its MTP block (``support/mcore_mtp_model.py``, which runs at TP1
only), every ``linear_proj``/``linear_fc1``/``linear_fc2`` wrapped, the decoder's and the MTP layer's alike (dense,
routed and shared experts), the adapter-only state saved with ``dist_checkpointing.save``: the MTP layer's pairs under
``mtp.layers.0.transformer_layer.<module>.adapter``. transformers does not run the MTP layer, so the check is on the
merged weights: the reference merges each held pair into the rank file on the Megatron side (Megatron-Bridge's
``LoRAMerge`` at TP1, ``W + alpha / dim · linear_out @ linear_in``) and converts that checkpoint to HF.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch

import pgconvert
from support.hf_helpers import load_hf_tensors

pytest.importorskip("peft")

DIM, ALPHA = 4, 6


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from support.mcore_bridge_lora import bridge_lora_checkpoint
    from support.mtp_models import with_mtp

    root = tmp_path_factory.mktemp("bridge_mtp_lora")
    hf = with_mtp("deepseek", root / "hf")
    pgconvert.convert(hf, root / "megatron", dst_format="megatron", dst_tp=1)
    lora = bridge_lora_checkpoint(root / "megatron", root / "lora", root / "held", DIM, ALPHA)
    return {"hf": hf, "megatron": root / "megatron", "lora": lora, "held": root / "held"}


def megatron_side_merge(paths: dict[str, Path], out: Path) -> Path:
    """The TP1 checkpoint with every held pair merged into its rank file's weight, in float64 rounded once."""
    megatron = Path(shutil.copytree(paths["megatron"], out))
    (rank_path,) = megatron.glob("*/mp_rank_00/model_optim_rng.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(rank_path, map_location="cpu", weights_only=True)
    held = torch.load(paths["held"] / "rank0.pt", weights_only=True)
    for module, sides in held.items():
        weight = state["model"][f"{module}.weight"]
        delta = (ALPHA / DIM) * (sides["linear_out"].double() @ sides["linear_in"].double())
        state["model"][f"{module}.weight"] = (weight.double() + delta).to(weight.dtype)
    torch.save(state, rank_path)
    return megatron


def test_mtp_layer_adapter_merges_as_on_the_megatron_side(bridge: dict[str, Path], tmp_path: Path) -> None:
    held = torch.load(bridge["held"] / "rank0.pt", weights_only=True)
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2" in held
    pgconvert.convert(bridge["hf"], tmp_path / "merged", dst_format="hf", merge_adapter=bridge["lora"])
    pgconvert.convert(megatron_side_merge(bridge, tmp_path / "reference_megatron"), tmp_path / "reference",
                      dst_format="hf")
    base, merged, reference = (load_hf_tensors(path) for path in (bridge["hf"], tmp_path / "merged",
                                                                    tmp_path / "reference"))
    assert sorted(merged) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(merged[name], reference[name], rtol=1e-6, atol=1e-6, msg=name)
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    # the MTP layer (HF layer 4): its attention output, shared expert and 8 routed experts, 2 linears each (gate and
    # up apart: 3 HF weights per MLP)
    assert len({name for name in changed if name.startswith("model.layers.4.")}) == 1 + 3 + 8 * 3
    # The same merge into a Megatron checkpoint, checked by verify --merge-adapter.
    pgconvert.convert(bridge["megatron"], tmp_path / "merged_megatron", dst_format="megatron",
                      merge_adapter=bridge["lora"])
    report = pgconvert.verify(bridge["megatron"], tmp_path / "merged_megatron", merge_adapter=bridge["lora"])
    assert report.equal and report.compared > 0, report.to_dict()


def test_mtp_layer_pairs_are_refused_on_export_to_peft(bridge: dict[str, Path], tmp_path: Path) -> None:
    from support.mcore_bridge_lora import assert_export_refused

    assert_export_refused(bridge["lora"], bridge["hf"], tmp_path / "out",
                          "adapts the MTP layers (mtp.layers.0.transformer_layer.",
                          "which transformers does not load, so PEFT would leave their pairs out")
