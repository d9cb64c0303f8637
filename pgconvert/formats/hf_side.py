"""HF side files: the files beside an HF model's weights that its users rely on and pgconvert
never interprets (config.json aside): the tokenizer, its chat templates, the generation config.

An HF source has them beside its weights. A Megatron or torch_dist checkpoint made from one keeps
them in an ``hf/`` folder beside its iterations (``SIDE_DIR``), carried along by every conversion
between those formats, so that the way back to HF gives the same config.json (the architecture,
token ids, RoPE scaling, sliding window and every key transformers reads), tokenizer and
generation config. The user can supply or replace them with ``--hf-config``, ``--generation-config``
and ``--tokenizer DIR``.

The files are untrusted input: only the names listed here are taken (and ``*.jinja`` templates in
``additional_chat_templates/``), each must be a regular file no larger than
``MAX_SIDE_FILE_BYTES``, and in a checkpoint a symlink must not lead outside the folder holding it.
They are copied byte for byte, never parsed, except config.json and generation_config.json.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, ConfigError, PgconvertError
from pgconvert.families.table import Family
from pgconvert.formats import PlannedFile, SaveOptions
from pgconvert.formats.hf import (
    MISSING,
    config_disagreements,
    family_mismatches,
    family_of,
    get_path,
    infer_family,
    model_config_from_hf,
    read_json_object,
    require_family_fits,
)
from pgconvert.io.limits import MAX_SIDE_FILE_BYTES, MAX_SIDE_TEMPLATES, over_limit, quote
from pgconvert.formats.stream import CanonicalSource

log = logging.getLogger(__name__)

# The folder of a Megatron / torch_dist checkpoint that holds the HF side files of its model.
SIDE_DIR = "hf"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' additional_chat_templates/NAME.jinja (CHAT_TEMPLATE_DIR): named templates.
TEMPLATE_DIR = "additional_chat_templates"
TEMPLATE_SUFFIX = ".jinja"
# What transformers' tokenizers save (tokenization_utils_base, the models' VOCAB_FILES_NAMES) and
# their chat templates (utils/hub.py: CHAT_TEMPLATE_FILE, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# What transformers' processors of multimodal models save beside the tokenizer (utils/hub.py's
# PROCESSOR_NAME, IMAGE_PROCESSOR_NAME = FEATURE_EXTRACTOR_NAME, VIDEO_PROCESSOR_NAME).
PROCESSOR_FILES: tuple[str, ...] = ("processor_config.json", "preprocessor_config.json",
                                    "video_preprocessor_config.json")
# Every file a side set may hold, config.json included (an hf target writes its own from it).
SIDE_FILES: tuple[str, ...] = (CONFIG_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES, *PROCESSOR_FILES)
# Side files are copied in pieces of this size, never read whole.
COPY_CHUNK_BYTES = 8 * 2**20
# Token ids of generation_config.json: an integer, a list of them, or null.
TOKEN_ID_KEYS: tuple[str, ...] = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@dataclass(frozen=True)
class SideFile:
    """One side file: its name in the set (``tokenizer.json``, ``additional_chat_templates/x.jinja``),
    the regular file it is read from, and its size."""

    name: str
    path: Path
    size: int


@dataclass(frozen=True)
class SideFiles:
    """The side files of one checkpoint (or given by the user), by name."""

    directory: Path
    files: tuple[SideFile, ...]

    def names(self) -> list[str]:
        return [item.name for item in self.files]

    def get(self, name: str) -> SideFile | None:
        return next((item for item in self.files if item.name == name), None)

    def without(self, names: Collection[str]) -> SideFiles:
        """These side files less those named."""
        return dataclasses.replace(self, files=tuple(item for item in self.files if item.name not in names))


def _checked(directory: Path, name: str, confine: bool, error: type[PgconvertError]) -> SideFile:
    """``directory / name`` as a side file: a regular file within the size limit, and with
    ``confine`` one that resolves inside ``directory``."""
    path = directory / name
    resolved = path.resolve()
    root = directory.resolve()
    if confine and root not in resolved.parents:
        raise error(f"{path}: resolves to {resolved}, outside {directory}; side files must lie inside the "
                    "checkpoint directory")
    try:
        info = os.stat(resolved)
    except OSError as exc:
        raise error(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: not a regular file; side files (tokenizer, configs) must be plain files")
    if info.st_size > MAX_SIDE_FILE_BYTES:
        raise error(str(over_limit(path, "the side file's size in bytes", info.st_size, "MAX_SIDE_FILE_BYTES")))
    return SideFile(name, resolved, info.st_size)


def _templates(directory: Path, confine: bool, error: type[PgconvertError]) -> list[SideFile]:
    folder = directory / TEMPLATE_DIR
    if not folder.is_dir():
        return []
    if confine and directory.resolve() not in folder.resolve().parents:
        raise error(f"{folder}: resolves to {folder.resolve()}, outside {directory}; side files must lie inside "
                    "the checkpoint directory")
    names = sorted(entry.name for entry in os.scandir(folder) if entry.name.endswith(TEMPLATE_SUFFIX))
    if len(names) > MAX_SIDE_TEMPLATES:
        raise error(str(over_limit(folder, "the number of chat templates", len(names), "MAX_SIDE_TEMPLATES")))
    return [_checked(directory, f"{TEMPLATE_DIR}/{name}", confine, error) for name in names]


def find_side_files(directory: Path, names: Iterable[str] = SIDE_FILES, confine: bool = True,
                    error: type[PgconvertError] = CheckpointError) -> SideFiles:
    """The side files of ``names`` present in ``directory`` (a dangling symlink is refused)."""
    wanted = list(names)
    found = [_checked(directory, name, confine, error) for name in wanted if os.path.lexists(directory / name)]
    if any(name in TOKENIZER_FILES for name in wanted):
        found += _templates(directory, confine, error)
    return SideFiles(directory, tuple(found))


def carried_side_files(root: Path, iteration_dir: Path | None = None) -> SideFiles | None:
    """The ``hf/`` folder of a Megatron or torch_dist checkpoint rooted at ``root``; None without one.

    When ``root`` is the iteration directory itself (SRC named ``iter_0000100/``), the folder is
    looked for beside it, in the checkpoint's root."""
    if iteration_dir is not None and root.resolve() == iteration_dir.resolve() \
            and not os.path.lexists(root / SIDE_DIR):
        root = root.absolute().parent
    folder = root / SIDE_DIR
    if not os.path.lexists(folder):
        return None
    if root.resolve() not in folder.resolve().parents or not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory inside {root}; it must hold the model's HF side files")
    return find_side_files(folder)


