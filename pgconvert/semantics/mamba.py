"""What megatron-core's Mamba mixer computes differently from a hybrid model's HF definition.

megatron-core 0.16.1's ``MambaMixer`` builds its gated norm (``RMSNormGated``) with epsilon 1e-5
whatever ``TransformerConfig.layernorm_epsilon`` is; transformers' Nemotron-H uses
``layer_norm_epsilon`` for it as for every other norm. (Its time-step clamp is a carried setting:
``pgconvert.semantics.carried``.)
"""

from __future__ import annotations

from pgconvert.model.config import ModelConfig
from pgconvert.model.layers import HYBRID_LAYER_KINDS, MAMBA

# The epsilon of megatron-core's MambaMixer gated norm (ssm/mamba_mixer.py: RMSNormGated(eps=1e-5)).
GATED_NORM_EPSILON = 1e-5


def megatron_core_gaps(config: ModelConfig) -> list[str]:
    """What a Megatron run of a hybrid model computes differently (each: a notice, refused under --strict)."""
    pattern = config.hybrid_override_pattern or ""
    has_mamba = any(HYBRID_LAYER_KINDS[symbol][0] == MAMBA for symbol in set(pattern))
    if not has_mamba or config.norms.norm_epsilon == GATED_NORM_EPSILON:
        return []
    return [f"norm_epsilon={config.norms.norm_epsilon} in the Mamba layers' gated norm: megatron-core's MambaMixer "
            f"fixes it at {GATED_NORM_EPSILON} (its other norms use norm_epsilon); the args and pgconvert.json carry it"]
