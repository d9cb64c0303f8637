"""The torch_dist form a test's client reads.

pgconvert writes torch_dist in megatron-core 0.19's form by default: the common state inside the checkpoint
(the ``common_state`` entry) and an ``integrity.json`` manifest. megatron-core 0.16.1, the client CI runs, reads
the common state from ``common.pt`` only (as every release up to 0.18.x does), so an output it loads is written
with ``--dst-torch-dist-common legacy``. Tests that damage a checkpoint's files to reach a check behind the
manifest use the same form: megatron-core 0.18 and older write no manifest, and those checks are what guard them.
"""

LEGACY = "legacy"
# pgconvert.convert keyword and CLI options for the form megatron-core 0.16.1 loads.
FOR_MCORE_016: dict[str, str] = {"dst_torch_dist_common": LEGACY}
FOR_MCORE_016_CLI: tuple[str, str] = ("--dst-torch-dist-common", LEGACY)
