"""Adversarial completions (seed Part 2's hacks plus pathological inputs), each with its reward.

Each row: a name, the completion, the ground truth, the expected reward and why. A row that
scores higher than expected is a loophole GRPO would find (seed Part 2: the hack gets the largest
advantage in its group).
"""

import os
import time

import pytest

from grpo_jax.rewards import (
    code_reward,
    extract_boxed,
    format_reward,
    format_reward_fn,
    math_accuracy_reward,
    math_reward,
)

R1 = "<think>\n{think}\n</think>\n<answer>\n{answer}\n</answer>"

MATH_TABLE = [
    # --- multiple answers / hedging (seed Part 2, rows 1-2)
    ("three boxes", r"\boxed{1/3} ... \boxed{1/2} ... \boxed{0}", "1/3", 0.0),
    ("two boxes, both right", r"\boxed{1/3} so \boxed{1/3}", "1/3", 0.0),  # still two final answers
    ("hedge in words, no box", "The answer is 1/3 or 1/2", "1/3", 0.0),
    ("hedge inside the box", r"\boxed{1/3 or 1/2}", "1/3", 0.0),
    ("hedge with \\text", r"\boxed{1/3 \text{ or } 1/2}", "1/3", 0.0),
    ("hedge as a list", r"\boxed{1/3, 1/2}", "1/3", 0.0),
    ("hedge with juxtaposition", r"\boxed{1/3 \quad 1/2}", "1/3", 0.0),  # not 1/3 * 1/2
    ("plus-minus", r"\boxed{\pm 3}", "3", 0.0),
    ("fbox and boxed", r"\fbox{1/2} \boxed{1/3}", "1/3", 0.0),
    ("answer only in <answer>", R1.format(think="think", answer="1/3"), "1/3", 0.0),  # no box
    # --- parser confusion: must be 0, never "correct by default"
    ("empty box", r"\boxed{}", "0", 0.0),
    ("unclosed box", r"\boxed{1/3", "1/3", 0.0),
    ("stray closing brace", r"\boxed{1/3}}", "1/3", 1.0),  # the box itself is well formed
    ("division by zero", r"\boxed{1/0}", "1", 0.0),
    ("zero over zero", r"\boxed{\frac{0}{0}}", "0", 0.0),
    ("infinity", r"\boxed{\infty}", "1", 0.0),
    ("python syntax", r"\boxed{2**3}", "8", 0.0),
    ("free symbol", r"\boxed{x}", "3", 0.0),
    ("equation, wrong letter", r"\boxed{y = 3}", "x = 3", 0.0),
    ("relation", r"\boxed{x < 3}", "3", 0.0),
    ("garbage", r"\boxed{%$#@!}", "3", 0.0),
    ("bare word", r"\boxed{three}", "3", 0.0),
    ("python code", r"\boxed{__import__('os').getcwd()}", "3", 0.0),
    ("lambda", r"\boxed{(lambda: 3)()}", "3", 0.0),
    ("nan text", r"\boxed{nan}", "3", 0.0),
    # --- pathological sizes (each must also return fast: see the timing test)
    ("power tower", r"\boxed{9^{9^{9}}}", "3", 0.0),
    ("plain power tower", r"\boxed{9^9^9}", "3", 0.0),
    ("huge power", r"\boxed{2^{100000}}", "3", 0.0),
    ("nested huge power", r"\boxed{(10^{1000})^{1000}}", "3", 0.0),
    ("huge factorial", r"\boxed{100000!}", "3", 0.0),
    ("factorial of factorial", r"\boxed{(10!)!}", "3", 0.0),
    ("megabyte box", r"\boxed{" + "1" * 1_000_000 + "}", "1", 0.0),
    ("megabyte completion, small box", "a" * 1_000_000 + r"\boxed{7}", "7", 1.0),
    ("deep parentheses", r"\boxed{" + "(" * 500 + "1" + ")" * 500 + "}", "1", 0.0),
    ("deep braces", r"\boxed{" + "{" * 500 + "1" + "}" * 500 + "}", "1", 0.0),
    ("deep fractions", r"\boxed{" + r"\frac{1}{" * 200 + "1" + "}" * 200 + "}", "1", 0.0),
    ("long sign chain", r"\boxed{" + "-" * 5000 + "1}", "1", 0.0),
    ("many boxes", r"\boxed{1}" * 10_000, "1", 0.0),
    # --- hedging through the answer kinds (sets, \pm, intervals, relations, words): never a match
    ("hedge as a set", r"\boxed{\{1/3, 1/2\}}", "1/3", 0.0),
    ("hedge as x = a, x = b", r"\boxed{x = 1/3, x = 1/2}", "1/3", 0.0),
    ("hedge with pm inside a fraction", r"\boxed{\frac{1 \pm 1}{2}}", "1", 0.0),  # {1, 0}
    ("hedge as an interval", r"\boxed{[0, 1]}", "1/3", 0.0),
    ("hedge as a union", r"\boxed{[0, 1] \cup [2, 3]}", "[0, 1]", 0.0),
    ("hedge as a chain of inequalities", r"\boxed{1 \le x \le 100}", "x = 5", 0.0),
    ("hedge as a matrix", r"\boxed{\begin{pmatrix} 1/3 \\ 1/2 \end{pmatrix}}", "1/3", 0.0),
    ("all solutions plus one", r"\boxed{1, -2, 3}", "1, -2", 0.0),
    ("a solution twice", r"\boxed{\{1, 1\}}", "1", 0.0),
    ("hedge in words", r"\boxed{\text{Evelyn or Emily}}", r"\text{Evelyn}", 0.0),
    ("hedge as a list of words", r"\boxed{\text{Evelyn}, \text{Emily}}", r"\text{Evelyn}", 0.0),
    ("hedge as a trailing unit", r"\boxed{3 \text{ or four}}", "3", 0.0),
    ("empty words", r"\boxed{\text{}}", r"\text{Evelyn}", 0.0),
    ("number in words", r"\boxed{\text{three}}", "3", 0.0),
    ("base-2 numeral of the value", r"\boxed{101010_2}", "42", 0.0),
    ("value of a base-8 answer", r"\boxed{42}", "52_8", 0.0),
    ("trivial equation", r"\boxed{0 = 0}", "x = 5", 0.0),
    ("identity", r"\boxed{x = x}", "x = 5", 0.0),
    ("equation times zero", r"\boxed{0(5x - 7y + 11z + 4) = 0}", "5x - 7y + 11z + 4 = 0", 0.0),
    ("inequality times -1", r"\boxed{-x \le -5}", r"x \le 5", 0.0),
    ("mixed number misread", r"\boxed{2\frac{1}{2}}", "1", 0.0),  # 5/2, never 2 * 1/2
    # --- pathological sizes for the answer kinds
    ("matrix over MAX_ITEMS", r"\boxed{\begin{pmatrix}" + " & ".join(["1"] * 40) + r"\end{pmatrix}}", "1", 0.0),
    ("list over MAX_ITEMS", r"\boxed{" + ", ".join(["1"] * 40) + "}", "1", 0.0),
    ("32 roots in reverse order", r"\boxed{" + ", ".join(rf"\sqrt{{{k}}}" for k in range(32, 0, -1)) + "}",
     ", ".join(rf"\sqrt{{{k}}}" for k in range(1, 33)), 1.0),
    ("32 roots, one wrong", r"\boxed{" + ", ".join(rf"\sqrt{{{k}}}" for k in range(33, 1, -1)) + "}",
     ", ".join(rf"\sqrt{{{k}}}" for k in range(1, 33)), 0.0),
    ("deep sets", r"\boxed{" + r"\{" * 200 + "1" + r"\}" * 200 + "}", "1", 0.0),
    ("deep intervals", r"\boxed{" + "[" * 100 + "0, 1" + "]" * 100 + "}", "[0, 1]", 0.0),
    ("long relation chain", r"\boxed{" + " < ".join(["x"] * 40) + "}", "x < 1", 0.0),
    ("many pm", r"\boxed{" + r"1 \pm " * 50 + "1}", "1", 0.0),
    ("nested power degree", r"\boxed{((x^{1000})^{1000})^{1000}}", "x", 0.0),
    ("product power degree", r"\boxed{" + "x^{1000}" * 100 + "}", "x", 0.0),
    ("equation of degree 1000", r"\boxed{(x+y+z)^{1000} = 0}", "5x - 7y + 11z + 4 = 0", 0.0),
    ("long base numeral", r"\boxed{" + "1" * 399 + "_2}", "1", 0.0),
    ("mixed number, huge whole part", r"\boxed{" + "9" * 300 + r"\frac{1}{2}}", "1", 0.0),
    ("function power", r"\boxed{\sin^{1000} x}", "x", 0.0),
    ("log of a huge power", r"\boxed{\log_2 2^{100000}}", "100000", 0.0),
    # --- unicode look-alikes
    ("fullwidth digits", "\\boxed{\uff11\uff12}", "12", 0.0),
    ("arabic-indic digits", "\\boxed{\u0661\u0662}", "12", 0.0),
    ("cyrillic x", "\\boxed{2\u0445}", "2x", 0.0),
    ("fraction slash", "\\boxed{1\u20443}", "1/3", 0.0),
    ("zero-width space", "\\boxed{1\u200b2}", "12", 0.0),
    ("unicode minus is a minus", "\\boxed{\u22123}", "-3", 1.0),
    # --- honest answers in odd but valid forms still score 1
    ("honest R1 answer", R1.format(think="1/3 of 3 is 1", answer=r"\boxed{\frac{1}{3}}"), "1/3", 1.0),
    ("honest decimal", r"\boxed{0.5}", "1/2", 1.0),
]

