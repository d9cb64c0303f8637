"""Megatron-Bridge LoRA adapters on a MoE layer's routed experts: one pair per expert, and PEFT's fused form of them.

Megatron-Bridge's ``LoRA`` wraps a routed expert's ``linear_fc1`` / ``linear_fc2`` as it wraps a dense linear
(peft/lora.py ``transform``; ``is_expert_linear`` in peft/utils.py names the module ``…mlp.experts….linear_fc<n>``).
Whatever the experts' form, the adapter's state is saved under the experts' common key with a global expert axis
after the layer axis, as megatron-core saves the experts' own weights:

- SequentialMLP (``experts.local_experts.<e>.linear_fc1``): one ``ParallelLinearAdapter`` per expert, its sharded
  state dict given the expert's offset by ``SequentialMLP.sharded_state_dict`` (``…mlp.experts.experts.linear_fc1
  .adapter.linear_in.weight`` ``[layers, experts, dim, in]``);
- grouped experts (TEGroupedMLP's ``experts.linear_fc1``) with ``share_expert_adapters`` (the default): one
  ``ParallelLinearAdapter`` per EP rank shared by its experts, saved once per expert slot
  (``ParallelLinearAdapter._apply_expert_axis_factory``), the same values in every slot;
- grouped experts with ``share_expert_adapters=False``: ``GroupedExpertLinearAdapter``'s packed ``[experts, dim,
  in]`` weights, their expert axis sharded over EP (``_make_grouped_expert_sharded_tensor``);
- ``experts_shared_outer_loras``: ``SharedOuterGroupedExpertAdapter``, one side per expert and the other (fc1's
  ``linear_in``, fc2's ``linear_out``) shared by all, saved without an expert axis.

Each form is read as one pair per expert (a side without an expert axis the same for every expert): expert ``e``'s
weight changes by ``linear_out[e] @ linear_in[e] * alpha / dim``, the same math in every form. The older checkpoints
of a shared grouped adapter (both sides without an expert axis) do not say how many experts share them, and are
refused by name. With ``singleton_local_shards`` the expert index is in the key (``experts.experts.<e>.``).

In PEFT's names these are transformers' fused experts parameters (``target_parameters``, PEFT's ``ParamWrapper``, as
``adapters.peft`` reads them): per layer, ``gate_up_proj`` from ``linear_fc1`` (a gated one's ``[gate; up]`` rows as
the family transform splits them, back to back) and ``down_proj`` from ``linear_fc2``; lora_A the experts' ``linear_in``
stacked expert-major, lora_B their ``linear_out`` columns rank-major, the layout PEFT's ``ParamWrapper`` saves.
"""

from __future__ import annotations

import re

import torch

from pgconvert.adapters.peft import PeftAdapter
from pgconvert.errors import CheckpointError, ValidationError

# An adapted routed experts' module within a layer, as the adapter's store names it.
ADAPTED_EXPERTS = re.compile(r"(?P<inner>(?:transformer_layer\.)?)mlp\.experts\.experts\.(?:(?P<expert>\d+)\.)?"
                             r"(?P<linear>linear_fc[12])")
# A canonical routed expert's weight: the layer's experts module, the expert and the linear.
EXPERT_WEIGHT = re.compile(r"(?:decoder|mtp)\.layers\.\d+\.(?:transformer_layer\.)?mlp\.experts\.local_experts\."
                           r"(?P<expert>\d+)\.(?P<linear>linear_fc[12])\.weight")
# How PEFT's keys of a fused experts module end (its one or two ParamWrappers).
EXPERTS_KEY_ENDS = (".experts.lora_A.weight", ".experts.base_layer.lora_A.weight")
# The module names PEFT, loading an adapter for a transformers 5 MoE model, takes for its experts' pre-fusion linears
# and turns into the fused experts' target_parameters (peft/utils/transformers_weight_conversion.py
# ``_MOE_TARGET_MODULE_MAPPING``, applied to every family transformers' conversion mapping fuses): a dense layer's or a
# shared expert's pairs under these names would not be loaded.
PEFT_REMAPPED_MODULES = ("gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# transformers' fused experts parameters (PEFT's target_parameters) by the Megatron linear they hold.
FUSED_PARAMETERS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}


def is_experts_module(module: str) -> bool:
    return ADAPTED_EXPERTS.fullmatch(module) is not None


