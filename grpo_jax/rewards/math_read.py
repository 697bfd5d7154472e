"""Reading an answer before it is compared: labels, chains of equal sides, joined lists, `\\approx`.

Models and answer keys put more around a value than the grammar of `math_parse` holds. This module
reads a normalised answer string into a `Reading`: the value (a `math_answers` kind) plus what was
written around it, and `readings_equal` compares two readings. Every rule is strict where a
lenient one would pay a hedge (seed Part 2):

| written | read as | equal to |
|---|---|---|
| `x = 5`, `f(x) = x^2`, `AB = 4`, `x \\in [0, 1]` | the value, labelled | the bare value, or the same label and value |
| `x = 1, x = -2`; `x_1 = 1, x_2 = -2`; `x = 1, -2` | one letter's solutions, unordered | `1, -2` in any order |
| `AB = 4, CD = 5`; `(p, q) = (3, 2)`; `p = 3, q = 2` | labelled entries, in written order | the same labels with the same values, or the bare entries in that order (`4, 5`, `(3, 2)`); never `5, 4` |
| `x = 5 + 6 = 11`, `\\frac12 \\cdot 12 = 6`, `(x+1)^2 = x^2+2x+1` | the last side, when every side is equal by value | `11`, `6`, `x^2+2x+1`; `x = 1/3 = 1/2`, `2 + 2 = 5` (sides that differ) are rejected |
| `1 and 2`, `1 or 2`, `(1, 2) and (3, 4)` | a list of answers, unordered | `1, 2` in any order; never `1` alone (a list never equals one of its entries) |
| `\\frac{639}{40} or 15\\frac{39}{40}` | one answer written twice, when the entries joined by "or" alone are equal | `\\frac{639}{40}` |
| `\\frac13 \\approx 0.333` | the exact part; the approximation must agree with it to its last digit | `1/3` |
| `x \\approx 3.14`, `3.14` | an approximation | an exact constant within `approx_rtol` (0: never), unless that constant can be written exactly with as many decimals (`0.5`, `100`): then only exactly |

A two-sided equation with a letter (`2x = 10`, `y = 2x + 3` against an equation) stays a `Relation`:
its right side is not "the answer" unless its left side is a label. Labels are a letter (with a
subscript or prime), two or three capitals (`AB`), a Greek letter, `\\angle ABC`, `\\overline{AB}`,
`|AB|`, a function of plain arguments (`f(x)`, `P(-1)`), or a tuple of those (`(p, q)`).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import re

import sympy

from grpo_jax.rewards.math_answers import (
    Matrix,
    Relation,
    Text,
    Unordered,
    _INFINITIES,
    answer_values_equal,
    exprs_equal,
    relation_as_set,
)
from grpo_jax.rewards.math_bounds import MAX_ITEMS, MathParseError, unordered
from grpo_jax.rewards.math_parse import parse_math

_GREEK = r"\\(?:alpha|beta|gamma|delta|epsilon|varepsilon|theta|vartheta|lambda|mu|nu|xi|rho|sigma|tau|phi|varphi|chi|psi|omega)"
_NAME = rf"(?:[A-Za-z]|[A-Z]{{2,3}}|{_GREEK})(?:_\{{?[A-Za-z0-9]{{1,3}}\}}?)?'{{0,2}}"
_ARGS = r"\(\s*-?[A-Za-z0-9]+(?:\s*,\s*-?[A-Za-z0-9]+)*\s*\)"
_ONE_LABEL = rf"(?:m?\s*\\angle\s*[A-Z]{{1,3}}|\\overline\{{[A-Z]{{2,3}}\}}|\|[A-Z]{{2,3}}\||{_NAME}(?:\s*{_ARGS})?)"
_LABEL_RE = re.compile(rf"\s*(?:{_ONE_LABEL})\s*", re.ASCII)
_TUPLE_LABEL_RE = re.compile(rf"\s*\(\s*({_NAME}(?:\s*,\s*{_NAME})+)\s*\)\s*", re.ASCII)
_SUBSCRIPTED_RE = re.compile(r"([A-Za-z]+|\\[a-z]+)_\{?([A-Za-z0-9]+)\}?", re.ASCII)
_WORDS_RE = re.compile(r"[A-Za-z]+(?:[ '-]+[A-Za-z]+)*", re.ASCII)
_DECIMAL_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+)", re.ASCII)
_IN_RE = re.compile(r"\\in(?![A-Za-z])")
_JOIN_RE = re.compile(r",|\s(?:and|or)\s", re.ASCII)  # top-level list separators
_JOIN_WORD_RE = re.compile(r"\s(?:and|or)\s", re.ASCII)
_ONLY_OR_RE = re.compile(r"(?:(?!\s(?:and)\s)[^,])+", re.ASCII)  # joined by "or" alone: no comma, no "and"
_EQUALS_RE = re.compile(r"(?<![<>!\\])=(?!=)")  # '=' that is not part of <=, >=, !=
_APPROX_RE = re.compile(r"\\approx(?![A-Za-z])")
_OPENING, _CLOSING = "([{", ")]}"


@dataclasses.dataclass(frozen=True)
class Reading:
    """An answer as read: its value and what was written around it.

    value: a sympy expression or a `math_answers` kind.
    name: the one label of the whole answer (`x` in `x = 5` and in `x = 1, x = -2`), or None.
    labels: one label per entry, in written order (`("AB", "CD")`), when `value` is the tuple of
      those entries; None otherwise.
    approx_digits: decimals of `value` when it is only an approximation (a decimal literal, or what
      follows `\\approx`), else None.
    """

    value: object
    name: str | None = None
    labels: tuple[str, ...] | None = None
    approx_digits: int | None = None


def split_top(text: str, separator: re.Pattern) -> list[str]:
    """`text` split at the matches of `separator` that lie outside brackets and braces."""
    depth, cuts, pos = 0, [], 0
    starts = {m.start(): m.end() for m in separator.finditer(text)}
    if not starts:
        return [text]
    while pos < len(text):
        ch = text[pos]
        if ch == "\\" and pos + 1 < len(text) and text[pos + 1] in "{}":
            depth += 1 if text[pos + 1] == "{" else -1
            pos += 2
            continue
        if ch in _OPENING:
            depth += 1
        elif ch in _CLOSING:
            depth -= 1
        elif depth == 0 and pos in starts:
            cuts.append((pos, starts[pos]))
            pos = max(starts[pos], pos + 1)
            continue
        pos += 1
    pieces, last = [], 0
    for start, end in cuts:
        pieces.append(text[last:start])
        last = end
    pieces.append(text[last:])
    return pieces


def _label(text: str) -> str | None:
    """The canonical label (spaces and subscript braces dropped) when `text` is one, else None."""
    if not _LABEL_RE.fullmatch(text):
        return None
    compact = re.sub(r"\s+", "", text)
    return _SUBSCRIPTED_RE.sub(r"\1_\2", compact)


def _base(label: str) -> str | None:
    """`x_1` -> `x`: the letter whose solutions a subscripted label numbers; None without a subscript."""
    m = _SUBSCRIPTED_RE.fullmatch(label)
    return m.group(1) if m else None


def _decimals(text: str) -> int | None:
    """Digits after the point of a plain decimal literal (`3.14` -> 2, `3` -> 0), else None."""
    text = text.strip()
    if not _DECIMAL_RE.fullmatch(text):
        return None
    return len(text.partition(".")[2])


def _scalar(value) -> sympy.Basic:
    if not isinstance(value, sympy.Basic):
        raise MathParseError(f"a {type(value).__name__} where one value belongs")
    return value


def _tuple_label(text: str) -> tuple[str, ...] | None:
    """`(p, q)` -> ("p", "q"); None when `text` is not a tuple of labels."""
    m = _TUPLE_LABEL_RE.fullmatch(text)
    return None if m is None else tuple(_label(n) for n in m.group(1).split(","))


def _entry(text: str) -> tuple[str | tuple[str, ...] | None, object]:
    """One entry of an answer: (its label, a tuple of labels, or None; its value). See the table above."""
    sides = split_top(text, _EQUALS_RE)
    if len(sides) > MAX_ITEMS:
        raise MathParseError(f"more than {MAX_ITEMS} sides in one chain")
    if len(sides) == 1:
        member = split_top(text, _IN_RE)
        if len(member) == 2 and (name := _label(member[0])) is not None:
            return name, parse_math(member[1])
        return None, parse_math(text)
    name = _label(sides[0]) or _tuple_label(sides[0])
    values = [parse_math(side) for side in (sides[1:] if name is not None else sides)]
    if name is None and len(values) == 2 and not _identity(*values):
        return None, parse_math(text)  # an equation: `2x = 10`, `5x - 7y + 11z + 4 = 0`
    if len(values) > 1:  # equal sides: `x = 5 + 6 = 11`, `\frac12 \cdot 12 = 6`; the last is the answer
        last = _scalar(values[-1])
        if not all(exprs_equal(_scalar(v), last) for v in values[:-1]):
            raise MathParseError("a chain of '=' whose sides differ")
    return name, values[-1]


def _identity(lhs, rhs) -> bool:
    """Both sides constants, or equal for every value of their letters (`(x+1)^2 = x^2 + 2x + 1`):
    a statement of the right side, not an equation to solve. Constants that differ are checked
    (and rejected) by the caller."""
    if not (isinstance(lhs, sympy.Basic) and isinstance(rhs, sympy.Basic)):
        return False
    if not lhs.free_symbols and not rhs.free_symbols:
        return True
    return lhs.free_symbols == rhs.free_symbols and exprs_equal(lhs, rhs)


def _solutions(values: list) -> Unordered:
    """A list of one letter's solutions; a `\\pm` entry is its two solutions (`x = 1, x = 2 \\pm \\sqrt3`)."""
    flat = []
    for v in values:
        flat.extend(v.items if isinstance(v, Unordered) else (v,))
    return unordered(flat)


