"""Answer kinds beyond one expression, and equality by value between parsed answers.

`math_parse` builds these from its own grammar (never from Python evaluation); `answer_values_equal`
compares two of them. Each kind equals only its own kind (one exception: an n x 1 column equals an
n-tuple), and every comparison is strict: when in doubt the answer is wrong (seed Part 2, a lenient
checker is a loophole). What each kind means, as decided for MATH-style answers:

| written as | kind | equal when |
|---|---|---|
| `3\\sqrt2`, `x^2+1`, `\\cot x`, `1\\frac45` | sympy expression | equal by value (exact, 60-digit numeric, or an exact zero difference) |
| `(3, 4)`, `\\left(3, \\frac\\pi2\\right)` | `tuple` (ordered) | same length, entries equal in order; `(a, b)` is also the open interval |
| `1, -2`, `\\{1\\pm\\sqrt5, -2\\}`, `1 \\pm \\sqrt{19}` | `Unordered` | same entries in any order, counted with multiplicity |
| `(3, 4]`, `[a, b]`, `(-\\infty, 0]` | `Interval` | same endpoints by value and the same open/closed ends |
| `(0,9) \\cup (9,36)` | `Union` | the same parts in any order (touching parts are not merged) |
| `\\begin{pmatrix}1\\\\2\\end{pmatrix}` | `Matrix` | same shape, entries equal; an n x 1 column also equals an n-tuple |
| `52_8`, `4210_{5}` | `BaseNumeral` | same base and same value (`052_8` = `52_8`); never a plain number |
| `5x-7y+11z+4=0`, `x \\le 5`, `-2 < x \\le 7`, `x \\neq 3` | `Relation` | the same relations up to sides, order and a nonzero (for `=`, `\\neq`) or positive (for `<`, `\\le`) constant factor; or, in one letter against an interval or union, the same set (`x \\le 3` = `(-\\infty, 3]`, `x \\neq 3` = `(-\\infty,3) \\cup (3,\\infty)`) |
| `\\text{Evelyn}`, `ellipse` | `Text` | the same words, case and spacing ignored |

`\\pm` is a set: `a \\pm b` is {a + b, a - b}, never a hedge that matches either one alone.
Labels (`x = 5`, `x = 1, x = -2`, `x \\in [-2, 7]`, `AB = 4, CD = 5`, `(p, q) = (3, 2)`), chains of
equal sides (`x = 5 + 6 = 11`) and `\\approx` are read by `math_read` before these comparisons.
"""

from __future__ import annotations

import dataclasses

import sympy

_NUMERIC_DIGITS = 60
_NUMERIC_RTOL = sympy.Rational(1, 10**40)
_KEY_DIGITS = 30  # cheap pre-filter when matching unordered collections
_INFINITIES = (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan)


@dataclasses.dataclass(frozen=True)
class PlusMinus:
    """`a \\pm b` inside an expression: its two branches. The parser flattens it into an Unordered."""

    plus: sympy.Basic
    minus: sympy.Basic


@dataclasses.dataclass(frozen=True)
class Unordered:
    """A bare list `1, -2`, a set `\\{1, -2\\}` or a `\\pm` expansion: a multiset of answers."""

    items: tuple


@dataclasses.dataclass(frozen=True)
class Interval:
    """An interval written with at least one square bracket: `(3, 4]`, `[a, b]`. `(a, b)` is a tuple."""

    lo: sympy.Basic
    hi: sympy.Basic
    left_closed: bool
    right_closed: bool


@dataclasses.dataclass(frozen=True)
class Union:
    """`A \\cup B \\cup ...`: parts are intervals, 2-tuples (open intervals) or sets."""

    parts: tuple


@dataclasses.dataclass(frozen=True)
class Matrix:
    """`\\begin{pmatrix}...\\end{pmatrix}` (or bmatrix, matrix): rows of scalar entries."""

    rows: tuple  # tuple[tuple[sympy.Basic, ...], ...], all rows the same length


@dataclasses.dataclass(frozen=True)
class BaseNumeral:
    """`52_8`: the numeral 52 in base 8. Kept apart from numbers: the task asked for base-8 digits."""

    value: int
    base: int


