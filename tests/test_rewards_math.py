"""The strict math verifier: extraction, normalisation, the bounded parser, equality by value."""

import fractions
import json
import pathlib

import pytest
import sympy

import grpo_jax
from grpo_jax.rewards import (
    MathParseError,
    answers_equal,
    extract_boxed,
    fast_math_reward,
    math_accuracy_reward,
    math_reward,
    normalize_answer,
    parse_math,
)
from grpo_jax.rewards.math_answers import (
    BaseNumeral,
    Interval,
    Matrix,
    Relation,
    Unordered,
)
from grpo_jax.tasks.jsonl import extract_reference


@pytest.mark.parametrize("completion, expected", [
    (r"so \boxed{\frac{1}{3}}.", r"\frac{1}{3}"),       # nested braces are matched
    (r"\boxed{ 42 }", "42"),                              # surrounding spaces stripped
    (r"\boxed {7}", "7"),                                 # a space before the brace is allowed
    (r"\boxed{1} and \boxed{2}", None),                   # two boxes: hedging
    (r"\boxed{1} \fbox{2}", None),                        # \fbox counts as a box too
    (r"\boxed{\frac{1}{3}", None),                        # unclosed
    (r"\boxed{}", None),                                  # empty
    (r"\boxed{   }", None),                               # blank
    ("The answer is 1/3", None),                          # no box at all
    (r"\boxed7", None),                                   # no brace: not a box we accept
])
def test_extract_boxed(completion, expected):
    assert extract_boxed(completion) == expected


@pytest.mark.parametrize("raw, normalised", [
    ("1,000", "1000"),                    # thousands separator, whole answer one number
    ("1{,}000", "1000"),                  # LaTeX's braced comma
    ("1, 2", "1, 2"),                     # a comma with a space separates tuple entries
    (r"50\%", "50"),                      # percent sign dropped: 50% matches 50, not 0.5
    (r"90^\circ", "90"),                  # degrees dropped
    (r"5 \text{ cm}", "5"),               # a trailing unit dropped
    ("12 dollars", "12"),                 # a bare trailing unit word too
    (r"\$5.", "5"),                       # dollar sign and final full stop
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),    # dfrac/tfrac are frac
    ("\u22123", "-3"),                    # Unicode minus
    (r"\text{1/3 or 1/2}", "1/3 or 1/2"),  # wrapper unwrapped; the parser then rejects "or"
    (r"$5 \text{ cm}$", "5"),             # `$` goes first, so the unit is still trailing
    (r"\(\frac{1}{2}\)", r"\frac{1}{2}"),  # inline-maths delimiters around the whole answer
    (r"\text{Evelyn}", "Evelyn"),          # a whole answer in \text is the answer, not a unit
    (r"\textbf{(C)}", "(C)"),
    (r"3 \text{ or four}", "3  or four"),  # a hedging "unit" is kept, and the parser rejects it
    (r"10,\!080", "10080"),                # LaTeX thousands separators
    (r"11,\! 111,\! 111,\! 100", "11111111100"),
    (r"1\,000", "1000"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),  # \\ is a row break, not `\ `
])
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


@pytest.mark.parametrize("text, value", [
    ("42", fractions.Fraction(42)),
    ("-0.25", fractions.Fraction(-1, 4)),
    (".5", fractions.Fraction(1, 2)),
    ("3/6", fractions.Fraction(1, 2)),
    (r"-\frac{2}{4}", fractions.Fraction(-1, 2)),
    (r"\frac43", fractions.Fraction(4, 3)),        # LaTeX one-digit arguments, as the parser reads them
    (r"\frac 59", fractions.Fraction(5, 9)),
    (r"\frac{270}7", fractions.Fraction(270, 7)),
    (r"\frac123", None),               # 1/2 then a stray 3: left to the parser, which rejects it
    (r"\frac{1}{0}", None),             # left to the parser, which rejects it
    ("x", None),                        # not a plain number: slow path
])
def test_fast_number_path(text, value):
    from grpo_jax.rewards.math_verify import fast_number

    assert fast_number(text) == value


