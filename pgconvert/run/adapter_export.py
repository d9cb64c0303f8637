"""``export-adapter``: a LoRA adapter written, unmerged, in the other form: a Megatron-Bridge LoRA checkpoint as a
Hugging Face PEFT adapter directory, or a PEFT adapter directory as a Megatron-Bridge LoRA checkpoint.

The base checkpoint (any format pgconvert reads) gives the family and the shapes: the adapter is put in the other
form's names for that family (``adapters.megatron``, ``adapters.megatron_save``) and checked as ``--merge-adapter``
checks one (every adapted weight is the model's, of the model's shape) before anything is written. The output is
written in a hidden sibling of DST and renamed into place, so a failed export leaves no DST.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pgconvert.adapters.megatron import MegatronAdapter, as_peft_adapter, find_adapter_store, read_megatron_adapter
from pgconvert.adapters.megatron_experts import refuse_pairs_peft_remaps
from pgconvert.adapters.megatron_save import write_bridge_adapter
from pgconvert.adapters.merge import AdapterMerge
from pgconvert.adapters.names import source_family
from pgconvert.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, PeftAdapter, is_adapter_directory, read_peft_adapter
from pgconvert.errors import DestinationError, ValidationError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.formats.stream import CanonicalSource
from pgconvert.model.provider import MTP_PREFIX
from pgconvert.io.durable import fsync_file
from pgconvert.run.convert import staged_output
from pgconvert.run.destination import refuse_unusable_name

log = logging.getLogger(__name__)
Written = TypeVar("Written")
PEFT_FORM = "peft"
MEGATRON_BRIDGE_FORM = "megatron-bridge"


@dataclass(frozen=True)
class AdapterExport:
    """What ``export-adapter`` wrote: the directory, its form (``peft`` or ``megatron-bridge``) and pair count."""

    path: Path
    form: str
    pairs: int


def export_adapter(src: Path, dst: Path, base: Path | None = None, iteration: int | None = None) -> AdapterExport:
    """Write the adapter ``src`` into ``dst`` (which must not exist) in the other form, for the model ``base`` (its
    ``iteration``): a PEFT adapter directory as a Megatron-Bridge checkpoint, anything else read as a
    Megatron-Bridge checkpoint and written as a PEFT adapter directory. Without ``base``, ``src`` is its own: a
    checkpoint that holds the adapter beside its model (the adapter then read from the iteration opened)."""
    refuse_unusable_name(dst)
    if dst.exists():
        raise DestinationError(f"DST {dst}: exists; export-adapter writes a new directory")
    if base is None and (is_adapter_directory(src) or find_adapter_store(src) is not None):
        raise ValidationError(f"export-adapter {src}: holds an adapter alone, not its base model: name the model it "
                              "was trained on with --base")
    source = get_loader(detect_format(base or src)).open(base or src, LoadOptions(iteration=iteration))
    try:
        if is_adapter_directory(src):
            return _to_megatron_bridge(read_peft_adapter(src), source, dst)
        where = src if base is not None else _embedded_store(source, src)
        megatron = read_megatron_adapter(where)
        _refuse_mtp_pairs(megatron)
        adapter = as_peft_adapter(megatron, source_family(source), source.config, base_model=str(base or src))
        AdapterMerge(adapter, source)  # every pair on one of the model's weights, of its shape
        refuse_pairs_peft_remaps(adapter, source.config.moe.num_experts)
        _staged(dst, lambda staging: _write_peft(adapter, staging))
        return AdapterExport(dst, PEFT_FORM, len(adapter.pairs) + len(adapter.experts_pairs))
    finally:
        source.close()


def _refuse_mtp_pairs(adapter: MegatronAdapter) -> None:
    """An MTP layer's pairs have no PEFT form PEFT loads: transformers builds no MTP module (its weights are left out
    of the model it loads), so PEFT would drop them without a word."""
    mtp = sorted(weight for weight in adapter.pairs if weight.startswith(MTP_PREFIX))
    if mtp:
        raise ValidationError(f"{adapter.directory}: adapts the MTP layers ({', '.join(mtp[:2])}"
                              f"{' …' if len(mtp) > 2 else ''}), which transformers does not load, so PEFT would "
                              "leave their pairs out; merge the adapter with --merge-adapter instead")


def _embedded_store(source: CanonicalSource, src: Path) -> Path:
    """The store of the adapter ``src`` holds beside its model: the iteration opened."""
    if source.embedded_adapter is None:
        raise ValidationError(f"export-adapter {src}: holds no LoRA adapter (no '.adapter.' keys beside its model)")
    return source.embedded_adapter.store


def _to_megatron_bridge(adapter: PeftAdapter, source: CanonicalSource, dst: Path) -> AdapterExport:
    AdapterMerge(adapter, source)  # every pair on one of the model's weights, of its shape
    family = source_family(source)
    pairs = _staged(dst, lambda staging: write_bridge_adapter(adapter, source, family, staging))
    return AdapterExport(dst, MEGATRON_BRIDGE_FORM, pairs)


def _write_peft(adapter: PeftAdapter, staging: Path) -> None:
    """adapter_model.safetensors and adapter_config.json."""
    from safetensors.torch import save_file

    tensors = {key: adapter.tensors.tensor(key) for key in adapter.tensors.header()}
    save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    (staging / CONFIG_FILE).write_text(json.dumps(adapter.settings_doc, indent=2, sort_keys=True) + "\n")


def _staged(dst: Path, write: Callable[[Path], Written]) -> Written:
    """``write(staging)`` into the hidden sibling of ``dst`` a conversion writes in (``convert.staged_output``: one
    writer per destination, renamed to ``dst`` when complete, removed when anything fails), its files synced."""
    with staged_output(dst, overwrite=False) as staging:
        written = write(staging)
        for path in staging.rglob("*"):
            if path.is_file():
                fsync_file(path)
    log.info("wrote %s", dst)
    return written
