"""User data sets from JSONL files: one JSON object per line with a question and an answer field.

Answer formats (`answer_format`):
  * "gsm8k": a worked solution ending in "#### 42"; the answer is the text after the last "####",
    thousands separators removed ("#### 1,000" -> "1000").
  * "boxed": a MATH-style solution; the answer is the content of its last \\boxed{...} (nested
    braces kept, e.g. "\\frac{1}{3}").
  * "raw": the field itself (numbers become their JSON text).
  * "auto": "gsm8k" when the text holds "####", else "boxed" when it holds "\\boxed", else "raw".

Split: with `eval_path` the held-out set is that file, and training drops any question that also
appears there; otherwise a question is held out when a hash of its whitespace-normalised text is
below `eval_fraction`. Duplicated questions therefore land on the same side.

Training order: `train_example(index)` reads epoch `index // n` and position `index % n` of a
permutation drawn from (seed, epoch), so every epoch visits every training example once, in a new
order, and any index can be produced directly (a resumed run continues at its saved position).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, ClassVar

from grpo_jax import rewards
from grpo_jax.rewards.math_verify import fast_number

from .base import (
    RewardSpec,
    check_choice,
    check_format_weight,
    check_fraction,
    check_index,
    check_int_range,
    example_rng,
    unit_hash,
)
from .templates import TEMPLATES, answer_block, apply_template

ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "raw")
_MAX_TEXT = 20_000
_GROUPED_NUMBER = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?", re.ASCII)


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


def _question_key(question: str) -> str:
    return " ".join(question.split())


def read_jsonl(path: str, question_field: str, answer_field: str, answer_format: str) -> list[dict]:
    """Records of `path` with "question" and "answer" filled in; errors name the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"JSONL data file not found: {path!r}")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for field in (question_field, answer_field):
                if field not in record:
                    raise ValueError(
                        f"{where}: missing field {field!r}; the line has fields {sorted(record)}"
                    )
            question, raw = record[question_field], record[answer_field]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: field {question_field!r} must be a non-empty string")
            if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
                raise ValueError(
                    f"{where}: field {answer_field!r} must be a string or a number, got {raw!r}"
                )
            answer = extract_reference(raw if isinstance(raw, str) else json.dumps(raw), answer_format)
            if answer is None:
                raise ValueError(
                    f"{where}: field {answer_field!r} holds no final answer for "
                    f"answer_format={answer_format!r} (gsm8k needs '#### <answer>', boxed needs "
                    f"'\\boxed{{...}}'): {str(raw)[:80]!r}"
                )
            records.append({**record, "question": question, "answer": answer})
    if not records:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return records


@dataclasses.dataclass
class JsonlTask:
    """Questions and reference answers from a JSONL file, with the plain or R1 template."""

    name: ClassVar[str] = "jsonl"

    path: str = ""
    question_field: str = "question"
    answer_field: str = "answer"
    answer_format: str = "auto"
    template: str = "plain"
    seed: int = 0
    eval_path: str | None = None
    eval_fraction: float = 0.1
    format_weight: float = 0.5  # lambda on the r1 format reward; < 1 (seed Part 3)

    _train: list[dict] = dataclasses.field(default_factory=list, init=False, repr=False)
    _eval: list[dict] = dataclasses.field(default_factory=list, init=False, repr=False)
    _order: tuple[int, list[int]] | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("path: give the JSONL data file, e.g. path='data/train.jsonl'")
        check_choice("answer_format", self.answer_format, ANSWER_FORMATS)
        check_choice("template", self.template, TEMPLATES)
        check_int_range("seed", self.seed, 0)
        check_fraction("eval_fraction", self.eval_fraction)
        check_format_weight(self.format_weight)
        fields = (self.question_field, self.answer_field, self.answer_format)
        records = [self._example(r) for r in read_jsonl(self.path, *fields)]
        if self.eval_path is not None:
            self._eval = [self._example(r) for r in read_jsonl(self.eval_path, *fields)]
            held_out = {_question_key(e["question"]) for e in self._eval}
            self._train = [r for r in records if _question_key(r["question"]) not in held_out]
        else:
            member = [
                unit_hash("jsonl-split", _question_key(r["question"])) < self.eval_fraction
                for r in records
            ]
            self._eval = [r for r, m in zip(records, member) if m]
            self._train = [r for r, m in zip(records, member) if not m]
        if not self._train:
            raise ValueError(
                f"{self.path}: no training examples left after the held-out split "
                f"({len(records)} read, eval_path={self.eval_path!r}, eval_fraction={self.eval_fraction})"
            )

    def _example(self, record: dict[str, Any]) -> dict:
        return {**record, "prompt": apply_template(self.template, record["question"])}

    @property
    def num_train(self) -> int:
        return len(self._train)

    def train_example(self, index: int) -> dict:
        """Position `index % n` of epoch `index // n`'s shuffled order (n training examples)."""
        index = check_index(index)
        epoch, position = divmod(index, len(self._train))
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self._train)))
            example_rng("jsonl-train", self.seed, epoch).shuffle(order)
            self._order = (epoch, order)
        return dict(self._train[self._order[1][position]])

    def eval_examples(self) -> list[dict]:
        return [dict(e) for e in self._eval]

    def extract_answer(self, completion: str) -> str | None:
        """The single boxed answer (inside the <answer> block for r1), canonical for majority voting.

        Plain numbers become their exact fraction ("0.50", "\\frac{1}{2}", "1/2" -> "1/2"), so
        equal values vote together; other answers are the verifier's normalisation minus spaces.
        """
        if not isinstance(completion, str) or len(completion) > _MAX_TEXT:
            return None

        region = completion if self.template == "plain" else answer_block(completion, _MAX_TEXT)
        if region is None or completion.count("\\boxed") != 1:
            return None
        boxed = rewards.extract_boxed(region)
        if boxed is None:
            return None
        normal = rewards.normalize_answer(boxed)
        value = fast_number(normal)
        return str(value) if value is not None else re.sub(r"\s+", "", normal)

    def eval_correct(self, completion: str, example: dict) -> bool:
        """math_reward on the completion, and (r1) the one box must sit inside the <answer> block."""
        if self.extract_answer(completion) is None:
            return False

        return rewards.math_reward(completion, example["answer"]) == 1.0

    def reward_fns(self) -> list[RewardSpec]:
        """plain: math accuracy; r1: accuracy + format_weight * format reward."""
        accuracy = RewardSpec("math", rewards.math_accuracy_reward, 1.0)
        if self.template == "plain":
            return [accuracy]
        return [accuracy, RewardSpec("format", rewards.format_reward_fn, float(self.format_weight))]
