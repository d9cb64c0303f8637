"""GPT-NeoX (``GPTNeoXForCausalLM``: EleutherAI/pythia-*, gpt-neox-20b): attention and MLP side by side.

transformers' GPTNeoXLayer computes ``x + attn(ln1(x)) + mlp(ln2(x))`` where ``use_parallel_residual`` (true in
every release; false is the sequential layer of the other families). megatron-core 0.16.1 has no such layer
(``TransformerLayer.forward`` runs the MLP on the attention's output, transformer/transformer_layer.py:513-518), so
the setting is carried in Megatron args under transformers' name (``pgconvert.semantics.carried``) and every
Megatron output names it in a notice (``--strict`` refuses a Megatron target).

The rest is megatron-core's: ``query_key_value`` holds, per head, ``[q; k; v]`` rows (``view(..., heads, 3 *
head_size)`` then ``chunk(3)``), which is megatron-core's ``linear_qkv`` with one query group per head, so it is
copied as it is; ``nn.LayerNorm`` with biases (``layer_norm_eps``); the exact GELU, not gated, with biases on both
MLP linears (always) and on the attention's (``attention_bias``: megatron-core has one ``add_bias_linear``, so it
must be true); rotate-half RoPE on the first ``partial_rotary_factor`` of each head (megatron-core's
``rotary_percent``; older configs: ``rotary_pct``, default 0.25, and ``rotary_emb_base``); an untied ``embed_out``
(transformers loads it as ``lm_head``). ``hidden_dropout`` drops out the embeddings and both sublayers' outputs,
as megatron-core's does.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.llama import ROPE_BASE_NULL, ROPE_DEFAULT, ROPE_RULE, read_rope, write_partial_rope
from pgconvert.families.table import (DROPPED, ConfigField, ConfigRule, Family, TensorMapping, TensorTable,
                                      read_nothing, write_nothing)
from pgconvert.io.limits import quote
from pgconvert.model.config import POSTNORM_OFF, ModelConfig
from pgconvert.semantics.carried import CarriedSetting, read_flag
from pgconvert.semantics.rope import rope_parameters

_L = "gpt_neox.layers.{}."
_D = "decoder.layers.{}."
_PAIRS = (
    ("input_layernorm", "input_layernorm"),
    ("self_attention.linear_qkv", "attention.query_key_value"),
    ("self_attention.linear_proj", "attention.dense"),
    ("pre_mlp_layernorm", "post_attention_layernorm"),
    ("mlp.linear_fc1", "mlp.dense_h_to_4h"),
    ("mlp.linear_fc2", "mlp.dense_4h_to_h"),
)
GPT_NEOX_TENSORS = TensorTable((
    TensorMapping("embedding.word_embeddings.weight", ("gpt_neox.embed_in.weight",)),
    *(TensorMapping(_D + f"{megatron}.{part}", (_L + f"{hf}.{part}",))
      for megatron, hf in _PAIRS for part in ("weight", "bias")),
    TensorMapping("decoder.final_layernorm.weight", ("gpt_neox.final_layer_norm.weight",)),
    TensorMapping("decoder.final_layernorm.bias", ("gpt_neox.final_layer_norm.bias",)),
    TensorMapping("output_layer.weight", ("embed_out.weight",)),
    # Buffers older transformers saved (the causal mask, its fill value, the rotary frequencies).
    *(TensorMapping(None, (_L + f"attention.{buffer}",), DROPPED)
      for buffer in ("bias", "masked_bias", "rotary_emb.inv_freq")),
))

# transformers' name for the parallel layer (GPT-NeoX's config.json key), carried in Megatron args.
PARALLEL_RESIDUAL = CarriedSetting("use_parallel_residual", False, read_flag)

# GPTNeoXConfig.convert_rope_params_to_dict: rope_parameters.partial_rotary_factor, else rotary_pct, else 0.25.
_DEFAULT_PARTIAL = 0.25


def _read_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Llama's RoPE reading, with GPT-NeoX's partial rotary default and older ``rotary_pct``; a null partial
    rotary is refused (transformers keeps it, and its attention cannot size the rotary part from it)."""
    params = rope_parameters(present)
    partial = params["partial_rotary_factor"] if "partial_rotary_factor" in params else present.get(
        "rotary_pct", _DEFAULT_PARTIAL)
    if partial is None:
        raise ValueError("partial_rotary_factor (rotary_pct) is null: transformers' GPTNeoXAttention sizes the "
                         "rotary part of each head from it")
    # Only the block: GPTNeoXConfig never reads a top-level partial_rotary_factor.
    return read_rope({"rope_parameters": {**params, "partial_rotary_factor": partial}}, model)


