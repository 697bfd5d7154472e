"""The static engine: every row of a call prefilled at once, then one `jax.lax.while_loop` that
decodes all rows until the longest stops (cheapest for short or equal completion lengths).

  1. `prefill` (jit): one forward over the prompts (not N * G rows: each prompt is prefilled once
     per device that holds its rows), then each prompt's keys/values are repeated for its samples
     into a cache of exactly S = P + max_new_tokens slots per row.
  2. `decode` (jit, the state pytree donated so the cache is updated in place): loop: sample a
     token from the current logits, feed it at cache slot P + step (written with
     dynamic_update_slice) to get the next logits. Rows that emitted EOS keep feeding pad tokens and
     are masked; the loop exits early once every row is done (unless `ignore_eos`). A step attends
     only over the cache blocks written so far (`grpo_jax.model.blockwise.decode_attention`), so an
     unused max_new_tokens budget costs memory for the cache, not time.

`programs` wraps the two as the (prefill, decode) pair the `Sampler` jits; the token draw, stop
tests and model step are the shared `grpo_jax.sampling.ops`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.distributed import sharding
from grpo_jax.model import KVCache, default_positions, moe
from grpo_jax.sampling.engine import SamplingConfig
from grpo_jax.sampling.ops import cache_sharding, decode_step, force_lengths, is_stop, row_keys, sample_tokens


class DecodeState(NamedTuple):
    caches: list[KVCache]          # per layer, keys [B, K, H, S], values [B, K, S, H]
    key_mask_BxS: jax.Array        # 1 where a slot may hold a real token (prompt pads are 0)
    logits_BxV: jax.Array          # float32 logits for the next token to sample
    positions_B: jax.Array         # RoPE position of the next sampled token
    step: jax.Array                # int32 scalar: tokens sampled so far
    tokens_BxC: jax.Array
    logprobs_BxC: jax.Array
    done_B: jax.Array              # bool: EOS already emitted
    # MoE models, prefill(record_experts=True) only: the experts each sparse layer chose for every
    # prompt and completion slot, [B, L_sparse, P + C, K] int32 (`token_logprobs` replays them);
    # None otherwise.
    experts_BxLxSxK: jax.Array | None = None


def _pad_slots(x: jax.Array, axis: int, slots: int) -> jax.Array:
    """`slots` zeros appended along the cache's slot axis."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, slots)
    return jnp.pad(x, widths)


def prefill(graphdef, params, tokens_NxP, mask_NxP, *, num_samples: int, max_new_tokens: int,
            record_experts: bool = False) -> DecodeState:
    """Forward over N left-padded prompts once; repeat each row's KV G = `num_samples` times into
    S = P + max_new_tokens slots (row n * G + g of the state is prompt n). With rows sharded, the
    repeat is local: each device's G copies of its prompts are its own rows. record_experts (a MoE
    model): the state records the experts of every prompt token now, of every completion token in
    `decode` (DecodeState.experts_BxLxSxK).
    """
    model = nnx.merge(graphdef, params)
    g, c = num_samples, max_new_tokens
    p = tokens_NxP.shape[1]
    layers = moe.start_recording(model) if record_experts else []
    h_NxPxD, kv = model.hidden_states(tokens_NxP, default_positions(mask_NxP), mask_NxP, max_position=p)
    experts = None
    if record_experts:
        experts = _pad_slots(jnp.repeat(jnp.moveaxis(moe.recorded_experts(layers), 0, 1), g, axis=0), 2, c)
    # Left padding puts every prompt's last real token in slot P - 1.
    logits_NxV = model.logits(h_NxPxD[:, -1:])[:, 0]

    caches = [KVCache(_pad_slots(jnp.repeat(layer.k_BxKxHxS, g, axis=0), 3, c),
                      _pad_slots(jnp.repeat(layer.v_BxKxSxH, g, axis=0), 2, c)) for layer in kv]
    mask_BxP = jnp.repeat(mask_NxP, g, axis=0).astype(jnp.int32)
    b = mask_BxP.shape[0]
    # Completion slots count as real; the causal slot test hides the ones not yet written.
    key_mask_BxS = jnp.concatenate([mask_BxP, jnp.ones((b, c), jnp.int32)], axis=1)
    return DecodeState(
        caches=caches,
        key_mask_BxS=key_mask_BxS,
        logits_BxV=jnp.repeat(logits_NxV, g, axis=0),
        positions_B=mask_BxP.sum(axis=1),
        step=jnp.zeros((), jnp.int32),
        tokens_BxC=jnp.zeros((b, max_new_tokens), jnp.int32),
        logprobs_BxC=jnp.zeros((b, max_new_tokens), jnp.float32),
        done_B=jnp.zeros((b,), bool),
        experts_BxLxSxK=experts,
    )
