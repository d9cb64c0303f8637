"""Facts of Megatron-LM's per-rank ("torch") checkpoint format shared by its loader and saver.

Layout on disk (megatron/training/checkpointing.py, ``get_checkpoint_name``)::

    ROOT/latest_checkpointed_iteration.txt        "1000" or "release"
    ROOT/iter_0001000/ or ROOT/release/
        mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt

``_{pp:03d}`` appears only when pp > 1 and ``_{ep:03d}`` only when ep > 1, so a two-part name is
ambiguous between PP-only and EP-only: it is resolved from the saved ``args``, never guessed.
"""

from __future__ import annotations

import argparse
import io
import logging
import pathlib
import pickle
import re
import signal
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from pgconvert.config import ModelConfig
from pgconvert.errors import CheckpointError, UnsafePickleError
from pgconvert.layout import ParallelLayout

log = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
ITERATION_DIR_RE = re.compile(r"^iter_(\d{7,})$")
RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def iteration_dir_name(iteration: int | None, release: bool) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, ep_rank: int, pp_size: int, ep_size: int) -> str:
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    return name


class OpaqueGlobal:
    """Stand-in for a framework class named in a checkpoint (an enum in ``args``, a dataclass).

    pgconvert does not import the training framework, so these globals are allowed under their
    own names but rebuilt as inert records: constructing one runs no code from the checkpoint.
    """

    qualified_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueGlobal:
        instance = super().__new__(cls)
        instance.args = args
        instance.state = None
        return instance

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else self.args

    def __repr__(self) -> str:
        return f"<{self.qualified_name} {self.value!r}>"


def _opaque(qualified_name: str) -> tuple[type, str]:
    stand_in = type(qualified_name.rsplit(".", 1)[-1], (OpaqueGlobal,), {"qualified_name": qualified_name})
    return stand_in, qualified_name


# megatron-core's own list (megatron/core/safe_globals.py) plus the stdlib types it names.
_FRAMEWORK_GLOBALS = [
    _opaque("megatron.core.enums.ModelType"),
    _opaque("megatron.core.transformer.enums.AttnBackend"),
    _opaque("megatron.core.transformer.enums.CudaGraphModule"),
    _opaque("megatron.core.transformer.enums.CudaGraphScope"),
    _opaque("megatron.core.transformer.enums.InferenceCudaGraphScope"),
    _opaque("megatron.core.optimizer.OptimizerConfig"),
    _opaque("megatron.core.optimizer.optimizer_config.OptimizerConfig"),
    _opaque("megatron.core.rerun_state_machine.RerunDiagnostic"),
    _opaque("megatron.core.rerun_state_machine.RerunMode"),
    _opaque("megatron.core.rerun_state_machine.RerunState"),
]
SAFE_GLOBALS: list[Any] = [
    argparse.Namespace,
    types.SimpleNamespace,
    pathlib.PosixPath,
    io.BytesIO,
    signal.Signals,
    *_FRAMEWORK_GLOBALS,
]


def safe_torch_load(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True, mmap=True)`` with the allowlist; errors name the file."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        detail = _unsafe_global(str(exc))
        if detail:
            raise UnsafePickleError(
                f"{path}: refuses to unpickle {detail}: it is not on the allowlist of safe globals "
                "(nothing from the file was executed)"
            ) from exc
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({first_line})") from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint ({first_line})") from exc
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: expected a dict at the top level, found {type(loaded).__name__}")
    return loaded


def _unsafe_global(message: str) -> str | None:
    match = re.search(r"GLOBAL ([\w.]+)", message)
    return f"global {match.group(1)}" if match else None


