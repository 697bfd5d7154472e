"""Off-policy training: the sampler correction wired into the trainer, and asynchronous rollouts
(`off_policy.max_staleness`): the schedule, exactness against the synchronous loop, exact resume with
batches in flight, and the 4 + 4 device split (tests/async_split_check.py).

The tiny SevensTask config of tests/test_train.py (beta 0.04, two minibatches: pi_old is a trainer
pass, and the sampler correction is on by default).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from grpo_jax.training import async_rollouts, phases, run_context, train
from grpo_jax.config import ConfigError
from grpo_jax.io.run_dir import RunDirError
from test_train import SevensTask, tiny_config
from tolerances import FORWARD_REL_ERR, metric_tolerance

TESTS = Path(__file__).parent


def _config(run_dir, k, **train):
    cfg = tiny_config(run_dir)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train),
                               off_policy=dataclasses.replace(cfg.off_policy, max_staleness=k))


def _same_bits(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _training_figures(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "async/", "tokens_per_second", "recompiles"))}


def _with_off_policy(cfg, **off_policy):
    return dataclasses.replace(cfg, off_policy=dataclasses.replace(cfg.off_policy, **off_policy))


def test_the_trainer_weighs_tokens_by_its_pi_old_over_the_samplers(tmp_path, monkeypatch):
    # Synchronous, pi_old from a trainer pass (two minibatches): on CPU in float32 the sampler's
    # log-probs are the trainer's up to summation order, each within FORWARD_REL_ERR * |logp|. A
    # weight exp(d) is then off by |d| relative, and the mean |logp| of sampled tokens is about the
    # entropy, <= log(14) for the 14-symbol vocabulary: the mean weight is 1 within
    LOGP_ERR = FORWARD_REL_ERR * np.log(14)  # noqa: N806
    agree = train.run(_config(tmp_path / "agree", 0, steps=2), task=SevensTask())
    for row in agree.history:
        assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=LOGP_ERR)
        assert row["sampling/importance_sampling_masked_fraction"] == 0.0

    # A sampler that reports every token 0.1 nats less likely than the trainer finds it: each
    # token's weight is pi_old / pi_sampler = e^0.1 = 1.105 under token truncation (cap 3) ...
    device_rows = phases.device_rows

    def shifted(ctx, batch, advantages, completion_mask):
        a = batch.arrays
        a["logprobs"] = a["logprobs"] - np.float32(0.1) * a["mask"]
        return device_rows(ctx, batch, advantages, completion_mask)

    monkeypatch.setattr(phases, "device_rows", shifted)
    cfg = _with_off_policy(_config(tmp_path / "truncate", 0, steps=2), vllm_importance_sampling_mode="token_truncate")
    for row in train.run(cfg, task=SevensTask()).history:
        assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(np.exp(0.1), rel=LOGP_ERR)
        assert row["sampling/sampling_logp_difference/mean"] == pytest.approx(0.1, abs=LOGP_ERR)
    # ... and with the band [1/1.05, 1.05] token masking drops every token: only the KL trains.
    cfg = _with_off_policy(_config(tmp_path / "mask", 0, steps=2), vllm_importance_sampling_mode="token_mask",
                           vllm_importance_sampling_clip_max=1.05)
    for row in train.run(cfg, task=SevensTask()).history:
        assert row["sampling/importance_sampling_masked_fraction"] == 1.0
        assert row["sampling/importance_sampling_ratio/max"] == 0.0
        assert row["policy_loss"] == 0.0


def test_schedule_worked_example():
    # k = 1: steps 1 and 2 sample from the initial params (version 0), step 3 from step 1's, ...
    assert [async_rollouts.sampling_version(n, 1) for n in range(1, 6)] == [0, 0, 1, 2, 3]
    # k = 0 is the synchronous loop: step n from step n - 1's params.
    assert [async_rollouts.sampling_version(n, 0) for n in range(1, 4)] == [0, 1, 2]
    # A checkpoint after step 5 with k = 2 keeps what steps 6 and 7 sample from: versions 3 and 4.
    assert async_rollouts.snapshot_versions(5, 2) == [3, 4]
    assert async_rollouts.snapshot_versions(1, 2) == [0, 0]


def test_the_pipeline_at_zero_staleness_equals_the_synchronous_loop_bit_for_bit(tmp_path, monkeypatch):
    # The rollout thread, the snapshots and the batch hand-over, with nothing stale: every figure
    # and every weight must be the synchronous trainer's.
    sync = train.run(_config(tmp_path / "sync", 0, steps=4), task=SevensTask())

    def shared_placement(config, graphdef, model_config, tokenizer, mesh, sampler, params):
        from grpo_jax.distributed import sharding
        return run_context.RolloutPlacement(sampler=sampler, mesh=mesh, split=False,
                                            param_shardings=sharding.param_shardings(mesh, params))

    monkeypatch.setattr(run_context, "rollout_placement", shared_placement)
    piped = train.run(_config(tmp_path / "piped", 0, steps=4), task=SevensTask())
    assert [r["async/staleness"] for r in piped.history] == [0.0] * 4
    assert [_training_figures(r) for r in piped.history] == [_training_figures(r) for r in sync.history]
    _same_bits(piped.params, sync.params)


def test_one_step_stale_batches_come_from_the_older_params_and_resume_exactly(tmp_path):
    straight = train.run(_config(tmp_path / "straight", 1, steps=6), task=SevensTask())
    assert [r["async/staleness"] for r in straight.history] == [0.0, 1, 1, 1, 1, 1]
    assert all(r["async/dropped_batches"] == 0 for r in straight.history)
    for r in straight.history:
        assert r["time/weight_sync"] >= 0 and np.isfinite(r["loss"])
        assert 0 < r["sampling/importance_sampling_ratio/mean"] < 3

    # Step 2's batch is what the initial params sample with step 2's key at the data position
    # after step 1: the same rewards, token for token.
    ctx, fresh = run_context.build(_config(tmp_path / "probe", 1, steps=6), task=SevensTask())
    worker = async_rollouts.RolloutWorker(ctx, async_rollouts.Snapshots(), first_step=1, last_step=0,
                                          data_position=ctx.config.grpo.prompts_per_step, max_staleness=1)
    batch = worker.collect(2, 0, fresh.params).batch
    worker.close()
    assert float(np.mean(batch.rewards)) == straight.history[1]["reward"]

    # Stopped after step 3 with step 4's rollout in flight; the resumed run re-runs it from the
    # snapshot in the checkpoint and ends with the same weights, bit for bit.
    first = train.run(_config(tmp_path / "split", 1, steps=6, stop_after_steps=3), task=SevensTask())
    assert first.step == 3
    resumed = train.run(_config(tmp_path / "split", 1, steps=6), resume=True, task=SevensTask())
    assert resumed.step == 6
    rows = {r["step"]: _training_figures(r) for r in straight.history}
    for row in resumed.history:
        assert _training_figures(row) == rows[row["step"]], row["step"]
    assert [r["async/staleness"] for r in resumed.history] == [1.0, 1, 1]
    _same_bits(straight.params, resumed.params)


def test_a_batch_older_than_the_bound_is_dropped_counted_and_sampled_again(tmp_path, caplog):
    ctx, fresh = run_context.build(_config(tmp_path, 1, steps=6), task=SevensTask())
    batches = async_rollouts.AsyncBatches(ctx, fresh)
    batches.worker.close()  # replaced by one that hands over a batch sampled 3 versions ago

    class StaleWorker:
        resampled = []

        def next(self):
            return async_rollouts.CollectedStep(step=5, version=1, batch="stale")

        def collect(self, step, version, params):
            self.resampled.append((step, version))
            return async_rollouts.CollectedStep(step=step, version=version, batch="fresh")

        def close(self):
            pass

    batches.worker = StaleWorker()
    batches.snapshots.put(4, "params of step 4")
    state = dataclasses.replace(fresh, step=4)
    with caplog.at_level(logging.WARNING, logger="grpo_jax"):
        batch = batches.next_batch(state, device_free_at=0.0)
    assert batch == "fresh" and StaleWorker.resampled == [(5, 4)]
    assert batches.dropped == 1 and batches._staleness[5] == 0
    assert "3 steps stale" in caplog.text


def test_async_config_errors_name_the_fields(tmp_path):
    with pytest.raises(ConfigError, match="off_policy.rollout_devices=2 needs off_policy.max_staleness >= 1"):
        cfg = tiny_config(tmp_path)
        dataclasses.replace(cfg,
                            off_policy=dataclasses.replace(cfg.off_policy, rollout_devices=2))
    with pytest.raises(ConfigError, match="off_policy.rollout_devices=1 leaves no device"):
        cfg = _config(tmp_path, 1)
        run_context.build(dataclasses.replace(cfg,
                                              off_policy=dataclasses.replace(cfg.off_policy, rollout_devices=1)),
                          task=SevensTask())
    with pytest.raises(ConfigError, match="off_policy.max_staleness"):
        dataclasses.replace(tiny_config(tmp_path),
                            off_policy=dataclasses.replace(tiny_config(tmp_path).off_policy, max_staleness=-1))


def test_resuming_with_another_staleness_is_refused_and_the_checkpoints_stay(tmp_path):
    train.run(_config(tmp_path, 1, steps=4, stop_after_steps=2), task=SevensTask())
    steps_before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    for k in (0, 2):
        with pytest.raises(RunDirError, match="off_policy.max_staleness changed 1 -> %d" % k):
            train.run(_config(tmp_path, k, steps=4), resume=True, allow_config_change=True, task=SevensTask())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == steps_before


def _split_run(tmp_path, devices: int, rollout_devices: int) -> dict:
    out = tmp_path / f"split{devices}_{rollout_devices}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, str(TESTS / "async_split_check.py"), str(out), str(tmp_path / out.stem),
                           str(rollout_devices)], env=env, cwd=TESTS.parent, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two subprocess runs (~20 s); CI runs it with the slow tests
def test_rollouts_on_four_devices_and_training_on_four_equal_the_one_device_run(tmp_path):
    one, split = _split_run(tmp_path, 1, 0), _split_run(tmp_path, 8, 4)
    # The trainer's weights live on devices 0-3, the sampler's copy on devices 4-7, and rows split
    # over each side's 4 devices (per-device shapes, not just the figures).
    assert split["param_devices"] == [0, 1, 2, 3] and split["snapshot_devices"] == [4, 5, 6, 7]
    assert split["sampler_rows_per_device"] == split["sampler_rows"] // 4
    assert split["update_rows_per_device"] == split["update_rows"] // 4
    assert [r["async/staleness"] for r in split["history"]] == [0.0, 1, 1, 1]
    # The reshard onto the sampler's devices after each update, measured.
    assert all(r["time/weight_sync"] >= 0 for r in split["history"])
    assert sum(r["time/weight_sync"] for r in split["history"]) > 0
    for got, want in zip(split["history"], one["history"]):
        # The same samples (per-row keys), from the same stale params ...
        for k in ("reward", "completions/mean_length", "data_position"):
            assert got[k] == want[k], (got["step"], k)
        # ... and the same updates and corrections up to float32 summation order.
        for k in ("loss", "kl", "grad_norm", "sampling/importance_sampling_ratio/mean"):
            assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)
        # A mean |difference| of two log-probs, each within FORWARD_REL_ERR of itself: off by at most
        # 2 * FORWARD_REL_ERR * mean |logp|, and the mean -log p of sampled tokens is about the
        # entropy, <= log(14) for the 14-symbol vocabulary: 2 * 1e-4 * 2.64 = 5.3e-4, taken as 1e-3.
        k = "sampling/sampling_logp_difference/mean"
        assert got[k] == pytest.approx(want[k], abs=1e-3), got["step"]
