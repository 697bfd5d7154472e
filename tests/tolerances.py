"""Tolerances for comparing float32 computations that differ only in summation order.

Two runs of the same math laid out differently (one device vs a mesh, a shared prompt vs per-row
prompt copies, one micro-batch vs several) add the same terms in another order. Each bound below is
derived here, once, so a test states which argument it relies on instead of a number that passed
on one machine.

Float32 rounding. The unit roundoff is u = 2^-24 ~ 6e-8. A sum of n terms reordered changes by at
most gamma_n * sum|terms| with gamma_n ~ n * u (Higham, Accuracy and Stability, 4.2). A gradient
coordinate of our test models sums at most n ~ 10^3 per-token products (rows x tokens, each already
a short dot product); GRPO advantages sum to zero within each group, so the terms cancel and
sum|terms| can reach ~10 |g|. Relative error of a gradient coordinate, and of a loss or metric
that is a reduction of the same size:

    GRAD_REL_ERR = n * u * cancellation = 1e3 * 6e-8 * 10 = 6e-4, taken as 1e-3.

Forward passes. A log-prob computed on another layout (sharded matmuls, a shared prompt, a cached
decode) passes through the same dot products summed in another order: a logit accumulates at most
k ~ 10^3 rounded terms through a test model's layers (D, F <= 128 per product, a few products per
layer, two layers), so its relative error is <= k * u ~ 6e-5, and log-softmax adds no more than the
logits' error:

    FORWARD_REL_ERR = 1e-4 (log-probs, logits, entropies; relative, with a tiny atol for ~0 values).

Adam. Its step is lr * m_hat / (sqrt(v_hat) + eps). With bias correction and b1 = 0.9, b2 = 0.99
over a few steps, |m_hat| <= sqrt(sum_t w_t^2 / c_t) sqrt(v_hat) ~ 1.0 sqrt(v_hat) (Cauchy-Schwarz
over the moment weights w_t, c_t), so the direction d = m_hat / sqrt(v_hat) has |d| <= ~1, and a
relative error r in every gradient changes it by at most r (through m) + r (through sqrt v) = 2r.
A weight therefore moves differently by at most 2 * lr * r per update, and the differences add up
over k updates (their effect through the next gradients is second order):

    adam_weight_atol(lr, k) = 2 * lr * k * GRAD_REL_ERR.

This needs Adam's eps well above the absolute rounding noise of a gradient coordinate whose true
value is ~0 (there the relative error is unbounded and eps alone keeps d ~ g / eps small): tests
that compare weights after Adam use eps = 1e-4, which leaves d <= noise / 1e-4 for such a weight.
(With eps = 1e-8, a coordinate that is pure cancellation noise moves by ~lr either way: the
comparison would measure Adam's sign of noise, not the code under test.) A real bug (a wrong
mask, a mean of means, a dropped micro-batch) moves weights by ~lr per update, 10^3 times these.
"""

from __future__ import annotations

FLOAT32_UNIT_ROUNDOFF = 2.0**-24
# n ~ 1e3 terms per reduction x u x a cancellation factor of ~10: see the module docstring.
GRAD_REL_ERR = 1e-3
# k ~ 1e3 rounded terms per logit x u: see the module docstring.
FORWARD_REL_ERR = 1e-4
# Adam eps for tests that compare weights after updates (see the module docstring).
ADAM_EPS_FOR_COMPARISONS = 1e-4


def adam_weight_atol(learning_rate: float, updates: int, grad_rel_err: float = GRAD_REL_ERR) -> float:
    """Largest weight difference two runs may show after `updates` Adam steps whose gradients
    agree to `grad_rel_err` relative: 2 * lr * updates * grad_rel_err (module docstring)."""
    return 2.0 * learning_rate * updates * grad_rel_err


def normwise_violation(a, b, rel: float) -> float:
    """max over elements of |a - b| - rel * max|b|: <= 0 when a equals b to `rel` norm-wise.

    Norm-wise (relative to the largest element) is the form the float32 bounds take for sums:
    an element that cancels to ~0 keeps the absolute error of the large terms it came from."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return -np.inf
    return float(np.max(np.abs(a - b)) - rel * np.max(np.abs(b)))


def metric_tolerance(name: str) -> dict[str, float]:
    """pytest.approx keywords for one GRPO update metric compared across layouts.

    `loss`/`policy_loss` cancel to ~0 (advantages sum to zero per group): absolute error
    n * u * max|term| with |rho * A| <= ~2, n ~ 1e3, i.e. ~1.2e-4, taken as 2e-4. `grad_norm`: a
    norm of gradients that agree to GRAD_REL_ERR. Every other metric is a mean of non-negative or
    bounded per-token values computed from log-probs (KL, entropy, ratios, clip fractions; a clip
    fraction could only change if a ratio sat within FORWARD_REL_ERR of a clip edge):
    FORWARD_REL_ERR relative."""
    if name in ("loss", "policy_loss"):
        return {"rel": GRAD_REL_ERR, "abs": 2e-4}
    if name.startswith("grad_norm"):
        return {"rel": GRAD_REL_ERR, "abs": 0.0}
    return {"rel": FORWARD_REL_ERR, "abs": 1e-7}
