"""Hugging Face config.json <-> ModelConfig: which architectures we read (Llama, Qwen2/2.5, Qwen3,
Qwen3-MoE, Gemma 3 text),
what their config.json fields mean for the model, and the config.json an export writes (keeping a
source checkpoint's keys where the model did not change them).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from grpo_jax.io.tokenizer_files import read_json_object
from grpo_jax.model import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "Gemma3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
GEMMA3 = "Gemma3ForCausalLM"
# Qwen3-MoE's config.json keys, each the ModelConfig field of the same name. transformers 5 writes
# num_experts as num_local_experts (its attribute_map); Qwen's checkpoints and vLLM say num_experts.
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")


def read_config(path: str | pathlib.Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; a missing or corrupt file is an error naming it."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"config.json not found in checkpoint directory {path} "
                                f"(expected {file})")
    return read_json_object(file)


def architecture_of(hf_config: dict[str, Any]) -> str:
    """One of `SUPPORTED_ARCHITECTURES`, else a ValueError."""
    archs = hf_config.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(hf_config.get("model_type", ""), None)
    if arch not in SUPPORTED_ARCHITECTURES:
        found = archs or hf_config.get("model_type")
        raise ValueError(f"unsupported architecture {found!r} in config.json; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope(hf_config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers < 5 writes rope_theta + rope_scaling; 5.x nests both in rope_parameters.
    params = hf_config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    return theta, _scaling(hf_config.get("rope_scaling") or params)


def _scaling(scaling: dict[str, Any]) -> RopeScaling | None:
    """The RopeScaling a rope_scaling / rope_parameters dict asks for (None: "default")."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
    if kind != "llama3":
        raise ValueError(f"config.json rope type {kind!r} is not supported; supported: 'default', "
                         "'llama3', 'linear'")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _number(hf_config: dict[str, Any], key: str, kind: type = int):
    """A required numeric field of config.json; a missing or non-numeric one is named."""
    if key not in hf_config:
        raise KeyError(key)
    value = hf_config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {key!r} must be a number, got {value!r}")
    return kind(value)


