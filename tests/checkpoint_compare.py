"""Test-only comparison of two Megatron per-rank checkpoints, file by file and tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron_fixtures import read_megatron_checkpoint


def assert_same_megatron_checkpoint(actual: Path, expected: Path) -> None:
    """Same rank files, same keys in each, every tensor ``torch.equal`` (and same dtype)."""
    actual_args, actual_ranks = read_megatron_checkpoint(actual)
    expected_args, expected_ranks = read_megatron_checkpoint(expected)
    assert sorted(actual_ranks) == sorted(expected_ranks)
    for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size",
                  "num_layers", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        assert getattr(actual_args, field) == getattr(expected_args, field), field
    for coord, expected_model in expected_ranks.items():
        actual_model = actual_ranks[coord]
        # Key order is not part of the format (load_state_dict matches by name).
        assert sorted(actual_model) == sorted(expected_model), f"rank {coord}: key set differs"
        for key, expected_value in expected_model.items():
            actual_value = actual_model[key]
            if expected_value is None:
                assert actual_value is None, f"rank {coord} {key}"
                continue
            assert actual_value.dtype == expected_value.dtype, f"rank {coord} {key}"
            assert torch.equal(actual_value, expected_value), f"rank {coord} {key} differs"
