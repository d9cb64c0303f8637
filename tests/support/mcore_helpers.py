"""Test-only helpers: load a Megatron checkpoint into megatron-core's own GPTModel, on CPU.

megatron-core is the client of the ``megatron`` format, so "the output is right" means what
megatron-LM's ``gpt_builder`` + ``load_checkpoint`` would do with it: for every rank, build
megatron-core's ``GPTModel`` from the rank file's own ``args`` (local, non-Transformer-Engine layer
spec, that rank's pipeline stage) and ``load_state_dict(rank_file["model"], strict=True)``; at TP1,
run its forward and compare the logits with an independent plain-torch forward over the full model.

Importing this module imports megatron-core; test modules call
``pytest.importorskip("megatron.core", ...)`` first. Verified against megatron-core 0.16.1.

Nothing here calls ``torch.distributed.init_process_group`` or writes megatron-core's
``parallel_state`` globals: a rank lives only in the ``ProcessGroupCollection`` of fake groups
passed to ``GPTModel(pg_collection=...)``. The few process-wide things megatron-core reaches for
are swapped for the duration of one call and restored (each is explained where it is done).
"""

from __future__ import annotations

import argparse
import functools
import contextlib
import copy
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import megatron.core.tensor_parallel as mcore_tensor_parallel
import megatron.core.utils as mcore_utils
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import GlobalMemoryBuffer
from support.megatron_fixtures import CHECKPOINT_FILE, TinyModel, load_rank_file, make_full_model, resolve_checkpoint_dir

from pgconvert.model.grid import FakeProcessGroup

# --------------------------------------------------------------------------- fake-group queries
#
# megatron-core asks a group for its rank and size only through three helpers of
# ``megatron.core.utils``, and all three first test ``torch.distributed.is_initialized()``: without an
# initialized default group ``get_pg_size`` answers 1, ``get_pg_rank`` answers 0 and
# ``get_tensor_model_parallel_group_if_none`` answers None *whatever group is passed*, so a fake TP2
# collection silently builds a TP1 model. Faking ``torch.distributed.is_initialized`` would be wider
# and wrong (megatron-core then calls real collectives, e.g. the tied-embedding all_reduce in
# ``LanguageModule.setup_embeddings_and_output_layer``). The narrowest fix is to swap just these three
# helpers for the answers they give in a real job that passes ``pg_collection`` and never initializes
# ``parallel_state``: ask the group itself.
#
# They are imported by name into ~20 megatron-core modules, so every binding of the original
# function object is swapped (and restored on exit); a ``from megatron.core.utils import ...`` run
# later inside a function body reads the swapped ``megatron.core.utils`` attribute.


def _group_size(group: Any = None) -> int:
    return 1 if group is None else group.size()


def _group_rank(group: Any = None) -> int:
    return 0 if group is None else group.rank()


def _tp_group_as_given(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
    return tp_group


GROUP_QUERY_REPLACEMENTS = {
    "get_pg_size": _group_size,
    "get_pg_rank": _group_rank,
    "get_tensor_model_parallel_group_if_none": _tp_group_as_given,
}


@contextmanager
def fake_group_queries(run_tp_group: Any = None) -> Iterator[None]:
    """While active, megatron-core reads ranks and sizes from the groups it is given. ``run_tp_group``: the TP
    group parallel_state would hold in a run, which ``get_tensor_model_parallel_group_if_none`` answers when
    given none (megatron-core 0.16.1's MambaMixer passes none for its own parameters); None: no such group."""
    originals = {name: getattr(mcore_utils, name) for name in GROUP_QUERY_REPLACEMENTS}
    replacements = dict(GROUP_QUERY_REPLACEMENTS)
    if run_tp_group is not None:
        replacements["get_tensor_model_parallel_group_if_none"] = (
            lambda tp_group, is_expert=False, check_initialized=True: run_tp_group if tp_group is None else tp_group)
    swapped: list[tuple[object, str, object]] = []
    try:
        for module_name, module in list(sys.modules.items()):
            if module is None or module_name.split(".")[:2] != ["megatron", "core"]:
                continue
            namespace = vars(module)
            for name, replacement in replacements.items():
                if namespace.get(name) is originals[name]:
                    swapped.append((module, name, originals[name]))
                    setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in reversed(swapped):
            setattr(module, name, original)


# megatron-core's ``LanguageModule._set_attention_backend`` (run by every GPTModel constructor)
# asserts that NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN are unset or already equal to
# what the configured backend wants, then writes them into ``os.environ``. Restoring them keeps the
# process environment as it was, and keeps one test's backend from failing the next one's assertion.
NVTE_BACKEND_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextmanager
def restored_attention_backend_env() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in NVTE_BACKEND_VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --------------------------------------------------------------------------- process groups


class McoreFakeGroup(FakeProcessGroup):
    """pgconvert's fake group, failing loudly if megatron-core asks more of it than rank()/size().

    Building, loading and a TP1 forward only ever call rank() and size() (through the swapped
    helpers above); anything else would be a collective, which a fake group must not pretend to do.
    """

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{type(self).__name__}({self.name!r}): megatron-core asked for {name!r}; a fake group "
            "answers only rank() and size()"
        )


