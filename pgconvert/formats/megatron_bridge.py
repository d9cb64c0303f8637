"""A Megatron-Bridge run's ``run_config.yaml``: read within bounds, and its model read as Megatron args.

Megatron-Bridge's ``save_checkpoint`` (``megatron/bridge/training/checkpointing.py``, 0.3.1) writes megatron-core's
torch_dist store with no ``args`` in its common state: ``generate_state_dict`` puts in ``checkpoint_version``,
``iteration``, the model, the optimizer, the scheduler and the RNG and rerun state. The run's configuration is
``ConfigContainer.to_yaml`` in the iteration's directory, ``run_config.yaml``
(``training/utils/checkpoint_utils.py``: ``CONFIG_FILE``), whose ``model`` section is the model provider
(``GPTModelProvider``, a megatron-core ``TransformerConfig``) field by field, every field that is not private.
Callables and dtypes are written by ``utils/yaml_utils.py``'s representers as ``{_target_: <module>.<qualname>,
_call_: false}`` (``_function_representer``, ``_torch_dtype_representer``); enums and partials as other
``_target_`` dicts. The iteration layout is Megatron-LM's (``iter_<7 digits>/``,
``latest_checkpointed_iteration.txt``, beside Bridge's ``latest_train_state.pt``).

A ``TransformerConfig`` field and the Megatron-LM argument made from it have one name (Megatron-LM's
``ArgumentGroupFactory``), so the model section is read as the ``args`` a Megatron-LM run of the same model would
have written (``bridge_args``): the same names copied, the fields Bridge names otherwise renamed, the callables
read as the flags Megatron-LM spells them with. The Megatron readers then read it as any run's args.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError
from pgconvert.formats.strict import fallback
from pgconvert.io.limits import MAX_JSON_BYTES, quote, read_config_bytes

log = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.yaml"
_TARGET = "_target_"

# The defaults of the provider fields read here where a run_config.yaml leaves them out (Bridge writes every field;
# an older or hand-written file may not): GPTModelProvider's (models/gpt_provider.py, 0.3.1) over megatron-core
# 0.16.1 TransformerConfig's / ModelParallelConfig's.
PROVIDER_DEFAULTS: dict[str, Any] = {
    "normalization": "LayerNorm", "layernorm_epsilon": 1e-5, "gated_linear_unit": False,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
    "rope_scaling": False, "rope_scaling_factor": 1.0, "seq_len_interpolation_factor": None, "seq_length": 1024,
    "share_embeddings_and_output_weights": True, "make_vocab_size_divisible_by": 128, "should_pad_vocab": False,
    "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False, "num_moe_experts": None,
    "moe_grouped_gemm": False, "moe_router_topk": 2, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
    "num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
    "bf16": False, "fp16": False, "use_transformer_engine_full_layer_spec": False,
}

# Provider fields whose Megatron-LM argument has another name (models/gpt_provider.py's GPTModelProvider.provide
# passes seq_length as the model's max_sequence_length; megatron-core's rope_scaling is Megatron-LM's
# --use-rope-scaling).
_RENAMED: dict[str, str] = {
    "num_moe_experts": "num_experts", "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers", "rope_scaling": "use_rope_scaling",
    "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor", "seq_length": "max_position_embeddings",
}

# The YaRN fields of Bridge's providers (gpt_oss_provider.py, ministral3_provider.py) under Megatron-LM's names, for
# position_embedding_type "yarn" (conversion/model_bridge.py maps HF's factor, mscale, mscale_all_dim to them).
_YARN_RENAMED: dict[str, str] = {"yarn_rotary_scaling_factor": "rotary_scaling_factor", "yarn_mscale": "mscale",
                                 "yarn_mscale_all_dim": "mscale_all_dim"}

# activation_func as Bridge's yaml names it -> pgconvert's activation (megatron.core.activations, 0.16.1, and
# fusions/fused_bias_geglu.py's quick_gelu, which GPT-OSS's provider uses). F.gelu, TransformerConfig's default, is
# torch's builtin: _function_representer names it by its module, torch._C._nn.
ACTIVATIONS: dict[str, str] = {
    "torch.nn.functional.silu": "silu", "torch._C._nn.gelu": "gelu", "torch.nn.functional.gelu": "gelu",
    "megatron.core.activations.squared_relu": "squared_relu", "megatron.core.activations.quick_gelu": "quick_gelu",
    "megatron.bridge.models.nemotron.nemotron_provider.squared_relu": "squared_relu",
    "megatron.core.fusions.fused_bias_geglu.quick_gelu": "quick_gelu",
    "megatron.core.activations.fast_gelu": "gelu_tanh", "megatron.core.transformer.utils.openai_gelu": "gelu_tanh",
    "megatron.core.transformer.utils.erf_gelu": "gelu",
}
# The Megatron-LM flags that spell each activation (formats/megatron.py's _mlp_from_args reads them), gated or not.
_ACTIVATION_FLAGS: dict[tuple[str, bool], dict[str, bool]] = {
    ("silu", True): {"swiglu": True}, ("quick_gelu", True): {"quick_geglu": True},
    ("squared_relu", False): {"squared_relu": True}, ("gelu", False): {}, ("gelu", True): {},
    ("gelu_tanh", False): {"openai_gelu": True}, ("gelu_tanh", True): {"openai_gelu": True},
}

# transformer_layer_spec -> the implementation whose key names the store holds.
LAYER_SPECS: dict[str, str] = {
    "megatron.bridge.models.gpt_provider.default_layer_spec": "transformer_engine",
    "megatron.bridge.models.gpt_provider.transformer_engine_layer_spec": "transformer_engine",
    "megatron.bridge.models.gpt_provider.local_layer_spec": "local",
}

# Callable or object fields that do not change what the trained model computes: initializers, the attention
# kernel, autocast and pipeline communication dtypes.
_INERT_OBJECTS = frozenset({"init_method", "output_layer_init_method", "embedding_init_method", "attention_backend",
                            "autocast_dtype", "pipeline_dtype", "params_dtype", "activation_func",
                            "transformer_layer_spec", "generation_config"})
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def run_config_beside(store: Path) -> Path | None:
    """run_config.yaml, which Megatron-Bridge writes in the iteration's directory (its run's directory has one too
    when an export looks there)."""
    return next((where / RUN_CONFIG_FILE for where in (store, store.parent) if (where / RUN_CONFIG_FILE).is_file()),
                None)


def read_run_config(path: Path) -> dict[str, Any]:
    """A run_config.yaml as a mapping, read no further than the config size limit, with YAML's safe loader."""
    import yaml

    text = read_config_bytes(path)
    if len(text) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_JSON_BYTES} bytes")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{path}: not YAML ({quote(str(exc), 200)})") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: not a mapping of run settings ({quote(type(doc).__name__)})")
    return doc


