"""Attention arithmetic, free of parameters: the `KVCache` layout, the reference kernels, and the
choice of kernel for a call.

Reference kernels (they materialise the [T, S] scores; exact, fast at short lengths, and what every
other kernel is tested against): `attend` (any number of queries: prefill, training),
`attend_one_query` (decode) and `attend_after_shared_prompt` (G completions over one shared prompt).

`self_attention` and `shared_prompt_attention` are what the model calls: they pick a kernel per
call from `ModelConfig.attention_impl` (`resolve`): "xla" (the reference kernels), "blockwise"
(`grpo_jax.model.blockwise`: pure JAX, linear memory, every backend), "cudnn" or "splash"
(`grpo_jax.model.fused`), or "auto": cuDNN on a GPU and splash on a TPU where their constraints
hold, else the reference kernel while a call's scores stay small (`XLA_MAX_SCORE_BYTES`) and the
blockwise kernel beyond. Letters as in `grpo_jax.model`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.model import blockwise, fused
from grpo_jax.model.config import ATTENTION_IMPLS as IMPLEMENTATIONS
# "auto" runs the reference kernel while a call's float32 scores take at most this much (16 MiB):
# below it the reference is as fast or faster on a CPU (the demo's update, 128 rows of ~21
# tokens: 15 ms against 25 ms for its gradient) and its [T, S] temporaries are small; above it the
# blockwise kernel is faster (it skips the tiles above the causal diagonal: 16 rows x 4 heads x
# 544 tokens, W3's longest bucket, 97 ms against 170 ms) and its memory grows with T, not T x S.
# Crossover measured between 8 and 16 MiB of scores (benchmarks/NOTES.md, reasoning lengths).
XLA_MAX_SCORE_BYTES = 1 << 24


def soft_cap(scores, cap: float | None):
    """cap * tanh(scores / cap) (attention logit soft-capping, Gemma 2), or scores when cap is None."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


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


