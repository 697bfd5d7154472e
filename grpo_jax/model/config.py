"""The decoder's configuration: `ModelConfig`, `RopeScaling` and the dtype names they accept."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Config dtype name -> jnp dtype, for param_dtype (storage) and dtype (compute).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT_POLICIES = ("none", "layer_inputs", "dots")
LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash")  # grpo_jax.model.attention
MOE_IMPLS = ("auto", "ragged", "tiled")  # grpo_jax.model.grouped_matmul


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
    # Sliding-window attention (Hugging Face's `sliding_window` and `layer_types`): a layer whose type
    # is "sliding_attention" lets a token see itself and the sliding_window - 1 slots before it.
    # layer_types None: every layer full attention.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Mixture of experts (Qwen3-MoE; HF's names, `grpo_jax.model.moe`). num_experts 0: every layer has
    # the dense MLP of intermediate_size (the defaults change nothing). Otherwise layer i is sparse
    # when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, as in transformers:
    # num_experts experts of moe_intermediate_size, num_experts_per_tok of them per token, their
    # softmax weights renormalised to sum to 1 when norm_topk_prob. router_aux_loss_coef and
    # output_router_logits are carried for the config.json round trip and for the caller that adds
    # the load-balancing loss (`moe.load_balancing_loss`); the forward pass never reads them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    # How the passes run, not the architecture (never written to an HF config.json).
    # remat (`REMAT_POLICIES`): what each layer keeps for the backward pass. "none": everything;
    # "layer_inputs" (or True): only its input, everything inside recomputed (about a third more
    # forward compute); "dots": its projections' outputs (q|k|v, o, gate|up, down), attention and
    # the elementwise work recomputed. No policy keeps attention scores.
    remat: bool | str = False
    # attention_impl: the attention kernel (`grpo_jax.model.attention.resolve`).
    attention_impl: str = "auto"
    # moe_impl: the experts' grouped matmul (`grpo_jax.model.grouped_matmul`): "ragged"
    # (jax.lax.ragged_dot), "tiled", or "auto" (ragged on TPU, tiled elsewhere).
    moe_impl: str = "auto"

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
        if self.remat not in (True, False) and self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat must be True, False or one of {list(REMAT_POLICIES)}, "
                             f"got {self.remat!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl must be one of {list(ATTENTION_IMPLS)}, "
                             f"got {self.attention_impl!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"ModelConfig.moe_impl must be one of {list(MOE_IMPLS)}, got {self.moe_impl!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"ModelConfig.layer_types must give one of {list(LAYER_TYPES)} for each of the "
                                 f"{self.num_layers} layers, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and not (
                    isinstance(self.sliding_window, int) and self.sliding_window >= 1):
                raise ValueError(f"ModelConfig.sliding_window must be an int >= 1 for sliding_attention layers, "
                                 f"got {self.sliding_window!r}")
        if self.num_experts:
            self._check_experts()
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )

    def _check_experts(self):
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int with num_experts > 0, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        if not isinstance(self.mlp_only_layers, tuple) or not all(
                isinstance(i, int) and 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(f"ModelConfig.mlp_only_layers must be a tuple of layer indices in [0, "
                             f"{self.num_layers}), got {self.mlp_only_layers!r}")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has the experts (else the dense MLP), by transformers' rule."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def remat_policy(self) -> str:
        """`remat` as a policy name: True is "layer_inputs", False "none"."""
        if self.remat is True:
            return "layer_inputs"
        return "none" if self.remat is False else self.remat

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window in slots (None: full attention)."""
        if self.layer_types is None or self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window
