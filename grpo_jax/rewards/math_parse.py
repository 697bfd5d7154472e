"""A small, bounded math grammar: answer text -> sympy objects and answer kinds, without evaluating Python.

Model text is untrusted. `sympify` and `parse_expr` run Python `eval` on their input, so
`\\boxed{__import__('os').system(...)}` would execute and `9**9**9` would hang. This module
tokenises the text itself (ASCII only), parses it with recursive descent, and builds sympy
objects directly (`Integer`, `Rational`, `Add`, `Mul`, `Pow`, `sqrt`, ...) and the answer kinds of
`math_answers` (tuples, sets, intervals, unions, matrices, base numerals, relations), every one
through the bounded builders of `math_bounds` (input length, nesting depth, item counts, exponents,
degrees, bit lengths, factorials). Anything outside the grammar or its bounds raises `MathParseError`.

Grammar (LaTeX and plain text; `^` binds tighter than unary minus, as in maths):
    answer  := chain (',' chain)*                    two or more: Unordered (a bare list of solutions)
    chain   := union (relop union)*                  relop: = < > <= >= \\le \\leq \\ge \\geq \\lt \\gt \\neq
    union   := expr (\\cup expr)*
    expr    := term (('+' | '-' | \\pm | \\mp) term)*
    term    := unary (('*' | '/' | \\cdot | \\times | \\div) unary | <implicit> power)*
    unary   := ('+' | '-' | \\pm | \\mp) unary | mixed | power
    mixed   := integer \\frac{p}{q}                   0 < p < q: the mixed number integer + p/q
    power   := postfix ('^' (group | unary))?
    postfix := atom '!'*                             n! for integers 0 <= n <= MAX_FACTORIAL
    atom    := number | integer '_' base | letter | pi | '{' items '}' | \\{ items \\} | \\emptyset
             | ('(' | '[') items (')' | ']')         one item: grouping; more: a tuple, or with a
                                                     square bracket an interval (exactly two items);
                                                     braces around two or more: a set, as `\\{...\\}`
             | \\begin{pmatrix} rows \\end{pmatrix}   (also bmatrix, matrix): '&' columns, '\\\\' rows
             | \\frac A B | \\sqrt[n]? A | \\pi | \\infty | func ('^' A)? ('_' A)? A
    func    := sin cos tan cot sec csc arcsin arccos arctan log ln exp (`\\log_b x` has a base)

Implicit multiplication (`2x`, `3\\pi`, `2(x+1)`) is allowed only when the right factor starts
with a letter, a command other than `\\frac`, or a bracket: never before a digit (`1/3 1/2` must
not become 1/6) and never before `\\frac`: an integer followed by a proper `\\frac{p}{q}` is the mixed
number a human reads (`1\\frac45` = 9/5); any other number before `\\frac` (`2\\frac32`, `1.5\\frac12`)
is ambiguous and rejected. `\\pm` makes two branches that arithmetic carries (`\\frac{1 \\pm \\sqrt5}{2}`);
at most one `\\pm` per entry, and only where a set of answers can stand (not inside tuples,
intervals, matrices or relations). Multi-letter words other than the function names are rejected,
so "1/3 or 1/2" cannot parse. In plain-text powers and subscripts the whole number is the exponent
or base (`2^10` is 1024, `101_10` is base ten), not LaTeX's one-character argument.
"""

from __future__ import annotations

import sympy

from grpo_jax.rewards.math_answers import (
    BaseNumeral,
    Interval,
    Matrix,
    PlusMinus,
    Relation,
    Union,
    Unordered,
)
from grpo_jax.rewards.math_bounds import (
    MAX_BASE,
    MAX_DEPTH,
    MAX_EXPONENT_DENOMINATOR,
    MAX_INPUT_CHARS,
    MAX_ITEMS,
    MAX_NUMBER_DIGITS,
    MathParseError,
    Token,
    bounded_degree,
    bounded_factorial,
    bounded_pow,
    check_scalars,
    entry,
    exact_number,
    lift_pm,
    negate,
    reciprocal,
    scalars_in,
    times,
    tokenize,
    unordered,
)