def bridge_args(path: Path, strict: bool, notices: list[str]) -> argparse.Namespace:
    """The Megatron args a run_config.yaml's ``model`` section describes (module docstring)."""
    model = read_run_config(path).get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: no model section (Megatron-Bridge's model provider); cannot determine the "
                              "model and layout")
    values = {**PROVIDER_DEFAULTS, **{name: value for name, value in model.items() if not name.startswith("_")}}
    args = argparse.Namespace(**{name: value for name, value in values.items() if _plain(value)})
    for bridge_name, arg_name in _RENAMED.items():
        setattr(args, arg_name, values.get(bridge_name))
    if values["position_embedding_type"] == "yarn":
        for bridge_name, arg_name in _YARN_RENAMED.items():
            if values.get(bridge_name) is not None:
                setattr(args, arg_name, values[bridge_name])
    args.untie_embeddings_and_output_weights = not values["share_embeddings_and_output_weights"]
    args.group_query_attention = values.get("num_query_groups") is not None
    # should_pad_vocab off: the tables hold vocab_size rows (GPTModelProvider.provide), a multiple of 1.
    args.make_vocab_size_divisible_by = values["make_vocab_size_divisible_by"] if values["should_pad_vocab"] else 1
    args.transformer_impl = _transformer_impl(values, path, strict, notices)
    args.params_dtype = _params_dtype(values.get("params_dtype"), values, path)
    for flag, value in _activation_flags(values, path, strict, notices).items():
        setattr(args, flag, value)
    _note_unread_objects(values, path, strict, notices)
    return args


