"""The strict math verifier: exactly one `\\boxed{}`, compared with the ground truth by value.

Seed Part 2: a verifier that accepts any of several boxes, finds "1/3" in "1/3 or 1/2", or
defaults to "correct" when its parser crashes is a loophole that GRPO will find. Here:
- exactly one `\\boxed` in the completion, closed, non-empty, at most MAX_INPUT_CHARS long;
- the answer text is normalised (documented in `normalize_answer`) and then compared:
  a fast path for plain integers, decimals and fractions (exact `fractions.Fraction`, no sympy),
  else the bounded grammar of `math_parse` and the comparisons of `math_answers`, whose table says
  what each kind of answer means (intervals, sets, `\\pm`, matrices, base numerals, equations,
  inequalities, words);
- anything unparseable, any exception, any timeout scores 0.0. Nothing reaches eval/sympify.

Measured on MATH-500 (`grpo_jax/assets/data/math500_test.jsonl`, tests/test_rewards_math.py): every
gold answer, and the last box of every gold solution, scores 1.0 against the gold answer.
"""

from __future__ import annotations

import contextlib
import fractions
import functools
import re
import signal
import threading
from collections.abc import Sequence

import sympy

from grpo_jax.rewards.math_answers import Relation, Text, Unordered, answer_values_equal
from grpo_jax.rewards.math_parse import MAX_INPUT_CHARS, MathParseError, parse_math

DEFAULT_TIMEOUT_S = 1.0  # wall clock per answer for the sympy path when run inline (main thread)

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
# Normalisation

_UNIT_WORDS = (
    "cm|mm|km|m|kg|g|mg|s|sec|seconds|minutes|min|hours|hrs|h|days|weeks|years|"
    "dollars|cents|units|degrees|inches|inch|feet|foot|ft|meters|metres|miles|mph|"
    "liters|litres|ml|l|pounds|lbs|ounces|oz|square|sq|cubic|percent"
)
_TEXT_CMDS = r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|boldsymbol)"
# A whole answer in words: `\text{Evelyn}`, `\textbf{(C)}`. It is the answer, never a unit to drop.
_WHOLE_TEXT_RE = re.compile(rf"{_TEXT_CMDS}\{{([^{{}}\\]*)\}}")
# A trailing unit: `\text{ cm}`, `\mbox{dollars}`, `\mathrm{kg}^2`, or bare `cm^2` after a number.
_TRAILING_TEXT_RE = re.compile(rf"(?<=\S)\s*{_TEXT_CMDS}\{{\s*([A-Za-z][A-Za-z .]*)\}}(?:\^\{{?[23]\}}?)?\s*$")
_TRAILING_UNIT_RE = re.compile(rf"(?<=[\d}}\s])\s*(?:{_UNIT_WORDS})(?:\^\{{?[23]\}}?)?\s*$", re.ASCII)
_WRAPPER_RE = re.compile(rf"{_TEXT_CMDS}\{{([^{{}}]*)\}}")
# Words that make a trailing `\text{...}` a hedge or a sentence, not a unit: `3 \text{ or four}`.
_NOT_UNITS = frozenset(["or", "and", "nor", "not", "either", "neither", "but", "plus", "minus", "times", "over", "than", "maybe"])
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
_DELIMITERS = (("\\(", "\\)"), ("\\[", "\\]"))
_REMOVE = (
    "\\left", "\\right", "\\displaystyle", "~", "\\$", "$", "^\\circ", "^{\\circ}", "\\circ", "\\%", "%",
    "\u00b0",
)
# LaTeX spacing (`\,` `\!` `\;` `\:` `\ ` `\quad`), read left to right so a matrix row break `\\`
# followed by a space is kept.
_SPACING_RE = re.compile(r"\\\\|\\[ ,;:!]|\\q?quad(?![A-Za-z])")
# `1{,}000`, `10,\!080`, `1\,000`: commas of a number written in LaTeX (`\,` only before 3 digits).
_GROUP_SEPARATOR_RE = re.compile(r"\{,\}|,\\!\s*|(?<=\d)\\,(?=\d{3}(?!\d))", re.ASCII)


def _spacing(m: re.Match) -> str:
    """A row break stays; a negative space `\\!` vanishes; a positive one becomes a space."""
    return {"\\\\": "\\\\", "\\!": ""}.get(m.group(0), " ")


