"""Blockwise (flash-style) attention in pure JAX: memory linear in the sequence length.

softmax(q k^T / sqrt(H)) v is computed one [block_q, block_k] tile at a time with an online
softmax: a running max m, normaliser l and float32 accumulator per query, rescaled by exp(m_old -
m_new) when a later tile raises the max (Milakov & Gimelshein 2018; FlashAttention, Dao et al.
2022). Nothing of size T x S is ever formed. The custom VJP keeps only q, k, v, the output and
the per-query log-sum-exp, and recomputes each tile's probabilities in the backward pass
(FlashAttention-2's backward: dS = P * (dP - rowsum(dO * O))).

Why our own kernel: it runs on every backend (CPU included, where there is no fused kernel), under
`jax.jit` with the trainer's shardings (rows and heads split; the loops touch neither axis, so no
collective enters them), and its masks are the model's: left-padded rows, a query offset (the
shared-prompt layout's completions start after the prompt) and sliding windows. cuDNN and splash
kernels (`grpo_jax.model.fused`) take over on GPUs and TPUs where their constraints hold.

The mask is slot arithmetic, never an array of T x S. Query t of row b sits at slot
`query_offset + t`, key s at slot s; s is visible from t when

    key_valid[b, s]  and  s <= query_offset + t  and  (window is None or query_offset + t - s < window)

(causal, as the reference kernels; `window` as Hugging Face's sliding window: a query sees itself
and the window - 1 slots before it). Tiles that no query of a block can see (above the causal
diagonal, or left of every window) are skipped: the loops' bounds come from the block indices.

A query that sees no key at all (a left-padding row) gets the mean of the values of the tiles it
was offered and no gradient; the reference kernel gives a mean over all slots. Neither reaches a
real token: such rows are keys to nobody. Letters as in `grpo_jax.model`; R = N / K query heads
per kv head (head n = k * R + r, Hugging Face's repeat_kv order).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Tiles of up to this many queries and keys. A tile's scores are [B, K, R * block_q, block_k] float32:
# 512 x 512 keeps them at 1 MiB per (row, query head), far below the layer's own activations at
# reasoning lengths, while the per-tile matmuls stay large enough for every backend's matmul units.
DEFAULT_BLOCK = 512
# Decode: caches longer than 4 blocks are attended block by block up to the longest row
# (`decode_attention`); shorter ones in one piece (`attention.attend_one_query`, faster there: W1's
# 96-slot cache decodes 8% slower in two blocks). None: per backend (`decode_block`); tests and
# benchmarks set an int.
DECODE_BLOCK: int | None = None
BLOCKED_DECODE_MIN_BLOCKS = 4


def decode_block(backend: str | None = None) -> int:
    """Slots per decode block: `DECODE_BLOCK`, else 64 on a CPU, 512 on an accelerator.

    CPU (W3's rollout, 2 threads, seconds for blocks of 32 / 64 / 128 / 256): static engine 6.9 /
    6.4 / 7.5 / 10.6, continuous 2.5 / 2.3 / 2.6 / 2.8 (benchmarks/NOTES.md): small blocks follow
    the rows' lengths closely and each is cheap. On an accelerator every loop iteration is a few
    kernel launches, and reading a block of the cache costs little next to the weights, so fewer,
    larger blocks.
    """
    if DECODE_BLOCK is not None:
        return DECODE_BLOCK
    return 64 if (backend or jax.default_backend()) == "cpu" else 512
_FLOOR = float(jnp.finfo(jnp.float32).min)  # a finite -inf: masked scores, never NaN


def block_size(length: int, max_block: int = DEFAULT_BLOCK) -> int:
    """The tile length for `length` positions: as many tiles as max_block needs, each a multiple of 8
    and as short as the tiles allow, so the padding is < 8 per tile (600 -> 2 tiles of 304, not 1024)."""
    tiles = -(-length // max_block)
    return -(-(-(-length // tiles)) // 8) * 8


def blockwise_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, key_valid_BxS, *, query_offset: int = 0,
                        window: int | None = None, block_q: int = DEFAULT_BLOCK,
                        block_k: int = DEFAULT_BLOCK, softcap: float | None = None) -> jax.Array:
    """Causal attention of T queries (at slots query_offset + [0, T)) over S keys, [B, T, N, H].

    Dtypes: q, k, v in the compute dtype; scores, the softmax statistics and the accumulator in
    float32, the output cast back to q's dtype (as `attention.attend`). `query_offset` and `window`
    are static ints; block sizes are upper bounds (`block_size`). softcap (static): scores become
    softcap * tanh(scores / softcap) before the softmax (Gemma 2's attention logit soft-cap).
    """
    b, t, n, hd = q_BxTxNxH.shape
    s, kv = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
    if n % kv:
        raise ValueError(f"blockwise_attention: {n} query heads are not a multiple of {kv} kv heads")
    if window is not None and window < 1:
        raise ValueError(f"blockwise_attention: window must be >= 1 or None, got {window}")
    bq, bk = block_size(t, block_q), block_size(s, block_k)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    r = n // kv
    # [B, K, R, T, H] and [B, K, S, H]: a tile is a slice of the sequence axis, its R heads and bq
    # queries one [R * bq, H] block against the kv head's [bk, H].
    q = jnp.pad(q_BxTxNxH.reshape(b, t, kv, r, hd), ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    q = q.transpose(0, 2, 3, 1, 4)
    k = jnp.pad(k_BxSxKxH, ((0, 0), (0, sp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    v = jnp.pad(v_BxSxKxH, ((0, 0), (0, sp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    valid = jnp.pad(key_valid_BxS > 0, ((0, 0), (0, sp - s)))
    out = _attention(q, k, v, valid, _Tiles(int(query_offset), window, bq, bk, softcap))
    return out.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, n, hd)


class _Tiles(NamedTuple):
    """The static part of a call (hashable: the custom VJP's non-differentiable argument): query
    offset, window, tile sizes, and the tile ranges and masks they imply."""

    offset: int
    window: int | None
    bq: int
    bk: int
    softcap: float | None = None

    def key_tiles(self, i, num_key_tiles: int):
        """[lo, hi): the key tiles some query of query tile i can see (i traced)."""
        first_q = self.offset + i * self.bq
        hi = jnp.minimum(num_key_tiles, (first_q + self.bq - 1) // self.bk + 1)
        if self.window is None:
            return jnp.zeros_like(hi), hi
        return jnp.maximum(0, (first_q - self.window + 1) // self.bk), hi

    def query_tiles(self, j, num_query_tiles: int):
        """[lo, hi): the query tiles with some query that can see key tile j (j traced)."""
        first_k = j * self.bk
        lo = jnp.clip((first_k - self.offset) // self.bq, 0, num_query_tiles)
        if self.window is None:
            return lo, jnp.full_like(lo, num_query_tiles)
        last_q = first_k + self.bk - 1 + self.window - 1 - self.offset  # the last query that sees it
        return lo, jnp.clip(last_q // self.bq + 1, lo, num_query_tiles)

    def visible(self, valid_BxS, i, j):
        """[B, bq, bk]: which keys of tile j each query of tile i sees."""
        q_slot = self.offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)
        k_slot = j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)
        rel = q_slot[:, None] - k_slot[None, :]
        ok = rel >= 0 if self.window is None else (rel >= 0) & (rel < self.window)
        return jax.lax.dynamic_slice_in_dim(valid_BxS, j * self.bk, self.bk, axis=1)[:, None, :] & ok[None]


_CONTRACT_H = (((3,), (3,)), ((0, 1), (0, 1)))   # [B, K, X, H] x [B, K, Y, H] -> [B, K, X, Y]
_CONTRACT_Y = (((3,), (2,)), ((0, 1), (0, 1)))   # [B, K, X, Y] x [B, K, Y, H] -> [B, K, X, H]
_CONTRACT_X = (((2,), (2,)), ((0, 1), (0, 1)))   # [B, K, X, Y] x [B, K, X, H] -> [B, K, Y, H]


def _tile_scores(q_i, k_j, valid, tiles: _Tiles, i, j):
    """Scaled scores of query tile i ([B, K, R * bq, H]) against key tile j, masked: [B, K, R*bq, bk]
    float32, and the visibility broadcast to that shape."""
    b, kv, rq, hd = q_i.shape
    r = rq // tiles.bq
    s = jax.lax.dot_general(q_i, k_j, _CONTRACT_H, preferred_element_type=jnp.float32) / math.sqrt(hd)
    if tiles.softcap is not None:
        s = tiles.softcap * jnp.tanh(s / tiles.softcap)
    vis = jnp.broadcast_to(tiles.visible(valid, i, j)[:, None, None], (b, kv, r, tiles.bq, tiles.bk))
    vis = vis.reshape(b, kv, rq, tiles.bk)
    return jnp.where(vis, s, _FLOOR), vis


def _forward(q, k, v, valid, tiles: _Tiles):
    """(out [B, K, R, Tp, H] in q's dtype, lse [B, K, R, Tp] float32)."""
    b, kv, r, tp, hd = q.shape
    nq, nk = tp // tiles.bq, k.shape[2] // tiles.bk
    rq = r * tiles.bq
    f32 = jnp.float32

    def query_tile(i, carry):
        out, lse = carry
        q_i = jax.lax.dynamic_slice_in_dim(q, i * tiles.bq, tiles.bq, axis=3).reshape(b, kv, rq, hd)

        def key_tile(j, st):
            m, l, acc = st
            k_j = jax.lax.dynamic_slice_in_dim(k, j * tiles.bk, tiles.bk, axis=2)
            v_j = jax.lax.dynamic_slice_in_dim(v, j * tiles.bk, tiles.bk, axis=2)
            s, _ = _tile_scores(q_i, k_j, valid, tiles, i, j)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            pv = jax.lax.dot_general(p.astype(v.dtype), v_j, _CONTRACT_Y, preferred_element_type=f32)
            return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

        init = (jnp.full((b, kv, rq), _FLOOR, f32), jnp.zeros((b, kv, rq), f32), jnp.zeros((b, kv, rq, hd), f32))
        lo, hi = tiles.key_tiles(i, nk)
        m, l, acc = jax.lax.fori_loop(lo, hi, key_tile, init)
        l_safe = jnp.where(l > 0, l, 1.0)  # a padded query tile that saw no key tile at all
        o_i = (acc / l_safe[..., None]).astype(out.dtype).reshape(b, kv, r, tiles.bq, hd)
        lse_i = (m + jnp.log(l_safe)).reshape(b, kv, r, tiles.bq)
        return (jax.lax.dynamic_update_slice_in_dim(out, o_i, i * tiles.bq, axis=3),
                jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * tiles.bq, axis=3))

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:4], f32))
    return jax.lax.fori_loop(0, nq, query_tile, init)


