"""The ``pgconvert`` command line: argument parsing and output only; no conversion logic."""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from pgconvert.version import __version__
from pgconvert.errors import PgconvertError
from pgconvert.formats.names import (COMMON_IN_STORE, COMMON_PLACES, DEFAULT_DIGEST, DIGEST_CHOICES, DTYPE_NAMES,
                                     EXPERT_LAYOUTS, loader_names, saver_names)
from pgconvert.model.config import MTP_LAYER_MODULES

if TYPE_CHECKING:
    from pgconvert.run.convert import ConvertRequest, Plan

# Only what --help, --version and argument errors need is imported above (no torch): each command
# imports the library when it runs.


class PgconvertClickError(click.ClickException):
    """A library error shown as one line, with the library's exit code (2 validation, 1 failure)."""

    def __init__(self, error: PgconvertError) -> None:
        super().__init__(str(error))
        self.exit_code = error.exit_code


def _format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ByteSize(click.ParamType):
    """A byte count such as ``5GB`` (decimal, as transformers counts), ``2GiB`` or ``1000000``."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            count = float(number) * _SIZE_UNITS[unit]
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a size (e.g. 5GB, 500MB, 2GiB, 1000000)", param, ctx)
        if not math.isfinite(count):
            self.fail(f"{value!r} is not a finite size (e.g. 5GB, 500MB, 2GiB, 1000000)", param, ctx)
        if count < 1:
            self.fail(f"{value!r} must be at least one byte", param, ctx)
        return int(count)


class Interrupted(click.ClickException):
    """Ctrl-C (or SIGTERM) anywhere in a command: one line and exit 130, never a traceback."""

    exit_code = 130

    def __init__(self) -> None:
        super().__init__("interrupted: no output was left behind")

    def show(self, file: Any = None) -> None:
        click.echo(self.message, err=True)


class ConvertByDefault(click.Group):
    """``pgconvert SRC DST`` runs ``convert``; ``pgconvert example …`` runs a subcommand."""

    default_command = "convert"

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        elif not args:
            args = ["--help"]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage("pgconvert", "[OPTIONS] SRC DST\n       pgconvert COMMAND [ARGS]...")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        command = self.commands[self.default_command]
        # A child of ctx: it inherits -h, which click caches as the command's help option on first use.
        with click.Context(command, info_name="pgconvert", parent=ctx) as sub_ctx:
            command.format_options(sub_ctx, formatter)
        self.format_commands(ctx, formatter)


@click.group(cls=ConvertByDefault, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pgconvert")
def main() -> None:
    """Reshard a checkpoint between tensor/pipeline/expert-parallel layouts and formats
    (megatron per-rank, torch_dist, Megatron-FSDP fsdp_dtensor, hf), on the CPU.

    SRC is read, DST is written complete or not at all. Every rank of both layouts is played in
    this one process on fake process groups: no GPU, no torch.distributed job, no training framework.

    Example: pgconvert --dst-tp 2 ckpt_tp8/ ckpt_tp2/
    """
    _idle_threads_sleep()


def _idle_threads_sleep() -> None:
    """OpenMP worker threads that sleep when idle rather than spin: a conversion runs short parallel kernels
    (finiteness checks, casts) between reads and writes, and spinning workers burn CPU time for nothing.
    No BLAS threads at all: nothing here multiplies matrices, and OpenBLAS's idle workers poll. Set before
    torch loads (no command imports it before this), and only where the user has not chosen."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


GC_YOUNG_THRESHOLD = 20_000