def fake_pg_collection(tp: int, pp: int, tp_rank: int, pp_rank: int) -> ProcessGroupCollection:
    """megatron-core's own ``ProcessGroupCollection`` holding fake groups for one rank.

    GPTModel reads ``tp``, ``pp``, ``cp`` and ``embd``. ``embd`` (the first/last-stage group that
    all-reduces tied embeddings) is None, as megatron-core documents for "no embedding group needed":
    a group there makes it call ``torch.distributed.get_rank()``.
    """
    collection = ProcessGroupCollection()
    collection.tp = McoreFakeGroup("tp", tp, tp_rank)
    collection.pp = McoreFakeGroup("pp", pp, pp_rank)
    collection.cp = McoreFakeGroup("cp", 1, 0)
    collection.embd = None
    return collection


# --------------------------------------------------------------------------- model from args


@dataclass(frozen=True)
class RankLayout:
    """One rank of a checkpoint, as its args describe it."""

    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    ep: int = 1
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


# megatron-LM's ``core_transformer_config_from_args`` (megatron/training/argument_utils.py:277,
# d98e8a64) first copies every TransformerConfig field that ``args`` has, by name. These are the
# fields beyond a dense Llama that pgconvert writes for the HF families megatron-core can run
# (windows, NoPE layers, attention sinks, GPT-OSS's clamped GLU, partial/interleaved RoPE, MoE with
# shared experts and sigmoid/grouped routing); each is copied when the args hold it, as megatron-LM
# does, so a setting the writer drops or misnames changes megatron-core's logits. Not copied:
# ``layernorm_zero_centered_gamma``, which the local spec's torch norm refuses (torch_norm.py:26);
# tests/test_semantics.py loads ``1 + gamma`` into the plain norm instead.
COPIED_CONFIG_FIELDS = (
    "softmax_scale", "window_size", "window_attn_skip_freq", "no_rope_freq", "rotary_interleaved", "softmax_type",
    "glu_linear_offset", "activation_func_clamp_value", "moe_ffn_hidden_size",
    "moe_layer_freq", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_grouped_gemm", "mrope_section", "qk_l2_norm", "moe_apply_probs_on_input",
)