def _backward(q, k, v, valid, out, lse, d_out, tiles: _Tiles):
    """(dq, dk, dv) for the cotangent d_out of `_forward`'s output; tiles recomputed."""
    b, kv, r, tp, hd = q.shape
    nq, nk = tp // tiles.bq, k.shape[2] // tiles.bk
    rq = r * tiles.bq
    f32 = jnp.float32
    # rowsum(dO * O): the softmax backward's per-query term, once for all tiles.
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)

    def rows(x, i):  # query tile i of a [B, K, R, Tp, ...] array as [B, K, R * bq, ...]
        tile = jax.lax.dynamic_slice_in_dim(x, i * tiles.bq, tiles.bq, axis=3)
        return tile.reshape(b, kv, rq, *x.shape[4:])

    def key_tile(j, carry):
        dq, dk, dv = carry
        k_j = jax.lax.dynamic_slice_in_dim(k, j * tiles.bk, tiles.bk, axis=2)
        v_j = jax.lax.dynamic_slice_in_dim(v, j * tiles.bk, tiles.bk, axis=2)

        def query_tile(i, st):
            dq, dk_j, dv_j = st
            q_i, do_i = rows(q, i), rows(d_out, i)
            s, vis = _tile_scores(q_i, k_j, valid, tiles, i, j)
            p = jnp.where(vis, jnp.exp(s - rows(lse, i)[..., None]), 0.0)
            dv_j = dv_j + jax.lax.dot_general(p.astype(v.dtype), do_i, _CONTRACT_X, preferred_element_type=f32)
            dp = jax.lax.dot_general(do_i, v_j, _CONTRACT_H, preferred_element_type=f32)
            ds = p * (dp - rows(delta, i)[..., None]) / math.sqrt(hd)
            if tiles.softcap is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2; s is the capped score
                ds = ds * jnp.where(vis, 1.0 - jnp.square(s / tiles.softcap), 0.0)
            ds = ds.astype(q.dtype)
            dk_j = dk_j + jax.lax.dot_general(ds, q_i, _CONTRACT_X, preferred_element_type=f32)
            dq_i = jax.lax.dot_general(ds, k_j, _CONTRACT_Y, preferred_element_type=f32)
            dq_i = rows(dq, i) + dq_i
            return (jax.lax.dynamic_update_slice_in_dim(dq, dq_i.reshape(b, kv, r, tiles.bq, hd), i * tiles.bq, axis=3),
                    dk_j, dv_j)

        lo, hi = tiles.query_tiles(j, nq)
        zero = jnp.zeros((b, kv, tiles.bk, hd), f32)
        dq, dk_j, dv_j = jax.lax.fori_loop(lo, hi, query_tile, (dq, zero, zero))
        return (dq, jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * tiles.bk, axis=2),
                jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * tiles.bk, axis=2))

    init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
    dq, dk, dv = jax.lax.fori_loop(0, nk, key_tile, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, valid, tiles: _Tiles):
    return _forward(q, k, v, valid, tiles)[0]