def _settle_imports() -> None:
    """Move everything imported so far out of the garbage collector's sight (``gc.freeze``): the modules,
    classes and functions of torch and the library are never garbage, and a conversion's allocations
    would otherwise have the collector walk them again and again. The youngest generation is collected
    every ``GC_YOUNG_THRESHOLD`` allocations rather than 700: a conversion makes many short-lived tuples and
    few cycles."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


HelpSections = Sequence[tuple[str, Sequence[str]]]

# convert's --help: the options most runs need first, the rest under a heading each. Every option of
# the command is named here exactly once (by its long name); SectionedCommand refuses anything else.
CONVERT_HELP_SECTIONS: HelpSections = (
    ("Common options", ("--dst-format", "--dst-tp", "--dst-pp", "--dst-ep", "--iteration", "--dtype", "--dry-run",
                        "--overwrite", "--quiet", "--verbose", "--help")),
    ("Layout", ("--dst-vpp", "--dst-decoder-first-pipeline-num-layers", "--dst-decoder-last-pipeline-num-layers",
                "--dst-pipeline-layout", "--dst-expert-tp")),
    ("Source", ("--src-format", "--src-tp", "--src-pp", "--src-ep", "--true-vocab-size", "--text-only")),
    ("Naming", ("--dst-transformer-impl", "--dst-expert-layout", "--dst-mtp-layer-name", "--dst-torch-dist-common")),
    ("Output files", ("--max-shard-size", "--digest")),
    ("HF output", ("--hf-config", "--generation-config", "--tokenizer", "--keep-fp8")),
    ("Adapters", ("--merge-adapter", "--drop-adapter")),
    ("Optimizer state", ("--skip-optimizer", "--dst-dp", "--dst-optim-form")),
    ("Safety", ("--strict", "--check-finite", "--skip-finite-check", "--verify-integrity")),
    ("Scale-out", ("--threads", "--workers", "--max-memory", "--shard-index", "--num-shards")),
)
# Options click adds to every command itself; a section may place them.
_IMPLICIT_OPTIONS = ("--help",)
_HELP_TERM_WIDTH = 30  # click's default widest option column


def option_key(option: click.Parameter) -> str:
    """The name an option is placed by in a help section: its first long name (``--quiet`` for ``-q, --quiet``)."""
    return next((opt for opt in option.opts if opt.startswith("--")), option.opts[0])


def check_help_sections(command_name: str, sections: HelpSections, options: Sequence[click.Parameter]) -> None:
    """Every option in exactly one section, and every placed name an option of the command."""
    placed = [name for _, names in sections for name in names]
    keys = [option_key(option) for option in options]
    twice = sorted({name for name in placed if placed.count(name) > 1})
    unplaced = [key for key in keys if key not in placed]
    unknown = [name for name in placed if name not in keys and name not in _IMPLICIT_OPTIONS]
    if twice or unplaced or unknown:
        raise ValueError(f"{command_name}: help sections must place every option once: not placed {unplaced}, "
                         f"placed twice {twice}, not an option {unknown}")


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options under headings, in the order ``sections`` declares.

    ``sections`` is ``(heading, (option long names, ...))`` pairs; an option of the command that no
    section places (or places twice) is an error when the command is defined.
    """

    def __init__(self, *args: Any, sections: HelpSections, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sections = tuple((heading, tuple(names)) for heading, names in sections)
        check_help_sections(self.name or "command", self.sections, self._options(self.params))

    @staticmethod
    def _options(params: Sequence[click.Parameter]) -> list[click.Parameter]:
        return [param for param in params if isinstance(param, click.Option)]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        options = {option_key(option): option for option in self._options(self.get_params(ctx))}
        sections = []
        for heading, names in self.sections:
            records = [options[name].get_help_record(ctx) for name in names if name in options]
            sections.append((heading, [record for record in records if record is not None]))
        # One column for the help texts of every section (click sizes each list on its own).
        width = min(max((len(term) for _, rows in sections for term, _ in rows), default=0), _HELP_TERM_WIDTH)
        for heading, rows in sections:
            if rows:
                with formatter.section(heading):
                    formatter.write_dl([(term.ljust(width), text) for term, text in rows], col_max=_HELP_TERM_WIDTH)


def _layout_option(name: str, help_text: str) -> Any:
    return click.option(name, type=click.IntRange(min=1), default=None, help=help_text)


@main.command("convert", cls=SectionedCommand, sections=CONVERT_HELP_SECTIONS)
@click.argument("src", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--src-format", type=click.Choice(["auto", *loader_names()]), default="auto", show_default=True,
              help="Format of SRC.")
@click.option("--dst-format", type=click.Choice(["same", *saver_names()]), default="same", show_default=True,
              help="Format of DST (default: the source's).")
@_layout_option("--src-tp", "Expected source tensor-parallel size (checked against the checkpoint).")
@_layout_option("--src-pp", "Expected source pipeline-parallel size (checked against the checkpoint).")
@_layout_option("--dst-tp", "Destination tensor-parallel size [default: the source's].")
@_layout_option("--dst-pp", "Destination pipeline-parallel size [default: the source's].")
@click.option("--dst-decoder-first-pipeline-num-layers", type=click.IntRange(min=0), default=None,
              help="Layers on the first pipeline stage (uneven PP); the rest split evenly.")
@click.option("--dst-decoder-last-pipeline-num-layers", type=click.IntRange(min=0), default=None,
              help="Layers on the last pipeline stage (uneven PP); the rest split evenly.")
@_layout_option("--src-ep", "Expected source expert-parallel size (checked against the checkpoint).")
@_layout_option("--dst-ep", "Destination expert-parallel size: EP rank r holds experts [r·E/ep, (r+1)·E/ep).")
@_layout_option("--dst-expert-tp", "Destination expert tensor-parallel size [default: --dst-tp].")
@_layout_option("--dst-vpp", "Destination virtual pipeline size: model chunks per stage (model0, model1, …).")
@click.option("--dst-pipeline-layout", default=None, metavar="LAYOUT",
              help="Destination pipeline_model_parallel_layout string, e.g. 'Ettt|tttt|tttt|tttL'.")
@click.option("--dst-transformer-impl", type=click.Choice(["local", "transformer_engine"]), default=None,
              help="Megatron key naming of DST: local spec or Transformer-Engine spec [default: the source's].")
@click.option("--dst-expert-layout", type=click.Choice(list(EXPERT_LAYOUTS)), default=None,
              help="Expert key layout of DST: SequentialMLP (local_experts.{j}) or grouped GEMM (weight{j}).")
@click.option("--iteration", type=click.IntRange(min=0), default=None,
              help="Source iteration to convert [default: latest_checkpointed_iteration.txt].")
@click.option("--true-vocab-size", type=click.IntRange(min=1), default=None,
              help="Tokenizer vocab size, to strip padding rows and re-pad for the target.")
@click.option("--dtype", type=click.Choice(list(DTYPE_NAMES)), default="keep", show_default=True,
              help="Cast floating-point tensors; a Megatron run's optimizer state is carried, its weights "
                   "re-derived from the fp32 masters.")
@click.option("--max-shard-size", type=ByteSize(), default=None, metavar="SIZE",
              help="Largest safetensors shard of an hf DST, and largest data file (tensor bytes) of a torch_dist "
                   "DST, e.g. 5GB (default), 500MB, 2GiB.")
@click.option("--hf-config", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="config.json for DST (megatron/torch_dist: hf/config.json) instead of the carried one "
                   "or one built from the model; it must describe the model.")
@click.option("--generation-config", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="generation_config.json for DST (hf: beside the weights; megatron/torch_dist: in hf/).")
@click.option("--tokenizer", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              metavar="DIR", help="Folder whose tokenizer files and chat templates DST gets instead of the source's.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Threads writing independent destination files at once in each process (megatron rank files, "
                   "hf shards); each holds one more tensor and 32 MiB of write buffers in memory.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes writing independent destination files (megatron DST).")
@click.option("--max-memory", type=ByteSize(), default=None, metavar="SIZE",
              help="With --workers: bytes of destination files held in memory at once, e.g. 8GB.")
@click.option("--shard-index", type=click.IntRange(min=0), default=None,
              help="Write only share I of --num-shards (a Slurm array task, a script); the last "
                   "share to finish renames the output into place. Under torchrun, RANK is used.")
@click.option("--num-shards", type=click.IntRange(min=1), default=None, help="Number of shares; see --shard-index.")
@click.option("--strict", is_flag=True,
              help="Refuse wherever pgconvert would otherwise guess (unknown true vocab, dropped "
                   "_extra_state, a lossy --dtype, …); without it each guess is a warning.")
@click.option("--keep-fp8", is_flag=True,
              help="hf -> hf: write FP8 block-scaled (and MXFP4) weights and their scales unchanged and keep "
                   "quantization_config (default: dequantize them to bf16).")
@click.option("--check-finite", "finite_mode", flag_value="error",
              help="Refuse tensors holding NaN or Inf (by default they are converted with a warning).")
@click.option("--skip-finite-check", "finite_mode", flag_value="off", help="Do not scan tensors for NaN/Inf.")
@click.option("--digest", type=click.Choice(DIGEST_CHOICES), default=DEFAULT_DIGEST, show_default=True,
              help="What pgconvert.json records of each written file besides its size, computed as it is written "
                   "(verify and batch --verify-hashes check it): xxh3-128 (about 0.05 CPU-seconds per GiB; finds "
                   "any corruption or change, not made to resist forgery), sha256 (cryptographic, about 0.6 "
                   "CPU-seconds per GiB) or none (sizes only; verify still compares every tensor). With sha256, a "
                   "torch_dist output in megatron-core 0.19's form also gets the integrity.json that Megatron-LM's "
                   "--verify-integrity requires (as it does when the source has one).")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (each destination file: tensors, bytes, optimizer state carried); write nothing.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty DST (only once the new one is complete).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no notices.")
@click.option("-v", "--verbose", is_flag=True, help="Log details to stderr.")
@click.option("--skip-optimizer", is_flag=True,
              help="Convert the model alone. By default megatron-core's optimizer state (fp32 masters, Adam "
                   "moments), scheduler and counters are resharded from a Megatron source (per-rank or "
                   "torch_dist) into a Megatron DST (RNG state never is).")
@click.option("--dst-dp", type=click.IntRange(min=1), default=None,
              help="Data-parallel size the carried optimizer state is written for (args.data_parallel_size, "
                   "world_size); distrib_optim.pt stays one per model-parallel rank, as Megatron-LM reads it.")
@click.option("--dst-optim-form", type=click.Choice(["fully_reshardable", "dp_reshardable", "fully_sharded_model_space"]),
              default=None,
              help="torch_dist DST: the distributed optimizer's form (default: a torch_dist source's own, else "
                   "fully_reshardable); dp_reshardable is cut for --dst-dp ranks; fully_sharded_model_space is for "
                   "megatron-core 0.15.0 and older; a layer-wise (Muon or Lion) run's: one of the first two.")
@click.option("--dst-mtp-layer-name", type=click.Choice(list(MTP_LAYER_MODULES)), default=None,
              help="Megatron per-rank DST: the MTP layer's inner-layer key, transformer_layer (megatron-core 0.16.1) or "
                   "mtp_model_layer (newer Megatron-LM) [default: the source's, else transformer_layer].")
@click.option("--dst-torch-dist-common", type=click.Choice(COMMON_PLACES), default=COMMON_IN_STORE, show_default=True,
              help="torch_dist DST: the common state (args, iteration, optimizer param groups) inside the checkpoint, "
                   "as megatron-core 0.19+ writes it (store; with --digest sha256 also its integrity.json), or in "
                   "common.pt, which every megatron-core reads (legacy: use it for megatron-core 0.18 and older).")
@click.option("--merge-adapter", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              metavar="DIR", help="Merge a Hugging Face PEFT LoRA adapter (adapter_config.json, "
                                  "adapter_model.safetensors) or a Megatron-Bridge LoRA checkpoint into the model: "
                                  "W + (B @ A) * alpha / r in float32, rounded once to the weight's dtype, at any DST "
                                  "layout; SRC itself when it holds a LoRA adapter beside its model.")
@click.option("--drop-adapter", is_flag=True,
              help="A Megatron-Bridge checkpoint that holds a LoRA adapter beside its model: convert the base model "
                   "alone, the adapter left out with a notice (without it such a SRC is refused; --merge-adapter SRC "
                   "merges the adapter, export-adapter takes it out).")
@click.option("--text-only", is_flag=True,
              help="A vision-language source: convert its language model alone (hf: written as the text model's "
                   "own architecture and config); what is left out (vision tower, projector, processor files) is "
                   "named in a notice.")
@click.option("--verify-integrity", is_flag=True,
              help="A torch_dist SRC with an integrity.json: re-hash every file it lists, the data files too (about "
                   "0.6 CPU-seconds per GiB; as Megatron-LM's --verify-integrity). By default its small files are "
                   "re-hashed and its data files only required to be there; verify always re-hashes them all.")
def convert_command(src: Path, dst: Path, src_format: str, dst_format: str, src_tp: int | None,
                    src_pp: int | None, dst_tp: int | None, dst_pp: int | None,
                    dst_decoder_first_pipeline_num_layers: int | None,
                    dst_decoder_last_pipeline_num_layers: int | None, src_ep: int | None,
                    dst_ep: int | None, dst_expert_tp: int | None, dst_vpp: int | None,
                    dst_pipeline_layout: str | None, dst_transformer_impl: str | None,
                    dst_expert_layout: str | None, iteration: int | None,
                    true_vocab_size: int | None, dtype: str, max_shard_size: int | None,
                    hf_config: Path | None, generation_config: Path | None, tokenizer: Path | None,
                    threads: int, workers: int, max_memory: int | None,
                    shard_index: int | None, num_shards: int | None, strict: bool, finite_mode: str | None,
                    digest: str, dry_run: bool, overwrite: bool,
                    quiet: bool, verbose: bool, keep_fp8: bool = False, skip_optimizer: bool = False,
                    dst_dp: int | None = None, dst_optim_form: str | None = None,
                    dst_mtp_layer_name: str | None = None, dst_torch_dist_common: str = "store",
                    merge_adapter: Path | None = None, drop_adapter: bool = False, text_only: bool = False,
                    verify_integrity: bool = False) -> None:
    """Convert SRC into DST (the default command)."""
    from pgconvert.run.convert import ConvertRequest

    _settle_imports()
    _configure_logging(quiet, verbose)
    request = ConvertRequest(
        src=src, dst=dst,
        src_format=None if src_format == "auto" else src_format,
        dst_format=None if dst_format == "same" else dst_format,
        src_tp=src_tp, src_pp=src_pp, dst_tp=dst_tp, dst_pp=dst_pp,
        dst_first_stage_layers=dst_decoder_first_pipeline_num_layers,
        dst_last_stage_layers=dst_decoder_last_pipeline_num_layers,
        src_ep=src_ep, dst_ep=dst_ep, dst_expert_tp=dst_expert_tp, dst_vpp=dst_vpp,
        dst_pipeline_layout=dst_pipeline_layout,
        dst_transformer_impl=dst_transformer_impl, dst_expert_layout=dst_expert_layout,
        iteration=iteration, true_vocab_size=true_vocab_size, dtype=dtype, overwrite=overwrite,
        strict=strict, check_finite=finite_mode or "warn", digest=digest,
        max_shard_size=max_shard_size, hf_config=hf_config, threads=threads, workers=workers,
        max_memory=max_memory, generation_config=generation_config, tokenizer=tokenizer,
        keep_fp8=keep_fp8, skip_optimizer=skip_optimizer, dst_dp=dst_dp, dst_optim_form=dst_optim_form,
        dst_mtp_layer_name=dst_mtp_layer_name, dst_torch_dist_common=dst_torch_dist_common,
        merge_adapter=merge_adapter, drop_adapter=drop_adapter, text_only=text_only, verify_integrity=verify_integrity)
    try:
        shard = _shard_of_this_process(shard_index, num_shards)
        if shard is not None and not dry_run:
            _run_shard(request, *shard, quiet=quiet)
            return
        from pgconvert.optimizer.plan import plan_lines
        from pgconvert.run.convert import plan

        conversion = plan(request)
        if dry_run:
            try:
                optimizer_lines = plan_lines(conversion)  # the optimizer state it carries
            finally:
                conversion.source.close()
            _print_plan(conversion)
            for line in optimizer_lines:
                click.echo(line)
            return
        _run_with_progress(conversion, quiet)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error


def _shard_of_this_process(shard_index: int | None, num_shards: int | None) -> tuple[int, int, str] | None:
    """(index, count, coordinator) for a sharded run; None for an ordinary one."""
    from pgconvert.errors import ValidationError
    from pgconvert.run.sharded import launcher_shard

    if (shard_index is None) != (num_shards is None):
        raise ValidationError("--shard-index and --num-shards: give both or neither")
    if shard_index is not None and num_shards is not None:
        return shard_index, num_shards, "files"
    launched = launcher_shard()
    return (launched[0], launched[1], "store") if launched else None


def _run_shard(request: ConvertRequest, index: int, count: int, coordinator: str, quiet: bool) -> None:
    from pgconvert.run.sharded import convert_shard

    outcome = convert_shard(request, index, count, coordinator)
    written = sum(item.nbytes for item in outcome.result.files)
    click.echo(f"shard {index}/{count}: wrote {len(outcome.result.files)} files, {_format_bytes(written)}")
    if outcome.finalized:
        if not quiet:
            for notice in dict.fromkeys(outcome.conversion.source.notices + outcome.result.notices):
                click.echo(f"note: {notice}", err=True)
        click.echo(f"wrote {request.dst} ({outcome.conversion.dst_format} "
                   f"{outcome.conversion.save_options.layout.describe()}): every share is complete")


def _print_plan(conversion: Plan) -> None:
    from pgconvert.io.output import OUTPUT_STAGING_BYTES

    click.echo(
        f"plan: {conversion.src_format} {conversion.src_layout.describe() if conversion.src_layout else ''}"
        f" -> {conversion.dst_format} {conversion.save_options.layout.describe()}"
    )
    for item in conversion.files:
        click.echo(f"  {item.relpath}  {item.tensors} tensors  {item.nbytes} bytes ({_format_bytes(item.nbytes)})")
    click.echo(f"total: {len(conversion.files)} files, {_format_bytes(conversion.total_bytes)}")
    at_once, together = conversion.files_at_once, conversion.files_together
    largest = _format_bytes(conversion.largest_tensor)
    records = 1 + conversion.saver.records_in_flight
    tensors = (f"its largest tensor ({largest})" if records == 1 else
               f"{records} tensors as large as its largest ({largest}; one is written while the next is made)")
    held = (f"each up to {tensors} and {_format_bytes(OUTPUT_STAGING_BYTES)} of write buffers"
            if together == 1 else
            f"in groups of {together} (a TP group's rank files, sharing the reads of the tensors their pieces are "
            f"cut from), each group up to twice the largest tensor ({largest}) and one file's write buffers")
    click.echo(f"memory in flight: {at_once} file{'s' if at_once > 1 else ''} at once, {held}: "
               f"{_format_bytes(conversion.memory_in_flight)}")


def _run_with_progress(conversion: Plan, quiet: bool) -> None:
    from tqdm import tqdm

    from pgconvert.run.convert import execute

    previous = signal.getsignal(signal.SIGTERM)

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    bar = tqdm(total=conversion.total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               desc="converting", file=sys.stderr, disable=quiet, dynamic_ncols=True)
    try:
        report = execute(conversion, progress=bar.update)
    except KeyboardInterrupt:
        bar.close()
        click.echo("interrupted: no output was left behind", err=True)
        sys.exit(130)
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, previous)
    if not quiet:
        for notice in report.notices:
            click.echo(f"note: {notice}", err=True)
    click.echo(
        f"wrote {report.dst} ({report.dst_format} {report.dst_layout}): {len(report.files)} files, "
        f"{_format_bytes(report.total_bytes)} in {report.seconds:.1f}s"
    )


