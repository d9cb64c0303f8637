"""A PEFT LoRA adapter written as Megatron-Bridge saves a LoRA run's adapter, for megatron-core to load at any TP.

The other direction of ``adapters.megatron``: each canonical weight some pairs adapt gets one Megatron-Bridge pair,
``linear_in`` the parts' common lora_A and ``linear_out`` their lora_B rows joined by the family transform's ``fuse``
(a part without a pair gets zero rows), exact where the transform only moves rows. Megatron-Bridge's LoRA has one
``dim`` and one ``alpha`` and a fused module one ``linear_in``, so an adapter whose ranks or scalings differ between
pairs, or whose q/k/v (gate/up) pairs have different lora_A (as PEFT trains them apart), has no exact
Megatron-Bridge form and is refused by name; so are pairs on embeddings, the output layer and experts, and saved
whole weights (``modules_to_save``). A DoRA adapter becomes Megatron-Bridge's DoRA: ``weight_magnitude`` is the
parts' magnitudes joined as their rows are (a fused module with a part PEFT did not adapt is refused: that part's
magnitude would be the base's row norms). It is written in the canonical rows' order, the order a TP 1 run holds
(``model.tensor_model_parallel_size: 1`` in run_config.yaml): Megatron-Bridge's DoRA takes each rank's norm and
stores a gated linear_fc1's magnitude per rank, so it computes PEFT's DoRA at TP 1 (and on column-parallel modules
at any TP, but for that fc1 order).

What is written is what a homogeneous model's adapter run saves with ``dist_checkpointing.save``: a torch_dist store
(``release/``: ``.metadata``, data files, ``metadata.json``, ``common.pt``) of the adapter keys at global shapes,
the layers stacked on a leading axis (``decoder.layers.<module>.adapter.linear_in.weight`` ``[layers, dim, in]``),
``run_config.yaml`` with the ``peft`` section, and the tracker naming ``release``. The store is the same at every TP:
megatron-core cuts each rank's pieces when it loads them.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from pgconvert.adapters.megatron import DORA_TARGET, LORA_TARGET, RUN_CONFIG_FILE, MegatronPair, moves_rows
from pgconvert.adapters.names import loaded_hf_weights
from pgconvert.adapters.peft import DORA, PeftAdapter
from pgconvert.errors import ValidationError
from pgconvert.families.table import Family, TensorMapping
from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.limits import quote

_LAYER_PREFIX = "decoder.layers."


def megatron_pairs(adapter: PeftAdapter, source: CanonicalSource, family: Family
                   ) -> tuple[dict[str, MegatronPair], int, float]:
    """The adapter's pairs as Megatron-Bridge's, by canonical weight, with its ``dim`` and ``alpha``."""
    refused = [what for what, held in (("fused experts' parameters (not written as Megatron-Bridge's experts' "
                                        "adapters yet)", adapter.experts_pairs),
                                       ("saved whole weights (modules_to_save)", adapter.replacements),
                                       ("embedding pairs", [p for p in adapter.pairs.values() if p.embedding])) if held]
    if refused:
        raise ValidationError(f"{adapter.where}: holds {', '.join(refused)}, which Megatron-Bridge's LoRA (linear "
                              "modules of the decoder layers) has no form for")
    ranks = sorted({pair.rank for pair in adapter.pairs.values()})
    scalings = sorted({pair.scaling for pair in adapter.pairs.values()})
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValidationError(f"{adapter.where}: pairs of ranks {ranks} and scalings {scalings}: Megatron-Bridge's "
                              "LoRA has one dim and one alpha")
    pairs = {}
    for name in source.names():
        found = loaded_hf_weights(family, name, source.config)
        if found is not None and adapter.pairs.keys() & set(found[1]):
            pairs[name] = _fused_pair(adapter, name, *found, source)
    alpha = scalings[0] * ranks[0]
    return pairs, ranks[0], int(alpha) if float(alpha).is_integer() else alpha


def _fused_pair(adapter: PeftAdapter, name: str, row: TensorMapping, hf_names: tuple[str, ...],
                source: CanonicalSource) -> MegatronPair:
    """One canonical weight's pair: its HF parts' common lora_A, their lora_B rows fused (zeros for a part without
    a pair)."""
    config, shape = source.config, source.meta(name).shape
    if not name.startswith(_LAYER_PREFIX) or not moves_rows(row.transform, shape, config):
        raise ValidationError(f"{adapter.where}: adapts {', '.join(hf_names)} (pgconvert's {name}), which "
                              "Megatron-Bridge's LoRA adapts as no linear of a decoder layer whose rows they are")
    present = [hf for hf in hf_names if hf in adapter.pairs]
    shared = [adapter.tensors.tensor(adapter.pairs[hf].a_key) for hf in present]
    if any(not torch.equal(shared[0], other) for other in shared[1:]):
        modules = ", ".join(hf.removesuffix(".weight") for hf in present)
        raise ValidationError(f"{adapter.where}: {modules} have different lora_A: Megatron-Bridge's one "
                              f"linear_in of {name.removesuffix('.weight')} cannot hold them (no exact form)")
    rank = shared[0].shape[0]
    outs = [adapter.tensors.tensor(adapter.pairs[hf].b_key) if hf in adapter.pairs
            else torch.zeros((part[0], rank), dtype=shared[0].dtype)
            for hf, part in zip(hf_names, row.transform.part_shapes(shape, config), strict=True)]
    magnitude = None
    if adapter.method == DORA:
        if len(present) != len(hf_names):
            raise ValidationError(f"{adapter.where}: DoRA on {', '.join(present)} but not on the rest of "
                                  f"{', '.join(hf_names)}: Megatron-Bridge's one weight_magnitude of "
                                  f"{name.removesuffix('.weight')} would need the base's row norms for those rows")
        columns = [adapter.tensors.tensor(adapter.pairs[hf].magnitude_key).unsqueeze(1) for hf in hf_names]
        magnitude = row.transform.fuse(columns, config)[:, 0].contiguous()
    return MegatronPair(name, shared[0], row.transform.fuse(outs, config).contiguous(), magnitude)


def stacked_tensors(pairs: dict[str, MegatronPair], num_layers: int, where: str) -> dict[str, torch.Tensor]:
    """The store's tensors: each module's pairs of every layer stacked on a leading axis (a module some layers lack
    has no such key, and is refused)."""
    by_module: dict[str, dict[int, MegatronPair]] = {}
    for weight, pair in pairs.items():
        layer, _, module = weight.removeprefix(_LAYER_PREFIX).partition(".")
        by_module.setdefault(module.removesuffix(".weight"), {})[int(layer)] = pair
    tensors = {}
    for module, layers in sorted(by_module.items()):
        missing = sorted(set(range(num_layers)) - set(layers))
        if missing:
            raise ValidationError(f"{where}: {module} is adapted in some layers only (not in {quote(missing)}): "
                                  "Megatron-Bridge stores every layer's adapter of a module in one key")
        prefix = f"{_LAYER_PREFIX}{module}.adapter"
        tensors[f"{prefix}.linear_in.weight"] = torch.stack([layers[i].linear_in for i in range(num_layers)])
        tensors[f"{prefix}.linear_out.weight"] = torch.stack([layers[i].linear_out for i in range(num_layers)])
        if layers[0].magnitude is not None:
            tensors[f"{prefix}.weight_magnitude"] = torch.stack([layers[i].magnitude for i in range(num_layers)])
    return tensors


def write_adapter_store(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """A torch_dist store of ``tensors`` as megatron-core 0.16 loads one: ``.metadata`` and a data file written by
    torch's DCP in this process, ``metadata.json`` and ``common.pt``."""
    import torch.distributed.checkpoint as dcp

    from pgconvert.formats.megatron import CHECKPOINT_VERSION, FRAMEWORK_PICKLE
    from pgconvert.formats.torch_dist import (COMMON_FILE, CONTENT_METADATA, single_process_calls,
                                              write_checkpoint_config)

    with single_process_calls():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    write_checkpoint_config(directory)
    common = io.BytesIO()
    torch.save({"checkpoint_version": CHECKPOINT_VERSION, "content_metadata": dict(CONTENT_METADATA)}, common,
               pickle_module=FRAMEWORK_PICKLE)
    (directory / COMMON_FILE).write_bytes(common.getbuffer())


