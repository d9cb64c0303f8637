"""Pickles that name classes pgconvert does not import: a stand-in class is written as the class it stands for.

pgconvert writes checkpoints that hold other frameworks' objects (Megatron-LM's enums in ``args``,
torch.distributed.checkpoint's metadata classes in a DCP ``.metadata``) without importing those frameworks. Python's
pickler writes a class as a reference to its module and qualified name, which it first looks up (importing the
module); ``StandInPickler`` writes the name a stand-in gives instead, unlooked-up, in the opcodes the pickler would
have used, so the bytes are those the framework's own objects pickle to.
"""

from __future__ import annotations

import pickle
from typing import Any


class StandInPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Python's pickler, with each class ``stands_for`` names written under that name."""

    def stands_for(self, cls: type) -> tuple[str, str] | None:
        """The module and qualified name a stand-in class is written as; None: the class is written as itself."""
        raise NotImplementedError

    def save_global(self, obj: Any, name: str | None = None) -> None:
        named = self.stands_for(obj) if isinstance(obj, type) else None
        if named is None:
            super().save_global(obj, name)
            return
        module, qualname = named
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)
