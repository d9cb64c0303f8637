"""A LoRA adapter as Megatron-Bridge saves it for a Megatron GPT model, read and put in PEFT's form.

Megatron-Bridge's ``LoRA`` wraps each targeted megatron-core linear of a layer (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``) with a ``ParallelLinearAdapter``: ``linear_in`` (A, ``[dim, in]``) and
``linear_out`` (B, ``[out, dim]``), its output scaled by ``alpha / dim``. An adapter run's checkpoint is a
torch_dist store of the adapter keys alone (``decoder.layers.<module>.adapter.linear_in.weight``, the layers
stacked on a leading axis, or one key per layer ``decoder.layers.<L>.<module>…``) beside ``run_config.yaml``,
whose ``peft`` section gives ``dim``, ``alpha``, ``dropout`` and ``target_modules``. A checkpoint of the wrapped
model saved whole holds the same adapter keys beside the base model's (under their plain names: the wrapper gives
``to_wrap`` its own prefix); they are read the same way, the base's left to the checkpoint's loader. The store
holds global shapes, so what is read is the same at any TP: ``linear_in`` whole (TP split its ``dim`` rows for a
column-parallel base, its ``in`` columns for a row-parallel one) and ``linear_out`` whole, its rows in the base
weight's canonical order (a fused ``linear_qkv``'s by query group; a gated ``linear_fc1``'s ``[gate; up]``, which
megatron-core's swiglu factory stores apart per rank, as it does the base's).

In PEFT's names a canonical module's pair becomes one pair per HF weight of it: lora_A is ``linear_in``, the same
for every part; lora_B is the part's rows of ``linear_out``, cut by the family transform's ``split``. Those
transforms only move rows, so each part's ``B @ A`` is exactly the part's rows of the canonical delta; ``r`` is
``dim`` and ``lora_alpha`` is ``alpha``, so PEFT's scaling is Megatron-Bridge's. This is the form
Megatron-Bridge's own ``save_hf_adapter`` writes (q/k/v and gate/up sharing lora_A). A MoE layer's routed experts'
adapters are read as one pair per expert and put in PEFT's fused experts form by ``adapters.megatron_experts``; an MTP
layer's (``mtp.layers.<i>.…``) as a decoder layer's; ``CanonicalLoRA``'s q/k/v and gate/up pairs each as its HF
projection's own (``adapters.megatron_canonical``).

Megatron-Bridge's ``DoRA`` (peft/dora.py, ``_target_`` ``megatron.bridge.peft.dora.DoRA``) wraps the same modules
with a ``ParallelLinearDoRAAdapter`` (peft/dora_layers.py): the same pair, and ``weight_magnitude``, one value per
output row of the wrapped module (``decoder.layers.<module>.adapter.weight_magnitude``, ``[layers, out]`` stacked),
its output ``m / ||W + s·B·A||_row * (W x + s·B·A x)`` (dora_layers.py:129-160): PEFT's DoRA. Its norm is taken
of what the rank holds (dora_layers.py:122-130), so the two agree where every rank holds whole rows: a
column-parallel module (linear_qkv, linear_fc1) at any TP, a row-parallel one (linear_proj, linear_fc2) at TP 1 only;
a row-parallel DoRA trained at a larger TP (run_config.yaml's ``model.tensor_model_parallel_size``) took the norm of
each rank's columns and is refused by name. A column-parallel magnitude is saved TP-sharded on its rows
(dora_layers.py:76-80), with no swiglu factory: a gated ``linear_fc1``'s is each rank's ``[gate_r; up_r]`` back to
back, put in canonical ``[gate; up]`` order here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pgconvert.adapters.megatron_canonical import CANONICAL_LORA_TARGET, check_part, part_name, rank_ordered_rows
from pgconvert.adapters.megatron_experts import (EXPERT_WEIGHT, EXPERTS_KEY_ENDS, FUSED_PARAMETERS, expert_pairs,
                                                 fused_experts_pairs, hf_experts_module, is_experts_module)
from pgconvert.adapters.peft import KEY_PREFIX, AdapterTensors, PeftAdapter, peft_adapter
from pgconvert.errors import CheckpointError, PgconvertError, ValidationError
from pgconvert.adapters.names import loaded_hf_weights
from pgconvert.families.table import Family, Transform
from pgconvert.io import limits
from pgconvert.io.limits import quote
from pgconvert.formats.megatron_bridge import RUN_CONFIG_FILE, read_run_config, run_config_beside
from pgconvert.io.sizes import dtype_name
from pgconvert.formats.megatron import is_adapter_key
from pgconvert.model.config import ModelConfig

# What inspect calls a Megatron-Bridge adapter checkpoint's format.
ADAPTER_FORMAT = "megatron-bridge-lora"
# Megatron-Bridge's plain LoRA (peft/lora.py); its other PEFT methods compute something else or store other keys.
LORA_TARGET = "megatron.bridge.peft.lora.LoRA"
# Megatron-Bridge's DoRA (peft/dora.py): the same pairs and a magnitude per output row.
DORA_TARGET = "megatron.bridge.peft.dora.DoRA"
_LORA_TARGETS = (LORA_TARGET, CANONICAL_LORA_TARGET, DORA_TARGET)
_ADAPTER_KEY = re.compile(r"(?P<block>decoder|mtp)\.layers\.(?:(?P<layer>\d+)\.)?(?P<module>(?:\w+\.)*?\w+)"
                          r"\.adapter\.(?:(?:adapter_(?P<part>q|k|v|gate|up)\.)?linear_(?P<side>in|out)\.weight"
                          r"|(?P<magnitude>weight_magnitude))")
# The row-parallel linears (megatron-core's RowParallelLinear): their TP pieces hold some columns of every row.
ROW_PARALLEL_MODULES = ("linear_proj", "linear_fc2")


@dataclass(frozen=True)
class MegatronPair:
    """One adapted canonical module: ``linear_in`` ``[dim, in]`` and ``linear_out`` ``[out, dim]``, whole."""

    weight: str  # the canonical weight it changes: decoder.layers.3.self_attention.linear_qkv.weight
    linear_in: torch.Tensor
    linear_out: torch.Tensor
    # DoRA's weight_magnitude ([out], as stored: see ``MegatronAdapter.magnitude``), None for LoRA.
    magnitude: torch.Tensor | None = None
    part: int | None = None  # CanonicalLoRA: which of the weight's HF parts it alone changes (q, k, v; gate, up)


@dataclass(frozen=True, eq=False)
class MegatronAdapter:
    """A Megatron-Bridge LoRA checkpoint: where it is, its settings and its pairs by canonical weight."""

    directory: Path
    run_config: Path
    dim: int
    alpha: float
    dropout: float
    pairs: dict[str, MegatronPair]
    method: str = "lora"  # "dora" for Megatron-Bridge's DoRA
    tp: int = 1  # a DoRA run's TP size: the order its gated linear_fc1's magnitude is stored in

    def delta(self, weight: str) -> torch.Tensor:
        """``linear_out @ linear_in * alpha / dim`` in float32: the canonical weight's update."""
        pair = self.pairs[weight]
        return (pair.linear_out.to(torch.float32) @ pair.linear_in.to(torch.float32)) * (self.alpha / self.dim)

    def magnitude(self, weight: str, gated: bool) -> torch.Tensor | None:
        """A DoRA pair's magnitude in the canonical rows' order (``gated``: the model's linear_fc1 is ``[gate; up]``,
        whose magnitude a TP ``tp`` run stores as each rank's ``[gate_r; up_r]`` back to back), None for LoRA."""
        pair = self.pairs[weight]
        if pair.magnitude is None or not (gated and self.tp > 1 and weight.endswith("linear_fc1.weight")):
            return pair.magnitude
        return pair.magnitude.reshape(self.tp, 2, -1).transpose(0, 1).reshape(-1)


