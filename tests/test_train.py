"""End-to-end GRPO on a tiny model: a learnable reward rises; resume is exact; signals checkpoint.

The task is deliberately trivial (reward = share of '7' characters in a 4-token answer) so a
2-layer, width-32 model learns it in a few dozen steps on CPU.
"""

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from grpo_jax.training import phases, run_state, step_record, train
from grpo_jax.training import step as step_lib
from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, RewardsSection,
                             SamplingSection, TrainSection)
from grpo_jax.rewards import RewardTimeoutError
from grpo_jax.tasks import RewardSpec
from tolerances import ADAM_EPS_FOR_COMPARISONS, GRAD_REL_ERR, adam_weight_atol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sevens_reward(prompts, completions, **_):
    return [sum(ch == "7" for ch in c) / 4.0 for c in completions]


class SevensTask:
    """Any prompt; the reward counts the 7s in the answer. Eval: the answer is all 7s."""

    name = "sevens"

    def train_example(self, index):
        return {"prompt": f"{index % 100:02d}+{(index * 7) % 100:02d}=", "answer": "7777"}

    def eval_examples(self):
        return [self.train_example(100_000 + i) for i in range(4)]

    def reward_fns(self):
        return [RewardSpec("sevens", sevens_reward, 1.0)]

    def eval_correct(self, completion, example):
        return completion == "7777"

    def extract_answer(self, completion):
        return completion or None


def tiny_config(run_dir, **train_overrides) -> Config:
    return Config(
        model=ModelSection(tokenizer="char:0123456789+=", hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=16),
        sampling=SamplingSection(max_new_tokens=4),
        # The sevens reward counts 7s in 4 tokens, EOS or not, so truncated answers keep their score.
        grpo=GRPOSection(prompts_per_step=4, num_generations=4, beta=0.04, num_minibatches=2),
        optim=OptimSection(learning_rate=1e-2),
        eval=EvalSection(every=0, num_questions=0),
        train=TrainSection(steps=6, seed=3, run_dir=str(run_dir), checkpoint_every=1, samples_every=0,
                           progress=False, **train_overrides),
        rewards=RewardsSection(truncated_reward="as_scored"),
    )


def _params_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_learnable_reward_rises(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=40, checkpoint_every=0),
                              eval=EvalSection(every=20, num_questions=4, num_samples=2, ks=(1, 2)))
    result = train.run(cfg, task=SevensTask())
    rewards = [row["reward"] for row in result.history if "reward" in row]
    assert len(rewards) == 40
    # Random init writes a 7 about 1 time in 14; after 40 steps most answer tokens are 7s.
    assert np.mean(rewards[:5]) < 0.3, rewards[:5]
    assert np.mean(rewards[-5:]) > 0.6, rewards[-5:]
    for key in ("kl", "entropy", "clip_ratio/region_mean", "frac_reward_zero_std", "grad_norm",
                "completions/mean_length", "rewards/sevens/mean", "time/rollout", "time/reward",
                "time/logprobs", "time/update", "tokens_per_second"):
        assert key in result.history[-1], key
    # Shapes are fixed after the first steps, so nothing compiles again (the trainer logs it if it does).
    assert not [row["step"] for row in result.history if "recompiles" in row]
    lines = open(tmp_path / "metrics.jsonl").read().splitlines()
    assert json.loads(lines[-1])["step"] == 40


def test_resume_gives_the_same_run(tmp_path):
    straight = train.run(tiny_config(tmp_path / "straight"), task=SevensTask())
    first = train.run(tiny_config(tmp_path / "split", stop_after_steps=3), task=SevensTask())
    assert first.step == 3
    resumed = train.run(tiny_config(tmp_path / "split"), resume=True, task=SevensTask())
    assert resumed.step == 6
    drop = ("time/", "tokens_per_second", "recompiles")
    def clean(row):
        return {k: v for k, v in row.items() if not k.startswith(drop)}
    straight_rows = {r["step"]: clean(r) for r in straight.history}
    for row in resumed.history:
        assert clean(row) == straight_rows[row["step"]], row["step"]
    _params_close(straight.params, resumed.params)


