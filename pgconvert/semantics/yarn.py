"""YaRN RoPE: config.json's ``rope_parameters`` of type ``yarn`` <-> ``ModelConfig`` <-> Megatron args.

transformers (``modeling_rope_utils._compute_yarn_parameters``) and megatron-core
(``YarnRotaryEmbedding``) compute the same inverse frequencies from the factor, the original context,
``beta_fast``/``beta_slow`` and the rounding of the correction range (HF ``truncate``, megatron-core
``correction_range_round_to_int``). They differ only in how the cos/sin attention factor follows from
``mscale``/``mscale_all_dim``:

* transformers: ``get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)`` when both are non-zero,
  else ``get_mscale(f)``; an explicit ``attention_factor`` overrides both;
* megatron-core (``_yarn_get_concentration_factor``): always the ratio.

So an HF model whose two values are not both non-zero reads as ``mscale=1, mscale_all_dim=0`` (the
ratio is then ``get_mscale(f)``); a model written to HF gets ``attention_factor`` where transformers'
inference would differ. DeepSeek's MLA softmax scale uses ``mscale_all_dim`` alone on both sides.

Megatron-LM's argument names: a plain-attention model is ``--position-embedding-type yarn`` with
``--rotary-scaling-factor``, ``--yarn-original-max-position-embeddings``, ``--yarn-beta-fast``,
``--yarn-beta-slow``, ``--mscale``, ``--mscale-all-dim``, ``--[no-]yarn-correction-range-round-to-int``
(``argument_utils._apply_yarn_config_from_args`` copies them to ``config.yarn_*``). Multi-latent
attention reads ``rope_type`` (default ``yarn``), ``rotary_scaling_factor``, ``mscale``,
``mscale_all_dim`` and ``MLATransformerConfig``'s own ``original_max_position_embeddings``,
``beta_fast``, ``beta_slow`` (taken from args of the same name when present).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote

YARN_FIELDS: tuple[str, ...] = (
    "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
    "yarn_mscale_all_dim", "yarn_correction_range_round_to_int",
)
# The ModelConfig defaults: a model without YaRN carries these.
YARN_DEFAULTS: dict[str, Any] = {
    "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": True,
}
# Relative tolerance within which two attention factors are the same value (float rounding).
_SAME = 1e-12


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``), as both libraries write it."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def megatron_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """megatron-core's cos/sin factor for the given values."""
    return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)


def hf_inferred_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """transformers' cos/sin factor when ``attention_factor`` is not given."""
    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def _number(params: Mapping[str, object], key: str, default: float, positive: bool = False) -> float:
    value = params.get(key)
    if value is None:
        return default
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or (positive and value <= 0)):
        raise ValueError(f"rope_parameters.{key}={quote(value)}: expected a {'positive ' if positive else ''}number")
    return float(value)


def _factor(params: Mapping[str, object], model: Mapping[str, object], original: int) -> float:
    """``factor``; transformers takes max_position_embeddings / original when it is null."""
    if params.get("factor") is None:
        longest = model.get("max_position_embeddings")
        if not isinstance(longest, int):
            raise ValueError("rope_parameters.factor: missing, and no max_position_embeddings to derive it from")
        return longest / original
    return _number(params, "factor", 1.0, positive=True)


def read_hf(params: Mapping[str, object], model: Mapping[str, object]) -> dict[str, Any]:
    """The ``ModelConfig`` values of a ``rope_type: yarn`` parameter set (``ValueError`` names a bad key)."""
    original = params.get("original_max_position_embeddings", model.get("max_position_embeddings"))
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ValueError(f"rope_parameters.original_max_position_embeddings={quote(original)}: expected a "
                         "positive integer")
    factor = _factor(params, model, original)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"rope_parameters.truncate={quote(truncate)}: expected true or false")
    mscale = _number(params, "mscale", 0.0)
    mscale_all_dim = _number(params, "mscale_all_dim", 0.0)
    if not (mscale and mscale_all_dim):
        # transformers then uses get_mscale(factor) for cos/sin; megatron-core's ratio with (1, 0) is
        # the same, and DeepSeek's softmax scale reads mscale_all_dim only.
        mscale = 1.0
    return {
        "rope_scaling": "yarn", "rope_scaling_factor": factor,
        "yarn_original_max_position_embeddings": original,
        # transformers: `get("beta_fast") or 32`, so a 0 means the default too.
        "yarn_beta_fast": _number(params, "beta_fast", 0.0) or 32.0,
        "yarn_beta_slow": _number(params, "beta_slow", 0.0) or 1.0,
        "yarn_mscale": mscale, "yarn_mscale_all_dim": mscale_all_dim,
        "yarn_correction_range_round_to_int": truncate,
    }


