"""Facts of Megatron-LM's per-rank ("torch") checkpoint format shared by its loader and saver.

Layout on disk (megatron/training/checkpointing.py, ``get_checkpoint_name``)::

    ROOT/latest_checkpointed_iteration.txt        "1000" or "release"
    ROOT/iter_0001000/ or ROOT/release/
        mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
        mp_rank_.../distrib_optim.pt                  the distributed optimizer's state, if any

``_{pp:03d}`` appears only when pp > 1 and ``_{ep:03d}`` only when ep > 1, so a two-part name is
ambiguous between PP-only and EP-only: it is resolved from the saved ``args``, never guessed.
"""

from __future__ import annotations

import argparse
import copyreg
import io
import logging
import math
import pathlib
import pickle
import re
import signal
import types
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy
import numpy.dtypes
import torch

from pgconvert.model.config import ModelConfig
from pgconvert.model.layers import ROTARY_TYPES
from pgconvert.errors import CheckpointError, ConfigError, LayoutError, UnsafePickleError
from pgconvert.formats import RELEASE, Iteration
from pgconvert.formats.hybrid_args import (hybrid_from_args, hybrid_to_args, linear_attention_from_args,
                                          linear_attention_to_args)
from pgconvert.formats.vision_args import MROPE, vision_from_args, vision_to_args
from pgconvert.formats.megatron_args import MEGATRON_DEFAULTS, megatron_ffn_hidden_size, none_notices
from pgconvert.model.layout import ParallelLayout
from pgconvert.io.limits import MAX_TRACKER_BYTES, over_limit, quote
from pgconvert.io.pickling import StandInPickler
from pgconvert.families import CARRIED_SETTINGS
from pgconvert.semantics import from_args as semantics_from_args
from pgconvert.semantics import to_args as semantics_to_args
from pgconvert.semantics.arg_values import arg
from pgconvert.io.torch_input import read_torch_structure

try:  # numpy >= 2
    from numpy._core import multiarray as numpy_multiarray
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as numpy_multiarray

log = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
# The distributed optimizer's state beside a rank file (``DistributedOptimizer.save_parameter_state``); the rank
# file's ``optimizer`` entry then holds only its param groups.
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
# A rank file's training state (Megatron-LM's ``generate_state_dict``): what a resumed run reads besides the model.
TRAINING_STATE_KEYS = ("optimizer", "opt_param_scheduler", "rng_state", "rerun_state_machine")
# What names a LoRA adapter's state in a Megatron-Bridge run's checkpoint (peft/adapter_wrapper.py).
ADAPTER_KEY_PART = ".adapter."
CHECKPOINT_VERSION = 3.0
ITERATION_DIR_RE = re.compile(r"^iter_(\d{7,})$")
RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def is_adapter_key(key: str) -> bool:
    """A model key of an adapter Megatron-Bridge wraps a linear with (``<module>.adapter.linear_in.weight``, its
    ``_extra_state``): peft/adapter_wrapper.py names the adapter's state ``<prefix>adapter.``."""
    return ADAPTER_KEY_PART in key


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

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and self.args == other.args  # type: ignore[attr-defined]
                and self.state == other.state)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.qualified_name, self.args))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled back under the framework's own name (see ``FrameworkPickler``): an enum as
        # ``Class(value)``, as Python's Enum pickles itself; any other object as ``Class.__new__``
        # plus its state, as the default reduction of a plain class does.
        if self.state is None:
            return type(self), self.args
        return copyreg.__newobj__, (type(self), *self.args), self.state


class FrameworkPickler(StandInPickler):
    """A pickler that writes ``OpaqueGlobal`` stand-ins as the framework classes they stand for.

    Megatron-LM's ``validate_args`` wants its own enum classes back in ``args`` (an int fails), and
    pgconvert does not import Megatron: the stand-in class is written as a reference to the
    framework's module and qualified name, which only the reader resolves.
    """

    def stands_for(self, cls: type) -> tuple[str, str] | None:
        if issubclass(cls, OpaqueGlobal) and cls is not OpaqueGlobal:
            module, _, qualname = cls.qualified_name.rpartition(".")
            return module, qualname
        return None