def _configure_logging(quiet: bool, verbose: bool) -> None:
    level = logging.DEBUG if verbose else (logging.ERROR if quiet else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@main.command("example")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--tp", type=click.IntRange(min=1), default=8, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty OUT.")
def example_command(out: Path, tp: int, pp: int, seed: int, overwrite: bool) -> None:
    """Write a tiny seeded Megatron checkpoint (GQA, SwiGLU, padded vocab) to OUT."""
    from pgconvert.run.convert import check_destination, staged_output
    from pgconvert.run.example import example_source
    from pgconvert.formats import SaveOptions
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.formats.registry import get_saver

    try:
        source = example_source(seed=seed)
        saver = get_saver("megatron")
        options = SaveOptions(layout=ParallelLayout(tp=tp, pp=pp))
        # Named as this command's own options (--tp), not convert's (--dst-tp).
        options.layout.validate(source.config, "--")
        saver.validate(source, options)
        check_destination(out, overwrite)
        with staged_output(out, overwrite) as staging:
            result = saver.save(source, staging, options, lambda nbytes: None)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error
    click.echo(f"wrote example megatron checkpoint {out} (tp={tp}, pp={pp}): {len(result.files)} rank files")


class LayoutParamType(click.ParamType):
    """``tp=2,pp=4,ep=8`` as a ``LayoutSpec``; a malformed value fails with the value quoted."""

    name = "layout"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from pgconvert.model.layout_spec import LayoutSpec

        if isinstance(value, LayoutSpec):
            return value
        try:
            return LayoutSpec.parse(value)
        except PgconvertError as error:
            self.fail(str(error), param, ctx)


