"""RoPE: config.json's rope parameters, and the Megatron args of RoPE scaling and NoPE layers.

Megatron-LM spells the scaling ``--use-rope-scaling`` (llama3, with ``--rope-scaling-factor``),
``--rotary-seq-len-interpolation-factor`` (linear) or YaRN (``pgconvert.semantics.yarn``), and the
layers without RoPE megatron-core's ``no_rope_freq`` (``Attention.forward``: 1 = the layer skips
RoPE), which Megatron-LM's ``--no-rope-freq`` sets.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.semantics import yarn
from pgconvert.semantics.arg_values import flag, number

# megatron-core's llama3 RoPE scaling (RotaryEmbedding._apply_scaling) fixes these three.
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Megatron-LM's default --rope-scaling-factor.
MEGATRON_DEFAULT_ROPE_SCALING_FACTOR = 8.0


def scaling_from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The RoPE scaling of a run's args: YaRN, llama3, linear or none."""
    if yarn.uses_yarn(args):
        return yarn.from_args(args, path)
    llama3 = flag(args, "use_rope_scaling", path)
    interpolation = getattr(args, "rotary_seq_len_interpolation_factor", None)
    if interpolation is not None:
        interpolation = number(args, "rotary_seq_len_interpolation_factor", 1.0, path)
    if llama3 and interpolation not in (None, 1.0):
        raise CheckpointError(f"{path}: args.use_rope_scaling and args.rotary_seq_len_interpolation_factor="
                              f"{quote(interpolation)} together: no HF RoPE type computes both")
    if llama3:
        return {"rope_scaling": "llama3",
                "rope_scaling_factor": number(args, "rope_scaling_factor", MEGATRON_DEFAULT_ROPE_SCALING_FACTOR, path)}
    if interpolation not in (None, 1.0):
        return {"rope_scaling": "linear", "rope_scaling_factor": interpolation}
    return {"rope_scaling": None, "rope_scaling_factor": 1.0}


def no_rope_from_args(args: argparse.Namespace, path: Path) -> tuple[int, ...] | None:
    """megatron-core's ``no_rope_freq`` as a 0/1 per layer (1: no RoPE), None when every layer has RoPE."""
    value = getattr(args, "no_rope_freq", None)
    layers = getattr(args, "num_layers", None)
    if value is None or value == 0 or not isinstance(layers, int):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        # megatron-core: every value-th layer (1-based) skips RoPE.
        pattern = tuple(int((layer + 1) % value == 0) for layer in range(layers))
    elif isinstance(value, (list, tuple)) and all(v in (0, 1) and not isinstance(v, bool) for v in value):
        pattern = tuple(int(v) for v in value)
    else:
        raise CheckpointError(f"{path}: args.no_rope_freq={quote(value)}: expected an int or a 0/1 list")
    return pattern if any(pattern) else None


def rope_parameters(doc: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's RoPE parameters: transformers 5's ``rope_parameters`` or 4.x's ``rope_scaling``
    (which transformers 5 prefers when both are there and it is not empty:
    ``convert_rope_params_to_dict`` takes ``rope_scaling or rope_parameters``)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = doc.get(key)
        if isinstance(value, dict):
            if value or key == "rope_parameters":
                return value
        elif value is not None:
            raise ValueError(f"{key}={quote(value)}: expected an object")
    return {}


def rope_type_of(params: Mapping[str, Any]) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    return rope_type if isinstance(rope_type, str) else quote(rope_type)


def hf_unrepresentable(doc: Mapping[str, Any], path: Path, carried_types: tuple[str, ...] = ()) -> list[str]:
    """config.json RoPE settings that no Megatron argument holds (the model then computes
    differently); ``carried_types``: the RoPE types the family carries whole (``hf_rope_parameters``)."""
    try:
        params = rope_parameters(doc)
    except ValueError:
        return []  # the family's rule names the bad value
    rope_type = rope_type_of(params)
    if rope_type in ("default", "linear") or rope_type in carried_types:
        return []
    if rope_type == "yarn":
        return yarn.hf_unrepresentable(params, doc, path)
    if rope_type == "llama3":
        odd = {key: params.get(key) for key, expected in MEGATRON_LLAMA3.items() if params.get(key) != expected}
        if not odd:
            return []
        detail = ", ".join(f"{key}={quote(value)}" for key, value in odd.items())
        return [f"{path}: rope_type='llama3' with {detail}: megatron-core's llama3 scaling fixes "
                f"{', '.join(f'{k}={v}' for k, v in MEGATRON_LLAMA3.items())}; a megatron target computes "
                "those instead"]
    return [f"{path}: rope_type={quote(rope_type)} (RoPE scaling) has no Megatron setting pgconvert writes: a "
            "megatron target computes plain RoPE"]
