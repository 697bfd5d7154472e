"""Arithmetic task, templates and `make_task`: worked examples with the expected value and the reason."""

import warnings

import pytest

from grpo_jax.tasks import (
    R1_SYSTEM,
    ArithmeticTask,
    RewardSpec,
    Task,
    apply_template,
    apply_template_to_messages,
    located_answer,
    make_task,
    task_options,
)
from grpo_jax.tasks.arithmetic import evaluate, write_answer
from grpo_jax.tasks.base import example_rng, unit_hash
from grpo_jax.tasks.templates import hash_answer, messages_problem

# --- make_task --------------------------------------------------------------------------------


def test_make_task_builds_each_task_and_satisfies_the_protocol(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    for task in (
        make_task("arithmetic"),
        make_task("countdown", eval_size=5),
        make_task("jsonl", path=str(data), eval_fraction=0.0),
    ):
        assert isinstance(task, Task)
        example = task.train_example(0)
        assert isinstance(example["prompt"], str) and isinstance(example["answer"], str)


def test_make_task_unknown_name_lists_the_tasks():
    with pytest.raises(ValueError, match=r"'arith'.*\['arithmetic', 'countdown', 'jsonl', 'tool_products'\]"):
        make_task("arith")


def test_make_task_unknown_option_names_it_and_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"\['digitz'\].*'digits'.*'reverse_answer'"):
        make_task("arithmetic", digitz=3)
    assert "_eval_cache" not in task_options("arithmetic")  # internal fields are not options


@pytest.mark.parametrize(
    "options, message",
    [
        ({"operators": "/"}, "operators='/'"),
        ({"operators": "++"}, "operators='\\+\\+'"),
        ({"digits": 0}, "digits=0"),
        ({"num_operands": 1}, "num_operands=1"),
        ({"template": "chat"}, "template='chat'.*'compact', 'plain', 'r1'"),
        ({"template": "plain", "reverse_answer": True}, "reverse_answer=True needs template='compact'"),
        ({"eval_fraction": 1.0}, "eval_fraction=1.0"),
        ({"format_weight": 1.0}, "format_weight=1.0.*lambda < 1"),
        ({"min_digits": 3}, "min_digits=3"),
    ],
)
def test_arithmetic_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**options)


# --- templates --------------------------------------------------------------------------------


def test_plain_template_appends_the_boxed_instruction():
    assert apply_template("plain", "What is 7+45?") == "What is 7+45? Put the answer in \\boxed{}."


def test_r1_template_asks_for_think_and_answer_tags_and_ends_at_assistant():
    prompt = apply_template("r1", "What is 7+45?")
    assert prompt.startswith(R1_SYSTEM)
    assert "<think>" in R1_SYSTEM and "</answer>" in R1_SYSTEM
    # Not pre-filled with "<think>": the format reward must see every tag the model writes.
    assert prompt.endswith("User: What is 7+45? Put the answer in \\boxed{}.\nAssistant:")


def test_unknown_template_is_an_error():
    with pytest.raises(ValueError, match="template='chatml'"):
        apply_template("chatml", "q")


def test_none_template_keeps_the_prompt_as_the_data_has_it():
    assert apply_template("none", "  Already formatted: 7+45=") == "  Already formatted: 7+45="


CHAT = [{"role": "user", "content": "What is 7+45?"}]


def test_templates_on_messages_touch_only_the_last_user_turn_and_the_system_message():
    plain = apply_template_to_messages("plain", CHAT)
    assert plain == [{"role": "user", "content": "What is 7+45? Put the answer in \\boxed{}."}]
    assert CHAT == [{"role": "user", "content": "What is 7+45?"}]  # the input is not changed
    # r1: the R1 text becomes the system message, in front of the conversation's own system text
    # (chat templates read only the first message as the system prompt).
    r1 = apply_template_to_messages("r1", CHAT)
    assert r1[0] == {"role": "system", "content": R1_SYSTEM} and r1[1] == plain[0]
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "What is 7+45?"}]
    r1 = apply_template_to_messages("r1", own)
    assert [m["role"] for m in r1] == ["system", "user", "assistant", "user"]
    assert r1[0]["content"] == R1_SYSTEM + "\n\nBe brief." and r1[1]["content"] == "Hi"
    assert r1[3]["content"] == "What is 7+45? Put the answer in \\boxed{}."
    assert apply_template_to_messages("none", own) == own


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([], "non-empty list"),
        ("What is 7+45?", "non-empty list"),
        ([{"role": "user"}], "message 0 must be an object with \"role\" and \"content\""),
        ([{"role": "tool", "content": "x"}], "message 0 has role 'tool'"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content must be a string"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
         "last message must be the user's turn, got role 'assistant'"),
        ([{"role": "user", "content": " "}], "last user message is empty"),
    ],
)
def test_bad_messages_say_what_is_wrong(messages, problem):
    assert problem in messages_problem(messages)
    with pytest.raises(ValueError, match="."):
        apply_template_to_messages("plain", messages)