def copied_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields = {name: getattr(args, name) for name in COPIED_CONFIG_FIELDS if hasattr(args, name)}
    if getattr(args, "num_experts", None):
        # Forward only: the load-balancing loss is a training term that changes no logit, and the
        # allgather dispatcher is the one that needs no expert-parallel collective at EP1.
        fields.update(num_moe_experts=args.num_experts, moe_token_dispatcher_type="allgather",
                      moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    return fields


def _activation(args: argparse.Namespace) -> tuple[Any, bool]:
    """megatron-LM's choice: --swiglu is gated SiLU, --squared-relu squared ReLU, --quick-geglu gated quick-GELU,
    else GELU; args that record gated_linear_unit (pgconvert's) with openai_gelu ask for the tanh GELU, which
    megatron-core computes when activation_func is set to it (as Megatron-Bridge's providers set it; Megatron-LM's
    parser cannot)."""
    if args.swiglu:
        return F.silu, True
    if getattr(args, "squared_relu", False):
        from megatron.core.activations import squared_relu

        return squared_relu, False
    if getattr(args, "quick_geglu", False):
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu, True
    if getattr(args, "openai_gelu", False) and hasattr(args, "gated_linear_unit"):
        return functools.partial(F.gelu, approximate="tanh"), bool(args.gated_linear_unit)
    return F.gelu, False


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """What megatron-LM's ``core_transformer_config_from_args`` (0.16.1) makes of these args.

    The dense-GPT fields, plus ``COPIED_CONFIG_FIELDS`` where the args hold them; anything else
    keeps megatron-core's default. For a CPU fp32 run the fused kernels (CUDA/apex only) are off and
    dropout is 0 so forward is deterministic.
    """
    if getattr(args, "transformer_impl", "local") != "local":
        raise ValueError(
            f"args.transformer_impl={args.transformer_impl!r}: only the local spec builds without Transformer Engine"
        )
    epsilon = getattr(args, "layernorm_epsilon", None) or getattr(args, "norm_epsilon", None) or 1e-5
    activation_func, gated = _activation(args)
    config = TransformerConfig(
        **copied_config_fields(args),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        # megatron-LM: num_query_groups only with --group-query-attention, else None (= MHA).
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size,
        gated_linear_unit=gated,
        activation_func=activation_func,
        normalization=args.normalization,
        layernorm_epsilon=epsilon,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=args.params_dtype,
        # megatron-LM sets pipeline_dtype = params_dtype; megatron-core requires it when pp > 1.
        pipeline_dtype=args.params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # megatron-LM's --decoder-first/last-pipeline-num-layers become these two fields.
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    _set_yarn_attributes(config, args)
    return config


# megatron-LM's _apply_yarn_config_from_args (argument_utils.py:384): GPTModel's 'yarn' branch reads
# these as dynamic config attributes with no default, mapped from the args of these names.
YARN_ATTRIBUTES = {
    "yarn_rotary_scaling_factor": ("rotary_scaling_factor", 1.0),
    "yarn_original_max_position_embeddings": ("yarn_original_max_position_embeddings", 4096),
    "yarn_beta_fast": ("yarn_beta_fast", 32.0),
    "yarn_beta_slow": ("yarn_beta_slow", 1.0),
    "yarn_mscale": ("mscale", 1.0),
    "yarn_mscale_all_dim": ("mscale_all_dim", 0.0),
    "yarn_correction_range_round_to_int": ("yarn_correction_range_round_to_int", True),
}


def _set_yarn_attributes(config: TransformerConfig, args: argparse.Namespace) -> None:
    if getattr(args, "position_embedding_type", None) != "yarn":
        return
    for attribute, (arg_name, default) in YARN_ATTRIBUTES.items():
        value = getattr(args, arg_name, None)
        setattr(config, attribute, default if value is None else value)


def build_gpt_model(args: argparse.Namespace, layout: RankLayout) -> GPTModel:
    """megatron-core's GPTModel for one rank, built from ``args`` the way megatron-LM's ``gpt_builder``
    builds it: local layer spec, ``padded_vocab_size`` rows, the stage's pre/post process and layers."""
    config = transformer_config_from_args(args)
    groups = fake_pg_collection(layout.tp, layout.pp, layout.tp_rank, layout.pp_rank)
    if config.num_moe_experts:
        # megatron-LM's gpt_builder: with --num-experts, megatron-core's decoder block spec (dense
        # and MoE layers by moe_layer_freq; shared experts, their gate and the router from config).
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          qk_l2_norm=config.qk_l2_norm, vp_stage=None, pp_rank=layout.pp_rank)
        spec = _l2_norms_on_rope_layers(spec, config, layout.pp_rank)
        if layout.tp * layout.ep > 1:  # a model for its state dicts: megatron-core's MoE forward on CPU is TP1/EP1
            groups = expert_pg_collection(layout.tp, layout.pp, layout.ep, layout.tp_rank, layout.pp_rank,
                                          layout.ep_rank)
        else:
            add_expert_groups(groups, args)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    if getattr(args, "qk_layernorm_across_heads", False):
        spec = _with_whole_projection_qk_norms(spec, layout.tp)
    # cpu_forward_patches: the router's expert-bias buffers and the attention-sink offsets are
    # allocated on ``torch.cuda.current_device()`` at construction.
    with fake_group_queries(), restored_attention_backend_env(), cpu_forward_patches():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=layout.is_first_stage,
            post_process=layout.is_last_stage,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            # gpt_builder passes these three (not rotary_seq_len_interpolation_factor).
            rotary_percent=getattr(args, "rotary_percent", 1.0),
            rotary_base=args.rotary_base,
            rope_scaling=getattr(args, "use_rope_scaling", False),
            pg_collection=groups,
        )
    return model.eval()


