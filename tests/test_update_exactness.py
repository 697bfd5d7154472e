"""Accumulation, devices and both together give the full-batch gradient, for every aggregation.

tests/update_exactness_check.py runs one GRPO update of a batch whose micro-batches hold answers of
1 token at one end and 8 at the other; here on one device, and in a child process on 8 fake CPU
devices (XLA_FLAGS must be set before jax starts). Bounds: tests/tolerances.py (GRAD_REL_ERR,
norm-wise per weight).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FAST_COMPILE = "--xla_backend_optimization_level=0"


def _run(tmp_path, devices: int) -> dict:
    out = tmp_path / f"exact{devices}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    proc = subprocess.run([sys.executable, str(TESTS / "update_exactness_check.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _assert_exact(result: dict, expected_cuts: int):
    for aggregation, entry in result["aggregations"].items():
        assert len(entry["cuts"]) == expected_cuts
        for cut, got in entry["cuts"].items():
            where = f"{aggregation}, {cut}"
            assert got["violation"] <= 0, (where, got)
            assert got["num_tokens"] == got["num_tokens_full"] == 71, where
            assert got["grad_norm"] == pytest.approx(entry["grad_norm_full"], rel=1e-3), where
            assert got["loss"] == pytest.approx(got["loss_full"], rel=1e-3, abs=2e-4), where
            assert got["kl"] == pytest.approx(got["kl_full"], rel=1e-4), where
    # The comparison can fail: DAPO's token mean taken as a mean of 4 micro-batch means (what the
    # update did before) is 86% off here, since the first micro-batch's answers are 1 token long.
    assert result["aggregations"]["token"]["mean_of_means_A=4_relative_difference"] > 0.1
    # Per answer and per budget, every micro-batch has the same rows: a mean of means is exact too.
    for aggregation in ("sequence", "constant"):
        assert result["aggregations"][aggregation]["mean_of_means_A=4_relative_difference"] < 1e-5


def test_accumulated_gradient_is_the_full_batch_gradient_on_one_device(tmp_path):
    _assert_exact(_run(tmp_path, 1), expected_cuts=2)


def test_accumulated_and_sharded_gradient_is_the_full_batch_gradient_on_8_devices(tmp_path):
    result = _run(tmp_path, 8)
    assert result["device_count"] == 8
    _assert_exact(result, expected_cuts=6)
    # The work is split, not replicated: each device's compiled update takes its micro-batch rows
    # (M / (data * fsdp)), and the log-prob pass B / (data * fsdp) rows; tensor parallel alone
    # keeps every row on every device (it splits heads, MLP and vocabulary instead).
    rows = result["per_device_rows"]
    assert rows["data=8, A=2"] == {"update_tokens": [[2, 1, 13]], "update_advantages": [[2, 1]],
                                   "logprob_tokens": [[2, 13]]}
    assert rows["data=2 fsdp=4, A=1"] == {"update_tokens": [[1, 2, 13]], "update_advantages": [[1, 2]],
                                          "logprob_tokens": [[2, 13]]}
    assert rows["tensor=8, A=1"]["update_tokens"] == [[1, 16, 13]]
    assert rows["tensor=8, A=1"]["logprob_tokens"] == [[16, 13]]