LAYOUT = LayoutParamType()


def _echo_json(doc: object) -> None:
    import json

    click.echo(json.dumps(doc, indent=2))


@main.command("export-optimizer")
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--iteration", type=click.IntRange(min=0), default=None,
              help="Iteration to open [default: latest_checkpointed_iteration.txt].")
def export_optimizer_command(src: Path, out: Path, iteration: int | None) -> None:
    """Write the optimizer state of Megatron per-rank, torch_dist or fsdp_dtensor SRC into OUT,
    layout-independent: one <canonical name>.pt per parameter (fp32 master 'param', 'exp_avg', 'exp_avg_sq',
    'step'), written one parameter at a time, and optimizer.json (groups, scheduler, iteration, counters)."""
    from pgconvert.optimizer.export import export_from_path

    try:
        count = export_from_path(src, out, iteration)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error
    click.echo(f"wrote {out}: optimizer state of {count} parameters")


@main.command("export-adapter")
@click.argument("src", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--base", type=click.Path(path_type=Path, exists=True), default=None, metavar="CKPT",
              help="The base model the adapter was trained on, any format pgconvert reads (a Megatron or torch_dist "
                   "checkpoint, an HF directory): it gives the family the adapter is named for and the shapes it is "
                   "checked against [default: SRC, when it holds the adapter beside its model].")