def find_adapter_store(path: Path, beside_model: bool = False) -> tuple[Path, Path] | None:
    """The torch_dist store of a Megatron-Bridge adapter run at ``path`` (the run's directory or an iteration's) and
    its run_config.yaml, or None when ``path`` is none: a store whose every model tensor is an adapter's, or
    (``beside_model``) one that holds adapter tensors beside others (the wrapped model saved whole)."""
    found = _found_store(path, beside_model)
    return None if found is None else found[:2]


def _found_store(path: Path, beside_model: bool) -> tuple[Path, Path, Any] | None:
    """``find_adapter_store`` with the store's ``.metadata`` as read."""
    from pgconvert.formats.dcp_layout import DCP_METADATA_FILE
    from pgconvert.formats.torch_dist import read_dcp_metadata, resolve_iteration_dir

    if not path.is_dir():
        return None
    try:
        store = resolve_iteration_dir(path, None)[0]
        run_config = run_config_beside(store)
        if not (store / DCP_METADATA_FILE).is_file() or run_config is None:
            return None
        metadata = read_dcp_metadata(store / DCP_METADATA_FILE)
    except (PgconvertError, OSError):  # not a Megatron checkpoint: what it is, its reader says
        return None
    keys = _tensor_keys(metadata)
    adapted = [key for key in keys if is_adapter_key(key)]
    return (store, run_config, metadata) if adapted and (beside_model or len(adapted) == len(keys)) else None


