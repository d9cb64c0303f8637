"""The ``pgconvert`` command line: argument parsing and output only; no conversion logic."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import click

from pgconvert import __version__
from pgconvert.convert import ConvertRequest, Plan, execute, plan
from pgconvert.errors import PgconvertError
from pgconvert.formats import DTYPE_CHOICES, EXPERT_LAYOUTS
from pgconvert.registry import loader_names, saver_names


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
        if count < 1:
            self.fail(f"{value!r} must be at least one byte", param, ctx)
        return int(count)


class ConvertByDefault(click.Group):
    """``pgconvert SRC DST`` runs ``convert``; ``pgconvert example …`` runs a subcommand."""

    default_command = "convert"

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
        with click.Context(command, info_name="pgconvert", parent=None) as sub_ctx:
            command.format_options(sub_ctx, formatter)
        self.format_commands(ctx, formatter)


@click.group(cls=ConvertByDefault, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pgconvert")
def main() -> None:
    """Reshard a checkpoint between tensor/pipeline-parallel layouts and formats, on the CPU.

    SRC is read, DST is written complete or not at all. Every rank of both layouts is played in
    this one process on fake process groups: no GPU, no torch.distributed job, no training framework.

    Example: pgconvert --dst-tp 2 ckpt_tp8/ ckpt_tp2/
    """


def _layout_option(name: str, help_text: str) -> Any:
    return click.option(name, type=click.IntRange(min=1), default=None, help=help_text)


@main.command("convert")
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
@click.option("--dtype", type=click.Choice(list(DTYPE_CHOICES)), default="keep", show_default=True,
              help="Cast floating-point tensors.")
@click.option("--max-shard-size", type=ByteSize(), default=None, metavar="SIZE",
              help="Largest safetensors shard of an hf DST, e.g. 5GB (default), 500MB, 2GiB.")
@click.option("--hf-config", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="config.json to write into an hf DST instead of one built from the model.")
@click.option("--strict", is_flag=True,
              help="Refuse wherever pgconvert would otherwise guess (unknown true vocab, dropped "
                   "_extra_state, a lossy --dtype, …); without it each guess is a warning.")
@click.option("--check-finite", "finite_mode", flag_value="error",
              help="Refuse tensors holding NaN or Inf (by default they are converted with a warning).")
@click.option("--skip-finite-check", "finite_mode", flag_value="off", help="Do not scan tensors for NaN/Inf.")
@click.option("--dry-run", is_flag=True, help="Print the plan (each destination file, tensors, bytes); write nothing.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty DST (only once the new one is complete).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no notices.")
@click.option("-v", "--verbose", is_flag=True, help="Log details to stderr.")
def convert_command(src: Path, dst: Path, src_format: str, dst_format: str, src_tp: int | None,
                    src_pp: int | None, dst_tp: int | None, dst_pp: int | None,
                    dst_decoder_first_pipeline_num_layers: int | None,
                    dst_decoder_last_pipeline_num_layers: int | None, src_ep: int | None,
                    dst_ep: int | None, dst_expert_tp: int | None, dst_vpp: int | None,
                    dst_pipeline_layout: str | None, dst_transformer_impl: str | None,
                    dst_expert_layout: str | None, iteration: int | None,
                    true_vocab_size: int | None, dtype: str, max_shard_size: int | None,
                    hf_config: Path | None, strict: bool, finite_mode: str | None,
                    dry_run: bool, overwrite: bool,
                    quiet: bool, verbose: bool) -> None:
    """Convert SRC into DST (the default command)."""
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
        strict=strict, check_finite=finite_mode or "warn",
        max_shard_size=max_shard_size, hf_config=hf_config,
    )
    try:
        conversion = plan(request)
        if dry_run:
            conversion.source.close()
            _print_plan(conversion)
            return
        _run_with_progress(conversion, quiet)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error


def _print_plan(conversion: Plan) -> None:
    click.echo(
        f"plan: {conversion.src_format} {conversion.src_layout.describe() if conversion.src_layout else ''}"
        f" -> {conversion.dst_format} {conversion.save_options.layout.describe()}"
    )
    for item in conversion.files:
        click.echo(f"  {item.relpath}  {item.tensors} tensors  {item.nbytes} bytes ({_format_bytes(item.nbytes)})")
    click.echo(f"total: {len(conversion.files)} files, {_format_bytes(conversion.total_bytes)}")


def _run_with_progress(conversion: Plan, quiet: bool) -> None:
    from tqdm import tqdm

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
    from pgconvert.convert import check_destination, staged_output
    from pgconvert.example import example_source
    from pgconvert.formats import SaveOptions
    from pgconvert.layout import ParallelLayout
    from pgconvert.registry import get_saver

    try:
        source = example_source(seed=seed)
        saver = get_saver("megatron")
        options = SaveOptions(layout=ParallelLayout(tp=tp, pp=pp))
        saver.validate(source, options)
        check_destination(out, overwrite)
        with staged_output(out, overwrite) as staging:
            result = saver.save(source, staging, options, lambda nbytes: None)
    except PgconvertError as error:
        raise PgconvertClickError(error) from error
    click.echo(f"wrote example megatron checkpoint {out} (tp={tp}, pp={pp}): {len(result.files)} rank files")