def _attention_fwd(q, k, v, valid, tiles):
    out, lse = _forward(q, k, v, valid, tiles)
    return out, (q, k, v, valid, out, lse)


def _attention_bwd(tiles, res, d_out):
    q, k, v, valid, out, lse = res
    dq, dk, dv = _backward(q, k, v, valid, out, lse, d_out, tiles)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def decode_attention(q_Bx1xNxH, keys_BxKxHxS, values_BxKxSxH, key_mask_BxS, q_slot_B, slot_bounds, *,
                     window: int | None = None, block: int, softcap: float | None = None) -> jax.Array:
    """One query per row over the cache, visiting only the cache blocks some row can see:
    [B, K, R, 1, H], as `attention.attend_one_query`.

    slot_bounds = (lowest, highest) query slot over the batch (scalars; with rows split over
    devices the engine reduces them once per step, not once per layer). The loop runs over blocks
    [(lowest - window + 1) // block, highest // block], so a step costs what the longest row has
    written (or its window), not the whole cache of P + max_new_tokens slots. The last block is
    clamped to end at slot S (its slots already visited are masked), so S need not be a multiple of
    `block`. Sums over H and the block's slots as in `attend_one_query` (multiply-and-sum along a
    major axis: the form XLA's CPU backend runs fastest for one query).
    """
    b, _, n, hd = q_Bx1xNxH.shape
    kv, s = keys_BxKxHxS.shape[1], keys_BxKxHxS.shape[3]
    r = n // kv
    block = min(block, s)
    f32 = jnp.float32
    q = q_Bx1xNxH.reshape(b, kv, r, hd).astype(f32)
    lowest, highest = slot_bounds
    first = 0 if window is None else jnp.maximum(0, lowest - window + 1) // block
    last = jnp.minimum(highest, s - 1) // block

    def body(j, st):
        m, l, acc = st
        start = jnp.minimum(j * block, s - block)
        k_j = jax.lax.dynamic_slice_in_dim(keys_BxKxHxS, start, block, axis=3).astype(f32)
        v_j = jax.lax.dynamic_slice_in_dim(values_BxKxSxH, start, block, axis=2)
        slot = start + jnp.arange(block, dtype=jnp.int32)
        vis = (jax.lax.dynamic_slice_in_dim(key_mask_BxS, start, block, axis=1) > 0) & (slot >= j * block)[None]
        vis = vis & (slot[None, :] <= q_slot_B[:, None])
        if window is not None:
            vis = vis & (q_slot_B[:, None] - slot[None, :] < window)
        scores = jnp.sum(q[..., None] * k_j[:, :, None], axis=3) / math.sqrt(hd)  # [B, K, R, block]
        if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
        scores = jnp.where(vis[:, None, None], scores, _FLOOR)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        pv = jnp.sum(p.astype(v_j.dtype)[..., None] * v_j[:, :, None], axis=3, dtype=f32)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

    init = (jnp.full((b, kv, r), _FLOOR, f32), jnp.zeros((b, kv, r), f32), jnp.zeros((b, kv, r, hd), f32))
    _, l, acc = jax.lax.fori_loop(first, last + 1, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out[:, :, :, None].astype(q_Bx1xNxH.dtype)
