"""Reading answers before comparing them (grpo_jax/rewards/math_read.py): labels, chains of equal
sides, joined lists, `\\approx`, relations as sets, number formats. Each rule has rows that must be
equal and look-alikes that must not: a rule that only ever says "equal" fails here."""

import pytest
import sympy

from grpo_jax.rewards import MathParseError, VerifyOptions, answers_equal, math_reward, normalize_answer
from grpo_jax.rewards.math_answers import Interval, Relation, Union
from grpo_jax.rewards.math_answers import relation_as_set
from grpo_jax.rewards.math_read import read_answer

RULES = [
    # labels on one side: stripped; a labelled list keeps its written order
    ("label", "AB = 4, CD = 5", "4, 5", 1.0),
    ("label", "AB = 5, CD = 4", "4, 5", 0.0),               # the labels carry the order: not 5, 4
    ("label", "CD = 5, AB = 4", "AB = 4, CD = 5", 1.0),     # labelled on both sides: matched by label
    ("label", "CD = 4, AB = 5", "AB = 4, CD = 5", 0.0),
    ("label", "AB = 4, CE = 5", "AB = 4, CD = 5", 0.0),     # a different label
    ("label", "(p, q) = (3, 2)", "(3, 2)", 1.0),
    ("label", "(p, q) = (2, 3)", "(3, 2)", 0.0),
    ("label", "p = 3, q = 2", "(p, q) = (3, 2)", 1.0),
    ("label", "q = 2, p = 3", "(p, q) = (3, 2)", 1.0),
    ("label", "p = 2, q = 3", "(p, q) = (3, 2)", 0.0),
    ("label", "f(x) = x^2 + 1", "x^2 + 1", 1.0),
    ("label", "f(x) = x^2 - 1", "x^2 + 1", 0.0),
    ("label", r"\angle ABC = 30", "30", 1.0),
    ("label", r"\theta = \frac{\pi}{4}", r"\frac{\pi}{4}", 1.0),
    ("label", r"\theta = \frac{\pi}{3}", r"\frac{\pi}{4}", 0.0),
    ("label", "BC = 4", "AB = 4", 0.0),                      # labelled on both sides: the same label
    # one letter's solutions: x = a, x = b / x_1 = a, x_2 = b / x = a, b are unordered
    ("roots", "x_1 = 2, x_2 = -3", "-3, 2", 1.0),
    ("roots", "x_1 = 2, x_2 = 3", "-3, 2", 0.0),
    ("roots", "x = 2, -3", "-3, 2", 1.0),
    ("roots", r"x = \frac12, x = 1 \pm \sqrt3", r"1 + \sqrt3, \frac12, 1 - \sqrt3", 1.0),  # \pm: two roots
    ("roots", r"x = \frac12, x = 1 + \sqrt3", r"1 + \sqrt3, \frac12, 1 - \sqrt3", 0.0),
    ("roots", "y = 2, y = -3", "x = 2, x = -3", 0.0),          # a different letter
    # chains of equal sides: the last side, when every side agrees
    ("chain", "x = 5 + 5 + 1 = 11", "11", 1.0),
    ("chain", r"\frac12 \cdot 3 \cdot 4 = 6", "6", 1.0),
    ("chain", "x = 5 + 5 + 1 = 12", "11", 0.0),                 # sides that differ: rejected
    ("chain", "x = 1/3 = 1/2", "1/2", 0.0),                     # a hedge as a chain
    ("chain", "2 + 2 = 5", "5", 0.0),
    ("chain", "2x = 10", "10", 0.0),                            # an equation, not the value 10
    ("chain", "(x+1)^2 = x^2 + 2x + 1", "x^2 + 2x + 1", 1.0),  # an identity states its right side
    ("chain", "(x+1)^2 = x^2 + x + 1", "x^2 + x + 1", 0.0),    # an equation (x = 0), not that value
    # joined lists: "and" / "or" make a list, compared as a multiset
    ("join", r"1 \text{ and } 2", "1, 2", 1.0),
    ("join", "x = 1 or x = -2", "1, -2", 1.0),
    ("join", "(1, 2) and (3, 4)", "(3, 4), (1, 2)", 1.0),
    ("join", "1 or 2", "1", 0.0),                               # a list never equals one entry
    ("join", "1 and 3", "1, 2", 0.0),
    ("join", r"\frac{639}{40} or 15\frac{39}{40}", r"\frac{639}{40}", 1.0),  # one value, twice
    ("join", r"\frac{639}{40} or 15\frac{38}{40}", r"\frac{639}{40}", 0.0),
    # relations as sets: an inequality in one letter is its interval
    ("set", r"x \le 3", r"(-\infty, 3]", 1.0),
    ("set", r"x < 3", r"(-\infty, 3]", 0.0),
    ("set", r"3 < x", r"(3, \infty)", 1.0),
    ("set", r"x > 3", r"[3, \infty)", 0.0),
    ("set", r"-2 \le x < 7", r"[-2, 7)", 1.0),
    ("set", r"7 > x \ge -2", r"[-2, 7)", 1.0),
    ("set", r"-2 < x < 7", r"[-2, 7)", 0.0),
    ("set", r"-2 \le x \le 7", r"x \in [-2, 7]", 1.0),
    ("set", r"-2 \le y \le 7", r"x \in [-2, 7]", 0.0),          # not the letter of the question
    ("set", r"x \neq 3", r"(-\infty, 3) \cup (3, \infty)", 1.0),
    ("set", r"x \ne 3", r"x \neq 3", 1.0),
    ("set", "x != 3", r"x \neq 3", 1.0),
    ("set", r"x \neq -3", r"x \neq 3", 0.0),
    ("set", r"x \neq 3", r"x < 3", 0.0),
    # approximations: the exact part is the answer, and it must agree with its approximation
    ("approx", r"\frac13 \approx 0.333", "1/3", 1.0),
    ("approx", r"\frac13 \approx 0.5", "1/3", 0.0),             # a contradiction, not a hedge that pays
    ("approx", r"\frac13 \approx 0.333", "0.333", 0.0),         # the exact 1/3 is not 0.333
    ("approx", r"x \approx 11", "11", 1.0),                     # approximately, and exactly, 11
    ("approx", r"x \approx 3.14", r"\pi", 0.0),                 # approx_rtol 0 (default): exact only
    # number formats (en): space-grouped thousands, `{, }`, never a decimal comma
    ("number", "1 000 000", "1000000", 1.0),
    ("number", "14 {, }916", "14916", 1.0),
    ("number", "1,2", "1.2", 0.0),                               # the list 1, 2
    ("number", "1,2", "1, 2", 1.0),
    ("number", "32, 349", "32349", 0.0),                         # a list of two numbers
    ("number", "-12; -11; -10", r"\{-12, -11, -10\}", 1.0),      # `;` separates entries
    # a trailing modulus: the residue is the answer
    ("modulus", r"9 \pmod{11}", "9", 1.0),
    ("modulus", r"9 \pmod 11", "9", 1.0),
    ("modulus", r"20 \pmod{11}", "9", 0.0),                     # congruent, but not the residue
    # LaTeX forms
    ("latex", r"\cfrac{1}{3}", "1/3", 1.0),
    ("latex", r"\nicefrac{2}{3}", "1/3", 0.0),
    ("latex", r"\left[\begin{array}{cc}1 & 2 \\ 3 & 4\end{array}\right]",
     r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}", 1.0),
    ("latex", r"\left[\begin{array}{c|c}1 & 2 \\ 4 & 3\end{array}\right]",
     r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}", 0.0),
    ("latex", "{1, 3}", r"\{3, 1\}", 1.0),                       # braces around a list: a set
    ("latex", "{1, 3}", "(1, 3)", 0.0),                          # ... not an ordered pair
    ("latex", r"\emptyset", r"\varnothing", 1.0),
    ("latex", r"\emptyset", r"\{0\}", 0.0),
    ("latex", r"125\textnormal{ miles}", "125", 1.0),
    ("latex", "28 pct", "28", 1.0),
]