def _tensor_keys(metadata: Any) -> list[str]:
    """The model's tensor keys (the run's optimizer state, ``optimizer.state.<state>.<parameter key>``, left out)."""
    from pgconvert.io.dcp_plan import TensorStorageMetadata

    from pgconvert.formats.torch_dist import TRAINING_STATE_PREFIXES

    return [key for key, value in metadata.state_dict_metadata.items()
            if isinstance(value, TensorStorageMetadata) and not key.startswith(TRAINING_STATE_PREFIXES)]


def read_megatron_adapter(path: Path) -> MegatronAdapter:
    """The Megatron-Bridge LoRA adapter at ``path``, its settings checked and its pairs read whole."""
    found = _found_store(path, beside_model=True)
    if found is None:
        raise ValidationError(f"{path}: not a Megatron-Bridge LoRA checkpoint (a torch_dist store of '.adapter.' "
                              f"keys, alone or beside the model's, as a LoRA run saves, with its {RUN_CONFIG_FILE})")
    store, run_config, metadata = found
    settings = _peft_settings(run_config)
    dim, alpha = settings["dim"], settings["alpha"]
    dropout = settings.get("dropout") or 0.0
    if not isinstance(dropout, (int, float)):
        raise ValidationError(f"{run_config}: peft.dropout={quote(dropout)}: expected a number")
    pairs = _read_pairs(store, metadata, dim, run_config)
    dora = settings["_target_"] == DORA_TARGET
    tp = _dora_tp(pairs, store, run_config) if dora else 1
    if not dora and any(pair.magnitude is not None for pair in pairs.values()):
        raise ValidationError(f"{store}: holds DoRA's weight_magnitude, but {run_config.name} gives "
                              f"peft._target_={quote(settings['_target_'])}")
    return MegatronAdapter(store, run_config, dim, alpha, float(dropout), pairs, "dora" if dora else "lora", tp)


def _dora_tp(pairs: dict[str, MegatronPair], store: Path, run_config: Path) -> int:
    """A DoRA run's TP size, its pairs checked to have a magnitude of their rows each and to take the norm of whole
    rows (see the module's docstring)."""
    model = read_run_config(run_config).get("model")
    tp = model.get("tensor_model_parallel_size") if isinstance(model, dict) else None
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValidationError(f"{run_config}: model.tensor_model_parallel_size={quote(tp)}: a DoRA run's TP size is "
                              "needed (Megatron-Bridge takes each rank's norm and saves fc1's magnitude per rank)")
    for weight, pair in pairs.items():
        rows = pair.linear_out.shape[0]
        where = f"{store}: {weight.removesuffix('.weight')}.adapter.weight_magnitude"
        if pair.magnitude is None or tuple(pair.magnitude.shape) != (rows,):
            said = "is missing" if pair.magnitude is None else f"has shape {list(pair.magnitude.shape)}"
            raise ValidationError(f"{where} {said}: a DoRA run saves one magnitude per output row ({rows})")
        if tp > 1 and weight.removesuffix(".weight").endswith(ROW_PARALLEL_MODULES):
            raise ValidationError(f"{where}: a row-parallel module's DoRA trained at TP {tp}: Megatron-Bridge took "
                                  "the norm of each rank's columns, not of whole rows, which no whole-weight DoRA "
                                  "(PEFT's) computes")
    return tp


