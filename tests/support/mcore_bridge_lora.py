"""A LoRA adapter as Megatron-Bridge trains and saves one for a Megatron GPT model, made with megatron-core 0.16.1.

Megatron-Bridge itself needs Transformer Engine and GPUs; what it saves is megatron-core's own work, so this
rank job does those steps with megatron-core's classes (one gloo process per TP rank, the model's groups fake,
``support.mcore_torch_dist_job`` runs it). The Megatron-Bridge facts followed, from its source
(NVIDIA-NeMo/Megatron-Bridge 067f987d, ``src/megatron/bridge/``):

- ``peft/lora.py:143-157``: ``LoRA(target_modules=[linear_qkv, linear_proj, linear_fc1, linear_fc2], dim, alpha,
  dropout)``; ``lora.py:189-261``: a megatron-core parallel linear is wrapped by ``LoRALinear(module,
  ParallelLinearAdapter(in_features, out_features, dim, alpha=..., input_is_parallel=...))``.
- ``peft/utils.py:660-669``: for ``ColumnParallelLinear`` (linear_qkv, linear_fc1) ``input_is_parallel=False``,
  for ``RowParallelLinear`` (linear_proj, linear_fc2) ``True``; in/out features are the base's global
  ``input_size``/``output_size``.
- ``peft/utils.py:1042-1083``: ``linear_in`` is ``RowParallelLinear(in, dim, input_is_parallel=True, bias=False)``
  for a row-parallel base (its columns split over TP) and ``ColumnParallelLinear(in, dim, gather_output=True,
  bias=False)`` for a column-parallel one (its ``dim`` rows split over TP); ``linear_out`` is always
  ``ColumnParallelLinear(dim, out, bias=False)`` (its rows split over TP; gathered for a row-parallel base).
  ``utils.py:1271``: the output is scaled by ``alpha / dim``.
- ``peft/lora_merge.py:65-87``: the merged weight of a rank: column-parallel base ``W_r + alpha/dim ·
  linear_out_r @ cat(linear_in over TP)``, row-parallel base ``W_r + alpha/dim · cat(linear_out over TP) @
  linear_in_r``.
- ``peft/adapter_wrapper.py:204-276``: the wrapper's state dict is the base's plus the adapter's under
  ``<module>.adapter.`` (``…linear_qkv.adapter.linear_in.weight``); ``utils.py:1513-1605``: the adapter's sharded
  state dict is ``linear_in``'s and ``linear_out``'s, a gated ``linear_fc1``'s ``linear_out`` through megatron-core's
  ``apply_swiglu_sharded_factory`` (its gate and up rows sharded apart, as the base's).
- ``training/checkpointing.py:1294-1298, 3332-3360`` and ``peft/base.py:230-248``: an adapter run's checkpoint is
  the model's sharded state dict filtered to the ``.adapter.`` keys (no ``_extra_state``), saved with
  ``dist_checkpointing.save`` (torch_dist); ``checkpointing.py:1460-1494``: ``run_config.yaml`` beside it holds
  the run's config, its ``peft`` section the LoRA settings (``_target_``, ``dim``, ``alpha``, ...). Saved with no
  adapter filter (``checkpointing.py:1294-1298`` applies it only when ``cfg.peft`` is set;
  ``training/model_load_save.py:505`` ``save_megatron_model`` sets none), the checkpoint is the whole wrapped model's sharded state dict:
  ``adapter_wrapper.py:259-262`` gives ``to_wrap`` the wrapper's own prefix, so the base keeps its plain names
  (``…linear_qkv.weight``, no ``to_wrap.``), and ``adapter_wrapper.py:266-275`` adds the adapter's under
  ``<module>.adapter.``.

A DoRA run (``dora``) follows ``peft/dora.py:75-113`` and ``peft/dora_layers.py``: the same adapter, wrapped by
``DoRALinear``, with ``weight_magnitude`` set at wrapping to the row norms of ``W + alpha/dim · linear_out @
linear_in`` over what the rank holds (``dora_layers.py:110, 122-130``; ``linear_out`` starts at zero,
``lora_B_init_method="zero"``, so that is the rank's base rows' norms), ``[out / TP]`` on a column-parallel base;
its sharded state dict adds ``<prefix>weight_magnitude``, TP-sharded on axis 0 for a column-parallel base and
replicated for a row-parallel one (``dora_layers.py:68-81``: no swiglu factory, unlike ``linear_out``'s).

``bridge_lora_load`` loads such a store back into the wrapped model at any TP, as Megatron-Bridge's
``load_peft_adapter_checkpoint`` does (``peft/utils.py:418-478``: the adapter-filtered sharded state dict,
``dist_checkpointing.load``). Each rank also writes what it holds (``rank{R}.pt``: per adapted module its local ``linear_in`` and ``linear_out``)
so a test can merge on the Megatron side by lora_merge.py's rules, independently of the checkpoint's layout.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ITERATION = 10
TARGETS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_ROW_PARALLEL = ("linear_proj", "linear_fc2")
LORA, DORA = "megatron.bridge.peft.lora.LoRA", "megatron.bridge.peft.dora.DoRA"
CANONICAL_LORA = "megatron.bridge.peft.canonical_lora.CanonicalLoRA"


class BridgeAdapter(torch.nn.Module):
    """Megatron-Bridge's ``ParallelLinearAdapter`` (peft/utils.py:923): its parameters and checkpoint layout. A routed
    expert's (``is_expert``, lora.py:189) has its linears built with ``is_expert=True`` on the expert TP group
    (utils.py:1001-1006, 1042-1083) and its replicas over expert data parallelism (utils.py:1382-1399, 1599-1600)."""

    def __init__(self, base: Any, dim: int, alpha: float, gated: bool, is_expert: bool = False,
                 out_features: int | None = None, dora: bool = False) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.dim, self.alpha, self.gated = dim, alpha, gated
        config, tp_group = base.config, base.tp_group
        self.tp_group = tp_group
        input_is_parallel = self.input_is_parallel = isinstance(base, RowParallelLinear)
        if input_is_parallel:
            self.linear_in = RowParallelLinear(base.input_size, dim, config=config, input_is_parallel=True,
                                               skip_bias_add=True, bias=False, init_method=torch.nn.init.zeros_,
                                               is_expert=is_expert, tp_group=tp_group)
        else:
            self.linear_in = ColumnParallelLinear(base.input_size, dim, config=config, bias=False, gather_output=True,
                                                  init_method=torch.nn.init.zeros_, is_expert=is_expert,
                                                  tp_group=tp_group)
        self.linear_out = ColumnParallelLinear(dim, out_features or base.output_size, config=config, bias=False,
                                               gather_output=input_is_parallel, init_method=torch.nn.init.zeros_,
                                               is_expert=is_expert, tp_group=tp_group)
        if dora:  # dora_layers.py:110, 129-130: the norm of W + scaling * linear_out @ linear_in, linear_out zero
            self.weight_magnitude = torch.nn.Parameter(torch.linalg.norm(base.weight.detach(), dim=1))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        linear_in = self.linear_in.sharded_state_dict(f"{prefix}linear_in.", sharded_offsets, metadata)
        linear_out = self.linear_out.sharded_state_dict(f"{prefix}linear_out.", sharded_offsets, metadata)
        if self.gated:  # utils.py:1535, 1562-1565
            key = f"{prefix}linear_out.weight"
            linear_out[key] = apply_swiglu_sharded_factory(linear_out[key], sharded_offsets)
        return {**linear_in, **linear_out, **self._magnitude_state(prefix, sharded_offsets)}

    def _magnitude_state(self, prefix: str, sharded_offsets: tuple) -> dict:
        """dora_layers.py:68-81: the magnitude replicated for a row-parallel base, TP-sharded on its rows otherwise."""
        import support.mcore_helpers as mcore
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        if not hasattr(self, "weight_magnitude"):
            return {}
        key, groups = f"{prefix}weight_magnitude", {"tp_group": self.tp_group, "dp_cp_group": mcore.McoreFakeGroup(
            "dp", 1, 0)}
        if self.input_is_parallel:
            return {key: make_sharded_tensor_for_checkpoint(self.weight_magnitude, key, prepend_offsets=sharded_offsets,
                                                            **groups)}
        return {key: make_tp_sharded_tensor_for_checkpoint(self.weight_magnitude, key, 0,
                                                           prepend_offsets=sharded_offsets, **groups)}


class AdapterDict(torch.nn.ModuleDict):
    """Megatron-Bridge CanonicalLoRA's ``ModuleDict`` (peft/canonical_lora.py:41-65): each adapter's state under its
    own name (``adapter.adapter_q.linear_in.weight``)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        return {key: value for name, adapter in self.items()
                for key, value in adapter.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata).items()}


