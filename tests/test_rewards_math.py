"""The strict math verifier: extraction, normalisation, the bounded parser, equality by value."""

import fractions

import pytest
import sympy

from grpo_jax.rewards import (
    MathParseError,
    extract_boxed,
    fast_math_reward,
    math_accuracy_reward,
    math_reward,
    normalize_answer,
    parse_math,
)


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
])
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


@pytest.mark.parametrize("text, value", [
    ("42", fractions.Fraction(42)),
    ("-0.25", fractions.Fraction(-1, 4)),
    (".5", fractions.Fraction(1, 2)),
    ("3/6", fractions.Fraction(1, 2)),
    (r"-\frac{2}{4}", fractions.Fraction(-1, 2)),
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
])
def test_parse_math_values(text, expected):
    assert parse_math(text) == expected


@pytest.mark.parametrize("text", [
    "1/3 1/2",            # implicit multiplication before a digit would turn hedging into 1/6
    r"2\frac{1}{2}",      # mixed number: ambiguous
    "1/3 or 1/2",         # words
    "9^9^9",              # exponent 387420489 > MAX_EXPONENT
    "10^{1000}^{1000}",   # exact power over MAX_POWER_BITS
    "1001!",              # factorial bound
    "3!!",                # ambiguous
    "1/0",
    "0^{-1}",
    "x = 1",              # '=' is handled before parsing, never inside
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
