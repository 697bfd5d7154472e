"""The loss of one micro-batch as the update differentiates it: the policy's log-probs and
entropy (`model.token_logprobs`), the sampler correction and high-entropy token weights, GRPO's
clipped objective with its KL (`losses.grpo_loss`), the distillation term and the entropy bonus,
and the metrics the update reports. `make_loss_fn` is what `grpo_jax.training.step`'s update and
chunked update take the gradient of."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax.core import distillation
from grpo_jax.core import entropy_control
from grpo_jax.core import losses
from grpo_jax.core import objectives
from grpo_jax.model import moe

if TYPE_CHECKING:
    from grpo_jax.training.update_batch import UpdateBatch


def make_loss_fn(graphdef, grpo: config_lib.GRPOSection, temperature: float, group_size: int, model_params_fn=None,
                 off_policy: config_lib.OffPolicySection = config_lib.OffPolicySection()):
    """`loss_fn(params, mb, normalizer, frozen) -> (loss, (metrics, num_tokens))` of one micro-batch
    [M, ...]: its share of the whole batch's loss (`normalizer` is the whole batch's), and its
    metrics. `params` are what trains: the model's params, or (with `model_params_fn`, the
    policy's merge: `grpo_jax.training.policy`) adapters merged into `frozen` inside the loss.
    `off_policy`: the sampler correction's settings. A micro-batch with `experts` (routing
    replay) routes each token to them: the router's gradient then comes from its probabilities
    at those experts (the mixing weights), not from which experts it would pick."""

    loss_type, aggregation, ratio = grpo.resolved_loss()

    aux_coef = grpo.router_aux_loss_coef

    def loss_fn(params, mb: UpdateBatch, normalizer, frozen=None, entropy_coef=None, router_tokens=None):
        num_targets = mb.completion_mask.shape[-1]
        out = model_lib.token_logprobs(
            graphdef,
            params if model_params_fn is None else model_params_fn(params, frozen),
            mb.tokens,
            mb.attention,
            num_targets=num_targets,
            temperature=temperature,
            return_entropy=True,
            group_size=group_size,
            gather_ids_BxCxK=mb.teacher_topk_ids,
            expert_indices_BxLxSxK=layer_major(mb.experts),
            return_routing=aux_coef > 0,
        )
        (logp, entropy), routing = out if aux_coef > 0 else (out, None)
        student_topk_logp = None
        if mb.teacher_topk_ids is not None:
            logp, student_topk_logp = logp
        # pi_old: given, or (one update per batch: these very params) the loss's own log-probs.
        old_logp = jax.lax.stop_gradient(logp) if mb.old_logp is None else mb.old_logp
        mask = mb.completion_mask.astype(jnp.float32)
        is_weights, is_metrics, entropy_mask = _token_weights(grpo, off_policy, old_logp, mb.sampler_logp, entropy, mask)
        # `max_len` only sets grpo_loss's default normaliser; the one passed in is the batch's.
        surrogate = objectives.surrogate_for(loss_type, eps_low=grpo.eps_low, eps_high=grpo.eps_high, ratio=ratio,
                                             key=_batch_key(mb) if loss_type == "clip_cov" else None,
                                             **grpo.objective_options())
        loss, metrics = losses.grpo_loss(
            logp, old_logp, mb.ref_logp if grpo.beta > 0 else None, mb.advantages, mb.completion_mask,
            eps_low=grpo.eps_low, eps_high=grpo.eps_high, beta=grpo.beta, kl=grpo.kl, aggregation=aggregation,
            max_len=num_targets, ratio=ratio, normalizer=normalizer, is_weights=is_weights,
            use_bias_correction_kl=grpo.use_bias_correction_kl, surrogate=surrogate,
        )
        distill_metrics = {}
        if grpo.teacher_model_name_or_path:
            distill_loss, distill_metrics = distillation.distillation_loss(
                logp, mb.completion_mask, teacher_logp_NxT=mb.teacher_logp, old_logp_NxT=mb.old_logp,
                student_topk_logp_NxTxK=student_topk_logp, teacher_topk_logp_NxTxK=mb.teacher_topk_logp,
                add_tail=grpo.loss_add_tail, aggregation=aggregation, max_len=num_targets,
                normalizer=normalizer)
            loss = loss + grpo.teacher_tau * distill_loss
        if grpo.entropy_coef != 0.0 or grpo.use_adaptive_entropy:
            loss = _with_entropy_bonus(grpo, loss, metrics, entropy, mask, entropy_mask, aggregation=aggregation,
                                       num_targets=num_targets, normalizer=normalizer, entropy_coef=entropy_coef)
        if routing is not None:
            loss, metrics = _with_router_aux_loss(aux_coef, loss, metrics, routing, mb.attention, group_size,
                                                  num_targets, router_tokens)
        num_tokens = mask.sum()
        metrics = {**metrics, **is_metrics, **distill_metrics}
        _add_logp_metrics(metrics, logp, mb.sampler_logp, entropy, mask, num_tokens, has_correction=bool(is_metrics))
        metrics["loss"] = loss
        return loss, (metrics, num_tokens)

    return loss_fn


def _with_router_aux_loss(coef: float, loss, metrics: dict, routing, attention_BxS, group_size: int, num_targets: int,
                          router_tokens):
    """loss + coef * this micro-batch's share of the load-balancing loss (`moe.load_balancing_loss`
    over its real tokens, times its tokens / `router_tokens`, the update's: micro-batches and
    length-bucket chunks add up to the token-weighted mean of theirs). `aux_loss`: the share, which
    the update sums into its load-balancing loss."""
    weights = moe.routing_token_weights(attention_BxS, group_size, num_targets)
    aux = moe.load_balancing_loss(routing.router_logits, routing.expert_indices[0].shape[-1], weights)
    share = aux * jnp.sum(weights) / router_tokens
    return loss + coef * share, {**metrics, "aux_loss": share}


def layer_major(experts_BxSxLxK):
    """Routing replay's experts as the trainer's rows hold them, [B, S, L_sparse, K] (token slots on
    axis 1, as `tokens`; int16, `rollout.EXPERTS_DTYPE`), in `model.token_logprobs`'s layout
    [B, L_sparse, S, K] int32; None stays None."""
    return None if experts_BxSxLxK is None else jnp.moveaxis(experts_BxSxLxK, 1, 2).astype(jnp.int32)


def _token_weights(grpo: config_lib.GRPOSection, off_policy: config_lib.OffPolicySection, old_logp_MxC, sampler_logp_MxC, entropy_MxC, mask_MxC):
    """(is_weights or None, the sampler correction's metrics, the high-entropy mask or None): the
    per-token weights of the clipped term. The sampler correction's (vLLM importance sampling);
    top_entropy_quantile: the clipped term only on the micro-batch's high-entropy tokens (a
    constant 0/1 weight beside the correction's; the KL and the normaliser keep every token)."""
    is_weights, is_metrics = None, {}
    if off_policy.vllm_importance_sampling_correction:
        is_weights, is_metrics = losses.sampler_correction(
            old_logp_MxC, sampler_logp_MxC, mask_MxC, off_policy.vllm_importance_sampling_mode,
            clip_max=off_policy.vllm_importance_sampling_clip_max, clip_min=off_policy.vllm_importance_sampling_clip_min)
    entropy_mask = None
    if grpo.top_entropy_quantile < 1.0:
        entropy_mask = entropy_control.high_entropy_mask(entropy_MxC, mask_MxC, grpo.top_entropy_quantile)
        keep = entropy_mask.astype(jnp.float32)
        is_weights = keep if is_weights is None else is_weights * keep
    return is_weights, is_metrics, entropy_mask


def _with_entropy_bonus(grpo, loss, metrics: dict, entropy_MxC, mask_MxC, entropy_mask_MxC, *, aggregation: str,
                        num_targets: int, normalizer, entropy_coef):
    """`loss` minus the entropy bonus (fixed `grpo.entropy_coef`, or the adaptive controller's
    `entropy_coef`); writes the applied coefficient and the controller's sums into `metrics`."""
    coef = grpo.entropy_coef if entropy_coef is None else entropy_coef
    bonus = entropy_control.entropy_bonus(entropy_MxC, mask_MxC, aggregation, entropy_mask=entropy_mask_MxC,
                                          max_len=num_targets, normalizer=normalizer)
    loss = loss - coef * bonus
    metrics["entropy_coef"] = jnp.asarray(coef, jnp.float32)
    active = mask_MxC if entropy_mask_MxC is None else mask_MxC * entropy_mask_MxC
    metrics["entropy_control/entropy_sum"] = jax.lax.stop_gradient((entropy_MxC * active).sum())
    metrics["entropy_control/num_tokens"] = active.sum()
    return loss


def _add_logp_metrics(metrics: dict, logp_MxC, sampler_logp_MxC, entropy_MxC, mask_MxC, num_tokens,
                      has_correction: bool) -> None:
    """The token-mean entropy and, without the sampler correction (which reports its own), how far
    the trainer's log-probs are from the sampler's (kernels, caching, dtype): TRL's names."""
    denom = jnp.maximum(num_tokens, 1.0)
    metrics["entropy"] = jax.lax.stop_gradient((entropy_MxC * mask_MxC).sum() / denom)
    if not has_correction:
        diff = jax.lax.stop_gradient(jnp.abs(logp_MxC - sampler_logp_MxC) * mask_MxC)
        metrics["sampling/sampling_logp_difference/mean"] = diff.sum() / denom
        metrics["sampling/sampling_logp_difference/max"] = diff.max()


def _batch_key(mb: UpdateBatch) -> jax.Array:
    """Clip-Cov's PRNG key for one micro-batch: a checksum of its tokens, so a run draws the same
    tokens again on a rerun (and on resume) without a key threaded through the update."""
    tokens = mb.tokens.astype(jnp.uint32)
    position = jnp.arange(1, tokens.size + 1, dtype=jnp.uint32).reshape(tokens.shape)
    return jax.random.fold_in(jax.random.key(0), (tokens * position).sum())