def _l2_norms_on_rope_layers(spec: Any, config: TransformerConfig, pp_rank: int) -> Any:
    """The block ``spec`` without the q/k L2 norms of the layers ``no_rope_freq`` marks, as Megatron-Bridge's
    ``get_llama4_layer_spec`` builds Llama 4 (transformers normalizes q and k on the RoPE layers only);
    megatron-core's own specs put them in every layer."""
    if not config.qk_l2_norm or not config.no_rope_freq:
        return spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    spec = copy.copy(spec)
    # One copy per layer: megatron-core's block spec repeats one layer spec object.
    spec.layer_specs = [copy.deepcopy(layer) for layer in spec.layer_specs]
    offset = get_transformer_layer_offset(config, vp_stage=None, pp_rank=pp_rank)
    for index, layer in enumerate(spec.layer_specs):
        if config.no_rope_freq[offset + index]:
            attention = layer.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = IdentityOp
    return spec


# pgconvert's qk_layernorm_across_heads (OLMo 2, OLMoE, MiniMax-M2: q and k RMS-normed over the whole
# projection, a weight of heads × head_dim) has no megatron-core module: SelfAttention builds its q/k
# norms per head (transformer/attention.py:1281, hidden_size=hidden_size_per_attention_head). At TP1
# the stand-in below is such a norm (Megatron-Bridge's custom layers also all-reduce the sum of
# squares over TP); megatron-core applies it where it applies its own, to query [sq, b, np, hn] and
# key [sq, b, ng, hn] before RoPE (attention.py:1477).


class _WholeProjectionRMSNorm(torch.nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2)
        normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).view_as(x)


class _WholeQueryNorm(_WholeProjectionRMSNorm):
    def __init__(self, hidden_size: int, config: TransformerConfig, eps: float) -> None:
        super().__init__(config.num_attention_heads * hidden_size, eps)


class _WholeKeyNorm(_WholeProjectionRMSNorm):
    def __init__(self, hidden_size: int, config: TransformerConfig, eps: float) -> None:
        super().__init__((config.num_query_groups or config.num_attention_heads) * hidden_size, eps)


def _with_whole_projection_qk_norms(spec: Any, tp: int) -> Any:
    """A copy of the layer (or decoder block) ``spec`` with the stand-in q/k norms (TP1 only)."""
    if tp != 1:
        raise ValueError(f"tp={tp}: the whole-projection q/k norm stand-in computes TP1 only")
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = _WholeQueryNorm, _WholeKeyNorm
    return spec


def expert_pg_collection(tp: int, pp: int, ep: int, tp_rank: int, pp_rank: int,
                         ep_rank: int) -> ProcessGroupCollection:
    """Fake groups of one rank of a job of tp·pp·ep ranks (expert TP = TP): dense tensors are data-parallel
    over the expert ranks, experts are not."""
    collection = ProcessGroupCollection()
    for name, size, rank in (("tp", tp, tp_rank), ("pp", pp, pp_rank), ("cp", 1, 0), ("ep", ep, ep_rank),
                             ("expt_tp", tp, tp_rank), ("expt_dp", 1, 0), ("tp_ep", tp * ep, ep_rank * tp + tp_rank),
                             ("tp_cp", tp, tp_rank), ("tp_dp_cp", tp * ep, ep_rank * tp + tp_rank), ("dp", ep, ep_rank),
                             ("dp_cp", ep, ep_rank)):
        setattr(collection, name, McoreFakeGroup(name, size, rank))
    collection.embd = None
    return collection


