"""The tiny Qwen3-Next model (``Qwen3NextForCausalLM``) several tests convert.

It keeps the released configuration's structural and semantic fields (Qwen/Qwen3-Next-80B-A3B-Instruct:
``full_attention_interval`` 4, so three gated delta net layers to one gated-attention layer; a MoE block in
every layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``) with a shared expert behind its sigmoid gate;
``norm_topk_prob`` true; value heads twice the key heads in the linear layers; eight query heads per key-value
head; partial rotary 0.25 at ``rope_theta`` 1e7; RMSNorm at 1e-6; untied output; no biases), with every size
shrunk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from support.family_helpers import save_with_side_files, seeded_model
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

TINY = dict(
    vocab_size=131, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=2, head_dim=8, full_attention_interval=4, linear_conv_kernel_dim=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    decoder_sparse_step=1, mlp_only_layers=[], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False, router_aux_loss_coef=0.001,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def gated_delta_net_value(name: str, noise: torch.Tensor) -> torch.Tensor:
    """The gated delta nets' output norms near one (stored as HF computes with them; megatron-core's are
    zero-centred, w - 1, exact in [0.5, 2]); every other norm (1 + w) and the time-step bias and decay near
    their initial values."""
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith("norm.weight"):
        return 0.1 * noise
    if name.endswith(("dt_bias", "A_log")):
        return 1.0 + 0.2 * noise
    return 0.1 * noise


def write_tiny_qwen3_next(directory: Path, **changes: object) -> Path:
    """The tiny model's HF checkpoint (seeded values, side files) in ``directory``, with ``changes`` to its config."""
    model, _ = seeded_model(Qwen3NextForCausalLM, Qwen3NextConfig(**{**TINY, **changes}), seed=11, value=gated_delta_net_value)
    return save_with_side_files(model, directory)


# The released checkpoints' MTP module (Qwen/Qwen3-Next-80B-A3B-Instruct's model.safetensors.index.json): its own
# tensors beside the layer ``mtp.layers.0.*``, a gated-attention decoder layer with the model's MoE block.
MTP_OWN = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def write_tiny_qwen3_next_with_mtp(directory: Path) -> tuple[Path, Path]:
    """The tiny model as the releases store it, with ``mtp_num_hidden_layers`` 1 (``directory / "hf"``), and the
    same model with its MTP layer as decoder layer ``num_hidden_layers`` (``directory / "mtp-as-layer"``)."""
    return write_with_mtp_module(Qwen3NextForCausalLM, Qwen3NextConfig, TINY, 11, directory)


def write_with_mtp_module(model_class: Any, config_class: Any, config: dict[str, Any], seed: int,
                          directory: Path) -> tuple[Path, Path]:
    """A Qwen3-Next-style model of ``config`` (a gated-attention layer every fourth) as the releases store it, with
    ``mtp_num_hidden_layers`` 1 (``directory / "hf"``), and the same model with its MTP layer as decoder layer
    ``num_hidden_layers`` (``directory / "mtp-as-layer"``), which transformers builds and runs (it builds no MTP
    module and skips ``mtp.*``)."""
    from safetensors.torch import load_file, save_file

    layers = int(config["num_hidden_layers"])
    kinds = ["linear_attention" if (layer + 1) % 4 else "full_attention" for layer in range(layers)] + ["full_attention"]
    model, generator = seeded_model(model_class, config_class(**{**config, "num_hidden_layers": layers + 1,
                                                                 "layer_types": kinds}),
                                    seed=seed, value=gated_delta_net_value)
    as_layer = save_with_side_files(model, directory / "mtp-as-layer")
    prefix = f"model.layers.{layers}."
    tensors = {("mtp.layers.0." + name.removeprefix(prefix) if name.startswith(prefix) else name): tensor
               for path in sorted(as_layer.glob("*.safetensors")) for name, tensor in load_file(path).items()}
    hidden = int(config["hidden_size"])
    for name in MTP_OWN:
        shape = (hidden, 2 * hidden) if name == "mtp.fc.weight" else (hidden,)
        tensors[name] = 0.1 * torch.randn(shape, generator=generator)
    source = directory / "hf"
    shutil.copytree(as_layer, source, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    doc = json.loads((source / "config.json").read_text())
    doc.update(num_hidden_layers=layers, layer_types=kinds[:layers], mtp_num_hidden_layers=1,
               mtp_use_dedicated_embeddings=False)
    (source / "config.json").write_text(json.dumps(doc, indent=2))
    return source, as_layer
