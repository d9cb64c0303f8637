"""ParallelLayout: how a model is cut into ranks, and its validation against a ModelConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pgconvert.config import ModelConfig
from pgconvert.errors import LayoutError


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor, pipeline and expert parallel sizes, and how layers fall on pipeline stages.

    ``first_stage_layers`` / ``last_stage_layers`` are Megatron's
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``: the remaining
    layers are split evenly over the remaining stages.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r}: must be an integer >= 1")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise LayoutError(f"{name}={value!r}: must be an integer >= 0")
        if self.pp == 1 and (self.first_stage_layers is not None or self.last_stage_layers is not None):
            raise LayoutError(
                "first/last pipeline stage layers: only meaningful with pp > 1 (pp=1 here)"
            )
        if self.ep != 1:
            raise LayoutError(f"ep={self.ep}: expert parallelism is not supported yet")

    def describe(self) -> str:
        text = f"tp={self.tp},pp={self.pp}"
        if self.ep != 1:
            text += f",ep={self.ep}"
        if self.first_stage_layers is not None:
            text += f",first={self.first_stage_layers}"
        if self.last_stage_layers is not None:
            text += f",last={self.last_stage_layers}"
        return text

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep

    def padded_vocab_size(self, vocab_rows: int, divisible_by: int) -> int:
        """Megatron's padding: a multiple of ``divisible_by * tp`` at least ``vocab_rows``."""
        multiple = divisible_by * self.tp
        return -(-vocab_rows // multiple) * multiple

    def stage_layers(self, num_layers: int, flag_prefix: str = "") -> list[range]:
        """Global layer indices held by each pipeline stage, as megatron-core assigns them."""
        opt = _flag_namer(flag_prefix)
        if self.pp == 1:
            return [range(num_layers)]
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_layers < 0:
            raise LayoutError(
                f"{opt('decoder-first-pipeline-num-layers', first)}, "
                f"{opt('decoder-last-pipeline-num-layers', last)}: more than num_layers={num_layers}"
            )
        if middle_stages == 0:
            if middle_layers:
                raise LayoutError(
                    f"{opt('pp', self.pp)}: first ({first}) + last ({last}) stage layers must "
                    f"add up to num_layers={num_layers}"
                )
            per_stage = 0
        else:
            if middle_layers % middle_stages:
                if first is None and last is None:
                    raise LayoutError(
                        f"{opt('pp', self.pp)}: num_layers={num_layers} is not divisible by {self.pp}"
                        " (give the first/last stage layer counts for uneven stages)"
                    )
                raise LayoutError(
                    f"{opt('pp', self.pp)}: the {middle_layers} layers left after the first/last "
                    f"stages do not divide evenly over {middle_stages} stages"
                )
            per_stage = middle_layers // middle_stages
        sizes = [per_stage] * self.pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        ranges: list[range] = []
        start = 0
        for size in sizes:
            ranges.append(range(start, start + size))
            start += size
        return ranges

    def validate(self, config: ModelConfig, flag_prefix: str = "") -> None:
        """Raise LayoutError naming the flag and the constraint when the model cannot take this layout."""
        opt = _flag_namer(flag_prefix)
        tp = self.tp
        checks = (
            ("num_attention_heads", config.num_attention_heads),
            ("num_query_groups", config.query_groups),
            ("ffn_hidden_size", config.ffn_hidden_size),
        )
        for field, value in checks:
            if value % tp:
                raise LayoutError(f"{opt('tp', tp)}: {field}={value} is not divisible by {tp}")
        if self.pp > config.num_layers:
            raise LayoutError(
                f"{opt('pp', self.pp)}: more pipeline stages than num_layers={config.num_layers}"
            )
        self.stage_layers(config.num_layers, flag_prefix)


def _flag_namer(prefix: str) -> Callable[[str, object], str]:
    """Name a setting the way the user gave it: ``--dst-tp 3`` on the CLI, ``tp=3`` in the API."""

    def name(option: str, value: object) -> str:
        return f"--{prefix}-{option} {value}" if prefix else f"{option.replace('-', '_')}={value}"

    return name