def attend(q_BxTxNxH, keys_BxKxHxS, values_BxKxSxH, visible_BxTxS, softcap: float | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(H)) v over the visible slots: [B, K, G, T, H], G = N / K query heads
    per kv head (head n = k * G + g, HF repeat_kv order); scores soft-capped by `softcap`."""
    b, t, n, hd = q_BxTxNxH.shape
    kv, s = keys_BxKxHxS.shape[1], keys_BxKxHxS.shape[3]
    g = n // kv
    # Both products are written as plain batched matmuls over (B, K) with the contraction on a
    # minor axis: as free-form einsums XLA's CPU backend picked a slow generic dot for probs @ values.
    q_BxKxGTxH = q_BxTxNxH.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, hd)
    batch = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(q_BxKxGTxH, keys_BxKxHxS, (((3,), (2,)), batch),
                                 preferred_element_type=jnp.float32) / math.sqrt(hd)
    scores = soft_cap(scores, softcap)
    # A finite floor, not -inf: a padding query with no visible key gets a uniform (unused)
    # distribution instead of NaN, which would poison gradients.
    scores_BxKxGxTxS = jnp.where(visible_BxTxS[:, None, None], scores.reshape(b, kv, g, t, s),
                                 jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(q_BxTxNxH.dtype).reshape(b, kv, g * t, s)
    out_BxKxGTxH = jax.lax.dot_general(probs, values_BxKxSxH, (((3,), (2,)), batch))
    return out_BxKxGTxH.reshape(b, kv, g, t, hd)


def attend_one_query(q_Bx1xNxH, keys_BxKxHxS, values_BxKxSxH, visible_Bx1xS,
                     softcap: float | None = None) -> jax.Array:
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
    scores_BxKxGxS = jnp.where(visible_Bx1xS[:, None], soft_cap(scores_BxKxGxS / math.sqrt(hd), softcap),
                               jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(values_BxKxSxH.dtype)
    out_BxKxGxH = jnp.sum(probs[..., None] * values_BxKxSxH[:, :, None], axis=3)
    return out_BxKxGxH[:, :, :, None].astype(q_Bx1xNxH.dtype)


def attend_after_shared_prompt(q_NxGxCxKxRxH, k_prompt_NxKxHxP, v_prompt_NxKxPxH, prompt_mask_NxP,
                               k_NxGxCxKxH, v_NxGxCxKxH, completion_mask_NxGxC,
                               window: int | None = None, softcap: float | None = None) -> jax.Array:
    """Attention of G completions per prompt over their one shared prompt and themselves.

    Completion token c of sample g sees the prompt's real tokens and its own tokens <= c (with a
    `window`, only those fewer than `window` slots back: the prompt's key j sits at slot j, the
    completion's token c at slot P + c, as in the unshared row). The
    prompt's keys are multiplied once per prompt by the queries of all G samples ([N, K, R*G*C, P],
    no G-fold copy); the completion part is per sample ([N*G, K, R*C, C]). One softmax spans both
    blocks (a shared max and normaliser). Returns [N, G, C, K*R*H], heads n = k * R + r.
    """
    n, g, c, kv, r, hd = q_NxGxCxKxRxH.shape
    p = prompt_mask_NxP.shape[1]
    dt = q_NxGxCxKxRxH.dtype
    floor = jnp.finfo(jnp.float32).min
    batch = ((0, 1), (0, 1))
    scale = 1.0 / math.sqrt(hd)
    # Prompt block, all samples of a prompt in one matmul: [N, K, R*G*C, P].
    q_cp = q_NxGxCxKxRxH.transpose(0, 3, 4, 1, 2, 5).reshape(n, kv, r * g * c, hd)
    s_cp = soft_cap(jax.lax.dot_general(q_cp, k_prompt_NxKxHxP, (((3,), (2,)), batch),
                                        preferred_element_type=jnp.float32) * scale, softcap)
    if window is None:
        s_cp = jnp.where(prompt_mask_NxP[:, None, None, :] > 0, s_cp, floor)
    else:  # completion c (slot P + c) sees prompt slot j when P + c - j < window
        near_CxP = (p + jnp.arange(c)[:, None] - jnp.arange(p)[None, :]) < window
        seen = (prompt_mask_NxP[:, None, None, None, None, :] > 0) & near_CxP[None, None, None, None]
        s_cp = jnp.where(seen, s_cp.reshape(n, kv, r, g, c, p), floor).reshape(n, kv, r * g * c, p)
    # Own block, per sample, causal: [N*G, K, R*C, C].
    q_cc = q_NxGxCxKxRxH.reshape(n * g, c, kv, r, hd).transpose(0, 2, 3, 1, 4).reshape(n * g, kv, r * c, hd)
    k_cc = k_NxGxCxKxH.reshape(n * g, c, kv, hd).transpose(0, 2, 3, 1)  # [NG, K, H, C]
    v_cc = v_NxGxCxKxH.reshape(n * g, c, kv, hd).transpose(0, 2, 1, 3)
    s_cc = soft_cap(jax.lax.dot_general(q_cc, k_cc, (((3,), (2,)), batch), preferred_element_type=jnp.float32)
                    * scale, softcap)
    causal_CxC = jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]
    if window is not None:
        causal_CxC = causal_CxC & (jnp.arange(c)[:, None] - jnp.arange(c)[None, :] < window)
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


def resolve(impl: str, *, dtype, head_dim: int, score_bytes: int, backend: str | None = None,
            softcap: bool = False) -> str:
    """The kernel `impl` ("auto" or a name in IMPLEMENTATIONS) runs for one call: "xla",
    "blockwise", "cudnn" or "splash". "cudnn" off a GPU or outside cuDNN's constraints (which
    include soft-capped scores: `softcap`) falls back as "auto" would (it cannot run there);
    "splash" off a TPU runs in Pallas interpret mode."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl must be one of {list(IMPLEMENTATIONS)}, got {impl!r}")
    backend = backend or jax.default_backend()
    if impl in ("xla", "blockwise", "splash"):
        return impl
    if backend == "gpu" and fused.cudnn_supports(dtype, head_dim) and not softcap:
        return "cudnn"
    if impl == "auto" and backend == "tpu" and fused.splash_supports(head_dim):
        return "splash"
    return "xla" if score_bytes <= XLA_MAX_SCORE_BYTES else "blockwise"


def describe(impl: str, *, dtype, head_dim: int, backend: str | None = None) -> str:
    """One line for the start-up log: what `impl` runs on this backend, short and long calls."""
    backend = backend or jax.default_backend()
    short = resolve(impl, dtype=dtype, head_dim=head_dim, score_bytes=0, backend=backend)
    long = resolve(impl, dtype=dtype, head_dim=head_dim, score_bytes=1 << 62, backend=backend)
    what = short if short == long else f"{short} up to {XLA_MAX_SCORE_BYTES >> 20} MiB of scores per call, {long} beyond"
    note = " (Pallas interpret mode: for tests)" if "splash" in (short, long) and backend != "tpu" else ""
    if impl == "cudnn" and short != "cudnn":
        note += f" (cudnn needs a GPU, bf16/fp16 compute and head_dim <= 128, a multiple of 8; here: {backend})"
    return f"attention_impl={impl}: {what} on {backend}{note}"


def causal_visible(key_valid_BxS, num_queries: int, query_offset: int = 0, window: int | None = None):
    """[B, T, S] bool: query t (slot query_offset + t) sees key s (the reference kernels' mask)."""
    s = key_valid_BxS.shape[1]
    q_slot_Tx1, k_slot_1xS = query_offset + jnp.arange(num_queries)[:, None], jnp.arange(s)[None, :]
    ok = k_slot_1xS <= q_slot_Tx1
    if window is not None:
        ok = ok & (q_slot_Tx1 - k_slot_1xS < window)
    return (key_valid_BxS[:, None, :] > 0) & ok[None]


