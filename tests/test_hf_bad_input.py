"""Broken, inconsistent or hostile hf sources and impossible hf targets fail with clear messages."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.hf_helpers import build_hf_model, edit_json, load_hf_tensors, rewrite_as_single_file, save_hf_model

import pgconvert
from pgconvert.cli import main
from pgconvert.errors import CheckpointError, ConfigError, LayoutError
from pgconvert.families import supported_architectures

# Every registered family, sorted (read from the registry as families are added).
SUPPORTED = ", ".join(supported_architectures())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {name: save_hf_model(build_hf_model(name, seed=2), root / name) for name in ("llama", "qwen2", "qwen3")}


@pytest.fixture
def llama(pristine: dict[str, Path], tmp_path: Path) -> Path:
    """A sharded Llama checkpoint of this test's own, free to break."""
    return Path(shutil.copytree(pristine["llama"], tmp_path / "src"))


def _convert(src: Path, tmp_path: Path, **options: object) -> None:
    pgconvert.convert(src, tmp_path / "dst", **{"dst_format": "megatron", **options})


def _first_shard(src: Path) -> Path:
    return sorted(src.glob("model-*.safetensors"))[0]


def test_unknown_architecture_is_refused_listing_the_supported_ones(llama: Path, tmp_path: Path) -> None:
    edit_json(llama / "config.json", lambda doc: doc.update(architectures=["FooForCausalLM"]))
    message = f"architectures[0]='FooForCausalLM' is not supported; supported: {SUPPORTED}"

    with pytest.raises(CheckpointError, match=re.escape(f"{llama / 'config.json'}: {message}")):
        _convert(llama, tmp_path)
    result = CliRunner().invoke(main, ["--dst-format", "megatron", str(llama), str(tmp_path / "cli")])

    assert result.exit_code == 1
    assert message in result.output
    assert not (tmp_path / "dst").exists() and not (tmp_path / "cli").exists()


def test_missing_tensor_is_named(llama: Path, tmp_path: Path) -> None:
    rewrite_as_single_file(llama, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))

    with pytest.raises(CheckpointError, match=re.escape(
        "tensors do not match LlamaForCausalLM as config.json describes it; "
        "missing: ['model.layers.1.mlp.up_proj.weight']; unexpected: []"
    )):
        _convert(llama, tmp_path)


def test_extra_tensor_is_named(llama: Path, tmp_path: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2)
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    rewrite_as_single_file(llama, add)

    with pytest.raises(CheckpointError, match=re.escape(
        "missing: []; unexpected: ['model.layers.0.self_attn.extra_proj.weight', "
        "'model.layers.0.self_attn.q_proj.bias']"
    )):
        _convert(llama, tmp_path)


def test_rotary_inv_freq_buffers_are_skipped(llama: Path, pristine: dict[str, Path], tmp_path: Path) -> None:
    rewrite_as_single_file(llama, lambda tensors: tensors.update({
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(4)
    }))

    pgconvert.convert(llama, tmp_path / "hf")

    expected, actual = load_hf_tensors(pristine["llama"]), load_hf_tensors(tmp_path / "hf")
    assert sorted(actual) == sorted(expected)


def test_tensor_with_a_shape_config_json_does_not_describe_is_refused(llama: Path, tmp_path: Path) -> None:
    edit_json(llama / "config.json", lambda doc: doc.update(intermediate_size=64))

    with pytest.raises(CheckpointError, match=r"model-\d{5}-of-\d{5}.safetensors: model.layers.0.mlp.gate_proj.weight "
                                              r"has shape \[128, 64\], expected \[64, 64\] from config.json"):
        _convert(llama, tmp_path)