@dataclasses.dataclass(frozen=True)
class Relation:
    """`sides[0] ops[0] sides[1] ops[1] ...`; ops are '=', '!=', '<', '<=', '>', '>='."""

    sides: tuple
    ops: tuple


@dataclasses.dataclass(frozen=True)
class Text:
    """A word answer (`\\text{Evelyn}`, `ellipse`): lower case, single spaces."""

    words: str


# ------------------------------------------------------------------------------------------------
# Scalars


def exprs_equal(a, b) -> bool:
    """Two sympy expressions equal by value: structural, then 60-digit numeric or an exact zero difference."""
    if a == b:
        return True
    if a.has(*_INFINITIES) or b.has(*_INFINITIES):
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
    da = sympy.N((a - b).subs(_probe_point(a.free_symbols, 0)), 30)
    if da.is_number and da != 0 and abs(da) > sympy.Rational(1, 10**20):
        return False
    diff = a - b
    # expand() settles polynomial identities in milliseconds; simplify() (slower) the rest.
    return sympy.expand(diff) == 0 or sympy.simplify(diff) == 0


def _probe_point(symbols, k: int) -> dict:
    """Exact rational values for `symbols`, different for each k, unlikely to be special points."""
    return {s: sympy.Rational(7 + 3 * j + 5 * k, 11 + 2 * j + 3 * k) for j, s in enumerate(sorted(symbols, key=str))}


def _numeric_key(x):
    """A 30-digit complex value of a constant scalar, or None (symbolic, infinite, or not a scalar)."""
    if not isinstance(x, sympy.Basic) or x.free_symbols or x.has(*_INFINITIES):
        return None
    try:
        return complex(sympy.N(x, _KEY_DIGITS))
    except (TypeError, ValueError):
        return None


def _keys_differ(ka, kb) -> bool:
    return ka is not None and kb is not None and abs(ka - kb) > 1e-12 * max(abs(ka), abs(kb), 1.0)


# ------------------------------------------------------------------------------------------------
# Relations


def _atoms(rel: Relation) -> list[tuple[str, sympy.Basic]]:
    """Each link of a chain as (kind, d) meaning `d = 0`, `d != 0`, `d < 0` or `d <= 0`."""
    atoms = []
    for (lhs, rhs), op in zip(zip(rel.sides, rel.sides[1:]), rel.ops):
        match op:
            case "=" | "!=":
                atoms.append((op, lhs - rhs))
            case "<" | "<=":
                atoms.append((op, lhs - rhs))
            case ">" | ">=":
                atoms.append(({">": "<", ">=": "<="}[op], rhs - lhs))
    return atoms


def _proportional(d1, d2, *, positive: bool) -> bool:
    """d1 == c * d2 for one constant c (c > 0 when `positive`, else c != 0); both must have symbols."""
    syms = d1.free_symbols
    if not syms or syms != d2.free_symbols or d1.has(*_INFINITIES) or d2.has(*_INFINITIES):
        return False  # `3 < 5` is a truth value, not an answer
    for k in (1, 2, 3):  # not exprs_equal's probe point 0, where d1 - c*d2 vanishes by construction
        point = _probe_point(syms, k)
        v2 = d2.subs(point)
        if v2.is_zero is False and not v2.has(*_INFINITIES):
            c = sympy.cancel(d1.subs(point) / v2)
            break
    else:
        return False
    if c.free_symbols or c.has(*_INFINITIES) or c.is_zero is not False:
        return False
    if positive:
        value = sympy.N(c, 30)
        if not (value.is_real and value > 0):
            return False
    return exprs_equal(d1, c * d2)  # its numeric probe rejects before any expand()


def relations_equal(a: Relation, b: Relation) -> bool:
    return _matched(_atoms(a), _atoms(b),
                    lambda x, y: x[0] == y[0] and _proportional(x[1], y[1], positive=x[0] in ("<", "<=")))


_FLIPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "!=": "!="}