_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import dataclasses
    import jax
    import numpy as np
    from test_train import SevensTask, tiny_config
    from grpo_jax.training import train
    cfg = tiny_config({run_dir!r})
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps={steps}))
    result = train.run(cfg, resume={resume}, task=SevensTask())
    np.savez({run_dir!r} + "/final_params.npz", *[np.asarray(x) for x in jax.tree.leaves(result.params)])
""")


def _child(run_dir, steps, resume=False):
    code = _CHILD.format(tests=os.path.join(ROOT, "tests"), run_dir=str(run_dir), steps=steps, resume=resume)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _wait_for_checkpoint(run_dir, proc, timeout=240):
    ckpt = os.path.join(run_dir, "checkpoints")
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.isdir(ckpt) and any(name.isdigit() for name in os.listdir(ckpt)):
            return
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode()[-3000:])
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


def _finish(proc):
    out = proc.communicate(timeout=600)[0].decode()
    assert proc.returncode == 0, out[-3000:]


def _last_rows(run_dir):
    """The last metrics row written for each step (a resumed run rewrites the steps it redoes)."""
    rows = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        rows[row["step"]] = {k: v for k, v in row.items() if not k.startswith(("time/", "tokens_per_second"))}
    return rows


def test_kill_9_then_resume_matches_straight_run(tmp_path):
    # Both runs go through the same child-process path, so they compile and compute identically.
    straight = _child(tmp_path / "straight", steps=12)
    _finish(straight)
    proc = _child(tmp_path / "killed", steps=12)
    _wait_for_checkpoint(tmp_path / "killed", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "final_params.npz").exists()  # it really died mid-run
    _finish(_child(tmp_path / "killed", steps=12, resume=True))
    assert _last_rows(tmp_path / "killed") == _last_rows(tmp_path / "straight")
    a = np.load(tmp_path / "straight" / "final_params.npz")
    b = np.load(tmp_path / "killed" / "final_params.npz")
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name])


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    proc = _child(tmp_path, steps=200)
    _wait_for_checkpoint(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM" in out
    steps = [int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert max(steps) == rows[-1]["step"] < 200


def test_corrupt_latest_checkpoint_falls_back(tmp_path, caplog):
    train.run(tiny_config(tmp_path, stop_after_steps=3), task=SevensTask())
    latest = tmp_path / "checkpoints" / "3"
    for root, _, files in os.walk(latest):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    with caplog.at_level(logging.WARNING):
        resumed = train.run(tiny_config(tmp_path), resume=True, task=SevensTask())
    assert any("3" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert resumed.step == 6
    assert resumed.history[0]["step"] == 3  # steps 1-2 were kept; step 3 was redone


@pytest.mark.parametrize("damage", ["xor_one_byte", "invert_4kb", "meta_without_data_position"])
def test_damaged_latest_checkpoint_falls_back_and_the_run_equals_a_straight_one(tmp_path, caplog, damage):
    # The fault probe of issue 30 on a real run: one byte XOR 0x01 in the middle of step 3's largest
    # array file (before fingerprints: resumed from step 3 with wrong params, exit 0), 4 KB there
    # bit-inverted (resumed into non-finite updates), or its meta missing data_position (a bare
    # KeyError). Each must fall back to step 2 with one warning, and the finished run must equal an
    # uninterrupted one: rows and params bit for bit.
    straight = train.run(tiny_config(tmp_path / "straight"), task=SevensTask())
    train.run(tiny_config(tmp_path / "split", stop_after_steps=3), task=SevensTask())
    step_dir = tmp_path / "split" / "checkpoints" / "3"
    if damage == "meta_without_data_position":
        meta = json.loads((step_dir / "meta" / "metadata").read_text())
        del meta["data_position"]
        (step_dir / "meta" / "metadata").write_text(json.dumps(meta))
    else:
        files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
        target = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(target.read_bytes())
        middle = len(data) // 2
        span = [middle] if damage == "xor_one_byte" else range(middle - 2048, middle + 2048)
        for i in span:
            data[i] ^= 0x01 if damage == "xor_one_byte" else 0xFF
        target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        resumed = train.run(tiny_config(tmp_path / "split"), resume=True, task=SevensTask())
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "grpo_jax.io.checkpoint"]
    # (On this small model's compressible arrays, the inverted 4 KB usually breaks zstd's framing and
    # tensorstore's read fails; tests/test_checkpoint.py inverts raw-stored bytes, which only the
    # fingerprint catches.)
    assert warning.startswith(f"checkpoint step 3 ({step_dir}) is corrupt or partial: "), warning
    assert "restored step 2 instead" in warning and "\n" not in warning
    assert resumed.step == 6 and resumed.history[0]["step"] == 3  # step 3 was redone from step 2

    def clean(row):
        return {k: v for k, v in row.items() if not k.startswith(("time/", "tokens_per_second", "recompiles"))}
    straight_rows = {r["step"]: clean(r) for r in straight.history}
    for row in resumed.history:
        assert clean(row) == straight_rows[row["step"]], row["step"]
    _params_close(straight.params, resumed.params)
    # The diagnostics' window travels with the state: step 6's checkpoint holds the rewards of
    # steps 1-2 (from step 2's checkpoint) and 3-6 (this process).
    meta = json.loads((tmp_path / "split" / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert meta["diagnostics"]["history"]["reward"] == [straight_rows[s]["reward"] for s in range(1, 7)]


def test_a_reward_of_1e30_warns_that_every_advantage_is_zero(tmp_path, caplog):
    # Issue 30: before, the run trained on advantages of 0 without a word.
    class HugeSevens(SevensTask):
        def reward_fns(self):
            return [RewardSpec("sevens", lambda prompts, completions, **kw: [1e30 * r for r in sevens_reward(prompts, completions)], 1.0)]

    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2, checkpoint_every=0))
    with caplog.at_level(logging.WARNING, logger="grpo_jax.training.diagnostics"):
        result = train.run(cfg, task=HugeSevens())
    assert result.history[0]["advantages/max"] == result.history[0]["advantages/min"] == 0.0
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "grpo_jax.training.diagnostics"]
    assert warning.startswith("[step 1] advantages_all_zero: every advantage is 0 although")


def test_every_grpo_option_runs_and_reports(tmp_path):
    """DAPO dynamic sampling, mu=2 with recomputed pi_old, accumulation, token aggregation, clip-higher,
    batch-std advantages, truncation masking, bf16 reference with resync, HF export: all in one run."""
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(
        cfg,
        grpo=dataclasses.replace(cfg.grpo, dynamic_sampling=True, max_resample_rounds=2, num_iterations=2, grad_accum_steps=2, num_minibatches=2,
                                 aggregation="token", eps_high=0.28, scale_rewards="batch",
                                 mask_truncated_completions=True, ref_dtype="bfloat16", ref_resync_every=2,
                                 kl="k2", ratio="sequence"),
        train=dataclasses.replace(cfg.train, steps=3, export_hf=True),
        off_policy=dataclasses.replace(cfg.off_policy, old_logprobs="recompute"))
    result = train.run(cfg, task=SevensTask())
    last = result.history[-1]
    assert 1 <= last["dynamic_sampling/rounds"] <= 3
    # What was sampled before the filter, beside the kept batch: the filter only drops
    # zero-variance groups, so the kept batch never has more of them.
    for row in result.history:
        assert 0 <= row["dynamic_sampling/sampled_frac_reward_zero_std"] <= 1
        assert row["frac_reward_zero_std"] <= row["dynamic_sampling/sampled_frac_reward_zero_std"] + 1e-9
        assert np.isfinite(row["dynamic_sampling/sampled_reward"])
    for key in ("loss", "kl", "grad_norm", "clip_ratio/high_mean", "advantages/std"):
        assert np.isfinite(last[key]), key
    from grpo_jax.io import hf
    exported = hf.load_model(str(tmp_path / "hf"))
    assert exported.config.num_layers == 2


def test_select_groups_keeps_informative_groups_first():
    rewards = np.array([1, 1, 0, 1, 2, 2, 0, 0, 3, 4, 5, 5], np.float32)
    # group_size 2: groups (1,1) (0,1) (2,2) (0,0) (3,4) (5,5); informative: (0,1) and (3,4).
    chosen, informative = phases.select_groups(rewards, 2, 3, dynamic=True)
    assert informative == 2
    assert chosen == [1, 4, 0]  # the informative two, then the first zero-variance one
    chosen, _ = phases.select_groups(rewards[:6], 2, 3, dynamic=False)
    assert chosen == [0, 1, 2]


def test_truncated_completions_earn_at_most_zero():
    # Seed, defence 3: a truncated answer has no final answer. A box followed by runaway text (1.0)
    # earns 0; a penalty (-0.5) still applies; finished answers and "no reward" (NaN) are untouched.
    rewards = np.array([1.0, -0.5, 1.0, np.nan], np.float32)
    truncated = np.array([True, True, False, True])
    got = phases.truncation_rule(rewards, truncated, "at_most_zero")
    np.testing.assert_array_equal(got, [0.0, -0.5, 1.0, np.nan])
    np.testing.assert_array_equal(phases.truncation_rule(rewards, truncated, "as_scored"), rewards)


def test_bad_mesh_for_the_batch_is_a_config_error(tmp_path):
    from grpo_jax.config import ConfigError, MeshSection
    cfg = dataclasses.replace(tiny_config(tmp_path), mesh=MeshSection(data=3))
    with pytest.raises((ConfigError, ValueError), match="mesh"):
        train.run(cfg, task=SevensTask())


def test_prompt_groups_share_only_whole_in_order_groups():
    g = GRPOSection(prompts_per_step=4, num_generations=4)
    assert step_lib.prompt_groups(g, rows_per_micro=16, row_multiple=1) == (4, 4)
    assert step_lib.prompt_groups(g, rows_per_micro=8, row_multiple=2) == (4, 4)  # 2 prompts, 1 per device
    assert step_lib.prompt_groups(g, rows_per_micro=8, row_multiple=4) == (1, 4)  # 2 prompts over 4 devices
    assert step_lib.prompt_groups(g, rows_per_micro=16, row_multiple=8) == (1, 1)  # 4 prompts over 8
    # Half a group per micro-batch: the log-prob passes' chunks of whole groups would hold twice the
    # update's rows (at 8k tokens and 1 row per micro-batch, G times: that pass set the peak).
    assert step_lib.prompt_groups(g, rows_per_micro=2, row_multiple=1) == (1, 1)
    shuffled = dataclasses.replace(g, num_minibatches=2)
    assert step_lib.prompt_groups(shuffled, rows_per_micro=8, row_multiple=1) == (1, 4)
    off = dataclasses.replace(g, share_prompt_prefix=False)
    assert step_lib.prompt_groups(off, rows_per_micro=16, row_multiple=1) == (1, 1)


def test_shared_prompt_run_matches_per_row_prompt_run(tmp_path):
    # The same 3 steps with each prompt run once per group (reference and update) and with every
    # row carrying its own copy: the same sums in another order, so the same run up to float32
    # summation order (tests/tolerances.py gives the bounds; Adam eps 1e-4 as it requires).
    results = {}
    for share in (True, False):
        cfg = tiny_config(tmp_path / str(share))
        cfg = dataclasses.replace(
            cfg, grpo=dataclasses.replace(cfg.grpo, num_minibatches=1, share_prompt_prefix=share),
            optim=dataclasses.replace(cfg.optim, eps=ADAM_EPS_FOR_COMPARISONS),
            train=dataclasses.replace(cfg.train, steps=3, checkpoint_every=0))
        results[share] = train.run(cfg, task=SevensTask())
    for a, b in zip(results[True].history, results[False].history):
        assert a["reward"] == b["reward"]  # the same samples: the policies differ by rounding only
        # Non-negative terms (no cancellation): relative error n * u ~ 1e3 * 6e-8, taken as 1e-4.
        for key in ("kl", "entropy"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=GRAD_REL_ERR, err_msg="grad_norm")
        # The loss cancels to ~0 (advantages sum to zero per group): absolute error n * u * max|term|
        # with |rho * A| <= ~2, i.e. 1e3 * 6e-8 * 2 ~ 1.2e-4.
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=0, atol=2e-4, err_msg="loss")
    atol = adam_weight_atol(learning_rate=1e-2, updates=3)
    for x, y in zip(jax.tree.leaves(results[True].params), jax.tree.leaves(results[False].params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def test_clip_and_ratio_metrics_cover_every_update_of_the_step(tmp_path):
    # Two minibatches per step with pi_old from the sampler: the first update has rho = 1 exactly,
    # so a step reported from its first update alone always reads clip 0 and ratio 1. Over both
    # updates the second one's ratios show.
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4, checkpoint_every=0))
    history = train.run(cfg, task=SevensTask()).history
    assert max(row["ratio/max"] for row in history) > 1.0
    assert min(row["ratio/min"] for row in history) < 1.0
    assert max(row["clip_ratio/region_mean"] for row in history) > 0.0
    for row in history:
        assert row["grad_norm/max"] >= row["grad_norm"] > 0


def test_the_loop_dispatches_the_next_rollout_before_reading_the_last_update(tmp_path, monkeypatch):
    # nanodo's order: step N's sampler call is dispatched before step N-1's metrics are read, so
    # the devices go from one update straight to the next rollout.
    events = []
    dispatch, read = train.phases.dispatch_round, step_record.read_row

    def spy_dispatch(ctx, params, step, data_position, round_index):
        events.append(("dispatch", step))
        return dispatch(ctx, params, step, data_position, round_index)

    def spy_read(ctx, record, source):
        events.append(("read", record.step))
        return read(ctx, record, source)

    monkeypatch.setattr(train.phases, "dispatch_round", spy_dispatch)
    monkeypatch.setattr(step_record, "read_row", spy_read)
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=3, checkpoint_every=0))
    result = train.run(cfg, task=SevensTask())
    assert events == [("dispatch", 1), ("dispatch", 2), ("read", 1), ("dispatch", 3), ("read", 2), ("read", 3)]
    assert [row["step"] for row in result.history] == [1, 2, 3]
    for row in result.history:  # each phase timed from when the devices ran it, not dispatch
        # Never negative; 0 only where a watcher thread saw a short phase end late (step_record).
        assert all(row[k] >= 0 for k in ("time/rollout", "time/update")), row
        assert row["time/step"] > 0 and row["time/step"] >= row["time/update"], row


def test_non_finite_updates_are_skipped_then_stop_the_run_with_finite_checkpoints(tmp_path, monkeypatch):
    # A batch whose advantages are inf (what an inf reward used to give): every update of those
    # steps is skipped and counted, the params stay finite, and train.max_nonfinite_steps in a row
    # stop the run with a message; every checkpoint on disk is finite.
    compute_advantages = phases.compute_advantages

    def poisoned(ctx, batch):
        advantages, mask = compute_advantages(ctx, batch)
        return np.full_like(advantages, np.inf), mask

    monkeypatch.setattr(train.phases, "compute_advantages", poisoned)
    cfg = tiny_config(tmp_path)
    with pytest.raises(FloatingPointError, match=r"3 steps in a row .*train.max_nonfinite_steps=3"):
        train.run(cfg, task=SevensTask())
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["skipped_updates"] for r in rows] == [2.0, 2.0, 2.0]  # both minibatch updates, each step
    steps = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert steps and steps[-1] == 3
    from grpo_jax.io.checkpoint import CheckpointManager
    ctx, fresh = train.run_context.build(cfg, task=SevensTask())
    ckpt = CheckpointManager(tmp_path / "checkpoints")
    restored = run_state.initial_state(ctx, fresh, ckpt, resume=True)
    ckpt.close()
    assert restored.step == 3
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(restored.params))


def test_no_checkpoint_is_written_from_non_finite_params(tmp_path):
    cfg = tiny_config(tmp_path)
    ctx, fresh = train.run_context.build(cfg, task=SevensTask())
    bad = dataclasses.replace(fresh, step=1, params=jax.tree.map(lambda x: x * np.nan, fresh.params))
    from grpo_jax.io.checkpoint import CheckpointManager
    ckpt = CheckpointManager(tmp_path / "checkpoints")
    with pytest.raises(run_state.NonFiniteStateError, match="step 1: params or optimizer state are not finite"):
        run_state.save(ctx, ckpt, bad)
    ckpt.close()
    assert not (tmp_path / "checkpoints" / "1").exists()


_CLI_CONFIG = textwrap.dedent("""
    import dataclasses, sys
    sys.path.insert(0, {tests!r})
    from test_train import tiny_config
    from grpo_jax.config import SFTSection, TaskSection

    def get_config():
        cfg = tiny_config({run_dir!r})
        return dataclasses.replace(
            cfg, task=TaskSection(name="arithmetic", options={{"digits": 1}}),
            sft=SFTSection(steps={sft_steps}, batch_size=16, eval_every=1000, eval_size=16),
            train=dataclasses.replace(cfg.train, steps=100000, checkpoint_every=0, progress=True))
