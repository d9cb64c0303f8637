"""A checkpoint Megatron-Bridge's own training code saved (tests/data/megatron_bridge/, see its README): a torch_dist
store with no ``args``, its model described by ``run_config.yaml``, read, inspected, converted and verified."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from support.checkpoint_compare import read_dcp
from support.cli_helpers import assert_clean_refusal, run_cli
from support.hf_helpers import hf_logits, input_ids
from support.mcore_helpers import padded_megatron_core_logits, rank_files

import pgconvert
from pgconvert.errors import CheckpointError, StrictModeError

GOLDEN = Path(__file__).parent / "data" / "megatron_bridge" / "train_tp1_torch_dist"
ITERATION = GOLDEN / "iter_0000005"
TRUE_VOCAB = 100  # run_config.yaml's model.vocab_size; the tables hold 128 rows (should_pad_vocab, multiple 32)
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def _model_tensors(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """The store's model tensors as torch.distributed.checkpoint reads them."""
    return {key: value for key, value in read_dcp(iteration_dir)[1].items() if key.startswith(MODEL_PREFIXES)}


@pytest.fixture(scope="module")
def golden_tensors() -> dict[str, torch.Tensor]:
    return _model_tensors(ITERATION)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden's run directory converted to HF, per-rank TP1 and per-rank TP2."""
    out = tmp_path_factory.mktemp("bridge")
    pgconvert.convert(GOLDEN, out / "hf", dst_format="hf")
    pgconvert.convert(GOLDEN, out / "tp1", dst_format="megatron", dst_tp=1)
    pgconvert.convert(GOLDEN, out / "tp2", dst_format="megatron", dst_tp=2)
    return out