def relation_as_set(rel: Relation):
    """The solution set of a relation in one letter with constant bounds, as the parser writes sets.

    `x < 3` -> the open interval `(-oo, 3)` (a 2-tuple, as `(a, b)` parses), `x \\ge 3` ->
    `Interval(3, oo, True, False)`, `-2 \\le x < 7` -> `Interval(-2, 7, True, False)`, `x \\neq 3` ->
    `Union(((-oo, 3), (3, oo)))`. None for anything else (`2x < 6`, `x = 3`, two letters, an empty
    range such as `5 < x < 1`): those are compared as relations only.
    """
    symbols = set().union(*(side.free_symbols for side in rel.sides))
    if len(symbols) != 1:
        return None
    (x,) = symbols
    sides, ops = rel.sides, rel.ops
    if len(sides) == 2:
        if sides[0] == x:
            bound, op = sides[1], ops[0]
        elif sides[1] == x:
            bound, op = sides[0], _FLIPPED.get(ops[0])
        else:
            return None
        if bound.free_symbols or bound.has(*_INFINITIES):
            return None
        match op:
            case "<":
                return (-sympy.oo, bound)
            case "<=":
                return Interval(-sympy.oo, bound, False, True)
            case ">":
                return (bound, sympy.oo)
            case ">=":
                return Interval(bound, sympy.oo, True, False)
            case "!=":
                return Union(((-sympy.oo, bound), (bound, sympy.oo)))
        return None
    if len(sides) != 3 or sides[1] != x or sides[0].free_symbols or sides[2].free_symbols:
        return None
    if all(op in ("<", "<=") for op in ops):
        lo, hi, lo_closed, hi_closed = sides[0], sides[2], ops[0] == "<=", ops[1] == "<="
    elif all(op in (">", ">=") for op in ops):
        lo, hi, lo_closed, hi_closed = sides[2], sides[0], ops[1] == ">=", ops[0] == ">="
    else:
        return None
    gap = sympy.N(hi - lo, 30)
    if not (gap.is_real and gap > 0):
        return None
    return (lo, hi) if not (lo_closed or hi_closed) else Interval(lo, hi, lo_closed, hi_closed)


def _set_like(value) -> bool:
    return isinstance(value, (Interval, Union)) or isinstance(value, tuple) and len(value) == 2


# ------------------------------------------------------------------------------------------------
# Everything


def _matched(xs, ys, equal) -> bool:
    """A one-to-one matching of xs onto ys under `equal` (an equivalence, so greedy is exact)."""
    if len(xs) != len(ys):
        return False
    keys_y = [_numeric_key(y) for y in ys]
    free = list(range(len(ys)))
    for x in xs:
        kx = _numeric_key(x)
        for pos, j in enumerate(free):
            if not _keys_differ(kx, keys_y[j]) and equal(x, ys[j]):
                del free[pos]
                break
        else:
            return False
    return True


def _column(m: Matrix) -> tuple | None:
    return tuple(row[0] for row in m.rows) if len(m.rows) >= 2 and len(m.rows[0]) == 1 else None


def answer_values_equal(a, b) -> bool:
    """Equality by value of two parsed answers (see the module docstring's table). May raise."""
    if isinstance(a, sympy.Basic) and isinstance(b, sympy.Basic):
        return exprs_equal(a, b)
    for rel, other in ((a, b), (b, a)):  # `x \\le 3` against `(-\\infty, 3]`: the same set
        if isinstance(rel, Relation) and _set_like(other):
            as_set = relation_as_set(rel)
            return as_set is not None and answer_values_equal(as_set, other)
    if isinstance(a, Matrix) and isinstance(b, tuple):
        a, b = b, a
    if isinstance(a, tuple):
        if isinstance(b, Matrix):
            b = _column(b)
        return isinstance(b, tuple) and len(a) == len(b) and all(answer_values_equal(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    match a:
        case Unordered():
            return _matched(a.items, b.items, answer_values_equal)
        case Union():
            return _matched(a.parts, b.parts, answer_values_equal)
        case Interval():
            return (a.left_closed == b.left_closed and a.right_closed == b.right_closed
                    and exprs_equal(a.lo, b.lo) and exprs_equal(a.hi, b.hi))
        case Matrix():
            return (len(a.rows) == len(b.rows) and len(a.rows[0]) == len(b.rows[0])
                    and all(exprs_equal(x, y) for ra, rb in zip(a.rows, b.rows) for x, y in zip(ra, rb)))
        case BaseNumeral():
            return a == b
        case Relation():
            return relations_equal(a, b)
        case Text():
            return a.words == b.words
    return False