def add_expert_groups(groups: ProcessGroupCollection, args: argparse.Namespace) -> None:
    """The expert-side groups a MoE layer reads, as fake groups of one (EP1, expert TP1 only)."""
    ep = getattr(args, "expert_model_parallel_size", 1)
    expert_tp = getattr(args, "expert_tensor_parallel_size", None) or 1
    if (ep, expert_tp, args.tensor_model_parallel_size) != (1, 1, 1):
        raise ValueError(f"ep={ep}, expert tp={expert_tp}: megatron-core's MoE forward on CPU needs TP1/EP1")
    for name in ("ep", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "dp", "dp_cp", "tp_ep_pp", "tp_dp_cp"):
        setattr(groups, name, McoreFakeGroup(name, 1, 0))


def global_layer_indices(model: GPTModel) -> list[int]:
    """The global layers megatron-core put on this stage (``TransformerLayer.layer_number`` is 1-based)."""
    return [layer.layer_number - 1 for layer in model.decoder.layers]


# --------------------------------------------------------------------------- checkpoints


@dataclass
class RankFile:
    """One rank file of a Megatron checkpoint and its place in the layout its args describe."""

    path: Path
    layout: RankLayout
    payload: dict[str, Any]

    @property
    def args(self) -> argparse.Namespace:
        return self.payload["args"]

    @property
    def model(self) -> dict[str, Any]:
        return self.payload["model"]