def expert_pairs(where: str, layer: str, module: str, linear_in: torch.Tensor,
                 linear_out: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One layer's (``layer``: ``decoder.layers.3.``, ``mtp.layers.0.``) adapted experts' module ``module``
    (``mlp.experts.experts[.<e>].linear_fc<n>``, an MTP layer's under ``transformer_layer.``) as one
    ``(linear_in, linear_out)`` pair per expert, by the canonical weight it changes."""
    match = ADAPTED_EXPERTS.fullmatch(module)
    assert match is not None, module
    name = f"{layer}{module}"
    if match["expert"] is not None:  # singleton_local_shards: one expert's pair, no expert axis
        sides = {int(match["expert"]): (linear_in, linear_out)}
    else:
        sides = _per_expert(name, linear_in, linear_out, where)
    return {f"{layer}{match['inner']}mlp.experts.local_experts.{expert}.{match['linear']}.weight": pair
            for expert, pair in sorted(sides.items())}


def _per_expert(name: str, linear_in: torch.Tensor, linear_out: torch.Tensor,
                where: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's sides from tensors with a leading expert axis (one side may lack it: shared by all)."""
    counts = {tensor.shape[0] for tensor in (linear_in, linear_out) if tensor.dim() == 3}
    if not counts:
        raise CheckpointError(f"{where}: {name}.adapter: linear_in {list(linear_in.shape)} and linear_out "
                              f"{list(linear_out.shape)} have no expert axis: a shared grouped-experts adapter as "
                              "older Megatron-Bridge versions saved it, which does not say how many experts share "
                              "it; load and save it again with a Megatron-Bridge that writes the expert axis")
    if len(counts) != 1:
        raise CheckpointError(f"{where}: {name}.adapter: linear_in {list(linear_in.shape)} and linear_out "
                              f"{list(linear_out.shape)} hold different numbers of experts")
    experts = counts.pop()
    return {expert: tuple(side[expert] if side.dim() == 3 else side for side in (linear_in, linear_out))
            for expert in range(experts)}


def hf_experts_module(names: tuple[str, ...]) -> str:
    """The HF experts module (``model.layers.3.mlp.experts``) of one expert's HF weights, as transformers' checkpoints
    name them: ``<experts module>.<expert>.<linear>.weight``."""
    module, expert, _, _ = names[0].rsplit(".", 3)
    assert expert.isdigit(), names
    return module


def fused_experts_pairs(pairs: dict[str, tuple[torch.Tensor, list[torch.Tensor]]], module: str,
                        experts: int, where: str) -> dict[str, torch.Tensor]:
    """PEFT's keys of one layer's fused experts (``module``: its HF experts module, as transformers names it in
    memory): ``pairs`` by canonical expert weight, each its ``linear_in`` and its ``linear_out`` cut into the HF
    parts' rows. The first fused parameter's pair is keyed under the module, the second under its ``base_layer``,
    as PEFT nests two ``ParamWrapper``s (``down_proj`` outermost)."""
    by_linear: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for weight, (a, parts) in pairs.items():
        match = EXPERT_WEIGHT.fullmatch(weight)
        assert match is not None, weight
        by_linear.setdefault(match["linear"], {})[int(match["expert"])] = (a, torch.cat(parts))
    tensors = {}
    for index, linear in enumerate(sorted(by_linear, reverse=True)):  # linear_fc2 (down_proj) outermost
        found = by_linear[linear]
        if sorted(found) != list(range(experts)):
            raise ValidationError(f"{where}: {module}: the adapter has {linear} of experts {sorted(found)}, the "
                                  f"model {experts} experts: PEFT's fused experts parameter adapts all of them")
        key = f"{module}{'.base_layer' if index else ''}"
        tensors[f"{key}.lora_A.weight"] = torch.cat([found[e][0] for e in range(experts)]).contiguous()
        # B's columns rank-major: column k * experts + e is expert e's column k (PEFT's ParamWrapper layout).
        tensors[f"{key}.lora_B.weight"] = torch.stack([found[e][1] for e in range(experts)], dim=2).flatten(1)
    return tensors


def refuse_pairs_peft_remaps(adapter: PeftAdapter, num_experts: int | None) -> None:
    """Refuse, for a MoE model, pairs PEFT would not load: those of HF modules whose names it remaps onto the fused
    experts (a dense layer's MLP, a shared expert), which it leaves out of the model without a word."""
    lost = sorted(weight for weight in adapter.pairs
                  if weight.removesuffix(".weight").rpartition(".")[2] in PEFT_REMAPPED_MODULES)
    if num_experts and lost:
        raise ValidationError(f"{adapter.where}: adapts {', '.join(lost[:3])}{' …' if len(lost) > 3 else ''} of a "
                              "MoE model: PEFT, loading an adapter for transformers' fused experts, takes target "
                              f"modules named {', '.join(PEFT_REMAPPED_MODULES[1:4])} for the routed experts' and "
                              "would leave these pairs out; merge the adapter with --merge-adapter instead")