@pytest.mark.parametrize("shard_name,problem", [
    ("../model-00001-of-00010.safetensors", "contains '..'"),
    ("/tmp/model-00001-of-00010.safetensors", "is an absolute path"),
    ("model-00001\x00.safetensors", "contains a NUL byte"),
    ("model-00001-of-00010.bin", "does not end in .safetensors"),
    ("weights/model-00001-of-00010.safetensors", "contains a path separator"),
    ("weights\\model-00001-of-00010.safetensors", "contains a path separator"),
], ids=["dotdot", "absolute", "nul", "not-safetensors", "slash", "backslash"])
def test_index_with_hostile_shard_name_is_refused(llama: Path, tmp_path: Path, shard_name: str,
                                                  problem: str) -> None:
    index = llama / "model.safetensors.index.json"
    edit_json(index, lambda doc: doc["weight_map"].update({"model.norm.weight": shard_name}))

    with pytest.raises(CheckpointError, match=re.escape(f"{index}: shard name {shard_name!r} {problem}")):
        _convert(llama, tmp_path)
    result = CliRunner().invoke(main, ["--dst-format", "megatron", str(llama), str(tmp_path / "cli")])
    assert result.exit_code == 1 and "shard name" in result.output


def test_shard_symlinked_outside_the_checkpoint_is_refused(llama: Path, tmp_path: Path) -> None:
    shard = _first_shard(llama)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)

    with pytest.raises(CheckpointError,
                       match=rf"{re.escape(shard.name)}' resolves to .*outside the checkpoint directory"):
        _convert(llama, tmp_path)


def test_index_that_puts_a_tensor_in_the_wrong_shard_is_refused(llama: Path, tmp_path: Path) -> None:
    index = llama / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    actual_shard = doc["weight_map"]["model.norm.weight"]
    other = next(s for s in sorted(set(doc["weight_map"].values())) if s != actual_shard)
    edit_json(index, lambda d: d["weight_map"].update({"model.norm.weight": other}))

    with pytest.raises(CheckpointError, match=re.escape(
        f"{actual_shard}: holds model.norm.weight, but model.safetensors.index.json lists it in {other}"
    )):
        _convert(llama, tmp_path)


def test_index_naming_a_missing_shard_is_refused(llama: Path, tmp_path: Path) -> None:
    shard = _first_shard(llama)
    shard.unlink()

    with pytest.raises(CheckpointError, match=re.escape(f"names shard {shard.name}, which is missing")):
        _convert(llama, tmp_path)


def test_corrupt_safetensors_header_names_the_file(llama: Path, tmp_path: Path) -> None:
    shard = _first_shard(llama)
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: not a readable safetensors file (corrupt header?)")):
        _convert(llama, tmp_path)


def test_truncated_single_file_names_the_file(llama: Path, tmp_path: Path) -> None:
    rewrite_as_single_file(llama, lambda tensors: None)
    single = llama / "model.safetensors"
    single.write_bytes(single.read_bytes()[:-100])

    with pytest.raises(CheckpointError, match=re.escape(f"{single}: not a readable safetensors file")):
        _convert(llama, tmp_path)


def test_config_json_that_is_not_json_is_refused(llama: Path, tmp_path: Path) -> None:
    (llama / "config.json").write_text("{not json")

    with pytest.raises(CheckpointError, match=re.escape(f"{llama / 'config.json'}: not valid JSON")):
        _convert(llama, tmp_path)


def test_llama_with_attention_bias_but_no_mlp_bias_is_refused(llama: Path, tmp_path: Path) -> None:
    edit_json(llama / "config.json", lambda doc: doc.update(attention_bias=True, mlp_bias=False))

    with pytest.raises(CheckpointError, match=re.escape(
        "attention_bias=True and mlp_bias=False: Megatron has one setting (add_bias_linear) for both"
    )):
        _convert(llama, tmp_path)


def test_qwen3_with_attention_bias_is_refused(pristine: dict[str, Path], tmp_path: Path) -> None:
    src = Path(shutil.copytree(pristine["qwen3"], tmp_path / "src"))
    edit_json(src / "config.json", lambda doc: doc.update(attention_bias=True))

    with pytest.raises(CheckpointError, match=re.escape(
        "attention_bias=True: Qwen3ForCausalLM is converted only with attention_bias=False"
    )):
        _convert(src, tmp_path)


def test_non_silu_activation_is_refused(llama: Path, tmp_path: Path) -> None:
    edit_json(llama / "config.json", lambda doc: doc.update(hidden_act="gelu"))

    with pytest.raises(CheckpointError, match="hidden_act='gelu': LlamaForCausalLM is converted only with "
                                              "hidden_act='silu'"):
        _convert(llama, tmp_path)