def user_side_files(options: SaveOptions) -> list[SideFile]:
    """What ``--generation-config`` and ``--tokenizer DIR`` supply, checked (``--hf-config`` is
    checked against the model by the saver that uses it)."""
    given: list[SideFile] = []
    if options.generation_config is not None:
        path = options.generation_config
        if not path.is_file():
            raise ConfigError(f"--generation-config {path}: {'not a file' if path.exists() else 'does not exist'}")
        item = _checked(path.parent, path.name, False, ConfigError)
        check_generation_config(read_json_object(item.path, ConfigError), path)
        given.append(SideFile(GENERATION_CONFIG_FILE, item.path, item.size))
    if options.tokenizer is not None:
        folder = options.tokenizer
        if not folder.is_dir():
            raise ConfigError(f"--tokenizer {folder}: {'not a directory' if folder.exists() else 'does not exist'}")
        found = find_side_files(folder, TOKENIZER_FILES, confine=False, error=ConfigError)
        if not found.files:
            raise ConfigError(f"--tokenizer {folder}: holds none of the tokenizer files "
                              f"({', '.join(TOKENIZER_FILES)})")
        given += found.files
    return given


def check_generation_config(doc: dict[str, Any], path: Path) -> None:
    for key in TOKEN_ID_KEYS:
        value = doc.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"{path}: {key}={quote(value)}: expected a token id (a non-negative integer) "
                              "or a list of them")


def target_side_files(source_files: SideFiles | None, options: SaveOptions) -> list[SideFile]:
    """The side files a target gets: the source's, with those the user gave in their place
    (``--tokenizer`` replaces the whole tokenizer, so files of two tokenizers never mix)."""
    given = user_side_files(options)
    files = list(source_files.files) if source_files is not None else []
    if options.tokenizer is not None:
        files = [item for item in files if item.name in (CONFIG_FILE, GENERATION_CONFIG_FILE)]
    replaced = {item.name for item in given}
    if options.hf_config is not None:
        replaced.add(CONFIG_FILE)
        path = options.hf_config
        given.append(_checked(path.parent, path.name, False, ConfigError))
        given[-1] = SideFile(CONFIG_FILE, given[-1].path, given[-1].size)
    return [item for item in files if item.name not in replaced] + given


