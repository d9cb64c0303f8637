"""Tiny HF checkpoints of every family, made from the family tables alone, and a bounded run.

``count_keys`` lists the config.json keys of a family that may hold a count or size
(``counted_keys`` those that count layers, experts and MTP layers), and
``write_family_checkpoint`` writes, for any family of ``pgconvert.families.ORDERED``, a config.json
and one safetensors file holding every tensor of a tiny model of that family: the smallest
settings below, the family's fixed values, and every optional part the family accepts (shared
experts, a dense first layer among MoE ones, a local RoPE base, a multi-token prediction layer).
A family added to the list gets a checkpoint here without a line of its own.

``bounded(call)`` runs ``call`` in this process and reports its time and the growth of the peak
resident memory; the address space is capped a little above that bound, so a count that drives
work ends in a MemoryError rather than filling the machine.
"""

from __future__ import annotations

import itertools
import json
import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.errors import ConfigError
from pgconvert.families.table import Family
from pgconvert.formats import SaveOptions
from pgconvert.formats.hf import family_mismatches, hf_config_from_model, model_config_from_hf
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.run.example import example_source

BASE: dict[str, object] = dict(num_layers=3, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=4,
                               ffn_hidden_size=24, vocab_size=40, params_dtype="float32", max_position_embeddings=64)
EXPERTS: dict[str, object] = dict(num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2)
LATENT_ATTENTION: dict[str, object] = dict(kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=4)
# Gated delta net layers (two of three) and their sizes, under the only spec megatron-core builds them with.
LINEAR_ATTENTION: dict[str, object] = dict(linear_attention_freq=3, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                                           transformer_impl="transformer_engine")
# A vision part (a two-block tower of each kind) and multimodal RoPE: only a vision-language family accepts one,
# the one of its tower.
VISIONS: tuple[dict[str, object], ...] = tuple(
    dict(vision_config=json.dumps(dict(model_type=tower, depth=2, hidden_size=8, intermediate_size=12, num_heads=2,
                                       out_hidden_size=16, patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                       in_channels=3, num_position_embeddings=4, deepstack_visual_indexes=[1]),
                                  sort_keys=True, separators=(",", ":")),
         vision_token_ids=json.dumps({"image_token_id": 36}), mrope_section=(1,), position_embedding_type="mrope")
    for tower in ("qwen2_5_vl_vision", "qwen3_vl_vision", "qwen3_vl_moe_vision")) + (
    # Pixtral with Mistral 3's projector, its top-level settings folded in, biases on; plain RoPE.
    dict(vision_config=json.dumps(dict(model_type="pixtral", num_hidden_layers=2, hidden_size=8, intermediate_size=12,
                                       num_attention_heads=2, patch_size=2, num_channels=3, spatial_merge_size=2,
                                       vision_feature_layer=-1, multimodal_projector_bias=True,
                                       projector_hidden_act="gelu"),
                                  sort_keys=True, separators=(",", ":")),
         vision_token_ids=json.dumps({"image_token_index": 36})),
    # SigLIP without its pooling head, with Gemma 3's projector; plain RoPE.
    dict(vision_config=json.dumps(dict(model_type="siglip_vision_model", num_hidden_layers=2, hidden_size=8,
                                       intermediate_size=12, num_attention_heads=2, image_size=4, patch_size=2,
                                       num_channels=3, vision_use_head=False),
                                  sort_keys=True, separators=(",", ":")),
         vision_token_ids=json.dumps({"mm_tokens_per_image": 4, "image_token_index": 36})),)
# Parts a family may accept, tried all together first; the routed-expert ones only with experts.
EXPERT_PARTS: tuple[dict[str, object], ...] = (dict(moe_shared_expert_intermediate_size=8),
                                               dict(moe_layer_freq=(0, 1, 1)))
# A hybrid layer pattern (Mamba, attention, MLP) with its Mamba sizes: only a hybrid family accepts it.
HYBRID: dict[str, object] = dict(hybrid_override_pattern="M*-", mamba_num_heads=4, mamba_head_dim=8,
                                 mamba_num_groups=2, mamba_state_dim=4)
# A sparse attention indexer beside multi-latent attention (its queries are the q latent): only DeepSeek-V3.2 accepts it.
SPARSE_ATTENTION: dict[str, object] = dict(q_lora_rank=6, dsa_indexer_n_heads=2, dsa_indexer_head_dim=4,
                                           dsa_indexer_topk=2)
PARTS: tuple[dict[str, object], ...] = (dict(rotary_base_local=1000.0), dict(mtp_num_layers=1), HYBRID,
                                        SPARSE_ATTENTION)