@click.option("--iteration", type=click.IntRange(min=0), default=None,
              help="Iteration of --base to open [default: latest_checkpointed_iteration.txt].")
def export_adapter_command(src: Path, dst: Path, base: Path | None, iteration: int | None) -> None:
    """Write the LoRA adapter SRC into DST, unmerged, in the other form, for the model --base: a Megatron-Bridge LoRA
    checkpoint (a LoRA run's torch_dist store of adapter weights and run_config.yaml, any TP) as a Hugging Face PEFT
    adapter directory (adapter_config.json, adapter_model.safetensors: fused linear_qkv and linear_fc1 pairs become
    q/k/v and gate/up pairs sharing lora_A, r = dim, lora_alpha = alpha), or a PEFT adapter directory as a
    Megatron-Bridge checkpoint megatron-core loads at any TP. A Megatron-Bridge checkpoint that holds the model too
    (the wrapped model saved whole) is its own base. DST must not exist; nothing is written when the adapter does not
    fit --base or has no exact form in the other."""
    from pgconvert.run.adapter_export import export_adapter

    try:
        written = export_adapter(src, dst, base, iteration)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error
    click.echo(f"wrote {dst}: {written.pairs} LoRA pairs ({written.form})")


@main.command("inspect")
@click.argument("ckpt", type=click.Path(path_type=Path, exists=True))
@click.option("--iteration", type=click.IntRange(min=0), default=None,
              help="Iteration to open [default: latest_checkpointed_iteration.txt].")
