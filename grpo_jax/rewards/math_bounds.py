"""The bounds on the work a model's answer can cause, and the bounded builders the grammar uses.

Model text is untrusted: every limit lives here, checked before (or, where sympy merges nodes,
right after) a node is built: input length, nesting depth, item counts, exponent size, the degree
of powers, the bit length of exact powers, factorial arguments, digits. The tokeniser is ASCII
only. `math_parse` holds the grammar; it builds every value through these functions, so model text
never reaches eval, exec, sympify or parse_expr.
"""

from __future__ import annotations

import dataclasses
import re

import sympy

from grpo_jax.rewards.math_answers import (
    Interval,
    Matrix,
    PlusMinus,
    Relation,
    Union,
    Unordered,
)

MAX_INPUT_CHARS = 1000  # a boxed answer longer than this is not a final answer
MAX_DEPTH = 64  # nested expressions/signs/commands (a bracket costs 1-2); ~7 Python frames each
MAX_EXPONENT = 1000  # |numerator| of a rational exponent
MAX_EXPONENT_DENOMINATOR = 100
MAX_POWER_BITS = 20_000  # exact rational powers larger than this are refused (9^9^9 is ~1.2e9 bits)
MAX_DEGREE = 10_000  # of any power in a built tree: (x^{1000})^{1000} is x^1000000, costly to probe
MAX_FACTORIAL = 1000
MAX_NUMBER_DIGITS = 400
MAX_ITEMS = 32  # entries of one list, set, tuple, matrix, union or relation chain
MAX_BASE = 36


class MathParseError(ValueError):
    """The text is outside the grammar or its bounds; the verifier scores it 0.0."""


@dataclasses.dataclass(frozen=True)
class Token:
    kind: str  # "num", "word", "cmd", "op"
    text: str


# One pattern, ASCII only: `\d` without re.ASCII would also match Arabic-Indic and other digits.
# `\\`, `\{` and `\}` are commands too (matrix rows, set braces).
_TOKEN_RE = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d*)?|\.\d+)|(?P<word>[A-Za-z]+)|(?P<cmd>\\[A-Za-z]+|\\[{}\\])"
    r"|(?P<op><=|>=|[-+*/^()\[\]{}!,=<>&_]))",
    re.ASCII,
)

_SCALAR = (sympy.Basic, PlusMinus)


def tokenize(text: str) -> list[Token]:
    """Splits `text` into tokens; raises MathParseError on any character outside the grammar."""
    if len(text) > MAX_INPUT_CHARS:
        raise MathParseError(f"answer has {len(text)} characters; at most {MAX_INPUT_CHARS} allowed")
    tokens: list[Token] = []
    pos = 0
    end = len(text.rstrip())
    while pos < end:
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            raise MathParseError(f"unexpected character {text[pos:pos + 1]!r} at position {pos}")
        kind = m.lastgroup
        tokens.append(Token(kind, m.group(kind)))
        pos = m.end()
    return tokens


def _bits(r: sympy.Rational) -> int:
    return max(int(r.p).bit_length(), int(r.q).bit_length())


def bounded_pow(base, exponent):
    """base**exponent, refusing the cases that would take unbounded time or memory to build."""
    check_scalars(base, exponent, pm=False)
    if exponent.is_Rational:
        if abs(exponent.p) > MAX_EXPONENT or exponent.q > MAX_EXPONENT_DENOMINATOR:
            raise MathParseError(f"exponent {exponent} outside |p| <= {MAX_EXPONENT}, q <= {MAX_EXPONENT_DENOMINATOR}")
        if base.is_Rational and _bits(base) * abs(int(exponent.p)) // int(exponent.q) > MAX_POWER_BITS:
            raise MathParseError(f"power would exceed {MAX_POWER_BITS} bits")
        if base == 0 and exponent.is_negative:
            raise MathParseError("zero to a negative power")
    # Other exponents (2^{\pi}, x^y) stay unevaluated in sympy, which is cheap. sympy merges nested
    # integer powers, (x^a)^b = x^(ab) and (xy)^a = x^a y^a, so the bound is checked on the result.
    return bounded_degree(sympy.Pow(base, exponent))


