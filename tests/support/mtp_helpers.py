"""Test-only helpers: a tiny HF DeepSeek-V3 or GLM-4.5-MoE checkpoint with one multi-token-prediction layer.

transformers builds no MTP module, so the source is a model built with one layer more whose last layer
becomes the MTP layer (HF layer index num_hidden_layers) beside its own enorm, hnorm, eh_proj,
shared_head.norm and the copies of the embedding and output layer a release stores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from support.deepseek_helpers import CASES

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