def _peft_settings(run_config: Path) -> dict[str, Any]:
    """run_config.yaml's ``peft`` section, checked to be a LoRA or DoRA with a positive ``dim`` and ``alpha``."""
    doc = read_run_config(run_config)
    peft = doc.get("peft")
    if not isinstance(peft, dict):
        raise ValidationError(f"{run_config}: no peft section: not a PEFT run's checkpoint")
    target = peft.get("_target_")
    if target not in _LORA_TARGETS:
        raise ValidationError(f"{run_config}: peft._target_={quote(target)}: only Megatron-Bridge's LoRA, CanonicalLoRA "
                              f"and DoRA ({', '.join(_LORA_TARGETS)}) are read")
    for key in ("dim", "alpha"):
        value = peft.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            said = "is missing" if key not in peft else f"={quote(value)}"
            raise ValidationError(f"{run_config}: peft.{key} {said}: expected a positive number")
    if not isinstance(peft["dim"], int):
        raise ValidationError(f"{run_config}: peft.dim={quote(peft['dim'])}: expected an integer")
    return peft


def _read_pairs(store: Path, metadata: Any, dim: int, run_config: Path) -> dict[str, MegatronPair]:
    """Every adapted module's ``linear_in`` and ``linear_out`` (``metadata``: the store's ``.metadata``), whole, by the
    canonical weight they change (a routed experts' module: one pair per expert, ``adapters.megatron_experts``; a
    CanonicalLoRA part's pair by ``megatron_canonical.part_name``)."""
    pairs = {}
    for (block, layer, module, part), found in sorted(_read_sides(store, metadata).items()):
        prefix = f"{block}.layers.{layer}."
        name = f"{prefix}{module}.adapter" + (f".adapter_{part}" if part else "")
        if not {"in", "out"} <= set(found):
            held = ", ".join("weight_magnitude" if side == "magnitude" else f"linear_{side}" for side in sorted(found))
            raise CheckpointError(f"{store}: {name} has {held} without linear_{'out' if 'in' in found else 'in'}")
        magnitude = found.get("magnitude")
        if is_experts_module(module):
            if magnitude is not None:
                raise ValidationError(f"{store}: {name}.weight_magnitude: DoRA on routed experts is not read")
            split = expert_pairs(str(store), prefix, module, found["in"], found["out"])
        else:
            split = {f"{prefix}{module}.weight": (found["in"], found["out"])}
        for weight, (a, b) in split.items():
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != dim or b.shape[1] != dim:
                raise ValidationError(f"{store}: {weight.removesuffix('.weight')}.adapter: linear_in {list(a.shape)} "
                                      f"and linear_out {list(b.shape)} do not make a rank-{dim} pair "
                                      f"({run_config.name} gives dim={dim})")
            index = check_part(str(store), f"{prefix}{module}", part) if part else None
            pairs[part_name(weight, part) if part else weight] = MegatronPair(weight, a, b, magnitude, index)
    return pairs


def _read_sides(store: Path, metadata: Any) -> dict[tuple[str, int, str, str | None], dict[str, torch.Tensor]]:
    """Each adapter's sides by (``decoder``/``mtp``, layer, module, CanonicalLoRA part or None) and side."""
    from pgconvert.formats.dcp_store import DcpStore

    sides: dict[tuple[str, int, str, str | None], dict[str, torch.Tensor]] = {}
    reader = DcpStore(store, metadata)
    for key in sorted(key for key in _tensor_keys(metadata) if is_adapter_key(key)):  # the base model's left out
        match = _ADAPTER_KEY.fullmatch(key)
        if match is None or (".experts." in match["module"] and not is_experts_module(match["module"])) or (
                match["block"] == "mtp" and match["layer"] is None):
            raise ValidationError(f"{store}: {key}: not a LoRA adapter key of a decoder or MTP layer "
                                  "(decoder.layers.<module>.adapter.linear_in/linear_out.weight, mtp.layers.<i>."
                                  "<module>…, a routed experts' module mlp.experts.experts.linear_fc1/2); other "
                                  "models' adapters are not read yet")
        if match["part"]:
            check_part(str(store), key.partition(".adapter.")[0], match["part"])
        meta = metadata.state_dict_metadata[key]
        side = match["side"] or "magnitude"
        for layer, tensor in _layer_tensors(reader, key, meta, match["layer"], side == "magnitude"):
            if match["part"] in ("gate", "up") and side == "out":
                half = min(int(chunk.sizes[-2]) for chunk in meta.chunks)
                tensor = rank_ordered_rows(tensor, half, f"{store}: {key}")
            sides.setdefault((match["block"], layer, match["module"], match["part"]), {})[side] = tensor
    return sides