def test_tied_output_copy_that_differs_from_the_embedding_is_refused(pristine: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    src = Path(shutil.copytree(pristine["qwen2"], tmp_path / "src"))
    rewrite_as_single_file(
        src, lambda t: t.__setitem__("lm_head.weight", torch.zeros_like(t["model.embed_tokens.weight"])))

    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight, but "
                                              r"config.json ties them \(tie_word_embeddings=true\)"):
        _convert(src, tmp_path)
    assert not (tmp_path / "dst").exists()
    assert not any(p.name.startswith(".dst") for p in tmp_path.iterdir())


def test_hf_destination_with_tensor_parallelism_is_refused(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match=re.escape(
        "dst layout tp=2,pp=1: the hf format holds one unsharded model; pass --dst-tp 1 --dst-pp 1"
    )):
        pgconvert.convert(llama, tmp_path / "dst", dst_format="hf", dst_tp=2)
    result = CliRunner().invoke(main, ["--dst-format", "hf", "--dst-tp", "2", str(llama), str(tmp_path / "cli")])

    assert result.exit_code == 2
    assert "the hf format holds one unsharded model" in result.output
    assert not (tmp_path / "dst").exists() and not (tmp_path / "cli").exists()


def test_source_layout_flags_other_than_one_are_refused_for_hf(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match=r"--src-tp 2: an hf checkpoint is not sharded"):
        _convert(llama, tmp_path, src_tp=2)


def test_saver_refuses_a_user_config_with_an_unknown_architecture(llama: Path, tmp_path: Path) -> None:
    from pgconvert.loaders.hf import HFLoader
    from pgconvert.formats import LoadOptions, SaveOptions
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.savers.hf import HFSaver

    user_config = tmp_path / "user_config.json"
    shutil.copy(llama / "config.json", user_config)
    edit_json(user_config, lambda doc: doc.update(architectures=["GPT2LMHeadModel"]))

    with HFLoader().open(llama, LoadOptions()) as source:
        with pytest.raises(ConfigError, match=re.escape(
            f"architectures[0]='GPT2LMHeadModel' is not supported; supported: {SUPPORTED}"
        )):
            HFSaver().validate(source, SaveOptions(layout=ParallelLayout(), hf_config=user_config))


def test_tokenizer_file_symlinked_outside_the_source_is_refused_before_writing(llama: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (llama / "tokenizer.json").unlink()
    (llama / "tokenizer.json").symlink_to(secret)

    with pytest.raises(CheckpointError, match=r"tokenizer.json: resolves to .*outside .*side files must lie inside the checkpoint directory"):
        pgconvert.convert(llama, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


# ------------------------------------------------------------------------------------ named as written


def _set_path(doc: dict[str, object], key: str, value: object) -> None:
    *parents, last = key.split(".")
    for parent in parents:
        doc = doc[parent]  # type: ignore[assignment]
    doc[last] = value


@pytest.mark.parametrize("key,value,megatron", [
    ("num_key_value_heads", 0, "num_query_groups=0"),
    ("num_hidden_layers", 0, "num_layers=0"),
    ("intermediate_size", 0, "ffn_hidden_size=0"),
    ("head_dim", 0, "kv_channels=0"),
    ("rope_parameters.rope_theta", 0, "rotary_base=0.0"),
])
def test_an_impossible_value_is_named_by_its_config_json_key(llama: Path, tmp_path: Path, key: str, value: object,
                                                            megatron: str) -> None:
    edit_json(llama / "config.json", lambda doc: _set_path(doc, key, value))

    with pytest.raises(CheckpointError) as raised:
        _convert(llama, tmp_path)

    assert f"config.json: {key}={value}: must be" in str(raised.value)
    assert f"(Megatron's {megatron})" in str(raised.value)


def test_a_nan_is_named_by_the_hf_tensor_that_holds_it(llama: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_as_single_file(llama, lambda tensors: tensors[name].view(-1).__setitem__(3, float("nan")))

    with pytest.raises(CheckpointError) as raised:
        _convert(llama, tmp_path, check_finite="error")

    message = str(raised.value)
    assert message.startswith(f"{name} (pgconvert's decoder.layers.1.mlp.linear_fc1.weight): 1 of ")
    assert "gate_proj" not in message  # fused with up_proj, but finite