def _copy_golden(tmp_path: Path, change: dict[str, object] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """The golden copied, its run_config.yaml's model section changed (``change``) or keys left out (``drop``)."""
    copy = tmp_path / "run"
    shutil.copytree(GOLDEN, copy)
    run_config = copy / ITERATION.name / "run_config.yaml"
    doc = yaml.safe_load(run_config.read_text())
    doc["model"].update(change or {})
    for key in drop:
        del doc["model"][key]
    run_config.write_text(yaml.safe_dump(doc))
    return copy


def test_golden_is_what_bridge_writes() -> None:
    common = torch.load(ITERATION / "common.pt", weights_only=True)
    assert "args" not in common and common["iteration"] == 5
    assert (GOLDEN / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert (GOLDEN / "latest_train_state.pt").is_file() and (ITERATION / "train_state.pt").is_file()
    model = yaml.safe_load((ITERATION / "run_config.yaml").read_text())["model"]
    assert model["_target_"] == "megatron.bridge.models.gpt_provider.GPTModelProvider"
    assert model["activation_func"] == {"_call_": False, "_target_": "torch.nn.functional.silu"}
    total = sum(path.stat().st_size for path in GOLDEN.rglob("*") if path.is_file())
    assert total < 1_000_000


def test_inspect_reads_the_model_from_run_config() -> None:
    info = pgconvert.inspect(GOLDEN)
    assert not [problem for problem in info.problems if problem.severity == "error"], info.problems
    assert info.layout is not None and (info.layout["tp"], info.layout["pp"]) == (1, 1)
    config = info.model_config
    assert config is not None
    assert (config["num_layers"], config["hidden_size"], config["num_attention_heads"], config["num_query_groups"],
            config["ffn_hidden_size"], config["kv_channels"]) == (2, 32, 4, 2, 64, 8)
    assert (config["normalization"], config["norm_epsilon"], config["activation"], config["gated_linear_unit"]) == (
        "RMSNorm", 1e-6, "silu", True)
    assert (config["position_embedding_type"], config["rotary_base"], config["tie_embeddings"]) == ("rope", 500000.0,
                                                                                                     False)
    assert (config["vocab_size"], config["make_vocab_size_divisible_by"], config["max_position_embeddings"],
            config["transformer_impl"], config["params_dtype"]) == (TRUE_VOCAB, 32, 64, "local", "float32")


def _assert_holds_the_golden_tensors(per_rank: Path, out: Path, golden_tensors: dict[str, torch.Tensor]) -> None:
    """``per_rank`` written back as a TP1 local-spec torch_dist store holds the golden's tensors, bit for bit."""
    pgconvert.convert(per_rank, out, dst_format="torch_dist", dst_tp=1, dst_transformer_impl="local")
    back = _model_tensors(next(path.parent for path in out.rglob("metadata.json")))
    assert sorted(back) == sorted(golden_tensors)
    for key, value in golden_tensors.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_hf_output_computes_what_megatron_core_computes(converted: Path, tmp_path: Path,
                                                         golden_tensors: dict[str, torch.Tensor]) -> None:
    _assert_holds_the_golden_tensors(converted / "tp1", tmp_path / "back", golden_tensors)
    ids = input_ids(TRUE_VOCAB)
    # megatron-core's GPTModel built from the written args, the rank file loaded with strict=True
    expected = padded_megatron_core_logits(rank_files(converted / "tp1"), ids)[..., :TRUE_VOCAB]
    torch.testing.assert_close(hf_logits(converted / "hf", ids), expected, rtol=1e-5, atol=1e-5)


def test_another_tp_round_trips_bit_exact(converted: Path, tmp_path: Path,
                                          golden_tensors: dict[str, torch.Tensor]) -> None:
    assert pgconvert.verify(GOLDEN, converted / "tp2").equal
    _assert_holds_the_golden_tensors(converted / "tp2", tmp_path / "back", golden_tensors)


def test_dry_run_plans_from_run_config(tmp_path: Path) -> None:
    result = run_cli(GOLDEN, tmp_path / "dry", "--dst-format", "megatron", "--dst-tp", "2", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "iter_0000005/mp_rank_01/model_optim_rng.pt" in result.output and not (tmp_path / "dry").exists()


def test_absent_provider_fields_take_the_provider_defaults(tmp_path: Path) -> None:
    # GPTModelProvider's share_embeddings_and_output_weights=True: the untied output layer is then unexpected
    copy = _copy_golden(tmp_path, drop=("share_embeddings_and_output_weights",))
    with pytest.raises(CheckpointError, match=r"unexpected: \['output_layer.weight'\]"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="hf")


def test_no_args_and_no_run_config_is_named(tmp_path: Path) -> None:
    copy = _copy_golden(tmp_path)
    (copy / ITERATION.name / "run_config.yaml").unlink()
    with pytest.raises(CheckpointError, match=r"common\.pt: no 'args' namespace, and no run_config\.yaml"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="hf")
    assert_clean_refusal(run_cli(copy, tmp_path / "out", "--dst-format", "hf"), 1, "no 'args' namespace")
    assert not (tmp_path / "out").exists()


def test_malformed_run_config_is_named(tmp_path: Path) -> None:
    copy = _copy_golden(tmp_path)
    run_config = copy / ITERATION.name / "run_config.yaml"
    run_config.write_text("model: [unclosed\n")
    with pytest.raises(CheckpointError, match=rf"{run_config}: not YAML"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="hf")
    run_config.write_text("checkpoint: {}\n")
    with pytest.raises(CheckpointError, match=rf"{run_config}: no model section"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="hf")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, named", [
    ({"activation_func": {"_target_": "my_project.activations.swish_beta", "_call_": False}},
     "model.activation_func='my_project.activations.swish_beta'"),
    ({"softmax_fn": {"_target_": "my_project.attention.entmax", "_call_": False}},
     "model.softmax_fn='my_project.attention.entmax'"),
], ids=["activation", "other callable"])
def test_a_provider_setting_pgconvert_cannot_read_is_a_notice_and_refused_under_strict(
        tmp_path: Path, change: dict[str, object], named: str) -> None:
    copy = _copy_golden(tmp_path, change)
    report = pgconvert.convert(copy, tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert any(named in notice and notice.startswith("not carried") for notice in report.notices), report.notices
    with pytest.raises(StrictModeError, match=named.replace(".", r"\.")):
        pgconvert.convert(copy, tmp_path / "strict", dst_format="megatron", dst_tp=1, strict=True)
    assert not (tmp_path / "strict").exists()


def test_an_unknown_layer_spec_is_a_guess_refused_under_strict(tmp_path: Path) -> None:
    copy = _copy_golden(tmp_path, {"transformer_layer_spec": {"_target_": "my_project.specs.custom",
                                                              "_call_": False}})
    report = pgconvert.convert(copy, tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert any("model.transformer_layer_spec='my_project.specs.custom'" in notice and notice.startswith("guess")
               for notice in report.notices), report.notices
    with pytest.raises(StrictModeError, match=r"model\.transformer_layer_spec='my_project\.specs\.custom'"):
        pgconvert.convert(copy, tmp_path / "strict", dst_format="hf", strict=True)


def test_a_bridge_run_optimizer_state_is_named_not_carried(tmp_path: Path) -> None:
    # the common part of megatron-core's optimizer.sharded_state_dict, as a run with save_optim saves it
    copy = _copy_golden(tmp_path)
    common_path = copy / ITERATION.name / "common.pt"
    common = torch.load(common_path, weights_only=True)
    torch.save({**common, "optimizer": {"param_groups": [{"lr": 1e-3, "params": [0]}]}}, common_path)
    report = pgconvert.convert(copy, tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert any(notice.startswith("guess") and "Megatron-Bridge run's optimizer state" in notice
               for notice in report.notices), report.notices
    with pytest.raises(StrictModeError, match="Megatron-Bridge run's optimizer state"):
        pgconvert.convert(copy, tmp_path / "strict", dst_format="megatron", dst_tp=1, strict=True)
    assert pgconvert.convert(copy, tmp_path / "skip", dst_format="megatron", dst_tp=1, skip_optimizer=True,
                             strict=True)
    # every command that opens optimizer state gives the same reason (open_checked asks the source)
    assert_clean_refusal(run_cli("export-optimizer", copy, tmp_path / "export"), 2,
                         "Megatron-Bridge run's optimizer state")


def test_provider_defaults_are_megatron_core_transformer_config_defaults() -> None:
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from pgconvert.formats.megatron_bridge import PROVIDER_DEFAULTS

    fields = {field.name: field.default for field in dataclasses.fields(TransformerConfig)}
    shared = {name: value for name, value in PROVIDER_DEFAULTS.items() if name in fields}
    assert len(shared) >= 15 and shared == {name: fields[name] for name in shared}


PROVIDERS = GOLDEN.parent / "providers"  # model sections Bridge's own serializer wrote for its providers' defaults


@pytest.mark.parametrize("provider, expected", [
    ("Llama32ModelProvider1B", {"activation": "silu", "gated_linear_unit": True, "rope_scaling": "llama3",
                                "tie_embeddings": True, "num_query_groups": 8, "kv_channels": 64}),
    ("Qwen3MoEModelProvider30B_A3B", {"activation": "silu", "num_experts": 128, "moe_router_topk": 8,
                                      "qk_layernorm": True, "moe_ffn_hidden_size": 768, "tie_embeddings": False}),
    ("GemmaModelProvider2B", {"activation": "gelu_tanh", "gated_linear_unit": True,
                              "layernorm_zero_centered_gamma": True, "num_query_groups": 1, "kv_channels": 256}),
    ("Nemotron3ModelProvider4B", {"activation": "squared_relu", "gated_linear_unit": False,
                                  "normalization": "LayerNorm", "layernorm_zero_centered_gamma": True}),
    ("GPTOSSProvider20B", {"activation": "quick_gelu", "gated_linear_unit": True, "rope_scaling": "yarn",
                           "rope_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 4096,
                           "softmax_type": "learnable", "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
                           "sliding_window": 129, "num_experts": 32}),
])
def test_bridge_providers_read_as_the_model_they_build(provider: str, expected: dict[str, object]) -> None:
    from pgconvert.formats import LoadOptions
    from pgconvert.formats.dcp_store import model_from_args
    from pgconvert.formats.megatron_bridge import bridge_args

    path = PROVIDERS / f"{provider}.yaml"
    notices: list[str] = []
    _, config = model_from_args(bridge_args(path, True, notices), path, LoadOptions(strict=True), notices)
    settings = config.to_dict()
    assert {name: settings[name] for name in expected} == expected and not notices


def test_transformer_engine_full_layer_spec_is_refused_by_name() -> None:
    from pgconvert.formats.megatron_bridge import bridge_args

    with pytest.raises(CheckpointError, match="GPTProvider126M.yaml: model.use_transformer_engine_full_layer_spec"):
        bridge_args(PROVIDERS / "GPTProvider126M.yaml", False, [])
