"""Loader for Megatron distributed checkpoints (``torch_dist``), registered as ``torch_dist``.

Detection needs only the file layout; the reader (``loaders/torch_dist/reader.py``, which imports torch) is
imported when a checkpoint is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pgconvert.formats import Iteration, Loader, LoadOptions
from pgconvert.formats.dcp_layout import CHECKPOINT_CONFIG_FILE
from pgconvert.formats.megatron import ITERATION_DIR_RE, list_megatron_iterations

if TYPE_CHECKING:
    from pgconvert.loaders.torch_dist.reader import TorchDistSource


def _is_iteration_dir(path: Path) -> bool:
    return (path / CHECKPOINT_CONFIG_FILE).is_file()


class TorchDistLoader(Loader):
    name = "torch_dist"

    def detect(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        if _is_iteration_dir(path):
            return True
        return any(_is_iteration_dir(child) for child in path.iterdir()
                   if child.is_dir() and (child.name == "release" or ITERATION_DIR_RE.match(child.name)))

    def open(self, path: Path, options: LoadOptions) -> TorchDistSource:
        from pgconvert.loaders.torch_dist.reader import TorchDistSource
        from pgconvert.formats.torch_dist import resolve_iteration_dir

        iteration_dir, iteration, release = resolve_iteration_dir(path, options.iteration)
        return TorchDistSource(iteration_dir, iteration, release, options, root=path)

    def iterations(self, path: Path) -> list[Iteration]:
        return list_megatron_iterations(path, _is_iteration_dir)
