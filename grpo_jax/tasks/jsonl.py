"""User data sets from JSONL or Parquet files: one row per example, with a question (or a prompt as
text or messages) and a reference answer.

Fields (task options): `question_field` ("question"), `answer_field` ("answer"), `messages_field`
("prompt"). A row with `messages_field` takes its prompt from there, as text or as messages in
TRL's conversational format (`[{"role": "system"|"user"|"assistant", "content": ...}]`, ending with
the user's turn); other rows need `question_field`. The template applies to either (see
`templates.py`): with messages the example's "prompt" is the messages list, for the tokenizer's chat
template; "question" is then the last user turn, as written in the data.

Answer formats of the reference (`answer_format`):
  * "gsm8k": a worked solution ending in "#### 42"; the answer is the text after the last "####",
    thousands separators removed ("#### 1,000" -> "1000").
  * "boxed": a MATH-style solution; the answer is the content of its last \\boxed{...} (nested
    braces kept, e.g. "\\frac{1}{3}").
  * "raw": the field itself (numbers become their JSON text).
  * "auto": "gsm8k" when the text holds "####", else "boxed" when it holds "\\boxed", else "raw".

Where the model's answer is (`answer_location`: "boxed", "gsm8k", "answer_tag" or "lenient", see
`templates.py`): the prompt's instruction and the training accuracy reward follow it; `eval_correct`
and `extract_answer` follow `eval_answer_location`, by default "lenient" when training reads
"boxed" (the last box, "The final answer is ...", "the answer is ...", as lm-eval-harness and
math-verify read answers) and `answer_location` otherwise. The answer is compared with the
reference by value with `grpo_jax.rewards.math_reward`'s bounded grammar; `approx_rtol` and
`number_format` are its options (`grpo_jax.rewards.VerifyOptions`), the same in training and
evaluation.

Split: with `eval_path` (a file, or a shipped set's name: "gsm8k", "math500") the held-out set is
that file, and training drops any question that also appears there; otherwise a question is held
out when a hash of its whitespace-normalised text is below `eval_fraction`. Duplicated questions
therefore land on the same side. The held-out file has its own fields: `eval_question_field`,
`eval_answer_field`, `eval_answer_format` (a shipped set's own by default, else the training ones).

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
import functools
import json
import logging
import re
from collections.abc import Callable, Sequence
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
from .data_files import EVAL_SETS, named_eval_set, read_rows
from .templates import (
    ANSWER_LOCATIONS,
    TEMPLATES,
    apply_template,
    apply_template_to_messages,
    located_answer,
    location_instruction,
    messages_problem,
)

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


def _as_boxed(answer: str | None) -> str:
    """`answer` as the one box math_reward reads, or "" (scores 0) when there is none or its braces
    would let the box end early ("1} or {2" must not become the answer "1")."""
    if answer is None:
        return ""
    boxed = f"\\boxed{{{answer}}}"
    return boxed if rewards.extract_boxed(boxed) == answer.strip() else ""


def _located_accuracy(location: str, options: rewards.VerifyOptions, prompts: Sequence[Any],
                      completions: Sequence[str], /, *, answer: Sequence[str], pool=None, **_) -> list[float]:
    """RewardFn body: the answer at a task location ("gsm8k", "answer_tag") boxed, then compared."""
    boxed = [_as_boxed(located_answer(c, location)) for c in completions]
    compare = rewards.math_accuracy_reward_fn(approx_rtol=options.approx_rtol, number_format=options.number_format)
    return compare([""] * len(boxed), boxed, answer=answer, pool=pool)


def gsm8k_accuracy_reward(prompts: Sequence[Any], completions: Sequence[str], *, answer: Sequence[str],
                          pool=None, **_) -> list[float]:
    """RewardFn: 1.0 when the completion's one "#### N" equals the reference by value, else 0.0."""
    return _located_accuracy("gsm8k", rewards.VerifyOptions(), prompts, completions, answer=answer, pool=pool)


def answer_tag_accuracy_reward(prompts: Sequence[Any], completions: Sequence[str], *, answer: Sequence[str],
                               pool=None, **_) -> list[float]:
    """RewardFn: 1.0 when the one <answer> block (a box in it unwrapped) equals the reference by value."""
    return _located_accuracy("answer_tag", rewards.VerifyOptions(), prompts, completions, answer=answer, pool=pool)