@pytest.mark.parametrize("text, expected", [
    ("2+3*4", sympy.Integer(14)),                      # precedence
    ("-2^2", sympy.Integer(-4)),                       # ^ binds tighter than unary minus
    ("2^3^2", sympy.Integer(512)),                     # ^ is right associative
    ("2^10", sympy.Integer(1024)),                     # plain-text exponent: the whole number
    (r"\frac12", sympy.Rational(1, 2)),                # LaTeX one-digit arguments
    (r"\sqrt[3]{27}", sympy.Integer(3)),
    (r"3\sqrt{2}", 3 * sympy.sqrt(2)),                 # implicit multiplication before a command
    ("2(3+1)", sympy.Integer(8)),                      # ... and before a bracket
    ("5!", sympy.Integer(120)),
    ("0.1+0.2", sympy.Rational(3, 10)),                # decimals are exact rationals
    (r"2\pi", 2 * sympy.pi),
    ("(1, 2)", (sympy.Integer(1), sympy.Integer(2))),  # a tuple
    (r"2\frac{1}{2}", sympy.Rational(5, 2)),            # a mixed number, as a human reads it
    (r"-1\frac{4}{5}", sympy.Rational(-9, 5)),          # the sign covers the whole mixed number
    ("52_8", BaseNumeral(42, 8)),                      # a numeral in base 8 (kept apart from 42)
    ("4210_{5}", BaseNumeral(555, 5)),
    ("(3, 4]", Interval(sympy.Integer(3), sympy.Integer(4), False, True)),
    ("1, -2", Unordered((sympy.Integer(1), sympy.Integer(-2)))),  # a bare list: solutions
    (r"\pm 3", Unordered((sympy.Integer(3), sympy.Integer(-3)))),  # \pm is a set of two
    (r"\{1 \pm \sqrt{5}, -2\}", Unordered((1 + sympy.sqrt(5), 1 - sympy.sqrt(5), sympy.Integer(-2)))),
    (r"\frac{1 \pm \sqrt{5}}{2}", Unordered(((1 + sympy.sqrt(5)) / 2, (1 - sympy.sqrt(5)) / 2))),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
     Matrix(((sympy.Integer(1), sympy.Integer(2)), (sympy.Integer(3), sympy.Integer(4))))),
    ("x = 1", Relation((sympy.Symbol("x"), sympy.Integer(1)), ("=",))),
    (r"-2 \le x < 7", Relation((sympy.Integer(-2), sympy.Symbol("x"), sympy.Integer(7)), ("<=", "<"))),
    (r"\cot x", sympy.cot(sympy.Symbol("x"))),
    (r"\sin^2 x", sympy.sin(sympy.Symbol("x")) ** 2),   # a power of the function, not of x
    (r"\log_2 8", sympy.Integer(3)),
])
def test_parse_math_values(text, expected):
    assert parse_math(text) == expected


@pytest.mark.parametrize("text", [
    "1/3 1/2",            # implicit multiplication before a digit would turn hedging into 1/6
    r"2\frac{3}{2}",      # an improper fraction after a number is no mixed number: ambiguous
    r"1.5\frac{1}{2}",    # nor after a decimal
    r"x^2\frac{1}{2}",    # nor in an exponent: x^2 times 1/2, or x^(5/2)?
    "1/3 or 1/2",         # words
    "9^9^9",              # exponent 387420489 > MAX_EXPONENT
    "10^{1000}^{1000}",   # exact power over MAX_POWER_BITS
    "1001!",              # factorial bound
    "3!!",                # ambiguous
    "1/0",
    "0^{-1}",
    "x = 1 = 2",          # '=' chains are not answers
    "1 < x > 0",          # a chain of relations that changes direction
    r"1 \pm 2 \pm 3",     # two \pm in one entry: which signs go together?
    r"(1 \pm 2, 3)",      # \pm inside a tuple
    r"(1, 2, 3]",         # an interval has two endpoints
    "(1]",                # ... and a bracket pair around one entry must match
    "58_8",               # 8 is not a digit in base 8
    "12_1",               # base 1
    r"\sin^{-1} x",       # inverse or reciprocal?
    r"\begin{pmatrix} 1 & 2 \\ 3 \end{pmatrix}",  # ragged matrix
    r"\begin{pmatrix} 1 \end{bmatrix}",           # mismatched environment
    r"\begin{vmatrix} 1 \end{vmatrix}",           # a determinant is not a matrix answer
    r"\{\{1\}\}",          # a set inside a list of answers
    r"1 \cup 2",          # a union of numbers
    "x^{1000}" * 11,      # x^11000: over MAX_DEGREE
    "__import__('os')",   # underscores and quotes are not in the grammar
    "2**3",               # Python power is not maths notation here
    "\uff11",             # fullwidth digit one
    r"\int x",            # unsupported command
    "(" * 70 + "1" + ")" * 70,  # nesting over MAX_DEPTH
    "1" * 1001,           # over MAX_INPUT_CHARS
])
def test_parse_math_rejects(text):
    with pytest.raises(MathParseError):
        parse_math(text)