def _plain(value: Any) -> bool:
    """A value Megatron-LM's args could hold as it is: no ``_target_`` object."""
    if isinstance(value, list):
        return all(_plain(item) for item in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _target(value: Any) -> str | None:
    return value.get(_TARGET) if isinstance(value, dict) and isinstance(value.get(_TARGET), str) else None


def _transformer_impl(values: dict[str, Any], path: Path, strict: bool, notices: list[str]) -> str:
    """The key names' implementation from the layer spec; an unknown spec is a guess (Transformer Engine's names)."""
    if values["use_transformer_engine_full_layer_spec"]:
        raise CheckpointError(f"{path}: model.use_transformer_engine_full_layer_spec=True: Transformer Engine's whole "
                              "TransformerLayer keeps its own tensor names, which pgconvert does not read")
    spec = _target(values.get("transformer_layer_spec"))
    if spec in LAYER_SPECS:
        return LAYER_SPECS[spec]
    fallback(f"{path}: model.transformer_layer_spec={quote(spec)} is not a layer spec pgconvert knows "
             f"({', '.join(sorted(LAYER_SPECS))}); reading its key names as Transformer Engine's", strict, notices)
    return "transformer_engine"


def _params_dtype(value: Any, values: dict[str, Any], path: Path) -> Any:
    """params_dtype as a torch dtype (``{_target_: torch.bfloat16}``), else from the bf16 / fp16 switches."""
    import torch

    target = _target(value)
    if target is None and value is None:
        return torch.bfloat16 if values["bf16"] else torch.float16 if values["fp16"] else torch.float32
    if target not in _DTYPES:
        raise CheckpointError(f"{path}: model.params_dtype={quote(value)}: expected one of {sorted(_DTYPES)}")
    return getattr(torch, _DTYPES[target])


def _activation_flags(values: dict[str, Any], path: Path, strict: bool, notices: list[str]) -> dict[str, bool]:
    """The Megatron-LM flags of ``activation_func`` with ``gated_linear_unit`` (absent: F.gelu, TransformerConfig's)."""
    given = values.get("activation_func")
    target = _target(given) if given is not None else "torch._C._nn.gelu"
    gated = bool(values["gated_linear_unit"])
    activation = ACTIVATIONS.get(target or "")
    flags = _ACTIVATION_FLAGS.get((activation, gated)) if activation is not None else None
    if flags is None:
        from pgconvert.semantics import lose

        lose(f"{path}: model.activation_func={quote(target or given)} with gated_linear_unit={gated}: not an MLP "
             f"pgconvert reads (activations: {', '.join(sorted(ACTIVATIONS))}); the output names Megatron-LM's "
             "default GELU", strict, notices)
        return {}
    return flags


def _note_unread_objects(values: dict[str, Any], path: Path, strict: bool, notices: list[str]) -> None:
    """A provider field set to a callable or object pgconvert does not read may change the computation."""
    from pgconvert.semantics import lose

    unread = sorted(f"model.{name}={quote(_target(value) or value, 80)}" for name, value in values.items()
                    if name not in _INERT_OBJECTS and not _plain(value))
    if unread:
        lose(f"{path}: {', '.join(unread)}: provider settings pgconvert does not read", strict, notices)
