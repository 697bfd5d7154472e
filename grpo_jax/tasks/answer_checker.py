"""How a data set's prompts are built and its completions checked (`AnswerChecker`): the template,
where the model's answer is, the training accuracy reward there, and evaluation's answer reading
and comparison with the reference by value. The jsonl task's, and the eval command's for any file.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

from grpo_jax import rewards
from grpo_jax.rewards.math_verify import fast_number

from .base import check_choice
from .templates import (
    ANSWER_LOCATIONS,
    TEMPLATES,
    apply_template,
    apply_template_to_messages,
    located_answer,
    location_instruction,
)

_MAX_TEXT = 20_000


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