@click.option("--all", "show_all", is_flag=True,
              help="List every model setting, not only those that differ from the family's defaults.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--skip-finite-check", is_flag=True,
              help="Do not read the optimizer state's values for NaN/Inf (its other checks still run).")
def inspect_command(ckpt: Path, iteration: int | None, show_all: bool, as_json: bool,
                    skip_finite_check: bool) -> None:
    """Describe CKPT: format, layout, model, iterations, tensors, optimizer state, and problems (exit 1 on
    an error); or a PEFT LoRA adapter directory: its ranks, scalings and the modules it adapts.

    The model is shown as its dimensions and the settings that differ from its family's defaults
    (the family its config.json names, or the one an hf target is written as); --all lists every
    setting. Optimizer state is checked as convert checks it, its values read once for NaN/Inf.
    """
    from pgconvert.run.inspection import inspect

    info = inspect(ckpt, iteration, skip_finite_check=skip_finite_check)
    if as_json:
        _echo_json(info.to_dict())
    else:
        _print_info(info, show_all)
    if not info.ok:
        sys.exit(1)


def _wrapped(text: str) -> str:
    import textwrap

    return textwrap.fill(text, width=100, subsequent_indent=" " * 12)


def _print_info(info: Any, show_all: bool = False) -> None:
    rows = [("checkpoint", info.path), ("format", info.format or "unknown")]
    if info.iterations:
        opened = "release" if info.release else info.iteration
        rows.append(("iterations", ", ".join(map(str, info.iterations))
                     + (f" (opened: {opened})" if info.model_config is not None else "")))
    if info.adapter is not None:
        rows += _adapter_rows(info.adapter)
    if info.model_config is not None:
        rows.append(("layout", info.layout_text or "none (unsharded)"))
        rows.append(("tensors", f"{info.tensor_count}, {_format_bytes(info.total_bytes)}"))
        rows.append(("dtypes", ", ".join(f"{dtype}: {count}" for dtype, count in info.dtypes.items())))
        rows.append(("vocab", f"{info.vocab_rows} rows, true vocab "
                     f"{info.true_vocab_size if info.true_vocab_size is not None else 'unknown'}"))
        rows += _model_rows(info, show_all)
    if info.optimizer is not None:
        rows.append(("optimizer", info.optimizer))
    if info.side_files:
        rows.append(("hf files", _wrapped(", ".join(info.side_files))))
    if info.manifest is not None:
        rows.append(("manifest", f"pgconvert {info.manifest['tool_version']}, {info.manifest['created']}, "
                     f"from {info.manifest['source_path']} ({info.manifest['files']} files)"))
    for key, value in rows:
        click.echo(f"{key:<11} {value}")
    for notice in info.notices:
        click.echo(f"note: {notice}")
    if info.problems:
        click.echo("problems:")
        for problem in info.problems:
            click.echo(f"  {problem.severity}: {problem.message}")


