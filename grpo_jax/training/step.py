"""The jitted pieces of one GRPO step: the update and the log-prob pass, and how their metrics add up.

`make_update_fn` builds `update(params, opt_state, batch) -> (params, opt_state, metrics)`: one
jitted call that runs forward, GRPO loss and backward over A micro-batches and one AdamW step
(params and optimizer state donated). `make_chunked_update` is the same update as one program per
micro-batch plus one for the AdamW step, for micro-batches of different shapes (length buckets,
`grpo_jax.training.length_buckets`). `make_logprob_fn` computes reference (or recomputed pi_old)
log-probs with rows split over the mesh. `prompt_groups` decides where each prompt can run once
for its G answers. `combine_update_metrics` reduces the metrics of a step's updates. The trainer
(`grpo_jax.training.train`) drives them; research code can too.

Exactness. Cutting a batch into micro-batches (gradient accumulation), devices (data parallel) or
both must give the full batch's gradient. Every micro-batch's loss is its numerator over the
*whole* optimizer batch's normaliser (`losses.loss_normalizer`: answers, real tokens or answers x
budget), and the micro-batch gradients are added, never averaged: a mean of per-micro-batch means
would weight the tokens of short micro-batches more under DAPO's token mean. Across devices the
same holds because the arrays are global (jit sums over every row, wherever it lives).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import config as config_lib
from grpo_jax.core import entropy_control
from grpo_jax.core import losses
from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding
from grpo_jax.training import step_loss
from grpo_jax.config.batch_plan import BatchPlan
from grpo_jax.training.update_batch import UpdateBatch  # noqa: F401 - its home before it moved

log = logging.getLogger("grpo_jax")


def as_dtype(tree, dtype):
    """The tree with its floating-point leaves cast to `dtype` (integers kept)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def frozen_copy(tree, dtype):
    """A copy that shares no buffer with `tree`: the policy's buffers are donated to the update."""
    return jax.tree.map(
        lambda x: jnp.array(x, dtype=dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, copy=True),
        tree,
    )


def global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of every leaf, in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


# How one metric adds up over pieces of a batch (micro-batches in an update, updates in a step).
# "share": the piece's part of a whole-batch value (loss over the whole batch's normaliser), summed;
# "min" / "max": over the pieces that hold tokens; every other metric is a token mean, so the pieces'
# values are weighted by their real-token counts (a piece whose tokens are all masked counts 0).
_SHARES = ("loss", "policy_loss", "aux_loss")
# Sums over the update's micro-batches that the adaptive entropy controller reads; not logged.
_CONTROLLER_SUMS = ("entropy_control/entropy_sum", "entropy_control/num_tokens")


def _reduction(name: str) -> str:
    if name in _SHARES or name in _CONTROLLER_SUMS:
        return "share"
    if name.endswith("/min"):
        return "min"
    if name.endswith("/max"):
        return "max"
    return "token_mean"


def _combine_micro_batches(metrics_A: dict[str, jax.Array], tokens_A: jax.Array) -> dict[str, jax.Array]:
    """Metrics of A micro-batches ([A] each) -> the update's, by `_reduction` (inside jit)."""
    has_tokens_A = tokens_A > 0
    any_tokens = jnp.any(has_tokens_A)
    total = jnp.maximum(tokens_A.sum(), 1.0)
    out = {}
    for name, v_A in metrics_A.items():
        match _reduction(name):
            case "share":
                out[name] = v_A.sum()
            case "min":
                out[name] = jnp.where(any_tokens, jnp.where(has_tokens_A, v_A, jnp.inf).min(), v_A[0])
            case "max":
                out[name] = jnp.where(any_tokens, jnp.where(has_tokens_A, v_A, -jnp.inf).max(), v_A[0])
            case _:
                out[name] = (v_A * tokens_A).sum() / total
    return out


