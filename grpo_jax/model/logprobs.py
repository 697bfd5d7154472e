"""`token_logprobs`: the log-probability (and entropy) of each target token, from the params pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.model import moe
from grpo_jax.model.transformer import default_positions

# Above this many float32 logits ([B, C, V] elements, 256 MiB) token_logprobs works in chunks;
# inside one chunk the logits, their log-softmax and (for entropy) its exp briefly coexist.
_MAX_LOGITS_ELEMENTS = 1 << 26


def _target_logprobs(logits_BxCxV, targets_BxC, temperature, return_entropy, ids_BxCxK=None):
    """log softmax(logits / T)[target] and (optionally) the entropy, without a [B, C, V] log-prob
    array: the target's logit is picked by a one-hot mask (its gradient is the mask again,
    elementwise; `take_along_axis` differentiates into a scatter). With `ids_BxCxK`, also the
    log-probs of those ids [B, C, K] (distillation's top-k; K is small, so a gather)."""
    scaled = logits_BxCxV.astype(jnp.float32) / temperature
    shifted = scaled - jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    lse_BxC = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    is_target = jnp.arange(scaled.shape[-1], dtype=jnp.int32) == targets_BxC[..., None]
    logp_BxC = jnp.sum(jnp.where(is_target, shifted, 0.0), axis=-1) - lse_BxC
    if ids_BxCxK is not None:
        logp_BxC = (logp_BxC, jnp.take_along_axis(shifted, ids_BxCxK, axis=-1) - lse_BxC[..., None])
    if not return_entropy:
        return logp_BxC, None
    # Seed, "Entropy": H = -sum_v p_v log p_v = lse - sum_v p_v * shifted_v (log p_v = shifted_v - lse).
    probs = jnp.exp(shifted - lse_BxC[..., None])
    return logp_BxC, lse_BxC - jnp.sum(probs * shifted, axis=-1)


def token_logprobs(graphdef, params, tokens_BxS, attention_mask_BxS, *, num_targets: int,
                   temperature: float = 1.0, return_entropy: bool = False,
                   chunk_size: int | None = None, group_size: int = 1, gather_ids_BxCxK=None,
                   expert_indices_BxLxSxK=None, return_routing: bool = False):
    """log softmax(logits / temperature)[token t] given tokens[:, :t], for t in [S - C, S).

    Returns logp_BxC float32 (C = num_targets), or (logp_BxC, entropy_BxC) with
    return_entropy. Logits are formed only for the C positions that predict targets; when
    B * C * V exceeds 2^26 (or chunk_size is given) they are formed chunk_size positions at a
    time under jax.checkpoint, so one chunk's [B, c, V] float32 array is alive at once, in the
    backward pass too.

    group_size G > 1: rows come in groups of G consecutive rows with the same prompt part
    (tokens and mask of the first S - C positions), as GRPO's G answers to one prompt. Each
    prompt then runs through the model once, not G times (`shared_prompt_hidden_states`): the
    same log-probs with 1 - (P + G*C) / (G*S) fewer tokens in every projection (W1's figure in
    benchmarks/NOTES.md).
    The caller guarantees the shared prompts; they are not checked here (the first row's is used).

    gather_ids_BxCxK (int32, optional): then logp_BxC is the pair (logp_BxC, logp_BxCxK), the
    log-probs of these ids at each target position as well (on-policy distillation's top-k).

    expert_indices_BxLxSxK (int32, MoE models, optional): routing replay, sparse layer l uses
    experts [b, l, t] for token t of row b instead of its router's top-k (`grpo_jax.model.moe`),
    e.g. those the sampler recorded (`SampleOutput.experts_BxLxSxK`).

    return_routing (MoE models): the result becomes (result, `moe.Routing`): every sparse layer's
    router logits and experts used, in the layout the model ran (group_size > 1: shared prompts,
    weigh its tokens with `moe.routing_token_weights`), for the load-balancing loss.
    """
    b, s = tokens_BxS.shape
    c = num_targets
    if not 0 < c < s:
        raise ValueError(f"token_logprobs: num_targets must be in [1, S - 1] = [1, {s - 1}], got {c}")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature!r}")
    if not isinstance(group_size, int) or group_size < 1 or b % group_size:
        raise ValueError(
            f"token_logprobs: group_size must be an int >= 1 dividing the {b} rows, got {group_size!r}"
        )
    model = nnx.merge(graphdef, params)
    recording = moe.start_recording(model) if return_routing else []
    if expert_indices_BxLxSxK is not None:
        moe.replay(model, moe.shared_prompt_layout(expert_indices_BxLxSxK, group_size, c))
    h_BxCxD = _target_hidden_states(model, tokens_BxS, attention_mask_BxS, c, group_size)
    result = token_logprobs_from_hidden(model, h_BxCxD, tokens_BxS[:, s - c:], temperature, return_entropy,
                                        chunk_size, gather_ids_BxCxK)
    if not return_routing:
        return result
    records = [layer.recorded.get_value() for layer in recording]
    return result, moe.Routing(tuple(r[0] for r in records), tuple(r[1] for r in records))


