"""grpo_loss(use_bias_correction_kl=True): TRL's unbiased KL (DeepSeek-V3.2), worked by hand.
(Parity with TRL's GRPOTrainer loss: tests/test_entropy_control.py::test_parity_loss_and_gradients_with_trl.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax.core.losses import grpo_loss, importance_ratio, kl_penalty

ATOL = 1e-6  # a few float32 roundings of O(1) values (16 u)


def _one_token(logp, corrected):
    """-J of one token with A = 0 and beta = 1: just the (corrected) KL term."""
    args = [jnp.array([[logp]]), jnp.array([[math.log(0.4)]]), jnp.array([[math.log(0.25)]]), jnp.zeros(1),
            jnp.ones((1, 1))]
    return grpo_loss(*args, beta=1.0, use_bias_correction_kl=corrected)[0]


def test_worked_example_value_and_gradient():
    # pi_theta = 0.5, pi_old = 0.4, pi_ref = 0.25 for the sampled token: rho = 1.25 and
    # k3 = r - log r - 1 with r = pi_ref / pi_theta = 0.5: 0.5 + 0.693147 - 1 = 0.193147.
    # Corrected: rho * k3 = 0.241434. Gradient w.r.t. log pi_theta: d k3 = 1 - r = 0.5, and
    # d (rho k3) = rho k3 + rho (1 - r) = 0.241434 + 0.625 = 0.866434 (the ratio's own derivative adds
    # rho * k3), against 0.5 without the correction.
    logp = math.log(0.5)
    k3 = 0.5 - math.log(0.5) - 1.0
    assert float(_one_token(logp, False)) == pytest.approx(k3, abs=ATOL)
    assert float(_one_token(logp, True)) == pytest.approx(1.25 * k3, abs=ATOL)
    assert float(jax.grad(_one_token)(logp, False)) == pytest.approx(0.5, abs=ATOL)
    assert float(jax.grad(_one_token)(logp, True)) == pytest.approx(1.25 * k3 + 1.25 * 0.5, abs=ATOL)


def test_corrected_estimate_is_unbiased_under_pi_old():
    # Why: tokens are sampled from pi_old, not pi_theta. Over a 3-token vocabulary, the expectation
    # under pi_old of rho * k3 is sum_x pi_theta(x) k3(x) = KL(pi_theta || pi_ref) exactly; the plain
    # k3's expectation under pi_old is another number.
    old, theta, ref = (np.array(p) for p in ([0.6, 0.3, 0.1], [0.4, 0.4, 0.2], [0.2, 0.5, 0.3]))
    lp, lo, lr = (jnp.log(jnp.asarray(p, jnp.float32))[None] for p in (theta, old, ref))
    mask = jnp.ones((1, 3))
    k3 = np.asarray(kl_penalty(lp, lr, "k3"))[0]
    rho = np.asarray(importance_ratio(lp, lo, mask))[0]
    true_kl = float((theta * np.log(theta / ref)).sum())
    assert float((old * rho * k3).sum()) == pytest.approx(true_kl, abs=ATOL)
    assert abs(float((old * k3).sum()) - true_kl) > 0.01


def test_no_change_at_ratio_one_or_without_beta():
    # On-policy (rho = 1 exactly) the value is the plain k3's; with beta = 0 nothing changes at all,
    # which is why the CPU demo (beta = 0) keeps its numbers under the new default.
    key = jax.random.split(jax.random.key(0), 3)
    logp = jax.random.uniform(key[0], (4, 5), minval=-3.0, maxval=-0.5)
    ref = logp + 0.2 * jax.random.normal(key[1], (4, 5))
    adv = jax.random.normal(key[2], (4,))
    mask = jnp.ones((4, 5))
    on, _ = grpo_loss(logp, logp, ref, adv, mask, beta=0.04, use_bias_correction_kl=True)
    off, _ = grpo_loss(logp, logp, ref, adv, mask, beta=0.04, use_bias_correction_kl=False)
    assert float(on) == float(off)
    old = logp - 0.1
    a, _ = grpo_loss(logp, old, None, adv, mask, beta=0.0, use_bias_correction_kl=True)
    b, _ = grpo_loss(logp, old, None, adv, mask, beta=0.0, use_bias_correction_kl=False)
    assert float(a) == float(b)


def test_trainer_default_is_trls():
    assert config_lib.GRPOSection().use_bias_correction_kl is True  # TRL 1.16's GRPOConfig default
