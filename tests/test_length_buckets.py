"""Length buckets (grpo_jax/training/length_buckets.py): worked examples of the plan, W3's executed padding,
and the bucketed update phase equal to the unbucketed one on 1 and 8 devices.

Exactness runs go through tests/length_buckets_check.py (the trainer's own phases and programs):
in a child process on one device, and on 8 fake CPU devices (XLA_FLAGS must be set before jax
starts). Bounds come from tests/tolerances.py; each comparison says which argument it relies on.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tolerances import FORWARD_REL_ERR, adam_weight_atol, metric_tolerance

from grpo_jax.cli import bench
from grpo_jax.training import length_buckets
from grpo_jax import config as config_lib

TESTS = Path(__file__).parent
FAST_COMPILE = "--xla_backend_optimization_level=0"
LEARNING_RATE = 1e-3  # tests/length_buckets_check.py's AdamW runs
length_ladder = length_buckets.length_ladder


# ----------------------------------------------------------------------------------------------
# The plan, by hand.

def test_ladder_rungs_are_fixed_fractions_of_the_budget():
    # ceil(C * f), f = 1, 3/4, 1/2, ... 1/32: a rung at most 1.5x the one below it, 11 at most.
    assert length_ladder(512) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert length_ladder(8) == (1, 2, 3, 4, 6, 8)
    assert length_ladder(1) == (1,)
    assert max(len(length_ladder(c)) for c in range(1, 5000, 37)) <= 11


def test_needed_length_is_the_last_column_the_loss_reads():
    mask = np.array([[1, 1, 0, 0],   # 2 tokens
                     [1, 0, 1, 0],   # a hole: the loss still reads column 2, so 3
                     [0, 0, 0, 0],   # nothing (a truncated answer, masked): 0
                     [1, 1, 1, 1]])  # the full budget
    np.testing.assert_array_equal(length_buckets.needed_lengths(mask), [2, 3, 0, 4])


def test_chunk_rows_divide_the_minibatch_and_split_over_the_devices():
    assert length_buckets.chunk_rows(128, 128, 1) == 8    # W3 on one device
    assert length_buckets.chunk_rows(128, 128, 8) == 8    # one row per device
    assert length_buckets.chunk_rows(128, 128, 16) == 16  # the devices need more than 8
    assert length_buckets.chunk_rows(36, 36, 1) == 6      # 8 does not divide 36 rows; 6 does
    assert length_buckets.chunk_rows(32, 4, 1) == 4       # never above the user's micro-batch (memory)
    with pytest.raises(ValueError, match="devices"):
        length_buckets.chunk_rows(12, 12, 8)


def test_plan_sorts_rows_by_length_and_cuts_each_chunk_to_a_rung():
    lengths = np.array([5, 1, 8, 3, 2, 7, 0, 4])
    chunks = length_buckets.plan(np.arange(8), lengths, 2, length_ladder(8))  # rungs 1 2 3 4 6 8
    # Sorted: rows 6 (0), 1 (1) | 4 (2), 3 (3) | 7 (4), 0 (5) | 5 (7), 2 (8).
    assert [c.rows.tolist() for c in chunks] == [[6, 1], [4, 3], [7, 0], [5, 2]]
    assert [c.length for c in chunks] == [1, 3, 6, 8]
    # 30 real tokens in 2 x (1 + 3 + 6 + 8) = 36 executed slots.
    assert length_buckets.padding_fraction(chunks, lengths) == pytest.approx(1 - 30 / 36)
    # A minibatch's rows (random order, as TRL's) keep their indices into the batch.
    sub = length_buckets.plan(np.array([2, 6, 5, 1]), lengths, 2, length_ladder(8))
    assert [c.rows.tolist() for c in sub] == [[6, 1], [5, 2]] and [c.length for c in sub] == [1, 8]


def _planner(mode, rows, update_group, logprob_group, num_micro=1):
    """A Bucketing with no programs: only its plan is asked for."""
    return length_buckets.Bucketing(mode=mode, rows=rows, update=None, logprob_fn=None,
                                    update_group=update_group, logprob_group=logprob_group, num_micro=num_micro)


@pytest.mark.parametrize("seed", range(10))
def test_w3_executes_at_most_a_quarter_padding(seed):
    # W3: 128 rows, lengths min(512, ceil(exp(log 96 + 0.9 z))), real tokens ~27% of 128 x 512.
    # The trainer's own plan (what phases.update and phases.logprobs run), on one device with the
    # groups of 8 the unbucketed passes would share: "auto" buckets both passes, and of the
    # completion slots the chunks execute at most 25% are padding.
    lengths = bench.w3_completion_lengths(128, seed=seed)
    planner = _planner("auto", length_buckets.chunk_rows(128, 128, 1), update_group=8, logprob_group=8)
    update = planner.update_chunks(lengths, np.arange(128), prompt_len=32, max_len=512)
    logprob = planner.logprob_chunks(lengths, prompt_len=32, max_len=512)
    for chunks in (update, logprob):
        assert chunks is not None
        assert sorted(np.concatenate([c.rows for c in chunks]).tolist()) == list(range(128))
        assert {(len(c.rows), c.length) for c in chunks} <= {(8, rung) for rung in length_ladder(512)}
        assert length_buckets.padding_fraction(chunks, lengths) <= 0.25
    # Against the unbucketed update's 1 - real / (128 x 512):
    assert 1 - lengths.sum() / (128 * 512) > 0.65


def test_auto_keeps_fixed_length_batches_unbucketed():
    # W1: 32 rows of exactly 64 tokens, prompts shared by groups of 8. Chunks would remove no
    # padding and run the prompt 32 times instead of 4: auto keeps the unbucketed passes; "on" not.
    lengths = np.full(32, 64)
    auto = _planner("auto", 8, update_group=8, logprob_group=8)
    assert auto.update_chunks(lengths, np.arange(32), prompt_len=32, max_len=64) is None
    assert auto.logprob_chunks(lengths, prompt_len=32, max_len=64) is None
    forced = _planner("on", 8, update_group=8, logprob_group=8)
    assert [c.length for c in forced.update_chunks(lengths, np.arange(32), prompt_len=32, max_len=64)] == [64] * 4


def test_bucket_by_length_is_a_validated_config_field():
    assert config_lib.GRPOSection().bucket_by_length == "auto"
    assert "grpo.bucket_by_length = 'auto'  (one of 'auto', 'on', 'off')" in config_lib.describe_fields()
    with pytest.raises(config_lib.ConfigError, match="grpo.bucket_by_length"):
        config_lib.Config(grpo=config_lib.GRPOSection(bucket_by_length="sometimes"))


# ----------------------------------------------------------------------------------------------
# Exactness: tests/length_buckets_check.py in a child process.

def _run(tmp_path, devices: int) -> dict:
    out = tmp_path / f"buckets{devices}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    proc = subprocess.run([sys.executable, str(TESTS / "length_buckets_check.py"), str(out)], env=env, check=False,
                          capture_output=True, text=True, timeout=900, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _assert_same_update(entry: dict, where: str):
    # The gradient: the same per-token terms summed over other groupings of rows (chunks instead of
    # one batch, every row's own prompt copy instead of one per group): GRAD_REL_ERR norm-wise.
    assert entry["grad_violation"] <= 0, (where, entry["grad_relative_difference"])
    # Metrics: tolerances.metric_tolerance's per-metric arguments; token counts are integers, exact.
    (on,), (off,) = entry["metrics_on"], entry["metrics_off"]
    assert on.keys() == off.keys()
    for name in on:
        assert on[name] == pytest.approx(off[name], **metric_tolerance(name)), (where, name)
    assert on["num_tokens"] == off["num_tokens"] == 139
    # Log-probs where the loss reads them: the same forward on a cut, unshared-prompt layout,
    # FORWARD_REL_ERR relative; beyond each row's length the bucketed pass wrote nothing (0).
    for name in ("ref_logp", "old_logp"):
        np.testing.assert_allclose(entry[f"{name}_on"], entry[f"{name}_off"], rtol=FORWARD_REL_ERR, atol=1e-7,
                                   err_msg=f"{where}, {name}")
    assert entry["logp_beyond_lengths_on"] == 0.0
    # The comparison can fail: the same chunks, each over its own normaliser, are far off (token:
    # the short chunks' tokens over-weighted; sequence/constant: 4 chunks summed, ~4x the gradient).
    assert entry["mean_of_means_relative_difference"] > 0.1, where


def _assert_same_minibatch_updates(entries: dict):
    for aggregation, entry in entries.items():
        # 4 AdamW updates whose gradients agree to GRAD_REL_ERR: tolerances.adam_weight_atol.
        assert entry["params_max_abs_difference"] <= adam_weight_atol(LEARNING_RATE, 4), aggregation
        assert entry["params_moved"] > 100 * adam_weight_atol(LEARNING_RATE, 4), aggregation  # it can fail
        assert entry["bucketed"] == [8, "on"]
        on, off = entry["metrics_on"], entry["metrics_off"]
        assert [m["num_tokens"] for m in on] == [m["num_tokens"] for m in off]
        assert sum(m["num_tokens"] for m in on) == 2 * 139  # every row once per pass
        # The first update starts from the same params: metric_tolerance's arguments apply.
        for name in on[0]:
            assert on[0][name] == pytest.approx(off[0][name], **metric_tolerance(name)), (aggregation, name)


def test_bucketed_update_phase_equals_the_unbucketed_one_on_one_device(tmp_path):
    result = _run(tmp_path, 1)
    for aggregation in ("token", "sequence", "constant"):
        entry = result["meshes"]["1"][aggregation]
        _assert_same_update(entry, aggregation)
        # 32 rows in 4 chunks of 8 cut to 2, 3, 6 and 16 of the 16 columns; the unbucketed side
        # ran each prompt once per group of 4.
        assert entry["chunk_shapes"] == [[8, 2], [8, 3], [8, 6], [8, 16]]
        assert entry["groups_off"] == [4, 4]
    _assert_same_minibatch_updates(result["meshes"]["1"]["minibatches"])


@pytest.mark.slow  # ~80 s of compiles on 2 cores; the one-device version runs by default
def test_bucketed_update_phase_equals_the_unbucketed_one_on_8_devices(tmp_path):
    result = _run(tmp_path, 8)
    assert result["device_count"] == 8
    for mesh_name in ("data=8", "data=2 fsdp=4"):
        entries = result["meshes"][mesh_name]
        for aggregation in ("token", "sequence", "constant"):
            _assert_same_update(entries[aggregation], f"{mesh_name}, {aggregation}")
            assert entries[aggregation]["groups_off"] == [4, 4]  # 8 prompts, one per device
        _assert_same_minibatch_updates(entries["minibatches"])
        # The split, not only the math: each device's compiled chunk programs take 1 of the
        # chunk's 8 rows, cut to the chunk's length (the last chunk: 16 columns, prompt 5).
        assert entries["per_device"] == {"chunk": [8, 16], "update_tokens": [[1, 21]], "update_advantages": [[1]],
                                         "logprob_tokens": [[1, 21]]}


# ----------------------------------------------------------------------------------------------
# The trainer end to end.

def test_training_with_length_buckets_matches_training_without(tmp_path):
    # The tiny SevensTask run of tests/test_train.py with 8 prompts x 4 (answers of 1-4 tokens: the
    # random policy samples EOS anywhere), recomputed pi_old, mu = 2 and 2 minibatches: "on" runs
    # every log-prob pass and update through length chunks, "off" none. The same samples (the same
    # keys), and updates equal up to float32 summation order (tolerances.metric_tolerance).
    from test_train import SevensTask, tiny_config

    from grpo_jax.training import train

    def run(mode):
        cfg = tiny_config(tmp_path / mode)
        grpo = dataclasses.replace(cfg.grpo, prompts_per_step=8, bucket_by_length=mode, num_iterations=2,
                                   aggregation="token")
        return train.run(dataclasses.replace(cfg, grpo=grpo, train=dataclasses.replace(cfg.train, steps=2),
                                             off_policy=dataclasses.replace(cfg.off_policy, old_logprobs="recompute")),
                         task=SevensTask()).history

    on, off = run("on"), run("off")
    assert [r["step"] for r in on] == [1, 2]
    for got, want in zip(on, off):
        assert got["completions/mean_length"] == want["completions/mean_length"]
        assert got["completions/min_length"] < got["completions/max_length"]  # lengths differ: chunks do
        for k in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean", "ratio/max"):
            assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)
