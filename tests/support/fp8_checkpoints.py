"""FP8 block-scaled checkpoints as DeepSeek-V3 stores them: tiny HF models whose linear weights are quantized."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from support.hf_helpers import build_hf_model, edit_json, rewrite_as_single_file, save_hf_model

QUANTIZED = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
             ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8_e4m3fn weight and its float32 block scales (amax / 448 per block), as DeepSeek stores them."""
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]), dtype=torch.float32)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            quantized[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                tile / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale



def fp8_checkpoint(path: Path, block: tuple[int, int] = (32, 48), name: str = "llama",
                   **overrides: object) -> dict[str, torch.Tensor]:
    """A tiny bf16 model (its config's ``overrides`` given) whose linear weights are stored FP8 block-scaled;
    returns the stored tensors."""
    save_hf_model(build_hf_model(name, **overrides).to(torch.bfloat16), path)
    stored: dict[str, torch.Tensor] = {}

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        for key in sorted(tensors):
            if key.endswith(QUANTIZED):
                tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(tensors[key], block)
        stored.update(tensors)

    rewrite_as_single_file(path, quantize)
    edit_json(path / "config.json", lambda doc: doc.update(quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}))
    return stored
