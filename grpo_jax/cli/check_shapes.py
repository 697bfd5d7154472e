"""The model's shape for `python -m grpo_jax check`, read without weights: `model.hf_path`'s
config.json, a `--model-shape` preset (`MODEL_SHAPES`), or the config's `model.*` fields."""

from __future__ import annotations

import os

# --model-shape presets: the shape fields of each model's public Hugging Face config.json
# (huggingface.co/<repo>/blob/main/config.json, the Instruct repos the shipped configs use;
# Qwen/Qwen2.5-{0.5B,1.5B,7B,32B}-Instruct, meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-30B-A3B,
# google/gemma-3-1b-it, and the text_config of google/gemma-3-4b-it with Gemma3TextConfig's
# defaults for the keys it leaves out). Only fields that hf.config_from_hf reads (and the token ids
# `resolve_shape` reads); the base models have the same shapes.
MODEL_SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                     "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 151645},
    "qwen2.5-1.5b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                     "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 151645},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                   "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 151645},
    "qwen2.5-32b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120, "intermediate_size": 27648,
                    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "vocab_size": 152064, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                    "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 151645},
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
                     "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                     "mlp_bias": False, "head_dim": 128, "bos_token_id": 128000,
                     "eos_token_id": [128001, 128008, 128009],
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    # Qwen/Qwen3-30B-A3B (Qwen3MoeForCausalLM): 48 sparse layers of 128 experts, 8 per token.
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0, "rope_scaling": None,
                      "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "hidden_act": "silu",
                      "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                      "max_window_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False,
                      "bos_token_id": 151643, "eos_token_id": 151645},
    # google/gemma-3-1b-it (Gemma3ForCausalLM): 5 sliding-window layers (512 tokens) to 1 global.
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "intermediate_size": 6912,
                   "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "vocab_size": 262144, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                   "rope_scaling": None, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
                   "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "sliding_window": 512,
                   "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
                   "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
                   "pad_token_id": 0},
    # google/gemma-3-4b-it's language model (Gemma3ForConditionalGeneration's text_config; its vision
    # tower, 0.4B, is not counted): global layers' RoPE scaled linearly by 8, a 1024-token window.
    "gemma-3-4b": {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 2560, "intermediate_size": 10240,
                   "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "vocab_size": 262208, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-06,
                   "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                   "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                   "final_logit_softcapping": None, "attn_logit_softcapping": None, "bos_token_id": 2,
                   "eos_token_id": [1, 106], "pad_token_id": 0},
}


def resolve_shape(config, preset: str | None):
    """(ModelConfig, where the shape came from, stop ids, pad id); nothing but config.json (and
    generation_config.json's stop ids beside it) is read."""
    from grpo_jax import config as config_lib
    from grpo_jax.io import hf
    from grpo_jax.io.tokenizer_files import stop_ids_beside
    from grpo_jax.training import run_context

    m = config.model
    if m.hf_path and os.path.isdir(m.hf_path) and not preset:
        try:
            hf_config = hf.read_config(m.hf_path)
        except (FileNotFoundError, ValueError) as e:
            raise config_lib.ConfigError(f"model.hf_path={m.hf_path!r}: {e}") from None
        source = f"model.hf_path={m.hf_path}/config.json"
    elif preset:
        hf_config, source = MODEL_SHAPES[preset], f"--model-shape {preset}"
    elif m.hf_path:
        raise config_lib.ConfigError(
            f"model.hf_path={m.hf_path!r} is not a directory on this machine, so its config.json cannot be read; "
            f"pass --model-shape with one of {sorted(MODEL_SHAPES)} (check reads no weights)")
    else:
        tokenizer = run_context.configured_tokenizer(config)
        vocab = m.vocab_size or tokenizer.vocab_size
        run_context.check_vocab(vocab, tokenizer, f"model.vocab_size={vocab}", m)
        eos = tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))
        return m.model_config(vocab), "the config's model.* fields", eos, tokenizer.pad_id
    try:
        model_config = hf.config_from_hf(hf_config, dtype=m.dtype, param_dtype="float32", remat=m.remat,
                                         attention_impl=m.attention_impl)
    except (KeyError, ValueError) as e:
        raise config_lib.ConfigError(f"{source}: {e}") from None
    # The stop ids a run reads: generation_config.json's list first (Gemma 3 [1, 106], Qwen2.5-Instruct
    # two), else config.json's; transformers 5 writes "eos_token_id": null when a model has none
    # (the Qwen3-MoE fixture), which counts as unset, as a missing key does.
    try:
        stops = stop_ids_beside(m.hf_path, model_config.vocab_size) if source.startswith("model.hf_path") else []
    except ValueError as e:  # an id past the vocabulary: the run would refuse it too
        raise config_lib.ConfigError(f"model.hf_path={m.hf_path!r}: {e}") from None
    eos = stops or hf_config.get("eos_token_id")
    if eos is None:
        eos = model_config.vocab_size - 1
    eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
    pad = hf_config.get("pad_token_id")
    return model_config, source, eos, eos[0] if pad is None else int(pad)