SANDBOX_TESTS = "assert square(5) == 25\nassert square(-4) == 16\nassert square(12) == 144\n"
CODE_TABLE = [
    ("honest", "```python\ndef square(x):\n    return x * x\n```", 1.0),
    ("hard-coded visible tests", "```python\ndef square(x):\n    if x == 3:\n        return 9\n"
     "    if x == 2:\n        return 4\n```", 0.0),
    ("early exit at import", "import sys\nsys.exit(0)\n", 0.0),
    ("os._exit in the function", "```python\nimport os\ndef square(x):\n    os._exit(0)\n```", 0.0),
    ("prints passed", "```python\nprint('3 passed')\ndef square(x):\n    print('passed')\n```", 0.0),
    ("catches everything", "```python\ndef square(x):\n    try:\n        return undefined(x)\n"
     "    except BaseException:\n        pass\n```", 0.0),
    ("always-equal object", "```python\nclass Eq(int):\n    def __eq__(self, other):\n        return True\n"
     "def square(x):\n    return Eq(0)\n```", 0.0),
    ("edits test files", "```python\nimport glob, os\nfor p in glob.glob('**/*test*', recursive=True):\n"
     "    open(p, 'w').write('')\ndef square(x):\n    return 0\n```", 0.0),
    ("patches builtins", "```python\nimport builtins\nbuiltins.AssertionError = Exception\n"
     "def square(x):\n    assert False\n```", 0.0),
]


