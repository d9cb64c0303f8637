"""Quantized weights of HF checkpoints, read dequantized one tensor (or one region) at a time.

Two storage schemes are recognised by their tensors, whatever the family:

- **FP8 block-scaled** (DeepSeek-V3, ``quantization_config.quant_method = "fp8"``): a weight ``X``
  stored as ``float8_e4m3fn`` (or ``e5m2``) beside ``X_scale_inv`` (float32) holding one scale per
  ``weight_block_size`` = [rows, cols] block of the last two dims, edge blocks partial. The value
  is ``weight.float() * scale`` over each block, cast to bf16 (DeepSeek's own ``weight_dequant``) or to
  the ``--dtype`` asked for: one rounding of the float32 product, never through bf16.
- **MXFP4** (GPT-OSS, ``quant_method = "mxfp4"``): a tensor ``X`` stored as ``X_blocks`` (uint8
  [E, R, G, 16], two e2m1 values per byte, low nibble first) and ``X_scales`` (uint8 [E, R, G],
  E8M0 exponents with bias 127), 32 values per scale; ``X`` is [E, G*32, R] in bf16 (or the ``--dtype``
  asked for), as transformers' ``integrations/mxfp4.py: convert_moe_packed_tensors`` builds it. Each
  value is an e2m1 value times a power of two, which bf16 and float32 hold exactly (float16 only in
  its narrower range).

The HF loader sees the logical tensors (``X`` in the dequantized dtype) in place of their stored parts, so a family
table names ``X`` alone. ``--keep-fp8`` (HF -> HF) writes the stored parts unchanged instead.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy
import torch

from pgconvert.errors import CheckpointError, ValidationError
from pgconvert.formats.hf import read_tensor, read_tensor_range, tensor_range_region, tensor_region
from pgconvert.io.ranges import FileRegion
from pgconvert.io.limits import quote
from pgconvert.io.sizes import dtype_name
from pgconvert.io.reuse import new_tensor, nothing_lent
from pgconvert.io.threads import spread
from pgconvert.formats.stream import TensorMeta

if TYPE_CHECKING:
    from pgconvert.formats import Loader, Saver

log = logging.getLogger(__name__)

QUANTIZATION_CONFIG = "quantization_config"
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_BLOCKS_SUFFIX = "_blocks"
MXFP4_SCALES_SUFFIX = "_scales"
MXFP4_BYTES_PER_BLOCK = 16  # 32 e2m1 values, two per byte
E8M0_BIAS = 127
E8M0_NAN_CODE = 255
# The e2m1 value of each nibble (sign bit 3, exponent bits 2-1, mantissa bit 0).
FP4_E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                      -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The dtype quantized tensors are dequantized to when no --dtype is asked for.
DEQUANTIZED_DTYPE = torch.bfloat16
# Elements dequantized per step: the float32 temporaries stay this size whatever the tensor's.
STRIP_ELEMENTS = 2**22
# A dequantized dtype's values seen as integers of its width, for numpy (which has no bfloat16).
_BITS_OF: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                                            torch.float32: torch.int32, torch.float64: torch.int64}
# MXFP4 values dequantized per strip: a strip's float32 values (1 MiB) stay in cache for the transposing write.
MXFP4_STRIP_VALUES = 2**18


class QuantizationError(CheckpointError):
    """A quantized checkpoint whose weights and scales do not fit together."""


class ScaleShapeError(QuantizationError):
    """A scale tensor's shape is not its weight's block grid."""


class MissingScaleError(QuantizationError):
    """A quantized weight without its scale (or a scale without its weight)."""


class ScaleDtypeError(QuantizationError):
    """A scale tensor of a dtype the scheme does not use."""


class BlockSizeError(QuantizationError):
    """``quantization_config.weight_block_size`` is not two positive integers."""


class KeepQuantizedError(ValidationError):
    """``--keep-fp8`` for a conversion whose target cannot hold the quantized tensors."""


# --- plain dequantization ----------------------------------------------------------------------

def fp8_scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape of an FP8 weight of ``shape``: one per block of its last two dims."""
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def dequantize_fp8(weight: torch.Tensor | FileRegion, scale: torch.Tensor, block: tuple[int, int],
                   row0: int = 0, col0: int = 0, dtype: torch.dtype = DEQUANTIZED_DTYPE,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight.float() * scale`` over blocks, rounded once to ``dtype``, a strip of rows at a time.

    ``weight`` (a tensor, or its bytes in a file: each strip is then read on its own, so no buffer of
    the whole stored weight is faulted in) may be a window of a larger weight starting at row
    ``row0``, column ``col0`` of its last two dims; ``scale`` then starts at the block holding that
    corner. A strip lies in one block row: its values are, per column block, a table of the 256 codes'
    float32 values times that block's scale, rounded to ``dtype`` (the same product and rounding as
    element by element), and each code, offset by its column block's table, indexes them straight
    into ``out``: a new tensor, or the contiguous tensor of ``dtype`` and the weight's shape given (a part's place
    in a fused tensor), which is returned. The strips are spread over threads (``io.threads.spread``); the
    gathers are numpy's, on each thread.
    """
    shape = tuple(weight.shape)
    if out is None:
        out = new_tensor(shape, dtype)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"dequantize_fp8: out is {out.dtype} {list(out.shape)}, expected contiguous {dtype} "
                         f"{list(shape)}")
    if out.numel():
        strips = _Fp8Strips(weight, scale, block, row0, col0, out)
        with nothing_lent():  # a strip read on a helper thread never takes the record's memory
            spread(lambda index, count: strips.run(index, count))
    return out


class _Fp8Strips:
    """The strips of one FP8 dequantization (``dequantize_fp8``), each done by one thread."""

    def __init__(self, weight: torch.Tensor | FileRegion, scale: torch.Tensor, block: tuple[int, int], row0: int,
                 col0: int, out: torch.Tensor) -> None:
        rows, cols = out.shape[-2], out.shape[-1]
        self.lead = math.prod(out.shape[:-2])
        self.weight, self.cols = weight, cols
        self.bits = _BITS_OF[out.dtype]
        self.out = out.view(self.lead, rows, cols).view(self.bits).numpy()
        self.scales = scale.reshape(self.lead, scale.shape[-2], scale.shape[-1])
        self.dtype, self.values = out.dtype, _fp8_table(weight.dtype)
        tables = (col0 + cols - 1) // block[1] - col0 // block[1] + 1
        index_type = numpy.uint16 if tables * 256 <= 1 << 16 else numpy.int32
        self.offsets = ((numpy.arange(col0, col0 + cols) // block[1] - col0 // block[1]) * 256).astype(index_type)
        limit = max(1, STRIP_ELEMENTS // max(1, cols * self.lead))
        self.strips: list[tuple[int, int, int]] = []  # (first row, row past the last, block row)
        start = 0
        while start < rows:
            block_row = (row0 + start) // block[0] - row0 // block[0]
            stop = min(rows, start + limit, (block_row + row0 // block[0] + 1) * block[0] - row0)
            self.strips.append((start, stop, block_row))
            start = stop
        self.index_rows = min(rows, limit, block[0])

    def run(self, index: int, count: int) -> None:
        """Strips ``index``, ``index + count``, ...: each read, offset into its column blocks' tables, gathered."""
        if index >= len(self.strips):
            return
        indices = numpy.empty((self.lead, self.index_rows, self.cols), dtype=self.offsets.dtype)
        for start, stop, block_row in self.strips[index::count]:
            strip = _strip(self.weight, start, stop).view(torch.uint8).numpy().reshape(self.lead, stop - start, -1)
            codes = indices[:, :stop - start]
            numpy.add(strip, self.offsets, out=codes, dtype=codes.dtype)
            table = (self.values * self.scales[:, block_row, :, None]).to(self.dtype)
            values = table.view(self.bits).numpy().reshape(self.lead, -1)
            for item in range(self.lead):
                numpy.take(values[item], codes[item], out=self.out[item, start:stop], mode="wrap")


