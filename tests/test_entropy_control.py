"""grpo_jax.core.entropy_control and its use in the train step: worked examples, exact zero gradients on
the tokens top_entropy_quantile drops, the adaptive controller in the update, and parity with TRL
1.16's GRPOTrainer loss (`parity`: needs torch and trl, skipped without them)."""

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.core import entropy_control as ec
from grpo_jax import model as model_lib
from grpo_jax.training import step as step_lib
from grpo_jax.core.losses import grpo_loss
from tolerances import GRAD_REL_ERR, normwise_violation

# Hand examples of a few float32 operations on O(1) values: 1e-6 absolute (16 u).
ATOL = 1e-6
PAD = 9.0  # garbage on padding, which must never count


def test_entropy_quantile_interpolates_like_torch():
    # Real entropies (0.1, 0.4, 0.2, 0.3) sorted (0.1, 0.2, 0.3, 0.4); q = 0.8: position 0.8 * 3 = 2.4,
    # so 0.3 + 0.4 * (0.4 - 0.3) = 0.34. The padding's 9.0 is not a token.
    h = jnp.array([[0.1, 0.4, PAD], [0.2, 0.3, PAD]])
    mask = jnp.array([[1, 1, 0], [1, 1, 0]])
    assert float(ec.entropy_quantile(h, mask, 0.8)) == pytest.approx(0.34, abs=ATOL)
    assert float(ec.entropy_quantile(h, mask, 0.0)) == pytest.approx(0.1, abs=ATOL)
    assert float(ec.entropy_quantile(h, mask, 1.0)) == pytest.approx(0.4, abs=ATOL)
    assert float(ec.entropy_quantile(h, jnp.zeros_like(mask), 0.5)) == np.inf  # no tokens


def test_high_entropy_mask_keeps_the_top_quantile():
    # top_entropy_quantile 0.2 (the 80/20 paper's): threshold = the 0.8-quantile 0.34, only 0.4 kept;
    # 0.5: threshold = the median 0.25, so 0.4 and 0.3; 1.0 keeps every real token, 0.0 the highest.
    h = jnp.array([[0.1, 0.4, PAD], [0.2, 0.3, PAD]])
    mask = jnp.array([[1, 1, 0], [1, 1, 0]])
    kept = lambda rho: np.asarray(ec.high_entropy_mask(h, mask, rho)).tolist()  # noqa: E731
    assert kept(0.2) == [[False, True, False], [False, False, False]]
    assert kept(0.5) == [[False, True, False], [False, True, False]]
    assert kept(1.0) == [[True, True, False], [True, True, False]]
    assert kept(0.0) == kept(0.2)


def test_masked_tokens_get_exactly_zero_gradient():
    # The dropped tokens' weight is 0 in the clipped term (a constant), so d loss / d logp there is
    # exactly 0.0, not small; the kept tokens' gradient is the ordinary one. The entropy bonus over
    # the same selection gives d bonus / d H = 0 exactly on dropped tokens too.
    key = jax.random.split(jax.random.key(0), 3)
    old = jax.random.uniform(key[0], (4, 5), minval=-3.0, maxval=-0.5)
    logp = old + 0.1 * jax.random.normal(key[1], (4, 5))
    h = jax.random.uniform(key[2], (4, 5), minval=0.0, maxval=3.0)
    mask = jnp.ones((4, 5)).at[3, 3:].set(0.0)
    adv = jnp.array([1.0, -0.5, 0.7, -1.2])
    keep = ec.high_entropy_mask(h, mask, 0.2)
    assert 0 < int(keep.sum()) < int(mask.sum())

    def loss(lp, ent):
        value, _ = grpo_loss(lp, old, None, adv, mask, beta=0.0, aggregation="token",
                             is_weights=keep.astype(jnp.float32))
        return value - 0.1 * ec.entropy_bonus(ent, mask, "token", entropy_mask=keep)

    g_logp, g_h = jax.grad(loss, argnums=(0, 1))(logp, h)
    dropped = np.asarray(~keep)
    assert np.all(np.asarray(g_logp)[dropped] == 0.0) and np.all(np.asarray(g_h)[dropped] == 0.0)
    assert np.all(np.asarray(g_logp)[np.asarray(keep)] != 0.0)
    # Kept tokens: d bonus / d H = 1 / (real tokens) = 1 / 18 each, times -0.1.
    np.testing.assert_allclose(np.asarray(g_h)[np.asarray(keep)], -0.1 / 18, atol=ATOL)


