"""What a change of layer spec does to a multi-latent-attention run's weight decay.

megatron-core's ``apply_wd_to_qk_layernorm`` keeps weight decay on parameters whose name contains
``q_layernorm.`` or ``k_layernorm.`` (``get_standard_config_overrides``, 0.16.1 and 0.20.0). With MLA's
q-LoRA the local spec names the latent q norm ``self_attention.q_layernorm.weight`` (decayed), the
Transformer Engine spec fuses it into ``linear_q_up_proj.layer_norm_weight`` (not decayed); ``kv_layernorm``
is never decayed. A conversion between the specs carries the state exactly into the group megatron-core
gives the target, so training continues with the target spec's rule: said in a notice.
"""

from __future__ import annotations

from pgconvert.model.config import ModelConfig
from pgconvert.optimizer.order import OptimizerRules


def qk_norm_decay_notice(rules: OptimizerRules, source: ModelConfig, target: ModelConfig) -> list[str]:
    """A notice when the q-LoRA norm moves between the weight-decay groups (see the module docstring)."""
    attention = source.attention
    if not (rules.apply_wd_to_qk_layernorm and attention.multi_latent_attention and attention.q_lora_rank is not None
            and source.transformer_impl != target.transformer_impl):
        return []
    decayed = target.transformer_impl == "local"
    return [f"apply_wd_to_qk_layernorm=True with multi-latent attention: megatron-core decays the q-LoRA norm by "
            f"its name, self_attention.q_layernorm (local spec) but not linear_q_up_proj.layer_norm_weight "
            f"(Transformer Engine spec); from {source.transformer_impl} to {target.transformer_impl} its state "
            f"moves to the {'weight-decay' if decayed else 'no-weight-decay'} group, and training continues "
            f"{'with' if decayed else 'without'} weight decay on it"]
