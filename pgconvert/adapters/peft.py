"""A Hugging Face PEFT LoRA adapter directory, read and checked: one low-rank pair per adapted weight.

PEFT writes ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern`` / ``alpha_pattern`` keyed by module-name patterns, ...) and
``adapter_model.safetensors`` holding ``base_model.model.<module>.lora_A.weight`` (rank x in) and
``...lora_B.weight`` (out x rank) for each adapted ``nn.Linear``. The module's weight changes by
``(B @ A) * scaling``, ``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``), computed as PEFT's
``get_delta_weight`` computes it.

An MoE model's MLP targets become ``target_parameters`` on transformers' fused experts (PEFT's
``ParamWrapper``): one pair per fused parameter of a layer's ``experts`` module (``gate_up_proj``, ``down_proj``;
a second one on the same module is keyed under ``.base_layer``), A holding ``rank x in`` rows per expert
(expert-major) and B ``out x rank`` columns per expert (rank-major), so expert ``e``'s delta is
``B[:, e::E] @ A[e*r:(e+1)*r]`` times the scaling of ``<module>.<parameter>``.

A DoRA adapter (``use_dora: true``) also holds ``<module>.lora_magnitude_vector`` (``[out]``, the key PEFT's
``LoraModel._get_adapter_state_dict`` writes, without ``.weight``) for each adapted ``nn.Linear``: the merged
weight is ``m / ||W + delta||_row * (W + delta)`` (``DoraLinearVariant.merge_unsafe``), the norm of each output row
over the input dimension. DoRA on embeddings and on fused experts' parameters is refused by name. Settings that make
an adapter compute anything else (trained biases, replaced modules, activated LoRA, initialisations that changed
the base weights) are refused by name: merging such an adapter as a plain LoRA would silently change the model.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pgconvert.errors import CheckpointError, ValidationError
from pgconvert.formats.hf import read_header, read_tensor, read_tensor_range
from pgconvert.formats.stream import TensorMeta
from pgconvert.io.limits import quote, read_json

# What inspect calls an adapter directory's format.
ADAPTER_FORMAT = "peft-lora"
# What inspect calls the two methods a LoRA adapter's pairs compute.
LORA, DORA = "lora", "dora"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"
# PEFT's prefix of every adapter key: the PeftModel's base_model (LoraModel) and its model.
KEY_PREFIX = "base_model.model."
_PAIR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<embedding>embedding_)?(?P<side>[AB])(?P<weight>\.weight)?")
# A whole weight the adapter file holds: a ``modules_to_save`` module's, or the base weight PEFT saves beside an
# adapted embedding or output layer (``base_layer``), which loading the adapter puts in place of the model's.
# DoRA's magnitude of an adapted module's output rows, as PEFT saves it (its ``.weight`` taken off).
_MAGNITUDE_SUFFIX = ".lora_magnitude_vector"
_SAVED_KEY = re.compile(r"(?P<module>.+?)(?P<base>\.base_layer)?\.(?P<param>weight|bias)")

# adapter_config.json settings under which the adapter computes something a plain LoRA merge does not:
# the key, the value that is plain LoRA, and what it would do otherwise.
_PLAIN_SETTINGS: tuple[tuple[str, object, str], ...] = (
    ("lora_bias", False, "the adapter trains a bias of its own"),
    ("bias", "none", "the run trained the base model's biases, which the adapter file holds"),
    ("fan_in_fan_out", False, "the base layers store their weights transposed (GPT-2's Conv1D)"),
    ("trainable_token_indices", None, "some embedding rows are trained apart"),
    ("alora_invocation_tokens", None, "activated LoRA applies only after its invocation tokens: it cannot be "
                                      "merged"),
    ("layer_replication", None, "layers are replicated"),
    ("use_qalora", False, "QA-LoRA pools the inputs"),
    ("use_bdlora", None, "the adapter is block-diagonal"),
    ("arrow_config", None, "Arrow routes between several adapters"),
    ("kasa_config", None, "KaSA changes the adapter's computation"),
    ("velora_config", None, "VeLoRA changes the adapter's computation"),
    ("monteclora_config", None, "MonteCLoRA samples the adapter"),
)
# Initialisations that leave the base weights as they were; pissa, olora, corda, loftq and lora_ga change
# them (the adapter is relative to the changed base until PEFT converts it), mica computes apart.
_BASE_KEEPING_INITS = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class LoraPair:
    """One adapted weight: its HF name, the adapter keys of its A and B, and its scaling."""

    weight: str
    a_key: str
    b_key: str
    rank: int
    scaling: float
    shape: tuple[int, int]  # (out, in): the delta's and the weight's
    # An embedding's pair (lora_embedding_A [r, vocab], lora_embedding_B [hidden, r]): the delta is (B @ A)^T.
    embedding: bool = False
    # A DoRA pair's magnitude vector ([out]): the merged weight's row norms.
    magnitude_key: str | None = None


@dataclass(frozen=True)
class ExpertsPair:
    """One adapted parameter of a fused experts module: the module, its pair's keys and their shapes."""

    module: str
    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