def test_entropy_bonus_is_aggregated_like_the_policy_loss():
    # H = [[1, 3], [4, pad]]: "token" (DAPO, TRL's bonus) (1 + 3 + 4) / 3 = 8/3; "sequence" (the seed's
    # per-answer mean, then over answers) (2 + 4) / 2 = 3; "constant" with max_len 2: 8 / 4 = 2.
    h = jnp.array([[1.0, 3.0], [4.0, PAD]])
    mask = jnp.array([[1, 1], [1, 0]])
    assert float(ec.entropy_bonus(h, mask, "token")) == pytest.approx(8 / 3, abs=ATOL)
    assert float(ec.entropy_bonus(h, mask, "sequence")) == pytest.approx(3.0, abs=ATOL)
    assert float(ec.entropy_bonus(h, mask, "constant")) == pytest.approx(2.0, abs=ATOL)
    # With a selection, dropped tokens add 0 but the normaliser keeps every real token: (3 + 4) / 3.
    sel = jnp.array([[False, True], [True, False]])
    assert float(ec.entropy_bonus(h, mask, "token", entropy_mask=sel)) == pytest.approx(7 / 3, abs=ATOL)


def test_adaptive_rule_worked_example():
    # coef 0.01, delta 0.005, target 0.2: an update at entropy 0.1 (collapsing) raises it to 0.015; at
    # 0.3 lowers it to 0.005; the bounds hold; the coefficient only applies below the target, and
    # never before the first measurement (last_entropy = inf).
    kw = dict(target=0.2, delta=0.005, coef_min=0.0, coef_max=0.012)
    assert float(ec.next_coef(jnp.float32(0.01), jnp.float32(0.1), **kw)) == pytest.approx(0.012)  # capped
    assert float(ec.next_coef(jnp.float32(0.01), jnp.float32(0.3), **kw)) == pytest.approx(0.005)
    assert float(ec.next_coef(jnp.float32(0.003), jnp.float32(0.3), **kw)) == 0.0  # floored
    state = ec.controller(0.01).init(None)
    assert float(ec.applied_coef(state, 0.2)) == 0.0
    assert float(ec.applied_coef(state._replace(last_entropy=jnp.float32(0.15)), 0.2)) == pytest.approx(0.01)


MODEL = model_lib.ModelConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=8)


def _update_batch(num_micro, rows, p=3, c=5):
    rng = np.random.default_rng(0)
    n = num_micro * rows
    mask = np.ones((n, c), np.int32)
    mask[1, 2:] = 0  # answers of different lengths, so "sequence" and "token" differ
    mask[6, 1:] = 0
    old = (-3.0 + 0.1 * rng.standard_normal((n, c))).astype(np.float32)
    arrays = {"tokens": rng.integers(2, MODEL.vocab_size, (n, p + c)).astype(np.int32),
              "attention": np.ones((n, p + c), np.int32), "completion_mask": mask,
              "advantages": rng.standard_normal(n).astype(np.float32), "old_logp": old, "sampler_logp": old,
              "ref_logp": old}
    return step_lib.UpdateBatch(**{k: jnp.asarray(v.reshape((num_micro, rows) + v.shape[1:]))
                                   for k, v in arrays.items()})


def _model():
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(MODEL, 0)))
    params = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
    return graphdef, params


def test_entropy_bonus_accumulates_exactly_over_micro_batches():
    # The bonus uses the loss's normaliser (the whole batch's), so 2 micro-batches of 4 rows move the
    # params as the 8 rows at once (sgd(1): by minus the gradient), under "sequence" aggregation where
    # a mean of per-micro-batch means would not. GRAD_REL_ERR: reassociated float32 sums (tolerances.py).
    graphdef, params = _model()
    grpo = config_lib.GRPOSection(prompts_per_step=4, num_generations=2, aggregation="sequence", entropy_coef=0.5)
    tx = optax.sgd(1.0)
    two = step_lib.make_update_fn(graphdef, tx, dataclasses.replace(grpo, grad_accum_steps=2), 1.0)
    one = step_lib.make_update_fn(graphdef, tx, grpo, 1.0)
    batch = _update_batch(2, 4)
    p2, _, m2 = two(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    p1, _, m1 = one(jax.tree.map(jnp.copy, params), tx.init(params),
                    jax.tree.map(lambda x: x.reshape((1, 8) + x.shape[2:]), batch))
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=GRAD_REL_ERR)
    assert float(m1["loss"]) < float(m1["policy_loss"]) - 0.5  # the bonus (0.5 x ~3 nats) is in the loss
    for a, b, p0 in zip(jax.tree.leaves(p2), jax.tree.leaves(p1), jax.tree.leaves(params)):
        assert normwise_violation(np.asarray(a - p0), np.asarray(b - p0), GRAD_REL_ERR) <= 0


