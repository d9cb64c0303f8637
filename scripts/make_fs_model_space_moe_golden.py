"""Make the MoE ``fully_sharded_model_space`` golden with megatron-core 0.15.0's own classes (local script, not CI).

    /venv/with/megatron-core-0.15.0/bin/python scripts/make_fs_model_space_moe_golden.py [check | load DIR DP EP]

The dense golden's companion (``scripts/make_fs_model_space_golden.py``, whose venv, shims and save path this
reuses). Four forked gloo processes, TP1 x EP2 x DP4 on the CPU (``tests/support/mcore_cpu_shim``): the dense
distributed optimizer is sharded over 4 data-parallel ranks, the expert one over an expert data-parallel size
of 2, and megatron-core chains the two. Each rank builds megatron-core 0.15.0's GPTModel (local spec, bf16 under
``Float16Module``) for ``MODEL``: layer 0 dense, layer 1 MoE with four SequentialMLP experts, a gated shared
expert and a sigmoid router with its expert bias, SwiGLU everywhere. ``get_megatron_optimizer`` builds the
chained distributed optimizers; they take two steps on gradients that are a fixed function of each
parameter's canonical name (so every replica of a parameter gets the same). Then the ranks save as Megatron-LM
core_v0.15.0's ``save_checkpoint`` does with ``--dist-ckpt-save-pre-mcore-014`` (the dense script's ``_save``:
content metadata ``distrib_optim_sharding_type='fully_sharded_model_space'`` and ``chained_optim_avoid_prefix``,
so the dense and expert records share the unprefixed ``optimizer.state.<field>.<model key>`` names and the
common state holds ``{0: dense, 1: expert}``). Fresh ranks reload the save and must hold what the first ranks
held, bit for bit; pgconvert's ``export-optimizer`` of the save must equal every rank's slices.

``check``: the reload and pgconvert comparisons against the committed golden (the state is rebuilt by the same
two steps, which are deterministic).

``save DIR [plain]``: the same run saved into DIR (not the golden) with the content metadata of the installed
megatron-core's Megatron-LM release (``_release_metadata``), reloaded and read by pgconvert as above: with
megatron-core 0.13.1 the chained optimizers' records carry the ``chained_<i>.`` prefix. ``plain``: the run with
megatron-core's plain (non-distributed) optimizer, whose torch_dist records are named alike.

``load DIR DP EP``: megatron-core 0.15.0 loads the fully_sharded_model_space checkpoint DIR (pgconvert's output
at TP1, EP ``EP``) on ``DP`` ranks, and what each rank's optimizer then holds must equal pgconvert's export of
the golden.

The common state is the dense golden's (Megatron-LM d98e8a64's scheduler, rerun state and counters, iteration
2), with ``args`` for this model and layout: the dense golden's run arguments, the model's from
``tests/support/megatron_fixtures.make_args``. Versions as the dense golden's (megatron-core 0.15.0, psutil
7.2.2, Python 3.11.7, torch 2.13.0+cpu, numpy 2.4.6).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "data" / "megatron_lm" / "mcore015_tp1ep2dp4_moe_distopt_fs_model_space_torch_dist"
ITERATION = "iter_0000002"
TP, EP, DP = 1, 2, 4
STEPS = 2


def _tiny_model() -> Any:
    from support.megatron_fixtures import TinyModel

    return TinyModel(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=4,
                     ffn_hidden_size=32, vocab_size=60, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                     add_qkv_bias=False, qk_layernorm=False, tied_embeddings=False, position_embedding_type="rope",
                     make_vocab_size_divisible_by=16, dtype=torch.bfloat16, num_experts=4, moe_ffn_hidden_size=8,
                     moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
                     moe_router_enable_expert_bias=True)


def _common_state(dp: int = DP, ep: int = EP, distributed: bool = True) -> dict[str, Any]:
    """The dense golden's common state with this model's and layout's ``args`` (``distributed``: the distributed
    optimizer, else megatron-core's plain one)."""
    import make_fs_model_space_golden as dense
    from support.megatron_fixtures import make_args

    common = dense._common_state()
    args = argparse.Namespace(**vars(common["args"]))
    model_args = vars(make_args(_tiny_model(), TP, 1, None, None, 2, ep=ep))
    vars(args).update({key: value for key, value in model_args.items() if key != "iteration"})
    args.data_parallel_size, args.world_size = dp, TP * dp
    args.use_distributed_optimizer = distributed
    args.expert_tensor_parallel_size = TP
    args.moe_token_dispatcher_type, args.moe_router_topk = "allgather", 2
    args.moe_router_load_balancing_type, args.moe_aux_loss_coeff = "none", 0.0
    common["args"] = dense._known_args(args)
    return common


def _model(args: argparse.Namespace) -> Any:
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module
    from support.mcore_helpers import transformer_config_from_args

    config = dataclasses.replace(transformer_config_from_args(args), bf16=True, params_dtype=torch.bfloat16,
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 expert_tensor_parallel_size=TP, perform_initialization=True)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, share_embeddings_and_output_weights=False,
                     position_embedding_type=args.position_embedding_type)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               overlap_param_gather=False,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    return DistributedDataParallel(config, ddp_config, Float16Module(config, model))


def _names(model: Any, args: argparse.Namespace) -> dict[int, str]:
    """id(param) -> pgconvert's canonical name: a local expert under its global index."""
    from megatron.core import parallel_state

    local = args.num_experts // args.expert_model_parallel_size
    first = parallel_state.get_expert_model_parallel_rank() * local
    names = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if "local_experts" in parts:
            at = parts.index("local_experts") + 1
            parts[at] = str(first + int(parts[at]))
        names[id(param)] = ".".join(parts)
    return names