def canonical_adapters(base: Any, attribute: str, spec: dict[str, Any]) -> dict[str, BridgeAdapter] | None:
    """CanonicalLoRA's adapters of ``linear_qkv`` (q, k, v: ``kv_channels`` times the heads or query groups rows,
    canonical_lora.py:383-394) and of ``linear_fc1`` (gate, up: half its rows each, canonical_lora.py:396-403), each a
    ``ParallelLinearAdapter`` named for the base (a gated ``linear_fc1``'s through the swiglu factory,
    utils.py:1537-1569); None for another module (a plain adapter, canonical_lora.py:405-409)."""
    config = base.config
    if attribute == "linear_qkv":
        rows = {"q": config.kv_channels * config.num_attention_heads, "k": config.kv_channels * config.num_query_groups,
                "v": config.kv_channels * config.num_query_groups}
    elif attribute == "linear_fc1":
        rows = {"gate": base.output_size // 2, "up": base.output_size // 2}
    else:
        return None
    gated = attribute == "linear_fc1" and config.gated_linear_unit
    return {f"adapter_{part}": BridgeAdapter(base, spec["dim"], spec["alpha"], gated, out_features=count)
            for part, count in rows.items()}


class LoRALinear(torch.nn.Module):
    """Megatron-Bridge's ``AdapterWrapper`` (peft/adapter_wrapper.py:93): the base under ``to_wrap``, its keys as they
    were, the adapter's under ``adapter.``."""

    def __init__(self, to_wrap: Any, adapter: BridgeAdapter) -> None:
        super().__init__()
        self.to_wrap, self.adapter = to_wrap, adapter

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        return {**self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata),
                **self.adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata)}