def decode(graphdef, params, state: DecodeState, rng, *, prompt_len: int, sampling: SamplingConfig,
           eos_id: int | tuple[int, ...], pad_id: int, first_row=0, forced_length_B=None) -> DecodeState:
    """Samples up to max_new_tokens per row with a while_loop; stops early when all rows are done.

    A row is done once it samples any of the stop ids `eos_id` (one id or a tuple of them).
    Row b of this batch is global row first_row + b: its noise comes from `row_keys`.
    forced_length_B (benchmarks): row b stops after exactly that many tokens (`force_lengths`).
    """
    c = sampling.max_new_tokens
    eos_ids = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    b = state.done_B.shape[0]
    keys_B = row_keys(rng, jnp.asarray(first_row, jnp.int32) + jnp.arange(b, dtype=jnp.int32))

    def record(st: DecodeState) -> DecodeState:
        logits_BxV = st.logits_BxV
        if forced_length_B is not None:
            logits_BxV = force_lengths(logits_BxV, jnp.broadcast_to(st.step, (b,)), forced_length_B, eos_ids[0], eos_ids)
        token_B, logp_B = sample_tokens(logits_BxV, keys_B, st.step, sampling)
        token_B = jnp.where(st.done_B, pad_id, token_B)
        logp_B = jnp.where(st.done_B, 0.0, logp_B)
        start = (jnp.zeros((), jnp.int32), st.step)
        done_B = st.done_B if sampling.ignore_eos else st.done_B | is_stop(token_B, eos_ids)
        return st._replace(
            tokens_BxC=jax.lax.dynamic_update_slice(st.tokens_BxC, token_B[:, None], start),
            logprobs_BxC=jax.lax.dynamic_update_slice(st.logprobs_BxC, logp_B[:, None], start),
            done_B=done_B,
            step=st.step + 1,
        )

    def cond(st: DecodeState):
        if sampling.ignore_eos:
            # No row ever finishes early: a trip count, and (rows sharded) no all-reduce of the
            # rows' done flags across devices before every token.
            return st.step < c
        return (st.step < c) & ~jnp.all(st.done_B)

    def body(st: DecodeState) -> DecodeState:
        # Sample, then feed the new token (slot P + step) to get the next logits. After the last
        # token this forward is wasted (1 of C steps), but sampling is traced once, not twice:
        # each threefry + sort instance costs seconds of compile time on a CPU.
        st = record(st)
        token_B = jax.lax.dynamic_index_in_dim(st.tokens_BxC, st.step - 1, axis=1, keepdims=False)
        slot = prompt_len + st.step - 1
        if st.experts_BxLxSxK is None:
            logits_BxV, caches = decode_step(graphdef, params, st.caches, st.key_mask_BxS, token_B,
                                             st.positions_B, slot)
        else:  # the fed token's experts go to its slot
            logits_BxV, caches, experts_LxBxK = decode_step(graphdef, params, st.caches, st.key_mask_BxS, token_B,
                                                            st.positions_B, slot, record_experts=True)
            zero = jnp.zeros((), jnp.int32)
            st = st._replace(experts_BxLxSxK=jax.lax.dynamic_update_slice(
                st.experts_BxLxSxK, jnp.moveaxis(experts_LxBxK, 0, 1)[:, :, None], (zero, zero, slot, zero)))
        return st._replace(caches=caches, logits_BxV=logits_BxV, positions_B=st.positions_B + 1)

    state = state._replace(tokens_BxC=jnp.full_like(state.tokens_BxC, pad_id))
    return jax.lax.while_loop(cond, body, state)


