"""The lenient answer location (grpo_jax/rewards/math_locate.py): where models state answers, and
the hedges that must read as no answer. Real data: every MATH-500 gold solution, read as a
completion, gives its gold answer."""

import json
import pathlib
import time

import pytest

import grpo_jax
from grpo_jax.rewards import lenient_answer, math_accuracy_reward, math_accuracy_reward_fn, math_reward

LOCATE = [
    # rule 1: the Minerva phrase (lm-eval-harness's prompt asks for it)
    ("Final Answer: The final answer is $10,455$. I hope it is correct.", "10,455"),
    ("Final Answer: The final answer is \\((-6, 10)\\). I hope it is correct.", "(-6, 10)"),
    ("The final answer is 34. I hope it is correct.", "34"),
    ("\\boxed{3} ... Final Answer: The final answer is $4$. I hope it is correct.", "4"),  # before any box
    # rule 2: the last box; boxes in a row are one list
    ("We get $x = 3$. Therefore, the final answer is $\\boxed{3}$.", "3"),
    ("\\boxed{1/3}\n\nWait, that is wrong. Let me redo the sum properly from the start: \\boxed{1/2}", "1/2"),
    ("$\\boxed{1}$, $\\boxed{2}$", "1, 2"),
    ("\\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}", "-2, 1"),
    ("$\\boxed{15\\frac{39}{40}},$ or $\\boxed{\\frac{639}{40}}$", "15\\frac{39}{40} or \\frac{639}{40}"),
    # rule 3: answer phrases, to the end of the sentence
    ("so the answer is 5", "5"),
    ("So the answer is 5 apples.", "5"),                       # a number and its unit word
    ("**Answer:** 17", "17"),
    ("The answer is:\n\n\\[ 42 \\]", "42"),
    ("The answers are $1$ and $-2$.", "1, -2"),
    ("Final Answer: The largest $n$ is 34.", "34"),            # a restated subject
    ("It costs \\$5, then \\$6, so the answer is \\$11.", "\\$11"),  # escaped dollars are prose
    # rule 4: the last maths of the final sentence
    ("Thus the sum is $5$.", "5"),
    ("Since $a=2$ and $b=3$, the sum is $5$.", "5"),
    ("So $x = 1$ or $x = 2$.", "x = 1 or x = 2"),
    ("First $3$. Then we see it is really $4$.", "4"),
    # nothing found
    ("The answer is $5$, not $6$.", None),                     # a hedge in words
    ("The answer is either $5$ or $6$.", None),
    ("The answer is $\\frac{1}{2}$ (or 0.5).", None),
    ("\\boxed{3}, or maybe \\boxed{4}", None),                 # two boxes hedged: not the last one
    ("The roots are $x=1$ and $x=2$.\n\nDone", None),          # no maths in the final sentence
    ("1/3", None),                                             # bare text: no box, phrase or maths
    ("", None),
]


@pytest.mark.parametrize("completion, expected", LOCATE, ids=[c[:40] for c, _ in LOCATE])
def test_lenient_answer(completion, expected):
    assert lenient_answer(completion) == expected


@pytest.mark.parametrize("completion, answer, lenient, strict", [
    ("\\boxed{3} wait, I made an error: \\boxed{4}", "4", 1.0, 0.0),   # strict: two boxes
    ("The answer is 4.", "4", 1.0, 0.0),                                # strict: no box
    ("\\boxed{1/3} \\boxed{1/2}", "1/2", 0.0, 0.0),                     # a list of two, never one
    ("\\boxed{1/3} \\boxed{1/2}", "1/3, 1/2", 1.0, 0.0),
    ("answer: 1/3 or 1/2", "1/3", 0.0, 0.0),
    ("The final answer is $\\frac{1}{3}$. I hope it is correct.", "1/3", 1.0, 0.0),
])
def test_lenient_reads_more_and_hedges_still_score_zero(completion, answer, lenient, strict):
    assert math_reward(completion, answer, location="lenient") == lenient
    assert math_reward(completion, answer) == strict  # the training default stays one box


def test_lenient_reward_fn_binds_its_options_against_field_names():
    fn = math_accuracy_reward_fn(location="lenient")
    completions = ["The answer is 4.", "\\boxed{4}", "so 4 or 5"]
    # A data column named like an option must not change the options (they are bound positionally).
    assert fn(["q"] * 3, completions, answer=["4"] * 3, location=["boxed"] * 3) == [1.0, 1.0, 0.0]
    assert math_accuracy_reward(["q"] * 3, completions, answer=["4"] * 3) == [0.0, 1.0, 0.0]


MATH500 = pathlib.Path(grpo_jax.__file__).parent / "assets" / "data" / "math500_test.jsonl"


def test_every_math500_solution_read_leniently_gives_its_answer():
    # Real text: MATH-500's worked solutions, with their prose, displayed maths and boxes.
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    wrong = [(r["answer"], lenient_answer(r["solution"])) for r in rows
             if math_reward(r["solution"], r["answer"], location="lenient") != 1.0]
    assert wrong == []


@pytest.mark.parametrize("form", [
    "Final Answer: The final answer is ${}$. I hope it is correct.",
    "So the answer is ${}$.",
    "Working it through, we arrive at\n\\[{}\\]",
])
def test_every_math500_gold_answer_in_each_phrase_form_scores_one(form):
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    wrong = [r["answer"] for r in rows if math_reward(form.format(r["answer"]), r["answer"], location="lenient") != 1.0]
    assert wrong == []


@pytest.mark.parametrize("name, text", [
    ("unclosed inline maths", "\\(" * 10_000),
    ("unclosed dollars", "$a" * 10_000),
    ("unclosed boxes", "\\boxed{" * 3_000),
    ("answer phrases", "the answer is " * 2_000),
    ("Minerva phrases without the end", "final answer is 2 " * 1_000),  # it says 2, not 1
])
def test_hostile_text_is_located_in_bounded_time(name, text):
    start = time.monotonic()
    assert math_reward(text, "1", location="lenient") == 0.0
    # Linear scans over 20-60k characters: tens of milliseconds on one core; 1 s is 20x that.
    assert time.monotonic() - start < 1.0, name
