"""Adapters trained beside a base model (LoRA), read and merged into the base as it is converted.

``peft`` reads a Hugging Face PEFT adapter directory (``adapter_config.json`` and
``adapter_model.safetensors``) into one low-rank pair per adapted HF weight; ``merge`` maps those
pairs onto the canonical tensors of a source through its family's table and adds each delta to
whatever piece of the tensor a saver reads (``CanonicalSource.load`` / ``load_shard``), so a merge
works at any destination layout and format.
"""
