"""The names an adapter's pairs are read in: the family that names them and a canonical tensor's HF weights.

An adapter names HF modules as transformers names them in memory (PEFT wraps the loaded model's modules), which
for a few families differ from the names their checkpoints store (``Family.hf_loaded_modules``).
"""

from __future__ import annotations

from pgconvert.families import mtp
from pgconvert.families.table import Family, TensorMapping
from pgconvert.formats.hf import infer_family
from pgconvert.formats.stream import CanonicalSource
from pgconvert.model.config import ModelConfig


def source_family(source: CanonicalSource) -> Family:
    """The family an adapter's HF names are read in: the one an HF source names, the one a Megatron source is
    written as."""
    return source.hf_origin.family if source.hf_origin is not None else infer_family(source.config)


def loaded_hf_weights(family: Family, name: str, config: ModelConfig) -> tuple[TensorMapping, tuple[str, ...]] | None:
    """The table row of canonical ``name`` and its HF weights as transformers names them in memory (an adapter's
    names)."""
    found = mtp.to_hf(family, name, config)
    if found is None or not family.hf_loaded_modules:
        return found
    row, names = found
    for stored, loaded in family.hf_loaded_modules:
        names = tuple(hf.replace(f".{stored}.", f".{loaded}.") for hf in names)
    return row, names
