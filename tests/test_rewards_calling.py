"""Reward functions written for TRL run as written: keyword arguments, conversational completions,
None for "not applicable", and a clear error when a signature cannot take the call."""

import dataclasses

import numpy as np
import pytest

from grpo_jax.training import train
from grpo_jax.config import Config, TaskSection
from grpo_jax.rewards import WeightedReward, compute_rewards, format_reward_fn, scheduled, truncation_gated
from grpo_jax.rewards.calling import TrainerState
from grpo_jax.tasks.user_rewards import import_reward, reward_specs, with_reward_funcs
from test_train import SevensTask, tiny_config

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


# TRL's documented examples (GRPOTrainer docs), as a TRL user writes them.
def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]


def format_reward_conv(completions, **kwargs):
    return [1.0 if c[0]["content"].startswith("<think>") else 0.0 for c in completions]


def exact_answer(completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 if a is not None else None for c, a in zip(completions, answer)]


def sevens_trl(completions, trainer_state, completion_ids, log_metric, log_extra, **kwargs):
    """The sevens reward in TRL's form; checks the TRL-only arguments it is given on the way, and
    logs with TRL's log_metric (a scalar for the row) and log_extra (a column for the samples)."""
    assert isinstance(trainer_state.global_step, int) and trainer_state.max_steps == 2
    assert all(isinstance(ids, list) and len(ids) >= 1 for ids in completion_ids)
    log_metric("sevens/global_step", float(trainer_state.global_step))
    log_extra("num_ids", [len(ids) for ids in completion_ids])
    return [sum(ch == "7" for ch in c) / 4.0 for c in completions]


def test_trl_signature_runs_with_text_prompts():
    # Today's positional call fn(prompts, completions) gives reward_len two positionals: TypeError.
    total, parts = compute_rewards([WeightedReward("len", reward_len)], ["q1", "q2"], ["a" * 20, "a" * 15], {})
    np.testing.assert_array_equal(parts["len"], [0.0, -5.0])  # -|20 - 20|, -|20 - 15|
    np.testing.assert_array_equal(total, [0.0, -5.0])


def test_messages_prompts_give_conversational_completions_to_user_functions_only():
    # TRL passes [{"role": "assistant", "content": text}] when the prompt is messages; built-ins
    # (which read text) still get the string: format_reward_fn scores the R1 layout, tags on own lines.
    completion = "<think>\n2+2 is 4\n</think>\n<answer>\n4\n</answer>"
    total, parts = compute_rewards(
        [WeightedReward("fmt_user", format_reward_conv), WeightedReward("fmt_builtin", format_reward_fn)],
        [MESSAGES, MESSAGES], [completion, "4"], {})
    np.testing.assert_array_equal(parts["fmt_user"], [1.0, 0.0])
    np.testing.assert_array_equal(parts["fmt_builtin"], [1.0, 0.0])


def test_function_without_kwargs_gets_the_names_it_declares_and_none_is_skipped():
    def strict(completions, answer):  # no **kwargs: the trainer's other names are not passed
        return exact_answer(completions, answer)

    total, parts = compute_rewards([WeightedReward("strict", strict)], ["q"] * 3, ["4", "5", "x"],
                                   {"answer": ["4", "4", None], "step": 3})
    np.testing.assert_array_equal(parts["strict"][:2], [1.0, 0.0])
    assert np.isnan(parts["strict"][2]) and np.isnan(total[2])  # None: not applicable, skipped


def test_a_signature_that_cannot_take_the_call_names_function_and_arguments():
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"reward function 'mine' cannot take the call: missing a required "
                                         r"argument: 'solution'.*\['answer', 'completions', 'pool', 'prompts'\]"):
        compute_rewards([WeightedReward("mine", needs_solution)], ["q"], ["a"], {"answer": ["1"]})