@pytest.mark.parametrize("completion, answer, reward", [
    (r"\boxed{\frac{1}{3}}", "1/3", 1.0),                     # LaTeX fraction vs slash
    (r"\boxed{\dfrac{2}{6}}", "1/3", 1.0),                     # unreduced, dfrac
    (r"\boxed{0.5}", r"\frac12", 1.0),                        # decimal vs fraction, exactly
    (r"\boxed{0.333}", "1/3", 0.0),                           # a rounded decimal is not 1/3
    (r"\boxed{+7}", "7", 1.0),                                # explicit sign
    (r"\boxed{-7}", "7", 0.0),
    (r"\boxed{1,234,567}", "1234567", 1.0),                   # thousands separators
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),                 # simple LaTeX, symbolic equality
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0),                           # an approximation is wrong
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),                    # symbolic identity (ground truth has x)
    (r"\boxed{2x+2}", "x^2+2x+1", 0.0),
    (r"\boxed{y+1}", "x+1", 0.0),                             # different free symbol
    (r"\boxed{x = 5}", "5", 1.0),                             # a single-letter assignment is unwrapped
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{12 \text{ dollars}}", "12", 1.0),
    (r"\boxed{(3, 4)}", "(3, 4)", 1.0),                       # ordered pair
    (r"\boxed{(4, 3)}", "(3, 4)", 0.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{10!}", "3628800", 1.0),
])
def test_math_reward_by_value(completion, answer, reward):
    assert math_reward(completion, answer) == reward


def test_fast_path_decides_plain_numbers_without_sympy():
    # Plain numbers on both sides are settled by fractions.Fraction; symbolic ones return None.
    assert fast_math_reward(r"\boxed{3/4}", "0.75") == 1.0
    assert fast_math_reward(r"\boxed{3/4}", "0.7") == 0.0
    assert fast_math_reward(r"no box", "0.7") == 0.0
    assert fast_math_reward(r"\boxed{\sqrt{4}}", "2") is None


def test_math_accuracy_reward_is_a_reward_fn():
    completions = [r"\boxed{4}", r"\boxed{\sqrt{16}}", r"\boxed{5}", "no answer"]
    scores = math_accuracy_reward(["q"] * 4, completions, answer=["4", "4", "4", "4"], step=3, truncated=[False] * 4)
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_math_accuracy_reward_length_mismatch_names_the_field():
    with pytest.raises(ValueError, match="answer"):
        math_accuracy_reward(["q"], [r"\boxed{1}"], answer=["1", "2"])


# ------------------------------------------------------------------------------------------------
# Answer kinds (semantics: the table in grpo_jax/rewards/math_answers.py). Each category has rows
# that must be equal and rows that must differ: a verifier that only ever says "equal" fails here.