# The ``pickle_module`` to hand ``torch.save`` for files holding Megatron ``args``.
FRAMEWORK_PICKLE = types.ModuleType("pgconvert_framework_pickle")
FRAMEWORK_PICKLE.Pickler = FrameworkPickler  # type: ignore[attr-defined]


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
    _opaque("megatron.core.transformer.enums.LayerType"),
    _opaque("megatron.core.transformer.pipeline_parallel_layer_layout.PipelineParallelLayerLayout"),
]
# What Megatron-LM's ``save_checkpoint`` writes beside the weights, as megatron-core's own
# ``safe_globals`` list allows it: ``rng_state`` holds ``np.random.get_state()`` (a uint32 array,
# rebuilt by numpy's ``_reconstruct``; numpy 1.x names it ``numpy.core``, 2.x ``numpy._core``),
# ``random.getstate()`` (plain tuples) and RNG-tracker states that may be ``torch.Generator``s.
_RNG_STATE_GLOBALS: list[Any] = [
    numpy.ndarray,
    numpy.dtype,
    numpy.dtypes.UInt32DType,
    (numpy_multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
    (numpy_multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    torch._C.Generator,
]
SAFE_GLOBALS: list[Any] = [
    argparse.Namespace,
    types.SimpleNamespace,
    pathlib.PosixPath,
    io.BytesIO,
    signal.Signals,
    *_RNG_STATE_GLOBALS,
    *_FRAMEWORK_GLOBALS,
]


def safe_torch_load(path: Path, list_ok: bool = False) -> Any:
    """``torch.load(weights_only=True, mmap=True)`` with the allowlist, after the file's structure is checked
    (``read_torch_structure``; a legacy file is read whole, without mmap); errors name the file. A dict at the top
    level, or with ``list_ok`` a list (a chained optimizer's ``distrib_optim.pt``)."""
    with _load_errors(path), torch.serialization.safe_globals(SAFE_GLOBALS):
        structure = read_torch_structure(path)
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=structure.is_zip)
    return _top_level(loaded, path, list_ok)


def safe_torch_structure(path: Path, list_ok: bool = False) -> Any:
    """The file's object as ``safe_torch_load`` gives it, with nothing mapped: a zip file's tensors over 64 KiB
    stay in the file as meta tensors that know their bytes' place (``io.torch_input.stored_region``: read them
    with ``io.torch_input.StoredTensors``), the small ones in memory; a legacy file is read whole."""
    with _load_errors(path), torch.serialization.safe_globals(SAFE_GLOBALS):
        structure = read_torch_structure(path)
        loaded = structure.meta if structure.is_zip else torch.load(path, map_location="cpu", weights_only=True)
    return _top_level(loaded, path, list_ok)


@contextmanager
def _load_errors(path: Path) -> Iterator[None]:
    """Failures of reading a torch file, as CheckpointErrors (UnsafePickleError for a global off the allowlist)
    naming it."""
    try:
        yield
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        detail = _unsafe_global(str(exc))
        if detail:
            raise UnsafePickleError(
                f"{path}: refuses to unpickle {detail}: it is not on the allowlist of safe globals "
                "(nothing from the file was executed)"
            ) from exc
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({quote(first_line, 200)})") from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint ({quote(first_line, 200)})") from exc


def _top_level(loaded: Any, path: Path, list_ok: bool) -> Any:
    if not isinstance(loaded, dict) and not (list_ok and isinstance(loaded, list)):
        raise CheckpointError(f"{path}: expected a dict at the top level, found {type(loaded).__name__}")
    return loaded


def _unsafe_global(message: str) -> str | None:
    match = re.search(r"GLOBAL ([\w.]+)", message)
    return f"global {match.group(1)}" if match else None


def params_dtype_for(dtypes: Iterable[torch.dtype], config: ModelConfig) -> torch.dtype:
    """The ``params_dtype`` a destination's args declare: the dtype of the first tensor stored in
    one Megatron trains in (float32, bfloat16, float16), else the model's. A stray tensor in another
    dtype (float64, int32) must not become the args' dtype, which Megatron and pgconvert refuse."""
    for dtype in dtypes:
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
    return getattr(torch, config.params_dtype)