def write_hf(config: ModelConfig) -> dict[str, Any]:
    """config.json's yarn parameters (but ``rope_type``/``rope_theta``) for ``config``."""
    positions = config.positions
    factor = positions.rope_scaling_factor
    params: dict[str, Any] = {
        "factor": factor,
        "original_max_position_embeddings": positions.yarn_original_max_position_embeddings,
        "beta_fast": positions.yarn_beta_fast,
        "beta_slow": positions.yarn_beta_slow,
        "mscale": positions.yarn_mscale,
        "mscale_all_dim": positions.yarn_mscale_all_dim,
    }
    wanted = megatron_attention_factor(factor, positions.yarn_mscale, positions.yarn_mscale_all_dim)
    inferred = hf_inferred_attention_factor(factor, positions.yarn_mscale, positions.yarn_mscale_all_dim)
    if not math.isclose(wanted, inferred, rel_tol=_SAME):
        params["attention_factor"] = wanted
    if not positions.yarn_correction_range_round_to_int:
        params["truncate"] = False
    return params


def hf_unrepresentable(params: Mapping[str, object], doc: Mapping[str, object], path: Path) -> list[str]:
    """A yarn ``attention_factor`` that megatron-core's mscale ratio cannot give."""
    given = params.get("attention_factor")
    if given is None:
        return []
    try:
        values = read_hf(params, doc)
    except ValueError:
        return []  # the family's rule names the bad value
    computed = megatron_attention_factor(values["rope_scaling_factor"], values["yarn_mscale"],
                                         values["yarn_mscale_all_dim"])
    if isinstance(given, (int, float)) and math.isclose(float(given), computed, rel_tol=_SAME):
        return []
    return [f"{path}: rope_parameters.attention_factor={quote(given)}: megatron-core computes the YaRN attention "
            f"factor from mscale/mscale_all_dim ({computed}); a megatron target computes that instead"]


def _arg(args: argparse.Namespace, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def _arg_number(args: argparse.Namespace, name: str, default: float, path: Path) -> float:
    value = _arg(args, name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a finite number")
    return float(value)


def uses_yarn(args: argparse.Namespace) -> bool:
    """Whether a Megatron run computes YaRN: ``--position-embedding-type yarn``, or multi-latent
    attention with ``rope_type`` yarn (MLATransformerConfig's default)."""
    if getattr(args, "position_embedding_type", None) == "yarn":
        return True
    return bool(getattr(args, "multi_latent_attention", False)) and _arg(args, "rope_type", "yarn") == "yarn"


def from_args(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The YaRN values of a run's args that ``uses_yarn``, with Megatron-LM's defaults."""
    mla = bool(getattr(args, "multi_latent_attention", False)) and getattr(args, "position_embedding_type", None) != "yarn"
    prefix = "" if mla else "yarn_"
    original = _arg(args, f"{prefix}original_max_position_embeddings", 4096)
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise CheckpointError(f"{path}: args.{prefix}original_max_position_embeddings={quote(original)}: "
                              "must be a positive integer")
    rounding = True if mla else _arg(args, "yarn_correction_range_round_to_int", True)
    if not isinstance(rounding, bool):
        raise CheckpointError(f"{path}: args.yarn_correction_range_round_to_int={quote(rounding)}: expected True "
                              "or False")
    return {
        "rope_scaling": "yarn",
        "rope_scaling_factor": _arg_number(args, "rotary_scaling_factor", 1.0, path),
        "yarn_original_max_position_embeddings": original,
        "yarn_beta_fast": _arg_number(args, f"{prefix}beta_fast", 32.0, path),
        "yarn_beta_slow": _arg_number(args, f"{prefix}beta_slow", 1.0, path),
        "yarn_mscale": _arg_number(args, "mscale", 1.0, path),
        "yarn_mscale_all_dim": _arg_number(args, "mscale_all_dim", 0.0, path),
        "yarn_correction_range_round_to_int": rounding,
    }


def to_args(config: ModelConfig) -> dict[str, Any]:
    """The YaRN args of ``config`` in both spellings (plain attention's ``yarn_*``, MLA's own); a model
    without YaRN gets Megatron-LM's argument defaults."""
    yarn = config.positions.rope_scaling == "yarn"
    values = config.to_dict() if yarn else dict(YARN_DEFAULTS)
    return {
        "rotary_scaling_factor": config.positions.rope_scaling_factor if yarn else 1.0,
        "mscale": values["yarn_mscale"],
        "mscale_all_dim": values["yarn_mscale_all_dim"],
        "yarn_original_max_position_embeddings": values["yarn_original_max_position_embeddings"],
        "yarn_beta_fast": values["yarn_beta_fast"],
        "yarn_beta_slow": values["yarn_beta_slow"],
        "yarn_correction_range_round_to_int": values["yarn_correction_range_round_to_int"],
        "original_max_position_embeddings": values["yarn_original_max_position_embeddings"],
        "beta_fast": values["yarn_beta_fast"],
        "beta_slow": values["yarn_beta_slow"],
    }