def _values(name: str, tp_rank: int, shape: torch.Size) -> torch.Tensor:
    """A trained-looking piece: fixed by the module, side and TP rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{tp_rank}".encode()))
    return 0.1 * torch.randn(shape, generator=generator)


def is_expert_linear(name: str) -> bool:
    """Megatron-Bridge's ``is_expert_linear`` (peft/utils.py:682-700): a routed expert's linear, not a shared one."""
    return re.match(r".*mlp\..*experts.*\.linear_fc[1-2]$", name) is not None and ".shared_experts." not in name


def global_module(name: str, ep_rank: int, local_experts: int) -> str:
    """``name`` with a SequentialMLP expert's local index made global (EP rank r holds experts [r·n, (r+1)·n))."""
    found = re.search(r"\.local_experts\.(\d+)\.", name)
    if found is None:
        return name
    return name.replace(found[0], f".local_experts.{ep_rank * local_experts + int(found[1])}.")


@contextlib.contextmanager
def _base_model(rank_file: Any) -> Iterator[Any]:
    """The rank file loaded into megatron-core's GPTModel (strict), while in use: with an MTP block
    (``support.mcore_mtp_model``, TP1) where its args have MTP layers."""
    import support.mcore_helpers as mcore

    if not getattr(rank_file.args, "mtp_num_layers", None):
        yield mcore.load_rank_into_gpt_model(rank_file)
        return
    from support.mcore_mtp_model import mtp_gpt_model

    with mtp_gpt_model(rank_file.args) as model:
        model.load_state_dict(dict(rank_file.model), strict=True)
        yield model