@pytest.mark.parametrize("name, completion, answer, expected", MATH_TABLE, ids=[r[0] for r in MATH_TABLE])
def test_math_adversarial_table(name, completion, answer, expected):
    start = time.monotonic()
    assert math_reward(completion, answer) == expected, name
    assert time.monotonic() - start < 1.5, f"{name} took too long"  # inline timeout is 1 s


# The lenient location (evaluation's) reads the last of several boxes, so a completion that boxes
# the right answer twice is right there; every other hack of the table still scores what it does
# under the strict one-box rule.
LENIENT_DIFFERS = {"two boxes, both right": 1.0}


@pytest.mark.parametrize("name, completion, answer, expected", MATH_TABLE, ids=[r[0] for r in MATH_TABLE])
def test_math_adversarial_table_read_leniently(name, completion, answer, expected):
    start = time.monotonic()
    assert math_reward(completion, answer, location="lenient") == LENIENT_DIFFERS.get(name, expected), name
    assert time.monotonic() - start < 1.5, f"{name} took too long"


@pytest.mark.parametrize("name, completion, expected", CODE_TABLE, ids=[r[0] for r in CODE_TABLE])
def test_code_adversarial_table(name, completion, expected):
    assert code_reward(completion, SANDBOX_TESTS, timeout_s=3.0) == expected, name


