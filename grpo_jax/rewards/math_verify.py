"""The math verifier: the answer where the location says, compared with the ground truth by value.

Seed Part 2: a verifier that accepts any of several boxes, finds "1/3" in "1/3 or 1/2", or
defaults to "correct" when its parser crashes is a loophole that GRPO will find. Here:
- where the answer is (`location`): "boxed" (the training default) is exactly one `\\boxed` in the
  completion, closed, non-empty, at most MAX_INPUT_CHARS long; "lenient" (evaluation's default)
  also reads the last box, the Minerva phrase, "the answer is ..." and the final sentence's maths
  (`math_locate`), where a hedge still finds nothing;
- the answer text is normalised (documented in `normalize_answer`) and then compared:
  a fast path for plain integers, decimals and fractions (exact `fractions.Fraction`, no sympy),
  else `math_read` (labels, chains of equal sides, joined lists, `\\approx`), the bounded grammar
  of `math_parse` and the comparisons of `math_answers`, whose table says what each kind of answer
  means (intervals, sets, `\\pm`, matrices, base numerals, equations, inequalities, words);
- a decimal approximation of an exact constant counts only within `approx_rtol` (default 0: never);
- anything unparseable, any exception, any timeout scores 0.0. Nothing reaches eval/sympify.

Measured on MATH-500 (`grpo_jax/assets/data/math500_test.jsonl`, tests/test_rewards_math.py): every
gold answer, and the last box of every gold solution, scores 1.0 against the gold answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fractions
import functools
import math
import re
import signal
import threading
from collections.abc import Sequence

from grpo_jax.rewards.math_locate import lenient_answer
from grpo_jax.rewards.math_normalize import normalize_answer
from grpo_jax.rewards.math_parse import MAX_INPUT_CHARS, MathParseError
from grpo_jax.rewards.math_read import fractions_approximate, read_answer, readings_equal

DEFAULT_TIMEOUT_S = 1.0  # wall clock per answer for the sympy path when run inline (main thread)
LOCATIONS = ("boxed", "lenient")
NUMBER_FORMATS = ("en", "comma")


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """How the verifier reads a completion and compares its answer.

    location: "boxed" (exactly one `\\boxed{}`; the training default, which the hedging defences
      rely on) or "lenient" (`math_locate`: the last box, the Minerva phrase, "the answer is",
      the final sentence's maths).
    approx_rtol: a decimal (`3.14`, `x \\approx 0.333`) equals an exact constant (`\\pi`, `1/3`)
      within this relative error; 0 (default): only exact values, as MATH's "express exactly" asks.
      An exact constant that can be written with as many decimals (`0.5`, `100`) never matches
      an approximation. Below 1.
    number_format: "en" (`1,000` and `1 000` group thousands, `.` is the decimal point, `1,2` is
      the list 1, 2) or "comma" (`1,5` is 1.5, `1.000` and `1 000` group thousands, `;`
      separates list entries: `(1; 2)`).
    """

    location: str = "boxed"
    approx_rtol: float = 0.0
    number_format: str = "en"

    def __post_init__(self):
        if self.location not in LOCATIONS:
            raise ValueError(f"location={self.location!r}; choose one of {list(LOCATIONS)}")
        if self.number_format not in NUMBER_FORMATS:
            raise ValueError(f"number_format={self.number_format!r}; choose one of {list(NUMBER_FORMATS)}")
        rtol = self.approx_rtol
        if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not (math.isfinite(rtol) and 0 <= rtol < 1):
            raise ValueError(f"approx_rtol={rtol!r}: give a relative tolerance in [0, 1), e.g. 1e-4 (0: exact only)")


@functools.lru_cache(maxsize=64)
def verify_options(location: str = "boxed", approx_rtol: float = 0.0, number_format: str = "en") -> VerifyOptions:
    """A validated, shared `VerifyOptions` (validation runs once per distinct setting)."""
    return VerifyOptions(location, approx_rtol, number_format)

# ------------------------------------------------------------------------------------------------
# Extraction


def extract_boxed(completion: str) -> str | None:
    """The content of the single `\\boxed{...}` in `completion`, or None.

    None when there is no box, more than one (`\\boxed` or `\\fbox` anywhere counts: hedging over
    several boxes is the first hack of seed Part 2), an unclosed box, or an empty one. Nested braces
    are matched, so `\\boxed{\\frac{1}{3}}` gives `\\frac{1}{3}`.
    """
    if not isinstance(completion, str):
        return None
    count = completion.count("\\boxed") + completion.count("\\fbox")
    if count != 1:
        return None
    start = completion.find("\\boxed")
    if start < 0:
        return None
    pos = start + len("\\boxed")
    while pos < len(completion) and completion[pos] == " ":
        pos += 1
    if pos >= len(completion) or completion[pos] != "{":
        return None
    depth = 0
    limit = min(len(completion), pos + MAX_INPUT_CHARS + 2)
    for j in range(pos, limit):
        ch = completion[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                content = completion[pos + 1 : j].strip()
                return content or None
    return None  # unclosed, or longer than any answer we accept


# ------------------------------------------------------------------------------------------------
# Fast path: plain numbers, exact, no sympy

_INT_RE = re.compile(r"[+-]?\d+", re.ASCII)
_DEC_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)", re.ASCII)
_SLASH_RE = re.compile(r"([+-]?)(\d+)\s*/\s*(\d+)", re.ASCII)
# `\\frac{3}{4}`, and LaTeX's one-digit arguments `\\frac34`, `\\frac 59`, `\\frac9{19}`, `\\frac{270}7`.
_FRAC_RE = re.compile(
    r"([+-]?)\\frac\s*(?:\{\s*([+-]?\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))", re.ASCII)
_FAST_MAX_DIGITS = 400


def fast_number(s: str) -> fractions.Fraction | None:
    """Exact value of a normalised plain integer/decimal/fraction, or None when sympy is needed."""
    if len(s) > _FAST_MAX_DIGITS:
        return None
    if _INT_RE.fullmatch(s):
        return fractions.Fraction(int(s))
    if _DEC_RE.fullmatch(s):
        sign = -1 if s.startswith("-") else 1
        whole, _, frac = s.lstrip("+-").partition(".")
        return sign * fractions.Fraction(int((whole or "0") + frac), 10 ** len(frac))
    if m := _SLASH_RE.fullmatch(s):
        sign, num, den = m.groups()
    elif m := _FRAC_RE.fullmatch(s):
        sign, num, den = m.group(1), m.group(2) or m.group(3), m.group(4) or m.group(5)
    else:
        return None
    if int(den) == 0:
        return None  # let the parser reject it with a reason
    value = fractions.Fraction(int(num), int(den))
    return -value if sign == "-" else value


def _located(completion: str, location: str) -> str | None:
    return extract_boxed(completion) if location == "boxed" else lenient_answer(completion)


def _fast_answers(found: str, answer: str, options: VerifyOptions) -> float | None:
    """1.0/0.0 when the found answer and the reference are plain numbers, else None."""
    pred_s = normalize_answer(found, options.number_format)
    pred = fast_number(pred_s)
    if pred is None:
        return None
    truth_s = normalize_answer(answer, options.number_format)
    truth = fast_number(truth_s)
    if truth is None:
        return None
    return 1.0 if _numbers_equal(pred_s, pred, truth_s, truth, options.approx_rtol) else 0.0


def _numbers_equal(pred_s: str, pred, truth_s: str, truth, rtol: float) -> bool:
    """Plain numbers: exactly equal, or one a decimal approximating the other within `rtol`."""
    if pred == truth:
        return True
    if rtol <= 0 or (_DEC_RE.fullmatch(pred_s) is None) == (_DEC_RE.fullmatch(truth_s) is None):
        return False  # exact only, or both (or neither) decimals: no approximation to accept
    if _DEC_RE.fullmatch(pred_s):
        return fractions_approximate(pred_s, pred, truth, rtol)
    return fractions_approximate(truth_s, truth, pred, rtol)


def fast_math_reward(completion: str, answer: str, *, location: str = "boxed", approx_rtol: float = 0.0,
                     number_format: str = "en") -> float | None:
    """1.0/0.0 when both sides are plain numbers (microseconds), None when the slow path is needed."""
    options = verify_options(location, approx_rtol, number_format)
    found = _located(completion, options.location)
    if found is None:
        return 0.0
    return _fast_answers(found, answer, options)


# ------------------------------------------------------------------------------------------------
# Slow path: the bounded grammar and sympy


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """SIGALRM wall-clock limit, only on the main thread (signals are delivered there only).

    Pure-Python sympy work is interrupted; a single long C call is not, which is why the parser
    bounds sizes first and the VerifierPool kills a worker as the last line of defence.
    """
    usable = seconds is not None and seconds > 0 and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def answers_equal(pred_text: str, truth_text: str, *, approx_rtol: float = 0.0,
                  number_format: str = "en") -> bool:
    """True when two answer strings are equal by value (normalised, read, compared). May raise.

    Reading (`math_read`): a label on one side only is ignored (`x = 5` equals `5`, `AB = 4, CD = 5`
    equals `4, 5` in that order, `x \\in [-2, 7]` equals `[-2, 7]`); on both sides labels must agree.
    Against an equation the assignment is that equation (`y = 2x+3` equals `2x - y + 3 = 0`); an
    inequality in one letter equals its interval (`x \\le 3` equals `(-\\infty, 3]`). Words
    (`\\text{Evelyn}`) equal only the same words. Approximations: see `VerifyOptions.approx_rtol`.
    """
    pred_s, truth_s = normalize_answer(pred_text, number_format), normalize_answer(truth_text, number_format)
    fp, ft = fast_number(pred_s), fast_number(truth_s)
    if fp is not None and ft is not None:
        return _numbers_equal(pred_s, fp, truth_s, ft, approx_rtol)
    return readings_equal(read_answer(pred_s), read_answer(truth_s), approx_rtol)


def math_reward(completion: str, answer: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                location: str = "boxed", approx_rtol: float = 0.0, number_format: str = "en") -> float:
    """1.0 when the answer at `location` in `completion` equals `answer` by value, else 0.0.

    location "boxed": exactly one `\\boxed{}` (training); "lenient": `math_locate`'s rules
    (evaluation). `approx_rtol`, `number_format`: see `VerifyOptions` (bad options raise ValueError).
    Never raises on model text: unparseable text, exceptions inside sympy and the `timeout_s`
    wall-clock limit (main thread only) all score 0.0.
    """
    return verify(completion, answer, verify_options(location, approx_rtol, number_format), timeout_s)


def verify(completion: str, answer: str, options: VerifyOptions = VerifyOptions(),
           timeout_s: float | None = DEFAULT_TIMEOUT_S) -> float:
    """`math_reward` with its options as one `VerifyOptions` (what the pool's workers run)."""
    try:
        found = _located(completion, options.location)
        if found is None:
            return 0.0
        fast = _fast_answers(found, answer, options)
        if fast is not None:
            return fast
        with _time_limit(timeout_s):
            equal = answers_equal(found, answer, approx_rtol=options.approx_rtol, number_format=options.number_format)
            return 1.0 if equal else 0.0
    except (_Timeout, MathParseError, RecursionError, MemoryError, ArithmeticError, TypeError, ValueError,
            AttributeError):
        return 0.0
    except Exception:  # noqa: BLE001 -- a checker bug must never default to "correct" (seed Part 2)
        return 0.0


# ------------------------------------------------------------------------------------------------
# RewardFn


def math_accuracy_reward(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str],
                         pool=None, **_) -> list[float]:
    """RewardFn: `math_reward` per completion (one box); the sympy cases go to `pool` (a VerifierPool).

    The fast path (plain numbers on both sides) runs inline: it costs microseconds, less than
    sending the item to a worker. Only the rest, which may be slow, goes to the pool, where a hung
    or crashed check costs one 0.0. Other options: `math_accuracy_reward_fn`.
    """
    return _accuracy(VerifyOptions(), prompts, completions, answer=answer, pool=pool)


def math_accuracy_reward_fn(*, location: str = "boxed", approx_rtol: float = 0.0, number_format: str = "en"):
    """`math_accuracy_reward` with these options bound (see `VerifyOptions`), e.g. the lenient one:

        rewards.math_accuracy_reward_fn(location="lenient", approx_rtol=1e-4)

    The options are bound positionally, so no example field of the batch can override them.
    """
    return functools.partial(_accuracy, verify_options(location, approx_rtol, number_format))


def _accuracy(options: VerifyOptions, prompts: Sequence[str], completions: Sequence[str], /, *,
              answer: Sequence[str], pool=None, **_) -> list[float]:
    if len(answer) != len(completions):
        raise ValueError(f"math_accuracy_reward: answer has {len(answer)} entries, completions {len(completions)}")
    scores: list[float | None] = []
    slow: list[int] = []
    for i, (c, a) in enumerate(zip(completions, answer)):
        try:
            found = _located(c, options.location)
            fast = 0.0 if found is None else _fast_answers(found, str(a), options)
        except Exception:  # noqa: BLE001 -- never raise on model text
            fast = 0.0
        scores.append(fast)
        if fast is None:
            slow.append(i)
    if slow:
        items = [(completions[i], str(answer[i]), options) for i in slow]
        if pool is not None:
            values = pool.map(verify, items)
        else:
            values = [verify(c, a, o) for c, a, o in items]
        for i, v in zip(slow, values):
            scores[i] = float(v)
    return [float(s) for s in scores]
