"""Stage layer ranges agree with megatron-core's own offset and layer-count functions.

Uneven first/last stages combined with a virtual pipeline are where hand-written expectations
drift from megatron-core; these cases ask megatron-core (``get_transformer_layer_offset`` and
``get_num_layers_to_build``, 0.16.1) for every (pp rank, virtual stage) instead.
"""

from __future__ import annotations

import pytest
import torch

from pgconvert.model.layout import ParallelLayout

pytest.importorskip("megatron.core")

# (num_layers, pp, vpp, first stage layers, last stage layers)
CASES = [
    (10, 3, 2, 2, 4),
    (14, 3, 2, 2, None),
    (12, 3, 2, None, 4),
    (16, 4, 2, 2, 2),
    (18, 4, 3, 3, 3),
    (8, 4, 2, None, None),
    (9, 3, None, 1, 2),
    (7, 3, None, None, 3),
]


def _megatron_core_config(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> object:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32, use_cpu_initialization=True,
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("num_layers", "pp", "vpp", "first", "last"), CASES)
def test_chunk_layers_match_megatron_core_offsets_with_uneven_stages_and_vpp(
        num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> None:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = _megatron_core_config(num_layers, pp, vpp, first, last)
    layout = ParallelLayout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    for pp_rank in range(pp):
        for chunk in range(vpp or 1):
            vp_stage = chunk if vpp is not None else None
            expected_start = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            expected_count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            layers = layout.chunk_layers(num_layers, pp_rank, chunk)
            assert (layers.start, len(layers)) == (expected_start, expected_count), (pp_rank, chunk)
