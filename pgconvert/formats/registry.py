"""Format plugins: built-in ones by name, third-party ones through entry points.

Third-party packages register ``pgconvert.loaders`` / ``pgconvert.savers`` entry points naming a
``Loader`` / ``Saver`` subclass. An import error in a plugin is reported, never swallowed.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from pathlib import Path

from pgconvert.errors import CheckpointError, NotACheckpointError, PluginError
from pgconvert.formats import Loader, Saver

log = logging.getLogger(__name__)

BUILTIN_LOADERS: dict[str, str] = {"megatron": "pgconvert.loaders.megatron:MegatronLoader", "hf": "pgconvert.loaders.hf:HFLoader",
                                   "torch_dist": "pgconvert.loaders.torch_dist:TorchDistLoader"}
BUILTIN_SAVERS: dict[str, str] = {"megatron": "pgconvert.savers.megatron:MegatronSaver", "hf": "pgconvert.savers.hf:HFSaver",
                                  "torch_dist": "pgconvert.savers.torch_dist:TorchDistSaver"}


def _targets(group: str, builtins: dict[str, str]) -> dict[str, str]:
    targets = dict(builtins)
    for entry in entry_points(group=group):
        targets.setdefault(entry.name, entry.value)
    return targets


def loader_names() -> list[str]:
    return sorted(_targets("pgconvert.loaders", BUILTIN_LOADERS))


def saver_names() -> list[str]:
    return sorted(_targets("pgconvert.savers", BUILTIN_SAVERS))


def _instantiate(kind: str, name: str, target: str) -> object:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except Exception as exc:  # a broken plugin must be visible, whatever it raised
        raise PluginError(f"{kind} {name!r} ({target}) failed to import: {type(exc).__name__}: {exc}") from exc
    return factory()


def get_loader(name: str) -> Loader:
    targets = _targets("pgconvert.loaders", BUILTIN_LOADERS)
    if name not in targets:
        raise PluginError(f"source format {name!r}: unknown; known formats: {', '.join(sorted(targets))}")
    loader = _instantiate("loader", name, targets[name])
    assert isinstance(loader, Loader), f"{targets[name]} is not a pgconvert Loader"
    return loader


def get_saver(name: str) -> Saver:
    targets = _targets("pgconvert.savers", BUILTIN_SAVERS)
    if name not in targets:
        raise PluginError(f"destination format {name!r}: unknown; known formats: {', '.join(sorted(targets))}")
    saver = _instantiate("saver", name, targets[name])
    assert isinstance(saver, Saver), f"{targets[name]} is not a pgconvert Saver"
    return saver


def detect_format(path: Path) -> str:
    """The name of the one loader that recognises ``path``."""
    found = [name for name in loader_names() if get_loader(name).detect(path)]
    if not found:
        raise NotACheckpointError(
            f"{path}: not a checkpoint of any known format ({', '.join(loader_names())}); "
            "expected e.g. latest_checkpointed_iteration.txt with iter_*/mp_rank_*/model_optim_rng.pt "
            "(megatron), or config.json with model.safetensors[.index.json] (hf)"
        )
    if len(found) > 1:
        raise CheckpointError(f"{path}: matches several formats ({', '.join(found)}); pass --src-format")
    return found[0]
