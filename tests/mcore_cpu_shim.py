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
- ``DistributedOptimizer``'s Adam ``step`` on resume (two megatron-core bugs, not CPU matters; see
  ``keep_adam_step``).
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

    Both are fixed where the per-parameter state is set: the parameter gets its own copy of the step
    ``load_state_dict`` gave it, and that copy is handed in as the ``step`` to set.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
            tensors = {"step": state["step"], **tensors}
        original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def install() -> None:
    """For a throwaway process only: it changes torch.cuda and enters a TorchFunctionMode for good."""
    torch.cuda.current_device = lambda: 0
    CudaDevicesOnCpu().__enter__()
    keep_adam_step()
    sys.stderr.write("[mcore_cpu_shim] CUDA devices on the CPU; DistributedOptimizer: one Adam step per parameter\n")
