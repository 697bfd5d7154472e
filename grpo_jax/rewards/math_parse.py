"""A small, bounded math grammar: answer text -> sympy objects, without evaluating any Python.

Model text is untrusted. `sympify` and `parse_expr` run Python `eval` on their input, so
`\\boxed{__import__('os').system(...)}` would execute and `9**9**9` would hang. This module
tokenises the text itself (ASCII only), parses it with recursive descent, and builds sympy
objects directly (`Integer`, `Rational`, `Add`, `Mul`, `Pow`, `sqrt`, ...). Every node is
bounded before it is built: input length, nesting depth, exponent size, the bit length of exact
powers, factorial arguments. Anything outside the grammar raises `MathParseError`.

Grammar (LaTeX and plain text; `^` binds tighter than unary minus, as in maths):
    answer  := expr (',' expr)*                     a comma list is a tuple
    expr    := term (('+' | '-') term)*
    term    := unary (('*' | '/' | \\cdot | \\times | \\div) unary | <implicit> power)*
    unary   := ('+' | '-') unary | power
    power   := postfix ('^' (group | unary))?
    postfix := atom '!'*                             n! for integers 0 <= n <= MAX_FACTORIAL
    atom    := number | letter | pi | '(' answer ')' | '{' expr '}'
             | \\frac A B | \\sqrt[n]? A | \\pi | \\infty | func A     (func: sin cos tan log ln exp sqrt)

Implicit multiplication (`2x`, `3\\pi`, `2(x+1)`) is allowed only when the right factor starts
with a letter, a command other than `\\frac`, or a bracket: never before a digit (`1/3 1/2` must
not become 1/6) and never before `\\frac` (`2\\frac12` is a mixed number to a human, 1 to sympy).
Multi-letter words other than the function names are rejected, so "1/3 or 1/2" cannot parse.
In plain-text powers `2^10` is 1024 (the whole number is the exponent), not LaTeX's `2^1 0`.
"""

from __future__ import annotations

import dataclasses
import re

import sympy

MAX_INPUT_CHARS = 1000  # a boxed answer longer than this is not a final answer
MAX_DEPTH = 64  # nested expressions/signs/commands (a bracket costs 1-2); ~7 Python frames each
MAX_EXPONENT = 1000  # |numerator| of a rational exponent
MAX_EXPONENT_DENOMINATOR = 100
MAX_POWER_BITS = 20_000  # exact rational powers larger than this are refused (9^9^9 is ~1.2e9 bits)
MAX_FACTORIAL = 1000
MAX_NUMBER_DIGITS = 400


class MathParseError(ValueError):
    """The text is outside the grammar or its bounds; the verifier scores it 0.0."""


@dataclasses.dataclass(frozen=True)
class Token:
    kind: str  # "num", "word", "cmd", "op"
    text: str


# One pattern, ASCII only: `\d` without re.ASCII would also match Arabic-Indic and other digits.
_TOKEN_RE = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d*)?|\.\d+)|(?P<word>[A-Za-z]+)|(?P<cmd>\\[A-Za-z]+)|(?P<op>[-+*/^()\[\]{}!,]))",
    re.ASCII,
)

_FUNCTIONS = {
    "sin": sympy.sin,
    "cos": sympy.cos,
    "tan": sympy.tan,
    "log": sympy.log,  # natural log, as in sympy and most answer keys
    "ln": sympy.log,
    "exp": sympy.exp,
}
_MUL_CMDS = {"\\cdot", "\\times"}
_DIV_CMDS = {"\\div"}


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
    if isinstance(base, tuple) or isinstance(exponent, tuple):
        raise MathParseError("a tuple cannot be raised to a power")
    if exponent.is_Rational:
        if abs(exponent.p) > MAX_EXPONENT or exponent.q > MAX_EXPONENT_DENOMINATOR:
            raise MathParseError(f"exponent {exponent} outside |p| <= {MAX_EXPONENT}, q <= {MAX_EXPONENT_DENOMINATOR}")
        if base.is_Rational and _bits(base) * abs(int(exponent.p)) // int(exponent.q) > MAX_POWER_BITS:
            raise MathParseError(f"power would exceed {MAX_POWER_BITS} bits")
        if base == 0 and exponent.is_negative:
            raise MathParseError("zero to a negative power")
    elif exponent.free_symbols == set() and base.is_number:
        # An irrational or huge symbolic exponent of a number (2^(10^10) written as 2^{10^{10}} is
        # caught above; this covers e.g. 2^{\pi}): sympy keeps it unevaluated, which is cheap.
        pass
    return sympy.Pow(base, exponent)


def bounded_factorial(arg):
    if isinstance(arg, tuple):
        raise MathParseError("factorial of a tuple")
    if arg.is_Integer:
        if not 0 <= int(arg) <= MAX_FACTORIAL:
            raise MathParseError(f"factorial argument {arg} outside 0..{MAX_FACTORIAL}")
        return sympy.factorial(arg)
    if arg.is_number:
        raise MathParseError(f"factorial of non-integer {arg}")
    return sympy.factorial(arg)


def _number(text: str) -> sympy.Rational:
    """Exact value of a decimal literal (no floats: 0.1 + 0.2 must equal 0.3)."""
    if len(text) > MAX_NUMBER_DIGITS:
        raise MathParseError(f"number with {len(text)} digits; at most {MAX_NUMBER_DIGITS} allowed")
    whole, _, frac = text.partition(".")
    digits = (whole or "0") + frac
    return sympy.Rational(int(digits), 10 ** len(frac))


