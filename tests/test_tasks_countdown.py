"""Countdown: generator, held-out split, and a checker that hostile text cannot fool, hang or run."""

import time
from fractions import Fraction

import pytest

from grpo_jax.tasks import CountdownTask, check_countdown, make_task, parse_equation


def test_parse_equation_returns_exact_value_numbers_and_canonical_text():
    assert parse_equation("(3 + 5) * 3 = 24") == (Fraction(24), [3, 5, 3], "(3+5)*3")
    assert parse_equation("8 / (3 - 8 / 3)") == (Fraction(24), [8, 3, 8, 3], "8/(3-8/3)")


# numbers [2, 3, 4, 6], target 24 unless the row says otherwise.
CHECKER_TABLE = [
    ("6*4*(3-2)", True, "each number once, equals 24"),
    ("6 * 4 * (3 - 2) = 24", True, "'expr = target' is one equation"),
    ("(6*4)*(3-2)", True, "redundant parentheses are fine"),
    ("6*4*(3-2) = 25", False, "the stated result must equal the value"),
    ("6*4*(3-2) = 24 = 24", False, "two '=': more than one equation"),
    ("24 = 6*4*(3-2)", False, "the right side must be a single number"),
    ("6*4", False, "2 and 3 unused"),
    ("6*4*(3-2)*1", False, "1 is not a given number"),
    ("6*4*(3-2)+2-2", False, "2 used three times"),
    ("6*4*(3-2)\n6*4*(3-2)", False, "two equations in one answer"),
    ("6*4*(3-2), 6*4*(3-2)", False, "a list of equations"),
    ("6*4*(3-2) or 6*4*3-2", False, "hedging with words"),
    ("6×4×(3−2)", False, "unicode look-alikes for * and - are not operators"),
    ("６*4*(3-2)", False, "full-width digit"),
    ("6*4*(3-02)", False, "leading zero"),
    ("-2+3+4*6-1", False, "unary minus and an extra number"),
    ("6**4*(3-2)", False, "no power operator"),
    ("6*4*(3-2", False, "unclosed parenthesis"),
    ("", False, "empty answer"),
    ("6*4*(3-2) ", True, "trailing space is whitespace"),
    ("__import__('os').system('echo hi')", False, "code is not arithmetic"),
]


@pytest.mark.parametrize("text, expected, reason", CHECKER_TABLE)
def test_countdown_checker_table(text, expected, reason):
    assert check_countdown(text, [2, 3, 4, 6], 24) is expected, reason


def test_checker_is_exact_where_floats_are_not():
    # 8 / (3 - 8/3) is 24 exactly, but 23.999999999999993 in floats.
    assert 8 / (3 - 8 / 3) != 24
    assert check_countdown("8/(3-8/3)", [3, 3, 8, 8], 24)
    assert check_countdown("6/(1-3/4)", [1, 3, 4, 6], 24)


def test_division_by_zero_is_wrong_not_an_exception():
    assert check_countdown("6/(4-4)+1", [1, 4, 4, 6], 24) is False


@pytest.mark.parametrize(
    "text",
    [
        "(" * 100_000 + "1" + ")" * 100_000,  # deep nesting: refused by length, no RecursionError
        "(" * 40 + "2" + ")" * 40 + "*3*4*6",  # under the length limit but past MAX_DEPTH
        "9" * 1_000_000,  # a megabyte number
        "2*" * 60 + "2",  # too many tokens
        "1+" * 100_000 + "1",
    ],
)
def test_pathological_answers_are_refused_fast(text):
    start = time.perf_counter()
    assert check_countdown(text, [2, 3, 4, 6], 24) is False
    assert time.perf_counter() - start < 0.1


def test_score_reads_only_the_single_answer_block():
    task = CountdownTask()
    numbers, target = [2, 3, 4, 6], 24
    assert task.score("<think>\n...\n</think>\n<answer>\n6*4*(3-2)\n</answer>", numbers, target) == 1.0
    assert task.score("6*4*(3-2)", numbers, target) == 0.0  # no answer block
    two = "<answer>6*4</answer> <answer>6*4*(3-2)</answer>"
    assert task.score(two, numbers, target) == 0.0  # several answers: never "any one matches"
    assert task.score("<answer>6*4*(3-2)", numbers, target) == 0.0  # unclosed
    assert task.score("</answer>6*4*(3-2)<answer>", numbers, target) == 0.0  # reversed tags


