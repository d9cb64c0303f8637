"""Test helpers: LoRA adapters made by PEFT itself, and PEFT's own merge of them as the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def make_adapter(base_dir: Path, out: Path, seed: int = 0, **lora: Any) -> Path:
    """A PEFT LoRA adapter for the model in ``base_dir``, saved by ``PeftModel.save_pretrained``.

    PEFT starts B at zero (the adapter changes nothing), a DoRA magnitude at the row norms of the base (it scales
    nothing) and the modules_to_save as copies of the base; here A and B (an embedding's too) are drawn at random,
    each magnitude scaled by its own random factors and the copies moved, as a trained adapter's are, so every
    merged weight differs from the base.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**lora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if any(part in name for part in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.")):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif ".lora_magnitude_vector." in name:
                param.mul_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            elif ".modules_to_save." in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out)
    return out


def peft_merged(base_dir: Path, adapter_dir: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """PEFT's ``merge_and_unload`` of the adapter into the base, computed in float32 and saved in ``dtype``
    (rounded once) with ``save_pretrained``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.to(dtype).save_pretrained(out)
    return out


def assert_tensors_equal(expected_dir: Path, actual_dir: Path) -> None:
    """The two HF checkpoints hold the same tensor names, each bit-equal."""
    from support.hf_helpers import load_hf_tensors

    expected, actual = load_hf_tensors(expected_dir), load_hf_tensors(actual_dir)
    assert sorted(expected) == sorted(actual)
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not different, different


def edit_config(adapter: Path, **changes: object) -> None:
    """``changes`` made to the adapter's adapter_config.json (a None value takes its key out)."""
    path = adapter / "adapter_config.json"
    doc = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            doc.pop(key)
        else:
            doc[key] = value
    path.write_text(json.dumps(doc))
