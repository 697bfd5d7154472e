"""Continuous batching for the sampler: a fixed number of decode slots; a row that stops hands its
slot to the next waiting row, so the decode loop runs on live rows instead of a static batch that
waits for its longest completion.

Rows are laid out as in the static engine (`grpo_jax.sampling.static`): B = N * G rows, row r is prompt
r // G, sample r % G; with D = data * fsdp devices, device d holds rows [d * Q, (d + 1) * Q),
Q = B / D, and prefills only the prompts of those rows. Each device runs its own queue and its own
S slots (every per-device step below is a `vmap` over a leading device axis, so nothing crosses
devices except the loop's exit test and the tensor-parallel model itself):

  1. `prefill_prompts` (jit): one forward over the device's prompts (once per prompt, not per
     sample) into a prompt store: each prompt's keys and values [K, H, P], its mask, the logits of
     its last position and its real length.
  2. `generate` (jit, one while_loop): every iteration samples one token for every slot, writes it
     to the row's outputs and feeds it to the model at the slot's own cache position (one write
     index per row); a row stops at any stop id or at max_new_tokens. Every `refill_every`
     iterations the slots whose row stopped take the next waiting rows: the prompt's keys and
     values are copied into the slot's first P cache slots (the prompt is never run again), its
     logits and position set, the row's step reset. The old row's completion entries need no
     clearing: a slot attends only up to its own write position. The loop ends when every row is
     done.

A row's noise is fold_in(fold_in(rng, global row), the row's own step): the draw the static
sampler makes for that row at that step, whatever slot or device the row lands in. Tokens and
log-probs therefore equal the static sampler's up to the floating-point order of the attention's
sums (a slot attends over the blocks its live neighbours have written, a static row over its batch's;
masked slots add exact zeros but change the summation tree).

Each slot holds a cache of P + C slots: S slots cost S / B of the static sampler's cache.

`programs` wraps the two as the (prefill, decode) pair the `Sampler` jits; the token draw, stop
tests and model step are the shared `grpo_jax.sampling.ops`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.distributed import sharding
from grpo_jax.model import KVCache, default_positions
from grpo_jax.model.kernels import constrain_rows
from grpo_jax.sampling.engine import SamplingConfig
from grpo_jax.sampling.ops import cache_sharding, decode_step, force_lengths, is_stop, row_keys, sample_tokens


class PromptStore(NamedTuple):
    """The device's prompts after prefill; leading axis M (prefill rows, M / D per device)."""

    keys: list[jax.Array]          # per layer [M, K, H, P]
    values: list[jax.Array]        # per layer [M, K, P, H]
    mask_MxP: jax.Array            # int32, 1 = real prompt token (left padded)
    logits_MxV: jax.Array          # float32, the logits of each prompt's last position
    length_M: jax.Array            # int32, real prompt tokens (the first completion token's position)


class SlotState(NamedTuple):
    """The decode loop's carry. Slot arrays have D * S rows, row arrays D * Q, `next_row` D."""

    caches: list[KVCache]          # per layer, keys [D*S, K, H, P + C], values [D*S, K, P + C, H]
    key_mask_SxL: jax.Array        # int32, the slot's prompt mask, then 1 for completion slots
    logits_SxV: jax.Array          # float32, the next token's logits per slot
    positions_S: jax.Array         # int32, RoPE position of the slot's next token
    slot_row: jax.Array            # int32, local row (in [0, Q)) the slot decodes
    slot_step: jax.Array           # int32, tokens that row has sampled
    slot_done: jax.Array           # bool, the slot's row stopped (or the slot never had one)
    next_row: jax.Array            # int32 [D], the device's next waiting row
    tokens_QxC: jax.Array          # int32 [D*Q, C], pad_id after a row's last token
    logprobs_QxC: jax.Array        # float32 [D*Q, C], 0 after a row's last token
    length_Q: jax.Array            # int32 [D*Q], tokens sampled per row (its stop id included)
    iteration: jax.Array           # int32 scalar


