"""Tiny DeepSeek-V3 and GLM-4.5-MoE checkpoints with one multi-token-prediction layer, as releases store it,
and Megatron-LM d98e8a64's spelling of that layer's per-rank keys.

transformers builds no MTP module, so a tiny source is a model built with one layer more whose last layer
becomes the MTP layer (HF layer index num_hidden_layers) beside its own enorm, hnorm, eh_proj,
shared_head.norm and the copies of the embedding and output layer a release stores.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from support.deepseek_helpers import CASES
from support.megatron_fixtures import load_for_test

import pgconvert

# The MTP layer's inner layer as megatron-core 0.16.1 and Megatron-LM d98e8a64 spell it in per-rank files.
OLD, NEW = ".transformer_layer.", ".mtp_model_layer."


LAYERS = 4


def build_with_extra_layer(family: str) -> Any:
    """The transformers model with LAYERS + 1 layers, every weight seeded."""
    if family == "glm":
        from support.glm4_moe_gpt_oss_helpers import build_glm4_moe

        return build_glm4_moe(num_hidden_layers=LAYERS + 1, n_routed_experts=8, n_group=2, topk_group=1)
    from support.deepseek_helpers import build_deepseek
    import support.deepseek_helpers as deepseek_helpers
    version, kwargs = CASES["v3"]
    deepseek_helpers.CASES["mtp"] = (version, dict(kwargs, num_hidden_layers=LAYERS + 1))
    try:
        return build_deepseek("mtp")
    finally:
        del deepseek_helpers.CASES["mtp"]


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def with_mtp(family: str, path: Path) -> Path:
    """An HF checkpoint of LAYERS layers plus one MTP layer (HF layer LAYERS), as releases store it."""
    model = build_with_extra_layer(family)
    model.save_pretrained(path)
    tensors = hf_tensors(path)
    for file in [*path.glob("*.safetensors"), *path.glob("*.index.json")]:
        file.unlink()
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(7)
    mtp = f"model.layers.{LAYERS}."
    tensors.update({
        mtp + "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
        mtp + "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
        mtp + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=generator),
        mtp + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
    })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    doc = json.loads((path / "config.json").read_text())
    doc.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(doc))
    return path


def rank_state(root: Path, name: str) -> dict[str, Any]:
    (path,) = root.glob(f"*/{name}/model_optim_rng.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def from_args_alone(megatron: Path, out: Path) -> Path:
    shutil.rmtree(megatron / "hf", ignore_errors=True)
    pgconvert.convert(megatron, out, dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)
    return out


def assert_same_tensors(src: Path, out: Path) -> None:
    before, after = hf_tensors(src), hf_tensors(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def rank_files(root: Path) -> list[Path]:
    return sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt")) or sorted(root.glob("release/mp_rank_*/*.pt"))


def model_keys(root: Path) -> set[str]:
    return {key for path in rank_files(root) for key in load_for_test(path)["model"]}


def respelled(root: Path, out: Path, both: bool = False) -> Path:
    """A copy of a per-rank checkpoint with the MTP layer's keys spelled as Megatron-LM d98e8a64 saves them
    (``both``: one key left in the old spelling, a broken file)."""
    shutil.copytree(root, out)
    for path in rank_files(out):
        state = load_for_test(path)
        model = state["model"]
        keys = [key for key in model if key.startswith("mtp.layers.") and OLD in key]
        state["model"] = {key.replace(OLD, NEW, 1) if key in keys[int(both):] else key: value
                          for key, value in model.items()}
        torch.save(state, path)
    return out
