"""Megatron-Bridge's ``CanonicalLoRA``: one adapter per HF projection under a fused ``linear_qkv`` / ``linear_fc1``.

``CanonicalLoRA`` (peft/canonical_lora.py) wraps ``linear_qkv`` with ``LoRALinearSplitQKV`` over a ``ModuleDict`` of
``adapter_q``, ``adapter_k``, ``adapter_v`` (each a ``ParallelLinearAdapter`` whose ``linear_out`` has the heads' or
query groups' rows in order; the wrapper interleaves their outputs by query group, as the fused weight's rows are)
and a gated ``linear_fc1`` with ``LoRALinearSplitFC1UpGate`` over ``adapter_gate`` and ``adapter_up`` (outputs joined
``[gate; up]``); ``linear_proj`` and ``linear_fc2`` get a plain adapter. The store names them
``<module>.adapter.adapter_<part>.linear_in/linear_out.weight``. Each is one HF projection's pair
(q_proj/k_proj/v_proj, gate_proj/up_proj: part ``i`` of the family transform's split), its own lora_A, so in PEFT's
names each part's pair is the adapter's pair as it is, and the canonical delta is the transform's ``fuse`` of the
parts' deltas (a part without an adapter: zero rows), exact as for any PEFT adapter.

``ParallelLinearAdapter.sharded_state_dict`` (peft/utils.py:1537-1569) applies megatron-core's
``apply_swiglu_sharded_factory`` to any adapter whose base is a gated ``linear_fc1``, ``adapter_gate`` and
``adapter_up`` included: each TP rank's rows of such a ``linear_out`` are saved as two halves, the first halves of the
ranks in order and then the second halves. The store's chunks say how many rows a half of a rank holds, so the
rows are put back in rank order (what the run computed with) whatever TP reads them.
"""

from __future__ import annotations

import torch

from pgconvert.errors import CheckpointError, ValidationError

CANONICAL_LORA_TARGET = "megatron.bridge.peft.canonical_lora.CanonicalLoRA"
# Each part's fused module and its index among the module's HF parts (the family transform's split order).
PARTS = {"q": ("linear_qkv", 0), "k": ("linear_qkv", 1), "v": ("linear_qkv", 2),
         "gate": ("linear_fc1", 0), "up": ("linear_fc1", 1)}


def part_name(weight: str, part: str) -> str:
    """The key of a part's pair: ``decoder.layers.0.self_attention.linear_qkv.adapter_q``."""
    return f"{weight.removesuffix('.weight')}.adapter_{part}"


def check_part(where: str, module: str, part: str) -> int:
    """The part's index among its module's HF parts; refused where the module is not the part's fused one."""
    owner, index = PARTS[part]
    if ".experts." in module:  # PEFT's fused gate_up_proj has one lora_A per expert: gate's and up's differ here
        raise ValidationError(f"{where}: {module}.adapter.adapter_{part}: CanonicalLoRA's separate gate and up "
                              "adapters on routed experts are not read yet")
    if module.rpartition(".")[2] != owner:
        raise CheckpointError(f"{where}: {module}.adapter.adapter_{part}: CanonicalLoRA's adapter_{part} is one of "
                              f"{owner}'s, not of {module.rpartition('.')[2]}")
    return index


def rank_ordered_rows(out: torch.Tensor, half_rows: int, where: str) -> torch.Tensor:
    """A gated linear_fc1's part adapter's ``linear_out`` as saved through the swiglu factory (its rank halves split
    apart, ``half_rows`` rows each) with its rows back in rank order."""
    rows = out.shape[0]
    if half_rows <= 0 or rows % (2 * half_rows):
        raise CheckpointError(f"{where}: linear_out's {rows} rows are not saved in halves of {half_rows} rows, as "
                              "megatron-core's swiglu factory saves a gated linear_fc1's adapters")
    first, second = out.split(rows // 2)
    return torch.cat([half for pair in zip(first.split(half_rows), second.split(half_rows), strict=True)
                      for half in pair])