@pytest.mark.parametrize(
    "text, expected, reason",
    [
        ("so 9 * 2 = 18.\n#### 18", "18", "GSM8K's own layout"),
        ("#### 1,000", "1000", "thousands separators dropped"),
        ("####$18.50.", "18.50", "a dollar sign before, a full stop after, no space needed"),
        ("#### -3\nThat is all.", "-3", "text on later lines is allowed"),
        ("#### 18 dollars", None, "anything else on the marker's line"),
        ("#### 3\n#### 4", None, "two markers: a hedge"),
        ("#### 1,00", None, "a comma that is not a thousands separator"),
        ("The answer is 18.", None, "no marker"),
        ("#### \\frac{1}{2}", None, "not a number"),
    ],
)
def test_hash_answer_table(text, expected, reason):
    assert hash_answer(text) == expected, reason


@pytest.mark.parametrize(
    "completion, location, template, expected",
    [
        ("so \\boxed{18}", "boxed", "plain", "18"),
        ("\\boxed{18} \\fbox{19}", "boxed", "plain", None),  # two boxes
        ("<think>\n\\boxed{18}\n</think>\n<answer>\n18\n</answer>", "boxed", "r1", None),  # box outside
        ("<think>\nx\n</think>\n<answer>\n\\boxed{18}\n</answer>", "boxed", "r1", "18"),
        ("<think>\nx\n</think>\n<answer>\n#### 18\n</answer>", "gsm8k", "r1", "18"),
        ("#### 18\n<answer>\n17\n</answer>", "gsm8k", "r1", None),  # marker outside the block
        ("<answer> 18 </answer>", "answer_tag", "plain", "18"),
        ("<answer>\\boxed{18}</answer>", "answer_tag", "plain", "18"),  # a box inside is unwrapped
        ("<answer>18</answer><answer>17</answer>", "answer_tag", "plain", None),  # two blocks
        ("18", "answer_tag", "plain", None),
        ("\\boxed{17} no, \\boxed{18}", "lenient", "plain", "18"),  # the last box
        ("The final answer is $18$. I hope it is correct.", "lenient", "plain", "18"),
        ("<think>\nthe answer is 17\n</think>\n<answer>\nThe answer is 18.\n</answer>", "lenient", "r1", "18"),
        ("<think>\nthe answer is 17\n</think>\n<answer>\n18\n</answer>", "lenient", "r1", None),  # only the block
    ],
)
def test_located_answer_table(completion, location, template, expected):
    assert located_answer(completion, location, template) == expected


# --- arithmetic: problems and answers -----------------------------------------------------------


def test_compact_prompt_pads_operands_to_digits():
    example = ArithmeticTask().make_example([7, 45], ["+"])
    assert example["prompt"] == "07+45="
    assert example["answer"] == "52"


def test_reversed_answers_put_the_least_significant_digit_first():
    task = ArithmeticTask(reverse_answer=True)
    assert task.make_example([7, 45], ["+"])["answer"] == "25"  # 52 reversed
    assert task.make_example([70, 70], ["+"])["answer"] == "041"  # 140: the leading zero is kept
    assert write_answer(-38, reverse=True) == "-83"  # sign first, digits reversed


def test_multiplication_binds_tighter_than_addition_and_subtraction():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14  # 2 + 12, not 20
    assert evaluate([10, 2, 3], ["-", "*"]) == 4  # 10 - 6
    assert evaluate([10, 2, 3], ["-", "-"]) == 5  # left to right


def test_plain_and_r1_prompts_use_unpadded_operands():
    assert ArithmeticTask(template="plain").make_example([7, 45], ["+"])["prompt"] == (
        "What is 7+45? Put the answer in \\boxed{}."
    )
    r1 = ArithmeticTask(template="r1").make_example([7, 45], ["+"])
    assert "User: What is 7+45?" in r1["prompt"] and r1["answer"] == "52"


def test_compact_addition_uses_only_the_demo_vocabulary():
    task = ArithmeticTask(reverse_answer=True)
    text = "".join(task.train_example(i)["prompt"] + task.train_example(i)["answer"] for i in range(300))
    assert set(text) <= set("0123456789+=")
    mixed = ArithmeticTask(operators="+-*", num_operands=3)
    text = "".join(mixed.train_example(i)["prompt"] + mixed.train_example(i)["answer"] for i in range(300))
    assert set(text) <= set("0123456789+=-*")  # the documented extra symbols, nothing else


