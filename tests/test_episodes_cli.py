"""Episodes from the command line, as a TRL user writes them: the environment and the reward
functions are import paths in the user's own module, and a wrong path or signature is one line and
exit status 2 before anything is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_MODULE = textwrap.dedent('''
    from grpo_jax.episodes import Reply


    class AskThenAnswer:
        """Turn 1 asks; the environment answers "=" and the second turn is scored."""

        def reset(self, **row):
            self.turns = 0

        def step(self, turn):
            self.turns += 1
            return Reply(text="=") if self.turns == 1 else Reply(done=True, reward=0.0)


    class NeedsABoard:
        def __init__(self, board):
            self.board = board


    def sevens(prompts, completions, **kwargs):
        return [sum(ch == "7" for ch in c) / 4.0 for c in completions]
''')

CONFIG = textwrap.dedent('''
    from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, SamplingSection, TaskSection,
                                 TrainSection)

    def get_config():
        return Config(
            model=ModelSection(tokenizer="char:0123456789+=", hidden_size=32, intermediate_size=64, num_layers=1,
                               num_heads=2, num_kv_heads=1, head_dim=16),
            task=TaskSection(name="arithmetic", options={"digits": 1}, max_turns=2, max_tokens_per_turn=4),
            sampling=SamplingSection(max_new_tokens=10),
            grpo=GRPOSection(prompts_per_step=2, num_generations=2),
            eval=EvalSection(every=0, num_questions=0),
            train=TrainSection(steps=2, checkpoint_every=0, samples_every=0, progress=False, report_to=()),
        )
''')


def _cli(tmp_path, *sets):
    (tmp_path / "my_envs.py").write_text(USER_MODULE)
    (tmp_path / "cfg.py").write_text(CONFIG)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    args = ["train", "--config", str(tmp_path / "cfg.py"), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    return subprocess.run([sys.executable, "-m", "grpo_jax", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)


@pytest.mark.slow  # a training run in a subprocess; CI runs it with the slow tests
def test_an_environment_and_reward_functions_by_import_path_train_from_the_cli(tmp_path):
    done = _cli(tmp_path, "task.environment=my_envs:AskThenAnswer", "rewards.reward_funcs=my_envs:sevens")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    last = [r for r in rows if "reward" in r][-1]
    assert last["step"] == 2
    assert "turns/mean" in last and "rewards/sevens/mean" in last and "rewards/environment/mean" in last


def _one_line_error(done, *fragments):
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("config error")]
    assert len(errors) == 1, done.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_a_wrong_environment_path_is_one_line_and_exit_2(tmp_path):
    _one_line_error(_cli(tmp_path, "task.environment=my_envs:Nope"), "task.environment='my_envs:Nope'", "Nope")
    _one_line_error(_cli(tmp_path, "task.environment=no_such_module:Env"), "no_such_module")


def test_an_environment_whose_signature_is_wrong_is_one_line_and_exit_2(tmp_path):
    _one_line_error(_cli(tmp_path, "task.environment=my_envs:NeedsABoard"), "NeedsABoard", "board")


def test_a_wrong_reward_path_is_one_line_and_exit_2(tmp_path):
    _one_line_error(_cli(tmp_path, "task.environment=my_envs:AskThenAnswer", "rewards.reward_funcs=my_envs:nope"),
                    "rewards.reward_funcs", "nope")