def _strip(weight: torch.Tensor | FileRegion, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the last-but-one dim of ``weight``, read from its file if it is a region."""
    if isinstance(weight, FileRegion):
        return weight.narrow(len(weight.shape) - 2, start, stop - start).read()
    return weight[..., start:stop, :]


def _column_blocks(col0: int, cols: int, width: int) -> list[tuple[int, int]]:
    """The column ranges of a window starting at column ``col0`` that fall in one scale block each."""
    spans, first = [], 0
    while first < cols:
        last = min(cols, ((col0 + first) // width + 1) * width - col0)
        spans.append((first, last))
        first = last
    return spans


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of an FP8 dtype's 256 codes."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized shape of MXFP4 blocks [E, R, G, 16]: [E, G * 32, R]."""
    experts, rows, groups, width = blocks_shape
    return (experts, groups * width * 2, rows)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = DEQUANTIZED_DTYPE) -> torch.Tensor:
    """MXFP4 blocks [E, R, G, 16] and E8M0 scales [E, R, G] as ``dtype`` [E, G * 32, R], a strip of rows at a time.

    Each byte holds two e2m1 values, the low nibble first: a table of the 256 bytes' value pairs gives
    both at once. Each group of 32 values is multiplied by 2 ** (scale - 127) from a table of the 256
    exponents (``torch.ldexp``'s own powers, so the same float32 products), rounded once to ``dtype``
    and written transposed into ``out`` a strip at a time (a whole-expert transposing copy runs at a
    third of the speed). A strip with the E8M0 NaN code 255 goes through ``torch.ldexp`` itself, which
    keeps zeros zero where the table's infinite power would make them NaN (transformers does the same).
    """
    experts, rows, groups, width = blocks.shape
    out = new_tensor(mxfp4_shape(tuple(blocks.shape)), dtype)
    if out.numel() == 0:
        return out
    step = max(1, MXFP4_STRIP_VALUES // (groups * width * 2))
    codes = torch.empty(step * groups * width, dtype=torch.int32)
    values = torch.empty(step * groups * width, 2, dtype=torch.float32)
    exponents = torch.empty(step * groups, dtype=torch.int32)
    for expert in range(experts):
        for first in range(0, rows, step):
            count = min(step, rows - first)
            strip_codes, strip_exponents = codes[:count * groups * width], exponents[:count * groups]
            strip_codes.view(count, groups, width).copy_(blocks[expert, first:first + count])
            strip_exponents.view(count, groups).copy_(scales[expert, first:first + count])
            strip = values[:count * groups * width]
            torch.index_select(_e2m1_pairs(), 0, strip_codes, out=strip)
            _scale_by_powers(strip.view(count, groups, width * 2), strip_exponents.view(count, groups, 1))
            out[expert, :, first:first + count].copy_(strip.view(count, groups * width * 2).T)
    return out


def _scale_by_powers(values: torch.Tensor, codes: torch.Tensor) -> None:
    """Multiply ``values`` in place by 2 ** (code - 127) for E8M0 ``codes`` (broadcast over the last dim)."""
    if int(codes.max()) == E8M0_NAN_CODE:
        torch.ldexp(values, codes - E8M0_BIAS, out=values)
        return
    values.mul_(torch.index_select(_e8m0_powers(), 0, codes.view(-1)).view(codes.shape))


@functools.cache
def _e2m1_pairs() -> torch.Tensor:
    """[256, 2] float32: the e2m1 values of each byte's low and high nibble."""
    nibbles = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([nibbles[codes & 0x0F], nibbles[codes >> 4]], dim=1).contiguous()


@functools.cache
def _e8m0_powers() -> torch.Tensor:
    """[256] float32: 2 ** (code - 127) for each E8M0 code, as ``torch.ldexp`` computes it."""
    return torch.ldexp(torch.ones(256, dtype=torch.float32), torch.arange(256, dtype=torch.int32) - E8M0_BIAS)


# --- the quantized tensors of one checkpoint ---------------------------------------------------

@dataclass(frozen=True)
class Quantized:
    """One logical tensor stored quantized: its stored data and scale tensors, and its dequantized meta."""

    name: str
    scheme: str  # "fp8" or "mxfp4"
    data: str
    scale: str
    meta: TensorMeta
    block: tuple[int, int] = (0, 0)  # fp8 only

    @property
    def parts(self) -> tuple[str, str]:
        return (self.data, self.scale)


def fp8_block_size(doc: dict[str, Any], config_path: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of a config.json, checked."""
    config = doc.get(QUANTIZATION_CONFIG)
    if not isinstance(config, dict):
        raise BlockSizeError(
            f"{config_path}: {QUANTIZATION_CONFIG}={quote(config)}: the checkpoint holds fp8 weights with "
            f"*{FP8_SCALE_SUFFIX} scales, and their block size must be given as "
            f"{QUANTIZATION_CONFIG}.weight_block_size")
    block = config.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in block)):
        raise BlockSizeError(
            f"{config_path}: {QUANTIZATION_CONFIG}.weight_block_size={quote(block)}: expected two positive "
            "integers [rows, cols] (DeepSeek-V3: [128, 128])")
    return (block[0], block[1])


def check_quant_method(doc: dict[str, Any], config_path: Path) -> str | None:
    """The ``quant_method`` of a config.json's quantization_config (None: there is none)."""
    config = doc.get(QUANTIZATION_CONFIG)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method not in ("fp8", "mxfp4"):
        raise QuantizationError(
            f"{config_path}: {QUANTIZATION_CONFIG}.quant_method={quote(method)}: pgconvert reads fp8 "
            "(block-scaled) and mxfp4 weights only")
    return str(method)


def _paired_scale(files: dict[str, Path], stored: dict[str, TensorMeta], name: str, scale: str,
                  dtype: torch.dtype, missing: str, needs: str) -> TensorMeta:
    """The stored scale tensor ``scale`` of the quantized tensor ``name``: present and of ``dtype``."""
    if scale not in stored:
        raise MissingScaleError(f"{files[name]}: {missing}")
    scale_meta = stored[scale]
    if scale_meta.dtype != dtype:
        raise ScaleDtypeError(f"{files[scale]}: {scale} has dtype {dtype_name(scale_meta.dtype)}; {needs}")
    return scale_meta


def _fp8_entries(doc: dict[str, Any], config_path: Path, files: dict[str, Path],
                 stored: dict[str, TensorMeta], dtype: torch.dtype) -> list[Quantized]:
    """Every fp8 weight with its float32 block scale, checked against the block grid."""
    weights = sorted(name for name, meta in stored.items() if meta.dtype in FP8_DTYPES)
    scales = sorted(name for name in stored if name.endswith(FP8_SCALE_SUFFIX))
    if not weights and not scales:
        return []
    block = fp8_block_size(doc, config_path)
    found = []
    for name in weights:
        meta, scale = stored[name], name + FP8_SCALE_SUFFIX
        scale_meta = _paired_scale(
            files, stored, name, scale, torch.float32,
            f"{name} is {dtype_name(meta.dtype)} {list(meta.shape)}, but its scale {scale} is not in the checkpoint; "
            "every fp8 weight needs its float32 block scales", f"the block scales of {name} must be float32")
        grid = fp8_scale_grid(meta.shape, block) if len(meta.shape) >= 2 else None
        if scale_meta.shape != grid:
            needs = f"needs {list(grid)}" if grid is not None else "cannot be block-scaled (fewer than 2 dims)"
            raise ScaleShapeError(
                f"{files[scale]}: {scale} has shape {list(scale_meta.shape)}; {name} {list(meta.shape)} in "
                f"blocks of {list(block)} (weight_block_size) {needs}")
        found.append(Quantized(name, "fp8", name, scale, TensorMeta(meta.shape, dtype), block))
    for scale in scales:
        weight = scale.removesuffix(FP8_SCALE_SUFFIX)
        if weight not in weights:
            what = f"stored as {dtype_name(stored[weight].dtype)}, not fp8" if weight in stored else "not in the checkpoint"
            raise MissingScaleError(f"{files[scale]}: {scale} scales {weight}, which is {what}")
    return found


def _mxfp4_entries(files: dict[str, Path], stored: dict[str, TensorMeta], dtype: torch.dtype) -> list[Quantized]:
    """Every uint8 ``X_blocks`` with its ``X_scales``, checked against each other."""
    found = []
    for name, meta in sorted(stored.items()):
        if not name.endswith(MXFP4_BLOCKS_SUFFIX) or meta.dtype != torch.uint8:
            continue
        base = name.removesuffix(MXFP4_BLOCKS_SUFFIX)
        scale = base + MXFP4_SCALES_SUFFIX
        scale_meta = _paired_scale(
            files, stored, name, scale, torch.uint8,
            f"{name} holds mxfp4 blocks {list(meta.shape)}, but its scales {scale} are not in the checkpoint",
            "mxfp4 scales are uint8 (E8M0 exponents)")
        if len(meta.shape) != 4 or meta.shape[-1] != MXFP4_BYTES_PER_BLOCK:
            raise QuantizationError(
                f"{files[name]}: {name} has shape {list(meta.shape)}; mxfp4 blocks are "
                f"[experts, rows, groups, {MXFP4_BYTES_PER_BLOCK}] (32 values in {MXFP4_BYTES_PER_BLOCK} bytes)")
        if scale_meta.shape != meta.shape[:-1]:
            raise ScaleShapeError(
                f"{files[scale]}: {scale} has shape {list(scale_meta.shape)}; the blocks {name} "
                f"{list(meta.shape)} need one scale per block: {list(meta.shape[:-1])}")
        if base in stored:
            raise QuantizationError(f"{files[base]}: {base} is stored both plain and as mxfp4 {name}")
        found.append(Quantized(base, "mxfp4", name, scale, TensorMeta(mxfp4_shape(meta.shape), dtype)))
    blocked = {entry.scale for entry in found}
    for name, meta in sorted(stored.items()):
        if name.endswith(MXFP4_SCALES_SUFFIX) and meta.dtype == torch.uint8 and name not in blocked:
            blocks = name.removesuffix(MXFP4_SCALES_SUFFIX) + MXFP4_BLOCKS_SUFFIX
            raise MissingScaleError(f"{files[name]}: {name} holds mxfp4 scales, but their blocks {blocks} are "
                                    "not in the checkpoint (or are not uint8)")
    return found


class QuantizedTensors:
    """The quantized tensors of one HF checkpoint, read by logical name, dequantized to ``dtype``
    (the ``--dtype`` asked for; bf16 by default), each value rounded once from its float32 product.

    ``keep`` (``--keep-fp8``): an hf target writes their stored parts unchanged (``stored_parts``,
    ``read_stored``) and keeps ``quantization_config``.
    """

    def __init__(self, entries: list[Quantized], files: dict[str, Path], stored: dict[str, TensorMeta],
                 keep: bool = False, dtype: torch.dtype = DEQUANTIZED_DTYPE) -> None:
        self.entries = {entry.name: entry for entry in entries}
        self.keep = keep
        self.dtype = dtype
        self._files = files
        self._stored = stored

    @classmethod
    def find(cls, doc: dict[str, Any], config_path: Path, files: dict[str, Path],
             stored: dict[str, TensorMeta], keep: bool = False,
             dtype: torch.dtype | None = None) -> QuantizedTensors:
        """``dtype``: what to dequantize to (None: bf16)."""
        check_quant_method(doc, config_path)
        dtype = DEQUANTIZED_DTYPE if dtype is None else dtype
        entries = _fp8_entries(doc, config_path, files, stored, dtype) + _mxfp4_entries(files, stored, dtype)
        return cls(entries, files, stored, keep, dtype)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __bool__(self) -> bool:
        return bool(self.entries)

    def logical(self) -> tuple[dict[str, Path], dict[str, TensorMeta]]:
        """The checkpoint's files and metas with each quantized tensor in place of its parts."""
        parts = {part for entry in self.entries.values() for part in entry.parts}
        files = {name: path for name, path in self._files.items() if name not in parts}
        metas = {name: meta for name, meta in self._stored.items() if name not in parts}
        for entry in self.entries.values():
            files[entry.name] = self._files[entry.data]
            metas[entry.name] = entry.meta
        return files, metas

    def read(self, name: str) -> torch.Tensor:
        """The whole logical tensor, dequantized."""
        entry = self.entries[name]
        scale = read_tensor(self._files[entry.scale], entry.scale)
        if entry.scheme == "fp8":
            return dequantize_fp8(tensor_region(self._files[entry.data], entry.data), scale, entry.block,
                                  dtype=self.dtype)
        return dequantize_mxfp4(read_tensor(self._files[entry.data], entry.data), scale, self.dtype)

    def read_range_into(self, name: str, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        """``read_range`` into ``out`` (of the range's elements): a contiguous ``out`` of a 2-d fp8 weight's rows
        or columns is dequantized straight into, as is each row block of an ``out`` [blocks, rows, ...] whose blocks
        lie apart (a fused QKV's rows, by query group); anything else is read and copied."""
        if dim == 0 and out.dim() == 3 and not out.is_contiguous() and out[0].is_contiguous():
            step = out.shape[1]  # rows of the range that land apart (a query group's rows of a fused QKV)
            for group in range(out.shape[0]):
                self.read_range_into(name, 0, start + group * step, start + (group + 1) * step, out[group])
            return
        entry = self.entries[name]
        shape = list(entry.meta.shape)
        if stop > start and 0 <= dim < 2:
            shape[dim] = stop - start
        if (entry.scheme != "fp8" or len(shape) != 2 or not stop > start or not out.is_contiguous()
                or out.dtype != self.dtype or out.numel() != math.prod(shape)):
            out.copy_(self.read_range(name, dim, start, stop).view(out.shape))
            return
        self.read_range(name, dim, start, stop, out=out.view(shape))

    def read_range(self, name: str, dim: int, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Indices ``[start, stop)`` of ``dim`` of the logical tensor, reading only the parts they need
        where the layout allows (fp8: rows or columns of a 2-d weight, dequantized into ``out`` when given; mxfp4:
        experts)."""
        entry = self.entries[name]
        ndim = len(entry.meta.shape)
        windowed = stop > start and ((entry.scheme == "fp8" and ndim == 2) or (entry.scheme == "mxfp4" and dim == 0))
        if not windowed:
            assert out is None, "only a 2-d fp8 weight's window is dequantized into a given tensor"
            return self.read(name).narrow(dim, start, stop - start).contiguous()
        if entry.scheme == "mxfp4":
            assert out is None, "only a 2-d fp8 weight's window is dequantized into a given tensor"
            data = read_tensor_range(self._files[entry.data], entry.data, dim, start, stop)
            return dequantize_mxfp4(data, read_tensor_range(self._files[entry.scale], entry.scale, 0, start, stop),
                                    self.dtype)
        size = entry.block[dim]
        scale = read_tensor_range(self._files[entry.scale], entry.scale, dim, start // size, (stop - 1) // size + 1)
        data = tensor_range_region(self._files[entry.data], entry.data, dim, start, stop)
        return dequantize_fp8(data, scale, entry.block, row0=start if dim == 0 else 0, col0=start if dim == 1 else 0,
                              dtype=self.dtype, out=out)

    def stored_parts(self, name: str) -> tuple[tuple[str, TensorMeta], ...]:
        """The stored tensors (data, scale) that make up ``name``, as ``--keep-fp8`` writes them."""
        return tuple((part, self._stored[part]) for part in self.entries[name].parts)

    def read_stored(self, part: str) -> torch.Tensor:
        """One stored part, unchanged."""
        return read_tensor(self._files[part], part)

    def notice(self, where: Path) -> str | None:
        """What reading them does, for the conversion's notices (None: nothing is quantized)."""
        if not self.entries:
            return None
        counts = {scheme: sum(entry.scheme == scheme for entry in self.entries.values()) for scheme in ("fp8", "mxfp4")}
        what = " and ".join(f"{count} {scheme}" for scheme, count in counts.items() if count)
        if self.keep:
            return f"{where}: {what} quantized tensors are written unchanged with their scales (--keep-fp8)"
        return (f"{where}: {what} quantized tensors are dequantized to {dtype_name(self.dtype)} while reading (each "
                f"value rounded once from its float32 scaled product); an hf target's config.json drops {QUANTIZATION_CONFIG} "
                "(--keep-fp8 keeps them quantized for an hf target)")


def without_quantization(doc: dict[str, Any], where: str) -> tuple[dict[str, Any], str | None]:
    """A copy of a config.json without ``quantization_config``, and a notice when there was one."""
    if QUANTIZATION_CONFIG not in doc:
        return doc, None
    updated = copy.deepcopy(doc)
    method = updated.pop(QUANTIZATION_CONFIG)
    method = method.get("quant_method") if isinstance(method, dict) else method
    return updated, (f"{where}: {QUANTIZATION_CONFIG} (quant_method={quote(method)}) is dropped from the written "
                     "config.json: its weights are written dequantized")



def check_keep_fp8(loader: Loader, saver: Saver) -> None:
    """``--keep-fp8`` keeps quantized tensors only between formats that hold them (``keeps_quantized``: hf ->
    hf): Megatron and torch_dist checkpoints hold plain tensors, with no place for block scales."""
    if not (loader.keeps_quantized and saver.keeps_quantized):
        raise KeepQuantizedError(
            f"--keep-fp8: converting {loader.name} -> {saver.name}; the quantized tensors and their scales can be "
            "kept only from an hf source to an hf target (hf -> hf); a megatron or torch_dist target holds "
            "bf16 weights: convert without --keep-fp8 to dequantize them")
