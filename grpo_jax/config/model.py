"""The policy's sections: `model` (a checkpoint or a fresh shape, its tokenizer and kernels) and
`lora` (adapters over a frozen base). Each validates itself and builds the model layer's config."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from grpo_jax.config.checks import ConfigError, check_fields, positive

DEFAULT_TOKENIZER = "char:0123456789+="
# The stored (master) weights are always float32: bf16 masters do not train at RL learning rates
# (model.param_dtype was removed; config.moved says why).
MASTER_DTYPE = "float32"


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy. Either `hf_path` (a Hugging Face checkpoint directory) or the shape fields below."""

    NAME: ClassVar[str] = "model"
    hf_path: str | None = None
    # See grpo_jax.io.tokenizer.load_tokenizer for accepted specs. None: the checkpoint's own tokenizer
    # (`hf_path`), else the demo's 14-symbol "char:0123456789+=".
    tokenizer: str | None = None
    vocab_size: int = 0  # 0: taken from the tokenizer
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # The compute dtype: bfloat16 runs the forward and backward in bf16 on float32 master weights.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # What each layer keeps for the backward pass (jax.checkpoint per layer). False / "none":
    # everything. True / "layer_inputs": only its input, the rest recomputed (~1/3 more forward
    # compute; activation memory about one layer's plus each layer's input). "dots": also its
    # projections' outputs, only attention and elementwise work recomputed. `check` shows each.
    remat: bool | Literal["none", "layer_inputs", "dots"] = False
    # The attention kernel (grpo_jax.model.attention): "auto" picks cuDNN on GPUs, splash on TPUs
    # where they apply, else the reference "xla" kernel for small calls and "blockwise" (memory
    # linear in the length) beyond. The choice is logged at start-up.
    attention_impl: Literal["auto", "xla", "blockwise", "cudnn", "splash"] = "auto"
    init_seed: int = 0
    # Bounds on rendering the tokenizer's chat template (it comes with the checkpoint: untrusted
    # code; grpo_jax.io.chat_template_bounds): wall time and characters, output and any value built.
    chat_template_max_seconds: float = 2.0
    chat_template_max_chars: int = 4_000_000

    def tokenizer_spec(self) -> str:
        """The tokenizer this model uses: `tokenizer`, else `hf_path`'s, else the demo's."""
        return self.tokenizer or self.hf_path or DEFAULT_TOKENIZER

    def validate(self) -> None:
        check_fields(self)
        positive(self, "chat_template_max_seconds", "chat_template_max_chars")
        if self.hf_path is None:
            positive(self, "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
            if self.num_heads % self.num_kv_heads:
                raise ConfigError(f"model.num_heads={self.num_heads} must be a multiple of "
                                  f"model.num_kv_heads={self.num_kv_heads}")

    def model_config(self, vocab: int):
        """The `grpo_jax.model.ModelConfig` of a fresh model from the shape fields (no `hf_path`),
        with `vocab` rows of embedding (`vocab_size`, else the tokenizer's)."""
        from grpo_jax.model.config import ModelConfig  # noqa: PLC0415 - the model layer, on demand

        return ModelConfig(
            vocab_size=vocab, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
            tie_embeddings=self.tie_embeddings, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
            param_dtype=MASTER_DTYPE, dtype=self.dtype, remat=self.remat, attention_impl=self.attention_impl)


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """LoRA (grpo_jax.model.lora): r > 0 trains rank-r adapters on `target_modules` (HF names, our
    expert names expert_gate / expert_up / expert_down / router, or the presets "attention" /
    "all-linear" / "experts") of a frozen base, which is also the reference policy;
    0 trains every weight. TRL's ModelConfig names without their `lora_` prefix (peft's `r`,
    `target_modules`). B starts at 0 (step 0 = the base); A as peft's "kaiming" (default) or
    "gaussian". The base may be stored in bfloat16."""

    NAME: ClassVar[str] = "lora"
    r: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)
    init: Literal["kaiming", "gaussian"] = "kaiming"
    base_dtype: Literal["float32", "bfloat16"] = "float32"

    def validate(self) -> None:
        check_fields(self)
        if self.r < 0:
            raise ConfigError(f"lora.r={self.r} must be >= 0 (0: full fine-tuning)")
        if not self.r:
            return
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be > 0 (the adapters' scale is alpha / r)")
        if self.dropout:
            raise ConfigError(
                f"lora.dropout={self.dropout}: grpo_jax merges the adapters into the weights (W + "
                "alpha/r * A @ B), which leaves no adapter-only input to drop; set it to 0")
        from grpo_jax.model.lora import resolve_targets  # noqa: PLC0415 - the model layer, on demand

        try:
            resolve_targets(self.target_modules)
        except ValueError as e:
            raise ConfigError(f"lora.target_modules={list(self.target_modules)}: {e}") from None

    def spec(self, compute_dtype: str):
        """The trainer's `grpo_jax.model.lora.LoraSpec` (None when r = 0); merged weights are
        computed in the model's `compute_dtype` (`model.dtype`)."""
        if not self.r:
            return None
        import jax.numpy as jnp  # noqa: PLC0415

        from grpo_jax.model.lora import LoraSpec, resolve_targets  # noqa: PLC0415

        return LoraSpec(rank=self.r, scale=self.alpha / self.r, targets=resolve_targets(self.target_modules),
                        merge_dtype=jnp.bfloat16 if compute_dtype == "bfloat16" else jnp.float32)
