"""Architectures megatron-core cannot compute are refused by name with the reason, before anything is written: Apertus
(its xIELU activation), Phi-MoE (its sparsemixer router) and Phi-2 (the bias of its output layer), each a tiny model as transformers' save_pretrained
writes it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.family_helpers import save_with_side_files
from support.hf_side_helpers import BOS, EOS, PAD

import pgconvert
from pgconvert.errors import CheckpointError

_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
              vocab_size=300, max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def _save(name: str, path: Path) -> Path:
    import transformers as t

    classes = {"apertus": (t.ApertusConfig, t.ApertusForCausalLM, {}),
               "phimoe": (t.PhimoeConfig, t.PhimoeForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
               # microsoft/phi-2's shape: partial rotary 0.4, the tanh GELU, one norm before attention and MLP.
               "phi": (t.PhiConfig, t.PhiForCausalLM, dict(partial_rotary_factor=0.4, hidden_act="gelu_new"))}
    config_class, model_class, extra = classes[name]
    return save_with_side_files(model_class(config_class(**_SIZES, **extra)), path)


@pytest.mark.parametrize("name, architecture, reason", [
    ("apertus", "ApertusForCausalLM", "its MLP activation is xIELU with learned alpha_p/alpha_n per layer"),
    ("phimoe", "PhimoeForCausalLM", "its router is sparsemixer"),
    ("phi", "PhiForCausalLM", "its lm_head adds a learned bias to every logit"),
])
def test_an_architecture_megatron_core_cannot_compute_is_refused_with_the_reason(tmp_path: Path, name: str,
                                                                                architecture: str,
                                                                                reason: str) -> None:
    src = _save(name, tmp_path / "src")

    with pytest.raises(CheckpointError, match=re.escape(
            f"{src / 'config.json'}: architectures[0]='{architecture}' is not supported; {reason}")):
        pgconvert.convert(src, tmp_path / "dst", dst_format="megatron", dst_tp=2)

    assert not (tmp_path / "dst").exists()