def combine_update_metrics(per_update: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of every update of one step (mu passes x minibatches) -> the step's.

    Token means are weighted by each update's real tokens (`num_tokens`), min/max taken over all
    updates, `loss`/`policy_loss` averaged over updates, and `grad_norm` reported as its mean with
    `grad_norm/max` beside it. The first update of a batch has rho = 1 (exactly, unless pi_old is the sampler's),
    so clip fractions and ratios only mean something over all updates.
    """
    if not per_update:
        raise ValueError("combine_update_metrics: no updates")
    tokens = np.array([float(m["num_tokens"]) for m in per_update])
    weights = tokens / tokens.sum() if tokens.sum() > 0 else np.full(len(tokens), 1.0 / len(tokens))
    has_tokens = tokens > 0 if tokens.sum() > 0 else np.ones(len(tokens), bool)
    out: dict[str, float] = {}
    for name in per_update[0]:
        if name == "num_tokens":
            continue
        values = np.array([float(m[name]) for m in per_update])
        if name == "grad_norm":
            out["grad_norm"] = float(values.mean())
            out["grad_norm/max"] = float(values.max())
            continue
        if name == "skipped_updates":  # a count: how many of the step's updates were not applied
            out[name] = float(values.sum())
            continue
        match _reduction(name):
            case "share":
                out[name] = float(values.mean())
            case "min":
                out[name] = float(values[has_tokens].min())
            case "max":
                out[name] = float(values[has_tokens].max())
            case _:
                out[name] = float((values * weights).sum())
    return out


def router_token_count(attention_BxS) -> jax.Array:
    """The tokens the load-balancing loss of one update averages over (`grpo.router_aux_loss_coef`):
    every real token of its rows (attention [..., S], any leading axes), at least 1."""
    return jnp.maximum(jnp.sum(attention_BxS.astype(jnp.float32)), 1.0)


def _apply_grads(tx, params, opt_state, grads, metrics_A, tokens_A, grpo=None):
    """One AdamW step with the summed gradient of a batch's A micro-batches (their metrics [A]
    each, their real-token counts tokens_A), skipped when the loss or gradient is not finite.
    With `grpo.use_adaptive_entropy` the controller in opt_state moves by this update's entropy."""
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    metrics = _combine_micro_batches(metrics_A, tokens_A)
    entropy_sum = metrics.pop("entropy_control/entropy_sum", None)
    active_tokens = metrics.pop("entropy_control/num_tokens", None)
    if grpo is not None and grpo.use_adaptive_entropy:
        # TRL: the update's entropy over the tokens the loss trains on, then the coefficient for the next.
        measured = entropy_sum / jnp.maximum(active_tokens, 1.0)
        coef = entropy_control.next_coef(
            optax.tree_utils.tree_get(opt_state, "entropy_coef"), measured, target=grpo.entropy_target,
            delta=grpo.entropy_coef_delta, coef_min=grpo.entropy_coef_min, coef_max=grpo.entropy_coef_max)
        new_opt_state = optax.tree_utils.tree_set(new_opt_state, entropy_coef=coef, last_entropy=measured)
        metrics["entropy_coef"] = coef  # TRL logs the coefficient after the update
    grad_norm = global_norm(grads)
    # One NaN or inf (a reward, a log-prob, an overflow) would make every weight NaN and Adam's
    # moments with them: such an update is skipped, params and optimizer state unchanged.
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (new_params, new_opt_state), (params, opt_state))
    metrics["grad_norm"] = grad_norm
    metrics["num_tokens"] = tokens_A.sum()
    metrics["skipped_updates"] = 1.0 - finite.astype(jnp.float32)
    return params, opt_state, metrics