def bounded_degree(value):
    """`value`, unless a power in it has a rational exponent over MAX_DEGREE (probing it would be slow)."""
    for p in value.atoms(sympy.Pow):
        if p.exp.is_Rational and abs(p.exp.p) > MAX_DEGREE:
            raise MathParseError(f"a power of degree {p.exp} (at most {MAX_DEGREE})")
    return value


def bounded_factorial(arg):
    check_scalars(arg, pm=False)
    if arg.is_Integer:
        if not 0 <= int(arg) <= MAX_FACTORIAL:
            raise MathParseError(f"factorial argument {arg} outside 0..{MAX_FACTORIAL}")
        return sympy.factorial(arg)
    if arg.is_number:
        raise MathParseError(f"factorial of non-integer {arg}")
    return sympy.factorial(arg)


def exact_number(text: str) -> sympy.Rational:
    """Exact value of a decimal literal (no floats: 0.1 + 0.2 must equal 0.3)."""
    if len(text) > MAX_NUMBER_DIGITS:
        raise MathParseError(f"number with {len(text)} digits; at most {MAX_NUMBER_DIGITS} allowed")
    whole, _, frac = text.partition(".")
    digits = (whole or "0") + frac
    return sympy.Rational(int(digits), 10 ** len(frac))


def check_scalars(*values, pm: bool = True) -> None:
    """Arithmetic takes scalars (and, through `lift_pm`, the branches of a `\\pm`), nothing else."""
    for v in values:
        if not pm and isinstance(v, PlusMinus):
            raise MathParseError("more than one \\pm in one expression")
        if not isinstance(v, _SCALAR):
            raise MathParseError(f"a {type(v).__name__} cannot take part in arithmetic")


def lift_pm(fn, *args):
    """fn over scalars, carried over the two branches of at most one `\\pm` among `args`."""
    check_scalars(*args)
    pm = [k for k, a in enumerate(args) if isinstance(a, PlusMinus)]
    if not pm:
        return fn(*args)
    if len(pm) > 1:
        raise MathParseError("more than one \\pm in one expression")
    k = pm[0]
    plus = fn(*args[:k], args[k].plus, *args[k + 1:])
    minus = fn(*args[:k], args[k].minus, *args[k + 1:])
    return PlusMinus(plus, minus)


def times(a, b):
    for m, c in ((a, b), (b, a)):  # a scalar times a matrix: each entry (\frac15 \begin{pmatrix}...)
        if isinstance(m, Matrix) and isinstance(c, sympy.Basic):
            return Matrix(tuple(tuple(sympy.Mul(c, x) for x in row) for row in m.rows))
    return lift_pm(sympy.Mul, a, b)


def reciprocal(d):
    if isinstance(d, sympy.Basic) and d == 0 or isinstance(d, PlusMinus) and 0 in (d.plus, d.minus):
        raise MathParseError("division by zero")
    return lift_pm(lambda x: bounded_pow(x, sympy.Integer(-1)), d)


def negate(a):
    if isinstance(a, Matrix):
        return times(sympy.Integer(-1), a)
    return lift_pm(lambda x: -x, a)


def entry(value):
    """An entry of a tuple, interval, matrix or relation: one scalar, no `\\pm`."""
    if not isinstance(value, sympy.Basic):
        raise MathParseError(f"a {type(value).__name__} cannot be an entry here")
    return value


def unordered(items: list) -> Unordered:
    """A list of answers, `\\pm` branches flattened: `\\{1 \\pm \\sqrt5, -2\\}` has three entries."""
    flat = []
    for x in items:
        if isinstance(x, Unordered):
            raise MathParseError("a set inside a list of answers")
        flat.extend((x.plus, x.minus) if isinstance(x, PlusMinus) else (x,))
    if len(flat) > MAX_ITEMS:
        raise MathParseError(f"more than {MAX_ITEMS} items in one list")
    return Unordered(tuple(flat))


def scalars_in(value):
    """Every sympy expression inside an answer kind."""
    if isinstance(value, sympy.Basic):
        yield value
        return
    match value:
        case tuple():
            parts = value
        case Unordered(items=parts) | Union(parts=parts) | Relation(sides=parts):
            pass
        case Interval():
            parts = (value.lo, value.hi)
        case Matrix():
            parts = tuple(x for row in value.rows for x in row)
        case _:
            parts = ()
    for p in parts:
        yield from scalars_in(p)
