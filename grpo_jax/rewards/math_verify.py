"""The strict math verifier: exactly one `\\boxed{}`, compared with the ground truth by value.

Seed Part 2: a verifier that accepts any of several boxes, finds "1/3" in "1/3 or 1/2", or
defaults to "correct" when its parser crashes is a loophole that GRPO will find. Here:
- exactly one `\\boxed` in the completion, closed, non-empty, at most MAX_INPUT_CHARS long;
- the answer text is normalised (documented in `normalize_answer`) and then compared:
  a fast path for plain integers, decimals and fractions (exact `fractions.Fraction`, no sympy),
  else the bounded grammar of `math_parse` and an exact/numeric/symbolic sympy comparison;
- anything unparseable, any exception, any timeout scores 0.0. Nothing reaches eval/sympify.
"""

from __future__ import annotations

import contextlib
import fractions
import re
import signal
import threading
from collections.abc import Sequence

import sympy

from grpo_jax.rewards.math_parse import MAX_INPUT_CHARS, MathParseError, parse_math

DEFAULT_TIMEOUT_S = 1.0  # wall clock per answer for the sympy path when run inline (main thread)
_NUMERIC_DIGITS = 60
_NUMERIC_RTOL = sympy.Rational(1, 10**40)

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
# A trailing unit: `\text{ cm}`, `\mbox{dollars}`, `\mathrm{kg}^2`, or bare `cm^2` after a number.
_TRAILING_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm|textrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?\s*$")
_TRAILING_UNIT_RE = re.compile(rf"(?<=[\d}}\s])\s*(?:{_UNIT_WORDS})(?:\^\{{?[23]\}}?)?\s*$", re.ASCII)
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm|textrm|mathbf|boldsymbol)\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
_ASSIGN_RE = re.compile(r"([A-Za-z])\s*=(.*)", re.ASCII | re.DOTALL)
_REMOVE = (
    "\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad",
    "\\ ", "~", "\\$", "$", "^\\circ", "^{\\circ}", "\\circ", "\\%", "%", "\u00b0",
)


def normalize_answer(text: str) -> str:
    """Documented normalisation applied to both the prediction and the ground truth.

    - `\\dfrac`/`\\tfrac` -> `\\frac`; the Unicode minus U+2212 -> `-`; every other non-ASCII
      character is kept, and the parser then rejects it (look-alike digits and letters score 0);
    - dropped: `$`, `\\$`, `\\left`/`\\right`, LaTeX spacing (`\\,` `\\!` `\\;` `~` `\\quad`), the
      degree sign (`^\\circ`, `°`), the percent sign (`50\\%` equals `50`, not `0.5`), a
      trailing full stop, and one trailing unit (`\\text{ cm}`, `\\mbox{dollars}`, `cm^2`, ...);
    - `\\text{...}` and `\\mathrm{...}` around anything else are unwrapped, so words inside them
      ("1/3 or 1/2") reach the parser and are rejected there;
    - thousands separators: `1,000` and `1{,}000` are 1000 only when the whole answer is one number
      in that form (otherwise a comma separates tuple entries).
    """
    s = text.strip()
    s = s.replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("{,}", ",")
    s = _TRAILING_TEXT_RE.sub("", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
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
_FRAC_RE = re.compile(r"([+-]?)\\frac\{\s*([+-]?\d+)\s*\}\{\s*(\d+)\s*\}", re.ASCII)
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
    m = _SLASH_RE.fullmatch(s) or _FRAC_RE.fullmatch(s)
    if m:
        den = int(m.group(3))
        if den == 0:
            return None  # let the parser reject it with a reason
        value = fractions.Fraction(int(m.group(2)), den)
        return -value if m.group(1) == "-" else value
    return None


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


def _split_assignment(s: str) -> tuple[str | None, str]:
    """`x = 5` -> ("x", "5"); a single `=` after one letter only."""
    m = _ASSIGN_RE.fullmatch(s)
    if m and "=" not in m.group(2):
        return m.group(1), m.group(2).strip()
    return None, s


def _exprs_equal(a, b) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        if not (isinstance(a, tuple) and isinstance(b, tuple)) or len(a) != len(b):
            return False
        return all(_exprs_equal(x, y) for x, y in zip(a, b))
    if a == b:
        return True
    if a.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return False  # only structurally equal infinities match
    if a.is_Rational and b.is_Rational:
        return False  # exact numbers that differ
    if a.free_symbols != b.free_symbols:
        return False
    if not a.free_symbols:
        # Constants: compare at 60 significant digits. Two different closed forms cannot agree to
        # 40 digits by accident; this avoids sympy.simplify, whose run time is unbounded.
        va, vb = sympy.N(a, _NUMERIC_DIGITS), sympy.N(b, _NUMERIC_DIGITS)
        if not (va.is_number and vb.is_number) or va.has(sympy.nan) or vb.has(sympy.nan):
            return False
        scale = max(abs(va), abs(vb), sympy.Integer(1))
        return bool(abs(va - vb) <= _NUMERIC_RTOL * scale)
    # Symbolic: reject fast on a numeric probe, then ask sympy for an exact zero difference.
    subs = {s: sympy.Rational(7 + 3 * k, 11 + 2 * k) for k, s in enumerate(sorted(a.free_symbols, key=str))}
    da = sympy.N((a - b).subs(subs), 30)
    if da.is_number and da != 0 and abs(da) > sympy.Rational(1, 10**20):
        return False
    diff = a - b
    # expand() settles polynomial identities in milliseconds; simplify() (slower) the rest.
    return sympy.expand(diff) == 0 or sympy.simplify(diff) == 0


def answers_equal(pred_text: str, truth_text: str) -> bool:
    """True when two answer strings are equal by value (normalised, parsed, compared). May raise."""
    pred_s, truth_s = normalize_answer(pred_text), normalize_answer(truth_text)
    fp, ft = fast_number(pred_s), fast_number(truth_s)
    if fp is not None and ft is not None:
        return fp == ft
    truth_var, truth_s = _split_assignment(truth_s)
    pred_var, pred_s = _split_assignment(pred_s)
    if pred_var is not None and truth_var is not None and pred_var != truth_var:
        return False
    return _exprs_equal(parse_math(pred_s), parse_math(truth_s))


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