@pytest.mark.parametrize("kind, pred, truth, reward", RULES, ids=[f"{r[0]}:{r[1]}|{r[2]}" for r in RULES])
def test_reading_rules(kind, pred, truth, reward):
    assert math_reward(rf"\boxed{{{pred}}}", truth) == reward


def test_every_rule_has_equal_and_unequal_rows():
    for kind in {r[0] for r in RULES}:
        assert {r[3] for r in RULES if r[0] == kind} == {0.0, 1.0}, kind


def test_reading_rules_are_symmetric():
    # The reference goes through the same normalisation, reading and comparison as the prediction.
    for _, pred, truth, reward in RULES:
        try:
            back = answers_equal(truth, pred)
        except MathParseError:
            back = False
        assert back == (reward == 1.0), (pred, truth)


APPROX = [
    # (prediction, reference, approx_rtol, reward, why)
    ("3.1416", r"\pi", 1e-4, 1.0, "|3.1416 - pi| / pi = 2.3e-6 <= 1e-4"),
    (r"x \approx 3.14", r"\pi", 1e-3, 1.0, "5.1e-4 <= 1e-3"),
    ("3.14", r"\pi", 1e-4, 0.0, "5.1e-4 > 1e-4"),
    ("0.333", "1/3", 2e-3, 1.0, "|0.333 - 1/3| / (1/3) = 1.0e-3 <= 2e-3"),
    ("0.33", "1/3", 2e-3, 0.0, "1.0e-2 > 2e-3"),
    (r"\sqrt{2}", "1.4142", 1e-4, 1.0, "the decimal may be either side: 1.5e-5 <= 1e-4"),
    ("0.4999", "0.5", 1e-3, 0.0, "0.5 can be written with 4 decimals, so only 0.5000 equals it"),
    ("99.99", "100", 1e-3, 0.0, "100 is exact at 2 decimals too"),
    ("0.13", "1/8", 0.1, 1.0, "1/8 = 0.125 needs 3 decimals; 0.13 is 4% off, inside 10%"),
    ("0.3333", "0.333", 1e-2, 0.0, "two decimals: both approximations, neither exact, so exact only"),
    ("-3.1416", r"\pi", 1e-4, 0.0, "the sign is part of the value"),
    ("3.1416", r"\pi", 0.0, 0.0, "the default: exact answers only"),
]