def prefill_prompts(model, tokens_MxP, mask_MxP) -> PromptStore:
    """One forward over the M prefill rows (left padded to P): the prompt store."""
    p = tokens_MxP.shape[1]
    h_MxPxD, kv = model.hidden_states(tokens_MxP, default_positions(mask_MxP), mask_MxP, max_position=p)
    return PromptStore(keys=[layer.k_BxKxHxS for layer in kv], values=[layer.v_BxKxSxH for layer in kv],
                       mask_MxP=mask_MxP.astype(jnp.int32), logits_MxV=model.logits(h_MxPxD[:, -1:])[:, 0],
                       length_M=mask_MxP.astype(jnp.int32).sum(axis=1))


def empty_slots(store: PromptStore, *, devices: int, slots_per_device: int, rows_per_device: int,
                max_new_tokens: int, pad_id: int) -> SlotState:
    """Every slot free ("done"), every row waiting; caches of P + C slots, zero."""
    s, q, c = devices * slots_per_device, devices * rows_per_device, max_new_tokens
    p = store.mask_MxP.shape[1]
    caches = [KVCache(jnp.zeros((s, *k.shape[1:3], p + c), k.dtype), jnp.zeros((s, v.shape[1], p + c, v.shape[3]), v.dtype))
              for k, v in zip(store.keys, store.values)]
    return SlotState(
        caches=caches,
        key_mask_SxL=jnp.ones((s, p + c), jnp.int32),
        logits_SxV=jnp.zeros((s, store.logits_MxV.shape[1]), jnp.float32),
        positions_S=jnp.zeros((s,), jnp.int32),
        slot_row=jnp.full((s,), rows_per_device, jnp.int32),
        slot_step=jnp.zeros((s,), jnp.int32),
        slot_done=jnp.ones((s,), bool),
        next_row=jnp.zeros((devices,), jnp.int32),
        tokens_QxC=jnp.full((q, c), pad_id, jnp.int32),
        logprobs_QxC=jnp.zeros((q, c), jnp.float32),
        length_Q=jnp.zeros((q,), jnp.int32),
        iteration=jnp.zeros((), jnp.int32),
    )


def _per_device(x: jax.Array, devices: int) -> jax.Array:
    """[D * X, ...] -> [D, X, ...], the device axis split over the mesh's row axes."""
    return constrain_rows(x.reshape(devices, -1, *x.shape[1:]))


def _flat(x: jax.Array) -> jax.Array:
    return constrain_rows(x.reshape(-1, *x.shape[2:]))


def refill(st: SlotState, store: PromptStore, *, devices: int, rows_per_device: int) -> SlotState:
    """Slots whose row stopped take the device's next waiting rows, in row order.

    A taken slot gets its prompt's keys and values in cache slots [0, P), the prompt's mask, last
    logits and length; its step restarts at 0. Row q's prompt is local prefill row q // (Q / M_d).
    """
    d, q = devices, rows_per_device
    m_d = store.mask_MxP.shape[0] // d
    copies = q // m_d  # rows per prefill row on a device
    p = store.mask_MxP.shape[1]

    def choose(done_S, row_S, next_row):
        # The k-th free slot (in slot order) takes waiting row next_row + k, while rows remain.
        candidate = next_row + jnp.cumsum(done_S.astype(jnp.int32)) - 1
        take = done_S & (candidate < q)
        return take, jnp.where(take, candidate, row_S), next_row + take.sum(dtype=jnp.int32)

    take_DxS, row_DxS, next_row = jax.vmap(choose)(_per_device(st.slot_done, d), _per_device(st.slot_row, d),
                                                   st.next_row)
    prompt_DxS = jnp.minimum(row_DxS, q - 1) // copies

    def pick(store_x, current_x):
        """current_x [D*S, ...] with taken slots replaced by their prompt's store_x [D*M_d, ...]."""
        chosen = jax.vmap(lambda s, i: s[i])(_per_device(store_x, d), prompt_DxS)
        cur = _per_device(current_x, d)
        t = take_DxS.reshape(take_DxS.shape + (1,) * (cur.ndim - 2))
        return _flat(jnp.where(t, chosen.astype(cur.dtype), cur))

    caches = []
    for layer, k_store, v_store in zip(st.caches, store.keys, store.values):
        k_prompt = pick(k_store, layer.k_BxKxHxS[..., :p])
        v_prompt = pick(v_store, layer.v_BxKxSxH[:, :, :p])
        caches.append(KVCache(jax.lax.dynamic_update_slice_in_dim(layer.k_BxKxHxS, k_prompt, 0, axis=3),
                              jax.lax.dynamic_update_slice_in_dim(layer.v_BxKxSxH, v_prompt, 0, axis=2)))
    take = _flat(take_DxS)
    return st._replace(
        caches=caches,
        key_mask_SxL=jax.lax.dynamic_update_slice_in_dim(st.key_mask_SxL, pick(store.mask_MxP, st.key_mask_SxL[:, :p]),
                                                         0, axis=1),
        logits_SxV=pick(store.logits_MxV, st.logits_SxV),
        positions_S=pick(store.length_M, st.positions_S),
        slot_row=_flat(row_DxS),
        slot_step=jnp.where(take, 0, st.slot_step),
        slot_done=st.slot_done & ~take,
        next_row=next_row,
    )