def _drop_unit(m: re.Match) -> str:
    return m.group(0) if _NOT_UNITS & set(m.group(1).lower().split()) else ""


@functools.lru_cache(maxsize=4096)  # pure; a group's G completions share one reference answer
def normalize_answer(text: str) -> str:
    """Documented normalisation applied to both the prediction and the ground truth.

    - `\\dfrac`/`\\tfrac` -> `\\frac`; the Unicode minus U+2212 -> `-`; every other non-ASCII
      character is kept, and the parser then rejects it (look-alike digits and letters score 0);
    - dropped first, so that `$5 \\text{ cm}$` and `5 \\text{ cm}` read alike: `$`, `\\$`, `\\(...\\)`
      and `\\[...\\]` around the whole answer, `\\left`/`\\right`, LaTeX spacing (`\\,` `\\!` `\\;` `~`
      `\\quad`), the degree sign (`^\\circ`, `°`), the percent sign (`50\\%` equals `50`, not `0.5`);
      then a trailing full stop;
    - a whole answer in `\\text{...}` (or `\\textbf`, `\\mbox`, `\\mathrm`, ...) is unwrapped and kept:
      `\\text{Evelyn}` is the word answer `Evelyn` (compared as words by the verifier);
    - one trailing unit after a value is dropped (`\\text{ cm}`, `\\mbox{ inches}^2`, `cm^2`, ...),
      unless its words hedge (`3 \\text{ or four}` keeps its words, and the parser rejects them);
    - `\\text{...}` and `\\mathrm{...}` around anything else are unwrapped, so words inside them
      ("1/3 or 1/2") reach the parser and are rejected there;
    - thousands separators: `1,000`, `1{,}000` and `10,\\!080` are one number only when the whole
      answer is one number in that form (otherwise a comma separates the entries of a list).
    """
    s = text.strip()
    s = s.replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _GROUP_SEPARATOR_RE.sub(",", s)
    for opening, closing in _DELIMITERS:
        if s.startswith(opening) and s.endswith(closing):
            s = s[len(opening):-len(closing)]
    s = _SPACING_RE.sub(_spacing, s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
    if m := _WHOLE_TEXT_RE.fullmatch(s):
        return m.group(1).strip()
    s = _TRAILING_TEXT_RE.sub(_drop_unit, s).strip()
    s = _TRAILING_UNIT_RE.sub("", s).strip()
    s = _WRAPPER_RE.sub(r"\1", s).strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s


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


def fast_math_reward(completion: str, answer: str) -> float | None:
    """1.0/0.0 when both sides are plain numbers (microseconds), None when the slow path is needed."""
    boxed = extract_boxed(completion)
    if boxed is None:
        return 0.0
    pred = fast_number(normalize_answer(boxed))
    if pred is None:
        return None
    truth = fast_number(normalize_answer(answer))
    if truth is None:
        return None
    return 1.0 if pred == truth else 0.0


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


# `x = 5`, `x \in [-2, 7]`: one letter, then the answer; the rest holds no other relation.
_ASSIGN_RE = re.compile(r"([A-Za-z])\s*(?:=|\\in(?![A-Za-z]))(.*)", re.ASCII | re.DOTALL)
_RELATION_RE = re.compile(r"[=<>]|\\(?:le|ge|lt|gt|in)(?![A-Za-z])|\\(?:leq|geq|leqslant|geqslant)", re.ASCII)
_WORDS_RE = re.compile(r"[A-Za-z]+(?:[ '-]+[A-Za-z]+)*", re.ASCII)


def _split_assignment(s: str) -> tuple[str | None, str]:
    """`x = 5` -> ("x", "5"), `x \\in (0, 1]` -> ("x", "(0, 1]"); anything else -> (None, s)."""
    m = _ASSIGN_RE.fullmatch(s)
    if m and not _RELATION_RE.search(m.group(2)):
        return m.group(1), m.group(2).strip()
    return None, s


def _assigned(value) -> tuple[str | None, object]:
    """`x = 1, x = -2` (a list of assignments to one letter) -> ("x", the list of values)."""
    if isinstance(value, Unordered) and all(
            isinstance(r, Relation) and r.ops == ("=",) and isinstance(r.sides[0], sympy.Symbol)
            and r.sides[0] not in r.sides[1].free_symbols for r in value.items):
        names = {r.sides[0].name for r in value.items}
        if len(names) == 1:
            return names.pop(), Unordered(tuple(r.sides[1] for r in value.items))
    return None, value


def parse_answer(s: str) -> tuple[str | None, object]:
    """A normalised answer -> (the letter it assigns or None, its value: see `math_answers`).

    Word answers (`Evelyn`, `even function`) that the grammar rejects become `Text`. May raise
    MathParseError.
    """
    var, rest = _split_assignment(s)
    try:
        value = parse_math(rest)
    except MathParseError:
        if var is None and _WORDS_RE.fullmatch(s):
            return None, Text(" ".join(s.lower().replace("-", " ").split()))
        raise
    return (var, value) if var is not None else _assigned(value)


def answers_equal(pred_text: str, truth_text: str) -> bool:
    """True when two answer strings are equal by value (normalised, parsed, compared). May raise.

    A letter assigned on one side only is ignored (`x = 5` equals `5`, `x \\in [-2, 7]` equals
    `[-2, 7]`); on both sides it must be the same letter. Against an equation the assignment is that
    equation (`y = 2x+3` equals `2x - y + 3 = 0`). Words (`\\text{Evelyn}`) equal only the same words.
    """
    pred_s, truth_s = normalize_answer(pred_text), normalize_answer(truth_text)
    fp, ft = fast_number(pred_s), fast_number(truth_s)
    if fp is not None and ft is not None:
        return fp == ft
    truth_var, truth = parse_answer(truth_s)
    pred_var, pred = parse_answer(pred_s)
    if pred_var is not None and truth_var is not None and pred_var != truth_var:
        return False
    if isinstance(pred, Relation) and truth_var is not None and isinstance(truth, sympy.Basic):
        truth = Relation((sympy.Symbol(truth_var), truth), ("=",))
    if isinstance(truth, Relation) and pred_var is not None and isinstance(pred, sympy.Basic):
        pred = Relation((sympy.Symbol(pred_var), pred), ("=",))
    return answer_values_equal(pred, truth)


def math_reward(completion: str, answer: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when `completion` has exactly one `\\boxed{}` equal by value to `answer`, else 0.0.

    Never raises: unparseable text, exceptions inside sympy and the `timeout_s` wall-clock limit
    (main thread only) all score 0.0.
    """
    try:
        fast = fast_math_reward(completion, answer)
        if fast is not None:
            return fast
        boxed = extract_boxed(completion)
        if boxed is None:
            return 0.0
        with _time_limit(timeout_s):
            return 1.0 if answers_equal(boxed, answer) else 0.0
    except (_Timeout, MathParseError, RecursionError, MemoryError, ArithmeticError, TypeError, ValueError,
            AttributeError):
        return 0.0
    except Exception:  # noqa: BLE001 -- a checker bug must never default to "correct" (seed Part 2)
        return 0.0


# ------------------------------------------------------------------------------------------------
# RewardFn


def math_accuracy_reward(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str],
                         pool=None, **_) -> list[float]:
    """RewardFn: `math_reward` per completion; the sympy cases go to `pool` (a VerifierPool) if given.

    The fast path (plain numbers on both sides) runs inline: it costs microseconds, less than
    sending the item to a worker. Only the rest, which may be slow, goes to the pool, where a hung
    or crashed check costs one 0.0.
    """
    if len(answer) != len(completions):
        raise ValueError(f"math_accuracy_reward: answer has {len(answer)} entries, completions {len(completions)}")
    scores: list[float | None] = []
    slow: list[int] = []
    for i, (c, a) in enumerate(zip(completions, answer)):
        try:
            fast = fast_math_reward(c, str(a))
        except Exception:  # noqa: BLE001 -- never raise on model text
            fast = 0.0
        scores.append(fast)
        if fast is None:
            slow.append(i)
    if slow:
        items = [(completions[i], str(answer[i])) for i in slow]
        if pool is not None:
            values = pool.map(math_reward, items)
        else:
            values = [math_reward(c, a) for c, a in items]
        for i, v in zip(slow, values):
            scores[i] = float(v)
    return [float(s) for s in scores]