def test_every_generated_problem_is_solvable_in_range_and_deterministic():
    task = CountdownTask(num_numbers=4, max_number=50, min_target=10, max_target=200, seed=1)
    examples = [task.train_example(i) for i in range(200)] + task.eval_examples()[:50]
    for e in examples:
        assert len(e["numbers"]) == 4 and all(1 <= n <= 50 for n in e["numbers"])
        assert 10 <= e["target"] <= 200 and e["answer"] == str(e["target"])
        # The stored solution passes the same checker the model faces.
        assert task.score(f"<answer>{e['solution']}</answer>", e["numbers"], e["target"]) == 1.0
        assert str(e["numbers"]) in e["prompt"] and str(e["target"]) in e["prompt"]
    again = CountdownTask(num_numbers=4, max_number=50, min_target=10, max_target=200, seed=1)
    assert again.train_example(123) == examples[123]


@pytest.mark.parametrize("n", [3, 6])
def test_number_count_range(n):
    e = CountdownTask(num_numbers=n).train_example(0)
    assert len(e["numbers"]) == n


def test_eval_split_disjoint_and_shared_across_seeds():
    task = CountdownTask(eval_size=100)
    eval_set = task.eval_examples()
    keys = {(tuple(sorted(e["numbers"])), e["target"]) for e in eval_set}
    assert len(keys) == 100
    assert all(task.is_eval_problem(e["numbers"], e["target"]) for e in eval_set)
    train = [task.train_example(i) for i in range(2000)]
    assert not any(task.is_eval_problem(e["numbers"], e["target"]) for e in train)
    assert CountdownTask(eval_size=100, seed=5).eval_examples() == eval_set


def test_reward_fns_batched_over_example_fields():
    (spec,) = make_task("countdown").reward_fns()
    assert spec.name == "countdown" and spec.weight == 1.0
    rewards = spec.fn(
        ["p", "p"],
        ["<answer>6*4*(3-2)</answer>", "<answer>6*4</answer>"],
        numbers=[[2, 3, 4, 6], [2, 3, 4, 6]],
        target=[24, 24],
        answer=["24", "24"],  # other fields are ignored
    )
    assert rewards == [1.0, 0.0]


def test_extract_answer_is_the_canonical_equation():
    task = CountdownTask()
    assert task.extract_answer("<answer>\n(3 + 5) * 3 = 24\n</answer>") == "(3+5)*3"
    assert task.extract_answer("<answer>3 +</answer>") is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_numbers": 2}, "num_numbers=2"),
        ({"num_numbers": 7}, "num_numbers=7"),
        ({"max_number": 0}, "max_number=0"),
        ({"min_target": 50, "max_target": 10}, "max_target=10"),
        ({"template": "compact"}, "template='compact'"),
        ({"format_weight": 2.0}, "format_weight=2.0"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        CountdownTask(**options)


def test_unreachable_target_range_is_a_clear_error():
    task = CountdownTask(num_numbers=3, max_number=2, min_target=1000, max_target=2000)
    with pytest.raises(RuntimeError, match=r"no target in \[1000, 2000\]"):
        task.train_example(0)


def test_hostile_text_never_executes(tmp_path):
    """A payload that would create a file, through every way a completion reaches the task."""
    target_file = tmp_path / "pwned"
    payloads = [
        f"<answer>__import__('os').system('touch {target_file}')</answer>",
        f"<answer>open('{target_file}', 'w').write('x')</answer>",
        f"<answer>\n__import__('pathlib').Path('{target_file}').touch() = 24\n</answer>",
        f"<think>\nx\n</think>\n<answer>\nexec(\"open('{target_file}','w')\")\n</answer>",
    ]
    for template in ("plain", "r1"):
        task = CountdownTask(template=template, eval_size=3)
        example = task.train_example(0)
        for text in payloads:
            assert task.eval_correct(text, example) is False
            assert task.extract_answer(text) is None
            n = len(payloads)
            for spec in task.reward_fns():  # r1 adds the format reward: it reads the text too
                scores = spec.fn(["p"] * n, payloads, numbers=[example["numbers"]] * n,
                                 target=[example["target"]] * n)
                if spec.name == "countdown":
                    assert scores == [0.0] * n
    assert not target_file.exists()
