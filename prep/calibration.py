"""Calibration token sequences from a recipe's ``calibration`` section.

``SOURCES`` is the registry of calibration sources, by the name ``calibration.source`` uses. A source is
a function ``(section, root) -> iterable of texts``; an entry may also be a ``"module:function"`` string,
imported on first use, so that this module depends on no source's package (the ``reference`` source
lives with the reference model). Built in: ``reference`` (fresh documents from the reference model's
generator), ``files`` (local ``.txt`` files, or ``.jsonl`` files read through ``text_field``) and
``dataset`` (a Hugging Face dataset id or local dataset directory, read through ``text_field``).
``register_calibration_source`` adds one. Texts are tokenized, joined with the end-of-sequence token
and cut into ``num_sequences`` windows of ``sequence_length``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from prep.errors import MoeprepError

MAX_SEQUENCES = 100_000
MAX_SEQUENCE_LENGTH = 1 << 17  # above every supported model's context


@dataclass(frozen=True)
class CalibrationSection:
    """Calibration text: ``reference`` (the reference model's generator), a Hugging Face dataset id,
    or local ``.txt``/``.jsonl`` files. ``KEY``: the recipe key the section stands at, which its messages name
    (a subclass stands elsewhere: ``prep.stages.divergence.HeldOutText`` is ``divergence.text``)."""

    KEY: ClassVar[str] = "calibration"
    source: str = "reference"
    files: tuple[str, ...] = ()
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    num_sequences: int = 16
    sequence_length: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        key = self.KEY
        if self.source not in SOURCES:
            raise MoeprepError(f"{key}.source {self.source!r} unknown; use {', '.join(SOURCES)}")
        if self.num_sequences <= 0 or self.sequence_length <= 1:
            raise MoeprepError(f"{key} needs num_sequences >= 1 and sequence_length >= 2")
        if self.num_sequences > MAX_SEQUENCES or self.sequence_length > MAX_SEQUENCE_LENGTH:
            raise MoeprepError(f"{key} asks for {self.num_sequences} sequences of {self.sequence_length} tokens; "
                               f"the bounds are {MAX_SEQUENCES:,} sequences of {MAX_SEQUENCE_LENGTH:,} tokens (and the "
                               "model's context), far above what calibration needs")
        if self.source == "files" and not self.files:  # what the source reads, refused before any work
            raise MoeprepError(f"{key}.source is 'files' but {key}.files is empty; list the .txt or .jsonl files")
        if self.files and self.source != "files":  # a file named and never read: the text would be another
            raise MoeprepError(f"{key}.files is set but {key}.source is {self.source!r}, so the files would not be "
                               f"read; set {key}.source to files (or remove {key}.files)")
        if self.source == "dataset" and not self.dataset:
            raise MoeprepError(f"{key}.source is 'dataset' but {key}.dataset is not set; name a Hugging Face dataset "
                               "id or a local dataset directory")


CalibrationSource = Callable[[CalibrationSection, Path], Iterable[str]]


def _read_text(path: Path, key: str) -> str:
    """A calibration file's text: one MoeprepError naming the file when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MoeprepError(f"calibration file {path} is not UTF-8 text ({e.reason} at byte {e.start:,}); save it as "
                           f"UTF-8 or name another file in {key}.files") from None
    except OSError as e:
        raise MoeprepError(f"cannot read calibration file {path} ({e.strerror or e}); fix {key}.files") from None


def _file_texts(section: CalibrationSection, root: Path) -> Iterator[str]:
    key = section.KEY
    if not section.files:
        raise MoeprepError(f"{key}.source is 'files' but {key}.files is empty")
    field = section.text_field
    for name in section.files:
        path = Path(name) if Path(name).is_absolute() else root / name
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "not found"  # a FIFO would block the read
            raise MoeprepError(f"calibration file {path} {what}; fix {key}.files in the recipe")
        if path.suffix == ".jsonl":
            for i, line in enumerate(_read_text(path, key).splitlines()):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except (json.JSONDecodeError, RecursionError) as e:
                        raise MoeprepError(f"{path}:{i + 1} is not valid JSON ({str(e)[:120]}); fix or remove that "
                                           "line") from None
                    if not isinstance(row, dict) or field not in row:
                        raise MoeprepError(f"{path}:{i + 1} has no field {field!r}; set {key}.text_field")
                    yield str(row[field])
        else:
            yield _read_text(path, key)