def _dtype_name(args: argparse.Namespace) -> str:
    params_dtype = getattr(args, "params_dtype", None)
    if isinstance(params_dtype, torch.dtype):
        return str(params_dtype).removeprefix("torch.")
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    return "float32"


def validate_source_layout(layout: ParallelLayout, config: ModelConfig, path: Path) -> None:
    """The layout a checkpoint's args describe must fit the model they describe."""
    try:
        layout.validate(config)
    except LayoutError as exc:
        raise CheckpointError(f"{path}: args describe a layout the model does not fit: {exc}") from exc


def check_vocab_multiple(args: argparse.Namespace, tp: int, rows: int, path: Path) -> None:
    """``args.make_vocab_size_divisible_by`` bounded by the vocab rows stored: Megatron-LM pads the
    vocab to a multiple of it times tp, so no checkpoint holds fewer rows (a target's padding is
    re-made from it: a hostile multiple would size the tables written)."""
    multiple = getattr(args, "make_vocab_size_divisible_by", None)
    if isinstance(multiple, int) and not isinstance(multiple, bool) and multiple * tp > rows:
        raise CheckpointError(f"{path}: args.make_vocab_size_divisible_by={multiple} with tensor_model_parallel_size="
                              f"{tp}: Megatron pads the vocab to a multiple of {multiple * tp} rows, but the vocab "
                              f"tables store {rows}")


# Settings whose Megatron-LM argument has another name (the rest are args fields of their own name).
_ARG_NAMES = {"gated_linear_unit": "swiglu", "params_dtype": "bf16"}


def arg_name(setting: str) -> str:
    """How a message names the ``args`` field that gives ModelConfig ``setting``."""
    return f"args.{_ARG_NAMES.get(setting, setting)}"


def config_from_args(args: argparse.Namespace, path: Path, transformer_impl: str,
                     true_vocab_size: int | None, grouped_gemm: bool = False) -> ModelConfig:
    """The ModelConfig a Megatron run's ``args`` describe; a value it refuses is named with the file.

    A field that is None where Megatron-LM never writes None is read as Megatron-LM would have it
    (``layout_from_args`` names it)."""
    try:
        config = _config_from_args(args, path, transformer_impl, true_vocab_size, grouped_gemm)
        return config.replace(mtp_num_layers=_arg_int(args, "mtp_num_layers", path, minimum=0) or 0)  # mtp
    except ConfigError as exc:
        raise CheckpointError(f"{path}: args describe an impossible model: {exc}") from exc