__all__ = ["MAX_INPUT_CHARS", "MathParseError", "parse_math", "tokenize"]

_FUNCTIONS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan,
    "cot": sympy.cot, "sec": sympy.sec, "csc": sympy.csc,
    "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "log": sympy.log,  # natural log, as in sympy and most answer keys; `\log_b x` takes a base
    "ln": sympy.log,
    "exp": sympy.exp,
}
_MUL_CMDS = {"\\cdot", "\\times"}
_DIV_CMDS = {"\\div"}
_PM_CMDS = {"\\pm", "\\mp"}
_RELATIONS = {
    "=": "=", "<": "<", ">": ">", "<=": "<=", ">=": ">=", "\\lt": "<", "\\gt": ">",
    "\\le": "<=", "\\leq": "<=", "\\leqslant": "<=", "\\ge": ">=", "\\geq": ">=", "\\geqslant": ">=",
    "\\neq": "!=", "\\ne": "!=",
}
_MATRIX_ENVS = {"pmatrix", "bmatrix", "matrix"}


class _Parser:
    def __init__(self, tokens: list[Token]):
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    # -- token helpers -------------------------------------------------------------------------
    def peek(self, ahead: int = 0) -> Token | None:
        j = self.i + ahead
        return self.tokens[j] if j < len(self.tokens) else None

    def at(self, *texts: str) -> bool:
        tok = self.peek()
        return tok is not None and tok.text in texts

    def take(self) -> Token:
        tok = self.peek()
        if tok is None:
            raise MathParseError("unexpected end of answer")
        self.i += 1
        return tok

    def expect(self, text: str) -> None:
        tok = self.take()
        if tok.text != text:
            raise MathParseError(f"expected {text!r}, found {tok.text!r}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise MathParseError(f"nesting deeper than {MAX_DEPTH}")

    # -- answers, lists, relations, unions -----------------------------------------------------
    def answer(self):
        items = self.items(self.chain)
        if len(items) == 1:
            return Unordered((items[0].plus, items[0].minus)) if isinstance(items[0], PlusMinus) else items[0]
        return unordered(items)

    def items(self, parse_one) -> list:
        items = [parse_one()]
        while self.at(","):
            self.take()
            items.append(parse_one())
            if len(items) > MAX_ITEMS:
                raise MathParseError(f"more than {MAX_ITEMS} items in one list")
        return items

    def chain(self):
        sides, ops = [self.union()], []
        while (tok := self.peek()) is not None and tok.text in _RELATIONS:
            self.take()
            if tok.text in ("<", ">") and self.at("="):  # `< =` with a space is still <=
                self.take()
                ops.append(tok.text + "=")
            else:
                ops.append(_RELATIONS[tok.text])
            sides.append(self.union())
            if len(sides) > MAX_ITEMS:
                raise MathParseError(f"more than {MAX_ITEMS} sides in one relation")
        if not ops:
            return sides[0]
        if ("=" in ops or "!=" in ops) and len(ops) > 1:
            raise MathParseError("'=' or '\\neq' in a chain of relations")
        if any(o in ("<", "<=") for o in ops) and any(o in (">", ">=") for o in ops):
            raise MathParseError("a chain of relations that changes direction")
        return Relation(tuple(entry(s) for s in sides), tuple(ops))

    def union(self):
        parts = [self.expr()]
        while self.at("\\cup"):
            self.take()
            parts.append(self.expr())
            if len(parts) > MAX_ITEMS:
                raise MathParseError(f"more than {MAX_ITEMS} parts in one union")
        if len(parts) == 1:
            return parts[0]
        for p in parts:
            if not (isinstance(p, (Interval, Unordered)) or isinstance(p, tuple) and len(p) == 2):
                raise MathParseError(f"a {type(p).__name__} cannot be part of a union")
        return Union(tuple(parts))

    # -- arithmetic ----------------------------------------------------------------------------
    def expr(self):
        self.enter()
        value = self.term()
        while (tok := self.peek()) is not None and (tok.kind == "op" and tok.text in "+-" or tok.text in _PM_CMDS):
            self.take()
            rhs = self.term()
            if tok.text == "+":
                value = lift_pm(sympy.Add, value, rhs)
            elif tok.text == "-":
                value = lift_pm(lambda a, b: sympy.Add(a, -b), value, rhs)
            else:  # a \pm b, a \mp b: as a set of two answers the order of the branches is immaterial
                check_scalars(value, rhs, pm=False)
                value = PlusMinus(sympy.Add(value, rhs), sympy.Add(value, -rhs))
        self.depth -= 1
        return value

    def term(self):
        value = self.unary()
        while (tok := self.peek()) is not None:
            if tok.text == "*" or tok.text in _MUL_CMDS:
                self.take()
                value = times(value, self.unary())
            elif tok.text == "/" or tok.text in _DIV_CMDS:
                self.take()
                rhs = self.unary()
                if isinstance(value, Matrix):
                    value = times(value, reciprocal(entry(rhs)))
                else:
                    value = lift_pm(sympy.Mul, value, reciprocal(rhs))
            elif self._starts_implicit_factor(tok):
                value = times(value, self.power())
            else:
                break
        return value

    @staticmethod
    def _starts_implicit_factor(tok: Token) -> bool:
        if tok.kind == "word":
            return True
        if tok.kind == "cmd":
            return tok.text not in _MUL_CMDS | _DIV_CMDS | _PM_CMDS | _RELATIONS.keys() | {
                "\\frac", "\\cup", "\\\\", "\\}", "\\end"}
        return tok.kind == "op" and tok.text in "({"

    def unary(self, mixed_ok: bool = True):
        tok = self.peek()
        if tok is not None and (tok.kind == "op" and tok.text in "+-" or tok.text in _PM_CMDS):
            self.take()
            self.enter()
            value = self.unary(mixed_ok)
            self.depth -= 1
            if tok.text == "-":
                return negate(value)
            if tok.text == "+":
                check_scalars(value)
                return value
            check_scalars(value, pm=False)
            return PlusMinus(value, -value)
        nxt = self.peek(1)
        if tok is not None and tok.kind == "num" and nxt is not None and nxt.text == "\\frac":
            if not mixed_ok:  # x^2\frac12: x^2 times 1/2 or x^(5/2)?
                raise MathParseError("a number before \\frac in an exponent is ambiguous")
            return self.mixed()
        return self.power()

    def mixed(self):
        """`1\\frac{4}{5}` = 9/5: an integer and a proper fraction of integers, nothing attached."""
        whole = self.take().text
        self.take()  # \frac
        num, den = self.argument(), self.argument()
        if "." in whole or not all(isinstance(v, sympy.Basic) and v.is_Integer for v in (num, den)) or not 0 < num < den:
            raise MathParseError(f"{whole} before \\frac{{{num}}}{{{den}}} is not a mixed number")
        if self.at("^", "!", "_"):
            raise MathParseError("a mixed number cannot take a power, factorial or subscript")
        return exact_number(whole) + sympy.Rational(int(num), int(den))

    def power(self):
        base = self.postfix()
        if self.at("^"):
            self.take()
            exponent = self.group() if self.at("{") else self.unary(mixed_ok=False)
            return lift_pm(bounded_pow, base, exponent)
        return base

    def postfix(self):
        value = self.atom()
        while self.at("!"):
            self.take()
            if self.at("!"):
                raise MathParseError("'!!' is ambiguous (double factorial or repeated factorial)")
            value = lift_pm(bounded_factorial, value)
        return value

    def group(self):
        """A braced LaTeX argument `{...}`."""
        self.expect("{")
        value = self.expr()
        self.expect("}")
        return value

    def argument(self):
        """A LaTeX argument: `{...}`, or one digit / one letter / one command (`\\frac12`)."""
        tok = self.peek()
        if tok is None:
            raise MathParseError("missing argument")
        if tok.text == "{":
            return self.group()
        if tok.kind == "num":
            # \frac12: each digit is its own argument; split the number token in place.
            self.take()
            if len(tok.text) > 1:
                self.i -= 1
                self.tokens[self.i] = Token("num", tok.text[1:])
            if tok.text[0] == ".":
                raise MathParseError("a bare '.' is not a LaTeX argument")
            return sympy.Integer(int(tok.text[0]))
        return self.atom()

    # -- atoms ---------------------------------------------------------------------------------
    def atom(self):
        tok = self.take()
        if tok.kind == "num":
            return self.base_numeral(tok.text) if self.at("_") else exact_number(tok.text)
        if tok.kind == "op":
            if tok.text in "([":
                return self.bracketed(tok.text)
            if tok.text == "{":  # `{1, 3}` renders as the list 1, 3: a set of answers
                self.enter()
                items = self.items(self.expr)
                self.expect("}")
                self.depth -= 1
                return items[0] if len(items) == 1 else unordered(items)
            raise MathParseError(f"unexpected {tok.text!r}")
        if tok.kind == "word":
            return self._word(tok.text)
        return self._command(tok.text)

    def bracketed(self, opening: str):
        self.enter()
        items = self.items(self.expr)
        closing = self.take().text
        self.depth -= 1
        if closing not in ")]":
            raise MathParseError(f"expected ')' or ']', found {closing!r}")
        if len(items) == 1:
            if opening + closing not in ("()", "[]"):
                raise MathParseError(f"{opening}...{closing} around one entry")
            return items[0]
        entries = tuple(entry(x) for x in items)
        if opening + closing == "()":
            return entries
        if len(entries) != 2:
            raise MathParseError(f"an interval has two endpoints, not {len(entries)}")
        return Interval(entries[0], entries[1], opening == "[", closing == "]")

    def base_numeral(self, digits: str):
        """`52_8`, `4210_{5}`: digits valid in the base, 2 <= base <= MAX_BASE."""
        self.expect("_")
        braced = self.at("{")
        if braced:
            self.take()
        tok = self.take()
        if braced:
            self.expect("}")
        if "." in digits or tok.kind != "num" or "." in tok.text or len(digits) > MAX_NUMBER_DIGITS:
            raise MathParseError(f"{digits}_{tok.text} is not an integer in a base")
        base = int(tok.text)
        if not 2 <= base <= MAX_BASE or any(int(d) >= base for d in digits):
            raise MathParseError(f"{digits} is not a numeral in base {base}")
        return BaseNumeral(int(digits, base), base)

    def _word(self, word: str):
        if len(word) == 1:
            return sympy.Symbol(word)
        if word == "pi":
            return sympy.pi
        if word == "sqrt":
            return lift_pm(sympy.sqrt, self._func_arg())
        if word in _FUNCTIONS:
            return self._function(word)
        raise MathParseError(f"word {word!r} is not math (only single letters and {sorted(_FUNCTIONS)})")

    def _func_arg(self):
        arg = self.atom() if self.at("(", "{") else self.power()
        check_scalars(arg)
        return arg

    def _function(self, name: str):
        """`\\sin x`, `\\sin^2 x` (= (sin x)^2), `\\log_2 8`; `\\sin^{-1}` is ambiguous and rejected."""
        exponent = base = None
        if self.at("^"):
            self.take()
            exponent = entry(self.argument())
            if exponent.is_negative:
                raise MathParseError(f"\\{name}^{{{exponent}}} is ambiguous (inverse or reciprocal)")
        if name == "log" and self.at("_"):
            self.take()
            base = entry(self.argument())
            if base.is_positive is not True or base == 1:
                raise MathParseError(f"logarithm base {base}")
        fn = _FUNCTIONS[name]
        value = lift_pm(fn if base is None else (lambda x: sympy.log(x, base)), self._func_arg())
        return value if exponent is None else lift_pm(bounded_pow, value, exponent)

    def _command(self, cmd: str):
        self.enter()
        try:
            if cmd == "\\frac":
                num, den = self.argument(), self.argument()
                return lift_pm(sympy.Mul, num, reciprocal(den))
            if cmd == "\\sqrt":
                index = None
                if self.at("["):
                    self.take()
                    index = self.expr()
                    self.expect("]")
                radicand = self.argument()
                if index is None:
                    return lift_pm(lambda r: bounded_pow(r, sympy.Rational(1, 2)), radicand)
                if not (isinstance(index, sympy.Basic) and index.is_Integer and 2 <= int(index) <= MAX_EXPONENT_DENOMINATOR):
                    raise MathParseError(f"root index {index} must be an integer in 2..{MAX_EXPONENT_DENOMINATOR}")
                return lift_pm(lambda r: bounded_pow(r, sympy.Rational(1, int(index))), radicand)
            if cmd == "\\pi":
                return sympy.pi
            if cmd == "\\infty":
                return sympy.oo
            if cmd in ("\\emptyset", "\\varnothing"):
                return Unordered(())
            if cmd == "\\{":
                items = self.items(self.expr)
                self.expect("\\}")
                return unordered(items)
            if cmd == "\\begin":
                return self.matrix()
            if cmd[1:] in _FUNCTIONS:
                return self._function(cmd[1:])
            raise MathParseError(f"LaTeX command {cmd!r} is not supported")
        finally:
            self.depth -= 1

    def _environment(self) -> str:
        self.expect("{")
        name = self.take().text
        self.expect("}")
        return name

    def matrix(self):
        env = self._environment()
        if env not in _MATRIX_ENVS:
            raise MathParseError(f"environment {env!r} is not one of {sorted(_MATRIX_ENVS)}")
        rows, row, count = [], [], 0
        while True:
            row.append(entry(self.expr()))
            count += 1
            if count > MAX_ITEMS:
                raise MathParseError(f"more than {MAX_ITEMS} matrix entries")
            tok = self.take()
            if tok.text == "&":
                continue
            if tok.text == "\\\\" and not self.at("\\end"):
                rows.append(tuple(row))
                row = []
                continue
            if tok.text == "\\\\":
                tok = self.take()  # a trailing \\ before \end
            if tok.text != "\\end":
                raise MathParseError(f"expected '&', '\\\\' or \\end in a matrix, found {tok.text!r}")
            rows.append(tuple(row))
            break
        if self._environment() != env:
            raise MathParseError(f"\\begin{{{env}}} closed by a different \\end")
        if len({len(r) for r in rows}) != 1:
            raise MathParseError("matrix rows of different lengths")
        return Matrix(tuple(rows))


def parse_math(text: str):
    """Parses a normalised answer string to a sympy expression or an answer kind (`math_answers`).

    Raises MathParseError for anything outside the grammar or its bounds (see module docstring).
    Never calls eval/exec/sympify/parse_expr.
    """
    tokens = tokenize(text)
    if not tokens:
        raise MathParseError("empty answer")
    parser = _Parser(tokens)
    try:
        value = parser.answer()
    except RecursionError as e:  # belt and braces: MAX_DEPTH should make this unreachable
        raise MathParseError("nesting too deep") from e
    if parser.peek() is not None:
        raise MathParseError(f"unexpected {parser.peek().text!r} after a complete answer")
    for scalar in scalars_in(value):  # products merge powers too: x^{1000} x^{1000} is x^2000
        bounded_degree(scalar)
    return value