def test_train_examples_are_random_access_and_seeded():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    # A resumed run asks for index 57 first and must get what the first run saw at 57.
    assert b.train_example(57) == [a.train_example(i) for i in range(58)][57]
    c = ArithmeticTask(seed=4)
    prompts_a = [a.train_example(i)["prompt"] for i in range(20)]
    assert prompts_a != [c.train_example(i)["prompt"] for i in range(20)]
    with pytest.raises(ValueError, match="index must be >= 0"):
        a.train_example(-1)


def test_min_digits_knob_draws_long_operands():
    task = ArithmeticTask(digits=3, min_digits=3)
    operands = [x for i in range(200) for x in task.train_example(i)["operands"]]
    assert min(operands) >= 100 and max(operands) <= 999


# --- arithmetic: the held-out split -------------------------------------------------------------


def test_two_digit_addition_eval_split_is_disjoint_from_training():
    task = ArithmeticTask(eval_size=500, eval_fraction=0.1)
    eval_set = task.eval_examples()
    eval_prompts = {e["prompt"] for e in eval_set}
    assert len(eval_set) == len(eval_prompts) == 500
    # 10,000 problems, ~1,000 held out by hash: 5,000 training draws would hit ~500 of them if the
    # sampler did not redraw.
    train_prompts = {task.train_example(i)["prompt"] for i in range(5000)}
    assert not train_prompts & eval_prompts
    all_held_out = sum(task.is_eval_problem([a, b], ["+"]) for a in range(100) for b in range(100))
    assert 900 < all_held_out < 1100  # eval_fraction of the space, give or take the hash


def test_eval_set_is_the_same_for_every_seed_and_template_keeps_membership():
    assert ArithmeticTask(seed=0).eval_examples() == ArithmeticTask(seed=9).eval_examples()
    compact = ArithmeticTask().eval_examples()
    plain = ArithmeticTask(template="plain").eval_examples()
    assert [e["operands"] for e in compact] == [e["operands"] for e in plain]


def test_tiny_problem_space_returns_every_held_out_problem_with_a_warning():
    task = ArithmeticTask(digits=1)  # 100 problems, about 10 held out
    with pytest.warns(UserWarning, match="only .* held-out problems exist"):
        eval_set = task.eval_examples()
    held_out = {f"{a}+{b}" for a in range(10) for b in range(10) if task.is_eval_problem([a, b], ["+"])}
    assert {task.problem_text(e["operands"], e["ops"]) for e in eval_set} == held_out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train = {task.problem_text(task.train_example(i)["operands"], ["+"]) for i in range(2000)}
    assert not train & held_out and len(train) == 100 - len(held_out)


def test_large_space_eval_set_is_sampled_distinct_and_held_out():
    task = ArithmeticTask(digits=4, operators="+-*", num_operands=3, eval_size=50)
    eval_set = task.eval_examples()
    assert len({e["prompt"] for e in eval_set}) == 50
    assert all(task.is_eval_problem(e["operands"], e["ops"]) for e in eval_set)
    assert all(e["value"] == evaluate(e["operands"], e["ops"]) for e in eval_set)


def test_hash_and_rng_are_deterministic_values():
    # Fixed numbers, so a change of hash (and of every split) shows up here first.
    assert unit_hash("arithmetic-split", "7+45") == unit_hash("arithmetic-split", "7+45")
    assert unit_hash("a", "bc") != unit_hash("ab", "c")
    assert example_rng("x", 0, 1).random() == example_rng("x", 0, 1).random()


# --- arithmetic: checking ---------------------------------------------------------------------


def test_compact_exact_match_reward():
    (spec,) = ArithmeticTask().reward_fns()
    assert spec.name == "exact_match" and spec.weight == 1.0
    completions = ["52", " 52\n", "53", "5 2", "", "052", "52=52"]
    # Stripped exact match: whitespace around is fine, anything else in the text is wrong.
    assert spec.fn(["07+45="] * 7, completions, answer=["52"] * 7) == [1, 1, 0, 0, 0, 0, 0]


def test_reward_fn_reports_a_missing_or_misaligned_field():
    (spec,) = ArithmeticTask().reward_fns()
    with pytest.raises(ValueError, match="needs the example field 'answer'"):
        spec.fn(["p"], ["52"])
    with pytest.raises(ValueError, match="'answer' has 2 entries for 1 completions"):
        spec.fn(["p"], ["52"], answer=["52", "1"])