def _sliding_windows(hf_config: dict[str, Any], arch: str, num_layers: int):
    """(sliding_window, layer_types) as transformers reads them: Qwen2 and Qwen3 use a window only
    with use_sliding_window (else sliding_window is None), in the layers `layer_types` names or,
    without it, layers >= max_window_layers. (None, None): full attention."""
    if arch == "Qwen3MoeForCausalLM" and hf_config.get("use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true is not supported for Qwen3MoeForCausalLM; "
                         "supported: false (sliding windows: Qwen2, Qwen3)")
    if arch == "LlamaForCausalLM":
        if hf_config.get("use_sliding_window", False) or "sliding_attention" in (hf_config.get("layer_types") or []):
            raise ValueError("config.json use_sliding_window / sliding_attention layers are not supported for "
                             "LlamaForCausalLM; supported: full attention (sliding windows: Qwen2, Qwen3)")
        return None, None
    if not hf_config.get("use_sliding_window", False):
        return None, None
    window = hf_config.get("sliding_window")
    if window is None:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"config.json sliding_window must be a positive int, got {window!r}")
    types = hf_config.get("layer_types")
    if types is None:
        first = int(hf_config.get("max_window_layers", num_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json layer_types must name full_attention or sliding_attention for each of "
                         f"the {num_layers} layers, got {types!r}")
    if "sliding_attention" not in types:
        return None, None
    return window, tuple(types)


def _moe_fields(hf_config: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's expert fields from a Qwen3-MoE config.json (transformers' defaults where a key
    is absent); {} for the dense architectures."""
    if arch != "Qwen3MoeForCausalLM":
        return {}
    if "num_experts" not in hf_config and "num_local_experts" not in hf_config:
        raise KeyError("num_experts")
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    return dict(
        num_experts=_number({"num_experts": experts}, "num_experts"),
        num_experts_per_tok=_number(hf_config, "num_experts_per_tok"),
        moe_intermediate_size=_number(hf_config, "moe_intermediate_size"),
        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf_config.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf_config.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(hf_config.get("output_router_logits", False)),
    )


def _gemma3_fields(hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelConfig fields of a Gemma3ForCausalLM config.json, read as transformers' Gemma3TextConfig
    does (its defaults where a key is absent); what the model lacks is an error naming the key."""
    for key, lacking in (("use_bidirectional_attention", False), ("attention_bias", False)):
        if hf_config.get(key, lacking) not in (lacking, False):
            raise ValueError(f"config.json {key}={hf_config[key]!r} is not supported for {GEMMA3}; "
                             f"supported: {lacking!r} (the model has no such option)")
    if hf_config.get("attn_logit_softcapping") is not None:
        # transformers' Gemma3ForCausalLM keeps the field but never applies it (its logits are the
        # same with and without; the parity test checks that), while our kernels would: no
        # reading of such a file agrees with the reference implementation.
        raise ValueError(f"config.json attn_logit_softcapping={hf_config['attn_logit_softcapping']!r} is not "
                         f"supported for {GEMMA3}: transformers ignores it there; supported: null")
    act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json hidden_activation {act!r} is not supported for {GEMMA3}; "
                         "supported: 'gelu_pytorch_tanh'")
    types = hf_config.get("layer_types")
    if types is None:  # transformers' rule: every pattern-th layer global, the others sliding
        pattern = int(hf_config.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    window = hf_config.get("sliding_window", 4096)
    if len(types) != num_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json layer_types must name full_attention or sliding_attention for each of "
                         f"the {num_layers} layers, got {types!r}")
    if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"config.json sliding_window must be a positive int, got {window!r}")
    # transformers 5: rope_parameters = {layer type: {rope_type, rope_theta, ...}}; before it,
    # rope_theta + rope_scaling (global layers) and rope_local_base_freq (sliding layers).
    params = hf_config.get("rope_parameters") or {}
    full = params.get("full_attention") or {**(hf_config.get("rope_scaling") or {}),
                                             "rope_theta": hf_config.get("rope_theta", 1_000_000.0)}
    local = params.get("sliding_attention") or {"rope_theta": hf_config.get("rope_local_base_freq", 10_000.0)}
    if _scaling(local) is not None:
        raise ValueError(f"config.json rope_parameters.sliding_attention {local!r}: scaled RoPE in sliding "
                         "layers is not supported; supported: rope_type 'default'")
    softcap = hf_config.get("final_logit_softcapping")
    scalar = _number(hf_config, "query_pre_attn_scalar", float) if "query_pre_attn_scalar" in hf_config else 256.0
    sliding = "sliding_attention" in types
    return dict(
        rope_theta=float(full.get("rope_theta", 1_000_000.0)), rope_scaling=_scaling(full),
        rope_local_theta=float(local.get("rope_theta", 10_000.0)) if sliding else None,
        sliding_window=window if sliding else None, layer_types=tuple(types) if sliding else None,
        hidden_act=act, rms_norm_offset=True, sandwich_norms=True, embed_scale=True, qk_norm=True,
        query_pre_attn_scalar=scalar,
        final_logit_softcap=None if softcap is None else float(softcap),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", True)),
        head_dim=int(hf_config.get("head_dim", 256)),
    )


def config_from_hf(hf_config: dict[str, Any], *, dtype: str = "float32", param_dtype: str | None = None,
                   remat: bool | str = False, attention_impl: str = "auto") -> ModelConfig:
    """ModelConfig for a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 text config.json dict; features we
    lack are errors. remat and attention_impl say how the passes run (ModelConfig); config.json has neither."""
    arch = architecture_of(hf_config)
    if arch == GEMMA3:
        return _config(hf_config, _gemma3_fields(hf_config, _number(hf_config, "num_hidden_layers")),
                       dtype=dtype, param_dtype=param_dtype, remat=remat, attention_impl=attention_impl)
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported; supported: 'silu'")
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which the model lacks.
    if arch != "Qwen2ForCausalLM" and hf_config.get("attention_bias", False):
        raise ValueError(f"config.json attention_bias=true ({arch}) is not supported; supported: false")
    if hf_config.get("mlp_bias", False):
        raise ValueError("config.json mlp_bias=true is not supported; supported: false")
    window, layer_types = _sliding_windows(hf_config, arch, _number(hf_config, "num_hidden_layers"))
    theta, scaling = _rope(hf_config)
    fields = dict(
        rope_theta=theta, rope_scaling=scaling, sliding_window=window, layer_types=layer_types,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",  # Qwen2 always has q/k/v biases (and no o bias)
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        **_moe_fields(hf_config, arch),
    )
    return _config(hf_config, fields, dtype=dtype, param_dtype=param_dtype, remat=remat,
                   attention_impl=attention_impl)


