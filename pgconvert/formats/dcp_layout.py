"""How megatron-core lays out a DCP checkpoint directory (torch_dist and fsdp_dtensor): its file names and
key suffixes, importable without torch.distributed, so that detecting a format costs no DCP import."""

from __future__ import annotations

# megatron-core's dist_checkpointing writes this beside .metadata in every iteration directory.
CHECKPOINT_CONFIG_FILE = "metadata.json"
# torch.distributed.checkpoint's Metadata (a pickle) of the store.
DCP_METADATA_FILE = ".metadata"
# megatron-core's ``apply_swiglu_sharded_factory`` with ``singleton_local_shards``: a gated linear_fc1's gate and up
# halves as keys of their own, the key followed by these.
GATED_HALVES = ("_w", "_v")
