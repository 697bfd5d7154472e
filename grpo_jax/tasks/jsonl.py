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
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from grpo_jax import rewards

from .answer_checker import (  # noqa: F401 (importable from here, as before the split)
    AnswerChecker,
    answer_tag_accuracy_reward,
    gsm8k_accuracy_reward,
)
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
from .data_files import EVAL_SETS
from .jsonl_read import (  # noqa: F401 (importable from here, as before the split)
    ANSWER_FORMATS,
    Fields,
    eval_data,
    extract_reference,
    last_boxed,
    question_key,
    read_examples,
    read_jsonl,
)

OVERLONG_CHOICES = ("skip", "error")
_SHOWN_LOCATIONS = 5  # over-long examples named in the warning or error; the rest are counted

log = logging.getLogger(__name__)


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
            held_out = {question_key(e["question"]) for e in self._eval}
            member = [question_key(r["question"]) in held_out for r in records]
        else:
            member = [
                unit_hash("jsonl-split", question_key(r["question"])) < self.eval_fraction
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