def run_config(dim: int, alpha: float, dropout: float, modules: list[str], dora: bool = False) -> str:
    """run_config.yaml's ``peft`` section as Megatron-Bridge writes a LoRA run's (peft/lora.py's fields) or a DoRA
    run's (peft/dora.py's), a DoRA run's with the TP size its magnitudes are ordered for."""
    import yaml

    peft = {"_target_": DORA_TARGET if dora else LORA_TARGET,
            "target_modules": sorted({module.rpartition(".")[2] for module in modules}),
            "dim": dim, "alpha": alpha, "dropout": dropout}
    return yaml.safe_dump({"model": {"tensor_model_parallel_size": 1}, "peft": peft} if dora else {"peft": peft},
                          sort_keys=False)


def write_bridge_adapter(adapter: PeftAdapter, source: CanonicalSource, family: Family, staging: Path) -> int:
    """The adapter as a Megatron-Bridge LoRA run's checkpoint in ``staging``: its ``release`` store, run_config.yaml
    and tracker; the number of Megatron-Bridge pairs."""
    from pgconvert.formats.megatron import TRACKER_FILE, iteration_dir_name

    pairs, dim, alpha = megatron_pairs(adapter, source, family)
    tensors = stacked_tensors(pairs, source.config.num_layers, adapter.where)
    store = staging / iteration_dir_name(None, release=True)
    store.mkdir()
    write_adapter_store(tensors, store)
    dropout = adapter.settings_doc.get("lora_dropout") or 0.0
    modules = [key.removeprefix(_LAYER_PREFIX).removesuffix(".adapter.linear_in.weight") for key in tensors
               if key.endswith(".linear_in.weight")]
    (store / RUN_CONFIG_FILE).write_text(run_config(dim, alpha, float(dropout), modules, adapter.method == DORA))
    (staging / TRACKER_FILE).write_text("release")
    return len(pairs)