KIND_TABLE = [
    # intervals: endpoints by value, open/closed ends exactly
    ("interval", "(3,4]", "(3,4]", 1.0),
    ("interval", r"\left( 3, \frac{8}{2} \right]", "(3,4]", 1.0),
    ("interval", "(3,4)", "(3,4]", 0.0),                     # an open end is not a closed one
    ("interval", "[3,4]", "(3,4]", 0.0),
    ("interval", "(4,3]", "(3,4]", 0.0),                     # endpoints in order
    ("interval", "[1,2]", "(1,2)", 0.0),
    ("interval", r"(-\infty, 0]", r"(-\infty, 0]", 1.0),
    ("interval", r"(-\infty, 0)", r"(-\infty, 0]", 0.0),
    ("interval", r"(\infty, 0]", r"(-\infty, 0]", 0.0),
    ("interval", r"[-2, 7]", r"x \in [-2,7]", 1.0),          # `x \in` is an assignment, dropped
    ("interval", r"x \in [-2, 7)", r"x \in [-2,7]", 0.0),
    ("interval", r"y \in [-2, 7]", r"x \in [-2,7]", 0.0),     # a different letter on both sides
    ("interval", r"\left[ \frac{\pi^2}{8}, \frac{5 \pi^2}{4} \right]", r"[\pi^2/8, 1.25\pi^2]", 1.0),
    # unions: the same parts in any order; touching parts are not merged (strict, documented)
    ("union", r"(9,36) \cup (0,9)", r"(0,9) \cup (9,36)", 1.0),
    ("union", r"(0,9) \cup [9,36)", r"(0,9) \cup (9,36)", 0.0),
    ("union", "(0,36)", r"(0,9) \cup (9,36)", 0.0),
    ("union", r"(0,9) \cup (9,36) \cup (0,9)", r"(0,9) \cup (9,36)", 0.0),
    ("union", r"(-\infty, 2) \cup (3, \infty)", r"(-\infty,2)\cup(3,\infty)", 1.0),
    # matrices and vectors: element-wise by value; an n x 1 column also equals an n-tuple
    ("matrix", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}", r"\begin{pmatrix} -\frac13 \\ \frac46 \\ \frac53 \end{pmatrix}", 1.0),
    ("matrix", r"(-1/3, 2/3, 5/3)", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}", 1.0),
    ("matrix", r"\begin{bmatrix} -1/3 \\ 2/3 \\ 5/3 \\ \end{bmatrix}", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}", 1.0),
    ("matrix", r"\frac{1}{3}\begin{pmatrix} -1 \\ 2 \\ 5 \end{pmatrix}", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}", 1.0),
    ("matrix", r"\begin{pmatrix} 2/3 \\ -1/3 \\ 5/3 \end{pmatrix}", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}", 0.0),
    ("matrix", r"\begin{pmatrix} -1/3 & 2/3 & 5/3 \end{pmatrix}", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}", 0.0),  # a row is not a column
    ("matrix", r"-\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", 1.0),
    ("matrix", r"\begin{pmatrix} -1 & 0 & 0 & -1 \end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", 0.0),  # shape
    ("matrix", r"\begin{pmatrix} 0 & -1 \\ -1 & 0 \end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", 0.0),
    ("matrix", "(-1, 0, 0, -1)", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", 0.0),
    # base subscripts: the same base and value; never a plain number (the task asked for base-8 digits)
    ("base", "52_8", "52_8", 1.0),
    ("base", "52_{8}", "52_8", 1.0),
    ("base", "052_8", "52_8", 1.0),
    ("base", "42", "52_8", 0.0),                              # its value in base ten
    ("base", "52", "52_8", 0.0),                              # the digits without the base
    ("base", "52_9", "52_8", 0.0),
    ("base", "53_8", "52_8", 0.0),
    # words: the same words, case and spacing ignored
    ("text", r"\text{Evelyn}", r"\text{Evelyn}", 1.0),
    ("text", "Evelyn", r"\text{Evelyn}", 1.0),
    ("text", r"\textbf{evelyn}", r"\text{Evelyn}", 1.0),
    ("text", r"\text{Emily}", r"\text{Evelyn}", 0.0),
    ("text", r"\text{Evelyn or Emily}", r"\text{Evelyn}", 0.0),
    ("text", r"\text{Evelyn}, \text{Emily}", r"\text{Evelyn}", 0.0),
    ("text", "", r"\text{Evelyn}", 0.0),                     # was: both stripped to nothing
    ("text", r"\text{west}", r"\text{east}", 0.0),
    ("text", "3", r"\text{three}", 0.0),
    ("text", r"\text{(C)}", r"\text{(C)}", 1.0),             # multiple choice
    ("text", "(C)", r"\text{(C)}", 1.0),
    ("text", r"\text{(D)}", r"\text{(C)}", 0.0),
    # \pm: the set {a + b, a - b}
    ("pm", r"1 \pm \sqrt{19}", r"1 \pm \sqrt{19}", 1.0),
    ("pm", r"1 - \sqrt{19}, 1 + \sqrt{19}", r"1 \pm \sqrt{19}", 1.0),
    ("pm", r"\{1+\sqrt{19}, 1-\sqrt{19}\}", r"1 \pm \sqrt{19}", 1.0),
    ("pm", r"\frac{2 \pm \sqrt{76}}{2}", r"1 \pm \sqrt{19}", 1.0),  # \pm carried through arithmetic
    ("pm", r"1 \mp \sqrt{19}", r"1 \pm \sqrt{19}", 1.0),
    ("pm", r"x = 1 \pm \sqrt{19}", r"1 \pm \sqrt{19}", 1.0),
    ("pm", r"x = 1 + \sqrt{19}, x = 1 - \sqrt{19}", r"1 \pm \sqrt{19}", 1.0),
    ("pm", r"1 + \sqrt{19}", r"1 \pm \sqrt{19}", 0.0),              # one of the two is not both
    ("pm", r"-1 \pm \sqrt{19}", r"1 \pm \sqrt{19}", 0.0),
    ("pm", r"1 \pm \sqrt{19}", r"1 + \sqrt{19}", 0.0),              # nor is "both" the one
    ("pm", r"3 \pm 2 \sqrt{2}", r"3 \pm 2 \sqrt{2}", 1.0),
    # mixed numbers: the human reading
    ("mixed", r"1\frac{4}{5}", r"1\frac{4}{5}", 1.0),
    ("mixed", r"\frac{9}{5}", r"1\frac{4}{5}", 1.0),
    ("mixed", "1.8", r"1\frac{4}{5}", 1.0),
    ("mixed", r"\frac{4}{5}", r"1\frac{4}{5}", 0.0),                # not 1 * 4/5
    ("mixed", r"275/2", r"137 \frac{1}{2}", 1.0),
    ("mixed", r"137", r"137 \frac{1}{2}", 0.0),
    ("mixed", r"-1\frac{1}{2}", "-3/2", 1.0),
    ("mixed", r"2\frac{3}{2}", "7/2", 0.0),                         # improper: ambiguous, rejected
    # functions
    ("function", r"\cot x", r"\cot x", 1.0),
    ("function", r"\frac{\cos x}{\sin x}", r"\cot x", 1.0),
    ("function", r"\frac{1}{\tan x}", r"\cot x", 1.0),
    ("function", r"\tan x", r"\cot x", 0.0),
    ("function", r"\cot y", r"\cot x", 0.0),
    ("function", r"\sin^2 x", r"(\sin x)^2", 1.0),
    ("function", r"\sin x^2", r"(\sin x)^2", 0.0),
    ("function", r"\log_2 8", "3", 1.0),
    # equations: the same equation up to sides, order of terms and a nonzero constant factor
    ("equation", r"5x - 7y + 11z + 4 = 0", r"5x - 7y + 11z + 4 = 0", 1.0),
    ("equation", r"0 = 5x - 7y + 11z + 4", r"5x - 7y + 11z + 4 = 0", 1.0),
    ("equation", r"-10x + 14y - 22z = 8", r"5x - 7y + 11z + 4 = 0", 1.0),
    ("equation", r"\frac{5}{4}x - \frac{7}{4}y + \frac{11}{4}z + 1 = 0", r"5x - 7y + 11z + 4 = 0", 1.0),
    ("equation", r"5x - 7y + 11z = 4", r"5x - 7y + 11z + 4 = 0", 0.0),
    ("equation", r"5x - 7y + 11z + 4", r"5x - 7y + 11z + 4 = 0", 0.0),  # an expression is no equation
    ("equation", r"5x - 7y + 11w + 4 = 0", r"5x - 7y + 11z + 4 = 0", 0.0),
    ("equation", r"(5x - 7y + 11z + 4)^2 = 0", r"5x - 7y + 11z + 4 = 0", 0.0),  # not a constant factor
    ("equation", r"0 = 0", r"5x - 7y + 11z + 4 = 0", 0.0),
    ("equation", r"0x = 0", r"5x - 7y + 11z + 4 = 0", 0.0),
    ("equation", r"y = 2x + 3", r"y = 2x + 3", 1.0),
    ("equation", r"2x - y + 3 = 0", r"y = 2x + 3", 1.0),
    ("equation", r"2x + 3", r"y = 2x + 3", 1.0),               # an assignment's right side alone
    ("equation", r"y = 2x - 3", r"y = 2x + 3", 0.0),
    ("equation", r"x = 2y + 3", r"y = 2x + 3", 0.0),
    ("equation", r"5 = x", r"x = 5", 1.0),
    ("equation", r"5 = y", r"x = 5", 0.0),
    # inequalities: the same relation up to sides and a positive constant factor
    ("inequality", r"x \le 5", r"5 \ge x", 1.0),
    ("inequality", r"2x \leq 10", r"x \le 5", 1.0),
    ("inequality", r"x <= 5", r"x \le 5", 1.0),
    ("inequality", r"x < 5", r"5 \ge x", 0.0),                  # strict is not non-strict
    ("inequality", r"x \ge 5", r"x \le 5", 0.0),
    ("inequality", r"-x \le -5", r"x \le 5", 0.0),              # a negative factor flips it
    ("inequality", r"x = 5", r"x \le 5", 0.0),
    ("inequality", r"7 \ge x \ge -2", r"-2 \le x \le 7", 1.0),
    ("inequality", r"-2 < x \le 7", r"-2 \le x \le 7", 0.0),
    ("inequality", r"x < 3", "3", 0.0),
    # several solutions: the same entries in any order
    ("list", "-2, 1", "1, -2", 1.0),
    ("list", r"\{1, -2\}", "1,-2", 1.0),
    ("list", r"x = 1, x = -2", "1,-2", 1.0),
    ("list", "1, 2", "1,-2", 0.0),
    ("list", "1, -2, 3", "1,-2", 0.0),
    ("list", "1, 1, -2", "1,-2", 0.0),                           # counted with multiplicity
    ("list", "1", "1,-2", 0.0),
    ("list", "(1, -2)", "1,-2", 0.0),                            # an ordered pair is not a list of solutions
    ("list", "(-2, 1)", "(1, -2)", 0.0),                         # and its order matters
    ("list", r"-2, 1+\sqrt{5}, 1-\sqrt{5}", r"\{1\pm\sqrt{5},-2\}", 1.0),
    ("list", r"-2, 1+\sqrt{5}", r"\{1\pm\sqrt{5},-2\}", 0.0),
    ("list", r"(1,2), (3,4)", r"(3,4), (1,2)", 1.0),             # points in any order
    ("list", r"(2,1), (3,4)", r"(3,4), (1,2)", 0.0),
    # the reference written with `$...$` reads as without
    ("dollars", r"5 \text{ cm}", r"$5 \text{ cm}$", 1.0),
    ("dollars", r"6 \text{ cm}", r"$5 \text{ cm}$", 0.0),
    ("dollars", r"(3,4]", r"$(3,4]$", 1.0),
    ("dollars", r"(3,4)", r"$(3,4]$", 0.0),
]


@pytest.mark.parametrize("kind, pred, truth, reward", KIND_TABLE,
                         ids=[f"{r[0]}:{r[1]}|{r[2]}" for r in KIND_TABLE])
def test_answer_kinds(kind, pred, truth, reward):
    assert math_reward(rf"\boxed{{{pred}}}", truth) == reward


def test_every_kind_has_equal_and_unequal_rows():
    kinds = {r[0] for r in KIND_TABLE}
    for kind in kinds:
        assert {r[3] for r in KIND_TABLE if r[0] == kind} == {0.0, 1.0}, kind


def test_answers_equal_is_symmetric_on_the_kind_table():
    # The prediction and the reference go through the same normalisation, parser and comparison.
    for _, pred, truth, reward in KIND_TABLE:
        if pred:
            try:
                back = answers_equal(truth, pred)
            except MathParseError:
                back = False
            assert back == (reward == 1.0), (pred, truth)


# ------------------------------------------------------------------------------------------------
# MATH-500: the real answers (shipped copy, MIT; see grpo_jax/assets/data/README.md)

MATH500 = pathlib.Path(grpo_jax.__file__).parent / "assets" / "data" / "math500_test.jsonl"


@pytest.fixture(scope="module")
def math500():
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    assert len(rows) == 500
    return rows


def test_math500_gold_answers_boxed_exactly_score_one(math500):
    wrong = [r["answer"] for r in math500 if math_reward(rf"\boxed{{{r['answer']}}}", r["answer"]) != 1.0]
    assert wrong == []


def test_math500_last_box_of_each_solution_scores_one(math500):
    # The box is found the way the jsonl task finds MATH references (tasks/jsonl.py).
    wrong = []
    for r in math500:
        boxed = extract_reference(r["solution"], "boxed")
        if math_reward(rf"\boxed{{{boxed}}}", r["answer"]) != 1.0:
            wrong.append((boxed, r["answer"]))
    assert wrong == []


@pytest.mark.parametrize("wrap", ["${}$", r"\({}\)"])
def test_math500_reference_in_maths_delimiters_reads_the_same(math500, wrap):
    wrong = [r["answer"] for r in math500
             if math_reward(rf"\boxed{{{r['answer']}}}", wrap.format(r["answer"])) != 1.0
             or math_reward(rf"\boxed{{{wrap.format(r['answer'])}}}", r["answer"]) != 1.0]
    assert wrong == []


def test_math500_another_problems_answer_scores_zero(math500):
    # Each gold answer against the next problem's: equal only where the two are equal by value.
    golds = [r["answer"] for r in math500]
    equal = [(a, b) for a, b in zip(golds, golds[1:] + golds[:1])
             if a != b and math_reward(rf"\boxed{{{b}}}", a) == 1.0]
    assert equal == [("5", "x=5")]  # `x = 5` answers "5": an assignment's letter is dropped