def _adapter_rows(adapter: dict[str, Any]) -> list[tuple[str, str]]:
    layers = adapter["layers"]
    return [
        ("base model", adapter["base_model"] or "not recorded"),
        ("method", "DoRA (LoRA with learned row magnitudes)" if adapter["method"] == "dora" else "LoRA"),
        ("pairs", f"{adapter['pairs']} (rank {', '.join(map(str, adapter['ranks']))}; scaling "
                  f"{', '.join(f'{value:g}' for value in adapter['scalings'])})"),
        ("modules", _wrapped(", ".join(adapter["modules"]))),
        ("layers", f"{len(layers)} ({layers[0]}–{layers[-1]})" if layers else "none"),
        ("saved", _wrapped(", ".join(adapter["saved_weights"])) if adapter["saved_weights"] else "none"),
        ("dtypes", f"{', '.join(adapter['dtypes'])}, {_format_bytes(adapter['bytes'])}"),
    ]


def _model_rows(info: Any, show_all: bool) -> list[tuple[str, str]]:
    """The family compared with, then every setting (``show_all``) or the dimensions and the settings
    that differ from the family's defaults, each with that default, and how many do not."""
    from pgconvert.semantics import SEMANTIC_FIELDS

    compared = info.family_defaults
    rows = [] if compared is None else [("family", f"{compared.family or 'none'} ({compared.basis})")]
    config = info.model_config
    if show_all or compared is None:
        model = " ".join(f"{key}={value}" for key, value in config.items() if key not in SEMANTIC_FIELDS)
        semantics = "; ".join(f"{name}: {text}" for name, text in info.semantics.items())
        return [*rows, ("model", _wrapped(model)), ("semantics", _wrapped(semantics))]
    rows.append(("model", _wrapped(" ".join(f"{name}={config[name]}" for name in compared.shown
                                            if config[name] is not None))))
    whose = "family default" if compared.family is not None else "default"
    lines = [f"{name}={config[name]!r} ({whose}: {default!r})" for name, default in compared.differing.items()]
    defaults = f"{compared.family}'s defaults" if compared.family is not None else "ModelConfig's defaults"
    count, noun = compared.at_defaults, "setting" if compared.at_defaults == 1 else "settings"
    lines.append(f"{count} other {noun} at {defaults} (--all lists every setting)" if lines
                 else f"all {count} {noun} at {defaults} (--all lists them)")
    rows.append(("settings", ("\n" + " " * 12).join(_wrapped(line) for line in lines)))
    return rows


@main.command("verify")
@click.argument("a", type=click.Path(path_type=Path, exists=True))
@click.argument("b", type=click.Path(path_type=Path, exists=True))
@click.option("--rtol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Relative tolerance (0 with --atol 0: bit-exact).")
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--iteration-a", type=click.IntRange(min=0), default=None, help="Iteration of A to compare.")
@click.option("--iteration-b", type=click.IntRange(min=0), default=None, help="Iteration of B to compare.")
@click.option("--true-vocab-size", type=click.IntRange(min=1), default=None,
              help="Tokenizer vocab size, when the checkpoints do not record it (vocab rows beyond it are padding).")
@click.option("--max-listed", type=click.IntRange(min=1), default=10, show_default=True,
              help="Differences listed in the text output.")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
@click.option("--skip-optimizer", is_flag=True,
              help="Compare the model alone, not the optimizer state (faster).")
@click.option("--merge-adapter", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              metavar="DIR", help="Merge this PEFT LoRA adapter (or Megatron-Bridge LoRA checkpoint) into A before "
                                  "comparing (as convert --merge-adapter does): checks a merged output against its "
                                  "base and adapter.")
