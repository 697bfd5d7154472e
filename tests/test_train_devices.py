"""`train.run` on one process with 8 (fake CPU) devices equals the same run on one device.

The local-GPUs case: one process, several devices, mesh data=8. tests/multihost_train_check.py
(one process here) trains the tiny SevensTask config for 2 steps with held-out evaluation; the
sampler, the log-prob pass and the update split their rows over the 8 devices (their per-device
programs are checked in tests/test_sampler_sharding.py and tests/test_update_exactness.py), and
the metrics must be the one-device metrics up to float32 summation order (tests/tolerances.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tolerances import metric_tolerance

TESTS = Path(__file__).parent
REPO = TESTS.parent


def _run(tmp_path, devices: int, *flags: str) -> dict:
    out = tmp_path / f"d{devices}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, str(TESTS / "multihost_train_check.py"), str(out), "--run-dir",
                           str(tmp_path / f"run{devices}"), "--eval", *flags], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_eight_devices_on_one_process_match_one_device(tmp_path):
    one, eight = _run(tmp_path, 1), _run(tmp_path, 8)
    assert (one["device_count"], eight["device_count"]) == (1, 8)
    assert [row["step"] for row in eight["history"]] == [0, 1, 2]
    for got, want in zip(eight["history"], one["history"]):
        assert got.keys() == want.keys()
        # The same samples (per-row keys), hence the same rewards and held-out figures ...
        for k in ("reward", "completions/mean_length", "data_position", "frac_reward_zero_std"):
            if k in want:
                assert got[k] == want[k], (got["step"], k)
        for k in (k for k in want if k.startswith("eval/") and k != "eval/time"):
            assert got[k] == want[k], (got["step"], k)
        # ... and the same update up to float32 summation order.
        for k in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean", "ratio/max"):
            if k in want:
                assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)


@pytest.mark.slow  # ~80 s
def test_episodes_on_eight_devices_match_one_device(tmp_path):
    """Episodes: each later turn is a call on the rows still playing, padded to a multiple of the 8
    devices (of a power of two on one device); per-row keys make the samples the same, so the
    episodes, rewards and turn counts are equal and the update agrees to summation order."""
    one, eight = _run(tmp_path, 1, "--episodes"), _run(tmp_path, 8, "--episodes")
    for got, want in zip(eight["history"], one["history"]):
        for k in ("reward", "completions/mean_length", "turns/mean", "turns/max", "episode/env_tokens"):
            if k in want:
                assert got[k] == want[k], (got["step"], k)
        for k in ("loss", "kl", "grad_norm"):
            if k in want:
                assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)
    assert any(row.get("turns/max", 0) > 1 for row in one["history"]), one["history"]