def test_adaptive_controller_rides_in_the_optimizer_state():
    # entropy_target 5 nats (above this model's ~3): the first update applies no bonus (nothing
    # measured yet) and raises the coefficient 0.01 -> 0.015; the second applies 0.015.
    graphdef, params = _model()
    grpo = config_lib.GRPOSection(prompts_per_step=4, num_generations=2, grad_accum_steps=2,
                                  use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=5.0,
                                  entropy_coef_delta=0.005)
    tx = optax.chain(optax.sgd(0.0), ec.controller(grpo.entropy_coef))
    update = step_lib.make_update_fn(graphdef, tx, grpo, 1.0)
    batch = _update_batch(2, 4)
    _, state, m = update(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    assert float(m["loss"]) == float(m["policy_loss"])  # coefficient 0 applied, exactly
    assert float(state[1].entropy_coef) == pytest.approx(0.015) and float(m["entropy_coef"]) == pytest.approx(0.015)
    # The measured entropy is the update's token mean, the logged `entropy`.
    assert float(state[1].last_entropy) == pytest.approx(float(m["entropy"]), rel=1e-5)
    _, state2, m2 = update(jax.tree.map(jnp.copy, params), state, batch)
    bonus = float(m["policy_loss"]) - float(m2["loss"])
    # loss = policy - 0.015 * H_sequence; H_sequence is within 10% of the token-mean entropy here.
    assert bonus == pytest.approx(0.015 * float(m["entropy"]), rel=0.1)
    assert float(state2[1].entropy_coef) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="use_adaptive_entropy"):
        step_lib.make_chunked_update(graphdef, tx, grpo, 1.0, mesh=None, params=params, opt_state=state)


def test_config_names_the_bad_entropy_settings():
    with pytest.raises(config_lib.ConfigError, match="top_entropy_quantile"):
        config_lib.Config(grpo=config_lib.GRPOSection(top_entropy_quantile=1.5))
    with pytest.raises(config_lib.ConfigError, match="grpo.entropy_coef=0.5"):
        config_lib.Config(grpo=config_lib.GRPOSection(use_adaptive_entropy=True, entropy_coef=0.5, entropy_coef_max=0.1))
    with pytest.raises(config_lib.ConfigError, match="bucket_by_length"):
        config_lib.Config(grpo=config_lib.GRPOSection(use_adaptive_entropy=True, bucket_by_length="on"))
    with pytest.raises(config_lib.ConfigError, match="grpo_passk"):
        config_lib.Config(grpo=config_lib.GRPOSection(adv_estimator="grpo_passk", scale_rewards="batch"))
    with pytest.raises(config_lib.ConfigError, match="adv_estimator"):
        config_lib.Config(grpo=config_lib.GRPOSection(adv_estimator="ppo"))


# ------------------------------------------------------------------------------------------------
# Parity with TRL 1.16: GRPOTrainer._compute_loss itself, run on a stand-in trainer that supplies
# the log-probs and entropies (no model), one process, no accumulation.

# float32 sums of 24 terms in another order, plus exp/log rounding: 1e-5 relative on O(1) values.
PARITY_RTOL, PARITY_ATOL = 1e-5, 1e-6


def _trl_loss(torch, trl_trainer, logp, old, ref, adv, mask, h, *, beta, quantile, coef, bias_kl,
              adaptive=False, last_entropy=float("inf"), target=0.2):
    """TRL's loss and its gradients w.r.t. logp and H; and the stand-in (its entropy_coef after)."""
    logp_t = torch.tensor(np.asarray(logp), requires_grad=True)
    h_t = torch.tensor(np.asarray(h), requires_grad=True)
    n, t = logp_t.shape
    accel = types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x, num_processes=1,
                                  reduce=lambda x, reduction="sum": x, sync_gradients=True,
                                  pad_across_processes=lambda x, dim=0, pad_index=0: x)
    fake = types.SimpleNamespace(
        accelerator=accel, beta=beta, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, top_entropy_quantile=quantile,
        importance_sampling_level="token", off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, current_gradient_accumulation_steps=1,
        max_completion_length=t, model=types.SimpleNamespace(training=True), entropy_coef=coef,
        use_adaptive_entropy=adaptive, _entropy_bonus_enabled=coef != 0.0 or adaptive,
        _last_world_entropy=last_entropy, _entropy_window_stats=None,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=bias_kl, steps_per_generation=1,
                                   entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0,
                                   entropy_target=target),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_t, h_t, None),
    )
    fake.get_high_entropy_mask = types.MethodType(trl_trainer.GRPOTrainer.get_high_entropy_mask, fake)
    m = torch.tensor(np.asarray(mask), dtype=torch.long)
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": m,
              "advantages": torch.tensor(np.asarray(adv)), "old_per_token_logps": torch.tensor(np.asarray(old)),
              "ref_per_token_logps": torch.tensor(np.asarray(ref)), "num_items_in_batch": m.sum().float()}
    loss = trl_trainer.GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    g_h = np.zeros(h_t.shape, np.float32) if h_t.grad is None else h_t.grad.numpy()  # H unused: no bonus
    return float(loss.detach()), logp_t.grad.numpy(), g_h, fake


