"""megatron-core's GPTModel with a multi-token-prediction block, built on the CPU from a Megatron rank file's
``args`` (MLA local spec, TP1/PP1/EP1); and, run as a script with any interpreter that has megatron-core (the
0.19.2 venv of ``test_torch_dist_mcore019.py``), a job that loads a rank file into it strictly and writes the
torch_dist layout its ``sharded_state_dict`` declares as JSON.

Verified with megatron-core 0.16.1 (whose MTP layer holds ``transformer_layer``) and 0.19.2 (``mtp_model_layer``,
saved as ``transformer_layer`` in torch_dist keys by ``MultiTokenPredictionLayer.sharded_state_dict``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def mla_mtp_specs(config: Any, args: argparse.Namespace, pp_rank: int) -> tuple[Any, Any]:
    """The MLA local decoder block spec of ``config`` for stage ``pp_rank`` (causal core attention, which runs
    on the CPU) and megatron-core's MTP block spec for it: its own MTP layer spec for the last decoder layer's
    spec, ``args.mtp_num_layers`` times (what get_gpt_mtp_block_spec picks)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                                   get_mtp_layer_spec)
    from support.megatron_mla import CausalAttention

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      qk_l2_norm=False, vp_stage=None, pp_rank=pp_rank)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = CausalAttention
    mtp_spec = MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec(spec.layer_specs[-1], use_transformer_engine=False)] * args.mtp_num_layers)
    return spec, mtp_spec


@contextlib.contextmanager
def mtp_process_groups(groups: Any) -> Iterator[None]:
    """MultiTokenPredictionBlock and its TransformerLayer ask ``ProcessGroupCollection.use_mpu_process_groups`` for
    their groups (no pg_collection is passed down), and the MTP layer offset, the block's sharded_state_dict and the
    gather after eh_proj ask parallel_state for the pipeline rank and TP group: they answer with ``groups`` (a fake
    collection, stage 0 of 1) while this is entered."""
    from unittest import mock

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    import megatron.core.transformer.multi_token_prediction as mtp_module
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region as gather

    with mock.patch.object(ProcessGroupCollection, "use_mpu_process_groups", return_value=groups), \
            mock.patch.object(parallel_state, "get_pipeline_model_parallel_rank", return_value=0), \
            mock.patch.object(parallel_state, "get_pipeline_model_parallel_world_size", return_value=1), \
            mock.patch.object(parallel_state, "get_virtual_pipeline_model_parallel_world_size", return_value=None), \
            mock.patch.object(parallel_state, "get_tensor_model_parallel_group", return_value=groups.tp), \
            mock.patch.object(mtp_module, "gather_from_tensor_model_parallel_region",
                              lambda x, group=None: gather(x, group=groups.tp)):
        yield


@contextlib.contextmanager
def mtp_gpt_model(args: argparse.Namespace) -> Iterator[Any]:
    """megatron-core's GPTModel of ``args`` (MLA local spec, TP1/PP1/EP1) with its MTP block: the
    MTP layer spec is megatron-core's own for the last decoder layer's spec (what
    get_gpt_mtp_block_spec picks). Runs under ``mla_cpu_patches`` and ``mtp_process_groups`` while the model is
    in use."""
    import support.mcore_helpers as mcore
    from megatron.core.models.gpt import GPTModel
    from support.megatron_mla import mla_config, mla_cpu_patches

    config = mla_config(args)
    config.mtp_num_layers = args.mtp_num_layers
    groups = mcore.fake_pg_collection(1, 1, 0, 0)
    for name in ("ep", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "dp", "dp_cp", "tp_ep_pp", "tp_dp_cp"):
        setattr(groups, name, mcore.McoreFakeGroup(name, 1, 0))
    with mla_cpu_patches(), mtp_process_groups(groups):
        spec, mtp_spec = mla_mtp_specs(config, args, pp_rank=0)
        yield GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            pg_collection=groups, mtp_block_spec=mtp_spec).eval()


def declared_layout(rank_dir: Path) -> dict[str, Any]:
    """The one rank file under ``rank_dir`` loaded strictly into the model its args describe: the model's MTP
    parameter names, and the torch_dist keys (global shape, chunks) and objects its sharded_state_dict declares."""
    import support.mcore_helpers as mcore
    from support.mcore_gpt_models import megatron_core_layout

    (rank,) = mcore.rank_files(rank_dir)
    with torch.no_grad(), mtp_gpt_model(rank.args) as model:
        model.load_state_dict(dict(rank.model), strict=True)
        tensors, objects = megatron_core_layout(model)
        names = [name for name in model.state_dict() if name.startswith("mtp.")]
    return {"mtp_names": names, "objects": objects,
            "tensors": {key: [list(shape), [[list(o), list(s)] for o, s in chunks]]
                        for key, (shape, _, chunks) in tensors.items()}}


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    Path(sys.argv[2]).write_text(json.dumps(declared_layout(Path(sys.argv[1]))))