@dataclasses.dataclass(frozen=True)
class AnswerChecker:
    """How a data set's prompts are built and its completions checked: the template and where the
    model's answer is. JsonlTask's own prompts and checks; the eval command's for any data file."""

    template: str = "plain"
    answer_location: str = "boxed"
    eval_answer_location: str | None = None  # None: "lenient" when answer_location is "boxed", else the same
    approx_rtol: float = 0.0
    number_format: str = "en"
    # Text questions as messages ([system?, user]) for the tokenizer's chat template: the same prompt
    # format in training and in every evaluation of the run (JsonlTask's `chat`).
    chat: bool = False
    system_prompt: str | None = None

    def __post_init__(self):
        check_choice("template", self.template, TEMPLATES)
        if not isinstance(self.chat, bool):
            raise ValueError(f"chat={self.chat!r}: must be true, false or (JsonlTask) null for auto")
        if self.system_prompt is not None and (not isinstance(self.system_prompt, str) or not self.system_prompt):
            raise ValueError(f"system_prompt={self.system_prompt!r}: give the system text, or null for none")
        check_choice("answer_location", self.answer_location, ANSWER_LOCATIONS)
        if self.eval_answer_location is not None:
            check_choice("eval_answer_location", self.eval_answer_location, ANSWER_LOCATIONS)
        rewards.verify_options("boxed", self.approx_rtol, self.number_format)  # a bad option fails here, named

    @property
    def options(self) -> rewards.VerifyOptions:
        return rewards.verify_options("boxed", self.approx_rtol, self.number_format)

    @property
    def eval_location(self) -> str:
        """Where evaluation reads the answer: the strict box trains, the lenient reading evaluates."""
        if self.eval_answer_location is not None:
            return self.eval_answer_location
        return "lenient" if self.answer_location == "boxed" else self.answer_location

    def accuracy_reward(self) -> rewards.RewardFn:
        """The training accuracy reward at `answer_location` (anywhere in the completion: with r1 the
        layout is the format reward's job)."""
        if self.answer_location in rewards.LOCATIONS:
            return rewards.math_accuracy_reward_fn(location=self.answer_location, approx_rtol=self.approx_rtol,
                                                   number_format=self.number_format)
        return functools.partial(_located_accuracy, self.answer_location, self.options)

    def example(self, record: dict[str, Any]) -> dict:
        """A record of `read_examples` with its "prompt": the template applied to its question, or
        to its messages (a list of messages stays a list)."""
        instruction = location_instruction(self.answer_location, self.template)
        raw = record.get("prompt")
        if not isinstance(raw, list) and self.chat:  # a text question, asked as a chat turn
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            raw = system + [{"role": "user", "content": record["question"]}]
        if isinstance(raw, list):
            prompt = apply_template_to_messages(self.template, raw, instruction)
        else:
            prompt = apply_template(self.template, record["question"], instruction)
        return {**record, "prompt": prompt}

    def extract_answer(self, completion: str) -> str | None:
        """The answer at `eval_location` (inside the <answer> block for r1), canonical for majority
        voting.

        Plain numbers become their exact fraction ("0.50", "\\frac{1}{2}", "1/2" -> "1/2"), so
        equal values vote together; other answers are the verifier's normalisation minus spaces.
        """
        answer = located_answer(completion, self.eval_location, self.template, _MAX_TEXT)
        if answer is None:
            return None
        normal = rewards.normalize_answer(answer, self.number_format)
        value = fast_number(normal)
        return str(value) if value is not None else re.sub(r"\s+", "", normal) or None

    def eval_correct(self, completion: str, example: dict) -> bool:
        """math_reward on the answer at `eval_location` (r1: it must sit inside the <answer> block)."""
        answer = located_answer(completion, self.eval_location, self.template, _MAX_TEXT)
        if answer is None:
            return False
        return rewards.verify(_as_boxed(answer), example["answer"], self.options) == 1.0