def generate(graphdef, params, st: SlotState, store: PromptStore, rng, first_row, *, devices: int,
             rows_per_device: int, sampling: SamplingConfig, eos_ids: tuple[int, ...], pad_id: int, refill_every: int,
             forced_length_Q=None) -> SlotState:
    """Decodes every row through the slots (module docstring); returns the final state, whose
    tokens_QxC / logprobs_QxC / length_Q hold every row's completion."""
    d, q = devices, rows_per_device
    c = sampling.max_new_tokens
    p = store.mask_MxP.shape[1]
    device_of_slot = jnp.repeat(jnp.arange(d, dtype=jnp.int32), st.slot_row.shape[0] // d)

    def rows_at(x_Q, local_row_S):
        """x_Q[row] for each slot's row, on the slot's own device."""
        rows = _per_device(jnp.minimum(local_row_S, q - 1), d)
        return _flat(jax.vmap(lambda x, i: x[i])(_per_device(x_Q, d), rows))

    def write_rows(x_Q, local_row_S, values_S, step_S=None):
        """x_Q with each slot's value written at its row (and step); rows >= Q write nothing."""
        rows, values = _per_device(local_row_S, d), _per_device(values_S, d)
        if step_S is None:
            out = jax.vmap(lambda x, i, v: x.at[i].set(v, mode="drop"))(_per_device(x_Q, d), rows, values)
        else:
            out = jax.vmap(lambda x, i, t, v: x.at[i, t].set(v, mode="drop"))(
                _per_device(x_Q, d), rows, _per_device(step_S, d), values)
        return _flat(out)

    def body(st: SlotState) -> SlotState:
        keys_S = row_keys(rng, jnp.asarray(first_row, jnp.int32) + device_of_slot * q + jnp.minimum(st.slot_row, q - 1))
        logits = st.logits_SxV
        if forced_length_Q is not None:
            logits = force_lengths(logits, st.slot_step, rows_at(forced_length_Q, st.slot_row), eos_ids[0], eos_ids)
        token_S, logp_S = sample_tokens(logits, keys_S, st.slot_step, sampling)
        live = ~st.slot_done
        target = jnp.where(live, st.slot_row, q)  # finished and empty slots write nowhere
        stops = st.slot_step + 1 >= c
        if not sampling.ignore_eos:
            stops = stops | is_stop(token_S, eos_ids)
        # The slot's own cache position; a finished slot's writes land in its own (free) cache,
        # hidden from the next row, which writes each position before attending to it.
        write_S = p + jnp.minimum(st.slot_step, c - 1)
        # Attention visits the cache only up to the furthest live slot's position (and from the
        # nearest one's window): a step costs what the longest live row has written, not P + C.
        # Finished slots may then see nothing; their outputs are never read.
        bounds = (jnp.min(jnp.where(live, write_S, p + c)), jnp.max(jnp.where(live, write_S, 0)))
        logits_SxV, caches = decode_step(graphdef, params, st.caches, st.key_mask_SxL, jnp.where(live, token_S, pad_id),
                                         st.positions_S, write_S, bounds)
        st = st._replace(
            caches=caches, logits_SxV=logits_SxV, positions_S=st.positions_S + live,
            slot_step=st.slot_step + live, slot_done=st.slot_done | (live & stops),
            tokens_QxC=write_rows(st.tokens_QxC, target, token_S, st.slot_step),
            logprobs_QxC=write_rows(st.logprobs_QxC, target, logp_S, st.slot_step),
            length_Q=write_rows(st.length_Q, target, st.slot_step + 1), iteration=st.iteration + 1)
        due = (st.iteration % refill_every == 0) & jnp.any(st.next_row < q) & jnp.any(st.slot_done)
        return jax.lax.cond(due, lambda s: refill(s, store, devices=d, rows_per_device=q), lambda s: s, st)

    def cond(st: SlotState):
        return jnp.any(~st.slot_done) | jnp.any(st.next_row < q)

    st = refill(st, store, devices=d, rows_per_device=q)
    return jax.lax.while_loop(cond, body, st)


def outputs(st: SlotState, *, eos_ids: tuple[int, ...], ignore_eos: bool):
    """(tokens_BxC, mask_BxC, truncated_B, logprobs_BxC) in row order, as the static sampler's."""
    c = st.tokens_QxC.shape[1]
    mask = (jnp.arange(c, dtype=jnp.int32)[None, :] < st.length_Q[:, None]).astype(jnp.int32)
    if ignore_eos:
        mask = jnp.ones_like(st.tokens_QxC)
    truncated = ~jnp.any(is_stop(st.tokens_QxC, eos_ids) & (mask > 0), axis=1)
    return st.tokens_QxC, mask, truncated, st.logprobs_QxC * mask


def programs(graphdef, *, copies: int, devices: int, rows_per_device: int, slots_per_device: int,
             sampling: SamplingConfig, eos_ids: tuple[int, ...], pad_id: int, refill_every: int,
             rng_impl: str | None, forced: bool, on_trace=lambda: None):
    """The continuous engine's (prefill_fn, decode_fn), to be jitted by the `Sampler`, with the
    static engine's signatures (`static.programs`); the state is (slots, prompt store)."""

    def prefill_fn(params, tokens_MxP, mask_MxP):
        on_trace()
        store = prefill_prompts(nnx.merge(graphdef, params), tokens_MxP, mask_MxP)
        slot_state = empty_slots(store, devices=devices, slots_per_device=slots_per_device,
                                 rows_per_device=rows_per_device, max_new_tokens=sampling.max_new_tokens,
                                 pad_id=pad_id)
        return (slot_state, store), jnp.repeat(tokens_MxP, copies, axis=0)

    def decode_fn(params, state, rng, first_row, *forced_length_B):
        if rng_impl is not None:
            rng = jax.random.wrap_key_data(rng, impl=rng_impl)
        slot_state, store = state
        st = generate(graphdef, params, slot_state, store, rng, first_row, devices=devices,
                      rows_per_device=rows_per_device, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id,
                      refill_every=refill_every, forced_length_Q=forced_length_B[0] if forced else None)
        tokens, mask, truncated, logprobs = outputs(st, eos_ids=eos_ids, ignore_eos=sampling.ignore_eos)
        return (st, store), (jnp.repeat(store.mask_MxP, copies, axis=0), tokens, mask, truncated, logprobs)

    return prefill_fn, decode_fn


def state_shardings(mesh, num_layers: int, num_kv_heads: int) -> tuple[SlotState, PromptStore]:
    """(slots, prompt store)'s layout on `mesh`: rows and slots over the batch axes ("data", "fsdp", "expert"), the caches
    as `ops.cache_sharding`, the iteration count whole."""
    rows, whole = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    heads = cache_sharding(mesh, num_kv_heads)
    caches = [KVCache(heads, heads) for _ in range(num_layers)]
    slot_state = SlotState(caches, *([rows] * 10), whole)
    store = PromptStore([heads] * len(caches), [heads] * len(caches), rows, rows, rows)
    return slot_state, store
