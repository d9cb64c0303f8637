"""The names a command line offers, known without importing torch or any format: the formats
(built-in and entry-point plugins), the dtypes ``--dtype`` accepts and the expert layouts.

``pgconvert --help`` and an argument error are answered from these alone.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from pgconvert.io.digest import ALGORITHMS, DEFAULT_ALGORITHM

BUILTIN_LOADERS: dict[str, str] = {"megatron": "pgconvert.loaders.megatron:MegatronLoader", "hf": "pgconvert.loaders.hf:HFLoader",
                                   "torch_dist": "pgconvert.loaders.torch_dist:TorchDistLoader",
                                   "fsdp_dtensor": "pgconvert.loaders.fsdp_dtensor:FsdpDtensorLoader"}
BUILTIN_SAVERS: dict[str, str] = {"megatron": "pgconvert.savers.megatron:MegatronSaver", "hf": "pgconvert.savers.hf:HFSaver",
                                  "torch_dist": "pgconvert.savers.torch_dist:TorchDistSaver",
                                  "fsdp_dtensor": "pgconvert.savers.fsdp_dtensor:FsdpDtensorSaver"}
# ``--dtype``: keep the source's, or one of these (pgconvert.formats.DTYPE_CHOICES maps them to torch dtypes).
DTYPE_NAMES = ("keep", "bf16", "fp16", "fp32")
EXPERT_LAYOUTS = ("sequential", "grouped")
# Where a torch_dist destination keeps the common state (``--dst-torch-dist-common``): "store", inside the DCP
# store as megatron-core >= 0.19 writes it, with its integrity manifest (the default); "legacy", common.pt, which
# every megatron-core reads (0.19+ prefers it when present) and the only place 0.18.x and older look.
COMMON_IN_STORE = "store"
COMMON_LEGACY = "legacy"
COMMON_PLACES = (COMMON_IN_STORE, COMMON_LEGACY)


def targets(group: str, builtins: dict[str, str]) -> dict[str, str]:
    """Format name -> ``module:factory``: the built-in ones, then the entry points of ``group``."""
    found = dict(builtins)
    for entry in entry_points(group=group):
        found.setdefault(entry.name, entry.value)
    return found


def loader_names() -> list[str]:
    return sorted(targets("pgconvert.loaders", BUILTIN_LOADERS))


def saver_names() -> list[str]:
    return sorted(targets("pgconvert.savers", BUILTIN_SAVERS))

# What the manifest records of each written file besides its size (``--digest``): a digest computed as the file
# is written (``pgconvert.io.digest``: xxh3-128 by default, or sha256), or nothing.
DEFAULT_DIGEST = DEFAULT_ALGORITHM
DIGEST_CHOICES = (*ALGORITHMS, "none")
