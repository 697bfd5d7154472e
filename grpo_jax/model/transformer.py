"""The decoder as Flax NNX modules (Attention, MLP, Block, Transformer) and its initialisation.

Parameter tree (names are stable; `hf.py` maps Hugging Face tensors onto them):

    embed                      [V, D]      HF model.embed_tokens.weight            (same layout)
    layers[i].attn_norm        [D]         HF layers.i.input_layernorm.weight
    layers[i].attn.q_proj      [D, N, H]   HF self_attn.q_proj.weight [N*H, D] -> .T.reshape(D, N, H)
    layers[i].attn.k_proj      [D, K, H]   HF self_attn.k_proj.weight [K*H, D] -> .T.reshape(D, K, H)
    layers[i].attn.v_proj      [D, K, H]   HF self_attn.v_proj.weight [K*H, D] -> .T.reshape(D, K, H)
    layers[i].attn.o_proj      [N, H, D]   HF self_attn.o_proj.weight [D, N*H] -> .T.reshape(N, H, D)
    layers[i].attn.q_bias      [N, H]      HF self_attn.q_proj.bias [N*H]          (qkv_bias only)
    layers[i].attn.k_bias      [K, H]      HF self_attn.k_proj.bias [K*H]          (qkv_bias only)
    layers[i].attn.v_bias      [K, H]      HF self_attn.v_proj.bias [K*H]          (qkv_bias only)
    layers[i].attn.q_norm      [H]         HF self_attn.q_norm.weight              (qk_norm only)
    layers[i].attn.k_norm      [H]         HF self_attn.k_norm.weight              (qk_norm only)
    layers[i].mlp_norm         [D]         HF layers.i.post_attention_layernorm.weight
                                           (Gemma: layers.i.pre_feedforward_layernorm.weight)
    layers[i].post_attn_norm   [D]         HF layers.i.post_attention_layernorm.weight (Gemma only)
    layers[i].post_mlp_norm    [D]         HF layers.i.post_feedforward_layernorm.weight (Gemma only)
    layers[i].mlp.gate_proj    [D, F]      HF mlp.gate_proj.weight [F, D] -> .T
    layers[i].mlp.up_proj      [D, F]      HF mlp.up_proj.weight [F, D] -> .T
    layers[i].mlp.down_proj    [F, D]      HF mlp.down_proj.weight [D, F] -> .T
    layers[i].mlp.router, .expert_gate, .expert_up, .expert_down: a sparse layer's (grpo_jax.model.moe)
    final_norm                 [D]         HF model.norm.weight
    lm_head                    [D, V]      HF lm_head.weight [V, D] -> .T          (untied only)

Gemma 3 (`ModelConfig`'s Gemma fields): norm weights are offsets from 1, each sublayer's output is
normed again before the residual add (`sandwich_norms`), embeddings are scaled by sqrt(D), the MLP
gate is GELU, and sliding-window layers take their own RoPE base.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax.ad_checkpoint import checkpoint_name

from grpo_jax.model import blockwise, moe
from grpo_jax.model.attention import KVCache, attend, attend_one_query, self_attention, shared_prompt_attention
from grpo_jax.model.config import DTYPES, ModelConfig
from grpo_jax.model.kernels import constrain_rows, dense, gelu_tanh_glu, rms_norm, swiglu
from grpo_jax.model.partitioning import SHARDING
from grpo_jax.model.remat import remat_layer
from grpo_jax.model.rope import Rope, apply_rope, rope_inv_freq, rope_tables


def _param(name: str, value: jax.Array) -> nnx.Param:
    # eager_sharding=False: keep the annotation as metadata only; flax 0.12 would otherwise try to
    # place the value on a mesh at construction, and there is none on one device.
    return nnx.Param(value, out_sharding=SHARDING[name], eager_sharding=False)


class _NormalPool:
    """Hands out consecutive slices of ONE N(0, 0.02^2) draw (0.02: HF's initializer_range).

    One draw instead of one per weight: each jax.random.normal of a new shape is its own
    threefry program, and compiling one per weight dominated start-up on a small CPU
    (benchmarks/NOTES.md).
    """

    def __init__(self, key: jax.Array, size: int, dtype):
        self._values = 0.02 * jax.random.normal(key, (size,), jnp.float32)
        self._offset = 0
        self._dtype = dtype

    def take(self, shape: tuple[int, ...]) -> jax.Array:
        n = math.prod(shape)
        out = self._values[self._offset : self._offset + n].reshape(shape).astype(self._dtype)
        self._offset += n
        return out


def _norm_weight(config: ModelConfig, size: int) -> jax.Array:
    """A fresh RMSNorm weight that scales by 1: ones, or zeros when stored as an offset (Gemma)."""
    fill = jnp.zeros if config.rms_norm_offset else jnp.ones
    return fill((size,), DTYPES[config.param_dtype])


def _norm(config: ModelConfig, x, weight) -> jax.Array:
    """RMSNorm of x with `weight` as the config stores norm weights."""
    return rms_norm(x, weight, config.rms_norm_eps, offset=config.rms_norm_offset)


def _num_random_weights(c: "ModelConfig") -> int:
    d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    attention = d * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlps = sum(moe.num_weights(c) if c.is_sparse(i) else 3 * d * f for i in range(c.num_layers))
    return v * d * (1 if c.tie_embeddings else 2) + c.num_layers * attention + mlps


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, normals: _NormalPool, layer: int = 0):
        c, pd = config, DTYPES[config.param_dtype]
        self.config = config
        self.window = config.window(layer)  # None: full attention
        self.q_proj = _param("q_proj", normals.take((c.hidden_size, c.num_heads, c.head_dim)))
        self.k_proj = _param("k_proj", normals.take((c.hidden_size, c.num_kv_heads, c.head_dim)))
        self.v_proj = _param("v_proj", normals.take((c.hidden_size, c.num_kv_heads, c.head_dim)))
        self.o_proj = _param("o_proj", normals.take((c.num_heads, c.head_dim, c.hidden_size)))
        if c.qkv_bias:
            self.q_bias = _param("q_bias", jnp.zeros((c.num_heads, c.head_dim), pd))
            self.k_bias = _param("k_bias", jnp.zeros((c.num_kv_heads, c.head_dim), pd))
            self.v_bias = _param("v_bias", jnp.zeros((c.num_kv_heads, c.head_dim), pd))
        if c.qk_norm:
            self.q_norm = _param("q_norm", _norm_weight(c, c.head_dim))
            self.k_norm = _param("k_norm", _norm_weight(c, c.head_dim))

    def _qkv(self, x_BxTxD, rope: Rope):
        """Queries [B, T, N, H] and keys, values [B, T, K, H] (compute dtype), RoPE applied."""
        c = self.config
        dt = DTYPES[c.dtype]
        x = x_BxTxD.astype(dt)
        b, t = x.shape[:2]
        n, kv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        if t == 1:
            # Decode: three matmuls on the weights as stored; a concatenated copy would be rebuilt
            # (a full weight read and write) at every step of the while_loop.
            q = jnp.einsum("btd,dnh->btnh", x, self.q_proj[...].astype(dt))
            k = jnp.einsum("btd,dkh->btkh", x, self.k_proj[...].astype(dt))
            v = jnp.einsum("btd,dkh->btkh", x, self.v_proj[...].astype(dt))
        else:
            # One [D, (N + 2K) H] matmul instead of three: fewer, larger dots run nearer the CPU's
            # matmul peak, forward and backward (benchmarks/NOTES.md).
            w_qkv = jnp.concatenate([self.q_proj[...].reshape(c.hidden_size, n * hd),
                                     self.k_proj[...].reshape(c.hidden_size, kv * hd),
                                     self.v_proj[...].reshape(c.hidden_size, kv * hd)], axis=1).astype(dt)
            qkv = checkpoint_name(dense(x, w_qkv), "qkv_proj")
            q = qkv[..., : n * hd].reshape(b, t, n, hd)
            k = qkv[..., n * hd : (n + kv) * hd].reshape(b, t, kv, hd)
            v = qkv[..., (n + kv) * hd :].reshape(b, t, kv, hd)
        if c.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if c.qk_norm:  # Qwen3, Gemma 3: RMSNorm over head_dim before RoPE
            q = _norm(c, q, self.q_norm[...])
            k = _norm(c, k, self.k_norm[...])
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        if c.query_scale != 1.0:
            # query_pre_attn_scalar (Gemma): scaling q here, once, gives every attention kernel
            # (reference, blockwise, cuDNN, splash, decode) the right scores without a scale
            # argument in each; it costs one rounding of q (relative 2^-24 in float32).
            q = q * jnp.asarray(c.query_scale, q.dtype)
        return q, k, v

    def shared_prompt(self, x_NxLxD, rope: Rope, prompt_mask_NxP, completion_mask_NxGxC) -> jax.Array:
        """Attention for N sequences laid out as one prompt then its G completions, L = P + G*C.

        Same results as running the N*G rows [prompt, completion] through `__call__`, with the
        prompt's projections computed once instead of G times. Returns [N, L, D].
        """
        c = self.config
        n, l = x_NxLxD.shape[:2]
        q, k, v = self._qkv(x_NxLxD, rope)
        out_NxLxNxH = shared_prompt_attention(q, k, v, prompt_mask_NxP, completion_mask_NxGxC,
                                              impl=c.attention_impl, window=self.window,
                                              softcap=c.attn_logit_softcap)
        w_o = self.o_proj[...].astype(DTYPES[c.dtype]).reshape(c.num_heads * c.head_dim, c.hidden_size)
        return checkpoint_name(dense(out_NxLxNxH.reshape(n, l, -1), w_o), "o_proj")

    def __call__(self, x_BxTxD, rope: Rope, key_mask_BxS, cache: KVCache | None, write_index,
                 slot_bounds=None) -> tuple[jax.Array, KVCache]:
        """Attention of T queries at cache slots write_index + [0, T) over S key slots.

        cache None: the keys are these T tokens themselves (S = T, write_index must be 0), the
        kernel is `self_attention`'s choice, and the returned KVCache holds them (keys [B, K, H, T],
        values [B, K, T, H]). Otherwise this step's k/v are written into the cache at write_index
        (dynamic_update_slice) and the updated cache is returned; write_index is one slot for every
        row, or (T = 1) one per row, [B] (the continuous sampler's rows are at different steps).
        key_mask_BxS: 1 where a slot holds a real token. Slot s is visible from query slot q when
        key_mask[b, s] and s <= q (causal), and q - s < window in a sliding-window layer.
        slot_bounds (decode, T = 1): the lowest and highest query slot over the batch (scalars);
        with a cache of more than 4 `blockwise.decode_block()`s, only the blocks between them (less the
        window) are attended (`blockwise.decode_attention`). Computed here for one write_index.
        """
        c = self.config
        dt = DTYPES[c.dtype]
        b, t = x_BxTxD.shape[:2]
        n, hd = c.num_heads, c.head_dim
        q, k, v = self._qkv(x_BxTxD, rope)
        k_BxKxHxT, v_BxKxTxH = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
        write_index = jnp.asarray(write_index, jnp.int32)
        if cache is None:
            out_BxTxNxH = self_attention(q, k, v, key_mask_BxS, impl=c.attention_impl, window=self.window,
                                         softcap=c.attn_logit_softcap)
            return self._project_out(out_BxTxNxH.reshape(b, t, n * hd)), KVCache(k_BxKxHxT, v_BxKxTxH)
        if write_index.ndim == 1:  # one slot per row (continuous batching: rows at different steps)
            cache = KVCache(_write_per_row(cache.k_BxKxHxS, k_BxKxHxT, write_index, axis=2),
                            _write_per_row(cache.v_BxKxSxH, v_BxKxTxH, write_index, axis=1))
        else:
            zero = jnp.zeros((), jnp.int32)
            cache = KVCache(
                jax.lax.dynamic_update_slice(cache.k_BxKxHxS, k_BxKxHxT.astype(cache.k_BxKxHxS.dtype),
                                             (zero, zero, zero, write_index)),
                jax.lax.dynamic_update_slice(cache.v_BxKxSxH, v_BxKxTxH.astype(cache.v_BxKxSxH.dtype),
                                             (zero, zero, write_index, zero)),
            )
        keys, values = cache.k_BxKxHxS.astype(dt), cache.v_BxKxSxH.astype(dt)
        s = keys.shape[3]
        g = c.num_heads // c.num_kv_heads
        o_KxGxHxD = self.o_proj[...].astype(dt).reshape(c.num_kv_heads, g, c.head_dim, c.hidden_size)
        block = blockwise.decode_block()
        if t == 1 and s > blockwise.BLOCKED_DECODE_MIN_BLOCKS * block:
            q_slot_B = jnp.broadcast_to(write_index, (b,))
            if slot_bounds is None:  # one slot for all rows: no reduction (rows may be on other devices)
                slot_bounds = ((write_index, write_index) if write_index.ndim == 0
                               else (jnp.min(write_index), jnp.max(write_index)))
            out = blockwise.decode_attention(q, keys, values, key_mask_BxS, q_slot_B, slot_bounds,
                                             window=self.window, block=block, softcap=c.attn_logit_softcap)
            return jnp.einsum("bkgth,kghd->btd", out, o_KxGxHxD), cache
        # Query slots: one for every row ([T]) or a row's own ([B, T]); visible up to the query's.
        if write_index.ndim == 0:
            q_slot_xT = (write_index + jnp.arange(t, dtype=jnp.int32))[None, :]
        else:
            q_slot_xT = write_index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        k_slot_1x1xS = jnp.arange(s, dtype=jnp.int32)[None, None, :]
        visible_BxTxS = (key_mask_BxS[:, None, :] > 0) & (k_slot_1x1xS <= q_slot_xT[:, :, None])
        if self.window is not None:
            visible_BxTxS = visible_BxTxS & (q_slot_xT[:, :, None] - k_slot_1x1xS < self.window)
        kernel = attend_one_query if t == 1 else attend
        out_BxKxGxTxH = kernel(q, keys, values, visible_BxTxS, c.attn_logit_softcap)
        if t == 1:
            return jnp.einsum("bkgth,kghd->btd", out_BxKxGxTxH, o_KxGxHxD), cache
        # Heads n = k * G + g in order, then one [B, T, N*H] x [N*H, D] matmul (see `dense`).
        return self._project_out(out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(b, t, n * hd)), cache

    def _project_out(self, out_BxTxNH) -> jax.Array:
        """The o projection of [B, T, N*H] attention outputs, one matmul (see `dense`): [B, T, D]."""
        c = self.config
        w_o = self.o_proj[...].astype(DTYPES[c.dtype]).reshape(c.num_heads * c.head_dim, c.hidden_size)
        return checkpoint_name(dense(out_BxTxNH, w_o), "o_proj")


def _write_per_row(cache_BxX, new_BxX, write_index_B, axis: int):
    """cache with row b's new entries written at slot write_index_B[b] along `axis` (of the row's
    own [K, H, S] or [K, S, H] block): a batched dynamic_update_slice, in place under a donated
    while_loop carry, and local to each device when rows are split over devices."""
    def one(c, x, w):
        start = [jnp.zeros((), jnp.int32)] * c.ndim
        start[axis] = w
        return jax.lax.dynamic_update_slice(c, x.astype(c.dtype), start)

    return jax.vmap(one)(cache_BxX, new_BxX, write_index_B)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, normals: _NormalPool):
        c = config
        self.config = config
        self.gate_proj = _param("gate_proj", normals.take((c.hidden_size, c.intermediate_size)))
        self.up_proj = _param("up_proj", normals.take((c.hidden_size, c.intermediate_size)))
        self.down_proj = _param("down_proj", normals.take((c.intermediate_size, c.hidden_size)))

    def __call__(self, x_BxTxD):
        dt = DTYPES[self.config.dtype]
        x = x_BxTxD.astype(dt)
        if x.shape[1] == 1:  # decode: no per-step weight concatenation (see Attention)
            gate = jnp.einsum("btd,df->btf", x, self.gate_proj[...].astype(dt))
            up = jnp.einsum("btd,df->btf", x, self.up_proj[...].astype(dt))
            act = jax.nn.silu(gate) if self.config.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
            return jnp.einsum("btf,fd->btd", act * up, self.down_proj[...].astype(dt))
        # gate and up as one [D, 2F] matmul (fewer, larger dots; see Attention)
        w_gate_up = jnp.concatenate([self.gate_proj[...], self.up_proj[...]], axis=1).astype(dt)
        gate_up = checkpoint_name(dense(x, w_gate_up), "gate_up_proj")
        return checkpoint_name(dense(self._glu(gate_up), self.down_proj[...].astype(dt)), "down_proj")

    def _glu(self, gate_up_BxTx2F):
        """act(gate) * up (`ModelConfig.hidden_act`)."""
        return swiglu(gate_up_BxTx2F) if self.config.hidden_act == "silu" else gelu_tanh_glu(gate_up_BxTx2F)


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, normals: _NormalPool, layer: int = 0):
        d = config.hidden_size
        self.config = config
        self.attn_norm = _param("attn_norm", _norm_weight(config, d))
        self.attn = Attention(config, normals, layer)
        self.mlp_norm = _param("mlp_norm", _norm_weight(config, d))
        self.mlp = moe.SparseMoe(config, normals) if config.is_sparse(layer) else MLP(config, normals)
        if config.sandwich_norms:
            self.post_attn_norm = _param("post_attn_norm", _norm_weight(config, d))
            self.post_mlp_norm = _param("post_mlp_norm", _norm_weight(config, d))

    def _residual(self, x_BxTxD, out_BxTxD, post_norm: str):
        """x + out, with out normed first under sandwich_norms (Gemma's post-sublayer norms)."""
        if self.config.sandwich_norms:
            out_BxTxD = _norm(self.config, out_BxTxD, getattr(self, post_norm)[...])
        return x_BxTxD + out_BxTxD

    def __call__(self, x_BxTxD, rope: Rope, key_mask_BxS, cache, write_index, slot_bounds=None):
        c = self.config
        attn_out, cache = self.attn(_norm(c, x_BxTxD, self.attn_norm[...]), rope, key_mask_BxS, cache,
                                    write_index, slot_bounds)
        x = self._residual(x_BxTxD, attn_out, "post_attn_norm")
        return self._residual(x, self.mlp(_norm(c, x, self.mlp_norm[...])), "post_mlp_norm"), cache

    def shared_prompt(self, x_NxLxD, rope: Rope, prompt_mask_NxP, completion_mask_NxGxC):
        """`__call__` for the one-prompt-then-G-completions layout (Attention.shared_prompt)."""
        c = self.config
        attn_out = self.attn.shared_prompt(_norm(c, x_NxLxD, self.attn_norm[...]), rope, prompt_mask_NxP,
                                           completion_mask_NxGxC)
        x = self._residual(x_NxLxD, attn_out, "post_attn_norm")
        return self._residual(x, self.mlp(_norm(c, x, self.mlp_norm[...])), "post_mlp_norm")


def default_positions(attention_mask_BxT: jax.Array) -> jax.Array:
    """cumsum(mask) - 1 clipped at 0: each row's first real token sits at position 0."""
    return jnp.maximum(jnp.cumsum(attention_mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, DTYPES[config.param_dtype]
        self.config = config
        normals = _NormalPool(rngs.params(), _num_random_weights(c), pd)
        self.embed = _param("embed", normals.take((c.vocab_size, c.hidden_size)))
        self.layers = nnx.List([Block(c, normals, i) for i in range(c.num_layers)])
        self.final_norm = _param("final_norm", _norm_weight(c, c.hidden_size))
        if not c.tie_embeddings:
            self.lm_head = _param("lm_head", normals.take((c.hidden_size, c.vocab_size)))
        assert normals._offset == normals._values.size, "_num_random_weights disagrees with the layers"

    def __call__(self, tokens_BxT, *, positions_BxT=None, attention_mask_BxT=None):
        """Logits [B, T, V] float32. No mask: causal over all T tokens, positions 0..T-1."""
        if attention_mask_BxT is None:
            attention_mask_BxT = jnp.ones(tokens_BxT.shape, jnp.int32)
        max_position = None  # caller's positions: any values, computed directly
        if positions_BxT is None:
            positions_BxT, max_position = default_positions(attention_mask_BxT), tokens_BxT.shape[1]
        h_BxTxD, _ = self.hidden_states(tokens_BxT, positions_BxT, attention_mask_BxT,
                                        max_position=max_position)
        return self.logits(h_BxTxD)

    def hidden_states(self, tokens_BxT, positions_BxT, key_mask_BxS, caches=None, write_index=0,
                      max_position: int | None = None, slot_bounds=None):
        """Final-normed hidden states [B, T, D] (compute dtype) and one KVCache per layer.

        caches None: S = T, the tokens attend to themselves (causal, key_mask = attention mask),
        and the returned caches hold their keys [B, K, H, T] and values [B, K, T, H]. Otherwise the
        tokens occupy slots write_index + [0, T) of the given caches (decode) and the updated caches
        return. max_position: a bound the caller guarantees on every position (0 <= p < it), which
        lets RoPE use a lookup table (`rope_tables`); positions from `default_positions` stay below T.
        slot_bounds (decode): the batch's lowest and highest query slot (`Attention.__call__`).
        """
        c = self.config
        x = self._embed(tokens_BxT)
        ropes = self._layer_ropes(positions_BxT, x.dtype, max_position)
        new_caches = []
        for i, layer in enumerate(self.layers):
            if caches is None:
                x, cache = remat_layer(c, lambda blk, x, rope, mask: blk(x, rope, mask, None, 0))(
                    layer, x, ropes[i], key_mask_BxS)
            else:
                x, cache = layer(x, ropes[i], key_mask_BxS, caches[i], write_index, slot_bounds)
            x = constrain_rows(x)
            new_caches.append(cache)
        return _norm(c, x, self.final_norm[...]), new_caches

    def _embed(self, tokens_BxT) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype; times sqrt(D) under embed_scale, the
        factor rounded to the weights' dtype first (as HF's Gemma3TextScaledWordEmbedding)."""
        c = self.config
        e = self.embed[...][tokens_BxT]
        if c.embed_scale:
            e = e * jnp.asarray(math.sqrt(c.hidden_size), e.dtype)
        return constrain_rows(e.astype(DTYPES[c.dtype]))

    def _layer_ropes(self, positions_BxT, dtype, max_position) -> list[Rope]:
        """Each layer's RoPE tables: one set for all, or (rope_local_theta) a second set for the
        sliding-window layers, each computed once."""
        c = self.config
        table = rope_tables(positions_BxT, rope_inv_freq(c), dtype, max_position=max_position)
        if c.rope_local_theta is None or c.layer_types is None:
            return [table] * c.num_layers
        local = rope_tables(positions_BxT, rope_inv_freq(c, sliding=True), dtype, max_position=max_position)
        return [table if c.window(i) is None else local for i in range(c.num_layers)]

    def shared_prompt_hidden_states(self, prompt_NxP, prompt_mask_NxP, completions_NxGxC,
                                    completion_mask_NxGxC):
        """Final-normed hidden states of N prompts, once each ([N, P, D]), and of their G
        completions ([N, G, C, D]); equal to `hidden_states` of the N*G rows [prompt, completion]
        (left-padded prompts; positions continue from each prompt's real length)."""
        c = self.config
        n, p = prompt_NxP.shape
        _, g, cl = completions_NxGxC.shape
        prompt_pos_NxP = default_positions(prompt_mask_NxP)
        prompt_len_N = prompt_mask_NxP.astype(jnp.int32).sum(axis=1)
        comp_pos = (jnp.cumsum(completion_mask_NxGxC.astype(jnp.int32), axis=-1) - 1
                    + prompt_len_N[:, None, None])
        positions_NxL = jnp.concatenate([prompt_pos_NxP, jnp.maximum(comp_pos, 0).reshape(n, g * cl)], axis=1)
        tokens_NxL = jnp.concatenate([prompt_NxP, completions_NxGxC.reshape(n, g * cl)], axis=1)
        x = self._embed(tokens_NxL)
        ropes = self._layer_ropes(positions_NxL, x.dtype, p + cl)
        run_layer = remat_layer(c, lambda blk, *args: blk.shared_prompt(*args))
        for layer, rope in zip(self.layers, ropes):
            x = constrain_rows(run_layer(layer, x, rope, prompt_mask_NxP, completion_mask_NxGxC))
        h = _norm(c, x, self.final_norm[...])
        return h[:, :p], h[:, p:].reshape(n, g, cl, -1)

    def logits(self, h_BxTxD) -> jax.Array:
        """Output projection, accumulated and returned in float32 [B, T, V] (soft-capped as
        cap * tanh(logits / cap) under final_logit_softcap)."""
        cap = self.config.final_logit_softcap
        logits = self._project_vocab(h_BxTxD)
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def _project_vocab(self, h_BxTxD) -> jax.Array:
        dt = DTYPES[self.config.dtype]
        if self.config.tie_embeddings:
            return jnp.einsum("btd,vd->btv", h_BxTxD.astype(dt), self.embed[...].astype(dt),
                              preferred_element_type=jnp.float32)
        if dt == jnp.float32:  # `dense`'s backward layout (its output dtype is its input's)
            return dense(h_BxTxD.astype(dt), self.lm_head[...].astype(dt))
        return jnp.einsum("btd,dv->btv", h_BxTxD.astype(dt), self.lm_head[...].astype(dt),
                          preferred_element_type=jnp.float32)


def init_model(config: ModelConfig, seed: int) -> Transformer:
    """A randomly initialised Transformer (weights N(0, 0.02^2), norms 1, biases 0).

    Built abstractly, then materialised by one jitted function: op-by-op creation compiles one
    tiny program per distinct shape, slow on a CPU (benchmarks/NOTES.md).
    """
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=seed))))
    state = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(params=seed)))[1])()
    return nnx.merge(graphdef, state)