def completion_mask(tokens_BxC, steps, eos_ids: tuple[int, ...], ignore_eos: bool):
    """(mask_BxC, truncated_B) of a decoded batch: 1 up to and including each row's first stop id
    within the `steps` tokens sampled (all 1 when EOS is ignored); truncated where no stop id is."""
    c = tokens_BxC.shape[1]
    if ignore_eos:
        mask_BxC = jnp.ones_like(tokens_BxC)
    else:
        is_eos = is_stop(tokens_BxC, eos_ids).astype(jnp.int32)
        eos_before = jnp.cumsum(is_eos, axis=1) - is_eos
        mask_BxC = ((eos_before == 0) & (jnp.arange(c) < steps)).astype(jnp.int32)
    truncated_B = ~jnp.any(is_stop(tokens_BxC, eos_ids) & (mask_BxC > 0), axis=1)
    return mask_BxC, truncated_B


def programs(graphdef, *, prompt_len: int, copies: int, sampling: SamplingConfig, eos_ids: tuple[int, ...], pad_id: int,
             rng_impl: str | None, forced: bool, on_trace=lambda: None):
    """The static engine's (prefill_fn, decode_fn), to be jitted by the `Sampler`.

    prefill_fn(params, tokens_MxP, mask_MxP) -> (state, prompt tokens [M * copies, P]).
    decode_fn(params, state, rng, first_row[, forced_length_B]) -> (final state, (prompt mask,
    tokens, mask, truncated, log-probs) in `SampleOutput` order). `rng` is a raw key or, with
    `rng_impl`, a typed key's bits; `on_trace()` is called each time prefill is traced.
    """

    def prefill_fn(params, tokens_MxP, mask_MxP):
        on_trace()
        state = prefill(graphdef, params, tokens_MxP, mask_MxP, num_samples=copies,
                        max_new_tokens=sampling.max_new_tokens, record_experts=sampling.record_experts)
        return state, jnp.repeat(tokens_MxP, copies, axis=0)

    def decode_fn(params, state, rng, first_row, *forced_length_B):
        if rng_impl is not None:  # a typed key, passed as its bits (host data, replicated)
            rng = jax.random.wrap_key_data(rng, impl=rng_impl)
        st = decode(graphdef, params, state, rng, prompt_len=prompt_len, sampling=sampling,
                    eos_id=eos_ids, pad_id=pad_id,
                    first_row=first_row, forced_length_B=forced_length_B[0] if forced else None)
        mask_BxP = state.key_mask_BxS[:, :prompt_len]
        mask_BxC, truncated_B = completion_mask(st.tokens_BxC, st.step, eos_ids, sampling.ignore_eos)
        # The final state goes back out so every donated buffer (the KV cache above all)
        # aliases an output: XLA then reuses the prefill's cache memory in place.
        return st, (mask_BxP, st.tokens_BxC, mask_BxC, truncated_B, st.logprobs_BxC * mask_BxC)

    return prefill_fn, decode_fn


def state_shardings(mesh, num_layers: int, num_kv_heads: int, record_experts: bool = False) -> DecodeState:
    """`DecodeState`'s layout on `mesh`: rows over the batch axes ("data", "fsdp", "expert"), the caches as `cache_sharding`."""
    rows, whole = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    heads = cache_sharding(mesh, num_kv_heads)
    return DecodeState(caches=[KVCache(heads, heads) for _ in range(num_layers)],
                       key_mask_BxS=rows, logits_BxV=rows, positions_B=rows, step=whole,
                       tokens_BxC=rows, logprobs_BxC=rows, done_B=rows,
                       experts_BxLxSxK=rows if record_experts else None)