@dataclasses.dataclass
class JsonlTask:
    """Questions (or prompts, as text or messages) and reference answers from a JSONL or Parquet
    file, with the plain, R1 or no template."""

    name: ClassVar[str] = "jsonl"

    path: str = ""
    question_field: str = "question"
    answer_field: str = "answer"
    messages_field: str = "prompt"
    answer_format: str = "auto"
    template: str = "plain"
    answer_location: str = "boxed"
    eval_answer_location: str | None = None  # None: "lenient" when answer_location is "boxed", else the same
    approx_rtol: float = 0.0  # a decimal equals an exact constant within this relative error (0: never)
    number_format: str = "en"  # "comma": 1,5 is 1.5 and `;` separates entries (rewards.VerifyOptions)
    seed: int = 0
    eval_path: str | None = None
    eval_question_field: str | None = None
    eval_answer_field: str | None = None
    eval_answer_format: str | None = None
    eval_fraction: float = 0.1
    format_weight: float = 0.5  # lambda on the r1 format reward; < 1 (seed Part 3)
    # Text questions (training and held-out) as messages for the chat template: True, False, or None
    # (auto: as the training file's rows are, messages when any is). One prompt format per run.
    chat: bool | None = None
    system_prompt: str | None = None  # with chat: a system message before each wrapped question

    _train: list[dict] = dataclasses.field(default_factory=list, init=False, repr=False)
    _eval: list[dict] = dataclasses.field(default_factory=list, init=False, repr=False)
    # "file:line" of each example, aligned with _train / _eval, for messages about one example.
    _train_where: list[str] = dataclasses.field(default_factory=list, init=False, repr=False)
    _eval_where: list[str] = dataclasses.field(default_factory=list, init=False, repr=False)
    _order: tuple[int, list[int]] | None = dataclasses.field(default=None, init=False, repr=False)
    _checker: AnswerChecker = dataclasses.field(default_factory=AnswerChecker, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("path: give the data file (JSONL or Parquet), e.g. path='data/train.jsonl'")
        check_choice("answer_format", self.answer_format, ANSWER_FORMATS)
        if self.eval_answer_format is not None:
            check_choice("eval_answer_format", self.eval_answer_format, ANSWER_FORMATS)
        for field in ("question_field", "answer_field", "messages_field"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"{field}={getattr(self, field)!r}: give a field name")
        if self.chat is not None and not isinstance(self.chat, bool):
            raise ValueError(f"chat={self.chat!r}: must be true, false or null (auto: as the training rows are)")
        if self.eval_path is not None and (not isinstance(self.eval_path, str) or not self.eval_path):
            raise ValueError(f"eval_path={self.eval_path!r}: give a data file or one of {sorted(EVAL_SETS)}")
        check_int_range("seed", self.seed, 0)
        check_fraction("eval_fraction", self.eval_fraction)
        check_format_weight(self.format_weight)
        fields = Fields(self.question_field, self.answer_field, self.messages_field, self.answer_format)
        numbered = read_examples(self.path, fields)
        chat = any(isinstance(r.get("prompt"), list) for _, r in numbered) if self.chat is None else self.chat
        self._checker = AnswerChecker(self.template, self.answer_location, self.eval_answer_location,
                                      self.approx_rtol, self.number_format, chat, self.system_prompt)
        records = [self.example(r) for _, r in numbered]
        where = [w for w, _ in numbered]
        if self.eval_path is not None:
            eval_path, eval_fields = eval_data(self.eval_path, fields, self.eval_question_field,
                                               self.eval_answer_field, self.eval_answer_format)
            eval_numbered = read_examples(eval_path, eval_fields)
            self._eval = [self.example(r) for _, r in eval_numbered]
            self._eval_where = [w for w, _ in eval_numbered]
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

    def example(self, record: dict[str, Any]) -> dict:
        """A record of `read_examples` with its templated "prompt" (see `AnswerChecker.example`)."""
        return self._checker.example(record)

    @property
    def checker(self) -> AnswerChecker:
        """How this run builds prompts and checks answers (`chat` resolved): what `eval` reuses."""
        return self._checker

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

    def check_prompt_lengths(self, count_tokens: Callable[[Any], int], max_tokens: int,
                             on_overlong: str = "skip") -> dict[str, int]:
        """Tokenises every training and held-out prompt once; acts on those over `max_tokens`.

        count_tokens: a prompt (text, or a list of messages) -> its number of tokens as the sampler
          will see it, e.g. `lambda p: len(grpo_jax.training.rollout.encode_prompt(tokenizer, p))`.
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
        """The answer at `answer_location`, canonical for majority voting (`AnswerChecker`)."""
        return self._checker.extract_answer(completion)

    def eval_correct(self, completion: str, example: dict) -> bool:
        """math_reward on the answer at `answer_location` (r1: inside the <answer> block)."""
        return self._checker.eval_correct(completion, example)

    def reward_fns(self) -> list[RewardSpec]:
        """plain / none: accuracy at `answer_location`; r1: accuracy + format_weight * format reward."""
        accuracy = RewardSpec("math", self._checker.accuracy_reward(), 1.0)
        if self.template != "r1":
            return [accuracy]
        return [accuracy, RewardSpec("format", rewards.format_reward_fn, float(self.format_weight))]