def _labelled_list(entries: list[tuple[str, object]]) -> Reading:
    names = [name for name, _ in entries]
    if any(isinstance(n, tuple) for n in names):
        raise MathParseError("a tuple of labels inside a list")
    values = [value for _, value in entries]
    bases = {_base(n) for n in names}
    if len(set(names)) == 1 or (None not in bases and len(bases) == 1 and len(set(names)) == len(names)):
        name = names[0] if len(set(names)) == 1 else bases.pop()
        return Reading(_solutions(values), name=name)  # one letter's solutions: `x_1 = 1, x_2 = -2`
    if len(set(names)) != len(names):
        raise MathParseError(f"labels {names} repeat some but not all names")
    return Reading(tuple(values), labels=tuple(names))


def _read_exact(text: str) -> Reading:
    pieces = split_top(text, _JOIN_RE)
    if len(pieces) > MAX_ITEMS:
        raise MathParseError(f"more than {MAX_ITEMS} items in one list")
    if len(pieces) > 1:
        entries = [_entry(p) for p in pieces]
        labelled = [name is not None for name, _ in entries]
        if all(labelled):
            return _labelled_list(entries)
        if labelled[0] and not any(labelled[1:]) and isinstance(entries[0][0], str):
            # `x = 1, -2`: the first label names the whole list of solutions
            return Reading(_solutions([value for _, value in entries]), name=entries[0][0])
        if any(labelled):
            raise MathParseError("a list with some entries labelled and some not")
        if _JOIN_WORD_RE.search(text):  # `1 and 2`, `x = 1 or x = -2` are lists, never one entry
            values = [value for _, value in entries]
            if _ONLY_OR_RE.fullmatch(text) and all(answer_values_equal(v, values[0]) for v in values[1:]):
                return Reading(values[0])  # `15\frac{39}{40} or \frac{639}{40}`: one answer, twice
            return Reading(unordered(values))
        return Reading(parse_math(text))  # a bare list (the parser also expands \pm in it)
    name, value = _entry(text)
    if isinstance(name, tuple):  # `(p, q) = (3, 2)`
        if not isinstance(value, tuple) or len(value) != len(name):
            raise MathParseError(f"{len(name)} labels for a {type(value).__name__}")
        return Reading(value, labels=name)
    digits = _decimals(split_top(text, _EQUALS_RE)[-1]) if isinstance(value, sympy.Rational) else None
    return Reading(value, name=name, approx_digits=digits if digits else None)  # `0.333`: maybe rounded