def _config_from_args(args: argparse.Namespace, path: Path, transformer_impl: str,
                      true_vocab_size: int | None, grouped_gemm: bool = False) -> ModelConfig:
    """The ModelConfig a Megatron run's ``args`` describe (megatron-LM's argument defaults apply)."""

    def required(name: str) -> Any:
        value = getattr(args, name, None)
        if value is None:
            raise CheckpointError(f"{path}: args.{name} is missing; cannot determine the model architecture")
        return value

    heads = required("num_attention_heads")
    hidden = required("hidden_size")
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    vocab = true_vocab_size
    if vocab is None and isinstance(getattr(args, "vocab_size", None), int):
        vocab = args.vocab_size
    mlp = _mlp_from_args(args, hidden)
    ffn = mlp["ffn_hidden_size"]
    return ModelConfig.from_settings({
        "num_layers": required("num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        **mlp,
        "num_query_groups": groups or heads,
        "kv_channels": getattr(args, "kv_channels", None) or None,
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": (getattr(args, "make_vocab_size_divisible_by", None)
                                         or MEGATRON_DEFAULTS["make_vocab_size_divisible_by"]),
        "normalization": getattr(args, "normalization", None) or MEGATRON_DEFAULTS["normalization"],
        "norm_epsilon": _arg_float(args, ("norm_epsilon", "layernorm_epsilon"), MEGATRON_DEFAULTS["layernorm_epsilon"],
                                   path),
        "add_bias_linear": bool(arg(args, "add_bias_linear", True)),
        # Megatron-LM before core_v0.5.0 has no add_qkv_bias: linear_qkv's bias is add_bias_linear's
        # (validate_args since then: add_bias_linear turns add_qkv_bias on).
        "add_qkv_bias": bool(arg(args, "add_qkv_bias", arg(args, "add_bias_linear", True))),
        "qk_layernorm": bool(getattr(args, "qk_layernorm", False)),
        "tie_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False),
        "position_embedding_type": _position_embedding_type(args, path),
        "max_position_embeddings": getattr(args, "max_position_embeddings", None),
        "rotary_base": _arg_float(args, ("rotary_base",), float(MEGATRON_DEFAULTS["rotary_base"]), path),
        "params_dtype": _dtype_name(args),
        "transformer_impl": transformer_impl,
        "num_experts": getattr(args, "num_experts", None) or None,
        "moe_ffn_hidden_size": arg(args, "moe_ffn_hidden_size", ffn if getattr(args, "num_experts", None) else None),
        "moe_layer_freq": _moe_layer_freq(getattr(args, "moe_layer_freq", None), path, required("num_layers")),
        "moe_router_topk": getattr(args, "moe_router_topk", None) or MEGATRON_DEFAULTS["moe_router_topk"],
        "moe_shared_expert_intermediate_size": getattr(args, "moe_shared_expert_intermediate_size", None),
        "moe_shared_expert_gate": bool(getattr(args, "moe_shared_expert_gate", False)),
        "moe_router_enable_expert_bias": bool(getattr(args, "moe_router_enable_expert_bias", False)),
        "moe_grouped_gemm": grouped_gemm,
        **hybrid_from_args(args, path),
        **linear_attention_from_args(args, path),
        **semantics_from_args(args, path, CARRIED_SETTINGS),
        **vision_from_args(args, path),
    })


def _mlp_from_args(args: argparse.Namespace, hidden: Any) -> dict[str, Any]:
    """The MLP's size, gating and activation as Megatron-LM's core_transformer_config_from_args sets
    megatron-core's ``gated_linear_unit`` and ``activation_func``: ``--swiglu`` a gated SiLU,
    ``--squared-relu`` squared ReLU, ``--quick-geglu`` a gated quick GELU (GPT-OSS), else ``F.gelu``.

    ``args.openai_gelu`` reaches no TransformerConfig field (only Megatron-LM's legacy model read it), so
    a Megatron-LM run with ``--openai-gelu`` computes ``F.gelu``. Args that record ``gated_linear_unit``,
    which Megatron-LM never writes (pgconvert's, for Gemma's gated GELU), spell the tanh GELU
    ``openai_gelu``; there it means ``gelu_tanh``."""
    swiglu = bool(getattr(args, "swiglu", False))
    squared_relu = bool(getattr(args, "squared_relu", False))
    quick_geglu = bool(getattr(args, "quick_geglu", False)) and not squared_relu
    if swiglu:
        activation = "silu"
    elif squared_relu:
        activation = "squared_relu"
    elif quick_geglu:
        activation = "quick_gelu"
    elif getattr(args, "openai_gelu", False) and hasattr(args, "gated_linear_unit"):
        activation = "gelu_tanh"
    else:
        activation = "gelu"
    # Megatron-LM's validate_args fills the size in when it is not given.
    ffn = getattr(args, "ffn_hidden_size", None) or (megatron_ffn_hidden_size(hidden, swiglu)
                                                     if isinstance(hidden, int) else hidden)
    return {"ffn_hidden_size": ffn, "activation": activation,
            "gated_linear_unit": swiglu or quick_geglu or bool(getattr(args, "gated_linear_unit", False))}


def _position_embedding_type(args: argparse.Namespace, path: Path) -> str:
    """``args.position_embedding_type`` (older runs: ``use_rotary_position_embeddings``); YaRN is RoPE here."""
    position = getattr(args, "position_embedding_type", None)
    if position is None:
        position = "rope" if getattr(args, "use_rotary_position_embeddings", False) else "learned_absolute"
    if position == "yarn":
        position = "rope"  # YaRN-scaled RoPE: pgconvert.semantics.yarn reads its parameters
    if position not in ("rope", MROPE, "learned_absolute", "none"):
        raise CheckpointError(f"{path}: args.position_embedding_type={quote(position)} is not supported")
    return position


