"""`train.run` on two processes joined by jax.distributed (CPU, 1 device each) equals one process.

tests/multihost_train_check.py trains the tiny SevensTask config of tests/test_train.py for 2 steps.
Two processes (each sampling and scoring its half of the prompts, on a data=2 mesh across them)
must report the same metrics rows as each other and as one process with 2 fake devices (data=2),
held-out evaluation (at steps 0 and 2) included.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tolerances import adam_weight_atol, metric_tolerance

TESTS = Path(__file__).parent
REPO = TESTS.parent
FAST_COMPILE = "--xla_backend_optimization_level=0"  # as tests/test_sharding.py
KEYS = ("loss", "reward", "kl", "grad_norm", "entropy", "reward_std", "completions/mean_length",
        "frac_reward_zero_std", "advantages/std")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                    [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")


def _run_pair(tmp_path, tag: str, run_dir, *extra: str) -> tuple[dict, dict]:
    script = str(TESTS / "multihost_train_check.py")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path / f"{tag}{i}.json"), "--run-dir", str(run_dir),
                               "--process-id", str(i), "--num-processes", "2", "--port", str(port), *extra],
                              env=_env(1), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    return tuple(json.loads((tmp_path / f"{tag}{i}.json").read_text()) for i in range(2))


@pytest.mark.slow
def test_two_process_stop_and_resume_matches_one_process(tmp_path):
    """Orbax checkpoints written and restored by both processes: stop after step 1, resume to 2."""
    script = str(TESTS / "multihost_train_check.py")
    single = subprocess.run([sys.executable, script, str(tmp_path / "single.json"), "--run-dir",
                             str(tmp_path / "single")], env=_env(2), cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-4000:]
    ref = json.loads((tmp_path / "single.json").read_text())
    first = _run_pair(tmp_path, "a", tmp_path / "multi", "--stop-after", "1")
    assert [r["step"] for r in first] == [1, 1]
    assert (tmp_path / "multi" / "checkpoints" / "1").is_dir()
    r0, r1 = _run_pair(tmp_path, "b", tmp_path / "multi", "--resume")
    assert r0["history"] == r1["history"]
    assert [row["step"] for row in r0["history"]] == [2]
    got, want = r0["history"][0], ref["history"][1]
    assert got["data_position"] == want["data_position"] and got["reward"] == want["reward"]
    for k in KEYS:
        assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), k


def test_two_process_train_run_matches_one_process(tmp_path):
    script = str(TESTS / "multihost_train_check.py")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path / f"p{i}.json"), "--run-dir", str(tmp_path / "multi"),
                               "--process-id", str(i), "--num-processes", "2", "--port", str(port), "--eval"],
                              env=_env(1), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        # The single-process reference runs while the pair runs (2 cores: they mostly overlap waits).
        single = subprocess.run([sys.executable, script, str(tmp_path / "single.json"), "--run-dir",
                                 str(tmp_path / "single"), "--eval"], env=_env(2), cwd=REPO, capture_output=True,
                                text=True, timeout=300)
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert single.returncode == 0, single.stderr[-4000:]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    ref, r0, r1 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("single", "p0", "p1"))

    assert (ref["process_count"], ref["device_count"]) == (1, 2)
    assert (r0["process_count"], r0["device_count"], r0["process_index"], r1["process_index"]) == (2, 2, 0, 1)
    assert r0["step"] == r1["step"] == ref["step"] == 2
    # Both processes compute identical metrics (gathered rows, replicated update outputs).
    assert r0["history"] == r1["history"]
    assert [row["step"] for row in r0["history"]] == [0, 1, 2]
    # Held-out eval (each process answers its half of the questions, results gathered): the same
    # pass@k / maj@k / greedy accuracy as one process, at step 0 and after the last step.
    evals = [(got, want) for got, want in zip(r0["history"], ref["history"]) if got["step"] in (0, 2)]
    for got, want in evals:
        names = [k for k in want if k.startswith("eval/") and k != "eval/time"]
        assert {"eval/pass@1", "eval/pass@2", "eval/maj@2", "eval/greedy_accuracy"} <= set(names)
        assert {k: got[k] for k in names} == {k: want[k] for k in names}
    for got, want in zip(r0["history"][1:], ref["history"][1:]):
        assert got.keys() == want.keys()
        # Same prompts, samples and rewards (the sampler's Gumbel noise does not depend on layout) ...
        assert got["data_position"] == want["data_position"]
        assert got["completions/mean_length"] == want["completions/mean_length"]
        assert got["reward"] == want["reward"]
        # ... and the same update up to float32 summation order.
        for k in KEYS:
            assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)
    # Process 0 alone writes the run directory's files; the checkpoint of the last step is there.
    assert len((tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()) == 3
    assert (tmp_path / "multi" / "checkpoints" / "2").is_dir()
    # export_hf: the weights gathered from both processes, written once, equal to one process's.
    from safetensors.numpy import load_file

    got, want = (load_file(str(tmp_path / n / "hf" / "model.safetensors")) for n in ("multi", "single"))
    assert got.keys() == want.keys()
    for name in want:
        # 2 steps x 2 minibatches of Adam (eps 1e-4, lr 1e-2): tests/tolerances.py.
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=adam_weight_atol(1e-2, updates=4),
                                   err_msg=name)


def test_multihost_settings_it_cannot_run_are_config_errors(monkeypatch, tmp_path):
    import dataclasses

    import jax

    from grpo_jax.training import run_context
    from grpo_jax.distributed import sharding
    from grpo_jax.config import ConfigError, SFTSection
    from test_train import tiny_config

    monkeypatch.setattr(run_context.jax, "process_count", lambda: 2)
    cfg = tiny_config(tmp_path)
    mesh = sharding.make_mesh()
    run_context.check_batch_fits_mesh(cfg, mesh)  # 4 prompts over 2 processes: fine
    with pytest.raises(ConfigError, match="prompts_per_step=3 must split evenly over 2 processes"):
        run_context.check_batch_fits_mesh(dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, prompts_per_step=3)), mesh)
    # Dynamic sampling and the SFT warm-up run on several processes now; the SFT batch must split.
    run_context.check_batch_fits_mesh(dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, dynamic_sampling=True)), mesh)
    two = jax.sharding.AbstractMesh((2, 1, 1), sharding.MESH_AXES)
    with pytest.raises(ConfigError, match="sft.batch_size=3 must split evenly"):
        run_context.check_batch_fits_mesh(dataclasses.replace(cfg, sft=SFTSection(steps=1, batch_size=3)), two)


def _single(tmp_path, tag: str, *extra: str) -> dict:
    script = str(TESTS / "multihost_train_check.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path / f"{tag}.json"), "--run-dir", str(tmp_path / tag),
                           *extra], env=_env(2), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / f"{tag}.json").read_text())


def _same_rows(got_rows, want_rows):
    assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows]
    for got, want in zip(got_rows, want_rows):
        assert got.keys() == want.keys(), got["step"]
        for k in ("data_position", "reward", "completions/mean_length", "dynamic_sampling/rounds",
                  "dynamic_sampling/sampled_reward"):
            if k in want:
                assert got[k] == want[k], (got["step"], k)
        for k in KEYS:
            assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)


@pytest.mark.slow  # ~30 s; the two-process training test runs by default
def test_two_processes_run_dynamic_sampling_and_the_sft_warm_up_as_one_process(tmp_path):
    # Before: both were refused on several processes. The resample decision is taken from the
    # gathered rewards (the same on every process), and the SFT warm-up feeds each process's
    # devices their rows of the same batches.
    extra = ("--dynamic", "--sft", "3", "--steps", "3")
    ref = _single(tmp_path, "single", *extra)
    r0, r1 = _run_pair(tmp_path, "p", tmp_path / "multi", *extra)
    assert r0["history"] == r1["history"]
    assert any(row["dynamic_sampling/rounds"] > 1 for row in ref["history"])  # resampling happened
    _same_rows(r0["history"], ref["history"])


@pytest.mark.slow  # ~40 s
def test_two_processes_play_episodes_to_the_end_together(tmp_path):
    """Each process plays its prompts' episodes; a turn's call runs on every process (padded to the
    same rows) until no process has a row playing, so turn counts that differ between processes
    cannot leave one waiting alone. Both processes write the same rows. (A later turn's rows are
    keyed by their place in that turn's call, which depends on the process layout: the samples are
    one process's on any number of devices, tests/test_train_devices.py, not across processes.)"""
    r0, r1 = _run_pair(tmp_path, "p", tmp_path / "multi", "--episodes")
    assert r0["history"] == r1["history"]
    assert [row["step"] for row in r0["history"]] == [1, 2]
    assert any(row.get("turns/max", 0) > 1 for row in r0["history"])
    for row in r0["history"]:
        assert all(math.isfinite(row[k]) for k in ("loss", "reward", "turns/mean", "grad_norm")), row


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step_and_resumes_exactly(tmp_path):
    # A preempted TPU VM gets SIGTERM alone. Before: the other process went on into the next step
    # and waited at its first gather. Now both stop after step 2 with one checkpoint, and resuming
    # both gives the uninterrupted run's rows.
    ref = _single(tmp_path, "single", "--steps", "4")
    first = _run_pair(tmp_path, "a", tmp_path / "multi", "--steps", "4", "--sigterm-at", "2")
    assert [r["step"] for r in first] == [2, 2]
    assert first[1]["stopped_by"] == "SIGTERM" and first[0]["stopped_by"] == "SIGTERM on another process"
    assert sorted(int(n) for n in os.listdir(tmp_path / "multi" / "checkpoints") if n.isdigit())[-1] == 2
    r0, r1 = _run_pair(tmp_path, "b", tmp_path / "multi", "--steps", "4", "--resume")
    assert r0["history"] == r1["history"]
    _same_rows(r0["history"], ref["history"][2:])


def test_a_reward_error_on_one_process_stops_both_with_the_last_step_saved(tmp_path):
    # A reward function that raises on one host's completions only. Before: that process exited
    # and the other waited at the next gather until killed. Now both raise after scoring step 2
    # (the other naming the failing process), having saved step 1 together.
    script = str(TESTS / "multihost_train_check.py")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path / f"f{i}.json"), "--run-dir",
                               str(tmp_path / "multi"), "--process-id", str(i), "--num-processes", "2", "--port",
                               str(port), "--steps", "3", "--reward-error-at", "2"],
                              env=_env(1), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode not in (0, None) for p in procs), "\n".join(log[-3000:] for log in logs)
    assert "ValueError: sevens: a completion this reward cannot parse" in logs[1]
    assert "scoring step 2's rewards failed on process(es) [1]" in logs[0]
    assert sorted(int(n) for n in os.listdir(tmp_path / "multi" / "checkpoints") if n.isdigit()) == [1]
