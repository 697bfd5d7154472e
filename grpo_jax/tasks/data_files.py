"""Rows of a data file, JSONL or Parquet, each with where it came from; the eval sets shipped with grpo_jax.

JSONL: one JSON object per line (blank lines skipped), located as "file, line N" (1-based).
Parquet (the Hugging Face hub's format, what `datasets.Dataset.to_parquet` writes): read with
pyarrow, an optional dependency (`pip install pyarrow`, or the `grpo_jax[parquet]` extra); rows are
located as "file, row i" (0-based, as `datasets` indexes them). A file is Parquet when its name ends
in ".parquet" or ".pq".

Named eval sets (`named_eval_set(name)`, also accepted wherever a task takes `eval_path`):
  "gsm8k"    GSM8K test, 1,319 questions: {"question", "answer"}, answers end with "#### N".
  "math500"  MATH-500, 500 problems: {"problem", "solution", "answer", ...}; `answer` is the gold
             final answer in LaTeX.
Their files, licenses and provenance are in grpo_jax/assets/data/ (README.md there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

PARQUET_SUFFIXES = (".parquet", ".pq")
ASSET_DATA = pathlib.Path(__file__).resolve().parent.parent / "assets" / "data"
_PARQUET_BATCH = 4096  # rows per pyarrow record batch; bounds the Arrow memory held at once


@dataclasses.dataclass(frozen=True)
class Row:
    where: str  # "file, line 3" / "file, row 2": the prefix of an error about this row
    location: str  # "file:3" / "file, row 2": this row in a list of locations
    record: dict


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """A data file shipped in grpo_jax/assets/data/ and the fields its rows use."""

    file: str
    question_field: str
    answer_field: str
    answer_format: str  # how the reference answer is written (see jsonl.extract_reference)
    license: str


EVAL_SETS = {
    "gsm8k": EvalSet("gsm8k_test.jsonl", "question", "answer", "gsm8k", "LICENSE.gsm8k"),
    "math500": EvalSet("math500_test.jsonl", "problem", "answer", "raw", "LICENSE.math500"),
}


def named_eval_set(name: str) -> str:
    """The path of a shipped eval set ("gsm8k", "math500")."""
    if name not in EVAL_SETS:
        raise ValueError(f"unknown eval set {name!r}; the shipped ones are {sorted(EVAL_SETS)} "
                         "(or give a JSONL / Parquet file path)")
    path = ASSET_DATA / EVAL_SETS[name].file
    if not path.is_file():
        raise FileNotFoundError(f"eval set {name!r}: {path} is missing from this installation of grpo_jax")
    return str(path)


def is_parquet(path: str) -> bool:
    return os.fspath(path).lower().endswith(PARQUET_SUFFIXES)


def read_rows(path: str) -> list[Row]:
    """Every row of a JSONL or Parquet file, in file order; errors name the file and line or row."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"data file path must be a non-empty string, got {path!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path!r}")
    rows = _read_parquet(path) if is_parquet(path) else _read_jsonl(path)
    if not rows:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return rows


def _read_jsonl(path: str) -> list[Row]:
    rows = []
    # Bytes, decoded line by line: a text-mode file reports a bad byte as "position 243" of its
    # read buffer, which is neither the line nor the column.
    with open(path, "rb") as f:
        for line_no, raw_line in enumerate(f, start=1):
            where = f"{path}, line {line_no}"
            if line_no == 1 and raw_line.startswith(b"\xef\xbb\xbf"):
                raw_line = raw_line[3:]  # a UTF-8 byte-order mark (Windows editors write one)
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}: not UTF-8 text (byte 0x{raw_line[e.start]:02x} at byte {e.start + 1} "
                    f"of the line: {e.reason}); re-save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            rows.append(Row(where, f"{path}:{line_no}", record))
    return rows


def _read_parquet(path: str) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet files needs pyarrow: pip install pyarrow "
                          "(or pip install 'grpo_jax[parquet]'), or convert the file to JSONL") from None
    try:
        parquet_file = pq.ParquetFile(path)
        batches = parquet_file.iter_batches(batch_size=_PARQUET_BATCH)
        rows = []
        for batch in batches:
            for record in batch.to_pylist():
                where = f"{path}, row {len(rows)}"
                rows.append(Row(where, where, record))
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    return rows