def _layout_string(value: Any, path: Path) -> str | None:
    """``args.pipeline_model_parallel_layout``: a string, or megatron-core's parsed layout object."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, OpaqueGlobal) and isinstance(value.state, dict):
        text = value.state.get("input_data")
        if isinstance(text, str):
            return text
    raise CheckpointError(
        f"{path}: args.pipeline_model_parallel_layout={quote(value)} is not a layout string pgconvert can read"
    )


def layout_from_args(args: argparse.Namespace, path: Path, strict: bool = False,
                     notices: list[str] | None = None) -> ParallelLayout:
    """The layout a Megatron run's ``args`` describe. Read first by both Megatron loaders, so it names every
    field of ``args`` that is None where Megatron-LM never writes None, with the value pgconvert reads it as
    (``pgconvert.formats.megatron_args.none_notices``; ``strict``: refused)."""
    none_notices(args, path, strict, notices)

    def size(name: str) -> int:
        value = _arg_int(args, name, path, minimum=1)
        return 1 if value is None else value

    pp = size("pipeline_model_parallel_size")
    tp = size("tensor_model_parallel_size")
    pipeline_layout = _layout_string(getattr(args, "pipeline_model_parallel_layout", None), path) if pp > 1 else None
    vpp = _arg_int(args, "virtual_pipeline_model_parallel_size", path, minimum=1)
    # Megatron ignores the expert TP size of a model without experts (tools/checkpoint copies the
    # source's, e.g. 8, into any dense output), and so does pgconvert.
    expert_tp = (_arg_int(args, "expert_tensor_parallel_size", path, minimum=1)
                 if getattr(args, "num_experts", None) else None)
    try:
        return _layout(args, tp, pp, size("expert_model_parallel_size"), vpp, expert_tp, pipeline_layout, path)
    except LayoutError as exc:
        raise CheckpointError(f"{path}: args describe an impossible layout: {exc}") from exc


def _layout(args: argparse.Namespace, tp: int, pp: int, ep: int, vpp: int | None, expert_tp: int | None,
            pipeline_layout: str | None, path: Path) -> ParallelLayout:
    return ParallelLayout(
        tp=tp,
        pp=pp,
        ep=ep,
        first_stage_layers=_arg_int(args, "decoder_first_pipeline_num_layers", path, minimum=0)
        if pp > 1 and not pipeline_layout else None,
        last_stage_layers=_arg_int(args, "decoder_last_pipeline_num_layers", path, minimum=0)
        if pp > 1 and not pipeline_layout else None,
        vpp=vpp,
        expert_tp=expert_tp if expert_tp is not None and expert_tp != tp else None,
        pipeline_layout=pipeline_layout,
    )


def _arg_int(args: argparse.Namespace, name: str, path: Path, minimum: int) -> int | None:
    """An integer setting of ``args`` (None when absent), refused with the file named unless it is one."""
    value = getattr(args, name, None)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be an integer >= {minimum}")
    return value


def _arg_float(args: argparse.Namespace, names: tuple[str, ...], default: float, path: Path) -> float:
    """The first of ``names`` that ``args`` sets (falsy values fall through, as Megatron-LM reads
    them), refused with the file named unless it is a finite number."""
    for name in names:
        value = getattr(args, name, None)
        if value is None or value == 0 and isinstance(value, (int, float)) and not isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a finite number")
        return float(value)
    return default


def check_megatron_layout(layout: ParallelLayout, flag_prefix: str, path: Path | None = None) -> None:
    """Constraints of the per-rank file format itself (beyond what the model allows)."""
    if layout.expert_tp is not None and layout.expert_tp != layout.tp:
        where = f"{path}: " if path else ""
        # A source's layout comes from its args, not from an option (there is no --src-expert-tp).
        if path is not None:
            flag = f"args.expert_tensor_parallel_size={layout.expert_tp} with tensor_model_parallel_size={layout.tp}"
        else:
            flag = f"--{flag_prefix}-expert-tp {layout.expert_tp}" if flag_prefix else f"expert_tp={layout.expert_tp}"
        raise LayoutError(
            f"{where}{flag}: the megatron per-rank format stores one file per "
            f"(tp rank, ep rank) and needs expert tensor parallel size == tp ({layout.tp}); "
            "use the torch_dist format for a different expert TP"
        )


def _moe_layer_freq(value: Any, path: Path, num_layers: Any) -> int | tuple[int, ...]:
    """``args.moe_layer_freq``: an int, or a 0/1 per layer (Megatron-LM's ``--moe-layer-freq "[1,0]*2"``).
    A list that is megatron-core's pattern of an int k (``get_gpt_decoder_layer_specs``: layer i has
    experts when i % k == 0) reads as k, so both spellings of one model read the same."""
    if value is None:
        return MEGATRON_DEFAULTS["moe_layer_freq"]
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(item, int) for item in value):
        pattern = tuple(value)
        if len(pattern) == num_layers:
            for every in range(1, len(pattern) + 1):
                if pattern == tuple(int(layer % every == 0) for layer in range(len(pattern))):
                    return every
        return pattern
    raise CheckpointError(f"{path}: args.moe_layer_freq={quote(value)}: expected an int or a list of 0/1")


# args fields that Megatron-LM's loaders read without a default (tools/checkpoint/saver_base.py)
UNCONDITIONAL_ARGS = ("sequence_parallel", "apply_query_key_layer_scaling")


def args_for_target(config: ModelConfig, layout: ParallelLayout, padded_vocab_size: int,
                    dtype: torch.dtype, iteration: int | None,
                    base: argparse.Namespace | None) -> argparse.Namespace:
    """The ``args`` a destination rank file carries: the source's, re-described for ``layout``."""
    # Framework enums and objects are kept as stand-ins: they are written back as Megatron's own
    # classes (``FrameworkPickler``), which its validate_args requires.
    args = argparse.Namespace(**vars(base)) if base is not None else argparse.Namespace()
    values = _model_args(config)
    values.update(_layout_args(config, layout))
    values.update(_run_args(padded_vocab_size, dtype, iteration, base))
    values.update(semantics_to_args(config, CARRIED_SETTINGS))
    values.update(hybrid_to_args(config))
    values.update(linear_attention_to_args(config))
    values.update(vision_to_args(config))
    if config.vocab_size is not None:
        values["vocab_size"] = config.vocab_size
    if config.moe.num_experts is not None:
        values.update(_moe_args(config))
    if base is None:
        values.update(_fresh_run_args(config))
    values.update(_size_fields(layout, base))
    # Megatron-LM's tools/checkpoint saver_base reads these unconditionally (AttributeError when
    # absent); neither changes the math. Megatron's defaults, unless the source recorded them.
    for name in UNCONDITIONAL_ARGS:
        if not hasattr(args, name):
            values[name] = False
    for key, value in values.items():
        setattr(args, key, value)
    return args