def _config(hf_config: dict[str, Any], fields: dict[str, Any], *, dtype: str, param_dtype: str | None,
            remat: bool | str, attention_impl: str) -> ModelConfig:
    """ModelConfig of the shape fields every architecture spells alike, plus its own `fields`."""
    heads = _number(hf_config, "num_attention_heads")
    hidden = _number(hf_config, "hidden_size")
    fields = {"head_dim": int(hf_config.get("head_dim") or hidden // heads), **fields}
    return ModelConfig(
        vocab_size=_number(hf_config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_number(hf_config, "intermediate_size"),
        num_layers=_number(hf_config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        param_dtype=param_dtype or dtype,
        dtype=dtype,
        remat=remat,
        attention_impl=attention_impl,
        **fields,
    )


# What Gemma3ForCausalLM has that the others lack, as ModelConfig fields and their Gemma 3 values.
_GEMMA3_SHAPE = {"rms_norm_offset": True, "sandwich_norms": True, "embed_scale": True, "qk_norm": True,
                 "hidden_act": "gelu_pytorch_tanh", "qkv_bias": False}
_GEMMA_ONLY = ("rms_norm_offset", "sandwich_norms", "embed_scale", "rope_local_theta", "query_pre_attn_scalar",
               "final_logit_softcap")


def architecture_for(config: ModelConfig) -> str:
    """The HF architecture `config` exports as; a model no supported architecture fits is an error."""
    if config.attn_logit_softcap is not None:
        raise ValueError(f"attn_logit_softcap={config.attn_logit_softcap} has no HF architecture to export as: "
                         f"{GEMMA3} in transformers ignores it (Gemma 2 applies it, and is not supported yet)")
    if config.hidden_act != "silu" or any(getattr(config, f) not in (None, False) for f in _GEMMA_ONLY):
        wrong = {f: getattr(config, f) for f, want in _GEMMA3_SHAPE.items() if getattr(config, f) != want}
        if wrong:
            raise ValueError(f"a model with Gemma fields exports as {GEMMA3}, which needs {_GEMMA3_SHAPE}; "
                             f"this one has {wrong}")
        return GEMMA3
    if config.qkv_bias and config.qk_norm:
        raise ValueError("no supported HF architecture has both qkv_bias and qk_norm; supported: "
                         "LlamaForCausalLM (neither), Qwen2ForCausalLM (qkv_bias), "
                         "Qwen3ForCausalLM (qk_norm)")
    if config.num_experts:
        if not config.qk_norm or config.qkv_bias or config.layer_types is not None:
            raise ValueError("a model with experts exports as Qwen3MoeForCausalLM, which has qk_norm, no "
                             "qkv_bias and no sliding window")
        return "Qwen3MoeForCausalLM"
    if config.qkv_bias:
        return "Qwen2ForCausalLM"
    if config.qk_norm:
        return "Qwen3ForCausalLM"
    if config.layer_types is not None:
        raise ValueError("sliding-window layers export as Qwen2ForCausalLM (qkv_bias) or Qwen3ForCausalLM "
                         "(qk_norm); LlamaForCausalLM has no sliding window")
    return "LlamaForCausalLM"


# config.json keys by the ModelConfig fields they come from: a group whose fields the model still
# has as the source's config.json says is kept as the source wrote it (its spelling, its extra
# keys); a group the model changed is written afresh.
_CONFIG_KEY_GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("vocab_size",), ("vocab_size",)),
    (("hidden_size",), ("hidden_size",)),
    (("intermediate_size",), ("intermediate_size",)),
    (("num_layers",), ("num_hidden_layers", "layer_types")),
    (("num_heads",), ("num_attention_heads",)),
    (("num_kv_heads",), ("num_key_value_heads",)),
    (("head_dim",), ("head_dim",)),
    (("rope_theta", "rope_scaling", "rope_local_theta"), ("rope_theta", "rope_scaling", "rope_parameters",
                                                          "rope_local_base_freq")),
    (("rms_norm_eps",), ("rms_norm_eps",)),
    (("tie_embeddings",), ("tie_word_embeddings",)),
    (("qkv_bias", "qk_norm", "num_experts", "hidden_act", "rms_norm_offset", "sandwich_norms", "embed_scale"),
     ("architectures", "model_type", "attention_bias", "mlp_bias", "hidden_act", "hidden_activation")),
    (("sliding_window", "layer_types"), ("use_sliding_window", "sliding_window", "layer_types",
                                         "max_window_layers", "sliding_window_pattern")),
    (("query_pre_attn_scalar",), ("query_pre_attn_scalar",)),
    (("final_logit_softcap", "attn_logit_softcap"), ("final_logit_softcapping", "attn_logit_softcapping")),
    (_MOE_KEYS, _MOE_KEYS + ("num_local_experts",)),
)
_DTYPE_KEYS = ("torch_dtype", "dtype")  # transformers < 5 writes torch_dtype, 5.x dtype


def _fresh_hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json for `config` alone: every key the model defines, in the spelling every reader
    understands (transformers 4 and 5, vLLM)."""
    arch = architecture_for(config)
    if arch == GEMMA3:
        return _fresh_gemma3_config(config)
    c = config
    out = {
        "architectures": [arch],
        "model_type": {v: k for k, v in _MODEL_TYPES.items()}[arch],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        # The pre-5.0 spelling: transformers 5 converts it, and vLLM reads both.
        "rope_theta": c.rope_theta,
        "rope_scaling": _scaling_json(c.rope_scaling),
        "torch_dtype": c.param_dtype,
    }
    if arch != "Qwen2ForCausalLM":
        out["attention_bias"] = False
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = False
    if c.layer_types is not None:
        # Both spellings: layer_types (transformers >= 4.53 reads it first) and the older
        # max_window_layers, exact when the sliding layers are the last ones.
        sliding = [i for i, kind in enumerate(c.layer_types) if kind == "sliding_attention"]
        out.update(use_sliding_window=True, sliding_window=c.sliding_window, layer_types=list(c.layer_types),
                   max_window_layers=sliding[0])
    elif arch in ("Qwen2ForCausalLM", "Qwen3MoeForCausalLM"):
        out["use_sliding_window"] = False
    if arch == "Qwen3MoeForCausalLM":
        out.update({key: getattr(c, key) for key in _MOE_KEYS}, mlp_only_layers=list(c.mlp_only_layers))
    return out


def _scaling_json(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """config.json's rope_scaling for `scaling` (None: none)."""
    if scaling is None:
        return None
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", **{k: v for k, v in dataclasses.asdict(scaling).items() if k != "rope_type"}}


def _whole(x: float) -> float | int:
    """x as an int when it is a whole number (config.json fields typed int by transformers)."""
    return int(x) if float(x).is_integer() else x


def _fresh_gemma3_config(c: ModelConfig) -> dict[str, Any]:
    """Gemma3ForCausalLM's config.json for `c`, in the spelling of the published checkpoints
    (rope_theta, rope_local_base_freq, rope_scaling), which transformers 5 and vLLM also read.
    layer_types is always written: without it transformers derives a 5-local-1-global pattern."""
    return {
        "architectures": [GEMMA3], "model_type": "gemma3_text", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_activation": c.hidden_act, "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_embeddings, "rope_theta": c.rope_theta,
        "rope_local_base_freq": c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta,
        "rope_scaling": _scaling_json(c.rope_scaling), "sliding_window": c.sliding_window,
        "layer_types": list(c.layer_types or ("full_attention",) * c.num_layers),
        # transformers' Gemma3TextConfig takes an int here (strict typing), Gemma's values are whole.
        "query_pre_attn_scalar": _whole(c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None
                                        else c.head_dim),
        "final_logit_softcapping": c.final_logit_softcap, "attn_logit_softcapping": None,
        "attention_bias": False, "torch_dtype": c.param_dtype,
    }


def hf_config_from(config: ModelConfig, base_config: dict[str, Any] | None = None,
                   token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `config`.

    With `base_config` (the source checkpoint's config.json) every key of it is kept, and only
    what the model changed is rewritten: the weights' dtype (torch_dtype, or dtype where the source
    spells it so), and any shape or architecture field that differs from what `base_config` says
    (e.g. a resized vocab_size). `token_ids` ({"bos_token_id": .., "eos_token_id": ..,
    "pad_token_id": ..}) fills ids the base does not give; without either they are null, and
    max_position_embeddings (which the model does not know) is 4096.
    """
    fresh = _fresh_hf_config(config)
    if not base_config:
        out = fresh
    else:
        try:
            derived = config_from_hf(base_config, dtype=config.dtype, param_dtype=config.param_dtype)
        except (KeyError, TypeError, ValueError):  # a base we cannot read: every group is rewritten
            derived = None
        # transformers_version stays: it says which spelling the kept keys are in, and
        # transformers reads a file by it (as it read the source).
        out = dict(base_config)
        for fields, keys in _CONFIG_KEY_GROUPS:
            if derived is not None and all(getattr(derived, f) == getattr(config, f) for f in fields):
                continue
            for key in keys:
                out.pop(key, None)
            out.update({key: fresh[key] for key in keys if key in fresh})
        dtype_keys = [k for k in _DTYPE_KEYS if k in base_config] or ["torch_dtype"]
        for key in dtype_keys:
            out[key] = config.param_dtype
    for key, value in (token_ids or {}).items():
        if out.get(key) is None:
            out[key] = value
    if not base_config:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            out.setdefault(key, None)
    out.setdefault("max_position_embeddings", 4096)
    return out