def _wrap(model: Any, layout: Any, spec: dict[str, Any]) -> dict[str, BridgeAdapter]:
    """Every module Megatron-Bridge's ``LoRA`` matches wrapped with an adapter (zeros), by the module's name with a
    routed expert's global index. ``ModuleMatcher.match`` (peft/module_matcher.py) matches a module whose own name is
    a target wherever it is, so a MoE layer's routed experts' (``experts.local_experts.<e>.linear_fc1``) and shared
    experts' linears, and an MTP layer's (``mtp.layers.<i>.transformer_layer.…``), are wrapped as a dense MLP's
    are."""
    import support.mcore_helpers as mcore

    local_experts = (model.config.num_moe_experts or 0) // layout.ep
    wanted = {target.rpartition(".")[2] for target in spec.get("targets", TARGETS)}
    adapters = {}
    with mcore.fake_group_queries():
        for name, base in list(model.named_modules()):
            owner_name, _, attribute = name.rpartition(".")
            if attribute not in wanted or not name.startswith(("decoder.layers.", "mtp.layers.")):
                continue
            owner = model.get_submodule(owner_name)
            gated = attribute == "linear_fc1" and model.config.gated_linear_unit
            module = global_module(name, layout.ep_rank, local_experts)
            parts = canonical_adapters(base, attribute, spec) if spec.get("canonical") else None
            if parts is not None:
                for part, adapter in parts.items():
                    adapters[f"{module}.{part}"] = adapter
                    adapter.local_name = f"{name}.adapter.{part}"
                setattr(owner, attribute, LoRALinear(base, AdapterDict(parts)))
                continue
            adapter = adapters[module] = BridgeAdapter(base, spec["dim"], spec["alpha"], gated, is_expert_linear(name),
                                                       dora=spec.get("dora", False))
            adapter.local_name = f"{name}.adapter"
            setattr(owner, attribute, LoRALinear(base, adapter))
    return adapters


def _adapter_state(model: Any, layout: Any) -> dict[str, Any]:
    """The model's sharded state dict as an adapter run saves and loads it (checkpointing.py:3332-3360); with EP the
    dense tensors are data-parallel over the expert ranks."""
    from support.mcore_gpt_models import model_sharded_state_dict

    sharded = model_sharded_state_dict(model, layout.ep, layout.ep_rank)
    return {key: value for key, value in sharded.items() if ".adapter." in key and "_extra_state" not in key}


def _saved_state(model: Any, spec: dict[str, Any], layout: Any) -> dict[str, Any]:
    """What the run saves: the adapter alone (``bridge_lora``) or, with no adapter filter (``bridge_lora_full``,
    checkpointing.py:1294-1298 filters only when ``cfg.peft`` is set), the whole wrapped model's sharded state dict:
    the base under its plain names (adapter_wrapper.py:259-260 passes the wrapper's own prefix to ``to_wrap``, so
    no ``to_wrap.`` appears) beside the adapter's ``<module>.adapter.`` keys (adapter_wrapper.py:266-270)."""
    from support.mcore_gpt_models import model_sharded_state_dict

    if spec["action"] == "bridge_lora_full":
        return model_sharded_state_dict(model, layout.ep, layout.ep_rank)
    return _adapter_state(model, layout)