@functools.lru_cache(maxsize=4096)  # pure; a group's completions share one reference answer
def read_answer(text: str) -> Reading:
    """Reads a normalised answer (see the module docstring). Raises MathParseError when it cannot.

    Word answers (`Evelyn`, `even function`) that the grammar rejects become `Text`.
    """
    exact, *approximations = split_top(text, _APPROX_RE)
    try:
        if not approximations:
            return _read_exact(text)
        name = _label(exact)
        if not exact.strip() or name is not None:  # `x \approx 3.14`: only an approximation is given
            digits = _decimals(approximations[0])
            if digits is None:
                raise MathParseError("an approximation that is not a decimal number")
            return Reading(parse_math(approximations[0]), name=name, approx_digits=digits)
        reading = _read_exact(exact)
        for approximation in approximations:  # `\frac13 \approx 0.333`: it must agree with the exact part
            digits = _decimals(approximation)
            value = _scalar(reading.value)
            if digits is None or value.free_symbols or not _agrees(parse_math(approximation), value, digits):
                raise MathParseError(f"{approximation.strip()!r} does not approximate the answer")
        return reading
    except MathParseError:
        if not approximations and _WORDS_RE.fullmatch(text):
            return Reading(Text(" ".join(text.lower().replace("-", " ").split())))
        raise


