"""The README's "Coming from TRL" example: TRL's reward functions, as written, score the same in
grpo_jax; the grpo_jax script trains; the TRL script runs where TRL is installed (parity)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax.rewards import WeightedReward, compute_rewards
from grpo_jax.tasks import make_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "coming_from_trl")


def _rewards_module():
    spec = importlib.util.spec_from_file_location("coming_from_trl_rewards", os.path.join(EXAMPLE, "rewards.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_rewards_score_the_example_data_as_trl_would():
    rewards = _rewards_module()
    task = make_task("jsonl", path=os.path.join(EXAMPLE, "data.jsonl"))
    example = task.train_example(0)
    gold = example["answer"]
    # Two replies to one chat prompt: the right sum last, and a wrong one. completion_ids as the
    # trainer passes them: 4 and 32 tokens -> brevity -4/32 and -32/32.
    total, parts = compute_rewards(
        [WeightedReward("correct", rewards.correct, 1.0), WeightedReward("brevity", rewards.brevity, 0.1)],
        [example["prompt"]] * 2, [f"It is {gold}", "It is 1000"],
        {"answer": [gold] * 2, "completion_ids": [[1] * 4, [1] * 32]})
    np.testing.assert_array_equal(parts["correct"], [1.0, 0.0])
    np.testing.assert_array_equal(parts["brevity"], [-0.125, -1.0])
    # float32: 1 - 0.1 * 0.125 and 0 - 0.1 * 1, each one rounding of a product and a sum.
    np.testing.assert_allclose(total, [0.9875, -0.1], rtol=2 * np.finfo(np.float32).eps)


def _tiny_checkpoint(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hf_fixtures import make_tiny_instruct_checkpoint

    return str(make_tiny_instruct_checkpoint(tmp_path / "tiny"))


def _run(python, script, model, cwd, env):
    return subprocess.run([python, script, model], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_grpo_jax_script_runs(tmp_path):
    model = _tiny_checkpoint(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("rewards.py", "data.jsonl"):
        (work / name).write_text(open(os.path.join(EXAMPLE, name)).read())
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{work}", "JAX_PLATFORMS": "cpu"}
    out = _run(sys.executable, os.path.join(EXAMPLE, "grpo_jax_grpo.py"), model, work, env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(work / "runs" / "grpo_jax" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all("rewards/correct/mean" in r and "rewards/brevity/mean" in r for r in rows)


@pytest.mark.slow
@pytest.mark.parity
def test_trl_script_runs(tmp_path):
    python = os.environ.get("GRPO_JAX_TRL_PYTHON", sys.executable)  # a venv with torch, transformers, trl
    probe = subprocess.run([python, "-c", "import trl, torch, datasets"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("TRL is not installed (set GRPO_JAX_TRL_PYTHON to a python that has trl, torch, datasets)")
    model = _tiny_checkpoint(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("rewards.py", "data.jsonl"):
        (work / name).write_text(open(os.path.join(EXAMPLE, name)).read())
    out = _run(python, os.path.join(EXAMPLE, "trl_grpo.py"), model, work, {**os.environ, "PYTHONPATH": str(work)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rewards/correct/mean" in out.stdout + out.stderr