def run_bridge_lora_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    """One TP rank (spec: base, ckpt, out, dim, alpha). ``bridge_lora``: the adapters get random values and the
    adapter-only state is saved with dist_checkpointing (``bridge_lora_full``: the whole wrapped model's, with the
    base's args in the common state); ``bridge_lora_load``: it is loaded from ``ckpt`` with
    dist_checkpointing.load, as Megatron-Bridge's load_peft_adapter_checkpoint does (peft/utils.py:418-478). Either
    way the rank's pieces go to ``out``/rank{R}.pt."""
    import support.mcore_helpers as mcore

    rank_file = mcore.rank_files(Path(spec["base"]))[rank]
    with _base_model(rank_file) as model:
        _save_or_load(model, _wrap(model, rank_file.layout, spec), rank, rank_file, spec)


def _save_or_load(model: Any, adapters: dict[str, BridgeAdapter], rank: int, rank_file: Any,
                  spec: dict[str, Any]) -> None:
    """``run_bridge_lora_rank``'s save or load of the wrapped ``model``."""
    from megatron.core import dist_checkpointing
    from support.mcore_gpt_models import content_metadata

    layout = rank_file.layout
    sides = ("linear_in", "linear_out", *(("weight_magnitude",) if spec.get("dora") else ()))
    if spec["action"] == "bridge_lora_load":
        loaded = dist_checkpointing.load({"model": _adapter_state(model, layout)}, spec["ckpt"],
                                         strict="raise_all")["model"]
        held = {module: {side: loaded[f"{adapter.local_name}.{_key(side)}"] for side in sides}
                for module, adapter in adapters.items()}
    else:
        with torch.no_grad():
            for module, adapter in adapters.items():
                for side in sides:
                    weight = _parameter(adapter, side)
                    values = _values(f"{module}.{side}", layout.tp_rank, weight.shape)
                    if side == "weight_magnitude":  # a trained magnitude: each initial row norm moved apart
                        weight.mul_(1 + 2 * values)
                    else:
                        weight.copy_(values)
        held = {module: {side: _parameter(adapter, side).detach().clone() for side in sides}
                for module, adapter in adapters.items()}
        state = {"model": _saved_state(model, spec, layout), "checkpoint_version": 3.0, "iteration": ITERATION}
        if spec["action"] == "bridge_lora_full":
            state["args"] = rank_file.args
        dist_checkpointing.save(state, spec["ckpt"], content_metadata=content_metadata())
    torch.save(held, Path(spec["out"]) / f"rank{rank}.pt")


def _parameter(adapter: BridgeAdapter, side: str) -> torch.Tensor:
    return adapter.weight_magnitude if side == "weight_magnitude" else getattr(adapter, side).weight


def _key(side: str) -> str:
    return side if side == "weight_magnitude" else f"{side}.weight"


def write_run_config(iteration_dir: Path, dim: int, alpha: float, tp: int,
                     targets: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
                     target: str = LORA) -> None:
    """``run_config.yaml`` with the ``peft`` section Megatron-Bridge's ``cfg.to_yaml`` writes for a LoRA run (the
    LoRA dataclass's fields, lora.py:143-157), a CanonicalLoRA run (the same fields) or a DoRA run (dora.py:58-68,
    without LoRA's MoE fields) and the model's parallel sizes."""
    import yaml

    peft: dict[str, Any] = {"_target_": target, "target_modules": list(targets), "exclude_modules": [], "dim": dim,
                            "alpha": alpha, "dropout": 0.0, "dropout_position": "pre", "lora_A_init_method": "xavier",
                            "lora_B_init_method": "zero"}
    if target != DORA:
        peft.update({"a2a_experimental": False, "lora_dtype": None, "normalize_moe_lora": False,
                     "share_expert_adapters": True})
    config = {"model": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1}, "peft": peft}
    (iteration_dir / "run_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def bridge_lora_checkpoint(base: Path, root: Path, out: Path, dim: int, alpha: float, whole: bool = False,
                           canonical: bool = False, dora: bool = False, targets: tuple[str, ...] = TARGETS) -> Path:
    """A Megatron-Bridge LoRA run's checkpoint directory at ``root`` (``iter_*`` with the adapter-only torch_dist store
    and run_config.yaml, the tracker) for the TP Megatron checkpoint ``base``; ``out``: the ranks' held pieces.
    ``whole``: the wrapped model saved whole instead (base and adapter in one store, megatron-core's ``args`` in its
    common state); the adapters get the same values either way. ``canonical``: Megatron-Bridge's CanonicalLoRA (q, k,
    v and gate, up apart; its default targets, canonical_lora.py:221-232). ``dora``: a DoRA run's, on the modules
    ``targets`` names."""
    from support.mcore_helpers import rank_files
    from support.mcore_torch_dist_job import run_job

    layout = rank_files(base)[0].layout
    tp = layout.tp
    iteration_dir = root / f"iter_{ITERATION:07d}"
    iteration_dir.mkdir(parents=True)
    run_job({"action": "bridge_lora_full" if whole else "bridge_lora", "base": str(base), "ckpt": str(iteration_dir),
             "world": tp * layout.ep, "tp": tp, "pp": 1, "ep": layout.ep, "dim": dim, "alpha": alpha,
             "canonical": canonical, "dora": dora, "targets": list(targets)}, out)
    if canonical:
        write_run_config(iteration_dir, dim, alpha, tp, ("linear_q", "linear_k", "linear_v", "linear_proj",
                                                         "linear_fc1_up", "linear_fc1_gate", "linear_fc2"),
                         CANONICAL_LORA)
    else:
        write_run_config(iteration_dir, dim, alpha, tp, tuple(target.rpartition(".")[2] for target in targets),
                         DORA if dora else LORA)
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return root