def _agrees(approximation, exact, digits: int) -> bool:
    """`approximation` is `exact` rounded or truncated to `digits` decimals (within one last digit)."""
    gap = sympy.N(abs(approximation - exact), 30)
    return bool(gap.is_real and gap <= sympy.Rational(1, 10**digits))


def _approximates(approx: Reading, exact: Reading, rtol: float) -> bool:
    """An approximation of an exact constant within `rtol` (see the module docstring's last row)."""
    if approx.approx_digits is None or exact.approx_digits is not None or rtol <= 0:
        return False
    e = exact.value
    if not isinstance(e, sympy.Basic) or e.free_symbols or e.has(*_INFINITIES) or not e.is_number:
        return False
    scaled = e * 10**approx.approx_digits
    if scaled.is_Integer:
        return False  # `0.5` or `100` could have been written exactly with as many decimals
    gap, size = sympy.N(abs(approx.value - e), 30), sympy.N(abs(e), 30)
    return bool(gap.is_real and size.is_real and gap <= sympy.Float(rtol, 30) * size)


def fractions_approximate(approx_text: str, approx: fractions.Fraction, exact: fractions.Fraction,
                          rtol: float) -> bool:
    """`_approximates` for two plain numbers (the verifier's fast path): `approx_text` is the decimal."""
    digits = _decimals(approx_text)
    if digits is None or rtol <= 0 or (exact * 10**digits).denominator == 1:
        return False
    return abs(approx - exact) <= fractions.Fraction(rtol) * abs(exact)


def _entries(value) -> tuple | None:
    """The entries of a bare list, tuple or column, in written order; one value is a 1-entry list."""
    if isinstance(value, Unordered):
        return value.items
    if isinstance(value, tuple):
        return value
    if isinstance(value, Matrix):
        return tuple(row[0] for row in value.rows) if len(value.rows[0]) == 1 else None
    return (value,)


def _as_equation(name: str | None, value):
    """`y` and `2x + 3` -> the equation y = 2x + 3, to compare a labelled value with an equation."""
    if name is None or not re.fullmatch(r"[A-Za-z]", name) or not isinstance(value, sympy.Basic):
        return None
    return Relation((sympy.Symbol(name), value), ("=",))


def readings_equal(pred: Reading, truth: Reading, approx_rtol: float = 0.0) -> bool:
    """Equality of two readings (the module docstring's table, then `answer_values_equal`). May raise."""
    if pred.labels is not None or truth.labels is not None:
        if pred.labels is not None and truth.labels is not None:
            if sorted(pred.labels) != sorted(truth.labels):
                return False
            truth_by_label = dict(zip(truth.labels, truth.value))
            return all(answer_values_equal(v, truth_by_label[k]) for k, v in zip(pred.labels, pred.value))
        labelled, bare = (pred, truth) if pred.labels is not None else (truth, pred)
        entries = _entries(bare.value)
        return (bare.name is None and entries is not None and len(entries) == len(labelled.value)
                and all(answer_values_equal(a, b) for a, b in zip(labelled.value, entries)))
    if pred.name is not None and truth.name is not None and pred.name != truth.name:
        return False
    pv, tv = pred.value, truth.value
    if isinstance(pv, Relation) and (equation := _as_equation(truth.name, tv)) is not None:
        tv = equation  # `2x - y + 3 = 0` against `y = 2x + 3`
    elif isinstance(tv, Relation) and (equation := _as_equation(pred.name, pv)) is not None:
        pv = equation
    for rel, other in ((pv, truth), (tv, pred)):  # `-2 \le y \le 7` is not `x \in [-2, 7]`
        if isinstance(rel, Relation) and other.name is not None and relation_as_set(rel) is not None:
            if {x.name for side in rel.sides for x in side.free_symbols} != {other.name}:
                return False
    if answer_values_equal(pv, tv):
        return True
    return _approximates(pred, truth, approx_rtol) or _approximates(truth, pred, approx_rtol)
