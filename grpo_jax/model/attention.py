"""Attention arithmetic, free of parameters: the `KVCache` layout and three kernels over it.

`attend` (any number of queries: prefill, training), `attend_one_query` (decode) and
`attend_after_shared_prompt` (G completions over one shared prompt). Letters as in `grpo_jax.model`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """One layer's keys (after RoPE, stored transposed) and values: slot s of row b at
    k[b, :, :, s] and v[b, :, s].

    Heads before slots: with [B, S, K, H] XLA transposed the whole cache at every decode step. Keys
    as [H, S]: the prefill's q @ k is a plain [G, H] x [H, S] product, and decode's sum over H
    (`attend_one_query`) runs over a major axis and vectorises along S. As [S, H], both operands
    of q @ k contracted their minor axis, and XLA's CPU dot ran it far slower than probs @ v of the
    same size (timings in benchmarks/NOTES.md, changes 11 and 16).
    """

    k_BxKxHxS: jax.Array
    v_BxKxSxH: jax.Array


def attend(q_BxTxNxH, keys_BxKxHxS, values_BxKxSxH, visible_BxTxS) -> jax.Array:
    """softmax(q k^T / sqrt(H)) v over the visible slots: [B, K, G, T, H], G = N / K query heads
    per kv head (head n = k * G + g, HF repeat_kv order)."""
    b, t, n, hd = q_BxTxNxH.shape
    kv, s = keys_BxKxHxS.shape[1], keys_BxKxHxS.shape[3]
    g = n // kv
    # Both products are written as plain batched matmuls over (B, K) with the contraction on a
    # minor axis: as free-form einsums XLA's CPU backend picked a slow generic dot for probs @ values.
    q_BxKxGTxH = q_BxTxNxH.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, hd)
    batch = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(q_BxKxGTxH, keys_BxKxHxS, (((3,), (2,)), batch),
                                 preferred_element_type=jnp.float32) / math.sqrt(hd)
    # A finite floor, not -inf: a padding query with no visible key gets a uniform (unused)
    # distribution instead of NaN, which would poison gradients.
    scores_BxKxGxTxS = jnp.where(visible_BxTxS[:, None, None], scores.reshape(b, kv, g, t, s),
                                 jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(q_BxTxNxH.dtype).reshape(b, kv, g * t, s)
    out_BxKxGTxH = jax.lax.dot_general(probs, values_BxKxSxH, (((3,), (2,)), batch))
    return out_BxKxGTxH.reshape(b, kv, g, t, hd)


def attend_one_query(q_Bx1xNxH, keys_BxKxHxS, values_BxKxSxH, visible_Bx1xS) -> jax.Array:
    """`attend` for one query per row (decode), as broadcast multiplies and sums: [B, K, G, 1, H].

    Both sums run over a major axis (H of the transposed keys, then S of the values), so they
    vectorise along the minor one. As batched matmuls these were B*K products of [G, H] x [H, S]:
    XLA's CPU dot kernels were slow on such tiny operands (benchmarks/NOTES.md, changes 2 and 16).
    """
    b, _, n, hd = q_Bx1xNxH.shape
    kv = keys_BxKxHxS.shape[1]
    g = n // kv
    q_BxKxGxH = q_Bx1xNxH.reshape(b, kv, g, hd).astype(jnp.float32)
    scores_BxKxGxS = jnp.sum(q_BxKxGxH[..., None] * keys_BxKxHxS[:, :, None].astype(jnp.float32), axis=3)
    scores_BxKxGxS = jnp.where(visible_Bx1xS[:, None], scores_BxKxGxS / math.sqrt(hd),
                               jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(values_BxKxSxH.dtype)
    out_BxKxGxH = jnp.sum(probs[..., None] * values_BxKxSxH[:, :, None], axis=3)
    return out_BxKxGxH[:, :, :, None].astype(q_Bx1xNxH.dtype)


def attend_after_shared_prompt(q_NxGxCxKxRxH, k_prompt_NxKxHxP, v_prompt_NxKxPxH, prompt_mask_NxP,
                               k_NxGxCxKxH, v_NxGxCxKxH, completion_mask_NxGxC) -> jax.Array:
    """Attention of G completions per prompt over their one shared prompt and themselves.

    Completion token c of sample g sees the prompt's real tokens and its own tokens <= c. The
    prompt's keys are multiplied once per prompt by the queries of all G samples ([N, K, R*G*C, P],
    no G-fold copy); the completion part is per sample ([N*G, K, R*C, C]). One softmax spans both
    blocks (a shared max and normaliser). Returns [N, G, C, K*R*H], heads n = k * R + r.
    """
    n, g, c, kv, r, hd = q_NxGxCxKxRxH.shape
    dt = q_NxGxCxKxRxH.dtype
    floor = jnp.finfo(jnp.float32).min
    batch = ((0, 1), (0, 1))
    scale = 1.0 / math.sqrt(hd)
    # Prompt block, all samples of a prompt in one matmul: [N, K, R*G*C, P].
    q_cp = q_NxGxCxKxRxH.transpose(0, 3, 4, 1, 2, 5).reshape(n, kv, r * g * c, hd)
    s_cp = jax.lax.dot_general(q_cp, k_prompt_NxKxHxP, (((3,), (2,)), batch),
                               preferred_element_type=jnp.float32) * scale
    s_cp = jnp.where(prompt_mask_NxP[:, None, None, :] > 0, s_cp, floor)
    # Own block, per sample, causal: [N*G, K, R*C, C].
    q_cc = q_NxGxCxKxRxH.reshape(n * g, c, kv, r, hd).transpose(0, 2, 3, 1, 4).reshape(n * g, kv, r * c, hd)
    k_cc = k_NxGxCxKxH.reshape(n * g, c, kv, hd).transpose(0, 2, 3, 1)  # [NG, K, H, C]
    v_cc = v_NxGxCxKxH.reshape(n * g, c, kv, hd).transpose(0, 2, 1, 3)
    s_cc = jax.lax.dot_general(q_cc, k_cc, (((3,), (2,)), batch), preferred_element_type=jnp.float32) * scale
    causal_CxC = jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]
    visible = causal_CxC[None] & (completion_mask_NxGxC.reshape(n * g, 1, c) > 0)  # [NG, C(query), C(key)]
    s_cc = jnp.where(visible[:, None, None], s_cc.reshape(n * g, kv, r, c, c), floor)
    # Shared max over both blocks, in the layout [N, G, K, R, C] (per query).
    m_cp = jnp.max(s_cp, axis=-1).reshape(n, kv, r, g, c).transpose(0, 3, 1, 2, 4)
    m_cc = jnp.max(s_cc, axis=-1).reshape(n, g, kv, r, c)
    m = jax.lax.stop_gradient(jnp.maximum(m_cp, m_cc))
    e_cp = jnp.exp(s_cp - m.transpose(0, 2, 3, 1, 4).reshape(n, kv, r * g * c)[..., None])
    e_cc = jnp.exp(s_cc - m.reshape(n * g, kv, r, c)[..., None])
    denom = jnp.sum(e_cp, axis=-1).reshape(n, kv, r, g, c).transpose(0, 3, 1, 2, 4) + jnp.sum(
        e_cc, axis=-1).reshape(n, g, kv, r, c)
    # Accumulated and normalised in float32 (then cast), so a bfloat16 model loses no more than
    # the per-row path's one rounding of the normalised probabilities.
    f32 = jnp.float32
    out_cp = jax.lax.dot_general(e_cp.astype(dt), v_prompt_NxKxPxH, (((3,), (2,)), batch),
                                 preferred_element_type=f32)
    out_cc = jax.lax.dot_general(e_cc.astype(dt).reshape(n * g, kv, r * c, c), v_cc, (((3,), (2,)), batch),
                                 preferred_element_type=f32)
    # Both to [N, G, C, K, R, H], normalised once.
    out = (out_cp.reshape(n, kv, r, g, c, hd).transpose(0, 3, 4, 1, 2, 5)
           + out_cc.reshape(n, g, kv, r, c, hd).transpose(0, 1, 4, 2, 3, 5))
    inv_denom = (1.0 / denom).transpose(0, 1, 4, 2, 3)[..., None]  # [N, G, C, K, R, 1]
    return (out * inv_denom).astype(dt).reshape(n, g, c, kv * r * hd)