def _write_rope(config: ModelConfig) -> Mapping[str, object]:
    """Llama's RoPE with the partial rotary, in ``rope_scaling`` too where that is written (transformers 5 reads
    ``rope_scaling or rope_parameters``, and the first without it is GPT-NeoX's default 0.25)."""
    written = dict(write_partial_rope(config))
    legacy = written["rope_scaling"]
    if isinstance(legacy, Mapping):
        written["rope_scaling"] = {**legacy, "partial_rotary_factor": config.positions.rotary_percent}
    return written


_ROPE_RULE = ConfigRule(keys=("rope_parameters", "rope_scaling"),
                        model_fields=ROPE_RULE.model_fields,
                        read=_read_rope, write=_write_rope, legacy_keys=("rotary_pct",),
                        null_keys=("rotary_pct",))


def _refuses_grouped_heads(config: ModelConfig) -> str | None:
    """GPT-NeoX has one key and value head per query head, each hidden_size / num_attention_heads wide."""
    attention = config.attention
    if attention.query_groups != attention.num_attention_heads:
        return f"num_query_groups={attention.query_groups} (needs num_attention_heads={attention.num_attention_heads})"
    if attention.head_dim * attention.num_attention_heads != config.hidden_size:
        return (f"kv_channels={attention.head_dim} (needs hidden_size / num_attention_heads = "
                f"{quote(config.hidden_size / attention.num_attention_heads)})")
    return None


GPT_NEOX = Family(
    architecture="GPTNeoXForCausalLM",
    model_type="gpt_neox",
    tensors=GPT_NEOX_TENSORS,
    fields=(
        ConfigField(("hidden_size",), "hidden_size", int),
        ConfigField(("num_hidden_layers",), "num_layers", int),
        ConfigField(("num_attention_heads",), "num_attention_heads", int),
        ConfigField(("layer_norm_eps",), "norm_epsilon", float, default=1e-5),
        ConfigField(("rope_parameters", "rope_theta"), "rotary_base", float, default=10000.0,
                    legacy=(("rotary_emb_base",),), null_refused=ROPE_BASE_NULL),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int, default=2048),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=False),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
        ConfigField(("hidden_dropout",), "hidden_dropout", float, default=0.0),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int),
        ConfigField(("use_parallel_residual",), "use_parallel_residual", bool, default=True),
    ),
    rules=(_ROPE_RULE, ConfigRule(keys=(), model_fields=(), read=read_nothing, write=write_nothing,
                                  refuses=_refuses_grouped_heads)),
    fixed={**POSTNORM_OFF, "gated_linear_unit": False, "activation": "gelu", "normalization": "LayerNorm",
           "position_embedding_type": "rope", "rotary_interleaved": False, "multi_latent_attention": False,
           "num_experts": None, "qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": True,
           "sliding_window": None},
    hf_fixed={"hidden_act": "gelu", "attention_bias": True},
    hf_scratch=ROPE_DEFAULT,
    hf_computes=frozenset({"rotary_percent"}),
    megatron_carried=(PARALLEL_RESIDUAL,),
    hf_notes={"rope theta": "rope_parameters.rope_theta (older: rotary_emb_base)",
              "rotary percent": "rope_parameters.partial_rotary_factor (older: rotary_pct; absent: 0.25)",
              "normalization": "LayerNorm with biases (fixed)", "norm epsilon": "layer_norm_eps",
              "activation": "gelu (exact), not gated (fixed)",
              "linear biases": "attention_bias (true: the MLP's biases are always there)",
              "query groups": "none: one key and value head per query head",
              "head dim": "none: hidden_size / num_attention_heads",
              "dropout": "attention_dropout; hidden_dropout", "parallel attention and MLP": "use_parallel_residual"},
)
