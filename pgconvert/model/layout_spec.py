"""Layouts written as text (``tp=2,pp=4,ep=8``): the form used by plans, the API and the CLI.

A ``LayoutSpec`` is a *partial* layout: the keys it names, and nothing about the others, so
``"tp=2"`` changes the tensor-parallel size and keeps the rest from the source, exactly as
``--dst-tp 2`` does. A full ``ParallelLayout`` becomes a spec naming every field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pgconvert.errors import LayoutError
from pgconvert.model.layout import ParallelLayout
from pgconvert.io.limits import quote

# Text key -> ParallelLayout field. The short keys are the ones ParallelLayout.describe() writes,
# so ``LayoutSpec.parse(layout.describe())`` gives the layout back.
_KEYS: dict[str, str] = {
    "tp": "tp",
    "pp": "pp",
    "ep": "ep",
    "vpp": "vpp",
    "expert_tp": "expert_tp",
    "first": "first_stage_layers",
    "first_stage_layers": "first_stage_layers",
    "last": "last_stage_layers",
    "last_stage_layers": "last_stage_layers",
    "layout": "pipeline_layout",
    "pipeline_layout": "pipeline_layout",
}
# Stage counts may be zero (an empty first or last stage); every size is at least one.
_MINIMUM: dict[str, int] = {"first_stage_layers": 0, "last_stage_layers": 0}
_MAX_DIGITS = 9
# Megatron pipeline-layout strings contain commas themselves ("Et*3|(tt|)*2,L"): once this key is
# reached, the rest of the text is its value.
_TRAILING_FIELD = "pipeline_layout"


@dataclass(frozen=True)
class LayoutSpec:
    """Some or all fields of a ``ParallelLayout``; ``None`` means "not given"."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    vpp: int | None = None
    expert_tp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    pipeline_layout: str | None = None

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value is None:
                continue
            if item.name == _TRAILING_FIELD:
                if not isinstance(value, str) or not value:
                    raise LayoutError(f"{item.name}={value!r}: must be a non-empty pipeline layout string")
                continue
            minimum = _MINIMUM.get(item.name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise LayoutError(f"{item.name}={value!r}: must be an integer >= {minimum}")

    @classmethod
    def parse(cls, text: str) -> LayoutSpec:
        """``"tp=2,pp=4,ep=8"`` → the spec; a malformed text is a LayoutError quoting it."""
        if not isinstance(text, str) or not text.strip():
            raise LayoutError(f"layout {quote(text)}: expected comma-separated key=value pairs such as 'tp=2,pp=4'")
        values: dict[str, int | str] = {}
        remaining = text.strip()
        while remaining:
            part, _, rest = remaining.partition(",")
            key, equals, value = part.partition("=")
            key = key.strip()
            if not equals:
                raise LayoutError(f"layout {quote(text)}: {quote(part.strip())} is not key=value")
            field = _KEYS.get(key)
            if field is None:
                raise LayoutError(f"layout {quote(text)}: unknown key {quote(key)}; known keys: {', '.join(_KEYS)}")
            if field in values:
                raise LayoutError(f"layout {quote(text)}: {key!r} given twice")
            if field == _TRAILING_FIELD:
                values[field] = remaining.partition("=")[2].strip()
                if "=" in values[field]:
                    raise LayoutError(f"layout {quote(text)}: {key}=… must come last (its value may contain commas)")
                break
            value = value.strip()
            # ASCII digits only ("²".isdigit() is true), and few of them: int() of thousands of
            # digits is refused by Python itself, and no parallel size has ten.
            if (not (value.isascii() and value.isdigit()) or len(value) > _MAX_DIGITS
                    or int(value) < _MINIMUM.get(field, 1)):
                raise LayoutError(
                    f"layout {quote(text)}: {key}={quote(value)} must be an integer >= {_MINIMUM.get(field, 1)} "
                    f"of at most {_MAX_DIGITS} digits"
                )
            values[field] = int(value)
            remaining = rest.strip()
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_layout(cls, layout: ParallelLayout) -> LayoutSpec:
        """Every field of ``layout``; the sizes tp, pp and ep are always named.

        Its unset stage fields (``vpp``, first/last stage layers, ``pipeline_layout``) stay unnamed:
        with an unchanged pipeline size the source's stage assignment is kept, as with the flags.
        """
        return cls(**dataclasses.asdict(layout))

    @classmethod
    def coerce(cls, value: LayoutSpec | ParallelLayout | str) -> LayoutSpec:
        if isinstance(value, LayoutSpec):
            return value
        if isinstance(value, ParallelLayout):
            return cls.from_layout(value)
        if isinstance(value, str):
            return cls.parse(value)
        raise LayoutError(f"layout {value!r}: expected a ParallelLayout or text such as 'tp=2,pp=4'")

    def given(self) -> dict[str, int | str]:
        """The named fields, by ParallelLayout field name."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) is not None}

    def request_fields(self) -> dict[str, int | str]:
        """The named fields as ``ConvertRequest`` destination fields (``tp`` → ``dst_tp``)."""
        return {f"dst_{name}": value for name, value in self.given().items()}

    def describe(self) -> str:
        short = {field: key for key, field in reversed(list(_KEYS.items()))}
        parts = [f"{short[name]}={value}" for name, value in self.given().items()]
        return ",".join(parts)
