"""Countdown: reach a target from given numbers with + - * / and parentheses, each number once.

Instances are solvable by construction: the generator combines the drawn numbers into a random
expression (intermediate results positive integers, divisions exact) and takes its value as the
target. The held-out split hashes (sorted numbers, target), so training never sees an eval problem.

The checker reads model text, so it is built for hostile input: its own tokenizer and
recursive-descent parser (no eval, exec, sympify or parse_expr), a whitelist of ASCII characters
("0-9 + - * / ( ) =" and spaces), bounded length, token count, nesting depth and number size, and
exact arithmetic with Fractions. An answer is correct when the completion has exactly one
<answer>...</answer> block holding exactly one equation, "expr" or "expr = target", whose numbers
are the given ones (each exactly once, no unary minus, no leading zeros) and whose value is the
target exactly.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction
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

TEMPLATES = ("plain", "r1")
MAX_ANSWER_CHARS = 256
MAX_TOKENS = 128
MAX_DEPTH = 32
MAX_NUMBER_DIGITS = 7
_OPERATOR_CHARS = "+-*/()="
_SPACES = " \t\r\n"

_INSTRUCTIONS = {
    "plain": "Put the equation alone in <answer> </answer> tags, e.g. <answer>(1 + 2) * 3</answer>.",
    "r1": "Write only the equation in the answer, e.g. (1 + 2) * 3.",
}


class _Reject(Exception):
    """Internal: the text is not one well-formed equation (always caught, becomes a 0)."""


def tokenize(text: str) -> list[str]:
    """'(3+5) * 3' -> ['(', '3', '+', '5', ')', '*', '3']; raises _Reject on anything else.

    Digits and "+-*/()=" are the only symbols: unicode look-alikes ("×", "−", "÷", full-width
    digits) are rejected rather than mapped, so a model cannot pass with lookalike text.
    """
    if len(text) > MAX_ANSWER_CHARS:
        raise _Reject("too long")
    tokens: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in _SPACES:
            i += 1
        elif c in _OPERATOR_CHARS:
            tokens.append(c)
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            number = text[i:j]
            if len(number) > MAX_NUMBER_DIGITS or (len(number) > 1 and number[0] == "0"):
                raise _Reject("number too long or with a leading zero")
            tokens.append(number)
            i = j
        else:
            raise _Reject(f"character {c!r}")
        if len(tokens) > MAX_TOKENS:
            raise _Reject("too many tokens")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := NUM | '(' expr ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _Reject("unexpected end")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise _Reject("division by zero")
            else:
                value = value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        token = self.take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise _Reject("nested too deep")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise _Reject("unclosed parenthesis")
            return value
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise _Reject(f"unexpected {token!r}")  # includes unary minus and stray operators


def parse_equation(text: str) -> tuple[Fraction, list[int], str] | None:
    """'(3+5)*3 = 24' -> (Fraction(24), [3, 5, 3], '(3+5)*3'); None unless it is one equation.

    Returns the left side's exact value, the numbers it uses in order, and its canonical text
    (tokens without spaces). A right side, when present, must be a single number equal to that value.
    """
    if not isinstance(text, str):
        return None
    try:
        tokens = tokenize(text)
        if tokens.count("=") > 1:
            raise _Reject("more than one '='")
        if "=" in tokens:
            split = tokens.index("=")
            left, right = tokens[:split], tokens[split + 1 :]
            if len(right) != 1 or not right[0].isdigit():
                raise _Reject("right side is not one number")
        else:
            left, right = tokens, []
        parser = _Parser(left)
        value = parser.expr(0)
        if parser.pos != len(left):
            raise _Reject("text after the expression")
        if right and Fraction(int(right[0])) != value:
            return None
        return value, parser.numbers, "".join(left)
    except (_Reject, RecursionError):
        return None


def check_countdown(answer_text: str | None, numbers: list[int], target: int) -> bool:
    """True when `answer_text` is one equation using each of `numbers` once and equal to `target`."""
    if answer_text is None:
        return False
    parsed = parse_equation(answer_text)
    if parsed is None:
        return False
    value, used, _ = parsed
    return Counter(used) == Counter(int(n) for n in numbers) and value == Fraction(int(target))


@dataclasses.dataclass
class CountdownTask:
    """Seeded, solvable Countdown instances with a disjoint held-out split."""

    name: ClassVar[str] = "countdown"

    num_numbers: int = 4
    min_number: int = 1
    max_number: int = 99
    min_target: int = 1
    max_target: int = 999
    template: str = "plain"
    seed: int = 0
    eval_size: int = 500
    eval_fraction: float = 0.1
    format_weight: float = 0.5  # lambda on the r1 format reward; < 1 (seed Part 3)

    _eval_cache: list[dict] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        check_int_range("num_numbers", self.num_numbers, 3, 6)
        check_int_range("min_number", self.min_number, 1, 10**6)
        check_int_range("max_number", self.max_number, self.min_number, 10**6)
        check_int_range("min_target", self.min_target, 1)
        check_int_range("max_target", self.max_target, self.min_target, 10**MAX_NUMBER_DIGITS - 1)
        check_choice("template", self.template, TEMPLATES)
        check_int_range("seed", self.seed, 0)
        check_int_range("eval_size", self.eval_size, 1)
        check_fraction("eval_fraction", self.eval_fraction, allow_zero=False)
        check_format_weight(self.format_weight)

    # --- problems ---------------------------------------------------------------------------

    def _draw(self, rng) -> tuple[list[int], int, str]:
        """Numbers, a reachable target in range, and one solution; retried until one fits."""
        for _ in range(1_000):
            numbers = [rng.randint(self.min_number, self.max_number) for _ in range(self.num_numbers)]
            pool = [(n, str(n)) for n in numbers]
            while len(pool) > 1:
                a = pool.pop(rng.randrange(len(pool)))
                b = pool.pop(rng.randrange(len(pool)))
                op = rng.choice("+-*/")
                match op:  # keep every intermediate a positive integer, as in the game
                    case "+":
                        value = a[0] + b[0]
                    case "*":
                        value = a[0] * b[0]
                    case "-":
                        if a[0] < b[0]:
                            a, b = b, a
                        value = a[0] - b[0]
                    case "/":
                        if a[0] % b[0]:
                            a, b = b, a
                        value = a[0] // b[0] if a[0] % b[0] == 0 else 0
                if value <= 0:
                    break  # an inexact division: draw again
                pool.append((value, f"({a[1]}{op}{b[1]})"))
            else:
                target, text = pool[0]
                if self.min_target <= target <= self.max_target:
                    return numbers, target, text[1:-1]
        raise RuntimeError(
            f"countdown: no target in [{self.min_target}, {self.max_target}] reached in 1,000 tries; "
            f"widen the target range or change min_number/max_number"
        )

    def is_eval_problem(self, numbers: list[int], target: int) -> bool:
        """Held-out membership from (sorted numbers, target); independent of seed and template."""
        return unit_hash("countdown-split", sorted(numbers), target) < self.eval_fraction

    def make_example(self, numbers: list[int], target: int, solution: str) -> dict:
        """Prompt, answer (the target, as text), "numbers", "target" and one known "solution"."""
        question = (
            f"Using the numbers {list(numbers)}, write an equation that equals {target}. Use each "
            "number exactly once, with only + - * / and parentheses."
        )
        return {
            "prompt": apply_template(self.template, question, _INSTRUCTIONS[self.template]),
            "answer": str(target),
            "numbers": list(numbers),
            "target": target,
            "solution": solution,
        }

    def train_example(self, index: int) -> dict:
        """Example `index` of the unlimited training stream; a pure function of (seed, index)."""
        rng = example_rng("countdown-train", self.seed, check_index(index))
        for _ in range(1_000):
            numbers, target, solution = self._draw(rng)
            if not self.is_eval_problem(numbers, target):
                return self.make_example(numbers, target, solution)
        raise RuntimeError(f"no training problem in 1,000 draws; lower eval_fraction={self.eval_fraction}")

    def eval_examples(self) -> list[dict]:
        """The fixed held-out set: `eval_size` distinct held-out problems, the same for every seed."""
        if self._eval_cache is None:
            rng = example_rng(
                "countdown-eval", self.num_numbers, self.min_number, self.max_number,
                self.min_target, self.max_target,
            )
            seen, examples = set(), []
            for _ in range(int(200 * self.eval_size / self.eval_fraction)):
                numbers, target, solution = self._draw(rng)
                key = (tuple(sorted(numbers)), target)
                if key not in seen and self.is_eval_problem(numbers, target):
                    seen.add(key)
                    examples.append(self.make_example(numbers, target, solution))
                    if len(examples) == self.eval_size:
                        break
            self._eval_cache = examples
        return [dict(e) for e in self._eval_cache]

    # --- checking ---------------------------------------------------------------------------

    def extract_answer(self, completion: str) -> str | None:
        """The canonical equation (left side, no spaces) in the single <answer> block, or None."""
        parsed = parse_equation(answer_block(completion, MAX_ANSWER_CHARS * 64) or "")
        return None if parsed is None else parsed[2]

    def score(self, completion: str, numbers: list[int], target: int) -> float:
        """1.0 for a correct equation in the completion's single <answer> block, else 0.0."""
        block = answer_block(completion, MAX_ANSWER_CHARS * 64)
        return float(check_countdown(block, numbers, target))

    def eval_correct(self, completion: str, example: dict) -> bool:
        return self.score(completion, example["numbers"], example["target"]) == 1.0

    def reward_fns(self) -> list[RewardSpec]:
        """plain: the equation check; r1: the check + format_weight * format reward."""
        accuracy = RewardSpec(
            "countdown", batched_reward("countdown", self.score, ["numbers", "target"]), 1.0
        )
        if self.template == "plain":
            return [accuracy]
        return [accuracy, RewardSpec("format", rewards.format_reward_fn, float(self.format_weight))]
