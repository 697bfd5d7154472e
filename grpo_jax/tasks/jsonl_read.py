"""Reading a data file's rows into examples: which fields hold the question, the prompt (text or
messages) and the reference answer (`Fields`), the reference's final answer in its format
(gsm8k's "####", MATH's last \\boxed{}, raw), and errors that name the file, line and field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re

from .data_files import EVAL_SETS, named_eval_set, read_rows
from .templates import messages_problem

ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "raw")
_GROUPED_NUMBER = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?", re.ASCII)

# The jsonl task's logger: its records are the task's, filtered there by users and tests.
log = logging.getLogger("grpo_jax.tasks.jsonl")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text`, braces balanced: '\\boxed{\\frac{1}{3}}' -> '\\frac{1}{3}'.

    For reference solutions (trusted data); None when there is no box or it is unclosed.
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_reference(text: str, answer_format: str) -> str | None:
    """The final answer of a reference solution in the given format; None when it has none."""
    if answer_format == "auto":
        answer_format = "gsm8k" if "####" in text else "boxed" if "\\boxed" in text else "raw"
    match answer_format:
        case "gsm8k":
            if "####" not in text:
                return None
            answer = text.rsplit("####", 1)[1].strip()
            if _GROUPED_NUMBER.fullmatch(answer):
                answer = answer.replace(",", "")
            return answer or None
        case "boxed":
            return last_boxed(text) or None
        case "raw":
            return text.strip() or None
    raise ValueError(f"answer_format={answer_format!r}; choose one of {list(ANSWER_FORMATS)}")


def question_key(question: str) -> str:
    """The question with its whitespace normalised: what the held-out split compares and hashes."""
    return " ".join(question.split())


@dataclasses.dataclass(frozen=True)
class Fields:
    """Which fields of a data file's rows hold what."""

    question: str = "question"
    answer: str = "answer"
    messages: str = "prompt"
    answer_format: str = "auto"


def read_examples(path: str, fields: Fields = Fields()) -> list[tuple[str, dict]]:
    """(location, record) for each row of a JSONL or Parquet file, with "question" (text), "answer"
    (the reference's final answer) and "prompt" (the untemplated prompt: the row's `fields.messages`,
    text or a list of messages, else its question) filled in. Errors name the file, line or row, and
    field."""
    out = []
    hashed, unhashed = [], []  # locations of text answers with and without "####" (answer_format="auto")
    for row in read_rows(path):
        record, where = row.record, row.where
        if fields.answer not in record:
            raise ValueError(f"{where}: missing field {fields.answer!r}; the row has fields {sorted(record)}")
        if record.get(fields.messages) is not None:
            raw_prompt = record[fields.messages]
            if isinstance(raw_prompt, str):
                if not raw_prompt.strip():
                    raise ValueError(f"{where}: field {fields.messages!r} must be a non-empty string or "
                                     "a list of messages")
                question = raw_prompt
            else:
                problem = messages_problem(raw_prompt)
                if problem is not None:
                    raise ValueError(f"{where}: field {fields.messages!r}: {problem}")
                question = raw_prompt[-1]["content"]
        else:
            if fields.question not in record:
                raise ValueError(
                    f"{where}: missing field {fields.question!r} (or {fields.messages!r} with the prompt); "
                    f"the row has fields {sorted(record)}")
            raw_prompt, question = None, record[fields.question]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: field {fields.question!r} must be a non-empty string, got "
                                 f"{str(question)[:80]!r}")
        raw = record[fields.answer]
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise ValueError(f"{where}: field {fields.answer!r} must be a string or a number, got {raw!r}")
        answer = extract_reference(raw if isinstance(raw, str) else json.dumps(raw), fields.answer_format)
        if answer is None:
            raise ValueError(
                f"{where}: field {fields.answer!r} holds no final answer for "
                f"answer_format={fields.answer_format!r} (gsm8k needs '#### <answer>', boxed needs "
                f"'\\boxed{{...}}'): {str(raw)[:80]!r}"
            )
        prompt = question if raw_prompt is None else raw_prompt  # untemplated (JsonlTask.example)
        out.append((row.location, {**record, "question": question, "answer": answer, "prompt": prompt}))
        if fields.answer_format == "auto" and isinstance(raw, str):
            (hashed if "####" in raw else unhashed).append(where)
    _warn_mixed_gsm8k(path, fields, hashed, unhashed)
    return out


def _warn_mixed_gsm8k(path: str, fields: Fields, hashed: list[str], unhashed: list[str]) -> None:
    """answer_format="auto" on a GSM8K-style file where some answers lack "####": those are used
    whole (the worked solution as the reference, which no completion matches). One warning line."""
    if len(hashed) > len(unhashed) > 0:
        log.warning("%s: %d of %d answers (field %r) have no '####' although the others do, e.g. %s; each is used "
                    "whole as its reference answer. Add '#### <answer>' to them, or set "
                    "task.options.answer_format='gsm8k' to refuse them", path, len(unhashed),
                    len(hashed) + len(unhashed), fields.answer, unhashed[0])


def read_jsonl(path: str, question_field: str, answer_field: str, answer_format: str) -> list[dict]:
    """Records of `path` with "question" and "answer" filled in; errors name the file and line."""
    fields = Fields(question=question_field, answer=answer_field, answer_format=answer_format)
    return [record for _, record in read_examples(path, fields)]


def eval_data(spec: str, fields: Fields, question_field: str | None = None, answer_field: str | None = None,
              answer_format: str | None = None) -> tuple[str, Fields]:
    """(path, fields) of a held-out set given as a file or a shipped set's name ("gsm8k",
    "math500"): a shipped set brings its own fields, a file the given `fields`; the explicit
    arguments override either."""
    if spec in EVAL_SETS:
        s = EVAL_SETS[spec]
        path, fields = named_eval_set(spec), Fields(s.question_field, s.answer_field, fields.messages, s.answer_format)
    else:
        path = spec
    return path, dataclasses.replace(
        fields,
        question=question_field if question_field is not None else fields.question,
        answer=answer_field if answer_field is not None else fields.answer,
        answer_format=answer_format if answer_format is not None else fields.answer_format,
    )