def token_logprobs_from_hidden(model, h_BxCxD, targets_BxC, temperature: float, return_entropy: bool,
                               chunk_size: int | None, gather_ids_BxCxK):
    """`token_logprobs`' result from the final hidden states at the C target positions."""
    b, c = targets_BxC.shape
    v = model.config.vocab_size
    if chunk_size is None:
        chunk_size = c if b * c * v <= _MAX_LOGITS_ELEMENTS else max(1, _MAX_LOGITS_ELEMENTS // (b * v))
    if chunk_size >= c:
        logp, ent = _target_logprobs(model.logits(h_BxCxD), targets_BxC, temperature, return_entropy,
                                     gather_ids_BxCxK)
        return (logp, ent) if return_entropy else logp
    return _chunked_target_logprobs(model, h_BxCxD, targets_BxC, temperature, return_entropy, chunk_size,
                                    gather_ids_BxCxK)


def _target_hidden_states(model, tokens_BxS, attention_mask_BxS, c: int, group_size: int):
    """h_BxCxD: the final hidden states at the C positions that predict the last C tokens (the
    state at position t - 1 predicts token t); with group_size > 1 each group's shared prompt runs
    through the model once (see `token_logprobs`)."""
    b, s = tokens_BxS.shape
    if group_size == 1:
        h_BxSxD, _ = model.hidden_states(tokens_BxS, default_positions(attention_mask_BxS),
                                         attention_mask_BxS, max_position=s)
        # The hidden state at position t - 1 predicts token t.
        return h_BxSxD[:, s - c - 1 : s - 1]
    n, g, p = b // group_size, group_size, s - c
    tokens_NxGxS = tokens_BxS.reshape(n, g, s)
    mask_NxGxS = attention_mask_BxS.reshape(n, g, s)
    h_prompt_NxPxD, h_NxGxCxD = model.shared_prompt_hidden_states(
        tokens_NxGxS[:, 0, :p], mask_NxGxS[:, 0, :p], tokens_NxGxS[:, :, p:], mask_NxGxS[:, :, p:])
    # Completion token 0 is predicted by the prompt's last position, token t by completion t - 1.
    last_prompt = jnp.broadcast_to(h_prompt_NxPxD[:, None, p - 1 :], (n, g, 1, h_NxGxCxD.shape[-1]))
    return jnp.concatenate([last_prompt, h_NxGxCxD[:, :, : c - 1]], axis=2).reshape(b, c, -1)


def _chunked_target_logprobs(model, h_BxCxD, targets_BxC, temperature, return_entropy, chunk_size: int,
                             gather_ids_BxCxK):
    """`token_logprobs`'s result from the hidden states, the logits formed chunk_size positions at
    a time under jax.checkpoint (one chunk's [B, chunk, V] float32 array alive at once)."""
    b, c = targets_BxC.shape
    num_chunks = -(-c // chunk_size)
    pad = num_chunks * chunk_size - c
    h_pad = jnp.pad(h_BxCxD, ((0, 0), (0, pad), (0, 0)))
    t_pad = jnp.pad(targets_BxC, ((0, 0), (0, pad)))
    # [num_chunks, B, chunk, ...] so lax.map walks chunks in order.
    h_chunks = h_pad.reshape(b, num_chunks, chunk_size, -1).transpose(1, 0, 2, 3)
    t_chunks = t_pad.reshape(b, num_chunks, chunk_size).transpose(1, 0, 2)
    ids_chunks = None
    if gather_ids_BxCxK is not None:
        k = gather_ids_BxCxK.shape[-1]
        ids_pad = jnp.pad(gather_ids_BxCxK, ((0, 0), (0, pad), (0, 0)))
        ids_chunks = ids_pad.reshape(b, num_chunks, chunk_size, k).transpose(1, 0, 2, 3)

    @jax.checkpoint
    def one_chunk(args):
        h, t, ids = args
        logp, ent = _target_logprobs(model.logits(h), t, temperature, return_entropy, ids)
        token_logp = logp[0] if ids is not None else logp
        return logp, (jnp.zeros_like(token_logp) if ent is None else ent)

    logp_chunks, ent_chunks = jax.lax.map(one_chunk, (h_chunks, t_chunks, ids_chunks))
    if gather_ids_BxCxK is not None:
        logp_chunks, ids_logp_chunks = logp_chunks
        ids_logp = ids_logp_chunks.transpose(1, 0, 2, 3).reshape(b, num_chunks * chunk_size, -1)[:, :c]
    logp = logp_chunks.transpose(1, 0, 2).reshape(b, -1)[:, :c]
    if gather_ids_BxCxK is not None:
        logp = (logp, ids_logp)
    if not return_entropy:
        return logp
    return logp, ent_chunks.transpose(1, 0, 2).reshape(b, -1)[:, :c]
