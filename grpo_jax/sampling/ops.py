"""The device-side pieces both built-in engines (`static`, `continuous`) decode with: one model step
on the KV cache, the token draw (filters, Gumbel-max, log-probs), stop tests, forced lengths, the
per-row noise keys and the caches' layout on a mesh. Pure functions, traced inside the engines' jits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.distributed import sharding
from grpo_jax.model import moe


def decode_step(graphdef, params, caches, key_mask_BxS, tokens_B, positions_B, write_index, slot_bounds=None,
                record_experts: bool = False):
    """Feeds one token per row at cache slot write_index (one for all rows, or [B]): (next logits_BxV
    float32, new caches). slot_bounds: the lowest and highest write_index of the rows that count
    (`Attention.__call__`; computed from write_index when None). record_experts (a MoE model): a
    third output, the experts each sparse layer chose for each row's token, [L_sparse, B, K] int32."""
    model = nnx.merge(graphdef, params)
    layers = moe.start_recording(model) if record_experts else []
    h_Bx1xD, caches = model.hidden_states(tokens_B[:, None], positions_B[:, None], key_mask_BxS,
                                          caches, write_index, slot_bounds=slot_bounds)
    if not record_experts:
        return model.logits(h_Bx1xD)[:, 0], caches
    return model.logits(h_Bx1xD)[:, 0], caches, moe.recorded_experts(layers)[:, :, 0]


def filter_logits(logits_BxV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets logits outside the top-k set, then outside the top-p nucleus, to -inf."""
    neg_inf = jnp.array(-jnp.inf, logits_BxV.dtype)
    if top_k and top_k < logits_BxV.shape[-1]:
        kth_B = jax.lax.top_k(logits_BxV, top_k)[0][:, -1]
        logits_BxV = jnp.where(logits_BxV < kth_B[:, None], neg_inf, logits_BxV)
    if top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_BxV, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass strictly
        # before it is still below top_p (the most likely token always stays).
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum(before < top_p, axis=-1)
        threshold_B = jnp.take_along_axis(sorted_BxV, (kept - 1)[:, None], axis=-1)
        logits_BxV = jnp.where(logits_BxV < threshold_B, neg_inf, logits_BxV)
    return logits_BxV


def argmax_last(x_BxV: jax.Array) -> jax.Array:
    """First index of the maximum over the last axis, int32 [B].

    Two plain reductions (max, then min index where equal): XLA's CPU lowering of argmax is a
    (value, index) pair reduction, several times slower per decode step (benchmarks/NOTES.md).
    """
    v = x_BxV.shape[-1]
    top_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x_BxV == top_Bx1, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def row_keys(rng: jax.Array, row_ids_B: jax.Array) -> jax.Array:
    """One PRNG key per row, fold_in(rng, global row index): a row's samples do not depend on
    which other rows share its batch, so splitting the batch (threads, devices) changes nothing."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, row_ids_B)


def sample_tokens(logits_BxV, keys_B, step, sampling):
    """(token_B, log-prob_B under the unfiltered softmax(logits / T)); row b's noise is drawn
    from fold_in(keys_B[b], step) (`step` one for all rows, or one per row [B]). `sampling` is a
    `SamplingConfig`."""
    scaled = logits_BxV.astype(jnp.float32) / sampling.temperature
    logp_BxV = jax.nn.log_softmax(scaled, axis=-1)
    if sampling.greedy:
        token_B = argmax_last(scaled)
    else:
        # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
        filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
        v = filtered.shape[-1]
        if jnp.ndim(step) == 0:  # one step for all rows (the static engine): fold it in as a constant
            noise_BxV = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, step), (v,), jnp.float32))(keys_B)
        else:
            noise_BxV = jax.vmap(lambda k, t: jax.random.gumbel(jax.random.fold_in(k, t), (v,), jnp.float32))(
                keys_B, step)
        token_B = argmax_last(filtered + noise_BxV)
    token_B = token_B.astype(jnp.int32)
    return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]


def is_stop(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """True where a token is any of the stop ids (a chat model may have several: Qwen2.5-Instruct
    stops on <|im_end|> and <|endoftext|>). `eos_ids` is static: a few unrolled compares."""
    hit = tokens == eos_ids[0]
    for eos in eos_ids[1:]:
        hit = hit | (tokens == eos)
    return hit


def force_lengths(logits_SxV, step_S, length_S, eos_id: int, stop_ids: tuple[int, ...]):
    """Logits that make a row stop after exactly length_S[s] tokens (0: leave the row alone):
    every logit but `eos_id`'s is -inf at step length - 1, and every stop id's before it. For
    benchmarks whose completion lengths are fixed in advance (the same for every engine)."""
    v = logits_SxV.shape[-1]
    ids = jnp.arange(v, dtype=jnp.int32)
    is_stop_V = jnp.zeros((v,), bool)
    for e in stop_ids:
        is_stop_V = is_stop_V | (ids == e)
    forced = length_S > 0
    last = forced & (step_S == length_S - 1)
    before = forced & (step_S < length_S - 1)
    neg_inf = jnp.array(-jnp.inf, logits_SxV.dtype)
    logits_SxV = jnp.where(last[:, None] & (ids != eos_id)[None, :], neg_inf, logits_SxV)
    return jnp.where(before[:, None] & is_stop_V[None, :], neg_inf, logits_SxV)


def cache_sharding(mesh, num_kv_heads: int) -> NamedSharding:
    """A KV cache's layout on `mesh` (keys [B, K, H, S] and values [B, K, S, H] alike): rows over
    the batch axes ("data", "fsdp", "expert"), kv heads over "tensor" as in k_proj / v_proj."""
    row_devices = sharding.batch_size_multiple(mesh)
    return NamedSharding(mesh, sharding.fit_spec(P(sharding.BATCH_AXES, "tensor"), (row_devices, num_kv_heads), mesh))
