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

Over-long prompts: `check_prompt_lengths(count_tokens, max_tokens)` (the trainer calls it once at
start-up, before any index is drawn) drops from both splits the examples whose prompt is longer
than the sampler takes, so n and the permutations are those of the kept examples, the same on
every resume with the same tokenizer and limit; or, with on_overlong="error", names the first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable
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
OVERLONG_CHOICES = ("skip", "error")
_SHOWN_LOCATIONS = 5  # over-long examples named in the warning or error; the rest are counted

log = logging.getLogger(__name__)


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
    return [record for _, record in _read_numbered(path, question_field, answer_field, answer_format)]


def _read_numbered(path: str, question_field: str, answer_field: str,
                   answer_format: str) -> list[tuple[int, dict]]:
    """(line number, record) for each record of `path`; see `read_jsonl`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"JSONL data file not found: {path!r}")
    records = []
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
            records.append((line_no, {**record, "question": question, "answer": answer}))
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
    # "file:line" of each example, aligned with _train / _eval, for messages about one example.
    _train_where: list[str] = dataclasses.field(default_factory=list, init=False, repr=False)
    _eval_where: list[str] = dataclasses.field(default_factory=list, init=False, repr=False)
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
        numbered = _read_numbered(self.path, *fields)
        records = [self._example(r) for _, r in numbered]
        where = [f"{self.path}:{n}" for n, _ in numbered]
        if self.eval_path is not None:
            eval_numbered = _read_numbered(self.eval_path, *fields)
            self._eval = [self._example(r) for _, r in eval_numbered]
            self._eval_where = [f"{self.eval_path}:{n}" for n, _ in eval_numbered]
            held_out = {_question_key(e["question"]) for e in self._eval}
            member = [_question_key(r["question"]) in held_out for r in records]
        else:
            member = [
                unit_hash("jsonl-split", _question_key(r["question"])) < self.eval_fraction
                for r in records
            ]
            self._eval = [r for r, m in zip(records, member) if m]
            self._eval_where = [w for w, m in zip(where, member) if m]
        self._train = [r for r, m in zip(records, member) if not m]
        self._train_where = [w for w, m in zip(where, member) if not m]
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

    def check_prompt_lengths(self, count_tokens: Callable[[str], int], max_tokens: int,
                             on_overlong: str = "skip") -> dict[str, int]:
        """Tokenises every training and held-out prompt once; acts on those over `max_tokens`.

        count_tokens: prompt text -> its number of tokens as the sampler will see it, e.g.
          `lambda text: len(tokenizer.encode(text))`.
        max_tokens: the longest prompt the sampler takes (its largest prompt bucket).
        on_overlong: "skip" drops over-long examples from both splits (one warning with the count
          and the first few file:line locations); "error" raises a ValueError naming the first
          one's file, line, token count and the limit.

        Call it before the first `train_example`: skipping changes n, so the training order is a
        permutation of the kept examples. Skipping only removes examples, so the held-out split
        stays disjoint from training. Returns {"train_skipped", "eval_skipped", "checked"}.
        """
        check_choice("on_overlong", on_overlong, OVERLONG_CHOICES)
        check_int_range("max_tokens", max_tokens, 1)
        over: dict[str, list[tuple[int, str, int]]] = {}  # split -> (position, where, tokens)
        for split, examples, wheres in (("train", self._train, self._train_where),
                                        ("eval", self._eval, self._eval_where)):
            over[split] = []
            for i, (example, where) in enumerate(zip(examples, wheres)):
                try:
                    tokens = int(count_tokens(example["prompt"]))
                except Exception as e:  # noqa: BLE001 -- the tokenizer's error, located
                    raise ValueError(f"{where}: cannot tokenise the prompt "
                                     f"({type(e).__name__}: {e})") from e
                if tokens > max_tokens:
                    over[split].append((i, where, tokens))
        found = over["train"] + over["eval"]
        counts = {"train_skipped": len(over["train"]), "eval_skipped": len(over["eval"]),
                  "checked": len(self._train) + len(self._eval)}
        if not found:
            return counts
        shown = ", ".join(f"{w} ({t} tokens)" for _, w, t in found[:_SHOWN_LOCATIONS])
        more = f" and {len(found) - _SHOWN_LOCATIONS} more" if len(found) > _SHOWN_LOCATIONS else ""
        if on_overlong == "error":
            _, where, tokens = found[0]
            others = f"; {len(found)} over-long prompts in all: {shown}{more}" if len(found) > 1 else ""
            raise ValueError(
                f"{where}: prompt of {tokens} tokens is longer than the limit of {max_tokens} tokens "
                f"(the sampler's largest prompt bucket){others}. Shorten it, raise the largest prompt "
                "bucket, or skip over-long examples (on_overlong='skip')"
            )
        if len(over["train"]) == len(self._train):
            raise ValueError(f"{self.path}: every one of the {len(self._train)} training prompts is "
                             f"longer than the limit of {max_tokens} tokens, e.g. {shown}")
        for split, examples, wheres in (("train", self._train, self._train_where),
                                        ("eval", self._eval, self._eval_where)):
            drop = {i for i, _, _ in over[split]}
            examples[:] = [e for i, e in enumerate(examples) if i not in drop]
            wheres[:] = [w for i, w in enumerate(wheres) if i not in drop]
        self._order = None  # n changed: the permutations are drawn anew over the kept examples
        log.warning(
            "skipped %d over-long example(s) of %d (training %d, held-out %d) whose prompts are "
            "longer than %d tokens: %s%s", len(found), counts["checked"], counts["train_skipped"],
            counts["eval_skipped"], max_tokens, shown, more)
        return counts

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