def _model_args(config: ModelConfig) -> dict[str, Any]:
    """The args describing the model's architecture."""
    return {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.mlp.ffn_hidden_size,
        "num_attention_heads": config.attention.num_attention_heads,
        "group_query_attention": config.attention.query_groups != config.attention.num_attention_heads,
        "num_query_groups": config.attention.query_groups,
        "kv_channels": config.attention.head_dim,
        "swiglu": config.mlp.gated_linear_unit and config.mlp.activation == "silu",
        "gated_linear_unit": config.mlp.gated_linear_unit,
        "openai_gelu": config.mlp.activation == "gelu_tanh",
        "squared_relu": config.mlp.activation == "squared_relu",
        "quick_geglu": config.mlp.activation == "quick_gelu",
        "normalization": config.norms.normalization,
        "norm_epsilon": config.norms.norm_epsilon,
        "add_bias_linear": config.add_bias_linear,
        "add_qkv_bias": config.attention.add_qkv_bias,
        "qk_layernorm": config.attention.qk_layernorm,
        "untie_embeddings_and_output_weights": not config.tie_embeddings,
        "position_embedding_type": config.positions.position_embedding_type,
        "max_position_embeddings": config.positions.max_position_embeddings,
        "rotary_base": config.positions.rotary_base,
        "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by,
        "transformer_impl": config.transformer_impl,
        "mtp_num_layers": config.mtp_num_layers or None,  # megatron-core's "no MTP" is None
    }