def make_update_fn(graphdef, tx, grpo: config_lib.GRPOSection, temperature: float, group_size: int = 1,
                   model_params_fn=None, compiler_options: dict | None = None,
                   off_policy: config_lib.OffPolicySection = config_lib.OffPolicySection()):
    """Returns the jitted `update(params, opt_state, batch, frozen=None) -> (params, opt_state, metrics)`.

    With `model_params_fn` ((params, frozen) -> the model's params; `Policy.model_params_fn`),
    `params` are what trains (adapters) and `frozen` what they are merged into (the base); only
    `params` get gradients and optimizer updates.

    The A micro-batches of `batch` run in one jitted call (lax.scan), each contributing its share
    of the whole batch's loss (module docstring), so accumulation is exact and costs no extra
    dispatch or host sync. group_size > 1: every micro-batch is whole groups of that many rows
    sharing a prompt, each prompt run once (`token_logprobs`).

    metrics (float32 scalars): grpo_loss's, `entropy`, the sampler correction's
    (`losses.sampler_correction`: `sampling/importance_sampling_ratio/*`, pi_old vs the sampler's
    `sampling/sampling_logp_difference/{mean,max}`; without the correction that difference is
    the loss's log-probs vs the sampler's), `entropy_coef` (with an entropy bonus: the applied
    coefficient, or the adaptive controller's next one), `loss`, `grad_norm` (before clipping), `num_tokens`, and
    `skipped_updates`: 1 when the loss or the gradient norm was not finite, in which case params
    and optimizer state come back unchanged. With a distillation teacher
    (`grpo.teacher_model_name_or_path`, the batch's teacher fields), `loss` adds `grpo.teacher_tau`
    times `distillation.distillation_loss` and the metrics its `distillation/reverse_kl`.
    """
    grad_fn = jax.value_and_grad(step_loss.make_loss_fn(graphdef, grpo, temperature, group_size, model_params_fn,
                                                        off_policy), has_aux=True)

    def update(params, opt_state, batch: UpdateBatch, frozen=None):
        num_micro, _, num_targets = batch.completion_mask.shape
        normalizer = losses.loss_normalizer(
            batch.completion_mask.reshape(-1, num_targets), grpo.resolved_aggregation(), max_len=num_targets
        )
        router_tokens = router_token_count(batch.attention)
        coef = None
        if grpo.use_adaptive_entropy:  # the controller's state rides in opt_state (entropy_control.controller)
            state = entropy_control.EntropyControlState(optax.tree_utils.tree_get(opt_state, "entropy_coef"),
                                                        optax.tree_utils.tree_get(opt_state, "last_entropy"))
            coef = entropy_control.applied_coef(state, grpo.entropy_target)
        if num_micro == 1:
            # No accumulation: one plain grad, without a length-1 scan (a while loop on CPU that
            # splits the program) and without a zeros tree plus an add over every parameter.
            (_, (metrics, tokens)), grads = grad_fn(params, jax.tree.map(lambda x: x[0], batch), normalizer, frozen,
                                                    coef, router_tokens)
            metrics, tokens_A = jax.tree.map(lambda x: x[None], metrics), tokens[None]
        else:

            def micro_step(grad_sum, mb):
                (_, aux), grads = grad_fn(params, mb, normalizer, frozen, coef, router_tokens)
                return jax.tree.map(jnp.add, grad_sum, grads), aux

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, (metrics, tokens_A) = jax.lax.scan(micro_step, zeros, batch)
        return _apply_grads(tx, params, opt_state, grads, metrics, tokens_A, grpo)

    return jax.jit(update, donate_argnums=(0, 1), compiler_options=compiler_options)


@dataclasses.dataclass(frozen=True)
class ChunkedUpdate:
    """The update as separate jitted programs, for micro-batches of different shapes (length
    buckets, `grpo_jax.training.length_buckets`), which one lax.scan cannot hold. Per optimizer update:

        grads = zeros(params)
        for mb in micro_batches:                      # UpdateBatch without the [A] axis: [M_k, ...]
            grads, metrics_k, tokens_k = accumulate(params, grads, mb, normalizer, router_tokens)
        params, opt_state, metrics = apply(params, opt_state, grads, [metrics_k...], [tokens_k...])

    `normalizer` is the whole batch's `losses.loss_normalizer` and `router_tokens` its
    `router_token_count` (the load-balancing loss's weights), so the sum is the full-batch
    gradient exactly as in `make_update_fn`, and `apply` reduces the metrics as it does. One
    program per micro-batch shape; `apply` one per number of micro-batches. `accumulate` donates
    grads, `apply` params and opt_state.
    """

    zeros: Callable
    accumulate: Callable
    apply: Callable


