"""On-policy distillation: the student's reverse KL to a frozen teacher on the student's own samples.

The objective (Agarwal et al. 2024, "On-Policy Distillation of Language Models", GKD with lmbda = 1
and the reverse-KL end of its divergence, beta = 1; Thinking Machines' "On-Policy Distillation",
2025): for completions o ~ pi_s (the student, the policy being trained) and every completion token t,

    D_t = KL(pi_s(. | o_<t) || pi_t(. | o_<t)) = sum_v pi_s(v) (log pi_s(v) - log pi_t(v))

averaged over tokens like the policy loss (`losses.aggregate`, the same normaliser, so gradient
accumulation and devices stay exact). Two estimates of D_t, picked by `loss_top_k` (TRL's name):

  loss_top_k = 0, "sampled": the sampled token x_t alone, d_t = log pi_s(x_t) - log pi_t(x_t), an
    unbiased estimate of D_t (x_t ~ pi_s). The trained term is the score-function surrogate
    rho_t * stop_grad(d_t), rho_t = pi_s(x_t) / pi_old(x_t) (1 at the first update of a batch), whose
    gradient is rho_t d_t grad log pi_s(x_t); in expectation over x_t ~ pi_old that is grad D_t
    (the d_t's own dependence on theta adds E[grad log pi_s] = 0). This is Thinking Machines' per-token
    advantage -d_t with discount 0. It needs only the teacher's log-prob of each sampled token.
  loss_top_k = K > 0, "top-k": D_t over S_t, the teacher's K most likely tokens, exactly (a
    differentiable sum, no sampling noise). With `loss_add_tail` (TRL's name, default on) the
    remaining mass is one more bucket, p(tail) = 1 - sum_{v in S_t} p(v), so the K + 1 buckets are
    distributions and their KL is a lower bound of D_t (the chain rule of KL drops the within-tail
    term); without it both are renormalised over S_t. K = vocabulary size is D_t exactly.

Mixed with the verifiable reward as `loss = policy_loss + teacher_tau * distillation_loss`
(`teacher_tau`: prime-rl's name for this weight).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.core import losses

# Tail buckets are floored at this probability before their log: a tail of exactly 0 (K = V) would
# give 0 * log 0 = NaN in value or gradient; the floor changes the KL by at most 1e-20 * 46 nats.
_TAIL_FLOOR = 1e-20


def sampled_reverse_kl(student_logp_NxT: jax.Array, teacher_logp_NxT: jax.Array) -> jax.Array:
    """d_t = log pi_s(x_t) - log pi_t(x_t) [N, T] float32: the one-sample estimate of the reverse
    KL at each token (module docstring); unbiased when x_t was sampled from pi_s."""
    return jnp.asarray(student_logp_NxT, jnp.float32) - jnp.asarray(teacher_logp_NxT, jnp.float32)


def sampled_reverse_kl_surrogate(student_logp_NxT: jax.Array, teacher_logp_NxT: jax.Array,
                                 old_logp_NxT: jax.Array | None = None) -> jax.Array:
    """[N, T] per-token term rho_t * stop_grad(d_t), rho_t = exp(log pi_s - stop_grad(log pi_old)).

    Value: rho_t d_t (d_t itself at the first update, pi_old = pi_s); gradient:
    rho_t d_t grad log pi_s(x_t), whose expectation over x_t ~ pi_old is grad KL(pi_s || pi_t).
    old_logp_NxT None: pi_old is pi_s (one update per batch)."""
    logp = jnp.asarray(student_logp_NxT, jnp.float32)
    old = jax.lax.stop_gradient(logp if old_logp_NxT is None else jnp.asarray(old_logp_NxT, jnp.float32))
    rho = jnp.exp(logp - old)
    return rho * jax.lax.stop_gradient(sampled_reverse_kl(logp, teacher_logp_NxT))


def _tail_logp(logp_NxTxK: jax.Array) -> jax.Array:
    """log(1 - sum_k p_k) [N, T], the mass outside the K ids, floored at _TAIL_FLOOR. -expm1 keeps a
    tail near 0 accurate (1 - sum would cancel); the floor keeps value and gradient finite at K = V."""
    return jnp.log(jnp.maximum(-jnp.expm1(jax.nn.logsumexp(logp_NxTxK, axis=-1)), _TAIL_FLOOR))


def top_k_reverse_kl(student_logp_NxTxK: jax.Array, teacher_logp_NxTxK: jax.Array, *,
                     add_tail: bool = True) -> jax.Array:
    """Reverse KL [N, T] over each token's K teacher-chosen ids (module docstring, "top-k").

    Args:
      student_logp_NxTxK: log pi_s of the K ids (full-vocabulary log-softmax values); differentiable.
      teacher_logp_NxTxK: log pi_t of the same ids (the teacher's top K), treated as constants.
      add_tail: one more bucket with each side's remaining mass; else renormalise over the K ids.

    Returns: sum over the K (+1) buckets of q_s (log q_s - log q_t), float32, >= 0.
    """
    s = jnp.asarray(student_logp_NxTxK, jnp.float32)
    t = jax.lax.stop_gradient(jnp.asarray(teacher_logp_NxTxK, jnp.float32))
    if not add_tail:
        s = s - jax.nn.logsumexp(s, axis=-1, keepdims=True)
        t = t - jax.nn.logsumexp(t, axis=-1, keepdims=True)
        return jnp.sum(jnp.exp(s) * (s - t), axis=-1)
    kl_k = jnp.sum(jnp.exp(s) * (s - t), axis=-1)
    s_tail, t_tail = _tail_logp(s), _tail_logp(t)
    return kl_k + jnp.exp(s_tail) * (s_tail - t_tail)


def distillation_loss(
    student_logp_NxT: jax.Array,
    mask_NxT: jax.Array,
    *,
    teacher_logp_NxT: jax.Array | None = None,
    old_logp_NxT: jax.Array | None = None,
    student_topk_logp_NxTxK: jax.Array | None = None,
    teacher_topk_logp_NxTxK: jax.Array | None = None,
    add_tail: bool = True,
    aggregation: losses.Aggregation = "sequence",
    max_len: int | None = None,
    normalizer: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics): the reverse-KL distillation term, aggregated as `losses.grpo_loss` is.

    Give `teacher_logp_NxT` for the sampled estimate, or the two `..._topk_logp_NxTxK` for the
    top-k one (module docstring). `aggregation`, `max_len` and `normalizer` are `losses.aggregate`'s:
    pass the whole batch's normaliser to every micro-batch and add the losses.

    metrics (float32 scalars, stop-gradient): "distillation/reverse_kl", the token mean of the
    reverse-KL estimate (d_t, or the top-k KL) over this batch's real tokens.
    """
    mask = jnp.asarray(mask_NxT) != 0
    if (teacher_logp_NxT is None) == (teacher_topk_logp_NxTxK is None):
        raise ValueError("distillation_loss: give teacher_logp_NxT (sampled) or the top-k log-probs, not both")
    if teacher_logp_NxT is not None:
        per_token = sampled_reverse_kl_surrogate(student_logp_NxT, teacher_logp_NxT, old_logp_NxT)
        estimate = sampled_reverse_kl(student_logp_NxT, teacher_logp_NxT)
    else:
        if student_topk_logp_NxTxK is None:
            raise ValueError("distillation_loss: the top-k estimate needs student_topk_logp_NxTxK")
        per_token = top_k_reverse_kl(student_topk_logp_NxTxK, teacher_topk_logp_NxTxK, add_tail=add_tail)
        estimate = per_token
    loss = losses.aggregate(per_token, mask, aggregation, max_len=max_len, normalizer=normalizer)
    count = jnp.maximum(mask.sum().astype(jnp.float32), 1.0)
    kl_mean = jnp.sum(jnp.where(mask, jax.lax.stop_gradient(estimate), 0.0)) / count
    return loss, {"distillation/reverse_kl": kl_mean}