def load_bridge_lora(base: Path, store: Path, out: Path, dim: int, alpha: float, dora: bool = False,
                     targets: tuple[str, ...] = TARGETS) -> None:
    """megatron-core's dist_checkpointing.load of the adapter store ``store`` into the TP model ``base`` wrapped as
    Megatron-Bridge wraps it; each rank's pieces in ``out``."""
    from support.mcore_helpers import rank_files
    from support.mcore_torch_dist_job import run_job

    layout = rank_files(base)[0].layout
    run_job({"action": "bridge_lora_load", "base": str(base), "ckpt": str(store), "world": layout.tp * layout.ep,
             "tp": layout.tp, "pp": 1, "ep": layout.ep, "dim": dim, "alpha": alpha, "dora": dora,
             "targets": list(targets)}, out)


def held_by_tp_rank(held: Path, tp: int, ep: int = 1) -> list[dict[str, dict[str, torch.Tensor]]]:
    """What each TP rank's adapters held (``rank{R}.pt`` of a job, R = ep_rank * tp + tp_rank), its EP ranks joined:
    every module by its name with a routed expert's global index."""
    joined: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(tp)]
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            joined[tp_rank].update(torch.load(held / f"rank{ep_rank * tp + tp_rank}.pt", weights_only=True))
    return joined


def megatron_merged_logits(paths: dict[str, Path], ids: torch.Tensor, scaling: float) -> torch.Tensor:
    """The TP model with each rank's weights merged as Megatron-Bridge's LoRAMerge (peft/lora_merge.py:65-87)
    merges them, run rank by rank: a column-parallel base (linear_qkv, linear_fc1) adds ``linear_out_r @ cat(linear_in
    over ranks)``, a row-parallel one (linear_proj, linear_fc2) ``cat(linear_out over ranks) @ linear_in_r``, both
    times alpha / dim; a routed expert's as its TP rank's (its EP ranks joined, experts by global index);
    CanonicalLoRA's parts each so, joined as its wrappers join their outputs (``canonical_rank_delta``)."""
    from support.hf_helpers import megatron_tp_logits, read_megatron_tp_ranks
    from support.mcore_helpers import rank_files

    models = read_megatron_tp_ranks(paths["megatron"])
    held = held_by_tp_rank(paths["held"], len(models), rank_files(paths["megatron"])[0].layout.ep)
    config = json.loads((paths["hf"] / "config.json").read_text())
    for rank, model in enumerate(models):
        deltas: dict[str, dict[str, torch.Tensor]] = {}
        for module in held[0]:
            linear_in = [pieces[module]["linear_in"].double() for pieces in held]
            linear_out = [pieces[module]["linear_out"].double() for pieces in held]
            if module.endswith(("linear_proj", "linear_fc2")):
                delta = torch.cat(linear_out) @ linear_in[rank]
            else:
                delta = linear_out[rank] @ torch.cat(linear_in)
            base, _, part = module.rpartition(".adapter_") if ".adapter_" in module else (module, "", "")
            deltas.setdefault(base, {})[part] = delta
        for module, parts in deltas.items():
            delta = parts[""] if "" in parts else canonical_rank_delta(parts, config, len(models))
            model[f"{module}.weight"] = model[f"{module}.weight"] + scaling * delta
    return megatron_tp_logits(models, config, ids).to(torch.float32)


