"""The decoder's configuration: `ModelConfig`, `RopeScaling` and the dtype names they accept."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Config dtype name -> jnp dtype, for param_dtype (storage) and dtype (compute).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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
    # How the backward pass runs, not the architecture (never written to an HF config.json): True
    # recomputes each layer's activations in the backward pass (jax.checkpoint per layer) instead of
    # keeping them, for about a third more forward compute.
    remat: bool = False

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
            if value not in DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {sorted(DTYPES)}, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )
