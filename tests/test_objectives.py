"""The policy objectives of grpo_jax.core.objectives: a worked example each (input, number, reason), the
gradient at ratio 1 (the plain policy gradient, also with eps = 0), and exact accumulation.

Tolerances: the worked examples are a handful of float32 operations on O(1) numbers, each rounding
by u = 6e-8 relative, compared with hand arithmetic rounded to 5-6 digits: abs=1e-5. Gradients of
two formulas of the same few-term sums agree to n * u ~ 1e-6 relative (rtol=1e-5, atol=1e-7 for
exact zeros); see tests/tolerances.py for the argument.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_losses import ragged_batch

from grpo_jax.core import losses
from grpo_jax.core.objectives import (
    LOSS_TYPES,
    clip_cov_terms,
    cispo_terms,
    dppo_terms,
    gmpo_terms,
    gpg_terms,
    kl_cov_terms,
    policy_loss,
    resolve_loss_type,
    sapo_terms,
    vespo_terms,
)

ABS = 1e-5  # hand-rounded worked examples (module docstring)


def single_tokens(p_old, p_new):
    """logp, old_logp, mask of one-token answers with the given probabilities (one row each)."""
    old = jnp.log(jnp.asarray(p_old, jnp.float32))[:, None]
    new = jnp.log(jnp.asarray(p_new, jnp.float32))[:, None]
    return new, old, jnp.ones_like(new)


def loss_and_grad(loss_type, logp, old, adv, mask, **kw):
    f = lambda lp: policy_loss(lp, old, None, adv, mask, loss_type=loss_type, beta=0.0, **kw)  # noqa: E731
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return float(loss), metrics, np.asarray(grad)


def test_cispo_keeps_the_gradient_ppo_clips():
    # Two tokens of one answer, A = +1, p_old = 0.5 -> p = (0.9, 0.25): r = (1.8, 0.5). The band
    # [0.8, 1.28] clips the weights to (1.28, 0.8): j = (1.28 log 0.9, 0.8 log 0.25) =
    # (-0.134861, -1.109035); token mean: loss = 0.621948. Each token's gradient is -w A / 2 =
    # (-0.64, -0.4): the first keeps one where PPO's clip (r = 1.8 > 1.28, A > 0) gives none.
    logp = jnp.log(jnp.array([[0.9, 0.25]]))
    old = jnp.log(jnp.array([[0.5, 0.5]]))
    mask = jnp.ones((1, 2))
    j, m = cispo_terms(logp, old, jnp.ones((1, 2)), mask, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(j[0], [-0.134861, -1.109035], atol=ABS)
    assert float(m["cispo_clip_ratio"]) == 0.5  # the first token: r > 1.28 with A > 0
    loss, _, grad = loss_and_grad("cispo", logp, old, jnp.array([1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert loss == pytest.approx(0.621948, abs=ABS)
    np.testing.assert_allclose(grad[0], [-0.64, -0.4], atol=ABS)
    _, _, ppo = loss_and_grad("dapo", logp, old, jnp.array([1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert ppo[0, 0] == 0.0


def test_sapo_gate_is_smooth_where_ppo_is_flat():
    # A = +1, r = 1.5, tau_pos = 1: f = 4 sigmoid(0.5) = 2.489837, and d j / d log pi = f'(r) r =
    # 4 sigmoid(0.5)(1 - sigmoid(0.5)) * 1.5 = 1.410022 (PPO: clipped, 0). A = -1, r = 0.5,
    # tau_neg = 1.05: f = (4 / 1.05) sigmoid(-0.525) = 1.415938, j = -1.415938.
    logp, old, mask = single_tokens([0.4, 0.4], [0.6, 0.2])
    adv = jnp.array([[1.0], [-1.0]])
    j, _ = sapo_terms(logp, old, adv, mask, temperature_pos=1.0, temperature_neg=1.05)
    np.testing.assert_allclose(j[:, 0], [2.489837, -1.415938], atol=ABS)
    grad = jax.grad(lambda lp: sapo_terms(lp, old, adv, mask)[0].sum())(logp)
    assert float(grad[0, 0]) == pytest.approx(1.410022, abs=ABS)


def test_vespo_gamma_weight_of_the_answer_ratio():
    # One answer, log r = (0.2, 0.1): w = e^0.3 = 1.349859; A >= 0 so (k, lambda) = (2, 3):
    # log phi = 3 + 2 * 0.3 - 3 * 1.349859 = -0.449576, phi = 0.637898 (an answer 35% more likely
    # than when sampled loses a third of its weight). p = (0.6, 0.5), token mean:
    # loss = -phi (log 0.6 + log 0.5) / 2 = 0.384006, gradient -phi / 2 on each token.
    logp = jnp.log(jnp.array([[0.6, 0.5]]))
    old = logp - jnp.array([[0.2, 0.1]])
    mask = jnp.ones((1, 2))
    _, m = vespo_terms(logp, old, jnp.ones((1, 2)), mask)
    assert float(m["vespo/phi_seq_mean"]) == pytest.approx(0.637898, abs=ABS)
    loss, _, grad = loss_and_grad("vespo", logp, old, jnp.array([1.0]), mask)
    assert loss == pytest.approx(0.384006, abs=ABS)
    np.testing.assert_allclose(grad[0], [-0.318949, -0.318949], atol=ABS)
    _, m1 = vespo_terms(logp, logp, jnp.ones((1, 2)), mask)  # on-policy: phi(1) = e^(3 - 3) = 1
    assert float(m1["vespo/phi_seq_mean"]) == 1.0


def test_gmpo_geometric_mean_of_log_clipped_ratios():
    # One answer, log r = (0.5, -0.1), eps = 0.4 (log space). A = +1: the first is clipped to 0.4,
    # so the answer's ratio is exp((0.4 - 0.1) / 2) = e^0.15 = 1.161834 and only the second token
    # has a gradient, e^0.15 / 2 = 0.580917. A = -1: clipping only lowers the ratio side, so
    # nothing is clipped and the value is -e^0.2 = -1.221403.
    logp = jnp.log(jnp.array([[0.5, 0.4]]))
    old = logp - jnp.array([[0.5, -0.1]])
    mask = jnp.ones((1, 2))
    j, m = gmpo_terms(logp, old, jnp.ones((1, 2)), mask, eps_low=0.4)
    np.testing.assert_allclose(j[0], [1.161834, 1.161834], atol=ABS)
    assert float(m["actor/pg_clipfrac"]) == 0.5
    loss, _, grad = loss_and_grad("geo_mean", logp, old, jnp.array([1.0]), mask, eps_low=0.4)
    assert loss == pytest.approx(-1.161834, abs=ABS)
    np.testing.assert_allclose(grad[0], [0.0, -0.580917], atol=ABS)
    j_neg, _ = gmpo_terms(logp, old, -jnp.ones((1, 2)), mask, eps_low=0.4)
    assert float(j_neg[0, 0]) == pytest.approx(-1.221403, abs=ABS)


def test_dppo_tv_and_kl_trust_regions():
    # p_old = 0.5. TV, eps 0.2: A > 0 and p = 0.8 moved 0.3 > 0.2 up: no gradient; p = 0.6 is
    # inside: j = r log p = 1.2 log 0.6 = -0.612991 with gradient r A = 1.2; A < 0 and p = 0.8
    # moved against A, always kept: j = -1.6 log 0.8 = 0.357030.
    logp, old, mask = single_tokens([0.5, 0.5, 0.5], [0.8, 0.6, 0.8])
    adv = jnp.array([[1.0], [1.0], [-1.0]])
    j, m = dppo_terms(logp, old, adv, mask, divergence="tv", eps_low=0.2)
    np.testing.assert_allclose(j[:, 0], [0.0, -0.612991, 0.357030], atol=ABS)
    assert float(m["actor/pg_clipfrac"]) == pytest.approx(1 / 3)
    grad = jax.grad(lambda lp: dppo_terms(lp, old, adv, mask, divergence="tv")[0].sum())(logp)
    np.testing.assert_allclose(grad[:, 0], [0.0, 1.2, -1.6], atol=ABS)
    # Binary KL from p_old = 0.5: to 0.8 it is 0.5 log(0.5/0.8) + 0.5 log(0.5/0.2) = 0.223144 > 0.2
    # (out, A > 0 pushing up); to 0.7 it is 0.087177 (in); to 0.2 with A < 0 pushing down, 0.223144 (out).
    logp, old, mask = single_tokens([0.5, 0.5, 0.5], [0.8, 0.7, 0.2])
    adv = jnp.array([[1.0], [1.0], [-1.0]])
    j, _ = dppo_terms(logp, old, adv, mask, divergence="kl", eps_low=0.2)
    assert [bool(x != 0) for x in np.asarray(j[:, 0])] == [False, True, False]


def test_gpg_is_advantage_times_log_prob():
    # A = 0.5, p = 0.25: j = 0.5 log 0.25 = -0.693147, gradient A, whatever pi_old says.
    logp, old, mask = single_tokens([0.9], [0.25])
    j, _ = gpg_terms(logp, old, jnp.array([[0.5]]), mask)
    assert float(j[0, 0]) == pytest.approx(-0.693147, abs=ABS)
    assert float(jax.grad(lambda lp: gpg_terms(lp, old, jnp.array([[0.5]]), mask)[0].sum())(logp)[0, 0]) == 0.5


def _cov_batch():
    # Four one-token answers, A = (+1, +1, -1, -1) (mean 0), log pi = (-0.5, -4.5, -1.0, -4.5)
    # (mean -2.625): Cov = A (log pi + 2.625) = (2.125, -1.875, -1.625, 1.875).
    logp = jnp.array([[-0.5], [-4.5], [-1.0], [-4.5]])
    return logp, jnp.array([[1.0], [1.0], [-1.0], [-1.0]]), jnp.ones((4, 1))


def test_clip_cov_detaches_drawn_high_covariance_tokens():
    # On-policy. Candidates (1 < Cov < 5): answers 0 and 3. Ratio 0.5 -> floor(0.5 * 4) = 2 draws:
    # both detached, whatever the key; ratio 0.25 -> one of the two, chosen by the key.
    logp, adv, mask = _cov_batch()

    def grad(ratio, key):
        f = lambda lp: clip_cov_terms(lp, jax.lax.stop_gradient(lp), adv, mask, clip_cov_ratio=ratio,  # noqa: E731
                                      key=key)[0].sum()
        return np.asarray(jax.grad(f)(logp)[:, 0])

    np.testing.assert_array_equal(grad(0.5, jax.random.key(0)), [0.0, 1.0, -1.0, 0.0])
    drawn = {tuple(grad(0.25, jax.random.key(s)) == 0.0) for s in range(20)}
    assert drawn == {(True, False, False, False), (False, False, False, True)}


def test_kl_cov_penalises_the_top_covariance_token():
    # Ratio 0.25 -> 1 token, the largest Cov (answer 0). Its log r = 0.1: j = e^0.1 - 0.1 * 0.1 =
    # 1.095171 (1.105171 without the penalty), gradient r A - coef = 1.005171.
    logp, adv, mask = _cov_batch()
    old = logp - jnp.array([[0.1], [0.0], [0.0], [0.0]])
    j, m = kl_cov_terms(logp, old, adv, mask, kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    np.testing.assert_allclose(j[:, 0], [1.095171, 1.0, -1.0, -1.0], atol=ABS)
    assert float(m["actor/ppo_kl"]) == pytest.approx(0.025, abs=ABS)
    g = jax.grad(lambda lp: kl_cov_terms(lp, old, adv, mask, kl_cov_ratio=0.25)[0].sum())(logp)
    assert float(g[0, 0]) == pytest.approx(1.005171, abs=ABS)


def test_gspo_clips_the_answer_and_luspo_weights_it_by_length():
    # GSPO: log r = (0.3, 0.1), A = +1: s = e^0.2 = 1.2214 > 1.2 clips the whole answer: no
    # gradient on either token (token-level, the second token's r = e^0.1 would keep one).
    logp = jnp.log(jnp.array([[0.5, 0.5], [0.5, 0.5]]))
    old = logp - jnp.array([[0.3, 0.1], [0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    adv = jnp.array([1.0, -1.0])
    loss, _, grad = loss_and_grad("gspo", logp, old, adv, mask)
    np.testing.assert_array_equal(grad[0], [0.0, 0.0])
    assert loss == pytest.approx(-(1.2 - 1.0) / 2, abs=ABS)  # answers' (1.2, -1) averaged
    # LUSPO on the same batch: each answer's term times its length, over N = 2 answers:
    # -(2 * 1.2 + 1 * (-1)) / 2 = -0.7 (GSPO's -0.1: the long answer counts twice as much).
    loss, _, _ = loss_and_grad("luspo", logp, old, adv, mask)
    assert loss == pytest.approx(-0.7, abs=ABS)


# ----------------------------------------------------------------------------------------------
# At ratio 1 (pi_old read in the loss) every family's gradient is the plain policy gradient.


def _tiny_policy():
    """A softmax policy over 7 tokens at 4 x 5 positions, answers of lengths 5, 3, 1, 4."""
    k_w, k_x, k_tok = jax.random.split(jax.random.key(1), 3)
    w = jax.random.normal(k_w, (3, 7))
    x = jax.random.normal(k_x, (4, 5, 3))
    tokens = jax.random.randint(k_tok, (4, 5), 0, 7)
    mask = (jnp.arange(5)[None, :] < jnp.array([5, 3, 1, 4])[:, None]).astype(jnp.float32)

    def logp_of(w):
        logits = jnp.einsum("ntd,dv->ntv", x, w)
        return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]

    return w, logp_of, mask


@pytest.mark.parametrize("eps", [(0.2, None), (0.0, 0.28), (0.2, 0.0), (0.0, 0.0)])
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_gradient_at_ratio_one_is_the_plain_policy_gradient(loss_type, eps):
    # grad(-J) at theta = theta_old must be -grad agg(A log pi) under the family's aggregation.
    # Before the fix, eps_low = 0 or eps_high = 0 gave 0.75 of it for the clipped families
    # (jnp.clip and jnp.minimum split the gradient of a tie in halves). Clip-Cov is the one
    # family that detaches tokens on purpose: there, exactly its drawn tokens differ, and are 0.
    w, logp_of, mask = _tiny_policy()
    adv = jnp.array([0.87, -0.87, 0.5, -0.5])
    eps_low, eps_high = eps
    aggregation, _ = resolve_loss_type(loss_type)
    options = {"clip_cov_ratio": 0.1} if loss_type == "clip_cov" else {}

    def loss(w):
        lp = logp_of(w)
        return policy_loss(lp, jax.lax.stop_gradient(lp), None, adv, mask, loss_type=loss_type, beta=0.0,
                           eps_low=eps_low, eps_high=eps_high, **options)[0]

    def plain(w):
        return -losses.aggregate(adv[:, None] * logp_of(w), mask, aggregation)

    got, want = jax.grad(loss)(w), jax.grad(plain)(w)
    if loss_type != "clip_cov":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        return
    # Clip-Cov: the loss on the kept tokens, by the same aggregation, is the plain one.
    lp = logp_of(w)
    terms = clip_cov_terms(lp, lp, jnp.broadcast_to(adv[:, None], lp.shape), mask, eps_low=eps_low,
                           eps_high=eps_high, **options)[0]
    kept = (terms != 0) | (mask == 0)
    assert 0 < int((~kept).sum()) <= 2  # floor(0.1 * 13) = 1 drawn token (2 if its value were 0)
    want_kept = jax.grad(lambda w: -losses.aggregate(adv[:, None] * logp_of(w) * kept, mask, aggregation))(w)
    np.testing.assert_allclose(got, want_kept, rtol=1e-5, atol=1e-7)


def test_clipped_term_at_a_bound_has_the_whole_gradient():
    # The bug itself, without a model: eps_low = 0, rho = 1, A = -1 (and eps_high = 0, A = +1):
    # d clipped_surrogate / d rho = A, not 0.75 A.
    for a, lo, hi in ((-1.0, 0.0, 0.2), (1.0, 0.2, 0.0)):
        g = jax.grad(lambda r: losses.clipped_surrogate(r, a, lo, hi))(jnp.float32(1.0))
        assert float(g) == a


# ----------------------------------------------------------------------------------------------
# Exact accumulation: micro-batches over the whole batch's normaliser add up to the full batch.


@pytest.mark.parametrize("loss_type", sorted(set(LOSS_TYPES) - {"clip_cov", "kl_cov"}))
def test_two_micro_batches_equal_one_batch(loss_type):
    # Answers of 1..7 tokens sorted short-first, so a mean of micro-batch means would be off;
    # pi_old 0.3 away and a KL term, so clips, gates and trust regions are all exercised.
    # Clip-Cov and KL-Cov draw their tokens from each call's rows (as verl's micro-batches do),
    # so they are exact only given the same draw: not tested here.
    logp, old, ref, adv, mask = ragged_batch()
    aggregation, _ = resolve_loss_type(loss_type)
    kw = dict(loss_type=loss_type, beta=0.04, max_len=8, eps_high=0.28)

    def full(lp):
        return policy_loss(lp, old, ref, adv, mask, **kw)[0]

    def accumulated(lp):
        rows = np.array_split(np.arange(12), 2)
        norm = sum(losses.loss_normalizer(mask[r], aggregation, max_len=8) for r in rows)
        return sum(policy_loss(lp[r], old[r], ref[r], adv[r], mask[r], normalizer=norm, **kw)[0] for r in rows)

    # A few dozen float32 terms summed in another order: ~1e2 * 6e-8 relative.
    np.testing.assert_allclose(float(accumulated(logp)), float(full(logp)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.grad(accumulated)(logp), jax.grad(full)(logp), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(jax.grad(full)(logp)).sum()) > 0.1  # a real gradient, so the check can fail


def test_conflicting_settings_name_both():
    with pytest.raises(ValueError, match="loss_type='dapo' aggregates as 'token', but aggregation='sequence'"):
        resolve_loss_type("dapo", "sequence")
    with pytest.raises(ValueError, match="loss_type='gspo' needs ratio='sequence', but ratio='token'"):
        resolve_loss_type("gspo", None, "token")
    assert resolve_loss_type("gpg", "constant") == ("constant", "token")  # verl's take any aggregation
    assert resolve_loss_type("dapo", None, "sequence") == ("token", "sequence")  # TRL's GSPO-token variant


# ----------------------------------------------------------------------------------------------
# The trainer setting: grpo.loss_type, and what the update logs under it.


def test_config_loss_type_resolves_and_conflicts_name_both_fields():
    from grpo_jax.config import Config, ConfigError, GRPOSection, apply_overrides

    assert GRPOSection().resolved_loss() == ("grpo", "sequence", "token")  # today's loss, unchanged
    assert GRPOSection(aggregation="token").resolved_loss() == ("grpo", "token", "token")
    assert GRPOSection(loss_type="dapo").resolved_loss() == ("dapo", "token", "token")
    assert GRPOSection(loss_type="gspo").resolved_loss() == ("gspo", "sequence", "sequence")
    assert GRPOSection(loss_type="luspo").resolved_aggregation() == "sequence_sum"
    with pytest.raises(ConfigError, match=r"grpo.loss_type='dapo' conflicts with grpo.aggregation"):
        apply_overrides(Config(), ["grpo.loss_type=dapo", "grpo.aggregation=sequence"])
    with pytest.raises(ConfigError, match=r"grpo.loss_type='luspo' conflicts with grpo.ratio"):
        apply_overrides(Config(), ["grpo.loss_type=luspo", "grpo.ratio=token"])
    with pytest.raises(ConfigError, match=r"grpo.loss_type='bogus' is not allowed; choose one of"):
        apply_overrides(Config(), ["grpo.loss_type=bogus"])
    with pytest.raises(ConfigError, match=r"grpo.clip_cov_lb=5.0 must be below grpo.clip_cov_ub=5.0"):
        apply_overrides(Config(), ["grpo.clip_cov_lb=5.0"])
    with pytest.raises(ConfigError, match=r"grpo.sapo_temperature_neg=0.0 must be > 0"):
        apply_overrides(Config(), ["grpo.sapo_temperature_neg=0"])
    cfg = apply_overrides(Config(), ["grpo.loss_type=cispo", "grpo.eps_high=4.0"])
    assert cfg.grpo.resolved_loss() == ("cispo", "token", "token")


def _update_metrics(grpo):
    import optax

    from grpo_jax.config import OffPolicySection
    from flax import nnx

    from grpo_jax import model as model_lib
    from grpo_jax.training import step as step_lib

    cfg = model_lib.ModelConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=8)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(cfg, 0)))
    params = jax.jit(lambda: nnx.split(model_lib.init_model(cfg, 0))[1])()
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 24, (1, 4, 8)).astype(np.int32)
    mask = np.ones((1, 4, 5), np.int32)
    mask[0, 1, 3:] = 0
    old = (-3.0 + 0.1 * rng.standard_normal((1, 4, 5))).astype(np.float32)
    batch = step_lib.UpdateBatch(tokens=jnp.asarray(tokens), attention=jnp.ones((1, 4, 8), jnp.int32),
                                 completion_mask=jnp.asarray(mask), advantages=jnp.asarray([[1.0, -1.0, 0.5, -0.5]]),
                                 old_logp=jnp.asarray(old), sampler_logp=jnp.asarray(old), ref_logp=jnp.asarray(old))
    tx = optax.sgd(1e-2)
    # The sampler correction off: sampler_logp equals old_logp here, and its metrics are not the point.
    no_correction = OffPolicySection(vllm_importance_sampling_correction=False)
    update = step_lib.make_update_fn(graphdef, tx, grpo, 1.0, off_policy=no_correction)
    _, _, m = update(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    return {k: float(v) for k, v in m.items()}


def test_update_runs_each_family_and_logs_its_metrics():
    # One update per family on a tiny model; the family's own metric names appear, PPO's clip
    # fractions only for the clipped families, and loss_type="grpo" is exactly the default.
    from grpo_jax.config import GRPOSection

    base = dict(prompts_per_step=2, num_generations=2, beta=0.04)
    default = _update_metrics(GRPOSection(**base))
    assert _update_metrics(GRPOSection(loss_type="grpo", **base)) == default
    expected = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean", "clip_cov": "actor/pg_clipfrac",
                "dapo": "clip_ratio/region_mean"}
    for loss_type, name in expected.items():
        m = _update_metrics(GRPOSection(loss_type=loss_type, **base))
        assert name in m and np.isfinite(m["loss"]) and m["grad_norm"] > 0, loss_type
        assert ("clip_ratio/region_mean" in m) == (loss_type == "dapo"), loss_type
        assert m["loss"] != default["loss"], loss_type  # another objective, another number


def test_objectives_import_no_trainer_model_or_verifier():
    # "One import away" for research code: the module pulls in jax and the pure math of grpo_jax.core
    # only (the loss and the siblings it re-exports: the sampler correction, entropy, token stats).
    import subprocess
    import sys

    code = ("import sys, grpo_jax.core.objectives; "
            "print(sorted(m for m in sys.modules if m.startswith('grpo_jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == ("['grpo_jax.core', 'grpo_jax.core.entropy', 'grpo_jax.core.losses', "
                           "'grpo_jax.core.objectives', 'grpo_jax.core.sampler_correction', "
                           "'grpo_jax.core.token_stats']")
