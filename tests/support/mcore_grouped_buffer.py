"""Run as a script: where megatron-core's own ``_ParamAndGradBuffer`` puts parameters given in an order.

argv: IN OUT. IN: a JSON object of lists of ``[name, shape]``, each in ``named_parameters()`` order (the test writes
TEGroupedMLP's from Transformer Engine's source, since TE cannot be installed here); OUT: per list, ``numel`` (the
buffer's unpadded size) and ``ranges`` (name -> [start, end)). megatron-core 0.16.1 builds one fp32 buffer with the
distributed optimizer's padding and one bucket (no ``overlap_grad_reduce``), in a one-process gloo world, as
``mcore_moe_optimizer._buffer_ranges`` does for a model.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def main(src: Path, dst: Path) -> None:
    warnings.simplefilter("ignore")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.process_groups_config import ProcessGroupCollection

    lists = json.loads(src.read_text())
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            group = torch.distributed.new_group([0], backend="gloo")
            collection = ProcessGroupCollection()
            collection.tp, collection.dp_cp = group, group
            out = {}
            for label, listed in lists.items():
                params = [torch.nn.Parameter(torch.zeros(shape)) for _, shape in listed]
                names = {param: name for param, (name, _) in zip(params, listed)}
                buffer = _ParamAndGradBuffer(DistributedDataParallelConfig(use_distributed_optimizer=True),
                                             torch.float32, torch.float32, params, group, None, names, 1.0,
                                             list(range(len(params))), False, collection)
                assert len(buffer.buckets) == 1
                out[label] = {"numel": buffer.numel_unpadded,
                              "ranges": {names[param]: list(buffer.param_index_map[param][:2]) for param in params}}
            dst.write_text(json.dumps(out))
        finally:
            torch.distributed.destroy_process_group()

if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