# One key and value head per query head: tried only for a family that refuses BASE's grouped ones (GPT-NeoX).
ONE_GROUP_PER_HEAD: dict[str, object] = dict(num_query_groups=4)
# A window on the first two layers and no RoPE on the third: tried only for a family that refuses BASE's RoPE on
# every layer without a window (Cohere2, which rotates only its windowed layers).
WINDOWED_NOPE: dict[str, object] = dict(sliding_window=4, window_layers=(1, 1, 0), no_rope_layers=(0, 0, 1))
# Experts and a shared expert as wide as the dense FFN: tried only for a family that refuses other widths (HunYuan).
FFN_WIDE_EXPERTS: dict[str, object] = dict(moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=24)
# With experts, a hybrid pattern with two MoE layers (E), routed as Nemotron-H's are (a sigmoid router
# with expert bias, a shared expert): a hybrid family with experts needs one.
EXPERT_PARTS += (dict(HYBRID, hybrid_override_pattern="MEE", moe_router_score_function="sigmoid",
                      moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=8),)


def count_keys(family: Family) -> list[str]:
    """Every config.json key a family reads that may hold a count or size: its integer fields (each
    spelling), its rules' keys and its MTP layer count."""
    keys = {".".join(where) for spec in family.fields if spec.kind is int for where in (spec.path, *spec.legacy)}
    keys |= {key for rule in family.rules for key in rule.keys}
    if family.hf_mtp_layers_key is not None:
        keys.add(family.hf_mtp_layers_key)
    return sorted(keys)


def counted_keys(family: Family) -> list[str]:
    """The config.json keys of a family that count layers, routed experts or MTP layers (each spelling)."""
    keys = {".".join(where) for spec in family.fields if spec.model_field in ("num_layers", "num_experts")
            for where in (spec.path, *spec.legacy)}
    return sorted(keys | ({family.hf_mtp_layers_key} if family.hf_mtp_layers_key is not None else set()))


def tiny_config(family: Family) -> ModelConfig:
    """The tiny model of ``family`` with the most optional parts it accepts."""
    settings = {**BASE, **family.fixed}
    parts = PARTS
    if "num_experts" not in family.fixed:
        # The family's fixed values win (Llama 4's top-1 routing).
        settings = {**BASE, **EXPERTS, **family.fixed}
        parts = EXPERT_PARTS + PARTS
    if settings.get("multi_latent_attention"):
        settings.update(LATENT_ATTENTION)
    if settings.get("experimental_attention_variant"):
        settings.update(LINEAR_ATTENTION)
    visions = VISIONS if "vision_config" not in family.fixed else ({},)
    for vision, heads, count in itertools.product(visions, ({}, ONE_GROUP_PER_HEAD, WINDOWED_NOPE, FFN_WIDE_EXPERTS),
                                                  range(len(parts), -1, -1)):
        for chosen in itertools.combinations(parts, count):
            try:
                config = ModelConfig.from_settings(
                    {**settings, **vision, **heads, **{k: v for part in chosen for k, v in part.items()}})
            except ConfigError:
                continue
            if not family_mismatches(family, config):
                return config
    raise AssertionError(f"{family.architecture}: no tiny model fits the family")


def write_family_checkpoint(family: Family, path: Path) -> Path:
    """config.json (built from the family table) and model.safetensors of the tiny model, seeded."""
    from pgconvert.savers.hf import HFSaver

    config = tiny_config(family)
    doc = hf_config_from_model(family, config, torch.float32)
    given = path.parent / f"{path.name}.config.json"
    given.write_text(json.dumps(doc))
    # The model config.json describes (its defaults filled in), with the MTP layers HF counts apart.
    described = model_config_from_hf(doc, given)[1].replace(mtp_num_layers=config.mtp_num_layers)
    source = example_source(described)
    options = SaveOptions(layout=ParallelLayout(), hf_config=given)
    path.mkdir(parents=True)
    HFSaver().validate(source, options)
    HFSaver().save(source, path, options, lambda nbytes: None)
    given.unlink()
    return path


# ----------------------------------------------------------------------------------- a bounded run

MEMORY_CAP = 2 << 30  # address space allowed beyond the current, so a runaway ends in a MemoryError


@dataclass
class Measured:
    """What ``bounded`` saw: the call's result or exception, seconds, peak resident growth in bytes."""

    result: Any
    error: BaseException | None
    seconds: float
    peak_growth: int


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


@contextmanager
def _peak_resident() -> Iterator[Callable[[], int]]:
    """The peak resident set size while the block runs: the kernel's high-water mark, reset first
    (``clear_refs`` 5), or where that is refused, the largest of samples every millisecond."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        yield lambda: _status("VmHWM")
        return
    except OSError:
        pass
    peak = [_status("VmRSS")]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], _status("VmRSS"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield lambda: max(peak[0], _status("VmRSS"))
    finally:
        done.set()
        sampler.join()


def bounded(call: Callable[[], Any]) -> Measured:
    """Run ``call`` with the address space capped MEMORY_CAP above its current size."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _status("VmSize") + MEMORY_CAP
    before = _status("VmRSS")
    started = time.perf_counter()
    result: Any = None
    error: BaseException | None = None
    with _peak_resident() as peak:
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
        try:
            result = call()
        except Exception as exc:  # MemoryError included: reported to the test
            error = exc
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        growth = peak() - before
    return Measured(result, error, time.perf_counter() - started, growth)
