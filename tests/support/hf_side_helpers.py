"""Test-only helpers: tiny real HF checkpoints as releases ship them, side files included.

Each is written by transformers' own ``save_pretrained``: the model (configured as the release
is: RoPE scaling, sliding window, tied embeddings, dense layers among MoE ones), a real word-level
tokenizer built with the ``tokenizers`` library and saved through ``PreTrainedTokenizerFast``, a
chat template (``chat_template.jinja``) and a ``GenerationConfig`` with bos/eos/pad ids. Nothing
here imports pgconvert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 256
SPECIAL = ("<s>", "</s>", "<pad>", "<unk>")
BOS, EOS, PAD = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_COMMON: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
    max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
)
# A window shorter than the test sequences, so a lost window changes the logits.
WINDOW = 5
SEQ = 12

# name -> (config class, model class, config kwargs): each configured as the release it is named after.
RELEASES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama3.1": (LlamaConfig, LlamaForCausalLM, dict(
        _COMMON, intermediate_size=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    )),
    "llama3.2": (LlamaConfig, LlamaForCausalLM, dict(
        _COMMON, intermediate_size=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    )),
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        _COMMON, intermediate_size=128, sliding_window=WINDOW, tie_word_embeddings=False,
    )),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        _COMMON, intermediate_size=128, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1,
    )),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        _COMMON, intermediate_size=128, head_dim=16, tie_word_embeddings=False,
    )),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        _COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )),
    # Layer 1 dense (mlp_only_layers), layer 0 MoE.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        _COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=True, head_dim=16, tie_word_embeddings=False,
    )),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A real word-level tokenizer of VOCAB tokens (specials first), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIAL)}
    vocab.update({f"w{index}": index for index in range(len(SPECIAL), VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>", model_max_length=256)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """Release ``name`` in miniature: every parameter seeded, norms near one, routers well separated."""
    config_class, model_class, kwargs = RELEASES[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in param_name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
                param.copy_(1.0 + 0.1 * noise)
            elif param_name.endswith(".gate.weight"):
                param.copy_(noise)
            else:
                param.copy_(0.05 * noise)
    return model.to(dtype)


def save_release(name: str, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A complete tiny HF checkpoint of release ``name`` at ``path``, as save_pretrained writes it."""
    model = build_model(name, dtype)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, PAD], pad_token_id=PAD,
                                               do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=32)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def input_ids(batch: int = 2, seq: int = SEQ, seed: int = 7) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ids[0, -1] = VOCAB - 1
    return ids


def logits(path: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, str]:
    """transformers' logits of the checkpoint at ``path`` and the class it loads as."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    with torch.no_grad():
        return model(ids).logits, type(model).__name__
