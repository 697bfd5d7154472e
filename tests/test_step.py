"""The update's metrics add up like the quantities they measure: token means weighted by tokens,
min/max over the pieces that hold tokens, over micro-batches inside an update and over a step's
updates."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax.training import step as step_lib


def test_step_metrics_over_updates_worked_example():
    # mu = 2 with pi_old from the sampler: the first update sees rho = 1 exactly (nothing clipped),
    # the second clips 30% of its 50 tokens. Over the step's 150 tokens: 15 / 150 = 0.1, not the
    # first update's 0 (what was reported before) nor the plain mean 0.15.
    first = {"clip_ratio/region_mean": 0.0, "ratio/min": 1.0, "ratio/max": 1.0, "entropy": 2.0,
             "loss": 0.1, "grad_norm": 0.5, "num_tokens": 100}
    second = {"clip_ratio/region_mean": 0.3, "ratio/min": 0.7, "ratio/max": 1.4, "entropy": 3.5,
              "loss": 0.3, "grad_norm": 1.5, "num_tokens": 50}
    got = step_lib.combine_update_metrics([first, second])
    assert got["clip_ratio/region_mean"] == pytest.approx(0.1)
    assert got["entropy"] == pytest.approx((2.0 * 100 + 3.5 * 50) / 150)  # 2.5
    assert (got["ratio/min"], got["ratio/max"]) == (0.7, 1.4)
    assert got["grad_norm"] == pytest.approx(1.0) and got["grad_norm/max"] == 1.5
    assert got["loss"] == pytest.approx(0.2)  # each update's loss is its minibatch's mean
    assert "num_tokens" not in got


def test_an_update_with_no_tokens_does_not_dilute_token_means():
    # A minibatch whose answers were all truncated and masked: weight 0, and its placeholder
    # ratios (1.0) do not count in min/max.
    real = {"entropy": 3.9, "ratio/min": 0.8, "ratio/max": 1.3, "loss": 0.2, "grad_norm": 1.0, "num_tokens": 40}
    empty = {"entropy": 0.0, "ratio/min": 1.0, "ratio/max": 1.0, "loss": 0.0, "grad_norm": 0.0, "num_tokens": 0}
    got = step_lib.combine_update_metrics([real, empty])
    assert got["entropy"] == pytest.approx(3.9)
    assert (got["ratio/min"], got["ratio/max"]) == (0.8, 1.3)


MODEL = model_lib.ModelConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=8)


def _batch(num_micro, rows, p, c, mask_last_micro):
    rng = np.random.default_rng(0)
    n = num_micro * rows
    tokens = rng.integers(2, MODEL.vocab_size, (n, p + c)).astype(np.int32)
    attention = np.ones((n, p + c), np.int32)
    mask = np.ones((n, c), np.int32)
    if mask_last_micro:
        mask[-rows:] = 0  # e.g. every answer truncated, mask_truncated_completions
    old = (-3.0 + 0.1 * rng.standard_normal((n, c))).astype(np.float32)
    arrays = {"tokens": tokens, "attention": attention, "completion_mask": mask,
              "advantages": rng.standard_normal(n).astype(np.float32), "old_logp": old, "sampler_logp": old,
              "ref_logp": old}
    return step_lib.UpdateBatch(**{k: jnp.asarray(v.reshape((num_micro, rows) + v.shape[1:])) for k, v in arrays.items()})


def test_micro_batch_with_all_tokens_masked_counts_nothing_in_the_update_metrics():
    # Seen on MATH-500 with mask_truncated_completions: a plain mean over micro-batches read the
    # entropy as half its value (3.89 -> 1.93). Weighted by tokens, the update with a fully masked
    # second micro-batch reports the first micro-batch's figures exactly.
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(MODEL, 0)))
    params = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
    grpo = config_lib.GRPOSection(prompts_per_step=2, num_generations=2, beta=0.04, aggregation="token",
                                  grad_accum_steps=2)
    tx = optax.sgd(0.0)
    two = step_lib.make_update_fn(graphdef, tx, grpo, 1.0)
    one = step_lib.make_update_fn(graphdef, tx, dataclasses.replace(grpo, grad_accum_steps=1), 1.0)
    batch = _batch(2, 4, 3, 5, mask_last_micro=True)
    _, _, m2 = two(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    _, _, m1 = one(jax.tree.map(jnp.copy, params), tx.init(params), jax.tree.map(lambda x: x[:1], batch))
    assert float(m2["num_tokens"]) == float(m1["num_tokens"]) == 20
    for name in ("entropy", "kl", "ratio/min", "ratio/max", "clip_ratio/region_mean", "loss", "grad_norm"):
        # The same sums over the same 20 tokens (the masked rows add exact zeros): float32
        # reassociation only, ~20 terms x u ~ 1e-6 relative.
        assert float(m2[name]) == pytest.approx(float(m1[name]), rel=1e-5, abs=1e-7), name
    assert float(m1["entropy"]) > 1.0  # a real value, so the comparison can fail


def test_an_update_with_a_non_finite_loss_is_skipped_and_counted():
    # One inf advantage (e.g. from an inf reward) makes the loss inf and every gradient NaN; the
    # update leaves params and Adam state exactly as they were and says so.
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(MODEL, 0)))
    params = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
    grpo = config_lib.GRPOSection(prompts_per_step=2, num_generations=2, beta=0.04)
    tx = optax.adam(1e-2)
    update = step_lib.make_update_fn(graphdef, tx, grpo, 1.0)
    batch = _batch(1, 4, 3, 5, mask_last_micro=False)
    bad = dataclasses.replace(batch, advantages=batch.advantages.at[0, 0].set(jnp.inf))
    before = jax.tree.map(np.asarray, params)
    opt_state = tx.init(params)
    new_params, new_opt, m = update(jax.tree.map(jnp.copy, params), opt_state, bad)
    assert float(m["skipped_updates"]) == 1.0 and not np.isfinite(float(m["loss"]))
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new_opt))
    _, _, ok = update(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    assert float(ok["skipped_updates"]) == 0.0
    assert step_lib.combine_update_metrics([{**{k: float(v) for k, v in ok.items()}},
                                            {**{k: float(v) for k, v in m.items()}}])["skipped_updates"] == 1.0


def test_logprob_pass_in_row_chunks_equals_one_pass():
    # The pass over a step's rows in micro-batch-sized chunks (lax.map) gives every row's log-probs
    # as one pass does, with and without prompts shared by groups of 4 (each row is computed from
    # its own tokens either way: only the matmuls' batch sizes differ, FORWARD_REL_ERR).
    from tolerances import FORWARD_REL_ERR

    cfg = model_lib.ModelConfig(vocab_size=14, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                num_kv_heads=1, head_dim=16, remat=True)  # (remat: nnx inside the loop)
    graphdef, params = nnx.split(model_lib.init_model(cfg, 0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 14, (32, 12)), jnp.int32)
    tokens = tokens.at[:, :7].set(jnp.repeat(tokens[::4, :7], 4, axis=0))  # groups of 4 share a prompt
    attention = jnp.ones_like(tokens)
    for group in (1, 4):
        one = step_lib.make_logprob_fn(graphdef, 1.0, group_size=group)(params, tokens, attention, num_targets=5)
        chunked = step_lib.make_logprob_fn(graphdef, 1.0, group_size=group, row_chunks=4)(
            params, tokens, attention, num_targets=5)
        np.testing.assert_allclose(chunked, one, rtol=FORWARD_REL_ERR, atol=1e-6)
    # As many chunks as the update's micro-batches per step, whole groups on every device:
    # 8 prompts x 4 = 32 rows, 2 minibatches x 2 micro-batches -> 4 chunks of 8 rows; with groups of
    # 4 over 4 devices a chunk needs 16 rows, so 2.
    g = config_lib.GRPOSection(prompts_per_step=8, num_generations=4, num_minibatches=2, grad_accum_steps=2)
    assert step_lib.logprob_row_chunks(g, row_multiple=1, group_size=1) == 4
    assert step_lib.logprob_row_chunks(g, row_multiple=4, group_size=4) == 2
    assert step_lib.logprob_row_chunks(dataclasses.replace(g, num_minibatches=1, grad_accum_steps=1), 1, 1) == 1