def make_chunked_update(graphdef, tx, grpo: config_lib.GRPOSection, temperature: float, *, mesh, params,
                        opt_state, group_size: int = 1, model_params_fn=None, frozen=None,
                        compiler_options: dict | None = None,
                        off_policy: config_lib.OffPolicySection = config_lib.OffPolicySection()) -> ChunkedUpdate:
    """`ChunkedUpdate` for the mesh: params, gradients and optimizer state in their training
    layout, each micro-batch's rows over the batch axes ("data", "fsdp", "expert"), scalars replicated. With
    `model_params_fn` (as `make_update_fn`'s), `accumulate` takes the frozen tree (`frozen`, for
    its layout) last."""
    if grpo.use_adaptive_entropy:
        raise ValueError("make_chunked_update: grpo.use_adaptive_entropy needs the controller's coefficient in "
                         "each micro-batch's loss, which only make_update_fn reads from opt_state; run it unbucketed")
    grad_fn = jax.value_and_grad(step_loss.make_loss_fn(graphdef, grpo, temperature, group_size, model_params_fn,
                                                        off_policy), has_aux=True)

    def accumulate(params, grad_sum, mb: UpdateBatch, normalizer, router_tokens, frozen=None):
        (_, (metrics, tokens)), grads = grad_fn(params, mb, normalizer, frozen, None, router_tokens)
        return jax.tree.map(jnp.add, grad_sum, grads), metrics, tokens

    def apply(params, opt_state, grads, metrics_list, tokens_list):
        metrics_A = jax.tree.map(lambda *xs: jnp.stack(xs), *metrics_list)
        return _apply_grads(tx, params, opt_state, grads, metrics_A, jnp.stack(tokens_list), grpo)

    p_sh = sharding.param_shardings(mesh, params)
    o_sh = sharding.opt_state_shardings(mesh, opt_state, params)
    rows, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    accumulate_in = (p_sh, p_sh, rows, rep, rep)
    if frozen is not None:
        accumulate_in += (sharding.param_shardings(mesh, frozen),)
    return ChunkedUpdate(
        zeros=jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), in_shardings=(p_sh,), out_shardings=p_sh),
        accumulate=sharding.MeshJit(jax.jit(accumulate, in_shardings=accumulate_in, out_shardings=(p_sh, rep, rep),
                                            donate_argnums=1, compiler_options=compiler_options), mesh),
        # grads is not donated to apply: params and opt_state take every output buffer already.
        apply=jax.jit(apply, in_shardings=(p_sh, o_sh, p_sh, rep, rep), out_shardings=(p_sh, o_sh, rep),
                      donate_argnums=(0, 1)),
    )


