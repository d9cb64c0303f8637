"""Optimizer state carried to another ``--dtype``: the fp32 masters stay the source of truth.

megatron-core keeps an fp32 master of every parameter (``Float16OptimizerWithFloat16Params``'s
``fp32_from_fp16_params``, the distributed optimizer's ``param`` buffers; ``FP32Optimizer``'s are the weights
themselves) and copies it into the model, rounded to the model's dtype, after every step. A run resumed in another
dtype is that run's masters, moments and steps with:

- the model's weights re-derived from the masters (``MasterWeights``, read by ``CanonicalSource.load`` in place of
  the stored weights): a bfloat16 run's weights widened to float32 would lose what its masters hold;
- the optimizer in the form megatron-core builds for the new dtype (``RetypedOptimizer``): ``FP32Optimizer`` for a
  float32 run of the plain optimizer, ``Float16OptimizerWithFloat16Params`` (masters beside the weights) for
  bfloat16; the distributed optimizer keeps its form, its flat buffers keyed by the new ``(param dtype, grad
  dtype)`` (``flat.buffer_dtype_key`` of the args written, ``formats.megatron.run_dtype_args``);
- the grad scaler megatron-core builds for the new dtype: a float16 run's dynamic scaler is dropped for bfloat16 or
  float32 (they have none; named in a notice), a constant ``--loss-scale``'s kept (it has no state). Into float16
  from another dtype the state is not carried: the dynamic scaler's loss scale and trackers cannot be derived.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from pgconvert.formats.megatron import run_dtype_args
from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.sizes import dtype_name
from pgconvert.model.rules import ShardRule
from pgconvert.optimizer.flat import buffer_dtype_key
from pgconvert.optimizer.source import (FORM_DISTRIBUTED, FORM_FP16, FORM_FP32, FORM_LAYER_WISE, OptimizerSource,
                                        SourceRank, StoredCopy)


def weights_dtype(source: CanonicalSource, optimizer: OptimizerSource) -> torch.dtype:
    """The dtype of the model weights the optimizer state belongs to (its first parameter's)."""
    return source.meta(optimizer.names()[0]).dtype


def retype_refusal(source: CanonicalSource, target: torch.dtype | None) -> str | None:
    """Why the source's optimizer state is not carried to ``target`` (None: it is, or there is no change), decided
    before it is opened: from the weights' dtype."""
    if target is None:
        return None
    stored = {meta.dtype for meta in map(source.meta, source.names()) if meta.dtype.is_floating_point}
    if target == torch.float16 and stored and stored != {torch.float16}:
        held = ", ".join(sorted(map(dtype_name, stored)))
        return (f"--dtype float16: the optimizer state of a {held} run is not carried into float16 (a float16 run's "
                "dynamic grad scaler, its loss scale and trackers, cannot be derived from it); pass --skip-optimizer")
    if target != torch.bfloat16 and getattr(source.megatron_args, "use_layer_wise_distributed_optimizer", False):
        return (f"--dtype {dtype_name(target)}: a layer-wise run's optimizer state "
                "(use_layer_wise_distributed_optimizer) is carried in bfloat16 only, the one dtype Megatron-LM builds "
                "the layer-wise optimizer in (float16 emerging optimizers are refused, a float32 chain fails its "
                "config check); pass --skip-optimizer")
    return None


class MasterWeights:
    """The optimizer's fp32 masters of every parameter it holds, read in place of the stored model weights."""

    def __init__(self, optimizer: OptimizerSource) -> None:
        self.optimizer = optimizer
        self._names = frozenset(optimizer.names())

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def whole(self, name: str) -> torch.Tensor:
        """The whole (source-padded) master of ``name``."""
        return self.optimizer.piece(name, "param", 1, 0, None).clone()

    def piece(self, name: str, rule: ShardRule, size: int, rank: int, rows: int | None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` of ``name``'s master cut with ``rule``, fitted to ``rows`` padded vocab rows."""
        return self.optimizer.piece(name, "param", size, rank, rows if rule.fits_rows else None, rule).clone()


class RetypedOptimizer(OptimizerSource):
    """``stored``'s state presented as megatron-core's optimizer of a run in ``dtype`` (form, buffer key, grad
    scalers, args); every value is read from ``stored``."""

    def __init__(self, stored: OptimizerSource, dtype: torch.dtype) -> None:  # reads through stored: no own state
        self.stored = stored
        self.config, self.layout, self.vocab_rows = stored.config, stored.layout, stored.vocab_rows
        self.sharding, self.rules = stored.sharding, stored.rules
        # What reading reports and checks is the stored state's (its reads are this view's).
        self.notices, self.check_finite, self._nonfinite_seen = stored.notices, stored.check_finite, set()
        self.form = stored.form if stored.form in (FORM_DISTRIBUTED, FORM_LAYER_WISE) else \
            FORM_FP32 if dtype == torch.float32 else FORM_FP16
        base = stored.first.extra.get("args")
        args = argparse.Namespace(**{**(vars(base) if base is not None else {}), **run_dtype_args(dtype, base)})
        self.first = SourceRank(stored.first.path, {**stored.first.extra, "args": args})
        self.dtype_key = buffer_dtype_key(args) if stored.dtype_key is not None else None
        self.grad_scalers = [_kept_scaler(scaler, dtype, self.form) for scaler in getattr(stored, "grad_scalers", [])]
        self._owners = stored._owners

    def step(self, name: str) -> torch.Tensor:
        return self.stored.step(name)

    def parameter(self, name: str) -> dict[str, torch.Tensor]:
        return self.stored.parameter(name)

    def piece(self, name: str, key: str, size: int, rank: int, rows: int | None,
              rule: ShardRule | None = None) -> torch.Tensor:
        return self.stored.piece(name, key, size, rank, rows, rule)

    def _stored_group_settings(self, optimizer: int) -> list[dict[str, Any]] | None:
        return self.stored._stored_group_settings(optimizer)

    def stored_copies(self) -> list[StoredCopy]:
        return self.stored.stored_copies()

    def stored_parts(self, name: str, key: str) -> list[tuple[str, torch.Tensor]]:
        return self.stored.stored_parts(name, key)


def _kept_scaler(scaler: Any, dtype: torch.dtype, form: str) -> Any:
    """The grad scaler megatron-core builds for a run in ``dtype``: FP32Optimizer has none; a constant loss scale
    (no state) is kept; a dynamic one only by a float16 run."""
    if scaler is None or form == FORM_FP32:
        return None
    return scaler if dtype == torch.float16 or scaler == {} else None


def read_masters(source: CanonicalSource, optimizer: OptimizerSource, notice: str) -> None:
    """The model's weights read from ``optimizer``'s fp32 masters (``source.masters``, with ``notice``) where they
    are not the stored weights: the optimizer keeps masters beside weights narrower than float32."""
    if source.masters is not None or optimizer.form == FORM_FP32 or weights_dtype(source, optimizer) == torch.float32:
        return
    source.masters = MasterWeights(optimizer)
    source.notices.append(notice)


def masters_for_destination(source: CanonicalSource, optimizer: OptimizerSource, dst_format: str) -> None:
    """A destination that stores the optimizer's masters as its model (``Saver.stores_masters``) and carries the
    state: its model is the masters, not the weights widened."""
    stored = dtype_name(weights_dtype(source, optimizer))
    read_masters(source, optimizer, f"{dst_format} stores the optimizer's fp32 master weights as the model: they are "
                 f"read from the source's optimizer state, not its {stored} weights widened")


def retyped(source: CanonicalSource, optimizer: OptimizerSource, dtype: torch.dtype | None) -> OptimizerSource:
    """``optimizer`` as a run in ``dtype`` carries it (itself when the weights are already in ``dtype``); where the
    masters are not the weights, they become the model's weights (``source.masters``), with a notice."""
    stored = weights_dtype(source, optimizer)
    if dtype is None or dtype == stored:
        return optimizer
    view = RetypedOptimizer(optimizer, dtype)
    rounded = "" if dtype == torch.float32 else f" rounded to {dtype_name(dtype)}"
    read_masters(source, optimizer, f"--dtype {dtype_name(dtype)}: the model's weights are the optimizer's fp32 master "
                 f"weights{rounded} (what megatron-core copies into the model after each step), not the "
                 f"{dtype_name(stored)} weights cast")
    if any(before is not None and after is None
           for before, after in zip(getattr(optimizer, "grad_scalers", []), view.grad_scalers)):
        source.notices.append(f"--dtype {dtype_name(dtype)}: the float16 run's dynamic grad scaler is not carried "
                              f"(a {dtype_name(dtype)} run has none)")
    return view


# The distributed optimizer's forms megatron-core loads into a float32 run (its other loaders raise there;
# Megatron-FSDP's fsdp_dtensor state is loaded into torch's optimizer itself).
FLOAT32_LOADABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")


def float32_load_notice(optimizer: OptimizerSource, written_form: str) -> list[str]:
    """A float32 run's distributed-optimizer state written in a form megatron-core cannot load into one: its main
    params are views of the model's leaf parameters, and its per-rank and dp_reshardable loaders
    (``load_parameter_state_from_dp_zero``, ``_from_dp_reshardable``; 0.16.1 and Megatron-LM main) copy into them
    outside ``torch.no_grad()``, so they raise."""
    key = optimizer.dtype_key
    if optimizer.form != FORM_DISTRIBUTED or not isinstance(key, tuple) or key[0] != torch.float32 \
            or any(form in written_form for form in FLOAT32_LOADABLE):
        return []
    return [f"optimizer ({written_form}) of a float32 run: megatron-core 0.16.1 (and Megatron-LM main) raises loading "
            "it (its per-rank and dp_reshardable loaders copy into the model's parameters outside torch.no_grad()); "
            "write torch_dist with --dst-optim-form fully_reshardable, which it loads"]