def _layer_tensors(reader: Any, key: str, meta: Any, layer: str | None,
                   magnitude: bool) -> list[tuple[int, torch.Tensor]]:
    """The key's tensor per layer (``magnitude``: a DoRA magnitude's rows; else a side's rows and columns, a routed
    experts' with an expert axis first): one (a key per layer), or each layer a stacked key holds
    chunks of (megatron-core writes a chunk per layer and rank; a store written whole has one chunk of every
    layer)."""
    shape = tuple(meta.size)
    if layer is not None and int(layer) > limits.MAX_LAYERS:
        raise limits.over_limit(f"{reader.directory}: {key}", "the layer index", int(layer), "MAX_LAYERS")
    if layer is not None:
        buffer = torch.empty(shape, dtype=meta.properties.dtype)
        reader.read({key: [((0,) * len(shape), buffer)]}, [])
        return [(int(layer), buffer)]
    expected = (2,) if magnitude else (3, 4)
    if len(shape) not in expected:
        raise CheckpointError(f"{reader.directory}: {key}: global shape {list(shape)}, expected "
                              + ("[layers, rows]" if magnitude else "[layers, rows, columns] (a routed experts' "
                                                                    "side: [layers, experts, rows, columns])"))
    if shape[0] > limits.MAX_LAYERS:
        raise limits.over_limit(f"{reader.directory}: {key}", "the stacked layer count", shape[0], "MAX_LAYERS")
    layers = sorted({layer for chunk in meta.chunks
                     for layer in range(int(chunk.offsets[0]), int(chunk.offsets[0]) + int(chunk.sizes[0]))})
    buffers = [torch.empty((1, *shape[1:]), dtype=meta.properties.dtype) for _ in layers]
    origin = (0,) * (len(shape) - 1)
    reader.read({key: [((index, *origin), buffer) for index, buffer in zip(layers, buffers, strict=True)]}, [])
    return [(index, buffer[0]) for index, buffer in zip(layers, buffers, strict=True)]


def peft_settings(adapter: MegatronAdapter, modules: list[str], base_model: str | None,
                  parameters: list[str] | None = None) -> dict[str, Any]:
    """adapter_config.json for the adapter's pairs on HF ``modules`` (and fused experts ``parameters``):
    Megatron-Bridge's ``build_adapter_config_dict`` (models/conversion/peft_bridge.py), ``r = dim`` and
    ``lora_alpha = alpha``."""
    settings = {
        "peft_type": "LORA", "auto_mapping": None, "base_model_name_or_path": base_model or "", "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "lora_alpha": adapter.alpha,
        "lora_dropout": adapter.dropout, "modules_to_save": None, "r": adapter.dim, "rank_pattern": {},
        "alpha_pattern": {}, "target_modules": sorted({module.rpartition(".")[2] for module in modules}),
        "task_type": "CAUSAL_LM", "use_dora": adapter.method == "dora", "use_rslora": False,
    }
    return {**settings, "target_parameters": sorted(set(parameters))} if parameters else settings