def _case():
    key = jax.random.split(jax.random.key(3), 5)
    old = jax.random.uniform(key[0], (4, 6), minval=-3.0, maxval=-0.5)
    logp = old + 0.3 * jax.random.normal(key[1], (4, 6))  # ratios around 1, some clipped
    ref = old + 0.2 * jax.random.normal(key[2], (4, 6))
    h = jax.random.uniform(key[3], (4, 6), minval=0.05, maxval=3.0)
    mask = jnp.ones((4, 6), jnp.int32).at[1, 4:].set(0).at[3, 2:].set(0)
    adv = jax.random.normal(key[4], (4,))
    return logp, old, ref, h, mask, adv


def _ours(logp, old, ref, h, mask, adv, *, beta, quantile, coef, bias_kl):
    keep = ec.high_entropy_mask(h, mask, quantile) if quantile < 1 else None

    def loss(lp, ent):
        value, _ = grpo_loss(lp, old, ref, adv, mask, beta=beta, aggregation="token", use_bias_correction_kl=bias_kl,
                             is_weights=None if keep is None else keep.astype(jnp.float32))
        return value - coef * ec.entropy_bonus(ent, mask, "token", entropy_mask=keep)

    value, (g_logp, g_h) = jax.value_and_grad(loss, argnums=(0, 1))(logp, h)
    return float(value), np.asarray(g_logp), np.asarray(g_h)


@pytest.mark.parity
@pytest.mark.parametrize("case", [
    dict(beta=0.04, quantile=1.0, coef=0.0, bias_kl=True),   # the unbiased KL, TRL's default
    dict(beta=0.04, quantile=1.0, coef=0.0, bias_kl=False),  # the plain k3
    dict(beta=0.04, quantile=0.3, coef=0.0, bias_kl=True),   # 80/20: clipped term on 30% of tokens
    dict(beta=0.0, quantile=1.0, coef=0.05, bias_kl=True),   # the entropy bonus
])
def test_parity_loss_and_gradients_with_trl(case):
    torch = pytest.importorskip("torch")
    trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    logp, old, ref, h, mask, adv = _case()
    theirs = _trl_loss(torch, trl_trainer, logp, old, ref, adv, mask, h, **case)
    ours = _ours(logp, old, ref, h, mask, adv, **case)
    assert ours[0] == pytest.approx(theirs[0], rel=PARITY_RTOL, abs=PARITY_ATOL)
    real = np.asarray(mask) != 0  # TRL's gradient on padding is 0 too, compare everywhere
    np.testing.assert_allclose(ours[1], theirs[1], rtol=PARITY_RTOL, atol=PARITY_ATOL)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=PARITY_RTOL, atol=PARITY_ATOL)
    assert np.abs(theirs[1][real]).max() > 1e-3  # a real gradient to compare


@pytest.mark.parity
def test_parity_high_entropy_mask_and_adaptive_step_with_trl():
    torch = pytest.importorskip("torch")
    trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    logp, old, ref, h, mask, adv = _case()
    fake = types.SimpleNamespace(accelerator=types.SimpleNamespace(
        gather=lambda x: x, pad_across_processes=lambda x, dim=0, pad_index=0: x))
    for rho in (0.0, 0.2, 0.5, 0.9, 1.0):
        theirs = trl_trainer.GRPOTrainer.get_high_entropy_mask(
            fake, torch.tensor(np.asarray(h)), torch.tensor(np.asarray(mask)), 1 - rho)
        np.testing.assert_array_equal(np.asarray(ec.high_entropy_mask(h, mask, rho)), theirs.numpy(), err_msg=rho)
    # Adaptive: last entropy 0.1 <= target 0.2, so coef 0.02 applies; the step's entropy (~1.5) is
    # above the target, so TRL lowers the coefficient to 0.015, as next_coef does.
    _, _, _, after = _trl_loss(torch, trl_trainer, logp, old, ref, adv, mask, h, beta=0.0, quantile=1.0,
                               coef=0.02, bias_kl=True, adaptive=True, last_entropy=0.1)
    state = ec.EntropyControlState(jnp.float32(0.02), jnp.float32(0.1))
    measured = float((h * mask).sum() / mask.sum())
    ours = ec.next_coef(ec.applied_coef(state, 0.2), jnp.float32(measured), target=0.2, delta=0.005,
                        coef_min=0.0, coef_max=1.0)
    assert float(ours) == pytest.approx(after.entropy_coef) and after._last_world_entropy == pytest.approx(measured)