def make_logprob_fn(
    graphdef,
    temperature: float,
    *,
    mesh=None,
    params=None,
    compute_dtype=jnp.float32,
    group_size: int = 1,
    row_chunks: int = 1,
):
    """Jitted `logprobs(params, tokens_BxS, attention_BxS, *, num_targets, experts=None) -> logp_BxC`
    (float32). `experts` [B, S, L_sparse, K] int32 (routing replay, `UpdateBatch.experts`' layout):
    each token runs through these experts instead of its routers' top-k.

    params are upcast to `compute_dtype` (a bf16 reference computes in float32). With `mesh` (and
    `params`, any tree with the policy's structure, for its shardings), the rows of tokens,
    attention and the output are split over the batch axes ("data", "fsdp", "expert") and the weights take their training
    layout, so each device computes B / (data * fsdp) rows. group_size > 1: rows are whole groups
    sharing a prompt, each prompt run once. row_chunks > 1: the rows run as that many chunks one
    after the other (`lax.map`), so activations and logits are one chunk's, as in the update's
    micro-batches; chunk j holds groups j, j + row_chunks, ... so that every device keeps its own
    rows and each chunk has an equal share of them on every device.
    """

    def one_pass(params, tokens, attention, experts, num_targets):
        return model_lib.token_logprobs(graphdef, params, tokens, attention, num_targets=num_targets,
                                        temperature=temperature, group_size=group_size,
                                        expert_indices_BxLxSxK=step_loss.layer_major(experts))

    def logprobs(params, tokens, attention, num_targets, experts=None):
        params = as_dtype(params, compute_dtype)
        if row_chunks == 1:
            return one_pass(params, tokens, attention, experts, num_targets)
        rows, unit = tokens.shape[0], group_size

        def to_chunks(x):  # [B, ...] -> [A, B / A, ...], whole groups, strided
            x = x.reshape((rows // (unit * row_chunks), row_chunks, unit) + x.shape[1:]).swapaxes(0, 1)
            return x.reshape((row_chunks, rows // row_chunks) + x.shape[3:])

        # params ride along as the scan's carry rather than as a closure: under `model.remat` nnx
        # would otherwise see weights from the enclosing trace inside the loop body (TraceContextError).
        chunked_experts = None if experts is None else to_chunks(experts)
        _, out = jax.lax.scan(lambda p, ta: (p, one_pass(p, *ta, num_targets)), params,
                              (to_chunks(tokens), to_chunks(attention), chunked_experts))
        out = out.reshape((row_chunks, rows // (unit * row_chunks), unit, num_targets)).swapaxes(0, 1)
        return out.reshape(rows, num_targets)

    if mesh is None:
        jitted = replaying = jax.jit(logprobs, static_argnums=3)
    else:
        if params is None:
            raise ValueError("make_logprob_fn: a mesh needs `params` (for the weights' shardings)")
        rows = sharding.batch_sharding(mesh)

        def on_mesh(*row_args):  # jit's in_shardings name every positional argument passed
            return sharding.MeshJit(jax.jit(logprobs, static_argnums=3, out_shardings=rows,
                                            in_shardings=(sharding.param_shardings(mesh, params), rows, rows,
                                                          *row_args)), mesh)

        # experts (routing replay) [B, S, L, K]: rows over the mesh like the tokens.
        jitted, replaying = on_mesh(), on_mesh(rows)

    def call(params, tokens, attention, *, num_targets: int, experts=None):
        if experts is None:
            return jitted(params, tokens, attention, num_targets)
        return replaying(params, tokens, attention, num_targets, experts)

    call.jitted = jitted  # for inspecting the compiled program: call.jitted.lower(..., num_targets)
    call.replaying = replaying  # the same with experts: call.replaying.lower(..., num_targets, experts)
    return call


def logprob_row_chunks(g_cfg: config_lib.GRPOSection, row_multiple: int, group_size: int) -> int:
    """How many chunks the log-prob pass over a step's rows runs in: as many as the update has
    micro-batches per step (num_minibatches x grad_accum_steps, so a chunk is a micro-batch's size),
    fewer where the rows do not split into that many chunks of whole groups over the devices."""
    plan = BatchPlan.of(g_cfg, row_multiple)
    rows, unit, chunks = plan.rows, group_size * row_multiple, plan.micro_batches_per_step
    while chunks > 1 and rows % (chunks * unit):
        chunks -= 1
    return chunks


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
    # The log-prob passes run in chunks of a micro-batch's rows (`logprob_row_chunks`), but a chunk
    # of shared prompts holds whole groups. Where a micro-batch is smaller than one group (long
    # answers, one or two rows per micro-batch) sharing would make each chunk G / rows_per_micro
    # times the update's rows: at 8k tokens that pass, not the update, set the step's peak. Each
    # row then runs its own prompt (P / (P + C) more compute, ~6% at P = 512, C = 8k).
    logprob_group = whole(g_cfg.prompts_per_step * G) if rows_per_micro >= G else 1
    if update_group == 1:
        log.info(
            "update: each completion runs its own copy of the prompt (grpo.num_minibatches > 1, "
            "or micro-batches of %d rows are not whole groups over %d devices)",
            rows_per_micro,
            row_multiple,
        )
    return update_group, logprob_group


@functools.cache
def _minibatch_fn(mesh, num_micro: int):
    def take(arrays, row_index):
        return jax.tree.map(lambda x: x[row_index].reshape((num_micro, -1) + x.shape[1:]), arrays)

    return jax.jit(take, out_shardings=sharding.batch_sharding(mesh, row_axis=1))


def minibatch(full: UpdateBatch, row_index: np.ndarray, num_micro: int, mesh) -> UpdateBatch:
    """The rows `row_index` of a step's batch (global arrays [B, ...]) as an UpdateBatch
    [A, M, ...], each micro-batch's rows split over the batch axes ("data", "fsdp", "expert"). A gather on the devices, so
    one process and many run the same code (`row_index`: host ints, the same on every process)."""
    return _minibatch_fn(mesh, num_micro)(full, np.asarray(row_index, np.int32))
