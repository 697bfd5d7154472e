"""The GRPO loss against seeds/000's worked examples, closed-form gradients, a NumPy reference."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core.losses import (
    aggregate,
    clipped_surrogate,
    grpo_loss,
    importance_ratio,
    kl_penalty,
    loss_normalizer,
    per_token_entropy,
    sampler_correction,
    token_entropy,
)

A_GOOD, A_BAD = 0.87, -0.87  # the seed's rounded advantages of o_1 and o_2


def test_clipping_example_rho_1_8():
    # "Clipping": probability 0.5 -> 0.9, rho = 1.8, A = +0.87: min(1.57, 1.2 * 0.87) = 1.04.
    assert float(clipped_surrogate(jnp.float32(1.8), A_GOOD)) == pytest.approx(1.044, abs=1e-3)


def worked_example_terms(p_old, p_new, a):
    """Per-token terms and d(-loss)/d(logp) of single-token answers (one row per table line)."""
    logp = jnp.log(jnp.asarray(p_new, jnp.float32))[:, None]
    old = jnp.log(jnp.asarray(p_old, jnp.float32))[:, None]
    adv = jnp.full((len(p_new),), a, jnp.float32)
    terms = clipped_surrogate(importance_ratio(logp, old, jnp.ones_like(logp)), adv[:, None])
    loss_fn = lambda lp: grpo_loss(lp, old, None, adv, jnp.ones_like(lp), beta=0.0)[0]  # noqa: E731
    return np.asarray(terms[:, 0]), np.asarray(jax.jit(jax.grad(loss_fn))(logp)[:, 0])


def test_worked_example_correct_answer():
    # o_1, A = +0.87: tokens "x^3" (0.60 -> 0.66), "=" (0.95 -> 0.96), "1/3" (0.40 -> 0.56) give
    # terms 0.957, 0.879, 1.044; the last is clipped (rho 1.40 > 1.2), so no gradient there.
    terms, grad = worked_example_terms([0.60, 0.95, 0.40], [0.66, 0.96, 0.56], A_GOOD)
    np.testing.assert_allclose(terms, [0.957, 0.879, 1.044], atol=1e-3)
    assert grad[0] != 0 and grad[1] != 0 and grad[2] == 0.0


def test_worked_example_wrong_answer():
    # o_2, A = -0.87: "=" (0.90 -> 0.93) gives -0.899 and still pushes down; "1/2" (0.30 -> 0.21),
    # rho 0.70 < 0.8, gives min(-0.609, -0.696) = -0.696 and is clipped: no gradient.
    terms, grad = worked_example_terms([0.90, 0.30], [0.93, 0.21], A_BAD)
    np.testing.assert_allclose(terms, [-0.899, -0.696], atol=1e-3)
    assert grad[0] != 0 and grad[1] == 0.0


def test_four_clipping_cases():
    # The seed's table (eps = 0.2), one single-token answer per row: the gradient is zero exactly
    # where the seed says "No (clipped)".
    cases = [  # (A, rho, has gradient)
        (+1.0, 1.1, True),  # good token, rho <= 1.2: keep raising
        (+1.0, 1.3, False),  # good token, rho > 1.2: raised enough, clipped
        (-1.0, 0.9, True),  # bad token, rho >= 0.8: keep lowering
        (-1.0, 0.7, False),  # bad token, rho < 0.8: lowered enough, clipped
        (+1.0, 0.7, True),  # good token that became less likely: pulled back, never clipped
        (-1.0, 1.3, True),  # bad token that became more likely: pushed down, never clipped
    ]
    adv = jnp.array([a for a, _, _ in cases])
    old = jnp.full((len(cases), 1), jnp.log(0.5))
    logp = old + jnp.log(jnp.array([[rho] for _, rho, _ in cases]))
    mask = jnp.ones_like(logp)
    grad = jax.jit(jax.grad(lambda lp: grpo_loss(lp, old, None, adv, mask, beta=0.0)[0]))(logp)
    assert [bool(g != 0.0) for g in np.asarray(grad[:, 0])] == [has for _, _, has in cases]


def test_eps_high_clips_higher():
    # DAPO's clip-higher: with eps_high = 0.28, rho = 1.25 on a good token is no longer clipped.
    assert float(clipped_surrogate(jnp.float32(1.25), 1.0, 0.2, 0.28)) == pytest.approx(1.25)
    assert float(clipped_surrogate(jnp.float32(1.25), 1.0, 0.2)) == pytest.approx(1.2)


def test_gradient_at_rho_one_is_the_plain_policy_gradient():
    # "On the first step, rho = 1 but the gradient isn't zero": with theta = theta_old and beta = 0,
    # grad(-J) = -(1/G) sum_i A_i grad (1/|o_i|) sum_t log pi(o_{i,t}). Checked on the parameters of
    # a tiny softmax policy with padded answers of different lengths.
    k_w, k_x, k_tok = jax.random.split(jax.random.key(1), 3)
    num, seq, dim, vocab = 4, 5, 3, 7
    w = jax.random.normal(k_w, (dim, vocab))
    x = jax.random.normal(k_x, (num, seq, dim))
    tokens = jax.random.randint(k_tok, (num, seq), 0, vocab)
    mask = jnp.arange(seq)[None, :] < jnp.array([5, 3, 1, 4])[:, None]
    adv = jnp.array([0.87, -0.87, 0.87, -0.87])

    def logp_of(w):
        logits = jnp.einsum("ntd,dv->ntv", x, w)
        return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]

    old = jax.lax.stop_gradient(logp_of(w))
    grad_loss = jax.jit(
        jax.grad(lambda w: grpo_loss(logp_of(w), old, None, adv, mask, beta=0.0)[0])
    )(w)

    def pg_surrogate(w):
        mean_logp = (logp_of(w) * mask).sum(1) / mask.sum(1)
        return -(adv * mean_logp).mean()

    np.testing.assert_allclose(grad_loss, jax.jit(jax.grad(pg_surrogate))(w), rtol=1e-5, atol=1e-7)


def test_kl_estimators_nonnegative_and_zero_only_when_equal():
    # The seed's estimator pi_ref/pi - log(pi_ref/pi) - 1 is >= 0 and 0 only when they agree.
    k1, k2 = jax.random.split(jax.random.key(2))
    logp = jax.random.normal(k1, (1000,)) * 3
    ref = jax.random.normal(k2, (1000,)) * 3
    for kind in ("k2", "k3"):
        assert np.all(np.asarray(kl_penalty(logp, ref, kind)) > 0)
        assert np.all(np.asarray(kl_penalty(logp, logp, kind)) == 0.0)
    # Tiny differences stay positive in float32 (expm1, not exp - 1).
    assert float(kl_penalty(jnp.float32(-1.0), jnp.float32(-1.0 + 1e-5), "k3")) > 0
    # k3 by hand: pi = 0.5, pi_ref = 0.25: 0.5 - log 0.5 - 1 = 0.1931.
    assert float(kl_penalty(jnp.log(0.5), jnp.log(0.25))) == pytest.approx(0.19315, abs=1e-5)
    # k1 is log(pi / pi_ref), negative when pi_ref > pi.
    assert float(kl_penalty(jnp.log(0.25), jnp.log(0.5), "k1")) == pytest.approx(-np.log(2))


# --- The NumPy reference: the seed's "In Code" block, extended to every option. -----------------


def numpy_grpo_loss(
    logp, old, ref, adv, mask, eps_low, eps_high, beta, aggregation, max_len, ratio
):
    logp, old, ref = (np.asarray(a, np.float64) for a in (logp, old, ref))
    m = np.asarray(mask, np.float64)
    adv = np.asarray(adv, np.float64)
    if adv.ndim == 1:
        adv = adv[:, None] * np.ones_like(logp)
    num, seq = logp.shape
    rho = np.ones_like(logp)
    for i in range(num):
        if ratio == "token":
            rho[i] = np.where(m[i] > 0, np.exp(logp[i] - old[i]), 1.0)
        else:
            n_i = max(m[i].sum(), 1.0)
            rho[i] = np.exp(((logp[i] - old[i]) * m[i]).sum() / n_i)
    surr = np.minimum(rho * adv, np.clip(rho, 1 - eps_low, 1 + eps_high) * adv)
    log_r = ref - logp
    kl = np.exp(log_r) - log_r - 1
    obj = (surr - beta * kl) * m
    if aggregation == "sequence":
        j = np.mean([obj[i].sum() / max(m[i].sum(), 1.0) for i in range(num)])
    elif aggregation == "token":
        j = obj.sum() / m.sum()
    else:
        j = obj.sum() / (num * (max_len or seq))
    real = m > 0
    metrics = {
        "kl": (kl * m).sum() / m.sum(),
        "clip_ratio/low_mean": ((rho < 1 - eps_low) & (adv < 0) & real).sum() / m.sum(),
        "clip_ratio/high_mean": ((rho > 1 + eps_high) & (adv > 0) & real).sum() / m.sum(),
        "clip_ratio/region_mean": (((rho < 1 - eps_low) | (rho > 1 + eps_high)) & real).sum()
        / m.sum(),
        "ratio/mean": (rho * m).sum() / m.sum(),
        "ratio/min": rho[real].min(),
        "ratio/max": rho[real].max(),
    }
    return -j, metrics


def random_batch(seed, num=6, seq=7, per_token_adv=False):
    ks = jax.random.split(jax.random.key(seed), 5)
    old = jax.random.uniform(ks[0], (num, seq), minval=-3.0, maxval=-0.05)
    logp = old + 0.3 * jax.random.normal(ks[1], (num, seq))  # ratios spread over both clip edges
    ref = old + 0.2 * jax.random.normal(ks[2], (num, seq))
    lengths = jnp.array([7, 3, 0, 5, 1, 6])[:num]  # row 2 is all padding
    mask = jnp.arange(seq)[None, :] < lengths[:, None]
    adv_shape = (num, seq) if per_token_adv else (num,)
    adv = jax.random.normal(ks[3], adv_shape)
    # Padding holds garbage (as real batches may): -inf log-probs must not leak into anything.
    garbage = jnp.where(mask, 0.0, -jnp.inf)
    return logp + garbage, old + garbage, ref + garbage, adv, mask


@pytest.mark.parametrize(
    "aggregation, eps_high, ratio, per_token_adv",
    [
        (agg, eh, r, pt)
        for agg, eh, r in itertools.product(
            ["sequence", "token", "constant"], [None, 0.28], ["token", "sequence"]
        )
        for pt in [False]
    ]
    + [("token", None, "token", True), ("sequence", 0.28, "sequence", True)],
)
def test_grpo_loss_matches_numpy_reference(aggregation, eps_high, ratio, per_token_adv):
    logp, old, ref, adv, mask = random_batch(3, per_token_adv=per_token_adv)
    kw = dict(eps_low=0.2, eps_high=eps_high, beta=0.04, aggregation=aggregation, ratio=ratio)
    max_len = 9 if aggregation == "constant" else None
    loss_fn = lambda lp: grpo_loss(lp, old, ref, adv, mask, max_len=max_len, **kw)  # noqa: E731
    (loss, metrics), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(logp)
    np_in = [np.where(mask, np.asarray(a), 0.0) for a in (logp, old, ref)]
    exp_loss, exp_metrics = numpy_grpo_loss(
        *np_in, adv, mask, 0.2, eps_high or 0.2, 0.04, aggregation, max_len, ratio
    )
    assert float(loss) == pytest.approx(exp_loss, rel=1e-5, abs=1e-6)
    assert np.isfinite(float(loss))
    for name, value in exp_metrics.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-6), name
        assert metrics[name].dtype == jnp.float32 and metrics[name].shape == ()
    # The clipped part alone: loss = policy_loss + beta * (aggregated KL) >= policy_loss.
    assert float(metrics["policy_loss"]) <= float(loss) + 1e-6
    # Gradients exist and are finite everywhere, zero on padding.
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[~np.asarray(mask)] == 0.0)
    # The batch had both kinds of clipping, so the clip metrics were really exercised.
    if ratio == "token":
        assert float(metrics["clip_ratio/low_mean"]) > 0
        assert float(metrics["clip_ratio/high_mean"]) > 0


def test_beta_zero_needs_no_reference_and_kl_metric_is_zero():
    logp, old, ref, adv, mask = random_batch(4)
    loss_none, m_none = grpo_loss(logp, old, None, adv, mask, beta=0.0)
    loss_ref, m_ref = grpo_loss(logp, old, ref, adv, mask, beta=0.0)
    assert float(loss_none) == pytest.approx(float(loss_ref), rel=1e-6)
    assert float(m_none["kl"]) == 0.0 and float(m_ref["kl"]) > 0.0  # logged even if unused
    with pytest.raises(ValueError, match="ref_logp is None but beta=0.04"):
        grpo_loss(logp, old, None, adv, mask)


def test_bf16_inputs_accumulate_in_float32():
    logp, old, ref, adv, mask = random_batch(5)
    as_bf16 = [a.astype(jnp.bfloat16) for a in (logp, old, ref)]
    loss16, metrics16 = grpo_loss(*as_bf16, adv, mask)
    loss32, _ = grpo_loss(*[a.astype(jnp.float32) for a in as_bf16], adv, mask)
    assert loss16.dtype == jnp.float32 and metrics16["kl"].dtype == jnp.float32
    assert float(loss16) == float(loss32)


def test_all_padding_batch_gives_no_nan():
    z = jnp.zeros((2, 3))
    loss, metrics = grpo_loss(z, z, z, jnp.ones(2), jnp.zeros((2, 3), bool))
    assert float(loss) == 0.0
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["ratio/min"]) == 1.0 and float(metrics["ratio/max"]) == 1.0


def test_bad_shapes_name_the_argument():
    z = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        grpo_loss(z, z, z, jnp.zeros(3), z)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\)"):
        grpo_loss(z, z, z, jnp.zeros(2), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="aggregation must be"):
        grpo_loss(z, z, z, jnp.zeros(2), z, aggregation="mean")


def test_vmap_over_independent_batches():
    # vmap over a leading "micro-batch" axis equals a Python loop.
    batches = [random_batch(s) for s in (6, 7)]
    stacked = [jnp.stack(parts) for parts in zip(*batches)]
    losses = jax.vmap(lambda *a: grpo_loss(*a)[0])(*stacked)
    np.testing.assert_allclose(losses, [float(grpo_loss(*b)[0]) for b in batches], rtol=1e-6)


def test_entropy_uniform_and_certain():
    # Uniform over V = 8: log 8 = 2.0794 nats. All mass on one token (others -inf): 0, not NaN.
    # A padded position holding NaN logits does not count.
    uniform = jnp.zeros((1, 1, 8))
    certain = jnp.full((1, 1, 8), -jnp.inf).at[..., 3].set(0.0)
    garbage = jnp.full((1, 1, 8), jnp.nan)
    logits = jnp.concatenate([uniform, certain, garbage], axis=1)
    mask = jnp.array([[1, 1, 0]])
    np.testing.assert_allclose(per_token_entropy(logits)[0, :2], [np.log(8), 0.0], atol=1e-6)
    assert float(token_entropy(logits, mask)) == pytest.approx(np.log(8) / 2, abs=1e-6)


def test_entropy_matches_numpy_and_bf16_is_upcast():
    logits = 5 * jax.random.normal(jax.random.key(8), (3, 4, 11))
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    x = np.asarray(logits, np.float64)
    log_p = x - x.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    h = -(np.exp(log_p) * log_p).sum(-1)
    expected = (h * np.asarray(mask)).sum() / np.asarray(mask).sum()
    assert float(jax.jit(token_entropy)(logits, mask)) == pytest.approx(expected, rel=1e-5)
    h16 = token_entropy(logits.astype(jnp.bfloat16), mask)
    assert h16.dtype == jnp.float32
    assert float(h16) == pytest.approx(float(token_entropy(logits.astype(jnp.bfloat16).astype(
        jnp.float32), mask)), rel=1e-6)


def test_entropy_temporaries_are_smaller_than_one_logits_array():
    # float32 logits [N, T, V] in 4 chunks: the compiled metric's temporaries (upcast, exp, ...)
    # stay below the size of the logits themselves; unchunked, XLA:CPU holds two full copies.
    # (Checked with float32 input: XLA:CPU stores any bf16 array that enters a loop as float32, a
    # CPU-only artefact that would hide the chunking.)
    n, t, v = 8, 32, 4096
    logits = jax.ShapeDtypeStruct((n, t, v), jnp.float32)
    mask = jax.ShapeDtypeStruct((n, t), jnp.bool_)

    def temp_bytes(chunk):
        fn = jax.jit(lambda x, m: token_entropy(x, m, chunk_elements=chunk))
        analysis = fn.lower(logits, mask).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        return analysis.temp_size_in_bytes

    assert temp_bytes(n * t * v // 4) < n * t * v * 4


def test_entropy_chunking_does_not_change_the_numbers():
    # 3 x 5 positions in chunks of 4 rows (the last chunk padded) equal one unchunked pass.
    logits = 3 * jax.random.normal(jax.random.key(9), (3, 5, 6))
    np.testing.assert_allclose(
        per_token_entropy(logits, chunk_elements=24), per_token_entropy(logits), rtol=1e-6
    )


def test_aggregate_worked_example_and_the_mean_of_means_it_avoids():
    # Two micro-batches of one answer each: a 1-token answer whose term is 1.0, and a 3-token
    # answer whose terms are 0. Full batch: token mean 1/4, sequence mean (1/1 + 0/3)/2 = 1/2,
    # constant (max_len 3) 1/(2*3). Averaging the two micro-batches' own token means would give
    # (1 + 0)/2 = 1/2: the short answer's token counted 3x (DAPO's token mean exists to avoid that).
    x = [jnp.array([[1.0, 0.0, 0.0]]), jnp.array([[0.0, 0.0, 0.0]])]
    m = [jnp.array([[1, 0, 0]]), jnp.array([[1, 1, 1]])]
    full_x, full_m = jnp.concatenate(x), jnp.concatenate(m)
    for aggregation, want in (("token", 0.25), ("sequence", 0.5), ("constant", 1 / 6)):
        full = float(aggregate(full_x, full_m, aggregation, max_len=3))
        assert full == pytest.approx(want, rel=1e-6), aggregation
        norm = sum(loss_normalizer(mk, aggregation, max_len=3) for mk in m)
        assert float(norm) == float(loss_normalizer(full_m, aggregation, max_len=3))
        accumulated = sum(float(aggregate(xk, mk, aggregation, max_len=3, normalizer=norm))
                          for xk, mk in zip(x, m))
        assert accumulated == pytest.approx(want, rel=1e-6), aggregation
    mean_of_means = np.mean([float(aggregate(xk, mk, "token")) for xk, mk in zip(x, m)])
    assert mean_of_means == 0.5


def test_normalizer_counts_rows_tokens_or_budget():
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])
    assert float(loss_normalizer(mask, "sequence")) == 3.0  # an all-padding row still counts (TRL)
    assert float(loss_normalizer(mask, "token")) == 5.0
    assert float(loss_normalizer(mask, "constant")) == 12.0  # N * T
    assert float(loss_normalizer(mask, "constant", max_len=10)) == 30.0
    assert float(loss_normalizer(jnp.zeros((2, 3)), "token")) == 1.0  # never 0: no NaN
    with pytest.raises(ValueError, match="aggregation must be"):
        aggregate(jnp.zeros((1, 2)), jnp.ones((1, 2)), "mean", normalizer=1.0)


def ragged_batch():
    """(logp, old, ref, adv, mask) of 12 answers of 1..7 of 8 tokens, sorted short-first, so a mean
    of micro-batch means is off; logp 0.3 and ref 0.2 (random) away from pi_old, so clips, gates,
    trust regions and the KL term are all exercised."""
    ks = jax.random.split(jax.random.key(11), 4)
    old = jax.random.uniform(ks[0], (12, 8), minval=-3.0, maxval=-0.05)
    logp = old + 0.3 * jax.random.normal(ks[1], (12, 8))
    ref = old + 0.2 * jax.random.normal(ks[2], (12, 8))
    adv = jax.random.normal(ks[3], (12,))
    lengths = np.sort(np.random.default_rng(1).integers(1, 8, 12))
    mask = jnp.asarray((np.arange(8)[None, :] < lengths[:, None]).astype(np.float32))
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_accumulated_gradient_equals_full_batch_gradient(aggregation):
    # Micro-batches of very different token counts (answers of 1..7 of 8 tokens, sorted so the
    # first micro-batch holds the short ones): summing each micro-batch's loss over the whole
    # batch's normaliser gives the full-batch loss and gradient, up to float32 summation order
    # (a few dozen terms: relative error ~1e2 * 6e-8 ~ 1e-5).
    logp, old, ref, adv, mask = ragged_batch()
    kw = dict(beta=0.04, aggregation=aggregation, max_len=8, eps_high=0.28)

    def full(lp):
        return grpo_loss(lp, old, ref, adv, mask, **kw)[0]

    def accumulated(lp, pieces=3):
        rows = np.array_split(np.arange(12), pieces)
        norm = sum(loss_normalizer(mask[r], aggregation, max_len=8) for r in rows)
        return sum(grpo_loss(lp[r], old[r], ref[r], adv[r], mask[r], normalizer=norm, **kw)[0] for r in rows)

    np.testing.assert_allclose(float(accumulated(logp)), float(full(logp)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.grad(accumulated)(logp), jax.grad(full)(logp), rtol=1e-5, atol=1e-7)
    if aggregation == "token":  # the old mean of per-micro-batch means is measurably different
        rows = np.array_split(np.arange(12), 3)
        means = np.mean([float(grpo_loss(logp[r], old[r], ref[r], adv[r], mask[r], **kw)[0]) for r in rows])
        assert abs(means - float(full(logp))) > 1e-3


# ----------------------------------------------------------------------------------------------
# Sampler correction (pi_old / pi_sampler), seed style: one answer of three tokens.


def _one_answer(d, pad=1):
    """trainer/sampler log-probs of one answer whose tokens differ by `d`, plus `pad` padding columns."""
    sampler = jnp.asarray([[-1.0, -2.0, -0.5] + [0.0] * pad], jnp.float32)
    trainer = sampler + jnp.asarray([list(d) + [7.0] * pad], jnp.float32)  # garbage on the padding
    mask = jnp.asarray([[1, 1, 1] + [0] * pad])
    return trainer, sampler, mask


def test_sampler_correction_worked_example():
    # d = (0.1, -0.2, 0.3), C = 2. Token TIS: (e^0.1, e^-0.2, e^0.3) = (1.105, 0.819, 1.350), all
    # inside the cap. Sequence: the product e^(0.1 - 0.2 + 0.3) = e^0.2 = 1.221 on every token,
    # inside [1/2, 2]. Padding gets exactly 1.
    trainer, sampler, mask = _one_answer((0.1, -0.2, 0.3))
    w, m = sampler_correction(trainer, sampler, mask, "token_truncate", clip_max=2.0)
    np.testing.assert_allclose(np.asarray(w)[0], [1.1052, 0.8187, 1.3499, 1.0], atol=1e-4)
    w, m = sampler_correction(trainer, sampler, mask, "sequence_mask", clip_max=2.0)
    np.testing.assert_allclose(np.asarray(w)[0], [1.2214, 1.2214, 1.2214, 1.0], atol=1e-4)
    assert float(m["sampling/importance_sampling_masked_fraction"]) == 0.0
    assert float(m["sampling/sampling_logp_difference/mean"]) == pytest.approx(0.2, abs=1e-6)
    assert float(m["sampling/sampling_logp_difference/max"]) == pytest.approx(0.3, abs=1e-6)


def test_sampler_correction_truncates_and_masks_outside_the_band():
    # d = (0.5, 0.5, 0.5), C = 2: e^0.5 = 1.649 per token (inside); the answer's e^1.5 = 4.48 > 2.
    trainer, sampler, mask = _one_answer((0.5, 0.5, 0.5))
    w, _ = sampler_correction(trainer, sampler, mask, "token_mask", clip_max=2.0)
    np.testing.assert_allclose(np.asarray(w)[0, :3], np.exp(0.5), rtol=1e-6)
    w, m = sampler_correction(trainer, sampler, mask, "sequence_truncate", clip_max=2.0)
    np.testing.assert_allclose(np.asarray(w)[0], [2.0, 2.0, 2.0, 1.0])
    assert float(m["sampling/importance_sampling_truncated_fraction"]) == 1.0
    w, m = sampler_correction(trainer, sampler, mask, "sequence_mask", clip_max=2.0)
    np.testing.assert_array_equal(np.asarray(w)[0], [0.0, 0.0, 0.0, 1.0])  # the answer drops out
    assert float(m["sampling/importance_sampling_masked_fraction"]) == 1.0
    assert float(m["sampling/importance_sampling_ratio/max"]) == 0.0
    # The lower edge: d = -1 per token, e^-1 = 0.368 < 1/2 is masked; truncation has no lower bound
    # unless clip_min is given.
    trainer, sampler, mask = _one_answer((-1.0, 0.0, 0.0))
    w, m = sampler_correction(trainer, sampler, mask, "token_mask", clip_max=2.0)
    np.testing.assert_array_equal(np.asarray(w)[0], [0.0, 1.0, 1.0, 1.0])
    assert float(m["sampling/importance_sampling_masked_fraction"]) == pytest.approx(1 / 3)
    w, _ = sampler_correction(trainer, sampler, mask, "token_truncate", clip_max=2.0)
    assert float(w[0, 0]) == pytest.approx(np.exp(-1.0), rel=1e-6)
    w, _ = sampler_correction(trainer, sampler, mask, "token_truncate", clip_max=2.0, clip_min=0.5)
    assert float(w[0, 0]) == 0.5


def test_sampler_correction_is_the_identity_when_log_probs_agree():
    # Equal log-probs: w = exp(0) = 1 exactly, so the loss and its gradient are bit-equal to the
    # uncorrected ones (x * 1.0 is exact in IEEE arithmetic), in every mode.
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-1.0, 0.5, (6, 5)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0.0, 0.1, (6, 5)), jnp.float32)
    ref = logp + 0.05
    adv = jnp.asarray(rng.normal(size=6), jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, (6, 5)))

    def loss(lp, weights):
        return grpo_loss(lp, old, ref, adv, mask, beta=0.04, is_weights=weights)[0]

    plain_value, plain_grad = jax.jit(jax.value_and_grad(lambda lp: loss(lp, None)))(logp)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        w, m = sampler_correction(old, old, mask, mode)
        assert np.all(np.asarray(w) == 1.0)
        value, grad = jax.jit(jax.value_and_grad(lambda lp: loss(lp, w)))(logp)
        assert np.asarray(value).tobytes() == np.asarray(plain_value).tobytes(), mode
        assert np.asarray(grad).tobytes() == np.asarray(plain_grad).tobytes(), mode
        assert float(m["sampling/sampling_logp_difference/max"]) == 0.0


def test_weights_scale_the_clipped_term_not_the_kl():
    # One token, rho = 1 (pi_old = pi_theta), A = 1, w = 0.5: the policy term is 0.5 * 1 * 1 and its
    # gradient in logp is 0.5 (d rho / d logp = rho = 1); the KL term (beta = 0.1, ref = logp - 0.2:
    # k3 = e^-0.2 + 0.2 - 1 = 0.01873) keeps its weight 1.
    logp = jnp.asarray([[-1.0]])
    ref, mask, adv, w = logp - 0.2, jnp.ones((1, 1)), jnp.ones((1,)), jnp.full((1, 1), 0.5)
    loss, metrics = grpo_loss(logp, logp, ref, adv, mask, beta=0.1, is_weights=w)
    k3 = np.exp(-0.2) + 0.2 - 1
    assert float(loss) == pytest.approx(-(0.5 - 0.1 * k3), rel=1e-5)
    assert float(metrics["policy_loss"]) == pytest.approx(-0.5, rel=1e-6)
    grad = jax.grad(lambda lp: grpo_loss(lp, jax.lax.stop_gradient(lp), ref, adv, mask, beta=0.0, is_weights=w)[0])(logp)
    assert float(grad[0, 0]) == pytest.approx(-0.5, rel=1e-6)


def test_sampler_correction_nan_and_huge_differences_stay_finite():
    # A NaN sampler log-prob is a difference of 0 (weight 1); a sequence whose log-ratio overflows
    # exp (d = 100 per token) is truncated to C or masked to 0, never inf or NaN.
    trainer, sampler, mask = _one_answer((100.0, 100.0, 100.0))
    for mode in ("sequence_truncate", "sequence_mask", "token_truncate", "token_mask"):
        w, m = sampler_correction(trainer, sampler, mask, mode)
        assert np.all(np.isfinite(np.asarray(w))) and all(np.isfinite(float(v)) for v in m.values()), mode
    w, _ = sampler_correction(trainer, sampler.at[0, 1].set(jnp.nan), mask, "token_mask", clip_max=1e9)
    assert float(w[0, 1]) == 1.0
    with pytest.raises(ValueError, match="mode must be"):
        sampler_correction(trainer, sampler, mask, "sequence")
