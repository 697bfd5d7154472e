"""Rotary position embedding: inverse frequencies (optional Llama-3 scaling), cos/sin tables, rotation.

Hugging Face's "rotate half" convention (the two halves of head_dim pair up), so HF q/k weights
load without permutation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig, sliding: bool = False) -> jax.Array:
    """Inverse frequencies [H/2] (float32), with the configured scaling. sliding: those of the
    sliding-window layers, which with `rope_local_theta` set use that base and no scaling (Gemma 3)."""
    h = config.head_dim
    local = sliding and config.rope_local_theta is not None
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    s = None if local else config.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":  # position interpolation: every angle slowed by `factor`
        return inv_freq / s.factor
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


def rope_tables(positions_BxT: jax.Array, inv_freq: jax.Array, dtype,
                max_position: int | None = None) -> Rope:
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
