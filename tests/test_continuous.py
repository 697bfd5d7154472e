"""The continuous engine samples what the static one samples, row by row, whatever slot a row lands in.

A tiny model; 4 prompts x G=3 = 12 rows through 3 decode slots (so every slot is refilled several
times), two stop ids. Each row's noise is keyed by its global row and its own step, so tokens are
equal; log-probs agree to float32 summation order (a continuous slot attends over the cache blocks
its live neighbours have written, a static row over its batch's: masked slots add exact zeros, but
the sums' trees differ).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_jax import model as M
from grpo_jax.sampling.ops import force_lengths
from grpo_jax.sampling.sampler import Sampler, SamplingConfig

TESTS = Path(__file__).parent
CONFIG = M.ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
STOP_IDS = (0, 1)
PAD = 47
# Log-probs: log_softmax of logits that differ only by the attention's float32 summation order over
# <= P + C = 32 slots: a few ulps of logits of size ~1 per layer, ~1e-6 through two layers and the
# softmax; 1e-5 leaves a factor 10.
LOGP_ATOL = 1e-5


def _sample(engine: str, *, slots: int = 3, refill_every: int = 2, forced=None, sampling=None, threads: int = 1):
    graphdef, params = nnx.split(M.init_model(CONFIG, 3))
    sampler = Sampler(graphdef, CONFIG, eos_id=STOP_IDS, pad_id=PAD, engine=engine, decode_slots=slots,
                      refill_every=refill_every, threads=threads)
    sampling = sampling or SamplingConfig(max_new_tokens=24, temperature=1.0)
    out = sampler(params, PROMPTS, num_samples=3, sampling=sampling, rng=jax.random.key(5), forced_lengths=forced)
    return jax.tree.map(np.asarray, out), sampler


def _assert_same(a, b):
    for field in ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxC", "mask_BxC", "truncated_B"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    np.testing.assert_allclose(a.logprobs_BxC, b.logprobs_BxC, atol=LOGP_ATOL, rtol=0)


@pytest.mark.parametrize("slots, refill_every", [(3, 2), (3, 1), (12, 8), (1, 5)])
def test_continuous_rows_equal_the_static_samplers(slots, refill_every):
    static, _ = _sample("static")
    continuous, sampler = _sample("continuous", slots=slots, refill_every=refill_every)
    _assert_same(static, continuous)
    lengths = static.mask_BxC.sum(axis=1)
    # The workload is not trivial: rows stop at different steps, on either stop id, or run out.
    assert len(set(lengths.tolist())) > 4 and static.truncated_B.any() and not static.truncated_B.all()
    ends = static.tokens_BxC[np.arange(12), lengths - 1][~static.truncated_B]
    assert set(ends.tolist()) <= set(STOP_IDS)
    assert sampler.slots_per_device(12) == min(slots, 12)


def test_blocked_decode_attention_follows_the_live_rows_and_samples_the_same(monkeypatch):
    # Cache blocks of 4 slots (P + C = 8 + 24 = 32 slots): each step attends from block 0 to the
    # furthest live slot's block only; slots whose row finished may then see nothing. The rows
    # must still equal the static engine's over the whole cache.
    from grpo_jax.model import blockwise

    static, _ = _sample("static")
    monkeypatch.setattr(blockwise, "DECODE_BLOCK", 4)
    for engine in ("static", "continuous"):
        blocked, _ = _sample(engine)
        _assert_same(static, blocked)


def test_forced_lengths_stop_each_row_after_its_length_in_both_engines():
    forced = np.array([1, 5, 24, 3, 7, 2, 9, 11, 13, 4, 6, 8])
    static, _ = _sample("static", forced=forced)
    continuous, _ = _sample("continuous", forced=forced)
    _assert_same(static, continuous)
    np.testing.assert_array_equal(continuous.mask_BxC.sum(axis=1), forced)
    assert (continuous.tokens_BxC[np.arange(12), forced - 1] == STOP_IDS[0]).all()
    assert not continuous.truncated_B.any()


def test_force_lengths_masks_stop_ids_before_and_everything_but_eos_at_the_last_step():
    logits = np.zeros((3, 6), np.float32)
    out = np.asarray(force_lengths(logits, np.array([0, 2, 4]), np.array([3, 3, 0]), eos_id=1, stop_ids=(1, 4)))
    inf = -np.inf
    np.testing.assert_array_equal(out[0], [0, inf, 0, 0, inf, 0])    # step 0 of 3: no stop id yet
    np.testing.assert_array_equal(out[1], [inf, 0, inf, inf, inf, inf])  # step 2 of 3: only EOS
    np.testing.assert_array_equal(out[2], [0, 0, 0, 0, 0, 0])        # length 0: untouched


def test_two_threads_and_greedy_and_ignore_eos_equal_the_static_samplers():
    for sampling in (SamplingConfig(max_new_tokens=24, temperature=1.0, greedy=True),
                     SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=5, ignore_eos=True)):
        static, _ = _sample("static", sampling=sampling, threads=2)
        continuous, _ = _sample("continuous", sampling=sampling, threads=2, slots=2)
        _assert_same(static, continuous)


def test_repeated_calls_compile_once_and_bad_settings_are_errors():
    graphdef, params = nnx.split(M.init_model(CONFIG, 3))
    sampler = Sampler(graphdef, CONFIG, eos_id=STOP_IDS, pad_id=PAD, engine="continuous", decode_slots=3)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    for seed in range(3):
        sampler(params, PROMPTS, num_samples=3, sampling=sampling, rng=jax.random.key(seed))
    assert sampler.num_traces == 1
    with pytest.raises(ValueError, match="engine must be 'static' or 'continuous'"):
        Sampler(graphdef, CONFIG, eos_id=0, pad_id=PAD, engine="paged")
    with pytest.raises(ValueError, match="decode_slots must be an int >= 0"):
        Sampler(graphdef, CONFIG, eos_id=0, pad_id=PAD, decode_slots=-1)
    with pytest.raises(ValueError, match="forced_lengths: one length >= 1 per row"):
        sampler(params, PROMPTS, num_samples=3, sampling=sampling, rng=jax.random.key(0), forced_lengths=[3])


def test_on_8_devices_each_device_decodes_its_own_slots_and_rows(tmp_path):
    # tests/continuous_sharding_check.py: meshes (8,1,1), (2,2,2), (1,8,1) against one device.
    out = tmp_path / "continuous.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               "--xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, str(TESTS / "continuous_sharding_check.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    for mesh, entry in result["meshes"].items():
        data, fsdp, _ = (int(v) for v in mesh.split(","))
        d = data * fsdp
        assert entry["tokens_equal"] and entry["mask_equal"], mesh
        assert entry["logp_max_diff"] <= LOGP_ATOL, mesh
        # Per device: its share of the slots' caches and of the rows' outputs, nothing whole.
        assert entry["slot_cache_rows"] == result["slots"] // d, mesh
        assert entry["output_rows"] == result["rows"] // d, mesh


def test_auto_picks_continuous_where_completions_run_long():
    from grpo_jax.config import SamplingSection

    assert SamplingSection(max_new_tokens=512).resolved_engine() == "continuous"   # W3, the GPU/pod configs
    assert SamplingSection(max_new_tokens=64, ignore_eos=True).resolved_engine() == "static"  # W1
    assert SamplingSection(max_new_tokens=512, ignore_eos=True).resolved_engine() == "static"
    assert SamplingSection(max_new_tokens=8).resolved_engine() == "static"          # the CPU demo
    assert SamplingSection(max_new_tokens=8, engine="continuous").resolved_engine() == "continuous"


def test_train_run_with_the_continuous_engine_equals_the_static_one(tmp_path):
    import dataclasses

    from grpo_jax.training import train
    from test_train import SevensTask, tiny_config

    rows = {}
    for engine in ("static", "continuous"):
        cfg = tiny_config(tmp_path / engine)
        cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, max_new_tokens=6, engine=engine,
                                                                    decode_slots=4, refill_every=1),
                                  train=dataclasses.replace(cfg.train, steps=3, checkpoint_every=0))
        rows[engine] = train.run(cfg, task=SevensTask()).history
    for a, b in zip(rows["static"], rows["continuous"]):
        # The same completions (so rewards, lengths, advantages). pi_old is the sampler's log-probs,
        # equal to LOGP_ATOL = 1e-5, so each ratio exp(logp - old) moves by <= 1e-5 relative, and the
        # loss (advantages ~1 times ratios ~1) by as much; Adam's normalised steps carry that into
        # params at lr 1e-2 x 1e-5 relative per step. Over 3 steps: ~1e-5; 1e-4 leaves a factor 10.
        for key in ("reward", "completions/mean_length", "frac_reward_zero_std"):
            assert a[key] == b[key], key
        for key in ("loss", "kl", "entropy"):
            assert abs(a[key] - b[key]) <= 1e-4, key