def self_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, key_valid_BxT, *, impl: str = "auto",
                   window: int | None = None, softcap: float | None = None) -> jax.Array:
    """Causal attention of T tokens over themselves (key t real where key_valid): [B, T, N, H]."""
    b, t, n, hd = q_BxTxNxH.shape
    choice = resolve(impl, dtype=q_BxTxNxH.dtype, head_dim=hd, score_bytes=4 * b * n * t * t,
                     softcap=softcap is not None)
    if choice == "blockwise":
        return blockwise.blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, key_valid_BxT, window=window,
                                             softcap=softcap)
    if choice == "cudnn":
        if softcap is not None:  # reached only by a caller forcing "cudnn" past `resolve`
            raise ValueError("attention kernel 'cudnn' has no attention logit soft-cap; use 'blockwise', "
                             "'splash' or 'xla' (attention_impl='auto' picks one)")
        return fused.cudnn_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, key_valid_BxT, window=window)
    if choice == "splash":
        return fused.splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, key_valid_BxT, window=window,
                                      softcap=softcap)
    out_BxKxGxTxH = attend(q_BxTxNxH, k_BxTxKxH.transpose(0, 2, 3, 1), v_BxTxKxH.transpose(0, 2, 1, 3),
                           causal_visible(key_valid_BxT, t, window=window), softcap)
    return out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hd)


def shared_prompt_attention(q_NxLxNhxH, k_NxLxKxH, v_NxLxKxH, prompt_mask_NxP, completion_mask_NxGxC, *,
                            impl: str = "auto", window: int | None = None,
                            softcap: float | None = None) -> jax.Array:
    """Attention of N rows laid out as one prompt (P slots) then its G completions (C each), L = P +
    G * C: the prompt over itself, each completion over the prompt and itself. [N, L, Nh, H].

    Equal to `self_attention` of the N * G rows [prompt, completion]. The reference kernel
    multiplies the prompt's keys once by all G completions' queries; the other kernels attend each
    completion over [its prompt's keys, its own] (the prompt's keys and values repeated G times:
    G * P * K * H elements, nothing next to the scores they replace), the blockwise kernel with its
    queries at offset P, cuDNN and splash over the whole rebuilt row (they take self-attention
    only), keeping the completion's part.
    """
    n, p = prompt_mask_NxP.shape
    _, g, c = completion_mask_NxGxC.shape
    nh, hd, kv = q_NxLxNhxH.shape[2], q_NxLxNhxH.shape[3], k_NxLxKxH.shape[2]
    score_bytes = 4 * n * nh * (p * p + g * c * (p + c))
    choice = resolve(impl, dtype=q_NxLxNhxH.dtype, head_dim=hd, score_bytes=score_bytes, softcap=softcap is not None)
    q_prompt, k_prompt, v_prompt = q_NxLxNhxH[:, :p], k_NxLxKxH[:, :p], v_NxLxKxH[:, :p]
    out_prompt = self_attention(q_prompt, k_prompt, v_prompt, prompt_mask_NxP, impl=choice, window=window,
                                softcap=softcap)
    if choice == "xla":
        r = nh // kv
        out = attend_after_shared_prompt(
            q_NxLxNhxH[:, p:].reshape(n, g, c, kv, r, hd), k_prompt.transpose(0, 2, 3, 1),
            v_prompt.transpose(0, 2, 1, 3), prompt_mask_NxP, k_NxLxKxH[:, p:].reshape(n, g, c, kv, hd),
            v_NxLxKxH[:, p:].reshape(n, g, c, kv, hd), completion_mask_NxGxC, window=window, softcap=softcap)
        return jnp.concatenate([out_prompt, out.reshape(n, g * c, nh, hd)], axis=1)

    def rows(x_prompt, x_NxLx):  # [N*G, P + C, ...]: each completion after its own copy of the prompt
        own = x_NxLx[:, p:].reshape(n * g, c, *x_NxLx.shape[2:])
        return jnp.concatenate([jnp.repeat(x_prompt, g, axis=0), own], axis=1)

    valid = jnp.concatenate([jnp.repeat(prompt_mask_NxP, g, axis=0), completion_mask_NxGxC.reshape(n * g, c)], axis=1)
    k_rows, v_rows = rows(k_prompt, k_NxLxKxH), rows(v_prompt, v_NxLxKxH)
    if choice == "blockwise":
        q_own = q_NxLxNhxH[:, p:].reshape(n * g, c, nh, hd)
        out = blockwise.blockwise_attention(q_own, k_rows, v_rows, valid, query_offset=p, window=window,
                                            softcap=softcap)
    else:
        out = self_attention(rows(q_prompt, q_NxLxNhxH), k_rows, v_rows, valid, impl=choice, window=window,
                             softcap=softcap)[:, p:]
    return jnp.concatenate([out_prompt, out.reshape(n, g * c, nh, hd)], axis=1)
