"""Run as a script: megatron-core's ``_get_param_groups`` over the model chunks of a virtual-pipeline
rank, printed as JSON ``[[[chunk, name], ...] per group]``.

argv: a VPP rank file (``model0``, ``model1``, … ; its ``args`` describe the model). Each chunk is
megatron-core's own GPTModel (local spec) for its share of the layers, built as the stage that holds
them (``mcore_helpers.build_gpt_model``: first chunk with the embedding, last with the output layer).
``_get_param_groups`` all-gathers its group keys, so a one-process gloo group is started here, in this
separate process only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def main(rank_file: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.mcore_helpers import RankLayout, build_gpt_model
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from support.megatron_fixtures import load_for_test

    state = load_for_test(rank_file)
    chunks = sorted(key for key in state if key.startswith("model") and key[5:].isdigit())
    args = argparse.Namespace(**vars(state["args"]))
    args.pipeline_model_parallel_size = len(chunks)  # chunk i is built as stage i of an even split
    models = [build_gpt_model(args, RankLayout(args.tensor_model_parallel_size, len(chunks), 0, index))
              for index in range(len(chunks))]
    where = {id(param): [index, name] for index, model in enumerate(models) for name, param in model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            groups = _get_param_groups(models, OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                                                               weight_decay=args.weight_decay), None)
        finally:
            torch.distributed.destroy_process_group()
    print(json.dumps([[where[id(param)] for param in group["params"]] for group in groups]))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main(Path(sys.argv[1]))
