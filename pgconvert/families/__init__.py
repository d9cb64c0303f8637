"""The model families pgconvert converts to and from Hugging Face, one module per lineage.

Each family is one ``Family`` value (``pgconvert.families.table``) in the module of its lineage
(``llama``, ``mistral``, ``qwen``, …), often another family's ``derive(...)``. ``ORDERED`` below lists
them all, in the order a model that names no HF architecture (a Megatron checkpoint) tries them:
it is written as the first whose fixed values and rules it satisfies. Everything else here derives
from that list.
"""

from __future__ import annotations

from pgconvert.families import (
    arcee,
    cohere,
    deepseek,
    dots,
    ernie,
    exaone,
    gemma,
    gemma_vl,
    glm,
    gpt_neox,
    gpt_oss,
    granite,
    hunyuan,
    llama,
    llama4,
    minimax,
    mistral,
    mistral_vl,
    mixtral,
    nemotron,
    nemotron_h,
    olmo,
    phi3,
    qwen,
    qwen3_5,
    qwen3_next,
    qwen_vl,
    seed_oss,
    smollm,
    starcoder2,
)
from pgconvert.families.table import Family
from pgconvert.semantics import SEMANTICS
from pgconvert.semantics.carried import CarriedSetting

# Only multi-latent attention models fit DeepSeek's families, and only those with a sparse attention indexer
# DeepSeek-V3.2 (a rotate-half indexer) and GLM-5 (an interleaved one), which every other family refuses. Mistral is Llama with a window on every
# layer, so a windowed Llama-like model is written as Mistral. Dense families need num_experts=None
# and the MoE ones routed experts, so at most one kind fits. Gemma 3 needs a local RoPE base and
# qk-norm, Gemma 2 neither; Gemma (1) has no post-norms and is the only family with embeddings scaled
# and no post-norms, so it takes no model another fits. OLMo 2 has no pre-norms, OLMoE experts, GLM-4
# interleaved rotary; OLMo 3 after OLMo 2: it takes OLMo 2's layers with a window, which OLMo 2 refuses.
# EXAONE 4 after them: OLMo 2's layers with q/k norms per head (OLMo's are over the whole projection).
# Ministral before SmolLM3: both express a window on some layers; SmolLM3 is needed for NoPE layers.
# Seed-OSS after them: every model Llama or Qwen2 fits stays theirs (Seed-OSS computes the same); it takes
# only the dense models with both add_qkv_bias and add_bias_linear, which no family before it fits.
# Arcee takes the non-gated squared-ReLU models with attention in every layer (the others fix a gated MLP
# or another activation); Nemotron after it: the only family with LayerNorm (zero-centred gamma) and squared ReLU.
# ERNIE 4.5 after them: a Llama-like model with interleaved rotary stays Llama's (written rotate-half).
# Nemotron-H takes the hybrid models (a layer pattern), which every other family refuses.
# MiniMax-M2 after it: it takes only MoE models with a sigmoid router, an expert bias and q/k norms over the
# whole projection, which no family before it fits (OLMoE's router is a softmax, GLM-4.5-MoE's norms per head).
# dots.llm1 after them: a model it fits without a window fits GLM-4.5-MoE first, which computes the same (q/k norms
# per head, its partial rotary written as the whole head); it takes the windowed ones.
# StarCoder2 after them: the only family with LayerNorm and a non-gated tanh GELU.
# GPT-NeoX last: the only family with LayerNorm and a non-gated exact GELU, and the only one holding
# use_parallel_residual (a parallel model fits no family before it: formats.hf.unmapped_losses).
# Cohere after it: only a parallel layer with one shared norm, LayerNorms without a bias fits it. Cohere2 after
# Cohere: the same layer with RoPE on the windowed layers alone, which Cohere (RoPE on every layer) refuses.
# Qwen3-Next takes the models with gated delta net layers and gated attention, which every other family refuses;
# Qwen3.5 after it (the same layers, its projections stored apart): dense ones, and MoE ones Qwen3-Next's config
# cannot hold.
# ERNIE 4.5 MoE takes the MoE models with a softmax router steered by an expert bias, which no other family fits.
# HunYuan (dense, MoE) takes the models with q/k norms after RoPE, which no other family holds.
# Llama 4 last: the only family with the qk L2 norm and the router score on the expert's input.
ORDERED: tuple[Family, ...] = (
    deepseek.DEEPSEEK_V3,
    deepseek.DEEPSEEK_V2,
    deepseek.DEEPSEEK_V32,
    glm.GLM_MOE_DSA,
    qwen.QWEN3,
    qwen.QWEN2,
    llama.LLAMA,
    mistral.MISTRAL,
    qwen.QWEN3_MOE,
    mixtral.MIXTRAL,
    gemma.GEMMA3,
    gemma.GEMMA2,
    gemma.GEMMA,
    olmo.OLMO2,
    olmo.OLMO3,
    exaone.EXAONE4,
    olmo.OLMOE,
    glm.GLM4,
    glm.GLM4_MOE,
    gpt_oss.GPT_OSS,
    qwen.QWEN2_MOE,
    granite.GRANITE,
    granite.GRANITE_MOE,
    mistral.MINISTRAL,
    smollm.SMOLLM3,
    phi3.PHI3,
    seed_oss.SEED_OSS,
    arcee.ARCEE,
    nemotron.NEMOTRON,
    ernie.ERNIE4_5,
    nemotron_h.NEMOTRON_H,
    minimax.MINIMAX_M2,
    dots.DOTS1,
    starcoder2.STARCODER2,
    gpt_neox.GPT_NEOX,
    cohere.COHERE,
    cohere.COHERE2,
    qwen3_next.QWEN3_NEXT,
    qwen3_5.QWEN3_5,
    qwen3_5.QWEN3_5_MOE,
    ernie.ERNIE4_5_MOE,
    hunyuan.HUNYUAN_DENSE,
    hunyuan.HUNYUAN_MOE,
    llama4.LLAMA4,
)

# Vision-language families: a text family's language model with a vision part (pgconvert.families.vision_language);
# only they take a model with a vision part, which every text family refuses.
VISION_LANGUAGE: tuple[Family, ...] = (qwen_vl.QWEN2_5_VL, qwen_vl.QWEN3_VL, qwen_vl.QWEN3_VL_MOE,
                                       gemma_vl.GEMMA3_VL, mistral_vl.MISTRAL3)

FAMILIES: dict[str, Family] = {family.architecture: family for family in (*ORDERED, *VISION_LANGUAGE)}
# The family written for a source that carries no HF architecture: the first that fits.
INFERENCE_ORDER: tuple[str, ...] = tuple(FAMILIES)
# The families' settings megatron-core does not compute, carried in Megatron args under their
# own names (for pgconvert.semantics' from_args, to_args and check_target), and those names.
CARRIED_SETTINGS: tuple[CarriedSetting, ...] = tuple(
    dict.fromkeys(setting for family in ORDERED for setting in family.megatron_carried))
CARRIED_ARGS: tuple[str, ...] = tuple(setting.name for setting in CARRIED_SETTINGS)


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


def hf_spellings(setting: str) -> dict[str, str]:
    """How each family's config.json holds the ``SEMANTICS`` row ``setting``: its own note, else the
    row's text."""
    (row,) = [row for row in SEMANTICS if row.name == setting]
    return {family.architecture: family.hf_notes.get(setting, row.hf) for family in FAMILIES.values()}
