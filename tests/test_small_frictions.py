"""The small frictions of a first hour: comma lists in --set with an example on a type error, task
options in `train --help`, a short RunResult repr, and the Python API logging as the CLI does."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax.training import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_set_takes_a_comma_list_for_list_fields():
    # Before: `--set train.report_to=wandb` failed with "expected a value of type tuple as JSON".
    cfg = config_lib.apply_overrides(config_lib.Config(), ["train.report_to=wandb", "eval.ks=1,4",
                                                           "eval.num_samples=4"])
    assert cfg.train.report_to == ("wandb",) and cfg.eval.ks == (1, 4)
    assert config_lib.apply_overrides(config_lib.Config(), ["train.report_to="]).train.report_to == ()
    assert config_lib.apply_overrides(config_lib.Config(), ['train.report_to=["wandb"]']).train.report_to == (
        "wandb",)


@pytest.mark.parametrize("item, example", [
    ("eval.ks=1,x", "e.g. eval.ks=1,8; eval.ks= for none) or a JSON list (e.g. eval.ks='[1, 8]')"),
    ("train.report_to=a,,b", "e.g. train.report_to=tensorboard,wandb"),
    ("train.steps=many", "expected a value of type int (e.g. train.steps=8)"),
    ("rewards.reward_weights=1,heavy", "a comma list of float (e.g. rewards.reward_weights=1.0,0.5"),
])
def test_a_type_error_shows_an_accepted_example(item, example):
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.apply_overrides(config_lib.Config(), [item])
    assert example in str(err.value)


def test_train_help_lists_task_options():
    done = subprocess.run([sys.executable, "-m", "grpo_jax", "train", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert done.returncode == 0
    for line in ("task.name=jsonl:", "task.options.answer_location = 'boxed'", "task.options.chat = None",
                 "task.name=arithmetic:", "task.options.reverse_answer = False"):
        assert line in done.stdout, line


def test_run_result_repr_is_one_short_line():
    params = {"w": np.zeros((1000, 100)), "b": np.zeros(100)}
    result = train.RunResult("runs/x", 3, [{"step": 3, "reward": 0.5, "kl": 0.01, "entropy": 1.2}],
                             [{"step": 3, "eval/pass@1": 0.25}], params=params)
    text = repr(result)
    # Before: the dataclass repr printed every params array (and every row).
    assert text == ("RunResult(run_dir='runs/x', step=3, stopped_by=None, 1 rows (reward=0.5, kl=0.01, "
                    "entropy=1.2), 1 evals, last eval/pass@1=0.25, params: 2 arrays, 100,100 values)")


@pytest.mark.slow
def test_the_python_api_logs_like_the_cli(tmp_path):
    # A script that calls train.run without setting up logging sees the start-up lines at INFO.
    code = textwrap.dedent(f"""
        import sys, dataclasses
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from test_train import SevensTask, tiny_config
        from grpo_jax.training import train
        cfg = tiny_config({str(tmp_path)!r})
        train.run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=1)), task=SevensTask())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("backend cpu, 1 device(s)") == 1, done.stderr  # printed, and once