def _layout_args(config: ModelConfig, layout: ParallelLayout) -> dict[str, Any]:
    """The args describing the parallel layout (sizes of the run aside: ``_size_fields``)."""
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "expert_model_parallel_size": layout.ep,
        "decoder_first_pipeline_num_layers": layout.first_stage_layers,
        "decoder_last_pipeline_num_layers": layout.last_stage_layers,
        "expert_tensor_parallel_size": layout.expert_tp_size,
        "virtual_pipeline_model_parallel_size": layout.virtual_size if layout.has_virtual_chunks else None,
        "num_layers_per_virtual_pipeline_stage": _layers_per_virtual_stage(config, layout),
        "pipeline_model_parallel_layout": layout.pipeline_layout,
    }


def _run_args(padded_vocab_size: int, dtype: torch.dtype, iteration: int | None,
              base: argparse.Namespace | None) -> dict[str, Any]:
    """The vocab padding, dtype flags, iteration and checkpoint format of the written files."""
    return {"padded_vocab_size": padded_vocab_size, **run_dtype_args(dtype, base), "iteration": iteration,
            "ckpt_format": "torch"}


def run_dtype_args(dtype: torch.dtype, base: argparse.Namespace | None) -> dict[str, Any]:
    """The dtype flags of a run in ``dtype`` whose other args are ``base``'s. A run changed to bfloat16 also gets
    what Megatron-LM's validate_args sets for one: gradients accumulated and all-reduced in fp32 unless
    ``main_grads_dtype`` is bf16 (it keys the distributed optimizer's flat buffers, ``optimizer.flat``)."""
    values: dict[str, Any] = {"params_dtype": dtype, "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}
    if dtype == torch.bfloat16 and base is not None and _dtype_name(base) != "bfloat16":
        main_grads = str(getattr(base, "main_grads_dtype", "fp32")).removeprefix("torch.")
        values["accumulate_allreduce_grads_in_fp32"] = main_grads in ("fp32", "float32")
    return values


def _moe_args(config: ModelConfig) -> dict[str, Any]:
    """The mixture-of-experts args of a model with experts."""
    return {
        "num_experts": config.moe.num_experts,
        "moe_ffn_hidden_size": config.expert_ffn_size,
        "moe_layer_freq": list(config.moe.moe_layer_freq) if isinstance(config.moe.moe_layer_freq, tuple)
        else config.moe.moe_layer_freq,
        "moe_router_topk": config.moe.moe_router_topk,
        "moe_shared_expert_intermediate_size": config.moe.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": config.moe.moe_shared_expert_gate,
        "moe_router_enable_expert_bias": config.moe.moe_router_enable_expert_bias,
        "moe_grouped_gemm": config.moe.moe_grouped_gemm,
    }


def _fresh_run_args(config: ModelConfig) -> dict[str, Any]:
    """What megatron-LM's check_checkpoint_args and its own HF importers expect of args that did
    not come from a training run."""
    return {
        "add_position_embedding": config.positions.position_embedding_type == "learned_absolute",
        "use_rotary_position_embeddings": config.positions.position_embedding_type in ROTARY_TYPES,
        "layernorm_epsilon": config.norms.norm_epsilon,
        "tokenizer_type": "HuggingFaceTokenizer",
        "seq_length": config.positions.max_position_embeddings,
    }


def _size_fields(layout: ParallelLayout, base: argparse.Namespace | None) -> dict[str, int]:
    """``world_size`` and the sizes derived from it, describing ``layout`` (never the source's run).

    The data-parallel size is the smallest that Megatron's expert grid allows: tp * dp * cp must be
    a multiple of expert_tp * ep. The source's context-parallel size is kept (it shards no weight).
    """
    cp = int(getattr(base, "context_parallel_size", None) or 1) if base is not None else 1
    dense_ranks = layout.tp * cp
    expert_ranks = layout.expert_tp_size * layout.ep
    dp = expert_ranks // math.gcd(expert_ranks, dense_ranks)
    return {
        "world_size": layout.tp * layout.pp * cp * dp,
        "data_parallel_size": dp,
        "context_parallel_size": cp,
        "transformer_pipeline_model_parallel_size": layout.pp,
    }


def _layers_per_virtual_stage(config: ModelConfig, layout: ParallelLayout) -> int | None:
    """Megatron's ``num_layers_per_virtual_pipeline_stage`` (even interleaving only)."""
    if not layout.has_virtual_chunks or layout.pipeline_layout is not None:
        return None
    if layout.first_stage_layers is not None or layout.last_stage_layers is not None:
        return None
    return config.num_layers // (layout.pp * layout.virtual_size)


def list_megatron_iterations(root: Path, is_iteration_dir: Callable[[Path], bool]) -> list[Iteration]:
    """Every ``iter_*`` directory under ``root`` (ascending), then ``release``; ``root`` itself when
    ``is_iteration_dir`` says it is one. The directories ``resolve_megatron_iteration`` can open."""
    if is_iteration_dir(root):
        match = ITERATION_DIR_RE.match(root.name)
        if match:
            return [int(match.group(1))]
        return [RELEASE] if root.name == RELEASE else []
    numbered = sorted(int(match.group(1)) for child in root.iterdir()
                      if child.is_dir() and (match := ITERATION_DIR_RE.match(child.name)))
    return [*numbered, *([RELEASE] if (root / RELEASE).is_dir() else [])]


def resolve_megatron_iteration(root: Path, iteration: int | None,
                               is_iteration_dir: Callable[[Path], bool]) -> tuple[Path, int | None, bool]:
    """The iteration directory to read: ``root`` itself when ``is_iteration_dir`` says it is one, else
    ``--iteration``, the tracker file, or the only iteration present (as Megatron-LM resolves it).

    Both Megatron formats (per-rank and torch_dist) share this layout of ``iter_*``/``release``
    directories under one tracker file.
    """
    if is_iteration_dir(root):
        match = ITERATION_DIR_RE.match(root.name)
        return root, int(match.group(1)) if match else None, root.name == "release"
    present = sorted(int(m.group(1)) for child in root.iterdir()
                     if child.is_dir() and (m := ITERATION_DIR_RE.match(child.name)))
    has_release = (root / "release").is_dir()
    listing = ", ".join(map(str, present)) or "none"
    if iteration is not None:
        directory = root / iteration_dir_name(iteration, release=False)
        if not directory.is_dir():
            raise CheckpointError(f"{root}: --iteration {iteration}: {directory.name} does not exist (present: {listing})")
        return directory, iteration, False
    tracker = root / TRACKER_FILE
    if tracker.is_file():
        text = _read_tracker(tracker)
        if text == "release":
            if not has_release:
                raise CheckpointError(f"{tracker}: names 'release' but {root / 'release'} is missing")
            return root / "release", None, True
        if not re.fullmatch(r"[0-9]+", text):
            raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found {quote(text)}")
        directory = root / iteration_dir_name(int(text), release=False)
        if not directory.is_dir():
            raise CheckpointError(f"{tracker}: names iteration {int(text)} but {directory.name} is missing (present: {listing})")
        return directory, int(text), False
    if has_release and not present:
        return root / "release", None, True
    if len(present) == 1 and not has_release:
        return root / iteration_dir_name(present[0], release=False), present[0], False
    if not present:
        raise CheckpointError(f"{root}: no {TRACKER_FILE}, iter_* or release directory")
    raise CheckpointError(f"{root}: no {TRACKER_FILE} and several iterations ({listing}"
                          f"{', release' if has_release else ''}); choose one with --iteration")


def _read_tracker(tracker: Path) -> str:
    """The tracker file's text: a few ASCII characters (a number or ``release``), else refused."""
    try:
        with open(tracker, "rb") as handle:
            data = handle.read(MAX_TRACKER_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{tracker}: cannot be read: {exc.strerror or exc}") from exc
    if len(data) > MAX_TRACKER_BYTES:
        raise over_limit(tracker, "the tracker file's size in bytes", tracker.stat().st_size, "MAX_TRACKER_BYTES")
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found the non-ASCII "
                              f"bytes {quote(data)}") from None
