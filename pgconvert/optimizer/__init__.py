"""Optimizer state: megatron-core's parameter order, flat buffers and data-parallel shards, the reshard plan, the grad scaler."""
