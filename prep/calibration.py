"""Calibration token sequences from a recipe's ``calibration`` section.

Sources: ``reference`` (fresh documents from the reference model's generator, all five domains),
``files`` (local ``.txt`` files, or ``.jsonl`` files read through ``text_field``), or ``dataset`` (a
Hugging Face dataset id or local dataset directory, read through ``text_field``). Texts are tokenized,
joined with the end-of-sequence token and cut into ``num_sequences`` windows of ``sequence_length``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from prep.errors import MoeprepError
from prep.recipe import CalibrationSection


def _reference_texts(seed: int) -> Iterator[str]:
    from prep.reference import data as D

    empty = D.Split(frozenset(), frozenset(), frozenset())
    round_ = 0
    while True:
        docs = D.training_documents(seed * 1000 + round_, empty, {d: 8 for d in D.DOMAINS})
        yield from (text for _, text in docs)
        round_ += 1


def _file_texts(files: tuple[str, ...], field: str, root: Path) -> Iterator[str]:
    for name in files:
        path = Path(name) if Path(name).is_absolute() else root / name
        if not path.is_file():
            raise MoeprepError(f"calibration file {path} not found; fix calibration.files in the recipe")
        if path.suffix == ".jsonl":
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
                if line.strip():
                    row = json.loads(line)
                    if field not in row:
                        raise MoeprepError(f"{path}:{i + 1} has no field {field!r}; set calibration.text_field")
                    yield str(row[field])
        else:
            yield path.read_text(encoding="utf-8")


def _dataset_texts(section: CalibrationSection) -> Iterator[str]:
    import datasets

    try:
        data = datasets.load_dataset(section.dataset, section.dataset_config, split=section.split)
    except Exception as e:  # datasets raises many types; all mean "cannot get it here"
        raise MoeprepError(f"cannot load calibration dataset {section.dataset!r} ({type(e).__name__}: {e}); "
                           "without network access, point calibration.files at local files instead") from None
    if section.text_field not in data.column_names:
        raise MoeprepError(f"dataset {section.dataset!r} has no column {section.text_field!r}; "
                           f"columns: {data.column_names}")
    yield from (str(t) for t in data[section.text_field])


def calibration_sequences(section: CalibrationSection, tokenizer, root: Path) -> list[torch.Tensor]:
    """``num_sequences`` LongTensors of ``sequence_length`` tokens each."""
    if section.source == "reference":
        texts = _reference_texts(section.seed)
    elif section.source == "files":
        if not section.files:
            raise MoeprepError("calibration.source is 'files' but calibration.files is empty")
        texts = _file_texts(section.files, section.text_field, root)
    elif section.source == "dataset":
        if not section.dataset:
            raise MoeprepError("calibration.source is 'dataset' but calibration.dataset is not set")
        texts = _dataset_texts(section)
    else:
        raise MoeprepError(f"calibration.source {section.source!r} unknown; use reference, files or dataset")
    need = section.num_sequences * section.sequence_length
    stream: list[int] = []
    eos = tokenizer.eos_token_id
    for text in texts:
        stream += tokenizer(text)["input_ids"] + ([eos] if eos is not None else [])
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise MoeprepError(f"calibration data gives {len(stream)} tokens, {need} needed; "
                           "add data or lower calibration.num_sequences / sequence_length")
    ids = torch.tensor(stream[:need], dtype=torch.long).view(section.num_sequences, section.sequence_length)
    return list(ids)


def fingerprint_sequences(sequences: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for seq in sequences:
        digest.update(seq.numpy().tobytes())
    return digest.hexdigest()
