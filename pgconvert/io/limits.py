"""Resource limits on untrusted input, in one place, and the helpers that enforce them.

Every file pgconvert reads may be hostile or broken. A small file must not make it allocate or
loop without bound, so each kind of input has a named limit here, and every refusal names the
file, the limit and its value. Tensor data is never limited (it is read piece by piece, memory
mapped); what is limited is what pgconvert parses whole: pickles, JSON documents, headers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from itertools import accumulate
from pathlib import Path
from typing import Any

from pgconvert.errors import CheckpointError, PgconvertError

# The largest pickle pgconvert unpickles (a rank file's data.pkl, common.pt, .metadata, a legacy
# torch.save file's object part): real ones hold the args and the tensors' descriptions, a few MiB.
MAX_PICKLE_BYTES = 256 * 2**20
# The largest non-tensor record of a torch zip file (version, byteorder, ...): a few bytes each.
MAX_SMALL_RECORD_BYTES = 2**20
# The largest JSON document (config.json, an index, metadata.json, pgconvert.json).
MAX_JSON_BYTES = 64 * 2**20
# The deepest nesting of arrays and objects in a JSON document (real ones nest 3 or 4 levels).
MAX_JSON_DEPTH = 64
# The largest safetensors header (safetensors itself refuses more than 100 MB).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
# The largest tracker file (latest_checkpointed_iteration.txt holds a number or "release").
MAX_TRACKER_BYTES = 64
# The most missing rank files a message lists; a layout from args that needs more than this many
# beyond those present is refused by count before its rank names are enumerated.
MAX_LISTED_MISSING = 64
# The most characters a pipeline layout string (``Et*3|tL``) may expand to: one per layer, stage
# separator, embedding and loss; a million is far beyond any real model.
MAX_PIPELINE_LAYOUT_CHARS = 1_000_000
# The widest field an ``{iteration:...}`` placeholder of a batch plan may format (a path component).
MAX_PLACEHOLDER_WIDTH = 255
# The most decoder layers (or multi-token prediction layers) and routed experts per layer a
# checkpoint may declare, and the most routed experts over all its layers: beyond any real model
# (DeepSeek-V3: 61 layers, 256 experts, 15,616 routed experts), each also bounded by what is stored
# (pgconvert.model.counts).
MAX_LAYERS = 100_000
MAX_EXPERTS = 100_000
MAX_ROUTED_EXPERTS = 1_000_000
# The most characters of an untrusted value an error message quotes.
MAX_QUOTED_CHARS = 120
# The largest HF side file (tokenizer, chat template, configs) copied along; real tokenizer.json
# files are tens of MiB at most.
MAX_SIDE_FILE_BYTES = 512 * 2**20
# The most named chat templates (additional_chat_templates/*.jinja) taken from one folder.
MAX_SIDE_TEMPLATES = 256

def over_limit(path: Path | str, what: str, found: int, limit: str) -> CheckpointError:
    """The refusal of an input past the limit of that name (a constant of this module)."""
    return CheckpointError(f"{path}: {what} is {found}, over pgconvert's limit {limit}={globals()[limit]}")


# --------------------------------------------------------------------------- quoting values


def quote(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """A repr of an untrusted value for an error message, built in bounded time and space.

    Containers are walked only as far as the budget reaches (a pickle's shared references can make
    a tiny list of lists whose full repr would take exabytes); objects other than plain data are
    named by their type, never by their own ``__repr__``.
    """
    parts: list[str] = []
    _quote_into(value, parts, [limit + 1], depth=0)
    text = "".join(parts)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _quote_into(value: object, parts: list[str], budget: list[int], depth: int) -> None:
    if budget[0] <= 0:
        return
    if value is None or isinstance(value, (bool, float)):
        text = repr(value)
    elif isinstance(value, int):
        text = repr(value) if value.bit_length() <= 128 else f"<int of {value.bit_length()} bits>"
    elif isinstance(value, (str, bytes)):
        text = repr(value[: budget[0]]) + ("…" if len(value) > budget[0] else "")
    elif isinstance(value, (list, tuple, dict, set, frozenset)) and depth < 4:
        _quote_container(value, parts, budget, depth)
        return
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        text = f"<{type(value).__name__} of {len(value)}>"
    else:
        name = getattr(value, "qualified_name", None)
        text = f"<{name if isinstance(name, str) else type(value).__name__}>"
    parts.append(text)
    budget[0] -= len(text)


def _quote_container(value: Any, parts: list[str], budget: list[int], depth: int) -> None:
    opening, closing = {list: "[]", tuple: "()", dict: "{}"}.get(type(value), "{}")
    parts.append(opening)
    budget[0] -= 1
    items: Iterable[Any] = value.items() if isinstance(value, dict) else value
    for index, item in enumerate(items):
        if budget[0] <= 0:
            parts.append("…")
            break
        if index:
            parts.append(", ")
            budget[0] -= 2
        if isinstance(value, dict):
            _quote_into(item[0], parts, budget, depth + 1)
            parts.append(": ")
            budget[0] -= 2
            _quote_into(item[1], parts, budget, depth + 1)
        else:
            _quote_into(item, parts, budget, depth + 1)
    parts.append(closing)
    budget[0] -= 1


# --------------------------------------------------------------------------- JSON

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, found without parsing it."""
    brackets = _JSON_STRING.sub(b"", data).translate(None, delete=bytes(set(range(256)) - set(_BRACKET_STEP)))
    return max(accumulate(_BRACKET_STEP[byte] for byte in brackets), default=0)


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def parse_json(data: bytes, path: Path | str, error: type[PgconvertError] = CheckpointError) -> Any:
    """A JSON document from untrusted bytes: size and depth bounded first, duplicate keys refused."""
    if len(data) > MAX_JSON_BYTES:
        raise error(str(over_limit(path, "the JSON document's size in bytes", len(data), "MAX_JSON_BYTES")))
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise error(str(over_limit(path, "the JSON nesting depth", depth, "MAX_JSON_DEPTH")))
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as exc:
        raise error(f"{path}: the key {quote(str(exc))} appears twice in one JSON object") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise error(f"{path}: not valid JSON ({quote(str(exc), 200)})") from None


def read_config_bytes(path: Path, error: type[PgconvertError] = CheckpointError) -> bytes:
    """A small config file's bytes (JSON, YAML), read no further than one byte past ``MAX_JSON_BYTES`` (the caller
    refuses more)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise error(f"{path}: cannot be read: {exc.strerror or exc}") from exc


def read_json(path: Path, error: type[PgconvertError] = CheckpointError) -> Any:
    """``parse_json`` of a file, read no further than the size limit."""
    return parse_json(read_config_bytes(path, error), path, error)


# --------------------------------------------------------------------------- numbers


def require_finite(value: float, path: Path | str, name: str) -> float:
    if not math.isfinite(value):
        raise CheckpointError(f"{path}: {name}={value!r}: must be a finite number")
    return value
