"""A DeepSeek-V3-shaped synthetic HF checkpoint stored as DeepSeek-V3 ships it: FP8 block-scaled.

Multi-latent attention with q-LoRA, layer 0 dense (``first_k_dense_replace=1``), then MoE layers with
routed and shared experts and sigmoid routing with ``e_score_correction_bias``; every linear weight
except the embeddings, the output layer and the routers is ``float8_e4m3fn`` with a float32
``weight_scale_inv`` per 128 x 128 block. The names and shapes come from transformers'
``DeepseekV3ForCausalLM`` built on the meta device; the tensors are made and written one layer
(one shard) at a time, so generating it keeps memory bounded by a layer, not the model.

    python benchmarks/deepseek_fp8.py OUT_DIR [--scale S]   # scale 1: about 1.1 B parameters (2.1 GB bf16)

``--scale`` sizes it as ``bench_convert.py --scale`` sizes its Llama model: widths by the square root of
the scale (multiples of the block, at least one), routed experts by the scale (at least 8).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

FP8_BLOCK = (128, 128)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
LOG = logging.getLogger(__name__)


def _width(scale_one: int, factor: float, step: int) -> int:
    """``scale_one`` times ``factor``, a multiple of ``step``, at least ``step``."""
    return max(step, round(scale_one * factor / step) * step)


def deepseek_config(scale: float = 1.0) -> dict[str, Any]:
    """DeepSeek-V3's structure at about 1.1 B parameters (scale 1): 9 layers, 16 routed experts, hidden
    2048; other scales change the widths by ``sqrt(scale)`` and the routed experts by ``scale``."""
    factor = math.sqrt(scale)
    experts = max(8, round(16 * scale / 4) * 4)  # 4 groups, 4 EP ranks, 2 experts a group at least
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=32000,
        hidden_size=_width(2048, factor, 128), intermediate_size=_width(5632, factor, 128),
        moe_intermediate_size=_width(1024, factor, 128), num_hidden_layers=9, num_attention_heads=16,
        num_key_value_heads=16, n_shared_experts=1, n_routed_experts=experts, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=_width(768, factor, 128), kv_lora_rank=_width(512, factor, 64),
        qk_rope_head_dim=_width(64, factor, 16), qk_nope_head_dim=_width(128, factor, 16),
        v_head_dim=_width(128, factor, 16),
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK),
                             "activation_scheme": "dynamic"},
    )


def meta_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF tensor name of the model -> (shape, stored dtype before quantization), from transformers."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = {key: value for key, value in config.items()
              if key not in ("architectures", "model_type", "quantization_config", "torch_dtype")}
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs))
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            shapes.update(_per_expert(name, config))  # stacked in memory; released checkpoints store each expert
        elif name.endswith("e_score_correction_bias"):
            shapes[name] = (tuple(tensor.shape), torch.float32)
        else:
            shapes[name] = (tuple(tensor.shape), torch.bfloat16)
    return shapes


def _per_expert(stacked: str, config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``mlp.experts.{e}.{gate,up,down}_proj.weight`` as the released DeepSeek-V3 shards name them."""
    prefix = stacked.rsplit(".", 1)[0]
    hidden, ffn = config["hidden_size"], config["moe_intermediate_size"]
    parts = (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden))) if stacked.endswith("gate_up_proj") else (
        ("down_proj", (hidden, ffn)),)
    return {f"{prefix}.{expert}.{part}.weight": (shape, torch.bfloat16)
            for expert in range(config["n_routed_experts"]) for part, shape in parts}


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """DeepSeek-V3's FP8 set: 2-d linear weights, not embeddings, the output layer or the router."""
    return len(shape) == 2 and name.endswith(".weight") and not name.endswith(
        ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with one float32 scale (amax / 448) per block, as DeepSeek-V3 stores weights."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    fp8 = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)[:rows, :cols]
    return fp8.contiguous(), scale


def make_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    scale = 0.1 if name.endswith("e_score_correction_bias") else 0.02
    return torch.randn(shape, generator=generator, dtype=dtype).mul_(scale)  # no float32 copy of the embedding


def shard_of(name: str) -> str:
    """One shard a layer, and one for each tensor outside the layers (the two vocab tables are the largest)."""
    match = _LAYER.match(name)
    return f"layer{int(match.group(1)):03d}" if match else name


def write_shard(out: Path, file_name: str, names: list[str],
                shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], seeds: dict[str, int]) -> list[str]:
    """One shard, made and written alone; the names it holds."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        shape, dtype = shapes[name]
        tensor = make_tensor(name, shape, dtype, seeds[name])
        if quantized(name, shape):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensor, FP8_BLOCK)
        else:
            tensors[name] = tensor
        del tensor
    save_file(tensors, str(out / file_name), metadata={"format": "pt"})
    return list(tensors)


def generate(out: Path, scale: float = 1.0) -> int:
    """Write the checkpoint to ``out``; the dequantized (bf16) byte count."""
    config = deepseek_config(scale)
    shapes = meta_shapes(config)
    seeds = {name: index for index, name in enumerate(shapes)}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        groups.setdefault(shard_of(name), []).append(name)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for index, (group, names) in enumerate(sorted(groups.items())):
        file_name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        weight_map.update(dict.fromkeys(write_shard(out, file_name, names, shapes, seeds), file_name))
        LOG.info("wrote %s (%s)", file_name, group)
    bf16_bytes = sum(math.prod(shape) * 2 for shape, _ in shapes.values())
    index_doc = {"metadata": {"total_size": bf16_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return bf16_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="size relative to scale 1 (about 1.1 B parameters)")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bf16_bytes = generate(options.out, options.scale)
    LOG.info("%s: %.2f GB dequantized (bf16)", options.out, bf16_bytes / 1e9)


if __name__ == "__main__":
    main()