def _dataset_texts(section: CalibrationSection, root: Path) -> Iterator[str]:
    if not section.dataset:
        raise MoeprepError(f"{section.KEY}.source is 'dataset' but {section.KEY}.dataset is not set")
    import datasets

    try:
        data = datasets.load_dataset(section.dataset, section.dataset_config, split=section.split)
    except Exception as e:  # datasets raises many types; all mean "cannot get it here"
        raise MoeprepError(f"cannot load calibration dataset {section.dataset!r} ({type(e).__name__}: {e}); "
                           f"without network access, point {section.KEY}.files at local files instead") from None
    if section.text_field not in data.column_names:
        raise MoeprepError(f"dataset {section.dataset!r} has no column {section.text_field!r}; set "
                           f"{section.KEY}.text_field to one of its columns: {data.column_names}")
    yield from (str(t) for t in data[section.text_field])


SOURCES: dict[str, CalibrationSource | str] = {
    "reference": "prep.reference:calibration_texts",
    "files": _file_texts,
    "dataset": _dataset_texts,
}


def register_calibration_source(name: str, source: CalibrationSource | str) -> None:
    """Make ``source`` available as ``calibration.source: <name>``."""
    SOURCES[name] = source


def _source(name: str) -> CalibrationSource:
    if name not in SOURCES:
        raise MoeprepError(f"calibration.source {name!r} unknown; use {', '.join(SOURCES)}")
    source = SOURCES[name]
    if isinstance(source, str):
        module, _, attr = source.partition(":")
        source = SOURCES[name] = getattr(importlib.import_module(module), attr)
    return source


def _documents(section: CalibrationSection, tokenizer, root: Path) -> Iterator[tuple[str, list[int]]]:
    """(sha256 of the text, its token ids with the end-of-sequence token) for each text of the source, in order."""
    eos = tokenizer.eos_token_id
    for text in _source(section.source)(section, root):
        yield (hashlib.sha256(text.encode("utf-8")).hexdigest(),
               tokenizer(text)["input_ids"] + ([eos] if eos is not None else []))


def _windows(stream: list[int], count: int, length: int) -> list[torch.Tensor]:
    return list(torch.tensor(stream[:count * length], dtype=torch.long).view(count, length))


def calibration_sequences(section: CalibrationSection, tokenizer, root: Path) -> list[torch.Tensor]:
    """``num_sequences`` LongTensors of ``sequence_length`` tokens each."""
    return _calibration_cut(section, tokenizer, root)[0]


def _calibration_cut(section: CalibrationSection, tokenizer, root: Path
                     ) -> tuple[list[torch.Tensor], set[str], int, list[int]]:
    """(the calibration windows, the digests of the texts they draw on, how many texts of the source they read, the
    tokens of the last one after the windows end)."""
    need = section.num_sequences * section.sequence_length
    stream: list[int] = []
    used: set[str] = set()
    read = 0
    for digest, ids in _documents(section, tokenizer, root):
        stream += ids
        used.add(digest)
        read += 1
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise MoeprepError(f"calibration data gives {len(stream)} tokens, {need} needed; "
                           "add data or lower calibration.num_sequences / sequence_length")
    return _windows(stream, section.num_sequences, section.sequence_length), used, read, stream[need:]


@dataclass(frozen=True)
class HeldOut:
    """Text no stage trained or calibrated on: the windows, and where they came from (for the report)."""

    sequences: list[torch.Tensor]
    provenance: dict