def test_wrappers_pass_the_keywords_on():
    # scheduled() and truncation_gated() wrap a TRL-style function; today both call it positionally.
    halved = scheduled(reward_len, lambda step: 0.5)
    gated = truncation_gated(reward_len)
    _, parts = compute_rewards([WeightedReward("half", halved), WeightedReward("gated", gated)],
                               ["q", "q"], ["a" * 10, "a" * 20], {"truncated": [True, False], "step": 0})
    np.testing.assert_array_equal(parts["half"], [-5.0, 0.0])  # 0.5 * -|20 - 10|
    np.testing.assert_array_equal(parts["gated"], [0.0, 0.0])  # truncated: 0.0; 20 chars: 0


def test_import_paths_and_weights():
    specs = reward_specs(["test_rewards_calling:reward_len", "test_rewards_calling.reward_len"], [1.0, 0.5])
    assert [(s.name, s.fn, s.weight) for s in specs] == [("reward_len", reward_len, 1.0),
                                                           ("reward_len_2", reward_len, 0.5)]
    with pytest.raises(ValueError, match="'nope_pkg:f': cannot import module 'nope_pkg'"):
        import_reward("nope_pkg:f")
    with pytest.raises(ValueError, match="module 'test_rewards_calling' has no 'missing'"):
        import_reward("test_rewards_calling:missing")
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 reward_funcs"):
        reward_specs([reward_len, reward_len], [1.0])


def test_with_reward_funcs_keeps_the_task_and_replaces_its_rewards():
    task = with_reward_funcs(SevensTask(), [reward_len])
    assert task.name == "sevens" and task.train_example(3) == SevensTask().train_example(3)
    assert [s.name for s in task.reward_fns()] == ["reward_len"]
    assert task.eval_correct("7777", {}) is True


def test_train_with_task_reward_funcs_from_config(tmp_path):
    # The command line's route: rewards.reward_funcs names a TRL-style function by import path. It
    # gets completion_ids and trainer_state (asserted inside) and its values are the reward.
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg,
                              train=dataclasses.replace(cfg.train, steps=2, checkpoint_every=0, samples_every=1),
                              rewards=dataclasses.replace(cfg.rewards, reward_funcs=("test_rewards_calling:sevens_trl",)))
    result = train.run(cfg, task=SevensTask())
    rows = [r for r in result.history if "reward" in r]
    assert len(rows) == 2
    assert all(r["rewards/sevens_trl/mean"] == r["reward"] for r in rows)
    # Step s's rollout is scored at trainer_state.global_step = s (the step it trains).
    assert [r["sevens/global_step"] for r in rows] == [1.0, 2.0]
    import json

    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert all(1 <= s["extra/num_ids"] <= 4 for s in samples)  # max_new_tokens=4


def test_trainer_state_pickles_for_worker_processes():
    import pickle

    assert pickle.loads(pickle.dumps(TrainerState(3, 10))) == TrainerState(global_step=3, max_steps=10)


def test_positional_only_parameters_are_passed_by_position():
    # Built-in rewards such as the jsonl task's located accuracy are `f(prompts, completions, /, *, answer)`.
    def located(prompts, completions, /, *, answer, **_):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    _, parts = compute_rewards([WeightedReward("located", located)], ["q", "q"], ["4", "5"], {"answer": ["4", "4"]})
    np.testing.assert_array_equal(parts["located"], [1.0, 0.0])


def test_a_bad_signature_stops_the_run_at_start_up(tmp_path):
    # Before any sampling, as a config error naming the function and the names on offer.
    from grpo_jax.config import ConfigError

    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg,
                              rewards=dataclasses.replace(cfg.rewards, reward_funcs=("test_rewards_calling:needs_solution",)))
    with pytest.raises(ConfigError, match=r"reward function 'needs_solution' cannot take the call: missing a "
                                          r"required argument: 'solution'.*'answer', 'completion_ids'"):
        train.run(cfg, task=SevensTask())
    assert not (tmp_path / "metrics.jsonl").exists()


def needs_solution(completions, solution, **kwargs):
    return [0.0] * len(completions)
