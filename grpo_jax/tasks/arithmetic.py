"""Arithmetic problems ("07+45=" -> "52"), generated from a seed without limit.

Templates:
  * "compact": the CPU demo. Prompt "07+45=" (operands zero-padded to `digits`), answer digits only;
    `reverse_answer=True` writes it least-significant digit first ("52" -> "25", "140" -> "041"),
    the order in which a left-to-right model can compute carries. Compact text uses only
    "0123456789+=", the demo tokenizer's symbols; the "-" and "*" operators add the symbols "-" and
    "*" (a negative difference is written "-12", reversed "-21": sign first, digits reversed).
    Reward: exact match of the stripped completion (1.0 / 0.0).
  * "plain": "What is 7+45? Put the answer in \\boxed{}." with `math_reward`.
  * "r1": the R1 think/answer template, accuracy plus `format_weight` times the format reward.

Held-out split: a problem belongs to the evaluation set when a hash of its canonical text ("7+45")
is below `eval_fraction`, whatever the seed, digits or template. The training sampler redraws such
problems, so training never sees an evaluation problem (2-digit addition has only 10,000).

Difficulty knobs: `digits` (operand width), `num_operands`, `operators`, and `min_digits`: None
draws each operand uniformly from [0, 10**digits); an int k first draws a digit count uniformly
from [k, digits], then a number of that many digits, which raises the share of long operands
(k = digits) or of short ones (k = 1, a curriculum start).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from typing import ClassVar

from grpo_jax import rewards

from .base import (
    RewardSpec,
    batched_reward,
    check_choice,
    check_format_weight,
    check_fraction,
    check_index,
    check_int_range,
    example_rng,
    unit_hash,
)
from .templates import answer_block, apply_template

TEMPLATES = ("compact", "plain", "r1")
OPERATORS = "+-*"
# Enumerate the whole problem space for the eval split below this size; sample above it.
_ENUMERATE_LIMIT = 100_000
_MAX_TEXT = 10_000  # longer completions are wrong without being read

# re.ASCII: without it \d also matches other scripts' digits, and int("٥٢") is 52.
_INT = re.compile(r"-?\d+", re.ASCII)
_BOXED_INT = re.compile(r"\\boxed\{\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+))\s*\}", re.ASCII)


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with * before + and -, left to right.

    Example: [2, 3, 4] with ["+", "*"] -> 2 + 12 = 14.
    """
    terms = [operands[0]]  # signed terms of the sum, products folded in as we go
    for op, x in zip(ops, operands[1:]):
        match op:
            case "*":
                terms[-1] *= x
            case "+":
                terms.append(x)
            case "-":
                terms.append(-x)
            case _:
                raise ValueError(f"operator {op!r} is not one of {list(OPERATORS)}")
    return sum(terms)


def write_answer(value: int, reverse: bool) -> str:
    """52 -> "52" ("25" reversed); 140 -> "041" reversed; -12 -> "-21" reversed (sign stays first)."""
    digits = str(abs(value))
    if reverse:
        digits = digits[::-1]
    return f"-{digits}" if value < 0 else digits


