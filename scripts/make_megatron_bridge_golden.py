"""Make tests/data/megatron_bridge/train_tp1_torch_dist/: a checkpoint that Megatron-Bridge's own training code saves.

Megatron-Bridge 0.3.1 (PyPI ``megatron-bridge``) with megatron-core 0.16.1 and torch 2.13.0 (CPU), one process
on gloo: a tiny GPT model built by Bridge's ``GPTModelProvider.provide`` (RMSNorm, SwiGLU, RoPE, GQA, untied
embeddings, padded vocab) and saved by Bridge's ``megatron.bridge.training.checkpointing.save_checkpoint``
(torch_dist store, ``train_state.pt``, ``latest_train_state.pt``, ``latest_checkpointed_iteration.txt`` and
``run_config.yaml`` written by ``ConfigContainer.to_yaml``), model only (``save_optim=False``: megatron-core's
optimizers need a GPU here).

Run with a venv holding megatron-bridge 0.3.1 installed ``--no-deps`` beside what its config and checkpoint modules
import (megatron-core==0.16.1, torch==2.13.0, transformers<5, huggingface-hub<1, omegaconf, hydra-core, pyyaml,
einops, triton, datasets, nvidia-modelopt --no-deps with pydantic, pulp, scipy, tensorboard):

    python scripts/make_megatron_bridge_golden.py tests/data/megatron_bridge/train_tp1_torch_dist
    python scripts/make_megatron_bridge_golden.py --providers tests/data/megatron_bridge/providers

Transformer Engine cannot be installed here; Bridge's ``peft/lora.py`` and ``peft/lora_layers.py`` import
``transformer_engine.pytorch`` at module level (and name its classes in annotations), so an import-only stand-in
is put in ``sys.modules`` while Bridge's modules import, after megatron-core's have found no Transformer Engine
(they then build the local spec). Nothing of it is called: the model uses Bridge's ``local_layer_spec``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import types
from pathlib import Path

import torch

# megatron-core's modules first, so that they find no Transformer Engine and take their local paths.
_CORE_MODULES = ("megatron.core", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.extensions.transformer_engine",
                 "megatron.core.fp8_utils", "megatron.core.optimizer", "megatron.core.dist_checkpointing",
                 "megatron.core.models.gpt", "megatron.core.transformer.transformer_config",
                 "megatron.core.post_training.modelopt.layers")


class _StandInMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandInMeta(name, (_StandIn,), {})


class _StandIn(metaclass=_StandInMeta):
    """Any Transformer Engine name Bridge's modules mention at import time."""


def import_bridge() -> None:
    """Bridge's config and checkpoint modules, with Transformer Engine's import-only stand-in while they import."""
    for name in _CORE_MODULES:
        importlib.import_module(name)
    engine = types.ModuleType("transformer_engine")
    engine.__path__ = []
    engine_torch = types.ModuleType("transformer_engine.pytorch")
    engine_torch.__getattr__ = lambda name: _StandIn.__getattr__(name) if not name.startswith("__") else None
    engine.pytorch = engine_torch
    sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = engine, engine_torch
    try:
        importlib.import_module("megatron.bridge.training.checkpointing")
    finally:
        del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]


def provider() -> object:
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec

    return GPTModelProvider(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=64,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, position_embedding_type="rope", rotary_base=500000,
        seq_length=64, share_embeddings_and_output_weights=False, add_bias_linear=False, add_qkv_bias=False,
        vocab_size=100, should_pad_vocab=True, make_vocab_size_divisible_by=32, transformer_layer_spec=local_layer_spec,
        params_dtype=torch.float32, bf16=False, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, use_cpu_initialization=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    )


def config(model: object, save: Path) -> object:
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, LoggerConfig, MockGPTDatasetConfig,
                                                 OptimizerConfig, SchedulerConfig, TrainingConfig)
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    return ConfigContainer(
        train=TrainingConfig(train_iters=10, global_batch_size=1, micro_batch_size=1),
        model=model,
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=False, bf16=False, fp16=False),
        scheduler=SchedulerConfig(),
        dataset=MockGPTDatasetConfig(seq_length=64, random_seed=1234, reset_position_ids=False,
                                     reset_attention_mask=False, eod_mask_loss=False),
        logger=LoggerConfig(),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100),
        checkpoint=CheckpointConfig(save=str(save), ckpt_format="torch_dist", save_optim=False, save_rng=False,
                                    fully_parallel_save=False, async_save=False),
    )


def main(out: Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import_bridge()
    from megatron.bridge.training.checkpointing import save_checkpoint
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    # save_checkpoint collects the CUDA RNG state before it looks at save_rng (False here: nothing of it is saved).
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    torch.cuda.synchronize = lambda device=None: None  # megatron-core's save preloads tensors; nothing runs on a GPU
    # megatron-core's save finalization all-reduces a failure flag on current_device(): here the gloo (CPU) one.
    torch.cuda.current_device = lambda: "cpu"
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model_provider = provider()
    model_provider.finalize()
    model_provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = model_provider.provide()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight changes the logits
        for name, parameter in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
    shutil.rmtree(out, ignore_errors=True)
    state = GlobalState()
    state.cfg = config(model_provider, out)
    state.train_state.step = 5
    save_checkpoint(state, [model], None, None, 0)
    torch.distributed.destroy_process_group()




# Model providers whose run_config.yaml model section tests/data/megatron_bridge/providers/ holds, as
# ConfigContainer.to_yaml writes one: an activation each of Bridge's providers use, MoE, YaRN and llama3 RoPE scaling.
# DeepSeek's default instances describe no model in 0.3.1 (DeepSeekV3ModelProvider() has 0 attention heads,
# DeepSeekV2LiteModelProvider() linear biases beside shared experts).
PROVIDERS = {
    "GPTProvider126M": "megatron.bridge.models.gpt_provider",
    "Llama32ModelProvider1B": "megatron.bridge.models.llama.llama_provider",
    "Qwen3MoEModelProvider30B_A3B": "megatron.bridge.models.qwen.qwen_provider",
    "GemmaModelProvider2B": "megatron.bridge.models.gemma.gemma_provider",
    "Nemotron3ModelProvider4B": "megatron.bridge.models.nemotron.nemotron_provider",
    "GPTOSSProvider20B": "megatron.bridge.models.gpt_oss.gpt_oss_provider",
}


_GPU_FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                "persist_layer_norm", "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "moe_permute_fusion",
                "moe_router_fusion")


def write_provider_sections(out: Path) -> None:
    """Each provider's default instance as ``{model: ...}``, through Bridge's own dict conversion and representers."""
    import yaml
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.utils.yaml_utils import safe_yaml_representers

    out.mkdir(parents=True, exist_ok=True)
    for name, module in PROVIDERS.items():
        provider = getattr(importlib.import_module(module), name)()
        for fusion in _GPU_FUSIONS:  # kernels only (no change to what the model computes), refused without a GPU
            if hasattr(provider, fusion):
                setattr(provider, fusion, False)
        provider.finalize()  # as ConfigContainer.validate does before a run saves its run_config.yaml
        with safe_yaml_representers():
            text = yaml.safe_dump({"model": ConfigContainer._convert_value_to_dict(provider)}, default_flow_style=False)
        (out / f"{name}.yaml").write_text(text)


if __name__ == "__main__":
    if sys.argv[1] == "--providers":
        import_bridge()
        write_provider_sections(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