@dataclass(frozen=True)
class SavedWeight:
    """A whole weight the adapter file holds: its key there and its shape."""

    key: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LoraSettings:
    """adapter_config.json's ranks and alphas, and PEFT's choice of them for a module or parameter."""

    r: int
    lora_alpha: float
    rank_pattern: dict[str, Any]
    alpha_pattern: dict[str, Any]
    use_rslora: bool
    # target_parameters' names without their module path ("gate_up_proj", "down_proj").
    parameters: tuple[str, ...] = ()

    def rank(self, name: str) -> Any:
        return _pattern_value(self.rank_pattern, name, self.r)

    def scaling(self, name: str, rank: int) -> float:
        alpha = _pattern_value(self.alpha_pattern, name, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


class AdapterTensors:
    """Where an adapter's tensors are: a safetensors file read in place, or (``stored``) tensors made in memory
    from another adapter format (a Megatron-Bridge adapter in PEFT's names)."""

    def __init__(self, path: Path, stored: dict[str, torch.Tensor] | None = None) -> None:
        self.path = path
        self._stored = stored

    def header(self) -> dict[str, TensorMeta]:
        if self._stored is None:
            return read_header(self.path)
        return {key: TensorMeta(tuple(value.shape), value.dtype) for key, value in self._stored.items()}

    def tensor(self, key: str) -> torch.Tensor:
        return read_tensor(self.path, key) if self._stored is None else self._stored[key]

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        if self._stored is None:
            return read_tensor_range(self.path, key, 0, start, stop)
        return self._stored[key][start:stop]


@dataclass(frozen=True, eq=False)
class PeftAdapter:
    """A PEFT LoRA adapter: its directory, the pairs by the HF weight name they change, and the pairs of fused
    experts' parameters."""

    directory: Path
    tensors: AdapterTensors  # its tensors (a safetensors file, or made in memory)
    pairs: dict[str, LoraPair]
    settings: LoraSettings
    experts_pairs: tuple[ExpertsPair, ...] = ()
    # Whole weights that take the place of the model's (modules_to_save, an adapted embedding's base) by HF weight name.
    replacements: dict[str, SavedWeight] = field(default_factory=dict)
    # adapter_config.json's base_model_name_or_path: the model it was trained on, as PEFT recorded it.
    base_model: str | None = None
    # adapter_config.json's settings as read (or made, for an adapter of another format).
    settings_doc: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return str(self.directory)

    def delta(self, weight: str) -> torch.Tensor:
        """``(B @ A) * scaling`` in float32, as PEFT's ``get_delta_weight`` computes it."""
        pair = self.pairs[weight]
        a = self.tensors.tensor(pair.a_key).to(torch.float32)
        b = self.tensors.tensor(pair.b_key).to(torch.float32)
        product = b @ a
        return (product.T if pair.embedding else product) * pair.scaling

    @property
    def method(self) -> str:
        """``dora`` when the pairs are DoRA's (use_dora), ``lora`` otherwise."""
        return DORA if self.settings_doc.get("use_dora") is True else LORA

    def magnitude(self, weight: str) -> torch.Tensor | None:
        """A DoRA pair's magnitude vector in float32, None for a plain LoRA pair."""
        key = self.pairs[weight].magnitude_key
        return None if key is None else self.tensors.tensor(key).to(torch.float32)

    def replacement(self, weight: str) -> torch.Tensor:
        return self.tensors.tensor(self.replacements[weight].key)

    def expert_delta(self, pair: ExpertsPair, expert: int, experts: int, scaling: float) -> torch.Tensor:
        """Expert ``expert``'s delta of a fused parameter, float32 (PEFT's ``ParamWrapper`` einsum, one expert)."""
        rank = pair.a_shape[0] // experts
        a = self.tensors.rows(pair.a_key, expert * rank, (expert + 1) * rank)
        b = self._whole(pair.b_key).reshape(pair.b_shape[0], rank, experts)[:, :, expert]
        return (b @ a.to(torch.float32)) * scaling

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one adapter per conversion; B is read once per layer
    def _whole(self, key: str) -> torch.Tensor:
        return self.tensors.tensor(key).to(torch.float32)



def is_adapter_directory(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def describe_adapter(adapter: PeftAdapter) -> dict[str, Any]:
    """What ``inspect`` shows of an adapter: its ranks and scalings, the modules it adapts (by their name
    within a layer) and the layers they are in, its dtypes and bytes."""
    metas = adapter.tensors.header()
    names = [*adapter.pairs, *(f"{pair.module}.{{{','.join(adapter.settings.parameters)}}}"
                               for pair in adapter.experts_pairs)]
    layers = sorted({int(found[1]) for name in names if (found := re.search(r"\.layers\.(\d+)\.", name)) is not None})
    modules = sorted({re.sub(r"^.*\.layers\.\d+\.", "", name).removesuffix(".weight") for name in names})
    return {
        "base_model": adapter.base_model,
        "method": adapter.method,
        "pairs": len(adapter.pairs) + len(adapter.experts_pairs),
        "ranks": sorted({pair.rank for pair in adapter.pairs.values()}),
        "scalings": sorted({pair.scaling for pair in adapter.pairs.values()}),
        "modules": modules,
        "layers": layers,
        # The whole weights it holds (modules_to_save, an adapted embedding's base), which take the model's place.
        "saved_weights": sorted(adapter.replacements),
        "dtypes": sorted({str(meta.dtype).removeprefix("torch.") for meta in metas.values()}),
        "bytes": sum(meta.nbytes for meta in metas.values()),
    }


def read_peft_adapter(directory: Path) -> PeftAdapter:
    """The adapter in ``directory``, every setting and tensor pair checked; nothing read but headers."""
    if not directory.is_dir():
        raise ValidationError(f"--merge-adapter {directory}: not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ValidationError(f"--merge-adapter {directory}: no {CONFIG_FILE} (a Hugging Face PEFT adapter "
                              "directory, as PeftModel.save_pretrained writes it), nor a Megatron-Bridge LoRA "
                              "checkpoint (a torch_dist store of adapter weights with its run_config.yaml)")
    doc = read_json(config_path, ValidationError)
    if not isinstance(doc, dict):
        raise ValidationError(f"{config_path}: expected a JSON object")
    weights_file = directory / WEIGHTS_FILE
    if not weights_file.is_file():
        _check_settings(doc, config_path)
        legacy = (directory / LEGACY_WEIGHTS_FILE).is_file()
        raise ValidationError(f"{directory}: no {WEIGHTS_FILE}"
                              + (f" ({LEGACY_WEIGHTS_FILE}, a pickle, is not read: save the adapter with "
                                 "safe_serialization=True)" if legacy else ""))
    return peft_adapter(directory, doc, AdapterTensors(weights_file), config_path)


def peft_adapter(directory: Path, doc: dict[str, Any], tensors: AdapterTensors, config_path: Path) -> PeftAdapter:
    """The adapter ``doc`` (adapter_config.json's settings) and ``tensors`` (PEFT's keys) describe, checked;
    ``config_path`` names the settings in errors."""
    _check_settings(doc, config_path)
    base_model = doc.get("base_model_name_or_path")
    settings = _settings(doc)
    pairs, experts, saved = _pairs(doc, settings, config_path, tensors)
    return PeftAdapter(directory, tensors, pairs, settings, experts, saved,
                       base_model if isinstance(base_model, str) else None, doc)


def _check_settings(doc: dict[str, Any], config_path: Path) -> None:
    if doc.get("peft_type") != "LORA":
        raise ValidationError(f"{config_path}: peft_type={quote(doc.get('peft_type'))}: only LORA adapters are "
                              "merged")
    for key, plain, why in _PLAIN_SETTINGS:
        value = doc.get(key)
        if value != plain and value not in (None, False, [], {}):
            raise ValidationError(f"{config_path}: {key}={quote(value)}: {why}; pgconvert merges plain LoRA "
                                  "adapters only")
    if not isinstance(doc.get("use_dora", False), bool):
        raise ValidationError(f"{config_path}: use_dora={quote(doc.get('use_dora'))}: expected true or false")
    init = doc.get("init_lora_weights", True)
    if not any(init is keep if isinstance(keep, bool) else init == keep for keep in _BASE_KEEPING_INITS):
        raise ValidationError(f"{config_path}: init_lora_weights={quote(init)}: this initialisation changed the "
                              "base weights (or computes apart); convert the adapter to a plain LoRA with PEFT "
                              "(path_initial_model_for_weight_conversion) first")
    for key in ("r", "lora_alpha"):
        value = doc.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            said = "is missing" if key not in doc else f"={quote(value)}"
            raise ValidationError(f"{config_path}: {key} {said}: expected a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(doc.get(key) or {}, dict):
            raise ValidationError(f"{config_path}: {key}={quote(doc.get(key))}: expected an object")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """The value PEFT's ``get_pattern_key`` picks for ``module``: the first pattern that matches its end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _settings(doc: dict[str, Any]) -> LoraSettings:
    parameters = doc.get("target_parameters") or ()
    return LoraSettings(doc["r"], doc["lora_alpha"], doc.get("rank_pattern") or {}, doc.get("alpha_pattern") or {},
                        bool(doc.get("use_rslora")), tuple(str(name).rpartition(".")[2] for name in parameters))


def _targets_module(module: str, target_modules: Any) -> bool:
    """Whether ``target_modules`` names ``module``, as PEFT matches them (a regex in full, or a name suffix)."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == name or module.endswith(f".{name}") for name in target_modules or ())


def _sides(tensors: AdapterTensors, saved_modules: tuple[str, ...]
           ) -> tuple[dict[str, TensorMeta], dict[str, dict[str, str]], dict[str, str]]:
    """The adapter's tensors; each adapted module's A and B keys (a ParamWrapper's ``.base_layer`` kept; an
    embedding's under ``"embedding"``); and the whole weights it holds by HF weight name (``saved_modules``:
    modules_to_save)."""
    metas = tensors.header()
    sides: dict[str, dict[str, str]] = {}
    saved: dict[str, str] = {}
    for key in metas:
        name = key.removeprefix(KEY_PREFIX) if key.startswith(KEY_PREFIX) else None
        if name is not None and name.endswith(_MAGNITUDE_SUFFIX):
            sides.setdefault(name.removesuffix(_MAGNITUDE_SUFFIX), {})["magnitude"] = key
            continue
        match = _PAIR_KEY.fullmatch(name) if name is not None else None
        whole = _SAVED_KEY.fullmatch(name) if name is not None and match is None else None
        if match is not None and bool(match["embedding"]) != (match["weight"] is None):
            match = None
        if match is not None:
            sides.setdefault(match["module"], {})[match["side"]] = key
            if match["embedding"]:
                sides[match["module"]]["embedding"] = key
        elif whole is not None and (whole["base"] or _targets_module(whole["module"], list(saved_modules))):
            saved[f"{whole['module']}.{whole['param']}"] = key
        else:
            raise ValidationError(f"{tensors.path}: {key}: not a LoRA pair's weight (base_model.model.<module>."
                                  "lora_A.weight / lora_B.weight), a DoRA magnitude (<module>.lora_magnitude_vector) "
                                  "nor a module_to_save's; pgconvert merges LoRA and DoRA adapters only")
    for keys in sides.values():
        if not {"A", "B"} <= set(keys):
            only = keys.get("A") or keys.get("B") or keys["magnitude"]
            raise ValidationError(f"{tensors.path}: {only} has no lora_{'B' if 'A' in keys else 'A'} beside it")
    return metas, sides, saved


def _pairs(doc: dict[str, Any], settings: LoraSettings, config_path: Path, tensors: AdapterTensors
           ) -> tuple[dict[str, LoraPair], tuple[ExpertsPair, ...], dict[str, SavedWeight]]:
    """The pairs of ``nn.Linear`` and embedding modules by weight name, those of fused experts' parameters (a module
    that ``target_modules`` does not name, or one under a ParamWrapper's ``base_layer``, of a ``target_parameters``
    adapter), and the whole weights the file holds by weight name."""
    saved_modules = doc.get("modules_to_save") or ()
    metas, sides, saved = _sides(tensors, tuple(saved_modules) if isinstance(saved_modules, list) else ())
    pairs, experts = {}, []
    for module, keys in sorted(sides.items()):
        a, b = metas[keys["A"]].shape, metas[keys["B"]].shape
        if "embedding" in keys:  # lora_embedding_A [r, vocab], lora_embedding_B [hidden, r]
            pairs[f"{module}.weight"] = _embedding_pair(module, keys, a, b, settings, tensors)
            continue
        owner = module.replace(".base_layer", "")
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise ValidationError(f"{tensors.path}: {module}: lora_A {list(a)} and lora_B {list(b)} are not a LoRA "
                                  "pair (A rank x in, B out x rank)")
        if settings.parameters and (owner != module or not _targets_module(module, doc.get("target_modules"))):
            if doc.get("use_dora") is True:
                raise ValidationError(f"{tensors.path}: {module}: DoRA on fused experts' parameters is not merged")
            experts.append(ExpertsPair(owner, keys["A"], keys["B"], a, b))
            continue
        rank = settings.rank(module)
        if a[0] != rank:
            raise ValidationError(f"{tensors.path}: {module}: lora_A {list(a)} and lora_B {list(b)} do not make a "
                                  f"rank-{quote(rank)} pair ({config_path.name} gives r={quote(rank)})")
        weight = f"{module}.weight"
        pairs[weight] = LoraPair(weight, keys["A"], keys["B"], rank, settings.scaling(module, rank), (b[0], a[1]),
                                 magnitude_key=keys.get("magnitude"))
    if not pairs and not experts and not saved:
        raise CheckpointError(f"{tensors.path}: holds no LoRA pairs")
    _check_magnitudes(doc.get("use_dora") is True, sides, metas, tensors, config_path)
    return pairs, tuple(experts), {name: SavedWeight(key, metas[key].shape) for name, key in saved.items()}


def _check_magnitudes(dora: bool, sides: dict[str, dict[str, str]], metas: dict[str, TensorMeta],
                      tensors: AdapterTensors, config_path: Path) -> None:
    """A DoRA adapter's every module has a magnitude of its lora_B's rows, a LoRA adapter's none; DoRA on an
    embedding is refused."""
    for module, keys in sorted(sides.items()):
        if "magnitude" in keys and not dora:
            raise ValidationError(f"{tensors.path}: {keys['magnitude']}: a DoRA magnitude, but {config_path.name} "
                                  "does not set use_dora: true")
        if not dora:
            continue
        if "embedding" in keys or "magnitude" not in keys:
            why = ("DoRA on an embedding is not merged" if "embedding" in keys else
                   f"use_dora: true, but no {KEY_PREFIX}{module}{_MAGNITUDE_SUFFIX} (DoRA's magnitude vector)")
            raise ValidationError(f"{tensors.path}: {module}: {why}")
        shape, rows = tuple(metas[keys["magnitude"]].shape), metas[keys["B"]].shape[0]
        if shape != (rows,):
            raise ValidationError(f"{tensors.path}: {keys['magnitude']}: shape {list(shape)}, expected [{rows}] (one "
                                  f"magnitude per output row of {module})")


def _embedding_pair(module: str, keys: dict[str, str], a: tuple[int, ...], b: tuple[int, ...],
                    settings: LoraSettings, tensors: AdapterTensors) -> LoraPair:
    rank = settings.rank(module)
    if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] != rank:
        raise ValidationError(f"{tensors.path}: {module}: lora_embedding_A {list(a)} and lora_embedding_B {list(b)} "
                              f"do not make a rank-{quote(rank)} pair")
    weight = f"{module}.weight"
    return LoraPair(weight, keys["A"], keys["B"], rank, settings.scaling(module, rank), (a[1], b[0]), embedding=True)
