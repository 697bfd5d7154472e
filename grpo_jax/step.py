"""The jitted pieces of one GRPO step: the optimizer, the update, the log-prob pass.

`make_update_fn` builds `update(params, opt_state, batch) -> (params, opt_state, metrics)` (one
jitted call: forward, GRPO loss, backward, AdamW; params and optimizer state donated);
`make_logprob_fn` the reference (or recomputed pi_old) log-probs; `prompt_groups` decides where each
prompt can run once for its G answers. `grpo_jax.train` drives them; research code can too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import optax

from grpo_jax import config as config_lib
from grpo_jax import losses
from grpo_jax import model as model_lib

log = logging.getLogger("grpo_jax")


def make_optimizer(optim: config_lib.OptimSection, total_updates: int):
    """AdamW with global-norm clipping and a warmup then constant or cosine schedule."""
    if optim.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, optim.learning_rate, optim.warmup_steps, max(total_updates, optim.warmup_steps + 1)
        )
    elif optim.warmup_steps:
        schedule = optax.join_schedules(
            [
                optax.linear_schedule(0.0, optim.learning_rate, optim.warmup_steps),
                optax.constant_schedule(optim.learning_rate),
            ],
            [optim.warmup_steps],
        )
    else:
        schedule = optax.constant_schedule(optim.learning_rate)
    parts = [optax.clip_by_global_norm(optim.max_grad_norm)] if optim.max_grad_norm > 0 else []
    parts.append(
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    )
    return optax.chain(*parts), schedule


def as_dtype(tree, dtype):
    """The tree with its floating-point leaves cast to `dtype` (integers kept)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def frozen_copy(tree, dtype):
    """A copy that shares no buffer with `tree`: the policy's buffers are donated to the update."""
    return jax.tree.map(
        lambda x: jnp.array(x, dtype=dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, copy=True),
        tree,
    )


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True)
class UpdateBatch:
    """What one optimizer step consumes; every array has a leading [A] micro-batch axis, then [M].

    tokens/attention: prompt then completion, [A, M, P+C]; the others [A, M, C] or [A, M].
    """

    tokens: jax.Array
    attention: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array
    sampler_logp: jax.Array
    ref_logp: jax.Array | None


jax.tree_util.register_dataclass(
    UpdateBatch, data_fields=[f.name for f in dataclasses.fields(UpdateBatch)], meta_fields=[]
)


def make_update_fn(graphdef, tx, grpo: config_lib.GRPOSection, temperature: float, group_size: int = 1):
    """Returns the jitted `update(params, opt_state, batch) -> (params, opt_state, metrics)`.

    Gradients of the A micro-batches are averaged inside one jitted call (lax.scan), so gradient
    accumulation costs no extra dispatch or host sync. group_size > 1: every micro-batch is whole
    groups of that many rows sharing a prompt, each prompt run once (`token_logprobs`).
    """

    def loss_fn(params, mb: UpdateBatch):
        num_targets = mb.completion_mask.shape[-1]
        logp, entropy = model_lib.token_logprobs(
            graphdef,
            params,
            mb.tokens,
            mb.attention,
            num_targets=num_targets,
            temperature=temperature,
            return_entropy=True,
            group_size=group_size,
        )
        loss, metrics = losses.grpo_loss(
            logp,
            mb.old_logp,
            mb.ref_logp if grpo.beta > 0 else None,
            mb.advantages,
            mb.completion_mask,
            eps_low=grpo.eps_low,
            eps_high=grpo.eps_high,
            beta=grpo.beta,
            kl=grpo.kl,
            aggregation=grpo.aggregation,
            max_len=num_targets,
            ratio=grpo.ratio,
        )
        mask = mb.completion_mask.astype(jnp.float32)
        denom = jnp.maximum(mask.sum(), 1.0)
        metrics = dict(metrics)
        metrics["entropy"] = jax.lax.stop_gradient((entropy * mask).sum() / denom)
        # How far the trainer's log-probs are from the sampler's (kernels, caching, dtype): TRL's name.
        metrics["sampling/sampling_logp_difference/mean"] = jax.lax.stop_gradient(
            (jnp.abs(logp - mb.sampler_logp) * mask).sum() / denom
        )
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def update(params, opt_state, batch: UpdateBatch):
        def micro_step(grad_sum, mb):
            (loss, metrics), grads = grad_fn(params, mb)
            return jax.tree.map(jnp.add, grad_sum, grads), (loss, metrics)

        num_micro = batch.completion_mask.shape[0]
        if num_micro == 1:
            # No accumulation: one plain grad, without a length-1 scan (a while loop on CPU that
            # splits the program) and without a zeros tree plus an add over every parameter.
            (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[0], batch))
            loss, metrics = loss[None], jax.tree.map(lambda x: x[None], metrics)
        else:
            zeros = jax.tree.map(jnp.zeros_like, params)
            grad_sum, (loss, metrics) = jax.lax.scan(micro_step, zeros, batch)
            grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            k: (v.min() if k.endswith("/min") else v.max() if k.endswith("/max") else v.mean())
            for k, v in metrics.items()
        }
        metrics["loss"] = loss.mean()
        metrics["grad_norm"] = _global_norm(grads)
        return params, opt_state, metrics

    return jax.jit(update, donate_argnums=(0, 1))


def make_logprob_fn(graphdef, temperature: float, compute_dtype=jnp.float32, group_size: int = 1):
    """Jitted per-token log-probs of the completion part; params are upcast (bf16 reference).
    group_size > 1: rows are whole groups sharing a prompt, each prompt run once."""

    @functools.partial(jax.jit, static_argnames="num_targets")
    def logprobs(params, tokens, attention, num_targets):
        params = as_dtype(params, compute_dtype)
        return model_lib.token_logprobs(
            graphdef,
            params,
            tokens,
            attention,
            num_targets=num_targets,
            temperature=temperature,
            group_size=group_size,
        )

    return logprobs


def prompt_groups(g_cfg: config_lib.GRPOSection, rows_per_micro: int, row_multiple: int) -> tuple[int, int]:
    """Group sizes for the update's micro-batches and for the log-prob pass over all rows: G where
    the rows are whole groups in order whose prompts split evenly over the devices (so each prompt
    is run once per group), else 1 (every row runs its own copy of the prompt)."""
    if not g_cfg.share_prompt_prefix:
        return 1, 1
    G = g_cfg.num_generations

    def whole(rows, in_order=True):
        return G if in_order and rows % G == 0 and (rows // G) % row_multiple == 0 else 1

    # Minibatches draw rows in a random order (as TRL), which breaks groups up.
    update_group = whole(rows_per_micro, in_order=g_cfg.num_minibatches == 1)
    logprob_group = whole(g_cfg.prompts_per_step * G)
    if update_group == 1:
        log.info(
            "update: each completion runs its own copy of the prompt (grpo.num_minibatches > 1, "
            "or micro-batches of %d rows are not whole groups over %d devices)",
            rows_per_micro,
            row_multiple,
        )
    return update_group, logprob_group
