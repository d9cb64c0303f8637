"""Optimizer state carried to and from the Transformer Engine spec's parameter names and order.

The TE spec fuses the input and pre-MLP norms into ``linear_qkv`` / ``linear_fc1``
(``layer_norm_weight``), which te.pytorch.LayerNormLinear registers before the linear's weight, so a
layer's input norm moves from the first position (local spec) to after ``linear_proj``: a local-spec
golden converted to TE naming and back must keep every optimizer tensor bit for bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from click.testing import CliRunner, Result
from support.megatron_fixtures import assert_same_tree, load_for_test

from pgconvert.cli import main
from pgconvert.formats import LoadOptions
from pgconvert.loaders.megatron import MegatronSource
from pgconvert.optimizer.order import optimizer_slots

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
PLAIN = GOLDENS / "train_tp2pp2_torch"
DISTOPT = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
ITER = "iter_0000002"


def _convert(src: Path, dst: Path, *flags: str) -> Result:
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", *flags], prog_name="pgconvert")
    assert result.exit_code == 0, result.output
    return result


def _ranks(root: Path) -> dict[str, dict]:
    return {path.parent.name: load_for_test(path) for path in sorted((root / ITER).glob("mp_rank_*/model_optim_rng.pt"))}



def test_te_positions_put_the_fused_norm_after_linear_proj(tmp_path: Path) -> None:
    _convert(PLAIN, tmp_path / "te", "--dst-tp", "1", "--dst-pp", "1", "--dst-transformer-impl", "transformer_engine")
    source = MegatronSource(tmp_path / "te" / ITER, 2, False, LoadOptions())
    assert source.config.transformer_impl == "transformer_engine"
    ((coord, path),) = source.files.items()
    slots = optimizer_slots(source.config, source.layout, coord, padded_vocab_size=source.vocab_rows)
    names = [slot.spec.local_name for slot in slots[1]]  # no weight decay: the norms, in module order
    layer = "decoder.layers.0."
    assert names.index(layer + "self_attention.linear_qkv.layer_norm_weight") < \
        names.index(layer + "mlp.linear_fc1.layer_norm_weight") < names.index("decoder.layers.1.self_attention."
                                                                            "linear_qkv.layer_norm_weight")
    local = _ranks(tmp_path / "te")["mp_rank_00"]
    state = local["optimizer"]["state"]
    by_name = {slot.spec.local_name: slot.position for group in slots for slot in group}
    # Each position's moments have its TE-named parameter's shape, and the weights' exp_avg are the local one's.
    for name, position in by_name.items():
        assert tuple(state[position]["exp_avg"].shape) == tuple(local["model"][name].shape), name
    _convert(PLAIN, tmp_path / "loc", "--dst-tp", "1", "--dst-pp", "1")
    plain_rank = _ranks(tmp_path / "loc")["mp_rank_00"]
    plain_slots = optimizer_slots(dataclasses.replace(source.config, transformer_impl="local"), source.layout, coord,
                                  padded_vocab_size=source.vocab_rows)
    plain_by_canonical = {slot.spec.canonical: slot.position for group in plain_slots for slot in group}
    for slot in (slot for group in slots for slot in group):
        assert torch.equal(state[slot.position]["exp_avg_sq"],
                           plain_rank["optimizer"]["state"][plain_by_canonical[slot.spec.canonical]]["exp_avg_sq"])


def test_plain_optimizer_round_trips_through_te_naming_bit_exact(tmp_path: Path) -> None:
    _convert(PLAIN, tmp_path / "te", "--dst-tp", "1", "--dst-pp", "1", "--dst-transformer-impl", "transformer_engine")
    _convert(tmp_path / "te", tmp_path / "back", "--dst-tp", "2", "--dst-pp", "2", "--dst-transformer-impl", "local")
    original, again = _ranks(PLAIN), _ranks(tmp_path / "back")
    assert set(original) == set(again) and len(original) == 4
    for rank, state in original.items():
        for key in ("optimizer", "iteration", "opt_param_scheduler"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")


def test_distributed_optimizer_round_trips_through_te_naming_bit_exact(tmp_path: Path) -> None:
    _convert(DISTOPT, tmp_path / "te", "--dst-transformer-impl", "transformer_engine")
    _convert(tmp_path / "te", tmp_path / "back", "--dst-transformer-impl", "local")
    for rank in ("mp_rank_00", "mp_rank_01"):
        te = torch.load(tmp_path / "te" / ITER / rank / "distrib_optim.pt", weights_only=True)
        before = torch.load(DISTOPT / ITER / rank / "distrib_optim.pt", weights_only=True)
        (te_entry,), (entry,) = te[0].values(), before[0].values()
        # Same parameters, another order in the buffer: same size, other contents.
        assert te_entry["numel_unpadded"] == entry["numel_unpadded"]
        assert not torch.equal(te_entry["exp_avg"], entry["exp_avg"])
        assert_same_tree(before, torch.load(tmp_path / "back" / ITER / rank / "distrib_optim.pt", weights_only=True), rank)