@dataclasses.dataclass
class ArithmeticTask:
    """Seeded arithmetic problems with a disjoint held-out split (see the module docstring)."""

    name: ClassVar[str] = "arithmetic"

    digits: int = 2
    operators: str = "+"
    num_operands: int = 2
    reverse_answer: bool = False
    template: str = "compact"
    seed: int = 0
    eval_size: int = 500
    eval_fraction: float = 0.1
    min_digits: int | None = None
    format_weight: float = 0.5  # lambda on the r1 format reward; < 1 (seed Part 3)

    _eval_cache: list[dict] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        check_int_range("digits", self.digits, 1, 9)
        if not isinstance(self.operators, str) or not self.operators:
            raise ValueError(f"operators={self.operators!r}: give a non-empty string of {OPERATORS!r}")
        bad = sorted(set(self.operators) - set(OPERATORS))
        if bad or len(set(self.operators)) != len(self.operators):
            raise ValueError(
                f"operators={self.operators!r}: each of {list(OPERATORS)} at most once, e.g. '+' or '+-*'"
            )
        check_int_range("num_operands", self.num_operands, 2, 6)
        if not isinstance(self.reverse_answer, bool):
            raise ValueError(f"reverse_answer must be True or False, got {self.reverse_answer!r}")
        check_choice("template", self.template, TEMPLATES)
        if self.reverse_answer and self.template != "compact":
            raise ValueError(
                f"reverse_answer=True needs template='compact', got template={self.template!r}"
            )
        check_int_range("seed", self.seed, 0)
        check_int_range("eval_size", self.eval_size, 1)
        check_fraction("eval_fraction", self.eval_fraction, allow_zero=False)
        if self.min_digits is not None:
            check_int_range("min_digits", self.min_digits, 1, self.digits)
        check_format_weight(self.format_weight)

    # --- problems ---------------------------------------------------------------------------

    def _operand(self, rng) -> int:
        if self.min_digits is None:
            return rng.randrange(10**self.digits)
        d = rng.randint(self.min_digits, self.digits)
        return rng.randrange(10 ** (d - 1) if d > 1 else 0, 10**d)

    def _allowed_operand(self, x: int) -> bool:
        return self.min_digits is None or len(str(x)) >= self.min_digits

    @staticmethod
    def problem_text(operands: list[int], ops: list[str]) -> str:
        """Canonical, unpadded text of a problem, e.g. "7+45"; the key of the held-out split."""
        parts = [str(operands[0])]
        for op, x in zip(ops, operands[1:]):
            parts += [op, str(x)]
        return "".join(parts)

    def is_eval_problem(self, operands: list[int], ops: list[str]) -> bool:
        """True when the problem belongs to the held-out split (independent of seed and template)."""
        return unit_hash("arithmetic-split", self.problem_text(operands, ops)) < self.eval_fraction

    def make_example(self, operands: list[int], ops: list[str]) -> dict:
        """The example dict for one problem: prompt, answer, and the fields "operands", "ops", "value"."""
        value = evaluate(operands, ops)
        if self.template == "compact":
            padded = [str(x).zfill(self.digits) for x in operands]
            prompt = padded[0] + "".join(op + x for op, x in zip(ops, padded[1:])) + "="
            answer = write_answer(value, self.reverse_answer)
        else:
            prompt = apply_template(self.template, f"What is {self.problem_text(operands, ops)}?")
            answer = str(value)
        return {
            "prompt": prompt,
            "answer": answer,
            "operands": list(operands),
            "ops": list(ops),
            "value": value,
        }

    def _draw(self, rng) -> tuple[list[int], list[str]]:
        operands = [self._operand(rng) for _ in range(self.num_operands)]
        ops = [rng.choice(self.operators) for _ in range(self.num_operands - 1)]
        return operands, ops

    def train_example(self, index: int) -> dict:
        """Example `index` of the unlimited training stream; a pure function of (seed, index)."""
        rng = example_rng("arithmetic-train", self.seed, check_index(index))
        for _ in range(10_000):
            operands, ops = self._draw(rng)
            if not self.is_eval_problem(operands, ops):
                return self.make_example(operands, ops)
        raise RuntimeError(  # only when nearly every problem is held out
            f"no training problem found in 10,000 draws; lower eval_fraction={self.eval_fraction}"
        )

    def _space_size(self) -> int:
        return (10**self.digits) ** self.num_operands * len(self.operators) ** (self.num_operands - 1)

    def eval_examples(self) -> list[dict]:
        """The fixed held-out set: `eval_size` distinct held-out problems, the same for every seed.

        Small problem spaces are enumerated (2-digit addition holds about 1,000 held-out problems);
        if fewer than `eval_size` exist, all of them are returned, with a warning.
        """
        if self._eval_cache is not None:
            return [dict(e) for e in self._eval_cache]
        rng = example_rng("arithmetic-eval", self.digits, self.operators, self.num_operands)
        if self._space_size() <= _ENUMERATE_LIMIT:
            numbers = [x for x in range(10**self.digits) if self._allowed_operand(x)]
            problems = [
                (list(xs), list(os_))
                for xs in itertools.product(numbers, repeat=self.num_operands)
                for os_ in itertools.product(self.operators, repeat=self.num_operands - 1)
                if self.is_eval_problem(list(xs), list(os_))
            ]
            rng.shuffle(problems)
            problems = problems[: self.eval_size]
        else:
            seen, problems = set(), []
            max_draws = int(200 * self.eval_size / self.eval_fraction)
            for _ in range(max_draws):
                operands, ops = self._draw(rng)
                key = self.problem_text(operands, ops)
                if key not in seen and self.is_eval_problem(operands, ops):
                    seen.add(key)
                    problems.append((operands, ops))
                    if len(problems) == self.eval_size:
                        break
        if len(problems) < self.eval_size:
            warnings.warn(
                f"arithmetic: only {len(problems)} held-out problems exist for digits={self.digits}, "
                f"operators={self.operators!r}, num_operands={self.num_operands}, "
                f"eval_fraction={self.eval_fraction}; eval_size={self.eval_size} was asked for",
                stacklevel=2,
            )
        self._eval_cache = [self.make_example(xs, os_) for xs, os_ in problems]
        return [dict(e) for e in self._eval_cache]

    # --- checking ---------------------------------------------------------------------------

    def extract_answer(self, completion: str) -> str | None:
        """The final answer, normalised for majority voting, or None when there is none.

        compact: the stripped completion when it is a (signed) digit string, as written.
        plain: the integer in the single \\boxed{} ("1,052" -> "1052").
        r1: the same, and that box must sit inside the single <answer> block.
        """
        if not isinstance(completion, str) or len(completion) > _MAX_TEXT:
            return None
        if self.template == "compact":
            text = completion.strip()
            return text if _INT.fullmatch(text) and len(text) <= 40 else None
        if completion.count("\\boxed") != 1:
            return None
        region = completion if self.template == "plain" else answer_block(completion)
        if region is None:
            return None
        match = _BOXED_INT.search(region)
        if match is None or len(match.group(1)) > 60:
            return None
        return str(int(match.group(1).replace(",", "")))

    def eval_correct(self, completion: str, example: dict) -> bool:
        """The held-out check: its own strict integer parser, not the training reward's."""
        got = self.extract_answer(completion)
        return got is not None and got == example["answer"]

    def reward_fns(self) -> list[RewardSpec]:
        """compact: exact match; plain: math accuracy; r1: accuracy + format_weight * format."""
        if self.template == "compact":

            def exact(completion: str, answer: str) -> float:
                return float(isinstance(completion, str) and completion.strip() == answer)

            return [RewardSpec("exact_match", batched_reward("exact_match", exact, ["answer"]), 1.0)]
        accuracy = RewardSpec("math", rewards.math_accuracy_reward, 1.0)
        if self.template == "plain":
            return [accuracy]
        return [accuracy, RewardSpec("format", rewards.format_reward_fn, float(self.format_weight))]