def test_table_covers_at_least_40_cases():
    assert len(MATH_TABLE) + len(CODE_TABLE) >= 40


@pytest.mark.parametrize("completion, expected", [
    (R1.format(think="3 * 3 = 9", answer=r"\boxed{9}"), 1.0),
    ("<think>\n\n</think>\n<answer>\n\\boxed{9}\n</answer>", 0.0),   # no reasoning (seed Part 2)
    ("<think></think>\\boxed{9}", 0.0),                                # the seed's literal example
    (R1.format(think="a", answer="9") + "\n<answer>\n8\n</answer>", 0.0),  # a second answer block
    ("<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n9\n</answer>", 0.0),  # two think blocks
    ("<think>a</think><answer>9</answer>", 0.0),                       # tags not on their own lines
    (R1.format(think="a", answer=""), 0.0),                              # empty answer
    ("Sure!\n" + R1.format(think="a", answer="9"), 0.0),                 # text before the template
])
def test_format_reward_hacks(completion, expected):
    assert format_reward(completion) == expected


def test_hostile_text_never_executes(tmp_path):
    # A payload that creates a file if anything evaluates it, sent through every reward function.
    marker = tmp_path / "pwned"
    py = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    payloads = [
        rf"\boxed{{{py}}}",
        R1.format(think=py, answer=rf"\boxed{{{py}}}"),
        py,
        rf"\boxed{{\text{{{py}}}}}",
    ]
    for p in payloads:
        assert math_reward(p, "0") == 0.0
        assert math_reward(p, "0", location="lenient") == 0.0
        assert math_reward(r"\boxed{0}", p) == 0.0  # even a hostile ground truth
        assert extract_boxed(p) in (None, py, rf"\text{{{py}}}")
        assert format_reward(p) in (0.0, 1.0)
    assert math_accuracy_reward([""] * 4, payloads, answer=["0"] * 4) == [0.0] * 4
    assert format_reward_fn([""] * 4, payloads) == [0.0, 1.0, 0.0, 0.0]
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to `nobody` only when started as root")
def test_code_sandbox_payload_cannot_touch_trainer_files(tmp_path):
    # The code reward does run code, but as `nobody` in its own temp dir: the trainer's 0700 dirs
    # are out of reach, so the payload fails at import and the completion scores 0.
    marker = tmp_path / "pwned"
    py = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    assert code_reward(py + "\ndef square(x):\n    return x * x\n", SANDBOX_TESTS, timeout_s=3.0) == 0.0
    assert not marker.exists()
    assert not os.path.exists(os.path.join(os.getcwd(), "pwned"))


def test_code_sandbox_cannot_write_outside_its_temp_dir(tmp_path):
    # The sandbox runs in its own temp dir; a relative write lands there and is deleted with it.
    code = "open('pwned', 'w').write('x')\ndef square(x):\n    return x * x\n"
    assert code_reward(code, SANDBOX_TESTS, timeout_s=3.0) == 1.0
    assert not os.path.exists("pwned")
