"""The decoder's configuration: `ModelConfig`, `RopeScaling` and the dtype names they accept."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

# Config dtype name -> jnp dtype, for param_dtype (storage) and dtype (compute).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT_POLICIES = ("none", "layer_inputs", "dots")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: SwiGLU (Llama, Qwen) or GeGLU (Gemma)
ROPE_SCALING_TYPES = ("llama3", "linear")
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash")  # grpo_jax.model.attention
MOE_IMPLS = ("auto", "ragged", "tiled")  # grpo_jax.model.grouped_matmul


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, HF config.json's "rope_type": "llama3" (Llama 3.1: long wavelengths
    slowed by `factor`, short ones kept, the band between interpolated; needs the three fields after
    `factor`) or "linear" (every frequency divided by `factor`: Gemma 3's global layers)."""

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    rope_type: str = "llama3"

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {list(ROPE_SCALING_TYPES)}, "
                             f"got {self.rope_type!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}")
        if self.rope_type == "linear":
            return
        if self.low_freq_factor is None or self.high_freq_factor is None \
                or self.original_max_position_embeddings is None:
            raise ValueError("RopeScaling of rope_type 'llama3' needs low_freq_factor, high_freq_factor and "
                             f"original_max_position_embeddings, got {self!r}")
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
    # Gemma 3 (Hugging Face's Gemma3ForCausalLM); each default is the Llama / Qwen behaviour.
    # rope_local_theta: the RoPE base of the sliding-window layers (HF rope_local_base_freq; they
    # take no rope_scaling); None: every layer uses rope_theta and rope_scaling.
    rope_local_theta: float | None = None
    # hidden_act (`HIDDEN_ACTS`): the MLP is act(gate) * up.
    hidden_act: str = "silu"
    # rms_norm_offset: norm weights are stored as offsets from 1 (scale = 1 + w, applied in float32
    # before the cast back, as Gemma's RMSNorm); a fresh model's norms then start at 0.
    rms_norm_offset: bool = False
    # sandwich_norms: a second RMSNorm on the attention's and the MLP's outputs before each is
    # added to the residual (HF post_attention_layernorm / post_feedforward_layernorm in Gemma).
    sandwich_norms: bool = False
    # embed_scale: token embeddings multiplied by sqrt(hidden_size), rounded to the weights' dtype.
    embed_scale: bool = False
    # query_pre_attn_scalar: attention scores are q.k * query_pre_attn_scalar**-0.5
    # (None: head_dim**-0.5).
    query_pre_attn_scalar: float | None = None
    # final_logit_softcap: logits = cap * tanh(logits / cap) (None: none).
    final_logit_softcap: float | None = None
    # attn_logit_softcap: attention scores (after scaling) = cap * tanh(scores / cap) in every kernel
    # but cuDNN's, which has no such option (None: none). Gemma 2's attn_logit_softcapping; no
    # supported HF architecture applies it yet (transformers' Gemma 3 ignores the field).
    attn_logit_softcap: float | None = None
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
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {list(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcap", "attn_logit_softcap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ValueError(f"ModelConfig.{name} must be a number > 0 or None, got {value!r}")
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

    @property
    def query_scale(self) -> float:
        """What q is multiplied by so that the kernels' q.k / sqrt(head_dim) is q.k times
        query_pre_attn_scalar**-0.5: sqrt(head_dim / query_pre_attn_scalar) (1.0 without it)."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window in slots (None: full attention)."""
        if self.layer_types is None or self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window
