"""The two spellings of an MTP layer's inner transformer layer in per-rank (``torch``) files.

megatron-core 0.16.1's MultiTokenPredictionLayer holds its layer as ``self.transformer_layer``, so its
``state_dict`` keys read ``mtp.layers.{i}.transformer_layer.*``. Megatron-LM d98e8a64 holds it as
``self.mtp_model_layer`` (megatron/core/transformer/multi_token_prediction.py, registered at the same
place: enorm, hnorm, eh_proj, the layer, final_layernorm), so a per-rank checkpoint it saves reads
``mtp.layers.{i}.mtp_model_layer.*``; only its ``sharded_state_dict`` maps the name back to
``transformer_layer.`` (torch_dist keys are the same in both). pgconvert's canonical name is
``transformer_layer``; ``ModelConfig.mtp_layer_module`` is the spelling a per-rank file uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pgconvert.model.config import MTP_LAYER_MODULES
from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.model.provider import MTP_LAYER_MODULE, MTP_PREFIX

CANONICAL_MODULE = MTP_LAYER_MODULE.rstrip(".")


def _split(key: str) -> tuple[str, str, str] | None:
    """``mtp.layers.{i}.{module}.rest`` → (``mtp.layers.{i}.``, module, rest) for either spelling; else None."""
    if not key.startswith(MTP_PREFIX):
        return None
    index, _, tail = key[len(MTP_PREFIX):].partition(".")
    module, _, rest = tail.partition(".")
    if not index.isdigit() or module not in MTP_LAYER_MODULES or not rest:
        return None
    return f"{MTP_PREFIX}{index}.", module, rest


def canonical_mtp_key(key: str) -> str:
    """A per-rank key with the inner layer under its canonical name ``transformer_layer``."""
    parts = _split(key)
    return key if parts is None else f"{parts[0]}{CANONICAL_MODULE}.{parts[2]}"


def local_mtp_key(canonical: str, module: str) -> str:
    """A canonical key with the inner layer spelled ``module`` (a per-rank target's spelling)."""
    parts = _split(canonical)
    return canonical if parts is None else f"{parts[0]}{module}.{parts[2]}"


def mtp_module_of(keys: Iterable[str], where: Path | str) -> str | None:
    """The spelling a rank file's MTP keys use; None when it has none. Both in one file is refused."""
    seen: dict[str, str] = {}
    for key in keys:
        parts = _split(key)
        if parts is not None:
            seen.setdefault(parts[1], key)
    if len(seen) > 1:
        raise CheckpointError(
            f"{where}: the MTP layer's inner layer is named both ways in one file ("
            + " and ".join(quote(key) for key in seen.values())
            + "); a file holds megatron-core 0.16.1's 'transformer_layer' or Megatron-LM's 'mtp_model_layer', not both")
    return next(iter(seen), None)