def rank_files(root: Path) -> list[RankFile]:
    """Every rank file of the checkpoint at ``root``, placed by their own args, in a job's rank order (TP rank
    fastest, then EP, then PP)."""
    from support.megatron_fixtures import rank_dir_name

    ckpt_dir = resolve_checkpoint_dir(root)
    first_dir = next(path for path in sorted(ckpt_dir.glob("mp_rank_00*")) if path.is_dir())
    args = load_rank_file(first_dir / CHECKPOINT_FILE)["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    files = []
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                path = ckpt_dir / rank_dir_name(tp_rank, pp_rank, pp, ep_rank, ep) / CHECKPOINT_FILE
                payload = load_rank_file(path)
                rank_args = payload["args"]
                layout = RankLayout(
                    tp=tp,
                    pp=pp,
                    tp_rank=tp_rank,
                    pp_rank=pp_rank,
                    first_stage_layers=rank_args.decoder_first_pipeline_num_layers,
                    last_stage_layers=rank_args.decoder_last_pipeline_num_layers,
                    ep=ep,
                    ep_rank=ep_rank,
                )
                files.append(RankFile(path, layout, payload))
    return files


def load_rank_into_gpt_model(rank: RankFile) -> GPTModel:
    """Build the rank's GPTModel from the rank's args and load its ``model`` dict, strict=True."""
    model = build_gpt_model(rank.args, rank.layout)
    # load_state_dict copies the dict first, so megatron-core's pre-hooks (which setdefault the
    # linear layers' ``_extra_state``) never touch ``rank.model``.
    model.load_state_dict(norms_as_computed(rank.args, rank.model), strict=True)
    return model


def norms_as_computed(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as megatron-core's local spec computes it: that spec cannot run zero-centred gamma (its torch norm
    asserts, torch_norm.py:26), so a model with ``layernorm_zero_centered_gamma`` loads ``1 + gamma`` into the plain
    norms, which is what megatron-core's fused norms compute (``weight + 1``)."""
    if not getattr(args, "layernorm_zero_centered_gamma", False):
        return state
    return {key: value + 1 if key.endswith("layernorm.weight") else value for key, value in state.items()}


# --------------------------------------------------------------------------- forward
#
# With the fusion flags off (see ``transformer_config_from_args``) megatron-core's local-spec forward
# is plain torch except for three process-wide things a training job sets up and a CPU test does
# not. Each is swapped only for the duration of a forward and restored:
#
# 1. ``torch.cuda.current_device``: ``RotaryEmbedding.get_emb`` moves ``inv_freq`` "to GPU once at the
#    first micro-batch" (``self.inv_freq.to(device=torch.cuda.current_device())``) whenever it is on
#    the CPU, and ``GlobalMemoryBuffer.get_tensor`` allocates on that device; on a CPU build of torch
#    both raise "Torch not compiled with CUDA enabled". No flag avoids either; answering the CPU
#    device keeps every tensor where it is.
# 2. ``parallel_state.get_global_memory_buffer``: ``DotProductAttention.forward`` takes its score
#    buffer from ``_GLOBAL_MEMORY_BUFFER``, which only ``initialize_model_parallel`` creates ("global
#    memory buffer is not initialized"). Instead of writing that parallel_state global, the accessor
#    hands out a private ``GlobalMemoryBuffer`` (``baddbmm`` with ``beta=0`` ignores its contents).
# 3. ``tensor_parallel.get_cuda_rng_tracker``: ``DotProductAttention.forward`` runs attention dropout
#    inside ``get_cuda_rng_tracker().fork()``, which raises "cuda rng state model-parallel-rng is not
#    added" until ``model_parallel_cuda_manual_seed`` (CUDA) has run. Dropout is 0 here, so a tracker
#    whose ``fork()`` does nothing changes no value (megatron-core's own inference tracker does the same).
#
# 4. ``fused_softmax.get_sliding_window_causal_mask``: a windowed layer's softmax builds its mask there
#    with a hard-coded ``device="cuda"`` (megatron/core/transformer/utils.py:38) and ignores the mask
#    it is given; the stand-in builds the same [sq, skv] mask (True = may not attend) on the CPU.
# 5. ``moe_utils.te_general_gemm``: the router's gating linear tests ``te_general_gemm is not None``,
#    a name only bound when Transformer Engine imports; without it the name is bound to None (and
#    unbound again afterwards), which selects megatron-core's own ``torch.mm`` path.
#
# A sixth CUDA dependency needs no patch: with ``attention_mask=None`` the causal softmax builds its
# mask in ``get_default_causal_mask`` with a hard-coded ``device="cuda"``, so the forward passes the
# mask megatron-LM's ``get_ltor_masks_and_position_ids`` builds, as training does.


class _NoRngTracker:
    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """True where query i may not see key j: outside ``[i - left, i + right]`` (keys end-aligned)."""
    query = torch.arange(sq)[:, None] + (skv - sq)
    key = torch.arange(skv)[None, :]
    return (key < query - window_size[0]) | (key > query + window_size[1])


_UNBOUND = object()


@contextmanager
def cpu_forward_patches() -> Iterator[None]:
    """While active, megatron-core's local-spec GPTModel forward runs on a CPU-only torch."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.moe_utils as moe_utils

    private_buffer = GlobalMemoryBuffer()
    swaps: list[tuple[object, str, object]] = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (parallel_state, "get_global_memory_buffer", lambda: private_buffer),
        (mcore_tensor_parallel, "get_cuda_rng_tracker", lambda *args, **kwargs: _NoRngTracker()),
        (fused_softmax, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask),
    ]
    if not hasattr(moe_utils, "te_general_gemm"):
        swaps.append((moe_utils, "te_general_gemm", None))
    originals = [(owner, name, getattr(owner, name, _UNBOUND)) for owner, name, _ in swaps]
    try:
        for owner, name, replacement in swaps:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in reversed(originals):
            if original is _UNBOUND:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def causal_attention_mask(seq: int) -> torch.Tensor:
    """``[1, 1, seq, seq]``, True where a query may not attend (megatron-LM's convention)."""
    return ~torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]


def megatron_core_logits(root: Path, m: TinyModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[batch, seq, m.vocab_size]`` of megatron-core's GPTModel on the checkpoint at ``root``.

    The checkpoint must be TP1 (TP>1 forward needs real collectives). PP>1 runs stage by stage, each
    stage's output handed to the next through ``set_input_tensor`` as megatron's pipeline schedule does.
    Padding rows of the vocab are cut off, so the result compares with any client's logits.
    """
    return padded_megatron_core_logits(rank_files(root), tokens)[..., : m.vocab_size]


def megatron_core_logits_from_args(root: Path, tokens: torch.Tensor) -> torch.Tensor:
    """``megatron_core_logits`` for a checkpoint written from HF: the true vocab is ``args.vocab_size``."""
    ranks = rank_files(root)
    return padded_megatron_core_logits(ranks, tokens)[..., : ranks[0].args.vocab_size]


def padded_megatron_core_logits(ranks: list[RankFile], tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's forward over a TP1 checkpoint's rank files, stage by stage: ``[batch, seq, padded vocab]``."""
    if ranks[0].layout.tp != 1:
        raise ValueError(f"{ranks[0].path}: tp={ranks[0].layout.tp}; megatron-core forward on CPU needs tp=1")
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    hidden: torch.Tensor | None = None
    with torch.no_grad(), fake_group_queries(), cpu_forward_patches():
        for rank in ranks:
            model = load_rank_into_gpt_model(rank)
            if not rank.layout.is_first_stage:
                model.set_input_tensor(hidden)
            hidden = model(input_ids=tokens, position_ids=positions, attention_mask=causal_attention_mask(seq))
    assert hidden is not None
    return hidden


# --------------------------------------------------------------------------- reference


def forward_test_model(m: TinyModel, seed: int = 0) -> dict[str, torch.Tensor]:
    """``make_full_model`` weights re-centred and scaled so a forward pass is well conditioned.

    ``make_full_model`` adds a distinct offset per tensor (so a misplaced slice changes values); over
    a whole forward those offsets dominate every activation and the logits hardly depend on the
    tokens. For logits tests each tensor keeps its random part: matrices scaled by 1/sqrt(fan-in),
    norm weights around 1, biases small, embeddings unit-variance.
    """
    tensors = {}
    for name, tensor in make_full_model(m, seed).items():
        centred = tensor.float() - tensor.float().mean()
        if name.endswith("layernorm.weight"):
            value = 1.0 + 0.1 * centred
        elif name.endswith(".bias"):
            value = 0.1 * centred
        elif "embeddings" in name:
            value = centred
        else:
            value = centred / math.sqrt(tensor.shape[-1])
        tensors[name] = value.to(m.dtype)
    return tensors


def reference_logits(m: TinyModel, full: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Plain-torch forward of the full model, written from the architecture, not from megatron-core.

    Pre-norm decoder; fused QKV rows grouped per query group as ``[q heads of group, k, v]``; q/k
    norms over the head dim, then non-interleaved rotary (rotate-half); causal softmax scaled by
    1/sqrt(head dim); MLP ``act(gate) * up`` over ``[gate; up]`` rows when gated; logits over the
    true vocab.
    """
    full = {name: tensor.to(torch.float32) for name, tensor in full.items()}
    batch, seq = tokens.shape
    H, nq, ng, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    per_group = nq // ng
    eps = 1e-5

    def norm(x: torch.Tensor, prefix: str, width: int) -> torch.Tensor:
        weight = full[prefix + ".weight"]
        if m.normalization == "RMSNorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        return F.layer_norm(x, (width,), weight, full[prefix + ".bias"], eps)

    def linear(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, full[prefix + ".weight"], full.get(prefix + ".bias"))

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [batch, seq, heads, d]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)[None, :, None, :]
        first, second = x[..., : d // 2], x[..., d // 2 :]
        return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()

    x = full["embedding.word_embeddings.weight"][tokens]
    if m.position_embedding_type == "learned_absolute":
        x = x + full["embedding.position_embeddings.weight"][:seq][None]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for layer in range(m.num_layers):
        p = f"decoder.layers.{layer}."
        h = norm(x, p + "input_layernorm", H)
        qkv = linear(h, p + "self_attention.linear_qkv").view(batch, seq, ng, (per_group + 2) * d)
        q = qkv[..., : per_group * d].reshape(batch, seq, nq, d)
        k = qkv[..., per_group * d : (per_group + 1) * d]
        v = qkv[..., (per_group + 1) * d :]
        if m.qk_layernorm:
            q = norm(q, p + "self_attention.q_layernorm", d)
            k = norm(k, p + "self_attention.k_layernorm", d)
        if m.position_embedding_type == "rope":
            q, k = rotate(q), rotate(k)
        # query head j belongs to group j // per_group
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~causal, float("-inf"))
        context = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(batch, seq, nq * d)
        x = x + linear(context, p + "self_attention.linear_proj")
        h = linear(norm(x, p + "pre_mlp_layernorm", H), p + "mlp.linear_fc1")
        if m.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        x = x + linear(h, p + "mlp.linear_fc2")
    x = norm(x, "decoder.final_layernorm", H)
    output = full["embedding.word_embeddings.weight" if m.tied_embeddings else "output_layer.weight"]
    return F.linear(x, output)
