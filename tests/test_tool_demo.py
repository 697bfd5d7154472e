"""The multi-turn CPU demo (grpo_jax.tasks.tool_products, configs/arith_tools_cpu.py), worked through:
the calculator answers a call with the product, anything else is the answer, the reward is exact
match of the episode's last model turn, and the demo config trains through the public API.

    prompt "07*45="   model "?"+eos   calculator "315="   model "315"+eos   reward 1.0
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

from grpo_jax.config.files import load_config_file
from grpo_jax.episodes import Reply
from grpo_jax.training.episode_rollout import EpisodeLimits, run_episodes
from grpo_jax.io.tokenizer import CharTokenizer
from grpo_jax.sampling.engine import SamplingConfig
from grpo_jax.tasks import make_task
from grpo_jax.tasks.tool_products import Calculator, NoCalculator, ToolProductsTask
from grpo_jax.training import train
from grpo_jax.training.rollout import encode_prompt
from test_episodes import Scripted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "arith_tools_cpu.py")
TOK = CharTokenizer("0123456789*=?")
ROW = {"prompt": "07*45=", "answer": "315"}


def test_the_calculator_answers_a_call_with_the_product_read_from_the_prompt():
    env = Calculator()
    assert env.reset(**ROW, operands=[0, 0]) is None  # the question is read from the prompt, not the fields
    assert env.step("?") == Reply(text="315=")
    assert (env.tool_calls, env.tool_errors) == (1, 0)
    # 99*99 = 9801, the longest reply: 4 digits and "=" (the config's budget counts on 5).
    env.reset(prompt="99*99=")
    assert env.step("?").text == "9801="
    env.reset(prompt="00*37=")
    assert env.step("?").text == "0="


def test_any_other_turn_is_the_answer_and_ends_the_episode():
    env = Calculator()
    env.reset(**ROW)
    assert env.step("315") == Reply(done=True)
    assert env.step("") == Reply(done=True)  # an empty turn (the stop token at once) is an answer too
    assert env.tool_errors == 0


def test_a_malformed_call_is_counted_and_ends_the_episode_as_a_wrong_answer():
    env = Calculator()
    env.reset(**ROW)
    for turn in ("??", "?315", "31?"):
        assert env.step(turn) == Reply(done=True)
    assert (env.tool_calls, env.tool_errors) == (0, 3)


def test_a_prompt_that_is_not_a_product_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'07\+45=' is not a product"):
        Calculator().reset(prompt="07+45=")


def test_without_the_tool_every_episode_ends_after_its_first_turn():
    env = NoCalculator()
    assert env.reset(**ROW) is None
    assert env.step("?") == Reply(done=True)
    assert env.tool_calls == 0


def test_the_reward_and_the_held_out_check_are_exact_match_of_the_last_turn():
    task = make_task("tool_products", seed=1)
    (reward,) = task.reward_fns()
    completions = ["315", "0315", "31", "?", "315=", ""]
    assert reward.fn(["07*45="] * 6, completions, answer=["315"] * 6) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [task.eval_correct(c, ROW) for c in completions] == [True, False, False, False, False, False]
    assert task.extract_answer("315") == "315" and task.extract_answer("?") is None


def test_the_task_plays_against_the_calculator_and_keeps_the_arithmetic_split():
    task = make_task("tool_products", seed=1)
    assert task.environment_factory is Calculator
    assert make_task("tool_products", tool=False).environment_factory is NoCalculator
    example = task.train_example(0)
    a, b = example["operands"]
    assert example["prompt"] == f"{a:02d}*{b:02d}=" and example["answer"] == str(a * b)
    # No held-out product is ever a training problem (the split is a hash of the problem's text).
    held_out = {e["prompt"] for e in task.eval_examples()}
    assert len(held_out) == 500
    assert not held_out & {task.train_example(i)["prompt"] for i in range(2000)}
    with pytest.raises(ValueError, match="tool must be True or False"):
        ToolProductsTask(tool="yes")


def test_the_warm_up_teaches_the_call_and_reading_the_reply():
    task = make_task("tool_products", seed=1)
    problem = task.train_example(3)
    call, read = task.warmup_example(6), task.warmup_example(7)  # both from problem 3
    assert call == {**problem, "answer": "?"}
    assert read == {**problem, "prompt": f"{problem['prompt']}?{problem['answer']}="}
    # Without the tool the warm-up is the problems themselves.
    baseline = make_task("tool_products", seed=1, tool=False)
    assert baseline.warmup_example(3) == baseline.train_example(3)


def test_an_episode_holds_the_calculators_reply_between_the_turns_and_trains_on_the_model_tokens():
    engine = Scripted(TOK, ["?", "315"])
    sample, played = run_episodes(engine, None, TOK, [ROW], environment_factory=Calculator,
                                  limits=EpisodeLimits(max_turns=2, max_tokens_per_turn=5), num_samples=2,
                                  sampling=SamplingConfig(max_new_tokens=12), rng=jax.random.key(0),
                                  encode_prompt=encode_prompt)
    eos = TOK.eos_id
    expected = TOK.encode("?") + [eos] + TOK.encode("315=") + TOK.encode("315") + [eos]
    for r, ep in enumerate(played.episodes):
        n = int(sample.mask_BxC[r].sum())
        assert sample.tokens_BxC[r, :n].tolist() == expected
        assert played.tool_mask[r, :n].tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
        assert ep.turn_texts == ["?", "315"] and not ep.truncated
    assert played.row_values()["tool_calls"].tolist() == [1.0, 1.0]
    # The second call read the prompt, the call and the reply.
    assert engine.calls[1][0] == TOK.encode("07*45=?") + [eos] + TOK.encode("315=")


def _short(config, run_dir, steps: int):
    return dataclasses.replace(
        config,
        sft=dataclasses.replace(config.sft, steps=4, eval_every=2, eval_size=16, target_accuracy=0.0),
        grpo=dataclasses.replace(config.grpo, prompts_per_step=4, num_generations=4),
        eval=dataclasses.replace(config.eval, every=0, num_questions=8, num_samples=2, ks=(1, 2)),
        train=dataclasses.replace(config.train, steps=steps, run_dir=str(run_dir), progress=False, samples_every=0),
    )


@pytest.mark.slow  # the demo config trained 3 steps; CI runs it with the slow tests
def test_the_demo_config_trains_a_few_steps_as_episodes(tmp_path):
    config = _short(load_config_file(CONFIG), tmp_path / "run", steps=3)
    result = train.run(config)
    rows = [row for row in result.history if "reward" in row]
    assert len(rows) == 3
    for key in ("turns/mean", "tools/calls", "episode/env_tokens", "rewards/exact_match/mean"):
        assert key in rows[-1], key
    assert 1.0 <= rows[-1]["turns/mean"] <= 2.0
    assert [e["step"] for e in result.evals] == [0, 3]
    assert 0.0 <= result.evals[-1]["eval/greedy_accuracy"] <= 1.0


@pytest.mark.slow
def test_the_demo_learns_to_read_the_calculator(tmp_path):
    """The whole demo (~2 minutes on 2 cores): held-out greedy success from about 0.1 after the
    warm-up to at least 0.4 more after 300 GRPO steps (measured: 0.11 -> 1.0 by step 200)."""
    config = load_config_file(CONFIG)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, run_dir=str(tmp_path / "run"),
                                                                    progress=False))
    result = train.run(config)
    greedy = [e["eval/greedy_accuracy"] for e in result.evals]
    assert greedy[0] < 0.4, greedy
    assert greedy[-1] >= greedy[0] + 0.4, greedy
    tools = [row["tools/calls"] for row in result.history if "tools/calls" in row]
    assert np.mean(tools[-10:]) > 0.9  # it calls the calculator in nearly every episode