@pytest.mark.parametrize("pred, truth, rtol, reward, why", APPROX, ids=[f"{r[0]}|{r[1]}|{r[2]}" for r in APPROX])
def test_approximations_within_the_stated_tolerance(pred, truth, rtol, reward, why):
    assert math_reward(rf"\boxed{{{pred}}}", truth, approx_rtol=rtol) == reward, why


@pytest.mark.parametrize("raw, number_format, normalised", [
    ("1 000", "en", "1000"),
    ("12\u202f345.5", "en", "12345.5"),             # a narrow no-break space groups thousands
    ("1,22", "en", "1,22"),                          # en: a comma is never a decimal point
    ("1,5", "comma", "1.5"),
    ("1.000,5", "comma", "1000.5"),
    ("1 000,5", "comma", "1000.5"),
    ("0.125", "comma", "0.125"),                     # a leading 0 is no thousands group
    ("(1; 2)", "comma", "(1, 2)"),
    ("1{,}5", "comma", "1.5"),                       # LaTeX's decimal comma
    ("x \u2260 3", "en", r"x \neq  3"),
])
def test_number_formats_and_unicode_relations(raw, number_format, normalised):
    assert normalize_answer(raw, number_format) == normalised


def test_comma_format_reads_decimals_and_keeps_pairs_apart():
    comma = {"number_format": "comma"}
    assert math_reward(r"\boxed{1000,99}", "1000.99", **comma) == 1.0
    assert math_reward(r"\boxed{(1; 2)}", "(1, 2)", **comma) == 1.0
    assert math_reward(r"\boxed{1,2}", "(1; 2)", **comma) == 0.0     # 1.2 is not the pair
    assert math_reward(r"\boxed{1,2}", "1.2") == 0.0                  # en: the list 1, 2 is not 1.2


@pytest.mark.parametrize("text, as_set", [
    (r"x < 3", (-sympy.oo, sympy.Integer(3))),
    (r"x \ge 3", Interval(sympy.Integer(3), sympy.oo, True, False)),
    (r"-2 \le x < 7", Interval(sympy.Integer(-2), sympy.Integer(7), True, False)),
    (r"x \neq 3", Union(((-sympy.oo, sympy.Integer(3)), (sympy.Integer(3), sympy.oo)))),
    (r"2x < 6", None),          # not solved for the letter: compared as a relation only
    (r"5 < x < 1", None),       # an empty range
    (r"x < y", None),
])
def test_relation_as_set(text, as_set):
    rel = read_answer(text).value
    assert isinstance(rel, Relation) and relation_as_set(rel) == as_set


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match=r"approx_rtol=1.5: give a relative tolerance in \[0, 1\)"):
        VerifyOptions(approx_rtol=1.5)
    with pytest.raises(ValueError, match=r"location='last'; choose one of \['boxed', 'lenient'\]"):
        math_reward(r"\boxed{1}", "1", location="last")
    with pytest.raises(ValueError, match=r"number_format='de'"):
        math_reward(r"\boxed{1}", "1", number_format="de")
