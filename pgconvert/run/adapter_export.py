"""``export-adapter``: a Megatron-Bridge LoRA checkpoint written, unmerged, as a Hugging Face PEFT adapter directory.

The base checkpoint (any format pgconvert reads) gives the family and the shapes: the adapter is put in PEFT's
names for that family (``adapters.megatron``) and checked as ``--merge-adapter`` checks one (every adapted
weight is the model's, of the model's shape) before anything is written. The directory is written as a hidden
sibling of DST and renamed into place, so a failed export leaves no DST.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from pgconvert.adapters.megatron import as_peft_adapter, read_megatron_adapter
from pgconvert.adapters.merge import AdapterMerge
from pgconvert.adapters.names import source_family
from pgconvert.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, PeftAdapter
from pgconvert.errors import DestinationError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.io.durable import fsync_dir, fsync_file
from pgconvert.run.destination import PARTIAL_MARKER, refuse_unusable_name, sibling

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterExport:
    """What ``export-adapter`` wrote: the directory, its pairs and the HF modules they adapt."""

    path: Path
    pairs: int
    modules: tuple[str, ...]


def export_adapter(src: Path, dst: Path, base: Path, iteration: int | None = None) -> AdapterExport:
    """Write the Megatron-Bridge LoRA adapter ``src`` into ``dst`` (which must not exist) as a PEFT adapter for
    the model ``base`` (its ``iteration``)."""
    refuse_unusable_name(dst)
    if dst.exists():
        raise DestinationError(f"DST {dst}: exists; export-adapter writes a new directory")
    source = get_loader(detect_format(base)).open(base, LoadOptions(iteration=iteration))
    try:
        adapter = as_peft_adapter(read_megatron_adapter(src), source_family(source), source.config,
                                  base_model=str(base))
        AdapterMerge(adapter, source)  # every pair on one of the model's weights, of its shape
    finally:
        source.close()
    _write(adapter, dst)
    modules = tuple(sorted(adapter.settings_doc["target_modules"]))
    log.info("wrote %s: %d LoRA pairs", dst, len(adapter.pairs))
    return AdapterExport(dst, len(adapter.pairs), modules)


def _write(adapter: PeftAdapter, dst: Path) -> None:
    """adapter_model.safetensors and adapter_config.json in a staging sibling, renamed to ``dst`` when complete."""
    from safetensors.torch import save_file

    staging = sibling(dst, f"{PARTIAL_MARKER}{uuid.uuid4().hex[:16]}")
    staging.mkdir(parents=True)
    try:
        tensors = {key: adapter.weights_file.tensor(key) for key in adapter.weights_file.header()}
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(adapter.settings_doc, indent=2, sort_keys=True) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            fsync_file(staging / name)
        os.rename(staging, dst)
        fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