def held_out_sequences(calibration: CalibrationSection, tokenizer, root: Path, num_sequences: int,
                       sequence_length: int, text: CalibrationSection | None = None) -> HeldOut:
    """``num_sequences`` windows of ``sequence_length`` tokens of held-out text: from ``text`` when given, else the
    calibration source's tokens after the calibration windows end (the rest of the text they end in, then the texts
    after it). A later text whose content is one the calibration windows drew on is skipped (a generator or a file
    may repeat a text), and the result is checked against the calibration windows (``check_disjoint``), which every
    stage's calibration and traces are cut from."""
    used_windows, used, consumed, rest = _calibration_cut(calibration, tokenizer, root)
    source = text or calibration
    documents = _documents(source, tokenizer, root)
    stream: list[int] = []
    if text is None:  # the same source: go on where the calibration windows end
        for _ in range(consumed):
            next(documents)
        stream = list(rest)
    need = num_sequences * sequence_length
    taken: set[str] = set()
    skipped = 0
    for digest, ids in documents:
        if digest in used:
            skipped += 1
            continue
        stream += ids
        taken.add(digest)
        if len(stream) >= need:
            break
    if len(stream) < need:
        where = text.KEY if text is not None else "the calibration source after its windows"
        raise MoeprepError(f"held-out text: {where} gives {len(stream)} tokens, {need} needed "
                           f"({num_sequences} sequences of {sequence_length}); add text (divergence.text names "
                           "another source) or lower divergence.num_sequences")
    sequences = _windows(stream, num_sequences, sequence_length)
    check_disjoint(sequences, used_windows, taken, used)
    return HeldOut(sequences, {"source": source.source, "after_calibration": text is None,
                               "rest_of_last_calibration_text": len(rest) if text is None else 0, "texts": len(taken), "texts_skipped_as_calibration": skipped,
                               "sequences": num_sequences, "sequence_length": sequence_length,
                               "disjoint_from_calibration": True})


def check_disjoint(held_out: list[torch.Tensor], used: list[torch.Tensor], held_texts: set[str],
                   used_texts: set[str]) -> None:
    """No held-out window is a calibration window and no held-out text (by content digest) is one the calibration
    windows drew on: a MoeprepError naming the overlap otherwise. Shorter runs may recur (a templated corpus repeats
    its phrases); a whole text or window may not."""
    if shared := held_texts & used_texts:
        raise MoeprepError(f"{len(shared)} held-out text(s) are calibration texts (first sha256 {min(shared)[:16]}): "
                           "the divergence would be measured on text the stages calibrated on; name other text in "
                           "divergence.text")
    seen = {seq.to(torch.int64).numpy().tobytes(): i for i, seq in enumerate(used)}
    for j, seq in enumerate(held_out):
        if (i := seen.get(seq.to(torch.int64).numpy().tobytes())) is not None:
            raise MoeprepError(f"held-out sequence {j} is calibration sequence {i}: the divergence would be measured "
                               "on text the stages calibrated on; name other text in divergence.text")


def fingerprint_sequences(sequences: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for seq in sequences:
        digest.update(seq.numpy().tobytes())
    return digest.hexdigest()


def model_context(config) -> int | None:
    """The model's context in tokens (``max_position_embeddings``), None where its config does not say."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def check_length(key: str, length: int | None, config, hint: str = "") -> None:
    """Windows of ``length`` tokens (the recipe's ``key``) must fit the model's context."""
    context = model_context(config)
    if length is not None and context is not None and length > context:
        raise MoeprepError(f"{key} {length} is longer than the model's context of {context} tokens; set it to "
                           f"{context} or less{hint}")


def check_context(recipe, config) -> None:
    """The calibration sequences, and the divergence stage's held-out windows where it runs, must fit the model's
    context (``prepare`` before its first stage that reads calibration data, and ``--dry-run``, both check)."""
    check_length("calibration.sequence_length", recipe.calibration.sequence_length, config)
    held = getattr(recipe, "divergence", None)
    if held is not None and held.enabled:
        check_length("divergence.sequence_length", held.sequence_length, config, " (or null)")