def _train(model: Any, optimizer: Any, names: dict[int, str], common: dict[str, Any]) -> None:
    """``STEPS`` steps on gradients that depend only on the parameter's name and the step, each followed by the
    learning-rate and weight-decay schedule's step, as Megatron-LM's ``train_step`` takes them (the schedule of the
    dense golden's run: its ``opt_param_scheduler``, in samples)."""
    import zlib

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    kept = common["opt_param_scheduler"]
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=kept["max_lr"], min_lr=kept["min_lr"], lr_warmup_steps=kept["lr_warmup_steps"],
        lr_decay_steps=kept["lr_decay_steps"], lr_decay_style=kept["lr_decay_style"], start_wd=kept["start_wd"],
        end_wd=kept["end_wd"], wd_incr_steps=kept["wd_incr_steps"], wd_incr_style=kept["wd_incr_style"])
    for step in range(STEPS):
        for param in model.parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(names[id(param)].encode()) + step)
            param.main_grad.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        updated, _, _ = optimizer.step()
        assert updated, "the optimizer skipped a step"
        scheduler.step(increment=common["args"].global_batch_size)
    assert scheduler.state_dict() == kept, (scheduler.state_dict(), kept)


def _rank(rank: int, world: int, store: str, common: dict[str, Any], work: Path, mode: str,
          directory: Path | None = None) -> None:
    import make_fs_model_space_golden as dense
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from support.mcore_optimizer_step import _gpt, optimizer_tensors

    dense.start_rank(rank, world, store)
    args = common["args"]
    parallel_state.initialize_model_parallel(TP, 1, expert_model_parallel_size=args.expert_model_parallel_size,
                                             expert_tensor_parallel_size=TP)
    torch.manual_seed(1234)  # the same initial weights on every rank and in every run
    ddp = _model(args)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, bf16=True,
        params_dtype=torch.bfloat16, use_distributed_optimizer=args.use_distributed_optimizer, clip_grad=0.0), [ddp])
    model = _gpt(ddp)
    names = _names(model, args)
    if mode == "save":
        _train(model, optimizer, names, common)
        out = f"reference{rank}.pt"
        dense._save(model, optimizer, common, work / "target" / ITERATION,
                    _release_metadata(args.use_distributed_optimizer))
    else:  # as Megatron-LM's load_checkpoint: the sharded state dicts built with the checkpoint's content metadata
        from megatron.core import dist_checkpointing
        from support.megatron_fixtures import allowed_globals

        iteration_dir = directory or work / "target" / ITERATION
        with torch.serialization.safe_globals(allowed_globals()):
            metadata = dist_checkpointing.load_content_metadata(str(iteration_dir))
        dense._load(model, optimizer, iteration_dir, dict(metadata))
        out = f"reloaded{rank}.pt" if mode == "reload" else f"reference{rank}.pt"
    torch.save({"tp_rank": 0, "state": optimizer_tensors(optimizer, names),
                "weights": {names[id(p)]: p.detach().clone() for p in model.parameters()}}, work / out)
    torch.distributed.destroy_process_group()


def _release_metadata(distributed: bool) -> dict[str, Any]:
    """The content metadata the installed megatron-core's Megatron-LM release saves this form with
    (``_build_sharded_state_dict_metadata``): core_v0.13.1 names the sharding type alone, so a chained optimizer's
    records are prefixed ``chained_<i>.``; core_v0.14.0 and core_v0.15.0 (``--dist-ckpt-save-pre-mcore-014``) add
    ``chained_optim_avoid_prefix`` and ``singleton_local_shards``."""
    import make_fs_model_space_golden as dense
    from megatron.core import __version__ as version

    old = tuple(int(part) for part in version.split(".")[:2]) < (0, 14)
    if not distributed:  # the plain optimizer: no sharding type
        return {} if old else {key: value for key, value in dense.METADATA.items()
                               if key != "distrib_optim_sharding_type"}
    return {"distrib_optim_sharding_type": "fully_sharded_model_space"} if old else dict(dense.METADATA)


def _load_other(directory: Path, dp: int, ep: int) -> None:
    """``load DIR DP EP``: megatron-core 0.15.0 loads DIR; its state is compared with the golden's export."""
    import make_fs_model_space_golden as dense
    from support.gloo_ranks import run_ranks

    iteration_dir = next(iter(sorted(directory.glob("iter_*"))))
    common = _common_state(dp, ep)
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_rank, TP * dp, common, Path(tmp), "load", iteration_dir, where=f"load {directory}")
        dense.TARGET = TARGET
        dense._compare_pgconvert(Path(tmp), TP * dp, common["args"])


def main(argv: list[str]) -> None:
    import make_fs_model_space_golden as dense
    from support.gloo_ranks import run_ranks

    if argv[:1] == ["load"]:
        _load_other(Path(argv[1]), int(argv[2]), int(argv[3]))
        return
    common = _common_state(distributed="plain" not in argv)
    target = Path(argv[1]) if argv[:1] == ["save"] else TARGET
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "target" / ITERATION).mkdir(parents=True)
        run_ranks(_rank, TP * DP, common, work, "save", where="save")
        dense.place_save(work, target, TARGET, "check" in argv)
        run_ranks(_rank, TP * DP, common, work, "reload", where="reload")
        dense._compare_reloaded(work, TP * DP)
        dense.TARGET = target
        dense._compare_pgconvert(work, TP * DP, common["args"])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_fs_model_space_golden

    make_fs_model_space_golden.prepare_process()
    main(sys.argv[1:])