class _Parser:
    def __init__(self, tokens: list[Token]):
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    # -- token helpers -------------------------------------------------------------------------
    def peek(self) -> Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

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

    # -- grammar -------------------------------------------------------------------------------
    def answer(self):
        items = [self.expr()]
        while self.peek() is not None and self.peek().text == ",":
            self.take()
            items.append(self.expr())
        if len(items) == 1:
            return items[0]
        if any(isinstance(x, tuple) for x in items):
            raise MathParseError("nested tuples are not answers")
        return tuple(items)

    def expr(self):
        self.enter()
        value = self.term()
        while (tok := self.peek()) is not None and tok.text in "+-" and tok.kind == "op":
            self.take()
            rhs = self.term()
            _no_tuple(value, rhs)
            value = sympy.Add(value, rhs) if tok.text == "+" else sympy.Add(value, -rhs)
        self.depth -= 1
        return value

    def term(self):
        value = self.unary()
        while (tok := self.peek()) is not None:
            if tok.text in ("*",) or tok.text in _MUL_CMDS:
                self.take()
                rhs = self.unary()
                _no_tuple(value, rhs)
                value = sympy.Mul(value, rhs)
            elif tok.text == "/" or tok.text in _DIV_CMDS:
                self.take()
                rhs = self.unary()
                _no_tuple(value, rhs)
                if rhs == 0:
                    raise MathParseError("division by zero")
                value = sympy.Mul(value, bounded_pow(rhs, sympy.Integer(-1)))
            elif self._starts_implicit_factor(tok):
                rhs = self.power()
                _no_tuple(value, rhs)
                value = sympy.Mul(value, rhs)
            else:
                break
        return value

    @staticmethod
    def _starts_implicit_factor(tok: Token) -> bool:
        if tok.kind == "word":
            return True
        if tok.kind == "cmd":
            return tok.text not in _MUL_CMDS and tok.text not in _DIV_CMDS and tok.text not in ("\\frac",)
        return tok.kind == "op" and tok.text in "({"

    def unary(self):
        tok = self.peek()
        if tok is not None and tok.kind == "op" and tok.text in "+-":
            self.take()
            self.enter()
            value = self.unary()
            self.depth -= 1
            _no_tuple(value)
            return -value if tok.text == "-" else value
        return self.power()

    def power(self):
        base = self.postfix()
        tok = self.peek()
        if tok is not None and tok.text == "^":
            self.take()
            nxt = self.peek()
            exponent = self.group() if nxt is not None and nxt.text == "{" else self.unary()
            return bounded_pow(base, exponent)
        return base

    def postfix(self):
        value = self.atom()
        while (tok := self.peek()) is not None and tok.text == "!":
            self.take()
            nxt = self.peek()
            if nxt is not None and nxt.text == "!":
                raise MathParseError("'!!' is ambiguous (double factorial or repeated factorial)")
            value = bounded_factorial(value)
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

    def atom(self):
        tok = self.take()
        if tok.kind == "num":
            return _number(tok.text)
        if tok.kind == "op":
            if tok.text == "(":
                value = self.answer()  # expr() counts the depth
                self.expect(")")
                return value
            if tok.text == "{":
                self.i -= 1
                return self.group()
            raise MathParseError(f"unexpected {tok.text!r}")
        if tok.kind == "word":
            return self._word(tok.text)
        return self._command(tok.text)

    def _word(self, word: str):
        if len(word) == 1:
            return sympy.Symbol(word)
        if word == "pi":
            return sympy.pi
        if word == "sqrt":
            return sympy.sqrt(self._func_arg())
        if word in _FUNCTIONS:
            return _FUNCTIONS[word](self._func_arg())
        raise MathParseError(f"word {word!r} is not math (only single letters and {sorted(_FUNCTIONS)})")

    def _func_arg(self):
        tok = self.peek()
        if tok is not None and tok.text in ("(", "{"):
            arg = self.atom()
        else:
            arg = self.power()
        _no_tuple(arg)
        return arg

    def _command(self, cmd: str):
        self.enter()
        try:
            if cmd == "\\frac":
                num, den = self.argument(), self.argument()
                _no_tuple(num, den)
                if den == 0:
                    raise MathParseError("division by zero in \\frac")
                return sympy.Mul(num, bounded_pow(den, sympy.Integer(-1)))
            if cmd == "\\sqrt":
                index = None
                tok = self.peek()
                if tok is not None and tok.text == "[":
                    self.take()
                    index = self.expr()
                    self.expect("]")
                radicand = self.argument()
                _no_tuple(radicand)
                if index is None:
                    return bounded_pow(radicand, sympy.Rational(1, 2))
                if not (index.is_Integer and 2 <= int(index) <= MAX_EXPONENT_DENOMINATOR):
                    raise MathParseError(f"root index {index} must be an integer in 2..{MAX_EXPONENT_DENOMINATOR}")
                return bounded_pow(radicand, sympy.Rational(1, int(index)))
            if cmd == "\\pi":
                return sympy.pi
            if cmd == "\\infty":
                return sympy.oo
            if cmd[1:] in _FUNCTIONS:
                return _FUNCTIONS[cmd[1:]](self._func_arg())
            raise MathParseError(f"LaTeX command {cmd!r} is not supported")
        finally:
            self.depth -= 1


def _no_tuple(*values) -> None:
    if any(isinstance(v, tuple) for v in values):
        raise MathParseError("a tuple cannot take part in arithmetic")


def parse_math(text: str):
    """Parses a normalised answer string to a sympy expression, or a tuple of them for `a, b`.

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
    return value
