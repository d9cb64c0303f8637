"""Loader for Megatron-FSDP checkpoints (``--ckpt-format fsdp_dtensor``), registered as ``fsdp_dtensor``.

Detection needs only the file layout (a DCP store without torch_dist's ``metadata.json``); the reader
(``loaders/fsdp_dtensor/reader.py``, which imports torch) is imported when a checkpoint is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pgconvert.formats import Iteration, Loader, LoadOptions
from pgconvert.formats.fsdp_dtensor import is_iteration_dir, resolve_iteration_dir
from pgconvert.formats.megatron import ITERATION_DIR_RE, list_megatron_iterations

if TYPE_CHECKING:
    from pgconvert.loaders.fsdp_dtensor.reader import FsdpDtensorSource


class FsdpDtensorLoader(Loader):
    name = "fsdp_dtensor"

    def detect(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        if is_iteration_dir(path):
            return True
        return any(is_iteration_dir(child) for child in path.iterdir()
                   if child.is_dir() and (child.name == "release" or ITERATION_DIR_RE.match(child.name)))

    def open(self, path: Path, options: LoadOptions) -> FsdpDtensorSource:
        from pgconvert.loaders.fsdp_dtensor.reader import FsdpDtensorSource

        iteration_dir, iteration, release = resolve_iteration_dir(path, options.iteration)
        return FsdpDtensorSource(iteration_dir, iteration, release, options, root=path)

    def iterations(self, path: Path) -> list[Iteration]:
        return list_megatron_iterations(path, is_iteration_dir)
