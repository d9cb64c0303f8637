"""Test-only: what megatron-core 0.16.1's DDP wrapper and optimizers need to run on a CPU-only torch.

Installed only inside the throwaway rank processes of ``mcore_optimizer_step.py`` (never in pytest's
own process). Each piece is the narrowest answer to one call megatron-core makes:

- ``CudaDevicesOnCpu``: a ``TorchFunctionMode`` that rewrites ``device=`` arguments naming a CUDA
  device (``"cuda"``, ``torch.device("cuda")``, or the integer ``torch.cuda.current_device()``
  returns) to the CPU, and makes ``Tensor.cuda()`` a no-op. The grad/param buffers of
  ``DistributedDataParallel``, the grad-norm and found-inf tensors of the optimizers and the dummy
  state of ``DistributedOptimizer.load_state_dict`` are all allocated on
  ``torch.cuda.current_device()``.
- ``torch.cuda.current_device`` answers 0 (on a CPU build it raises), which the mode above maps to
  the CPU.
- ``Tensor.type()`` of a CPU tensor answered with its CUDA name: the optimizers sort parameters by
  ``param.type()`` (``torch.cuda.BFloat16Tensor`` / ``torch.cuda.FloatTensor``, anything else is
  refused) and ``clip_grads`` asserts the grads are ``torch.cuda.FloatTensor``.
- ``DistributedOptimizer``'s Adam ``step`` on resume (megatron-core bugs, not CPU matters; see
  ``keep_adam_step`` and ``adam_state_before_sharded_load``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _on_cpu(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


class CudaDevicesOnCpu(TorchFunctionMode):
    """Every tensor megatron-core puts on 'the current CUDA device' is made on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "to":
            args = tuple(_on_cpu(arg) for arg in args)
        if name == "type" and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def keep_adam_step() -> None:
    """Two megatron-core bugs of ``DistributedOptimizer`` without Apex/Transformer Engine (torch's Adam,
    which keeps a ``step`` tensor per parameter), both in the resume path; GPU runs with Apex/TE never
    reach them. Line numbers: megatron-core 0.16.1 distrib_optimizer.py (Megatron-LM d98e8a64 in brackets).

    1. ``load_state_dict`` gives every Adam state the *same* ``step`` tensor, made from the param
       groups' step (817-825 [1024-1031]: ``for s in state_dict_state.values(): s["step"] = step``),
       and torch's ``Optimizer.load_state_dict`` keeps a float32 CPU tensor as it is. Adam's step
       then adds 1 to that one tensor once per parameter: after one step every parameter reports
       ``step`` = old step + number of parameters, and the bias corrections are those of that step.
    2. ``load_parameter_state`` -> ``load_parameter_state_from_dp_zero`` hands
       ``_set_main_param_and_optimizer_states`` only ``param``/``exp_avg``/``exp_avg_sq`` (the file
       holds no step), and that copies every key of the state, ``step`` included:
       ``KeyError: 'step'`` (938-940 [1217-1223]).

    3. torch_dist ``dp_reshardable``: ``sharded_param_state_dp_reshardable`` keeps each state's ``step``
       as a ``LocalNonpersistentObject`` (1664-1667) -- the tensor the state held when the sharded state
       dict was made, before ``load_state_dict`` set the checkpoint's step -- and
       ``load_parameter_state_from_dp_reshardable`` hands that stale step to
       ``_set_main_param_and_optimizer_states`` (1804), which copies it over the loaded one.

    All three are fixed where the per-parameter state is set: the parameter gets its own copy of the
    step ``load_state_dict`` gave it (megatron-core's rule: the step comes from the param groups), and
    that copy is what is set, whatever ``step`` the caller handed in.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def adam_state_before_sharded_load() -> None:
    """The torch_dist load of megatron-core 0.16.1's ``DistributedOptimizer`` with torch's Adam (no
    Apex/Transformer Engine) cannot start: ``sharded_state_dict(is_loading=True)`` first calls
    ``state_dict()``, which reads the step from the Adam state of every parameter,
    ``steps = list(set(s["step"].item() for s in inner_state_dict["state"].values())); assert len(steps) == 1``
    (distrib_optimizer.py 640-642 [Megatron-LM d98e8a64: 837-839]), and a freshly built optimizer has
    no Adam state yet: ``AssertionError``. Megatron-LM's ``load_checkpoint`` ->
    ``generate_state_dict`` -> ``optimizer.sharded_state_dict`` fails the same way. With Apex's or
    TE's FusedAdam the step lives in the param groups and the empty state passes (``steps`` may be
    empty there).

    Worked around just before that call, only when the inner optimizer holds no state yet: every main
    param gets the state torch's Adam gives it before its first step (``exp_avg``/``exp_avg_sq``
    zeros, as megatron-core's own ``init_state_fn`` makes them, and its own ``step`` tensor 0.0,
    ``Adam._init_group``). ``state_dict()`` then reports step 0; the loaded checkpoint overwrites the
    tensors, and its param groups' step replaces the 0 (``load_state_dict``, with ``keep_adam_step``).
    """
    from megatron.core.optimizer import distrib_optimizer

    original = distrib_optimizer.DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self: Any, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           *args: Any, **kwargs: Any) -> Any:
        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            for group in self.optimizer.param_groups:
                for main in group["params"]:
                    self.optimizer.state[main] = {"exp_avg": torch.zeros_like(main),
                                                  "exp_avg_sq": torch.zeros_like(main),
                                                  "step": torch.tensor(0.0)}
        return original(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    distrib_optimizer.DistributedOptimizer.sharded_state_dict = sharded_state_dict


def allow_cpu_save() -> None:
    """``dist_checkpointing.save`` on the CPU: its file writer syncs CUDA before copying tensors to the CPU
    (``FileSystemWriterAsync.preload_tensors``), and logs psutil's memory figure
    (``filesystem_async._process_memory``; megatron-core does not declare psutil). For a throwaway process only.
    Its writers' results queue comes from a forked Manager (``forked_results_queue``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    filesystem_async._process_memory = lambda: 0
    forked_results_queue()


def forked_results_queue() -> None:
    """megatron-core's queue through which ``dist_checkpointing.save``'s writer processes report
    (``filesystem_async._results_queue``, one per process), made now by a Manager forked from this process: made on
    first use, megatron-core starts that Manager with "spawn", a fresh interpreter importing this process's main
    module again, most of a small save's time. The writers themselves megatron-core forks."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def install() -> None:
    """For a throwaway process only: it changes torch.cuda and enters a TorchFunctionMode for good."""
    torch.cuda.current_device = lambda: 0
    CudaDevicesOnCpu().__enter__()
    keep_adam_step()
    adam_state_before_sharded_load()
    sys.stderr.write("[mcore_cpu_shim] CUDA devices on the CPU; DistributedOptimizer: one Adam step per parameter\n")