def plain_args(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """A copy of ``args`` with framework stand-ins replaced by their plain values, and their names."""
    values = dict(vars(args))
    replaced = []
    for key, value in values.items():
        if isinstance(value, OpaqueGlobal):
            values[key] = value.value
            replaced.append(key)
    return argparse.Namespace(**values), sorted(replaced)


def _dtype_name(args: argparse.Namespace) -> str:
    params_dtype = getattr(args, "params_dtype", None)
    if isinstance(params_dtype, torch.dtype):
        return str(params_dtype).removeprefix("torch.")
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    return "float32"


def config_from_args(args: argparse.Namespace, path: Path, transformer_impl: str,
                     true_vocab_size: int | None) -> ModelConfig:
    """The ModelConfig a Megatron run's ``args`` describe (megatron-LM's argument defaults apply)."""

    def required(name: str) -> Any:
        value = getattr(args, name, None)
        if value is None:
            raise CheckpointError(f"{path}: args.{name} is missing; cannot determine the model architecture")
        return value

    heads = required("num_attention_heads")
    hidden = required("hidden_size")
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    position = getattr(args, "position_embedding_type", None)
    if position is None:
        position = "rope" if getattr(args, "use_rotary_position_embeddings", False) else "learned_absolute"
    if position not in ("rope", "learned_absolute", "none"):
        raise CheckpointError(f"{path}: args.position_embedding_type={position!r} is not supported")
    vocab = true_vocab_size
    if vocab is None and isinstance(getattr(args, "vocab_size", None), int):
        vocab = args.vocab_size
    swiglu = bool(getattr(args, "swiglu", False))
    return ModelConfig(
        num_layers=required("num_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None) or 4 * hidden,
        num_query_groups=groups or heads,
        kv_channels=getattr(args, "kv_channels", None) or None,
        vocab_size=vocab,
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", None) or 128,
        gated_linear_unit=swiglu,
        activation="silu" if swiglu else "gelu",
        normalization=getattr(args, "normalization", None) or "LayerNorm",
        norm_epsilon=float(getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", 1e-5)),
        add_bias_linear=bool(getattr(args, "add_bias_linear", True)),
        add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        tie_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=position,
        max_position_embeddings=getattr(args, "max_position_embeddings", None),
        rotary_base=float(getattr(args, "rotary_base", 10000)),
        params_dtype=_dtype_name(args),
        transformer_impl=transformer_impl,
        num_experts=getattr(args, "num_experts", None) or None,
    )


def layout_from_args(args: argparse.Namespace, path: Path) -> ParallelLayout:
    def size(name: str) -> int:
        value = getattr(args, name, None)
        return 1 if value is None else int(value)

    if getattr(args, "virtual_pipeline_model_parallel_size", None) not in (None, 1):
        raise CheckpointError(
            f"{path}: args.virtual_pipeline_model_parallel_size="
            f"{args.virtual_pipeline_model_parallel_size}: virtual pipelines are not supported yet"
        )
    pp = size("pipeline_model_parallel_size")
    return ParallelLayout(
        tp=size("tensor_model_parallel_size"),
        pp=pp,
        ep=size("expert_model_parallel_size"),
        first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None) if pp > 1 else None,
        last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None) if pp > 1 else None,
    )


def args_for_target(config: ModelConfig, layout: ParallelLayout, padded_vocab_size: int,
                    dtype: torch.dtype, iteration: int | None,
                    base: argparse.Namespace | None) -> tuple[argparse.Namespace, list[str]]:
    """The ``args`` a destination rank file carries: the source's, re-described for ``layout``."""
    if base is not None:
        args, replaced = plain_args(base)
    else:
        args, replaced = argparse.Namespace(), []
    dtype_name = str(dtype).removeprefix("torch.")
    values: dict[str, Any] = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.ffn_hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "group_query_attention": config.query_groups != config.num_attention_heads,
        "num_query_groups": config.query_groups,
        "kv_channels": config.head_dim,
        "swiglu": config.gated_linear_unit,
        "normalization": config.normalization,
        "norm_epsilon": config.norm_epsilon,
        "add_bias_linear": config.add_bias_linear,
        "add_qkv_bias": config.add_qkv_bias,
        "qk_layernorm": config.qk_layernorm,
        "untie_embeddings_and_output_weights": not config.tie_embeddings,
        "position_embedding_type": config.position_embedding_type,
        "max_position_embeddings": config.max_position_embeddings,
        "rotary_base": config.rotary_base,
        "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by,
        "transformer_impl": config.transformer_impl,
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "expert_model_parallel_size": layout.ep,
        "decoder_first_pipeline_num_layers": layout.first_stage_layers,
        "decoder_last_pipeline_num_layers": layout.last_stage_layers,
        "virtual_pipeline_model_parallel_size": None,
        "num_layers_per_virtual_pipeline_stage": None,
        "padded_vocab_size": padded_vocab_size,
        "params_dtype": dtype,
        "bf16": dtype_name == "bfloat16",
        "fp16": dtype_name == "float16",
        "iteration": iteration,
        "ckpt_format": "torch",
    }
    if config.vocab_size is not None:
        values["vocab_size"] = config.vocab_size
    if base is None:
        values["world_size"] = layout.world_size
    for key, value in values.items():
        setattr(args, key, value)
    return args, replaced