@pytest.mark.parametrize(
    "completion, expected, reason",
    [
        ("So 7+45 = \\boxed{52}.", True, "one box, right integer"),
        ("\\boxed{ 52 }", True, "spaces inside the box are fine"),
        ("\\boxed{52} or maybe \\boxed{53}", False, "two boxes: a hedge"),
        ("The answer is 52.", False, "no box"),
        ("\\boxed{53}", False, "wrong value"),
        ("\\boxed{٥٢}", False, "Arabic-Indic digits look like 52 to int() but are not ASCII"),
        ("\\boxed{52.0}", False, "the held-out check wants the integer as an integer"),
        ("\\boxed{52", False, "unclosed box"),
        ("\\boxed{" + "9" * 5000 + "}", False, "megabyte-ish numbers are not read"),
    ],
)
def test_plain_eval_correct_table(completion, expected, reason):
    task = ArithmeticTask(template="plain")
    assert task.eval_correct(completion, task.make_example([7, 45], ["+"])) is expected, reason


def test_r1_eval_needs_the_box_inside_the_answer_block():
    task = ArithmeticTask(template="r1")
    example = task.make_example([7, 45], ["+"])
    good = "<think>\n7+45 is 52\n</think>\n<answer>\n\\boxed{52}\n</answer>"
    assert task.eval_correct(good, example)
    assert not task.eval_correct("<think>\n\\boxed{52}\n</think>\n<answer>\n52\n</answer>", example)
    assert not task.eval_correct(good + "\n<answer>\n\\boxed{53}\n</answer>", example)  # two answers


def test_extract_answer_normalises_for_majority_voting():
    plain = ArithmeticTask(template="plain")
    assert plain.extract_answer("\\boxed{1,052}") == "1052"
    assert plain.extract_answer("\\boxed{-007}") == "-7"
    assert plain.extract_answer("no answer") is None
    compact = ArithmeticTask(reverse_answer=True)
    assert compact.extract_answer(" 041 ") == "041"  # compact answers are compared as written
    assert compact.extract_answer("41a") is None


# --- training rewards through the rewards package -------------------------------------------------

R1_GOOD = "<think>\n7+45: 5+2 carries, 52\n</think>\n<answer>\n\\boxed{52}\n</answer>"
R1_WRONG_FORMATTED = "<think>\n7+45 is 53\n</think>\n<answer>\n\\boxed{53}\n</answer>"
R1_RIGHT_UNFORMATTED = "It is \\boxed{52}."


def test_plain_arithmetic_trains_on_math_accuracy():
    from grpo_jax.rewards import compute_rewards

    task = ArithmeticTask(template="plain")
    specs = task.reward_fns()
    assert [(s.name, s.weight) for s in specs] == [("math", 1.0)]
    completions = ["\\boxed{52}", "\\boxed{52} \\boxed{53}", "52", "\\boxed{1/3 or 52}"]
    total, per_fn = compute_rewards(specs, ["p"] * 4, completions, {"answer": ["52"] * 4})
    # One box with the value: 1. Two boxes, no box, a hedge inside the box: 0 (seed Part 2).
    assert total.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_r1_arithmetic_rewards_keep_correctness_above_format():
    from grpo_jax.rewards import compute_rewards

    task = ArithmeticTask(template="r1", format_weight=0.5)
    specs = task.reward_fns()
    assert [(s.name, s.weight) for s in specs] == [("math", 1.0), ("format", 0.5)]
    completions = [R1_GOOD, R1_RIGHT_UNFORMATTED, R1_WRONG_FORMATTED, "53"]
    total, per_fn = compute_rewards(specs, ["p"] * 4, completions, {"answer": ["52"] * 4})
    # Seed Part 3 with lambda = 0.5: 1.5, 1.0, 0.5, 0 -- every correct answer beats every wrong one.
    assert total.tolist() == [1.5, 1.0, 0.5, 0.0]
    assert per_fn["format"].tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("template", ["compact", "plain", "r1"])
def test_hostile_text_never_executes_in_arithmetic(tmp_path, template):
    target = tmp_path / "pwned"
    payloads = [
        f"\\boxed{{__import__('os').system('touch {target}')}}",
        f"<think>\nx\n</think>\n<answer>\n\\boxed{{open('{target}','w')}}\n</answer>",
        f"__import__('os').system('touch {target}')",
    ]
    task = ArithmeticTask(template=template)
    example = task.make_example([7, 45], ["+"])
    n = len(payloads)
    for spec in task.reward_fns():
        scores = spec.fn(["p"] * n, payloads, answer=[example["answer"]] * n)
        if spec.name != "format":
            assert scores == [0.0] * n
    for text in payloads:
        assert not task.eval_correct(text, example) and task.extract_answer(text) is None
    assert not target.exists()


def test_reward_spec_is_the_type_compute_rewards_takes():
    from grpo_jax.rewards import WeightedReward

    spec = RewardSpec("sevens", lambda prompts, completions, **_: [1.0] * len(completions), 0.5)
    assert isinstance(spec, WeightedReward) and (spec.name, spec.weight) == ("sevens", 0.5)
