"""Decoder-only transformer (Llama / Qwen2 / Qwen3 family) in Flax NNX, used functionally.

One config covers RMSNorm, RoPE (theta, optional Llama-3 scaling), grouped-query attention, a
SwiGLU MLP, optional q/k/v bias (Qwen2), optional q/k RMSNorm over head_dim (Qwen3) and tied or
untied embeddings. Code that jits takes `graphdef, params = nnx.split(model, nnx.Param)` and calls
the pure `forward` / `token_logprobs` below; nothing here uses `nnx.jit`.

Dimension letters: B batch, T query length, S key length / sequence, D hidden_size, N num_heads,
K num_kv_heads, G = N // K query heads per kv head, H head_dim, F intermediate_size, V vocab,
C number of target tokens, L layers.

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
    layers[i].mlp.gate_proj    [D, F]      HF mlp.gate_proj.weight [F, D] -> .T
    layers[i].mlp.up_proj      [D, F]      HF mlp.up_proj.weight [F, D] -> .T
    layers[i].mlp.down_proj    [F, D]      HF mlp.down_proj.weight [D, F] -> .T
    final_norm                 [D]         HF model.norm.weight
    lm_head                    [D, V]      HF lm_head.weight [V, D] -> .T          (untied only)

RoPE uses the Hugging Face "rotate half" convention (the two halves of head_dim pair up), so HF
q/k weights load without permutation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3" in HF config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "RopeScaling needs high_freq_factor > low_freq_factor > 0, got "
                f"low_freq_factor={self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}"
            )
        if not self.original_max_position_embeddings > 0:
            raise ValueError(
                "RopeScaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings!r}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for name in ("param_dtype", "dtype"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )


# One table: weight name -> PartitionSpec over mesh axes ("data", "fsdp", "tensor").
# "data" never shards weights (it splits the batch); "fsdp" shards the hidden dimension D of
# every matrix; "tensor" shards heads, the MLP width and the vocabulary (Megatron style).
SHARDING: dict[str, tuple[str | None, ...]] = {
    "embed": ("tensor", "fsdp"),            # [V, D]
    "attn_norm": (None,),                   # [D]
    "q_proj": ("fsdp", "tensor", None),     # [D, N, H]
    "k_proj": ("fsdp", "tensor", None),     # [D, K, H]
    "v_proj": ("fsdp", "tensor", None),     # [D, K, H]
    "o_proj": ("tensor", None, "fsdp"),     # [N, H, D]
    "q_bias": ("tensor", None),             # [N, H]
    "k_bias": ("tensor", None),             # [K, H]
    "v_bias": ("tensor", None),             # [K, H]
    "q_norm": (None,),                      # [H]
    "k_norm": (None,),                      # [H]
    "mlp_norm": (None,),                    # [D]
    "gate_proj": ("fsdp", "tensor"),        # [D, F]
    "up_proj": ("fsdp", "tensor"),          # [D, F]
    "down_proj": ("tensor", "fsdp"),        # [F, D]
    "final_norm": (None,),                  # [D]
    "lm_head": ("fsdp", "tensor"),          # [D, V]
}


def _param(name: str, value: jax.Array) -> nnx.Param:
    # eager_sharding=False: keep the annotation as metadata only; flax 0.12 would otherwise try to
    # place the value on a mesh at construction, and there is none on one device.
    return nnx.Param(value, out_sharding=SHARDING[name], eager_sharding=False)


class _NormalPool:
    """Hands out consecutive slices of ONE N(0, 0.02^2) draw (0.02: HF's initializer_range).

    One draw instead of one per weight: each jax.random.normal of a new shape is its own
    threefry program, and ~20 of them took ~30 s to compile on a loaded 2-core CPU.
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


def _num_random_weights(c: "ModelConfig") -> int:
    d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    per_layer = d * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * d * f
    return v * d * (1 if c.tie_embeddings else 2) + c.num_layers * per_layer


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * scale over the last axis, statistics in float32 (as HF)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Inverse frequencies [H/2] (float32), with Llama-3 scaling when configured."""
    h = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated linearly in 1/wavelength.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


class Rope(NamedTuple):
    """cos and sin of position * inv_freq, [B, T, 1, H/2] (compute dtype), shared by every layer."""

    cos: jax.Array
    sin: jax.Array


def rope_tables(positions_BxT: jax.Array, inv_freq: jax.Array, dtype, max_position: int | None = None) -> Rope:
    """The RoPE angles' cos and sin for every (row, token), computed once per forward.

    With max_position (positions are known to be < it), cos and sin are evaluated on the
    [max_position, H/2] grid and looked up: XLA's CPU backend fuses these tables into each layer's
    rotation and recomputes them per element of q and k (forward and backward), and a lookup is
    much cheaper to recompute than a sine (benchmarks/NOTES.md). Decode (T = 1) computes directly.
    """
    if max_position is None:
        angles_BxTxh = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
        cos, sin = jnp.cos(angles_BxTxh), jnp.sin(angles_BxTxh)
    else:
        angles_Mxh = jnp.arange(max_position, dtype=jnp.float32)[:, None] * inv_freq
        cos, sin = jnp.cos(angles_Mxh)[positions_BxT], jnp.sin(angles_Mxh)[positions_BxT]
    return Rope(cos[:, :, None, :].astype(dtype), sin[:, :, None, :].astype(dtype))


def apply_rope(x_BxTxNxH: jax.Array, rope: Rope) -> jax.Array:
    """Rotates pairs (i, i + H/2) by angle position * inv_freq[i] (HF rotate_half convention)."""
    x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
    return jnp.concatenate([x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin], axis=-1)


@jax.custom_vjp
def dense(x_BxTxD: jax.Array, w_DxF: jax.Array) -> jax.Array:
    """x_BxTxD @ w_DxF -> [B, T, F], with a backward pass laid out for XLA's CPU matmul kernels.

    dy is materialised once. The input gradient is dy @ w^T contracting both minor axes (no copy
    of w). The weight gradient x^T @ dy uses an explicit transposed copy of x when D <= F (a plain
    [D, BT] x [BT, F] matmul), else contracts the row axis of x and dy directly: the fastest of
    the layouts measured on W1's shapes. Left to itself XLA transposed dy (the larger operand),
    fused with the elementwise backward of SwiGLU into slow strided loops (benchmarks/NOTES.md).
    """
    return jnp.einsum("btd,df->btf", x_BxTxD, w_DxF)


def _dense_fwd(x_BxTxD, w_DxF):
    return dense(x_BxTxD, w_DxF), (x_BxTxD, w_DxF)


def _dense_bwd(res, dy_BxTxF):
    x_BxTxD, w_DxF = res
    d, f = w_DxF.shape
    barrier = jax.lax.optimization_barrier
    # dy materialised once (not recomputed inside each matmul that reads it).
    dy_NxF = barrier(dy_BxTxF.reshape(-1, f).astype(x_BxTxD.dtype))
    x_NxD = x_BxTxD.reshape(-1, d)
    dx_NxD = jax.lax.dot_general(dy_NxF, w_DxF.astype(dy_NxF.dtype), (((1,), (1,)), ((), ())))
    if d <= f:
        dw = jnp.dot(barrier(x_NxD.T), dy_NxF, preferred_element_type=jnp.float32)
    else:  # [N, D] x [N, F] contracting N: as fast as it gets here when D > F (measured)
        dw = jax.lax.dot_general(x_NxD, dy_NxF, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx_NxD.reshape(x_BxTxD.shape).astype(x_BxTxD.dtype), dw.astype(w_DxF.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


@jax.custom_vjp
def swiglu(gate_up_BxTx2F: jax.Array) -> jax.Array:
    """silu(gate) * up from the fused [..., 2F] projection (gate first): [B, T, F].

    The backward writes d(gate | up) as one [..., 2F] array with the sigmoid computed once;
    differentiated as two slices, XLA formed each half's padded gradient and added them.
    """
    gate, up = jnp.split(gate_up_BxTx2F, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate_up_BxTx2F):
    gate, up = jnp.split(gate_up_BxTx2F, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    # The sigmoid is kept for the backward (one exp per element in all, not two).
    return gate * sig * up, (gate, up, sig)


def _swiglu_bwd(res, dh_BxTxF):
    gate, up, sig = res
    # d silu(a) / da = s + a s (1 - s) = s (1 + a (1 - s))
    d_gate = dh_BxTxF * up * sig * (1 + gate * (1 - sig))
    return (jnp.concatenate([d_gate, dh_BxTxF * gate * sig], axis=-1),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class KVCache(NamedTuple):
    """One layer's keys (after RoPE, stored transposed) and values: slot s of row b at
    k[b, :, :, s] and v[b, :, s].

    Heads before slots: with [B, S, K, H] XLA transposed the whole cache at every decode step (3x
    slower on CPU). Keys as [H, S]: the prefill's q @ k is a plain [G, H] x [H, S] product, and
    decode's sum over H (`_attend_one_query`) runs over a major axis and vectorises along S. As
    [S, H], XLA's CPU dot took 0.78 ms per layer-step on W1 against 0.27 ms for probs @ v of the
    same size (benchmarks/NOTES.md, changes 11 and 16).
    """

    k_BxKxHxS: jax.Array
    v_BxKxSxH: jax.Array


def _attend(q_BxTxNxH, keys_BxKxHxS, values_BxKxSxH, visible_BxTxS) -> jax.Array:
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


def _attend_one_query(q_Bx1xNxH, keys_BxKxHxS, values_BxKxSxH, visible_Bx1xS) -> jax.Array:
    """`_attend` for one query per row (decode), as broadcast multiplies and sums: [B, K, G, 1, H].

    Both sums run over a major axis (H of the transposed keys, then S of the values), so they
    vectorise along the minor one. As batched matmuls these were B*K products of [G, H] x [H, S]:
    XLA's CPU dot kernels took several times longer on such tiny operands (benchmarks/NOTES.md).
    """
    b, _, n, hd = q_Bx1xNxH.shape
    kv = keys_BxKxHxS.shape[1]
    g = n // kv
    q_BxKxGxH = q_Bx1xNxH.reshape(b, kv, g, hd).astype(jnp.float32)
    scores_BxKxGxS = jnp.sum(q_BxKxGxH[..., None] * keys_BxKxHxS[:, :, None].astype(jnp.float32), axis=3)
    scores_BxKxGxS = jnp.where(visible_Bx1xS[:, None], scores_BxKxGxS / math.sqrt(hd), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(values_BxKxSxH.dtype)
    out_BxKxGxH = jnp.sum(probs[..., None] * values_BxKxSxH[:, :, None], axis=3)
    return out_BxKxGxH[:, :, :, None].astype(q_Bx1xNxH.dtype)


def _attend_after_shared_prompt(q_NxGxCxKxRxH, k_prompt_NxKxHxP, v_prompt_NxKxPxH, prompt_mask_NxP,
                                k_NxGxCxKxH, v_NxGxCxKxH, completion_mask_NxGxC) -> jax.Array:
    """Attention of G completions per prompt over their one shared prompt and themselves.

    Completion token c of sample g sees the prompt's real tokens and its own tokens <= c. The
    prompt's keys are multiplied once per prompt by the queries of all G samples ([N, K, R*G*C, P],
    no G-fold copy); the completion part is per sample ([N*G, K, R*C, C]). One softmax spans both
    blocks (a shared max and normaliser). Returns [N, G, C, K*R*H], heads n = k * R + r.
    """
    n, g, c, kv, r, hd = q_NxGxCxKxRxH.shape
    p = k_prompt_NxKxHxP.shape[3]
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
    out_cp = jax.lax.dot_general(e_cp.astype(dt), v_prompt_NxKxPxH, (((3,), (2,)), batch), preferred_element_type=f32)
    out_cc = jax.lax.dot_general(e_cc.astype(dt).reshape(n * g, kv, r * c, c), v_cc, (((3,), (2,)), batch),
                                 preferred_element_type=f32)
    # Both to [N, G, C, K, R, H], normalised once.
    out = (out_cp.reshape(n, kv, r, g, c, hd).transpose(0, 3, 4, 1, 2, 5)
           + out_cc.reshape(n, g, kv, r, c, hd).transpose(0, 1, 4, 2, 3, 5))
    inv_denom = (1.0 / denom).transpose(0, 1, 4, 2, 3)[..., None]  # [N, G, C, K, R, 1]
    return (out * inv_denom).astype(dt).reshape(n, g, c, kv * r * hd)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, normals: _NormalPool):
        c, pd = config, _DTYPES[config.param_dtype]
        self.config = config
        self.q_proj = _param("q_proj", normals.take((c.hidden_size, c.num_heads, c.head_dim)))
        self.k_proj = _param("k_proj", normals.take((c.hidden_size, c.num_kv_heads, c.head_dim)))
        self.v_proj = _param("v_proj", normals.take((c.hidden_size, c.num_kv_heads, c.head_dim)))
        self.o_proj = _param("o_proj", normals.take((c.num_heads, c.head_dim, c.hidden_size)))
        if c.qkv_bias:
            self.q_bias = _param("q_bias", jnp.zeros((c.num_heads, c.head_dim), pd))
            self.k_bias = _param("k_bias", jnp.zeros((c.num_kv_heads, c.head_dim), pd))
            self.v_bias = _param("v_bias", jnp.zeros((c.num_kv_heads, c.head_dim), pd))
        if c.qk_norm:
            self.q_norm = _param("q_norm", jnp.ones((c.head_dim,), pd))
            self.k_norm = _param("k_norm", jnp.ones((c.head_dim,), pd))

    def _qkv(self, x_BxTxD, rope: Rope):
        """Queries [B, T, N, H] and keys, values [B, T, K, H] (compute dtype), RoPE applied."""
        c = self.config
        dt = _DTYPES[c.dtype]
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
            qkv = dense(x, w_qkv)
            q = qkv[..., : n * hd].reshape(b, t, n, hd)
            k = qkv[..., n * hd : (n + kv) * hd].reshape(b, t, kv, hd)
            v = qkv[..., (n + kv) * hd :].reshape(b, t, kv, hd)
        if c.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if c.qk_norm:  # Qwen3: RMSNorm over head_dim before RoPE
            q = rms_norm(q, self.q_norm[...], c.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], c.rms_norm_eps)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        return q, k, v

    def shared_prompt(self, x_NxLxD, rope: Rope, prompt_mask_NxP, completion_mask_NxGxC) -> jax.Array:
        """Attention for N sequences laid out as one prompt then its G completions, L = P + G*C.

        Same results as running the N*G rows [prompt, completion] through `__call__`, with the
        prompt's projections computed once instead of G times. Returns [N, L, D].
        """
        c = self.config
        n, p = prompt_mask_NxP.shape
        _, g, cl = completion_mask_NxGxC.shape
        kv, r, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        q, k, v = self._qkv(x_NxLxD, rope)
        k_prompt, v_prompt = k[:, :p].transpose(0, 2, 3, 1), v[:, :p].transpose(0, 2, 1, 3)
        visible_NxPxP = (prompt_mask_NxP[:, None, :] > 0) & (jnp.arange(p)[None, :] <= jnp.arange(p)[:, None])[None]
        out_prompt = _attend(q[:, :p], k_prompt, v_prompt, visible_NxPxP)  # [N, K, R, P, H]
        out_prompt_NxPxNH = out_prompt.transpose(0, 3, 1, 2, 4).reshape(n, p, c.num_heads * hd)
        out_completion = _attend_after_shared_prompt(
            q[:, p:].reshape(n, g, cl, kv, r, hd), k_prompt, v_prompt, prompt_mask_NxP,
            k[:, p:].reshape(n, g, cl, kv, hd), v[:, p:].reshape(n, g, cl, kv, hd), completion_mask_NxGxC)
        out_NxLxNH = jnp.concatenate([out_prompt_NxPxNH, out_completion.reshape(n, g * cl, -1)], axis=1)
        w_o = self.o_proj[...].astype(_DTYPES[c.dtype]).reshape(c.num_heads * hd, c.hidden_size)
        return dense(out_NxLxNH, w_o)

    def __call__(self, x_BxTxD, rope: Rope, key_mask_BxS, cache: KVCache | None,
                 write_index) -> tuple[jax.Array, KVCache]:
        """Attention of T queries at cache slots write_index + [0, T) over S key slots.

        cache None: the keys are these T tokens themselves (S = T, write_index must be 0) and the
        returned KVCache holds them (keys [B, K, H, T], values [B, K, T, H]). Otherwise this step's k/v are written into the cache at
        write_index (dynamic_update_slice) and the updated cache is returned.
        key_mask_BxS: 1 where a slot holds a real token. Slot s is visible from query slot q when
        key_mask[b, s] and s <= q (causal).
        """
        c = self.config
        dt = _DTYPES[c.dtype]
        b, t = x_BxTxD.shape[:2]
        n, hd = c.num_heads, c.head_dim
        q, k, v = self._qkv(x_BxTxD, rope)
        k_BxKxHxT, v_BxKxTxH = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
        if cache is None:
            cache = KVCache(k_BxKxHxT, v_BxKxTxH)
        else:
            zero, slot = jnp.zeros((), jnp.int32), jnp.asarray(write_index, jnp.int32)
            cache = KVCache(
                jax.lax.dynamic_update_slice(cache.k_BxKxHxS, k_BxKxHxT.astype(cache.k_BxKxHxS.dtype),
                                             (zero, zero, zero, slot)),
                jax.lax.dynamic_update_slice(cache.v_BxKxSxH, v_BxKxTxH.astype(cache.v_BxKxSxH.dtype),
                                             (zero, zero, slot, zero)),
            )
        keys, values = cache.k_BxKxHxS.astype(dt), cache.v_BxKxSxH.astype(dt)
        s = keys.shape[3]
        q_slot_T = jnp.asarray(write_index, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
        visible_BxTxS = (key_mask_BxS[:, None, :] > 0) & (
            jnp.arange(s, dtype=jnp.int32)[None, None, :] <= q_slot_T[None, :, None]
        )
        attend = _attend_one_query if t == 1 else _attend
        out_BxKxGxTxH = attend(q, keys, values, visible_BxTxS)
        g = c.num_heads // c.num_kv_heads
        o_KxGxHxD = self.o_proj[...].astype(dt).reshape(c.num_kv_heads, g, c.head_dim, c.hidden_size)
        if t == 1:
            return jnp.einsum("bkgth,kghd->btd", out_BxKxGxTxH, o_KxGxHxD), cache
        # Heads n = k * G + g in order, then one [B, T, N*H] x [N*H, D] matmul (see `dense`).
        out_BxTxNH = out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(b, t, n * hd)
        return dense(out_BxTxNH, o_KxGxHxD.reshape(n * hd, c.hidden_size)), cache


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, normals: _NormalPool):
        c, pd = config, _DTYPES[config.param_dtype]
        self.config = config
        self.gate_proj = _param("gate_proj", normals.take((c.hidden_size, c.intermediate_size)))
        self.up_proj = _param("up_proj", normals.take((c.hidden_size, c.intermediate_size)))
        self.down_proj = _param("down_proj", normals.take((c.intermediate_size, c.hidden_size)))

    def __call__(self, x_BxTxD):
        dt = _DTYPES[self.config.dtype]
        x = x_BxTxD.astype(dt)
        if x.shape[1] == 1:  # decode: no per-step weight concatenation (see Attention)
            gate = jnp.einsum("btd,df->btf", x, self.gate_proj[...].astype(dt))
            up = jnp.einsum("btd,df->btf", x, self.up_proj[...].astype(dt))
            return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.down_proj[...].astype(dt))
        # gate and up as one [D, 2F] matmul (fewer, larger dots; see Attention)
        w_gate_up = jnp.concatenate([self.gate_proj[...], self.up_proj[...]], axis=1).astype(dt)
        return dense(swiglu(dense(x, w_gate_up)), self.down_proj[...].astype(dt))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, normals: _NormalPool):
        pd = _DTYPES[config.param_dtype]
        self.config = config
        self.attn_norm = _param("attn_norm", jnp.ones((config.hidden_size,), pd))
        self.attn = Attention(config, normals)
        self.mlp_norm = _param("mlp_norm", jnp.ones((config.hidden_size,), pd))
        self.mlp = MLP(config, normals)

    def __call__(self, x_BxTxD, rope: Rope, key_mask_BxS, cache, write_index):
        eps = self.config.rms_norm_eps
        attn_out, cache = self.attn(rms_norm(x_BxTxD, self.attn_norm[...], eps), rope, key_mask_BxS, cache,
                                    write_index)
        x = x_BxTxD + attn_out
        return x + self.mlp(rms_norm(x, self.mlp_norm[...], eps)), cache


    def shared_prompt(self, x_NxLxD, rope: Rope, prompt_mask_NxP, completion_mask_NxGxC):
        """`__call__` for the one-prompt-then-G-completions layout (Attention.shared_prompt)."""
        eps = self.config.rms_norm_eps
        x = x_NxLxD + self.attn.shared_prompt(rms_norm(x_NxLxD, self.attn_norm[...], eps), rope,
                                              prompt_mask_NxP, completion_mask_NxGxC)
        return x + self.mlp(rms_norm(x, self.mlp_norm[...], eps))


def default_positions(attention_mask_BxT: jax.Array) -> jax.Array:
    """cumsum(mask) - 1 clipped at 0: each row's first real token sits at position 0."""
    return jnp.maximum(jnp.cumsum(attention_mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, _DTYPES[config.param_dtype]
        self.config = config
        normals = _NormalPool(rngs.params(), _num_random_weights(c), pd)
        self.embed = _param("embed", normals.take((c.vocab_size, c.hidden_size)))
        self.layers = nnx.List([Block(c, normals) for _ in range(c.num_layers)])
        self.final_norm = _param("final_norm", jnp.ones((c.hidden_size,), pd))
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
        h_BxTxD, _ = self.hidden_states(tokens_BxT, positions_BxT, attention_mask_BxT, max_position=max_position)
        return self.logits(h_BxTxD)

    def hidden_states(self, tokens_BxT, positions_BxT, key_mask_BxS, caches=None, write_index=0,
                      max_position: int | None = None):
        """Final-normed hidden states [B, T, D] (compute dtype) and one KVCache per layer.

        caches None: S = T, the tokens attend to themselves (causal, key_mask = attention mask),
        and the returned caches hold their keys [B, K, H, T] and values [B, K, T, H]. Otherwise the
        tokens occupy slots write_index + [0, T) of the given caches (decode) and the updated caches
        return. max_position: a bound the caller guarantees on every position (0 <= p < it), which
        lets RoPE use a lookup table (`rope_tables`); positions from `default_positions` stay below T.
        """
        c = self.config
        x = self.embed[...][tokens_BxT].astype(_DTYPES[c.dtype])
        rope = rope_tables(positions_BxT, rope_inv_freq(c), x.dtype, max_position=max_position)
        new_caches = []
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, rope, key_mask_BxS, None if caches is None else caches[i], write_index)
            new_caches.append(cache)
        return rms_norm(x, self.final_norm[...], c.rms_norm_eps), new_caches

    def shared_prompt_hidden_states(self, prompt_NxP, prompt_mask_NxP, completions_NxGxC, completion_mask_NxGxC):
        """Final-normed hidden states of N prompts, once each ([N, P, D]), and of their G
        completions ([N, G, C, D]); equal to `hidden_states` of the N*G rows [prompt, completion]
        (left-padded prompts; positions continue from each prompt's real length)."""
        c = self.config
        n, p = prompt_NxP.shape
        _, g, cl = completions_NxGxC.shape
        prompt_pos_NxP = default_positions(prompt_mask_NxP)
        prompt_len_N = prompt_mask_NxP.astype(jnp.int32).sum(axis=1)
        comp_pos = jnp.cumsum(completion_mask_NxGxC.astype(jnp.int32), axis=-1) - 1 + prompt_len_N[:, None, None]
        positions_NxL = jnp.concatenate([prompt_pos_NxP, jnp.maximum(comp_pos, 0).reshape(n, g * cl)], axis=1)
        tokens_NxL = jnp.concatenate([prompt_NxP, completions_NxGxC.reshape(n, g * cl)], axis=1)
        x = self.embed[...][tokens_NxL].astype(_DTYPES[c.dtype])
        rope = rope_tables(positions_NxL, rope_inv_freq(c), x.dtype, max_position=p + cl)
        for layer in self.layers:
            x = layer.shared_prompt(x, rope, prompt_mask_NxP, completion_mask_NxGxC)
        h = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        return h[:, :p], h[:, p:].reshape(n, g, cl, -1)

    def logits(self, h_BxTxD) -> jax.Array:
        """Output projection, accumulated and returned in float32 [B, T, V]."""
        dt = _DTYPES[self.config.dtype]
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
    tiny program per distinct shape, which costs tens of seconds on a CPU.
    """
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=seed))))
    state = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(params=seed)))[1])()
    return nnx.merge(graphdef, state)


def forward(graphdef, params, tokens_BxT, attention_mask_BxT, positions_BxT=None) -> jax.Array:
    """Pure forward: logits_BxTxV (float32) from the params pytree; what jitted code calls."""
    model = nnx.merge(graphdef, params)
    return model(tokens_BxT, positions_BxT=positions_BxT, attention_mask_BxT=attention_mask_BxT)


# Above this many float32 logits ([B, C, V] elements, 256 MiB) token_logprobs works in chunks;
# inside one chunk the logits, their log-softmax and (for entropy) its exp briefly coexist.
_MAX_LOGITS_ELEMENTS = 1 << 26


def _target_logprobs(logits_BxCxV, targets_BxC, temperature, return_entropy):
    """log softmax(logits / T)[target] and (optionally) the entropy, without a [B, C, V] log-prob
    array: the target's logit is picked by a one-hot mask (its gradient is the mask again,
    elementwise; `take_along_axis` differentiates into a scatter)."""
    scaled = logits_BxCxV.astype(jnp.float32) / temperature
    shifted = scaled - jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    lse_BxC = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    is_target = jnp.arange(scaled.shape[-1], dtype=jnp.int32) == targets_BxC[..., None]
    logp_BxC = jnp.sum(jnp.where(is_target, shifted, 0.0), axis=-1) - lse_BxC
    if not return_entropy:
        return logp_BxC, None
    # Seed, "Entropy": H = -sum_v p_v log p_v = lse - sum_v p_v * shifted_v (log p_v = shifted_v - lse).
    probs = jnp.exp(shifted - lse_BxC[..., None])
    return logp_BxC, lse_BxC - jnp.sum(probs * shifted, axis=-1)


def token_logprobs(graphdef, params, tokens_BxS, attention_mask_BxS, *, num_targets: int,
                   temperature: float = 1.0, return_entropy: bool = False,
                   chunk_size: int | None = None, group_size: int = 1):
    """log softmax(logits / temperature)[token t] given tokens[:, :t], for t in [S - C, S).

    Returns logp_BxC float32 (C = num_targets), or (logp_BxC, entropy_BxC) with
    return_entropy. Logits are formed only for the C positions that predict targets; when
    B * C * V exceeds 2^26 (or chunk_size is given) they are formed chunk_size positions at a
    time under jax.checkpoint, so one chunk's [B, c, V] float32 array is alive at once, in the
    backward pass too.

    group_size G > 1: rows come in groups of G consecutive rows with the same prompt part
    (tokens and mask of the first S - C positions), as GRPO's G answers to one prompt. Each
    prompt then runs through the model once, not G times (`shared_prompt_hidden_states`): the
    same log-probs with 1 - (P + G*C) / (G*S) fewer tokens in every projection (29% on W1).
    The caller guarantees the shared prompts; they are not checked here (the first row's is used).
    """
    b, s = tokens_BxS.shape
    c = num_targets
    if not 0 < c < s:
        raise ValueError(f"token_logprobs: num_targets must be in [1, S - 1] = [1, {s - 1}], got {c}")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature!r}")
    if not isinstance(group_size, int) or group_size < 1 or b % group_size:
        raise ValueError(f"token_logprobs: group_size must be an int >= 1 dividing the {b} rows, got {group_size!r}")
    model = nnx.merge(graphdef, params)
    if group_size == 1:
        h_BxSxD, _ = model.hidden_states(tokens_BxS, default_positions(attention_mask_BxS), attention_mask_BxS,
                                         max_position=s)
        # The hidden state at position t - 1 predicts token t.
        h_BxCxD = h_BxSxD[:, s - c - 1 : s - 1]
    else:
        n, g, p = b // group_size, group_size, s - c
        tokens_NxGxS = tokens_BxS.reshape(n, g, s)
        mask_NxGxS = attention_mask_BxS.reshape(n, g, s)
        h_prompt_NxPxD, h_NxGxCxD = model.shared_prompt_hidden_states(
            tokens_NxGxS[:, 0, :p], mask_NxGxS[:, 0, :p], tokens_NxGxS[:, :, p:], mask_NxGxS[:, :, p:])
        # Completion token 0 is predicted by the prompt's last position, token t by completion t - 1.
        last_prompt = jnp.broadcast_to(h_prompt_NxPxD[:, None, p - 1 :], (n, g, 1, h_NxGxCxD.shape[-1]))
        h_BxCxD = jnp.concatenate([last_prompt, h_NxGxCxD[:, :, : c - 1]], axis=2).reshape(b, c, -1)
    targets_BxC = tokens_BxS[:, s - c :]
    v = model.config.vocab_size
    if chunk_size is None:
        chunk_size = c if b * c * v <= _MAX_LOGITS_ELEMENTS else max(1, _MAX_LOGITS_ELEMENTS // (b * v))
    if chunk_size >= c:
        logp, ent = _target_logprobs(model.logits(h_BxCxD), targets_BxC, temperature, return_entropy)
        return (logp, ent) if return_entropy else logp

    num_chunks = -(-c // chunk_size)
    pad = num_chunks * chunk_size - c
    h_pad = jnp.pad(h_BxCxD, ((0, 0), (0, pad), (0, 0)))
    t_pad = jnp.pad(targets_BxC, ((0, 0), (0, pad)))
    # [num_chunks, B, chunk, ...] so lax.map walks chunks in order.
    h_chunks = h_pad.reshape(b, num_chunks, chunk_size, -1).transpose(1, 0, 2, 3)
    t_chunks = t_pad.reshape(b, num_chunks, chunk_size).transpose(1, 0, 2)

    @jax.checkpoint
    def one_chunk(args):
        h, t = args
        logp, ent = _target_logprobs(model.logits(h), t, temperature, return_entropy)
        return logp, (jnp.zeros_like(logp) if ent is None else ent)

    logp_chunks, ent_chunks = jax.lax.map(one_chunk, (h_chunks, t_chunks))
    logp = logp_chunks.transpose(1, 0, 2).reshape(b, -1)[:, :c]
    if not return_entropy:
        return logp
    return logp, ent_chunks.transpose(1, 0, 2).reshape(b, -1)[:, :c]


def partition_specs(params):
    """PartitionSpec per weight, same tree as `params`, read from the SHARDING table by name."""

    def spec(path, leaf):
        # Innermost named key wins: ('layers', 0, 'attn', 'q_proj', .value) -> 'q_proj'.
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        for name in reversed(names):
            if name in SHARDING:
                if len(SHARDING[name]) != jnp.ndim(leaf):
                    raise ValueError(
                        f"partition_specs: weight {name!r} has shape {jnp.shape(leaf)} but the "
                        f"SHARDING table gives {SHARDING[name]} ({len(SHARDING[name])} dims)"
                    )
                return P(*SHARDING[name])
        raise ValueError(
            f"partition_specs: no SHARDING entry for {jax.tree_util.keystr(path)}; "
            f"known weights: {sorted(SHARDING)}"
        )

    return jax.tree_util.tree_map_with_path(spec, params)
