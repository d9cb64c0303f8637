"""ParallelLayout: how a model is cut into ranks, and its validation against a ModelConfig."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pgconvert.model.config import ModelConfig
from pgconvert.model.layers import linear_attention_layers
from pgconvert.errors import LayoutError
from pgconvert.io.limits import MAX_PIPELINE_LAYOUT_CHARS, quote

# Megatron's pipeline_model_parallel_layout characters (megatron/core/transformer/
# pipeline_parallel_layer_layout.py): E embedding, L loss (final norm + output layer), t decoder layer.
_LAYOUT_CHARS = {"E", "L", "t", "m"}  # "m": an MTP layer (megatron-core's LayerType.mtp)


def parse_pipeline_layout(text: str) -> list[str]:
    """Expand a layout string such as ``"Et*3|(tt|)*2,L"`` into one string per virtual stage.

    The expansion is bounded (``MAX_PIPELINE_LAYOUT_CHARS``) before any repeat is built.
    """
    expanded = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        budget = [MAX_PIPELINE_LAYOUT_CHARS - len(expanded)]
        expanded = re.sub(pattern, lambda m: _repeat(text, m.group(1), m.group(2), budget), expanded)
    stages = expanded.split("|")
    for stage in stages:
        unknown = sorted(set(stage) - _LAYOUT_CHARS)
        if unknown:
            raise LayoutError(
                f"pipeline layout {quote(text)}: unsupported layer characters {quote(unknown)} "
                "(E embedding, t decoder layer, m multi-token prediction layer, L loss)"
            )
    return stages


def _too_long(text: str) -> LayoutError:
    return LayoutError(f"pipeline layout {quote(text)}: expands to more than {MAX_PIPELINE_LAYOUT_CHARS} "
                       f"characters, over pgconvert's limit MAX_PIPELINE_LAYOUT_CHARS={MAX_PIPELINE_LAYOUT_CHARS}")


def _repeat(text: str, unit: str, count: str, budget: list[int]) -> str:
    """``unit * count``, refused before it is built when the whole expansion would pass the limit
    (``budget``: the characters still allowed)."""
    if len(count) > len(str(MAX_PIPELINE_LAYOUT_CHARS)):
        raise _too_long(text)
    budget[0] -= len(unit) * int(count)
    if budget[0] < 0:
        raise _too_long(text)
    return unit * int(count)


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor, pipeline, expert and virtual-pipeline sizes, and how layers fall on stages.

    ``first_stage_layers`` / ``last_stage_layers`` are Megatron's
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``: the remaining
    layers are split evenly over the remaining stages. ``pipeline_layout`` is Megatron's
    ``pipeline_model_parallel_layout`` string; it fixes every virtual stage's layers.
    ``expert_tp`` (expert tensor parallel size) defaults to ``tp``.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    vpp: int | None = None
    expert_tp: int | None = None
    pipeline_layout: str | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            _require_size(name, getattr(self, name))
        for name in ("vpp", "expert_tp"):
            if getattr(self, name) is not None:
                _require_size(name, getattr(self, name))
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise LayoutError(f"{name}={quote(value)}: must be an integer >= 0")
        if self.pp == 1 and (self.first_stage_layers is not None or self.last_stage_layers is not None):
            raise LayoutError("first/last pipeline stage layers: only meaningful with pp > 1 (pp=1 here)")
        if self.pipeline_layout is not None:
            if self.first_stage_layers is not None or self.last_stage_layers is not None:
                raise LayoutError("pipeline layout: cannot be combined with first/last stage layer counts")
            stages = parse_pipeline_layout(self.pipeline_layout)
            if len(stages) % self.pp:
                raise LayoutError(
                    f"pipeline layout {quote(self.pipeline_layout)}: {len(stages)} stages is not a multiple of pp={self.pp}"
                )
            if self.vpp is not None and len(stages) != self.pp * self.vpp:
                raise LayoutError(
                    f"pipeline layout {quote(self.pipeline_layout)}: {len(stages)} stages, but pp×vpp = "
                    f"{self.pp * self.vpp}"
                )

    @property
    def virtual_size(self) -> int:
        """Model chunks per pipeline stage (1 without a virtual pipeline)."""
        if self.pipeline_layout is not None:
            return len(parse_pipeline_layout(self.pipeline_layout)) // self.pp
        return self.vpp or 1

    @property
    def expert_tp_size(self) -> int:
        return self.expert_tp if self.expert_tp is not None else self.tp

    @property
    def has_virtual_chunks(self) -> bool:
        """Whether rank files hold ``model0…`` chunks rather than one ``model``."""
        return self.vpp is not None or (self.pipeline_layout is not None and self.virtual_size > 1)

    def describe(self) -> str:
        text = f"tp={self.tp},pp={self.pp}"
        if self.ep != 1:
            text += f",ep={self.ep}"
        if self.expert_tp is not None and self.expert_tp != self.tp:
            text += f",expert_tp={self.expert_tp}"
        if self.vpp is not None:
            text += f",vpp={self.vpp}"
        if self.first_stage_layers is not None:
            text += f",first={self.first_stage_layers}"
        if self.last_stage_layers is not None:
            text += f",last={self.last_stage_layers}"
        if self.pipeline_layout is not None:
            text += f",layout={self.pipeline_layout}"
        return text

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep

    def padded_vocab_size(self, vocab_rows: int, divisible_by: int) -> int:
        """Megatron's padding: a multiple of ``divisible_by * tp`` at least ``vocab_rows``."""
        multiple = divisible_by * self.tp
        return -(-vocab_rows // multiple) * multiple

    def virtual_stage_index(self, pp_rank: int, chunk: int) -> int:
        """Chunk ``c`` of stage ``p`` is virtual stage ``c·pp + p`` (Megatron's interleaving)."""
        return chunk * self.pp + pp_rank

    def virtual_stage_layers(self, num_layers: int, flag_prefix: str = "") -> list[range]:
        """Global layers of every virtual stage, indexed by ``virtual_stage_index``."""
        counts = self._virtual_stage_counts(num_layers, flag_prefix)
        ranges: list[range] = []
        start = 0
        for count in counts:
            ranges.append(range(start, start + count))
            start += count
        if start != num_layers:
            opt = _flag_namer(flag_prefix)
            raise LayoutError(f"{opt('pp', self.pp)}: the stages hold {start} layers, but num_layers={num_layers}")
        return ranges

    def stage_layers(self, num_layers: int, flag_prefix: str = "") -> list[range]:
        """Global layers of each pipeline stage (only without a virtual pipeline)."""
        if self.virtual_size != 1:
            raise LayoutError("stage_layers: this layout has virtual pipeline chunks; use virtual_stage_layers")
        return self.virtual_stage_layers(num_layers, flag_prefix)

    def chunk_layers(self, num_layers: int, pp_rank: int, chunk: int) -> range:
        return self.virtual_stage_layers(num_layers)[self.virtual_stage_index(pp_rank, chunk)]

    def _virtual_stage_counts(self, num_layers: int, flag_prefix: str) -> list[int]:
        opt = _flag_namer(flag_prefix)
        if self.pipeline_layout is not None:
            stages = parse_pipeline_layout(self.pipeline_layout)
            flat = "".join(stages)
            if not stages[0].startswith("E") or flat.count("E") != 1:
                raise LayoutError(f"pipeline layout {quote(self.pipeline_layout)}: E (embedding) must open the first stage, once")
            if not stages[-1].endswith("L") or flat.count("L") != 1:
                raise LayoutError(f"pipeline layout {quote(self.pipeline_layout)}: L (loss) must close the last stage, once")
            return [stage.count("t") for stage in stages]
        vpp = self.vpp or 1
        if self.pp == 1 and vpp == 1:
            return [num_layers]
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_layers < 0:
            raise LayoutError(
                f"{opt('decoder-first-pipeline-num-layers', first)}, "
                f"{opt('decoder-last-pipeline-num-layers', last)}: more than num_layers={num_layers}"
            )
        if middle_stages == 0 and middle_layers:
            raise LayoutError(
                f"{opt('pp', self.pp)}: first ({first}) + last ({last}) stage layers must "
                f"add up to num_layers={num_layers}"
            )
        if first is None and last is None and num_layers % (self.pp * vpp):
            what = f"{opt('pp', self.pp)}" + (f" × {opt('vpp', vpp)}" if vpp > 1 else "")
            raise LayoutError(
                f"{what}: num_layers={num_layers} is not divisible by {self.pp * vpp}"
                + (" (give the first/last stage layer counts for uneven stages)" if vpp == 1 else "")
            )
        if middle_stages and middle_layers % (middle_stages * vpp):
            raise LayoutError(
                f"{opt('pp', self.pp)}: the {middle_layers} layers left after the first/last "
                f"stages do not divide evenly over {middle_stages} stages"
                + (f" × {vpp} virtual chunks" if vpp > 1 else "")
            )
        for name, value in (("decoder-first-pipeline-num-layers", first), ("decoder-last-pipeline-num-layers", last)):
            if value is not None and value % vpp:
                raise LayoutError(f"{opt(name, value)}: not divisible by {opt('vpp', vpp)}")
        per_middle = middle_layers // (middle_stages * vpp) if middle_stages else 0
        per_stage = [per_middle] * self.pp
        if first is not None:
            per_stage[0] = first // vpp
        if last is not None:
            per_stage[-1] = last // vpp
        return [per_stage[p] for _ in range(vpp) for p in range(self.pp)]

    def validate(self, config: ModelConfig, flag_prefix: str = "") -> None:
        """Raise LayoutError naming the flag and the constraint when the model cannot take this layout."""
        opt = _flag_namer(flag_prefix)
        tp = self.tp
        moe = config.moe
        for field, value in _tp_divided(config):
            if value % tp:
                raise LayoutError(f"{opt('tp', tp)}: {field}={value} is not divisible by {tp}")
        self._validate_hybrid(config, opt)
        if moe.num_experts is None:
            if self.ep != 1:
                raise LayoutError(f"{opt('ep', self.ep)}: the model has no experts")
        else:
            if moe.num_experts % self.ep:
                raise LayoutError(f"{opt('ep', self.ep)}: num_experts={moe.num_experts} is not divisible by {self.ep}")
            if config.expert_ffn_size % self.expert_tp_size:
                raise LayoutError(
                    f"{opt('expert-tp', self.expert_tp_size)}: moe_ffn_hidden_size={config.expert_ffn_size} "
                    f"is not divisible by {self.expert_tp_size}"
                )
        if self.pp * self.virtual_size > config.num_layers and self.pipeline_layout is None:
            if self.virtual_size > 1:
                raise LayoutError(
                    f"{opt('pp', self.pp)} × {opt('vpp', self.virtual_size)}: {self.pp * self.virtual_size} "
                    f"virtual pipeline stages, more than num_layers={config.num_layers}"
                )
            raise LayoutError(
                f"{opt('pp', self.pp)}: more pipeline stages than num_layers={config.num_layers}"
            )
        self.virtual_stage_layers(config.num_layers, flag_prefix)
        self._validate_mtp(config)

    def _validate_hybrid(self, config: ModelConfig, opt: Callable[[str, object], str]) -> None:
        """megatron-core 0.16.1's MambaStack cuts its layer pattern into even (or first/last-uneven)
        stages and asserts it has no virtual pipeline (``_select_layers_for_pipeline_parallel``); it
        reads no pipeline layout string."""
        pattern = config.hybrid_override_pattern
        if pattern is None:
            return
        if self.has_virtual_chunks:
            raise LayoutError(f"{opt('vpp', self.virtual_size)}: the hybrid model {quote(pattern)} cannot take a "
                              "virtual pipeline (megatron-core's MambaStack asserts it has none)")
        if self.pipeline_layout is not None:
            raise LayoutError(f"pipeline layout {quote(self.pipeline_layout)}: the hybrid model {quote(pattern)} "
                              "places its layers by the pattern; give even or first/last stage sizes instead")

    def _validate_mtp(self, config: ModelConfig) -> None:
        """megatron-core builds MTP layers on the last virtual stage only; a layout string must
        place all of them there (get_mtp_num_layers_to_build counts its "m")."""
        if self.pipeline_layout is None:
            return
        counts = [stage.count("m") for stage in parse_pipeline_layout(self.pipeline_layout)]
        if sum(counts) != config.mtp_num_layers or sum(counts[:-1]):
            where = f", {sum(counts[:-1])} outside the last stage" if sum(counts[:-1]) else ""
            raise LayoutError(
                f"pipeline layout {quote(self.pipeline_layout)}: places {sum(counts)} MTP layers (m){where}; the "
                f"model has mtp_num_layers={config.mtp_num_layers}, all on the last pipeline stage")


def _tp_divided(config: ModelConfig) -> list[tuple[str, int]]:
    """The settings tensor parallelism splits, by name: a GPT model's heads, groups and MLP (and its gated
    delta nets' key and value heads); a hybrid model's only for the layer kinds its pattern has (its Mamba
    mixers split heads and groups)."""
    pattern = config.hybrid_override_pattern
    attention = pattern is None or "*" in pattern
    checks = []
    if attention:
        checks += [("num_attention_heads", config.attention.num_attention_heads),
                   ("num_query_groups", config.attention.query_groups)]
    if pattern is None or "-" in pattern:
        checks.append(("ffn_hidden_size", config.mlp.ffn_hidden_size))
    if pattern is not None and "M" in pattern:
        checks += [("mamba_num_heads", config.mamba.num_heads), ("mamba_num_groups", config.mamba.mamba_num_groups)]
    if any(linear_attention_layers(config)):
        # GatedDeltaNet splits its key and value heads (megatron-core's TransformerConfig asserts both).
        linear = config.linear_attention
        checks += [("linear_num_key_heads", linear.linear_num_key_heads),
                   ("linear_num_value_heads", linear.linear_num_value_heads)]
    if config.moe.moe_shared_expert_intermediate_size is not None:
        checks.append(("moe_shared_expert_intermediate_size", config.moe.moe_shared_expert_intermediate_size))
    return checks


def _require_size(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{name}={quote(value)}: must be an integer >= 1")


def _flag_namer(prefix: str) -> Callable[[str, object], str]:
    """Name a setting the way the user gave it: ``--dst-tp 3`` on the CLI (prefix ``dst``; ``--``
    for a command whose options are bare, ``--tp 3``), ``tp=3`` in the API."""

    def name(option: str, value: object) -> str:
        if prefix == "--":
            return f"--{option} {value}"
        return f"--{prefix}-{option} {value}" if prefix else f"{option.replace('-', '_')}={value}"

    return name