def copy_side_files(files: Iterable[SideFile], out_dir: Path) -> list[PlannedFile]:
    """Copy each file byte for byte into ``out_dir`` under its name (fsynced), in bounded pieces;
    a file that grew past the size checked when it was found is refused."""
    written = []
    for item in files:
        target = out_dir / item.name
        target.parent.mkdir(parents=True, exist_ok=True)
        copied = 0
        with open(item.path, "rb") as reader, open(target, "wb") as writer:
            while chunk := reader.read(COPY_CHUNK_BYTES):
                copied += len(chunk)
                if copied > item.size:
                    raise CheckpointError(f"{item.path}: grew while being copied (it was {item.size} bytes)")
                writer.write(chunk)
            writer.flush()
            os.fsync(writer.fileno())
        written.append(PlannedFile(target.relative_to(out_dir).as_posix(), 0, copied))
    return written


# --- config.json on the way back to HF -----------------------------------------------------------

def check_user_config(options: SaveOptions, config: ModelConfig) -> None:
    """``--hf-config`` must describe the model it is written with (as on an hf target)."""
    if options.hf_config is None:
        return
    doc = read_json_object(options.hf_config, ConfigError)
    family, differences = config_disagreements(doc, options.hf_config, config)
    if differences:
        raise ConfigError(f"{options.hf_config}: does not describe the source model: {'; '.join(differences)}")
    require_family_fits(family, config, str(options.hf_config))


def carried_config(doc: dict[str, Any], path: Path,
                   config: ModelConfig) -> tuple[Family, dict[str, Any] | None, list[str]]:
    """The family and base config.json of an hf target from a carried config.json, and the guesses
    made (for ``pgconvert.formats.strict.fallback``). It is kept whole where it describes the model; where
    the model's settings differ, the model's values are written and each difference is named. None:
    a config.json built from the model (the carried one names a family the model cannot be). A vision-language
    config.json carried with a model that has no vision part (``--text-only``) is read as its text model's."""
    try:
        nesting = family_of(doc, path, ConfigError).vision_language
        if nesting is not None and config.vision.vision_config is None:
            doc = nesting.text_doc(doc)
        family, differences = config_disagreements(doc, path, config)
    except ConfigError as exc:
        return infer_family(config), None, [f"{path} is not usable ({exc}); config.json is built from the model"]
    mismatches = family_mismatches(family, config)
    if mismatches:
        return infer_family(config), None, [
            f"{path} names {family.architecture}, which the model is not ({', '.join(mismatches)}); "
            "config.json is built from the model"]
    if not differences:
        return family, doc, []
    return family, _with_model_values(doc, path, family, config), [
        f"{path} (carried from the HF source) disagrees with the model's settings: {'; '.join(differences)}; "
        "the model's values are written"]


def _with_model_values(doc: dict[str, Any], path: Path, family: Family, config: ModelConfig) -> dict[str, Any]:
    """A copy of ``doc`` holding ``config``'s value for every family field and rule key that differs."""
    _, described, _ = model_config_from_hf(doc, path, error=ConfigError)
    nesting = family.vision_language
    updated = copy.deepcopy(doc if nesting is None else nesting.flat(doc))
    for spec in family.fields:
        value = spec.value_of(config)
        if value == spec.value_of(described):
            continue
        for where in spec.spellings:
            if where == spec.path or get_path(updated, where) is not MISSING:
                _put(updated, where, value, keep_null=spec.nullable and spec.default is not None)
    for rule in family.rules:
        in_file, in_model = rule.write(described), rule.write(config)
        updated.update({key: copy.deepcopy(in_model[key]) for key in rule.keys if in_file[key] != in_model[key]})
    return updated if nesting is None else nesting.nested(updated)


def _put(doc: dict[str, Any], where: tuple[str, ...], value: object, keep_null: bool) -> None:
    """``doc[where] = value``; a None removes the key unless ``keep_null`` (its absence means a value)."""
    node = doc
    for key in where[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if value is None and not keep_null:
        node.pop(where[-1], None)
    else:
        node[where[-1]] = value


# --- carrying them in a Megatron / torch_dist target ----------------------------------------------

def carried_for_target(source: CanonicalSource, options: SaveOptions) -> list[SideFile]:
    """The side files a Megatron or torch_dist target keeps in ``hf/`` (checked; nothing written)."""
    check_user_config(options, source.config)
    return target_side_files(source.side_files, options)


def write_carried(source: CanonicalSource, options: SaveOptions, out_dir: Path) -> list[PlannedFile]:
    """Copy the target's side files into ``out_dir/hf/`` (nothing, and no folder, when there are none)."""
    files = carried_for_target(source, options)
    if not files:
        return []
    written = copy_side_files(files, out_dir / SIDE_DIR)
    log.info("carried HF side files in %s/: %s", SIDE_DIR, ", ".join(item.name for item in files))
    return [PlannedFile(f"{SIDE_DIR}/{item.relpath}", 0, item.nbytes) for item in written]
