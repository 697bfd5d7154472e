"""The on-policy distillation losses (grpo_jax.core.distillation) as worked examples, their gradients
against the analytic reverse-KL gradient, and the student/teacher log-prob passes they read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core import distillation, losses
from grpo_jax import model as model_lib
from grpo_jax.training import teacher as teacher_lib
from tolerances import FORWARD_REL_ERR

# The examples below are a handful of float32 logs, exps and sums of <= 5 terms of size <= 1:
# each result is within ~10 roundings of its value, 10 * u ~ 6e-7; 1e-6 absolute is that bound.
SMALL_ATOL = 1e-6


def test_sampled_estimate_worked_example():
    # One answer of two tokens. Student log-probs of the sampled tokens -0.5 and -1.0, teacher's
    # -1.5 and -0.25: d = (-0.5 + 1.5, -1.0 + 0.25) = (1.0, -0.75). "sequence" aggregation over
    # one answer is the token mean, (1.0 - 0.75) / 2 = 0.125; at the first update (pi_old = pi_s,
    # rho = 1) the surrogate's value is d itself, so loss and metric are both 0.125.
    student = jnp.array([[-0.5, -1.0]])
    teacher = jnp.array([[-1.5, -0.25]])
    np.testing.assert_allclose(distillation.sampled_reverse_kl(student, teacher), [[1.0, -0.75]])
    loss, metrics = distillation.distillation_loss(student, jnp.ones((1, 2)), teacher_logp_NxT=teacher)
    assert float(loss) == pytest.approx(0.125, abs=SMALL_ATOL)
    assert float(metrics["distillation/reverse_kl"]) == pytest.approx(0.125, abs=SMALL_ATOL)
    # A padded third token (mask 0) holding NaN changes nothing.
    padded, _ = distillation.distillation_loss(jnp.array([[-0.5, -1.0, jnp.nan]]), jnp.array([[1, 1, 0]]),
                                               teacher_logp_NxT=jnp.array([[-1.5, -0.25, 0.0]]))
    assert float(padded) == pytest.approx(0.125, abs=SMALL_ATOL)


def test_sampled_surrogate_weights_by_the_ratio_to_pi_old():
    # Second update of a batch: pi_s(x) = e^-0.5, pi_old(x) = e^-1.0, so rho = e^0.5 = 1.6487 and
    # the term is rho * d = 1.6487 * (-0.5 - (-2.0)) = 1.6487 * 1.5 = 2.4731.
    term = distillation.sampled_reverse_kl_surrogate(jnp.array([-0.5]), jnp.array([-2.0]), jnp.array([-1.0]))
    assert float(term[0]) == pytest.approx(np.exp(0.5) * 1.5, abs=SMALL_ATOL * 3)


def test_top_k_worked_example():
    # Vocabulary of 3: student p = (0.5, 0.3, 0.2), teacher q = (0.3, 0.5, 0.2).
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.3, 0.5, 0.2])
    logp, logq = jnp.log(jnp.asarray(p, jnp.float32)), jnp.log(jnp.asarray(q, jnp.float32))
    # K = 3 is the full KL: 0.5 ln(5/3) + 0.3 ln(3/5) + 0.2 ln 1 = 0.2 ln(5/3) = 0.10217.
    full = distillation.top_k_reverse_kl(logp[None, None], logq[None, None])
    assert float(full[0, 0]) == pytest.approx(0.2 * np.log(5 / 3), abs=SMALL_ATOL)
    # K = 1, the teacher's top token (id 1) plus the tail bucket: student (0.3, 0.7), teacher
    # (0.5, 0.5): 0.3 ln 0.6 + 0.7 ln 1.4 = -0.15325 + 0.23553 = 0.08228 <= 0.10217 (a lower bound).
    top1 = distillation.top_k_reverse_kl(logp[None, None, 1:2], logq[None, None, 1:2], add_tail=True)
    assert float(top1[0, 0]) == pytest.approx(0.3 * np.log(0.6) + 0.7 * np.log(1.4), abs=SMALL_ATOL)
    # K = 2 (ids 1, 0) renormalised, no tail: student (0.3, 0.5) / 0.8 = (0.375, 0.625), teacher
    # (0.625, 0.375): 0.375 ln 0.6 + 0.625 ln(5/3) = 0.12771.
    ids = jnp.array([1, 0])
    top2 = distillation.top_k_reverse_kl(logp[ids][None, None], logq[ids][None, None], add_tail=False)
    assert float(top2[0, 0]) == pytest.approx(0.375 * np.log(0.6) + 0.625 * np.log(5 / 3), abs=SMALL_ATOL)


def _analytic_grad(z_s, z_t):
    """d KL(softmax z_s || softmax z_t) / d z_s = p * (log p - log q - KL), p = softmax z_s."""
    logp, logq = jax.nn.log_softmax(z_s), jax.nn.log_softmax(z_t)
    p = jnp.exp(logp)
    kl = jnp.sum(p * (logp - logq))
    return p * (logp - logq - kl)


def _logits(seed, v=5):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return 1.5 * jax.random.normal(k1, (v,)), 1.5 * jax.random.normal(k2, (v,))


@pytest.mark.parametrize("add_tail", [True, False])
def test_top_k_gradient_over_the_whole_vocabulary_is_the_analytic_one(add_tail):
    # K = V: the top-k KL is the exact reverse KL (tail 0, floored), so its autodiff gradient with
    # respect to the student's logits is p * (log p - log q - KL). Terms are <= 5 products of size
    # <= ~5 (logits of scale 1.5): float32 error ~ 5 * 5 * u ~ 1.5e-6, bounded by 1e-5.
    for seed in range(3):
        z_s, z_t = _logits(seed)

        def kl(z):
            return distillation.top_k_reverse_kl(jax.nn.log_softmax(z)[None, None],
                                                 jax.nn.log_softmax(z_t)[None, None], add_tail=add_tail)[0, 0]

        np.testing.assert_allclose(jax.grad(kl)(z_s), _analytic_grad(z_s, z_t), atol=1e-5)


def test_sampled_surrogate_gradient_in_expectation_is_the_analytic_one():
    # E_{x ~ p}[grad of rho(x) * sg(d(x))] at pi_old = pi_s = sum_x p(x) d(x) (e_x - p)
    # = p * (d - KL): the analytic reverse-KL gradient. Enumerating the 5 tokens weighted by p gives
    # the expectation exactly (no sampling), so only float32 rounding separates them (as above).
    for seed in range(3):
        z_s, z_t = _logits(seed)
        p = jax.nn.softmax(z_s)

        def surrogate(z, x):
            logp = jax.nn.log_softmax(z)[x]
            return distillation.sampled_reverse_kl_surrogate(logp[None], jax.nn.log_softmax(z_t)[x][None])[0]

        grads = jnp.stack([jax.grad(surrogate)(z_s, x) for x in range(5)])
        np.testing.assert_allclose(jnp.sum(p[:, None] * grads, axis=0), _analytic_grad(z_s, z_t), atol=1e-5)


def test_micro_batches_with_the_whole_normaliser_add_up_to_the_full_batch():
    # Token aggregation over 4 answers; two halves each divided by the whole batch's normaliser
    # sum to the full batch's loss (the accumulation rule of step.py). Sums of 12 terms: 1e-6.
    rng = np.random.default_rng(0)
    s, t = jnp.asarray(-rng.random((4, 3)), jnp.float32), jnp.asarray(-rng.random((4, 3)), jnp.float32)
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    norm = losses.loss_normalizer(mask, "token")
    full, _ = distillation.distillation_loss(s, mask, teacher_logp_NxT=t, aggregation="token")
    halves = [distillation.distillation_loss(s[i:i + 2], mask[i:i + 2], teacher_logp_NxT=t[i:i + 2],
                                             aggregation="token", normalizer=norm)[0] for i in (0, 2)]
    assert float(sum(halves)) == pytest.approx(float(full), abs=SMALL_ATOL)


def test_distillation_loss_takes_one_estimate():
    with pytest.raises(ValueError, match="not both"):
        distillation.distillation_loss(jnp.zeros((1, 2)), jnp.ones((1, 2)))


def _tiny_model(seed=0, hidden=32, layers=2):
    cfg = model_lib.ModelConfig(vocab_size=14, hidden_size=hidden, intermediate_size=2 * hidden,
                                num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=16)
    from flax import nnx

    return nnx.split(model_lib.init_model(cfg, seed))


def _full_logp(graphdef, params, tokens, c):
    from flax import nnx

    logits = nnx.merge(graphdef, params)(tokens)
    return jax.nn.log_softmax(logits[:, -c - 1:-1].astype(jnp.float32), axis=-1)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_student_log_probs_of_the_teachers_ids_are_the_log_softmax_there(chunk_size):
    # token_logprobs(gather_ids_BxCxK=...) returns log softmax(logits)[ids] beside the targets'
    # log-probs, in one pass or in chunks of positions. Same dot products, other layout:
    # FORWARD_REL_ERR (tests/tolerances.py).
    graphdef, params = _tiny_model()
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 9), 0, 14)
    attention = jnp.ones_like(tokens)
    ids = jax.random.randint(jax.random.PRNGKey(2), (3, 5, 4), 0, 14)
    logp, logp_ids = model_lib.token_logprobs(graphdef, params, tokens, attention, num_targets=5,
                                              gather_ids_BxCxK=ids, chunk_size=chunk_size)
    full = _full_logp(graphdef, params, tokens, 5)
    np.testing.assert_allclose(logp_ids, jnp.take_along_axis(full, ids, axis=-1), rtol=FORWARD_REL_ERR, atol=1e-6)
    np.testing.assert_allclose(logp, model_lib.token_logprobs(graphdef, params, tokens, attention, num_targets=5),
                               rtol=FORWARD_REL_ERR, atol=1e-6)


def test_teacher_top_k_are_the_largest_log_probs_of_the_students_vocabulary():
    # A teacher of another shape (1 layer, width 48) over the same 14 ids; restricted to the first
    # 10 ids, its top 3 are the 3 largest of log_softmax(logits[:10]).
    graphdef, params = _tiny_model(seed=5, hidden=48, layers=1)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 8), 0, 14)
    logp, ids = teacher_lib.top_k_logprobs(graphdef, params, tokens, jnp.ones_like(tokens), num_targets=4, k=3,
                                           vocab=10)
    from flax import nnx

    logits = nnx.merge(graphdef, params)(tokens)[:, 3:7, :10].astype(jnp.float32)
    ref = jax.nn.log_softmax(logits, axis=-1)
    assert ids.shape == (2, 4, 3) and int(ids.max()) < 10
    np.testing.assert_allclose(logp, jnp.sort(ref, axis=-1)[..., ::-1][..., :3], rtol=FORWARD_REL_ERR, atol=1e-6)
    np.testing.assert_allclose(logp, jnp.take_along_axis(ref, ids, axis=-1), rtol=FORWARD_REL_ERR, atol=1e-6)