""")


def _cli(tmp_path, sft_steps):
    config = tmp_path / "cfg.py"
    config.write_text(_CLI_CONFIG.format(tests=os.path.join(ROOT, "tests"), run_dir=str(tmp_path / "run"),
                                         sft_steps=sft_steps))
    return subprocess.Popen([sys.executable, "-m", "grpo_jax", "train", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _wait_for(proc, text, timeout=240):
    seen = b""
    t0 = time.time()
    os.set_blocking(proc.stdout.fileno(), False)
    while time.time() - t0 < timeout:
        chunk = proc.stdout.read() or b""
        seen += chunk
        if text.encode() in seen:
            return seen
        if proc.poll() is not None:
            raise AssertionError(seen.decode()[-3000:])
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared")


def test_sigterm_during_the_sft_warm_up_stops_gracefully_with_the_stopped_status(tmp_path):
    # Before: SIGTERM during the warm-up killed the run at once (or printed a 37-frame traceback),
    # and a graceful stop exited 0 like a finished run.
    proc = _cli(tmp_path, sft_steps=100000)
    _wait_for(proc, "sft step 0")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 75, out[-3000:]
    assert "stopped by SIGTERM during the SFT warm-up" in out
    assert "Traceback" not in out


def test_sigterm_during_grpo_exits_with_the_stopped_status_after_a_checkpoint(tmp_path):
    proc = _cli(tmp_path, sft_steps=0)
    _wait_for(proc, " 2/100000 ")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 75, out[-3000:]
    assert "continue with --resume" in out and "Traceback" not in out
    assert [n for n in os.listdir(tmp_path / "run" / "checkpoints") if n.isdigit()]


class HangingSevens(SevensTask):
    """The sevens task whose reward function hangs from step 3 on (it used to hang the trainer, and
    make it ignore SIGTERM); `on_hang` runs when it starts hanging."""

    def __init__(self, on_hang=lambda: None):
        self.on_hang = on_hang

    def reward_fns(self):
        def sevens_or_hang(prompts, completions, *, step, **fields):
            if step >= 3:
                self.on_hang()
                time.sleep(30)
            return sevens_reward(prompts, completions)

        return [RewardSpec("sevens_or_hang", sevens_or_hang, 1.0)]


def test_a_hanging_reward_function_times_out_naming_it_and_the_last_step_is_saved(tmp_path):
    cfg = dataclasses.replace(tiny_config(tmp_path), rewards=RewardsSection(truncated_reward="as_scored", timeout_s=1.0))
    t0 = time.time()
    with pytest.raises(RewardTimeoutError, match="sevens_or_hang"):
        train.run(cfg, task=HangingSevens())
    assert time.time() - t0 < 25  # one timeout, not the 30 s hang
    assert max(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == 2


def test_sigterm_while_a_reward_function_hangs_still_stops_the_run(tmp_path):
    import threading

    def send_sigterm():
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()

    cfg = dataclasses.replace(tiny_config(tmp_path), rewards=RewardsSection(truncated_reward="as_scored", timeout_s=0.0))  # no limit
    t0 = time.time()
    result = train.run(cfg, task=HangingSevens(on_hang=send_sigterm))
    assert time.time() - t0 < 25
    assert (result.stopped_by, result.step) == ("SIGTERM", 2)
    assert max(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == 2


class InfOnceSevens(SevensTask):
    """Returns inf for one completion at step 3: before, every param became NaN, the run exited 0
    and keep_checkpoints rotated the good checkpoints out."""

    def reward_fns(self):
        def sevens_inf_once(prompts, completions, *, step, **fields):
            values = sevens_reward(prompts, completions)
            if step == 3:
                values[0] = float("inf")
            return values

        return [RewardSpec("sevens_inf_once", sevens_inf_once, 1.0)]


def test_an_inf_reward_is_an_error_naming_the_function_and_the_good_checkpoints_stay(tmp_path):
    cfg = tiny_config(tmp_path, keep_checkpoints=2)
    with pytest.raises(ValueError, match=r"reward function 'sevens_inf_once' returned inf at index 0"):
        train.run(cfg, task=InfOnceSevens())
    steps = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert steps == [1, 2]
