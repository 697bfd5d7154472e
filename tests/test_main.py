"""`python -m grpo_jax`: flags to a config to a run. In-process calls of `main` (the subprocess
route is tests/test_config.py's and test_small_frictions.py's)."""

import os

import pytest

from grpo_jax import config as config_lib
from grpo_jax.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH = os.path.join(ROOT, "configs", "arith_cpu.py")


def test_train_help_shows_the_sections_in_config_order(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    heads = [out.index(f"\n  {name}: ") for name in config_lib.SECTIONS]
    assert heads == sorted(heads)  # model, lora, task, sampling, rewards, grpo, off_policy, ... mesh
    assert "off_policy.vllm_importance_sampling_correction = True  (bool)" in out  # TRL's name kept


@pytest.mark.parametrize("key, says", [
    ("model.lora_r=8", "config error: --set model.lora_r: moved to lora.r\n"),
    ("train.max_staleness=1", "config error: --set train.max_staleness: moved to off_policy.max_staleness\n"),
    ("train.verifier_workers=2", "config error: --set train.verifier_workers: moved to rewards.workers\n"),
])
def test_an_old_set_key_exits_2_naming_its_new_place(capsys, tmp_path, key, says):
    assert main(["train", "--config", ARITH, "--run-dir", str(tmp_path), "--set", key]) == 2
    assert capsys.readouterr().err == says


def test_a_mesh_time_config_error_exits_2_before_any_step(capsys, tmp_path):
    # One CPU device cannot hold mesh.data=2: refused by config validation, as a config error.
    assert main(["train", "--config", ARITH, "--run-dir", str(tmp_path), "--set", "mesh.data=2"]) == 2
    err = capsys.readouterr().err.splitlines()  # (after the platform check's CPU warning, if any)
    assert err[-1] == ("config error: mesh: data*fsdp*expert*tensor = 2*1*1*1 = 2 but there are 1 devices; use -1 "
                       "for one axis (1 cpu devices)"), err
    assert not (tmp_path / "checkpoints").exists()
