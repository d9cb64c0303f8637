"""config.json variants of every family, generated from its table, and what transformers makes of them.

For each family a reference config.json is transformers' own ``AutoConfig.for_model(model_type,
**sizes).to_dict()`` (every key its class has, resolved), plus a few references that switch on what
the base leaves off (a sliding window, grouped routing). A variant changes one thing of a reference:

* ``absent KEY`` / ``null KEY``: a config.json key the family's table reads (a ``ConfigField`` path
  or legacy path, a ``ConfigRule`` key or legacy key, the MTP layer count) left out, or null;
* ``older spelling …``: the same settings as transformers 4 (or an ``attribute_map`` alias) wrote them:
  ``rope_scaling`` and a top-level ``rope_theta`` instead of ``rope_parameters``, Gemma 3's
  ``rope_local_base_freq`` and ``sliding_window_pattern``;
* ``rope block …``: a ``rope_parameters`` (or ``rope_scaling``) giving only some of its keys.

``resolve`` is what transformers' config class makes of a variant (its ``to_dict()``), so a test can
check that pgconvert reads the variant as it reads transformers' resolution of it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pgconvert.families.table import Family

# Every family's reference sizes: 128 heads so that any class default of num_key_value_heads (up to
# DeepSeek-V3's 128) divides them; head_dim stated (16, not hidden_size / heads = 2) so that a
# default head_dim reads differently from the stated one.
SIZES: dict[str, Any] = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=4,
                             head_dim=16, intermediate_size=96, vocab_size=1000)
# What a family's class needs beyond SIZES to describe a model pgconvert converts (DeepseekV2Config has
# no default top-k), and expert counts other than the class's, so that an alias of the key reads apart.
NEEDED: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(n_routed_experts=16),
    "deepseek_v2": dict(n_routed_experts=16, num_experts_per_tok=6),
    "qwen3_moe": dict(num_experts=16),
    "qwen2_moe": dict(num_experts=16),
    "mixtral": dict(num_local_experts=4),
    "olmoe": dict(num_experts=16),
    "glm4_moe": dict(n_routed_experts=16),
    "gpt_oss": dict(num_local_experts=16),
    # Dots1Config has no expert-count, top-k or shared-expert defaults, and does not renormalize by default.
    "dots1": dict(n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, norm_topk_prob=True),
    "minimax_m2": dict(num_local_experts=16),
    # NemotronHConfig's default layers include a MoE layer; the dense variant's kinds, four layers.
    "nemotron_h": dict(layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"]),
}
# References that switch on what the base leaves off, so that the keys read only then are varied too.
FEATURES: dict[str, tuple[dict[str, Any], ...]] = {
    "qwen2": (dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),),
    "qwen3": (dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),),
    "qwen3_moe": (dict(use_sliding_window=True, sliding_window=64, decoder_sparse_step=2, mlp_only_layers=[0]),),
    "qwen2_moe": (dict(use_sliding_window=True, sliding_window=64, max_window_layers=3),),
    "smollm3": (dict(use_sliding_window=True, sliding_window=64),),
    "mistral": (dict(sliding_window=64),),
    "ministral": (dict(sliding_window=64),),
    "mixtral": (dict(sliding_window=64),),
    "phi3": (dict(sliding_window=64),),
    "deepseek_v2": (dict(topk_method="group_limited_greedy", n_group=8, topk_group=6),),
    "glm4_moe": (dict(n_group=4, topk_group=2, num_experts_per_tok=4),),
    "ernie4_5": (dict(use_bias=True),),
    "dots1": (dict(sliding_window=64, max_window_layers=2), dict(n_group=4, topk_group=2)),
    "starcoder2": (dict(sliding_window=64, residual_dropout=0.1, embedding_dropout=0.1),),
    # The release spells the partial rotary as rotary_dim (MiniMaxM2Config reads it as rotary_dim / head_dim).
    "minimax_m2": (dict(rotary_dim=8),),
    # EXAONE-4.0-1.2B's: no window (Exaone4Config fills layer_types from no period then: layer_types given).
    "exaone4": (dict(sliding_window=None, layer_types=["full_attention"] * 4),),
}
# Keys to_dict() holds that are no setting (transformers' version, which resolve drops).
NOT_SETTINGS = ("transformers_version",)


@dataclass(frozen=True)
class Variant:
    """A config.json one change away from a reference: ``what`` says which."""

    reference: str
    what: str
    doc: dict[str, Any]
    # The reference it changes.
    base: dict[str, Any]
    # The config.json key the change is about (None: several, a rope block or an older spelling).
    key: str | None = None
    kind: str = "spelling"


def _quiet() -> None:
    # transformers warns about every odd rope block and missing key; the tests read its results.
    logging.getLogger("transformers").setLevel(logging.ERROR)


def resolve(family: Family, doc: dict[str, Any]) -> dict[str, Any]:
    """transformers' reading of config.json ``doc``: its config class built from it, as ``to_dict()``
    (raises what transformers raises)."""
    from transformers import AutoConfig

    _quiet()
    given = {key: value for key, value in copy.deepcopy(doc).items() if key not in ("model_type", *NOT_SETTINGS)}
    resolved: dict[str, Any] = AutoConfig.for_model(family.model_type, **given).to_dict()
    for key in NOT_SETTINGS:
        resolved.pop(key, None)
    resolved["architectures"] = [family.architecture]
    return resolved


def references(family: Family) -> dict[str, dict[str, Any]]:
    """The family's reference config.json documents by name: ``base`` and its ``FEATURES``."""
    needed = NEEDED.get(family.model_type, {})
    extras = ({}, *FEATURES.get(family.model_type, ()))
    named = {}
    for index, extra in enumerate(extras):
        doc = resolve(family, {**SIZES, **needed, **extra})
        named["base" if index == 0 else ", ".join(f"{key}={value}" for key, value in extra.items())] = doc
    return named