def canonical_rank_delta(parts: dict[str, torch.Tensor], config: dict[str, Any], tp: int) -> torch.Tensor:
    """One rank's delta of a CanonicalLoRA-wrapped module from its parts' deltas: ``LoRALinearSplitQKV``'s q, k and
    v rows interleaved by the rank's query groups (canonical_lora.py:75-135), ``LoRALinearSplitFC1UpGate``'s
    ``[gate; up]`` (canonical_lora.py:138-156)."""
    if "gate" in parts:
        return torch.cat([parts["gate"], parts["up"]])
    groups = (config.get("num_key_value_heads") or config["num_attention_heads"]) // tp
    q, k, v = (parts[name].chunk(groups) for name in ("q", "k", "v"))
    return torch.cat([rows for group in zip(q, k, v, strict=True) for rows in group])


def peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers + PEFT's logits of the HF model ``base`` with the adapter ``adapter`` loaded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    with torch.no_grad():
        return model(ids).logits


def rewrite_store(lora: Path, change: object) -> None:
    """The store's tensors (``lora``: the store, or a run's directory with its ``iter_*``), read and written back by
    torch.distributed.checkpoint (one process) after ``change`` edits the dict of them; megatron-core's
    metadata.json, common.pt and run_config.yaml kept."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    store = lora if (lora / ".metadata").is_file() else next(lora.glob("iter_*"))
    metadata = FileSystemReader(str(store)).read_metadata()
    tensors = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    dcp.load(tensors, checkpoint_id=str(store), no_dist=True)
    change(tensors)  # type: ignore[operator]
    for data in [*store.glob("*.distcp"), store / ".metadata"]:
        data.unlink()
    dcp.save(tensors, checkpoint_id=str(store), no_dist=True)


def exported_bridge_run(root: Path, hf: Path, layout: dict[str, int], dim: int, alpha: float,
                        **adapter: Any) -> dict[str, Path]:
    """The HF model ``hf`` converted to a Megatron checkpoint at ``layout`` (``dst_tp``, ``dst_ep``), a
    Megatron-Bridge adapter run on it (``adapter``: ``bridge_lora_checkpoint``'s options) and its PEFT export, by
    the names the adapter tests take (``held``: what each rank held)."""
    import pgconvert

    pgconvert.convert(hf, root / "megatron", dst_format="megatron", **layout)
    lora = bridge_lora_checkpoint(root / "megatron", root / "lora", root / "held", dim, alpha, **adapter)
    exported = root / "exported"
    pgconvert.export_adapter(lora, exported, base=root / "megatron")
    return {"hf": hf, "megatron": root / "megatron", "lora": lora, "held": root / "held", "exported": exported}


def assert_export_refused(lora: Path, base: Path, out: Path, *fragments: str) -> None:
    """``export-adapter`` of ``lora`` for ``base`` into ``out`` refused (exit 2) naming each fragment, nothing left."""
    from support.cli_helpers import assert_clean_refusal, run_cli

    assert_clean_refusal(run_cli("export-adapter", lora, out, "--base", base), 2, *fragments)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