def peft_tensors(adapter: MegatronAdapter, family: Family, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The adapter's pairs in PEFT's keys for ``family``: lora_A shared by a fused module's parts, lora_B and a DoRA
    magnitude cut as the weight's rows are; the routed experts' pairs as transformers' fused experts parameters
    (``megatron_experts.fused_experts_pairs``)."""
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, tuple[torch.Tensor, list[torch.Tensor]]]] = {}
    for weight, pair in adapter.pairs.items():
        magnitude = adapter.magnitude(weight, config.mlp.gated_linear_unit)
        rows = [pair.linear_out] if magnitude is None else [pair.linear_out, magnitude.unsqueeze(1)]
        names, parts = _hf_parts(adapter, family, config, pair, rows)
        if EXPERT_WEIGHT.fullmatch(weight) is not None:
            experts.setdefault(hf_experts_module(names), {})[weight] = (pair.linear_in, parts[0])
            continue
        for index, hf in enumerate(names):
            module = KEY_PREFIX + hf.removesuffix(".weight")
            tensors[f"{module}.lora_A.weight"] = pair.linear_in.clone()
            tensors[f"{module}.lora_B.weight"] = parts[0][index].contiguous()
            if magnitude is not None:
                tensors[f"{module}.lora_magnitude_vector"] = parts[1][index][:, 0].contiguous()
    for module, pairs in sorted(experts.items()):
        fused = fused_experts_pairs(pairs, module, config.moe.num_experts or 0, str(adapter.directory))
        tensors.update({KEY_PREFIX + key: value for key, value in fused.items()})
    return tensors


def moves_rows(transform: Transform, shape: tuple[int, ...], config: ModelConfig) -> bool:
    """Whether ``transform`` makes a canonical weight of ``shape`` of its HF parts by moving whole rows (then a
    pair's B is cut or joined as the weight's rows are, its A the same for every part)."""
    parts = transform.part_shapes(shape, config)
    return sum(part[0] for part in parts) == shape[0] and all(tuple(part[1:]) == shape[1:] for part in parts)


def _hf_parts(adapter: MegatronAdapter, family: Family, config: ModelConfig, pair: MegatronPair,
              rows: list[torch.Tensor]) -> tuple[tuple[str, ...], list[list[torch.Tensor]]]:
    """The HF weights (as transformers names them in memory) of the pair's canonical weight, and each of ``rows``
    (tensors of the weight's rows: linear_out, a magnitude column) cut into the parts' rows; refused where the
    family's transform does not only move rows."""
    found = loaded_hf_weights(family, pair.weight, config)
    if found is None:
        raise ValidationError(f"{adapter.directory}: adapts {pair.weight}, which the model "
                              f"({family.architecture}, {config.num_layers} layers) does not have as a weight")
    row, names = found
    if pair.part is not None:  # a CanonicalLoRA part's pair: that HF weight's own
        if pair.part >= len(names):
            raise ValidationError(f"{adapter.directory}: {pair.weight}: a CanonicalLoRA pair of part {pair.part}, "
                                  f"the model's weight has {len(names)} HF parts ({', '.join(names)})")
        return (names[pair.part],), [[tensor] for tensor in rows]
    shape = (pair.linear_out.shape[0], pair.linear_in.shape[1])
    parts = [row.transform.split(tensor, config) for tensor in rows] if moves_rows(row.transform, shape, config) else []
    if any(len(cut) != len(names) for cut in parts) or not parts:
        raise ValidationError(f"{adapter.directory}: {pair.weight}: the family's {row.transform.name} transform into "
                              f"{', '.join(names)} does not only move rows: no exact split of linear_out")
    return names, parts


def as_peft_adapter(adapter: MegatronAdapter, family: Family, config: ModelConfig,
                    base_model: str | None = None) -> PeftAdapter:
    """The adapter as a PEFT adapter in memory (checked as a PEFT directory is): what a merge reads."""
    tensors = peft_tensors(adapter, family, config)
    modules = [key.removeprefix(KEY_PREFIX).removesuffix(".lora_A.weight") for key in tensors
               if key.endswith(".lora_A.weight") and not key.endswith(EXPERTS_KEY_ENDS)]
    parameters = [FUSED_PARAMETERS[found["linear"]] for weight in adapter.pairs
                  if (found := EXPERT_WEIGHT.fullmatch(weight)) is not None]
    return peft_adapter(adapter.directory, peft_settings(adapter, modules, base_model, parameters),
                        AdapterTensors(adapter.directory, tensors), adapter.run_config)


def describe_megatron_adapter(adapter: MegatronAdapter) -> dict[str, Any]:
    """What ``inspect`` shows of a Megatron-Bridge adapter: settings, modules (by their name within a layer),
    layers, dtypes and bytes."""
    tensors = [tensor for pair in adapter.pairs.values() for tensor in (pair.linear_in, pair.linear_out, pair.magnitude)
               if tensor is not None]
    layers = sorted({int(found[1]) for weight in adapter.pairs
                     if (found := re.match(r"decoder\.layers\.(\d+)\.", weight)) is not None})
    return {
        "base_model": None,
        "method": adapter.method,
        "pairs": len(adapter.pairs),
        "ranks": [adapter.dim],
        "scalings": [adapter.alpha / adapter.dim],
        "modules": sorted({re.sub(r"^decoder\.layers\.\d+\.", "", weight).removesuffix(".weight")
                           for weight in adapter.pairs}),
        "layers": layers,
        "saved_weights": [],
        "dtypes": sorted({dtype_name(tensor.dtype) for tensor in tensors}),
        "bytes": sum(tensor.numel() * tensor.element_size() for tensor in tensors),
    }