def read_keys(family: Family) -> list[tuple[str, ...]]:
    """Every config.json key (as a path) the family's table reads."""
    paths: list[tuple[str, ...]] = []
    for spec in family.fields:
        paths += list(spec.spellings)
    for rule in family.rules:
        paths += [(key,) for key in (*rule.keys, *rule.legacy_keys)]
    if family.hf_mtp_layers_key is not None:
        paths.append((family.hf_mtp_layers_key,))
    return list(dict.fromkeys(paths))


def legacy_keys(family: Family) -> set[str]:
    """The older spellings the table declares (to be produced by some ``older spelling`` variant)."""
    keys = {".".join(path) for spec in family.fields for path in (*spec.legacy, *spec.aliases)}
    return keys | {key for rule in family.rules for key in rule.legacy_keys}


def _parent(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: Any = doc
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _absent(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    changed = copy.deepcopy(doc)
    parent = _parent(changed, path)
    if parent is None or path[-1] not in parent:
        return None
    del parent[path[-1]]
    return changed


def _null(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    changed = copy.deepcopy(doc)
    parent = _parent(changed, path)
    if parent is None:
        return None
    parent[path[-1]] = None
    return changed


def _older_rope(doc: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_parameters`` as transformers 4 wrote it: a top-level ``rope_theta`` (and
    ``partial_rotary_factor``), ``rope_scaling`` for a scaled type; Gemma 3's per layer type as
    ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` (the full-attention layers')."""
    params = doc.get("rope_parameters")
    if not isinstance(params, dict):
        return None
    changed = copy.deepcopy(doc)
    del changed["rope_parameters"]
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        changed["rope_local_base_freq"] = local.get("rope_theta")
    else:
        full = dict(params)
    changed["rope_theta"] = full.pop("rope_theta", None)
    if "partial_rotary_factor" in full:
        changed["partial_rotary_factor"] = full.pop("partial_rotary_factor")
    changed["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    return changed


def _older_interval(key: str, other: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """``layer_types`` as an interval ``key`` (every n-th layer full attention, the others ``other``): Gemma 3's
    ``sliding_window_pattern`` (transformers 4.50), Qwen3-Next's ``full_attention_interval`` (its release)."""

    def rewrite(doc: dict[str, Any]) -> dict[str, Any] | None:
        types = doc.get("layer_types")
        if not isinstance(types, list):
            return None
        period = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
        if types != [other if (layer + 1) % period else "full_attention" for layer in range(len(types))]:
            return None
        changed = copy.deepcopy(doc)
        del changed["layer_types"]
        changed[key] = period
        return changed

    return rewrite


def _older_neox_rope(doc: dict[str, Any]) -> dict[str, Any] | None:
    """GPT-NeoX's ``rope_parameters`` as its releases wrote it: ``rotary_emb_base`` and ``rotary_pct`` (and
    ``rope_scaling`` for a scaled type)."""
    params = doc.get("rope_parameters")
    if not isinstance(params, dict):
        return None
    changed, rest = copy.deepcopy(doc), dict(params)
    del changed["rope_parameters"]
    changed["rotary_emb_base"] = rest.pop("rope_theta", None)
    changed["rotary_pct"] = rest.pop("partial_rotary_factor", None)
    changed["rope_scaling"] = rest if rest.get("rope_type", "default") != "default" else None
    return changed


def _indexer_pattern(doc: dict[str, Any]) -> dict[str, Any] | None:
    """GLM-5's ``indexer_types`` as ``index_topk_pattern`` (F full, S shared), which GlmMoeDsaConfig expands."""
    types = doc.get("indexer_types")
    if not isinstance(types, list):
        return None
    changed = copy.deepcopy(doc)
    changed["index_topk_pattern"] = "".join("F" if kind == "full" else "S" for kind in changed.pop("indexer_types"))
    return changed


def _indexer_schedule(doc: dict[str, Any]) -> dict[str, Any] | None:
    """GLM-5's ``indexer_types`` as ``index_topk_freq`` / ``index_skip_topk_offset`` (every layer full: 1 and 0)."""
    if doc.get("indexer_types") != ["full"] * len(doc.get("indexer_types") or [0]):
        return None
    changed = copy.deepcopy(doc)
    del changed["indexer_types"]
    changed.update(index_topk_freq=1, index_skip_topk_offset=0)
    return changed


# How an older spelling a table declares is written, by the key it reads.
OLDER_SPELLINGS: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
    "rope_theta": _older_rope,
    "rope_scaling": _older_rope,
    "rope_local_base_freq": _older_rope,
    "sliding_window_pattern": _older_interval("sliding_window_pattern", "sliding_attention"),
    "full_attention_interval": _older_interval("full_attention_interval", "linear_attention"),
    "rotary_emb_base": _older_neox_rope,
    "rotary_pct": _older_neox_rope,
    "index_topk_pattern": _indexer_pattern,
    "index_topk_freq": _indexer_schedule,
    "index_skip_topk_offset": _indexer_schedule,
}


def _aliases(family: Family) -> dict[str, str]:
    """transformers' ``attribute_map`` of the family's config class (alias -> attribute) for the keys
    the table reads: both names are accepted in config.json."""
    from transformers import AutoConfig

    read = {".".join(path) for path in read_keys(family)}
    mapped = dict(type(AutoConfig.for_model(family.model_type)).attribute_map)
    if family.hf_mtp_layers_key is not None and family.hf_mtp_layers_alias is not None:
        mapped.setdefault(family.hf_mtp_layers_alias, family.hf_mtp_layers_key)
    return {alias: real for alias, real in mapped.items() if real in read}


def _renamed(doc: dict[str, Any], real: str, alias: str) -> dict[str, Any] | None:
    if real not in doc or alias in doc:
        return None
    changed = copy.deepcopy(doc)
    changed[alias] = changed.pop(real)
    return changed


def _field_legacy_paths(family: Family) -> set[tuple[str, ...]]:
    return {path for spec in family.fields for path in (*spec.legacy, *spec.aliases)}


def older_spellings(family: Family, doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``doc`` in each older spelling transformers accepts for a key the family reads."""
    written = {}
    for key in ("rope_theta", *sorted(legacy_keys(family) - {"rope_theta"})):
        rewrite = OLDER_SPELLINGS.get(key)
        if rewrite is not None and rewrite not in written.values():
            written[key] = rewrite
    for key, rewrite in written.items():
        changed = rewrite(doc)
        if changed is not None:
            yield f"older spelling of {key}", changed
    for alias, real in sorted(_aliases(family).items()):
        changed = _renamed(doc, real, alias)
        if changed is not None:
            yield f"older spelling {alias} (attribute_map alias of {real})", changed


def rope_blocks(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE parameter blocks giving only some of their keys (transformers fills, or refuses, the rest)."""
    rotary = doc["hidden_size"] // doc["num_attention_heads"]
    longrope = {"short_factor": [1.0] * max(rotary // 2, 1), "long_factor": [2.0] * max(rotary // 2, 1)}
    return {
        "yarn, factor only": {"rope_type": "yarn", "factor": 4.0},
        "yarn as 'type', factor only": {"type": "yarn", "factor": 4.0},
        "yarn with longrope's factors": {"rope_type": "yarn", "factor": 4.0, **longrope},
        "linear, factor only": {"rope_type": "linear", "factor": 2.0},
        "llama3, factor only": {"rope_type": "llama3", "factor": 8.0},
        "default, no base": {"rope_type": "default"},
        "longrope, no original context": {"rope_type": "longrope", **longrope},
        "full-attention layers linear only": {"full_attention": {"rope_type": "linear", "factor": 8.0}},
    }


def _rope_block_variants(name: str, doc: dict[str, Any]) -> Iterator[Variant]:
    if "rope_parameters" not in doc:
        return
    for what, block in rope_blocks(doc).items():
        given = copy.deepcopy(doc)
        given["rope_parameters"] = copy.deepcopy(block)
        yield Variant(name, f"rope block {what} (rope_parameters)", given, doc)
        older = copy.deepcopy(doc)
        del older["rope_parameters"]
        older["rope_scaling"] = copy.deepcopy(block)
        yield Variant(name, f"rope block {what} (rope_scaling)", older, doc)


def _key_variants(name: str, prefix: str, doc: dict[str, Any], base: dict[str, Any],
                  paths: list[tuple[str, ...]]) -> Iterator[Variant]:
    for path in paths:
        key = ".".join(path)
        absent = _absent(doc, path)
        if absent is not None:
            yield Variant(name, f"{prefix}absent {key}", absent, base, key, "absent")
        null = _null(doc, path)
        if null is not None:
            yield Variant(name, f"{prefix}null {key}", null, base, key, "null")


def variants(family: Family, named: dict[str, dict[str, Any]] | None = None) -> Iterator[Variant]:
    """Every variant of every reference (``named``, by default ``references(family)``) of ``family``:
    each key it reads absent and null (an older spelling of a field only where the current one is
    absent, as no writer puts both), each older spelling (and each key it introduces absent and
    null), and the partial RoPE blocks."""
    legacy = _field_legacy_paths(family)
    spelled: set[str] = set()
    for name, doc in (references(family) if named is None else named).items():
        yield Variant(name, "as transformers resolved it", doc, doc)
        paths = [path for path in read_keys(family) if path not in legacy]
        yield from _key_variants(name, "", doc, doc, paths)
        for what, changed in older_spellings(family, doc):
            yield Variant(name, what, changed, doc)
            introduced = [(key,) for key in changed if key not in doc]
            spelled |= {key for (key,) in introduced}
            yield from _key_variants(name, f"{what}, ", changed, doc, introduced)
        if name == "base":
            yield from _rope_block_variants(name, doc)
    unwritten = sorted(legacy_keys(family) - spelled)
    if unwritten:
        raise ValueError(f"{family.architecture} reads older spellings {unwritten} that no variant writes: "
                         "teach OLDER_SPELLINGS (or a reference) to write them")
