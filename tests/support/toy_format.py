"""A third-party format plugin as an outside package would write one: a ``Loader`` and a ``Saver`` that implement
the abstract methods only, none of the contract's optimizer hooks.

A checkpoint of this format is a directory holding ``toy.pt``: ``{"config": ModelConfig.to_dict(), "iteration",
"tensors": {canonical name: full tensor}}``. Register it in a test with ``register(monkeypatch)``.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from pgconvert.formats import Loader, LoadOptions, PlannedFile, Progress, SaveOptions, Saver, SaveResult, names
from pgconvert.formats.stream import CanonicalSource, InMemorySource
from pgconvert.model.config import ModelConfig

FILE = "toy.pt"


class ToySource(InMemorySource):
    format_name = "toy"


class ToyLoader(Loader):
    name = "toy"

    def detect(self, path: Path) -> bool:
        return (path / FILE).is_file()

    def open(self, path: Path, options: LoadOptions) -> CanonicalSource:
        state = torch.load(path / FILE, weights_only=True)
        return ToySource(ModelConfig(**state["config"]), state["tensors"], iteration=state["iteration"])


class ToySaver(Saver):
    name = "toy"
    parallel = False

    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        return [PlannedFile(FILE, len(source.names()), source.total_bytes())]

    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions, progress: Progress) -> SaveResult:
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {name: source.load(name).clone() for name in source.names()}
        torch.save({"config": source.config.to_dict(), "iteration": source.iteration, "tensors": tensors},
                   out_dir / FILE)
        progress(source.total_bytes())
        return SaveResult(files=self.plan(source, options))


def register(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``toy`` a known source and destination format through the ``pgconvert.loaders`` /
    ``pgconvert.savers`` entry points, as an installed plugin package declares them."""
    points = {"pgconvert.loaders": [EntryPoint("toy", f"{__name__}:ToyLoader", "pgconvert.loaders")],
              "pgconvert.savers": [EntryPoint("toy", f"{__name__}:ToySaver", "pgconvert.savers")]}
    monkeypatch.setattr(names, "entry_points", lambda group: points.get(group, []))
