"""Format plugins: built-in ones by name, third-party ones through entry points.

Third-party packages register ``pgconvert.loaders`` / ``pgconvert.savers`` entry points naming a
``Loader`` / ``Saver`` subclass. An import error in a plugin is reported, never swallowed.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from pgconvert.errors import CheckpointError, NotACheckpointError, PluginError
from pgconvert.formats import Loader, Saver
from pgconvert.formats.names import BUILTIN_LOADERS, BUILTIN_SAVERS, loader_names, targets

log = logging.getLogger(__name__)


def _instantiate(kind: str, name: str, target: str) -> object:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except Exception as exc:  # a broken plugin must be visible, whatever it raised
        raise PluginError(f"{kind} {name!r} ({target}) failed to import: {type(exc).__name__}: {exc}") from exc
    return factory()


def get_loader(name: str) -> Loader:
    known = targets("pgconvert.loaders", BUILTIN_LOADERS)
    if name not in known:
        raise PluginError(f"source format {name!r}: unknown; known formats: {', '.join(sorted(known))}")
    loader = _instantiate("loader", name, known[name])
    assert isinstance(loader, Loader), f"{known[name]} is not a pgconvert Loader"
    return loader


def get_saver(name: str) -> Saver:
    known = targets("pgconvert.savers", BUILTIN_SAVERS)
    if name not in known:
        raise PluginError(f"destination format {name!r}: unknown; known formats: {', '.join(sorted(known))}")
    saver = _instantiate("saver", name, known[name])
    assert isinstance(saver, Saver), f"{known[name]} is not a pgconvert Saver"
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