@click.option("--base", type=click.Path(path_type=Path, exists=True), default=None, metavar="PATH",
              help="When A and B are LoRA adapters: the base model they adapt (any format pgconvert reads), needed "
                   "when one is a PEFT adapter and the other a Megatron-Bridge checkpoint; each is mapped onto its "
                   "weights as export-adapter maps it.")
@click.option("--base-iteration", type=click.IntRange(min=0), default=None, help="Iteration of --base to read.")
def verify_command(a: Path, b: Path, rtol: float, atol: float, iteration_a: int | None, iteration_b: int | None,
                   true_vocab_size: int | None, max_listed: int, as_json: bool, skip_optimizer: bool,
                   merge_adapter: Path | None, base: Path | None, base_iteration: int | None) -> None:
    """Compare checkpoints A and B tensor by tensor in canonical form (any formats and layouts).

    When both hold megatron-core optimizer state, it is compared per parameter too (fp32 master,
    exp_avg, exp_avg_sq with the same tolerances, step exactly, param groups' hyperparameters,
    scheduler, iteration and consumed-samples counters); a side without one is named, not a difference.

    When A and B are LoRA adapters (PEFT adapter directories or Megatron-Bridge adapter-only
    checkpoints), each adapted weight's update scaling * B @ A is compared (float32, with --rtol and
    --atol), with its rank and scaling, and the factor tensors both store under the same names
    bit-exactly; adapters in different forms need --base.

    Exit 0 when equal, 1 when a tensor, the optimizer state or a file listed in a pgconvert.json
    manifest differs.
    """
    from pgconvert.run.verification import verify

    try:
        report = verify(a, b, rtol, atol, iteration_a=iteration_a, iteration_b=iteration_b,
                        true_vocab_size=true_vocab_size, skip_optimizer=skip_optimizer, merge_adapter=merge_adapter,
                        base=base, base_iteration=base_iteration)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error
    if as_json:
        _echo_json(report.to_dict())
    else:
        _print_verify(report, max_listed)
    if not report.equal:
        sys.exit(1)


def _print_verify(report: Any, max_listed: int) -> None:
    click.echo(f"A: {report.a} ({report.format_a} {report.layout_a or 'unsharded'})")
    click.echo(f"B: {report.b} ({report.format_b} {report.layout_b or 'unsharded'})")
    for note in report.notes:
        click.echo(f"note: {note}")
    for problem in report.file_problems:
        click.echo(f"file differs: {problem}")
    for difference in report.differences[:max_listed]:
        click.echo(f"differs: {difference.name}: {difference.message}")
    if len(report.differences) > max_listed:
        click.echo(f"… and {len(report.differences) - max_listed} more differences (--json lists all)")
    for difference in report.padding_differences:
        click.echo(f"padding only (not a failure): {difference.name}: {difference.message}")
    tolerance = "bit-exact" if report.rtol == 0 and report.atol == 0 else f"rtol={report.rtol}, atol={report.atol}"
    verdict = "equal" if not report.differences and not report.file_problems else \
        f"NOT equal: {len(report.differences)} tensor differences, " \
        f"{len(report.file_problems)} file problems"
    from pgconvert.run.adapter_verification import adapter_formats

    compared = "adapted weights" if report.format_a in adapter_formats() else "tensors"
    click.echo(f"{report.compared} {compared} compared ({tolerance}): {verdict}")
    if report.optimizer is not None:
        from pgconvert.run.verify_optimizer import text_lines

        for line in text_lines(report.optimizer, tolerance, max_listed):
            click.echo(line)


@main.command("batch")
@click.argument("plan_file", metavar="PLAN", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Conversions run at once, each in its own process.")
@click.option("--force", is_flag=True, help="Convert entries whose output is already complete, replacing it.")
@click.option("--verify-hashes", is_flag=True,
              help="Before skipping a complete output, check the digests of its files too (not only sizes).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def batch_command(plan_file: Path, jobs: int, force: bool, verify_hashes: bool, as_json: bool) -> None:
    """Run the conversions of a TOML PLAN ([defaults] and [[convert]] entries); exit 1 if any failed.

    Entries whose destination already holds a matching pgconvert.json are skipped unless --force.
    """
    from pgconvert.run.batch import run_batch

    _settle_imports()

    def progress(result: Any) -> None:
        click.echo(f"{result.status:<7} {result.label}: {result.dst}"
                   + (f": {result.error}" if result.error else ""), err=True)

    try:
        report = run_batch(plan_file, jobs=jobs, force=force, verify_hashes=verify_hashes, on_result=progress)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error
    if as_json:
        _echo_json(report.to_dict())
    else:
        _print_batch(report)
    if not report.ok:
        sys.exit(1)


def _print_batch(report: Any) -> None:
    header = ("entry", "src", "dst", "status", "seconds", "error")
    rows = [(r.label, r.src, r.dst, r.status, f"{r.seconds:.1f}", r.error or "") for r in report.results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    click.echo(f"{report.count('ok')} ok, {report.count('failed')} failed, {report.count('skipped')} skipped")
