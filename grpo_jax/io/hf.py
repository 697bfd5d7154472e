"""Hugging Face checkpoints in and out: Llama, Qwen2/2.5 and Qwen3 causal LMs, safetensors only.

    model = hf.load_model("/ckpt/Qwen2.5-0.5B", dtype="bfloat16")   # model(tokens_BxT) -> logits_BxTxV
    hf.save_model(model, "/out/policy", source_dir="/ckpt/Qwen2.5-0.5B")  # config, tokenizer, weights

Weights are read with `safetensors` into numpy (no torch), one tensor at a time, and mapped onto
the parameter tree documented in `grpo_jax/model/transformer.py` (HF Linear weights are [out, in];
ours are [in, ...] with heads split out, so loading is a transpose and a reshape, saving the inverse).
Both directions are exact, so save-then-load returns bit-identical parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any, Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from grpo_jax.model import ModelConfig, RopeScaling, Transformer
from grpo_jax.io.tokenizer import read_json_object

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Tensors some checkpoints carry that hold nothing we need (old Llama exports saved RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def _open_safetensors(file: pathlib.Path):
    """safe_open(file), with safetensors' own errors ("header too large") naming the file."""
    try:
        return safe_open(str(file), framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); the file is truncated "
                         "or corrupt, copy it again from its source") from None


def architecture_of(hf_config: dict[str, Any]) -> str:
    """'LlamaForCausalLM', 'Qwen2ForCausalLM' or 'Qwen3ForCausalLM', else a ValueError."""
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
    scaling = hf_config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json rope type {kind!r} is not supported; supported: 'default', "
                         "'llama3'")
    return theta, RopeScaling(
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


def config_from_hf(hf_config: dict[str, Any], *, dtype: str = "float32", param_dtype: str | None = None,
                   remat: bool | str = False, attention_impl: str = "auto") -> ModelConfig:
    """ModelConfig for a Llama / Qwen2 / Qwen3 config.json dict; features we lack are errors.
    remat and attention_impl say how the passes run (ModelConfig); config.json has neither."""
    arch = architecture_of(hf_config)
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported; supported: 'silu'")
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which the model lacks.
    if arch != "Qwen2ForCausalLM" and hf_config.get("attention_bias", False):
        raise ValueError(f"config.json attention_bias=true ({arch}) is not supported; supported: false")
    if hf_config.get("mlp_bias", False):
        raise ValueError("config.json mlp_bias=true is not supported; supported: false")
    heads = _number(hf_config, "num_attention_heads")
    window, layer_types = _sliding_windows(hf_config, arch, _number(hf_config, "num_hidden_layers"))
    hidden = _number(hf_config, "hidden_size")
    theta, scaling = _rope(hf_config)
    return ModelConfig(
        vocab_size=_number(hf_config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_number(hf_config, "intermediate_size"),
        num_layers=_number(hf_config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),
        head_dim=int(hf_config.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",  # Qwen2 always has q/k/v biases (and no o bias)
        qk_norm=arch == "Qwen3ForCausalLM",
        param_dtype=param_dtype or dtype,
        dtype=dtype,
        sliding_window=window,
        layer_types=layer_types,
        remat=remat,
        attention_impl=attention_impl,
    )


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor: its name and shape, where it lives in our tree, and both conversions."""

    hf_name: str
    hf_shape: tuple[int, ...]
    path: tuple[Any, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _linear(*out_dims: int) -> tuple[Callable, Callable]:
    """HF Linear [prod(out), in] <-> ours [in, *out] (out split into e.g. heads x head_dim)."""
    def to_ours(w):
        return w.T.reshape(w.shape[1], *out_dims)

    def to_hf(w):
        return w.reshape(w.shape[0], -1).T
    return to_ours, to_hf


def weight_map(config: ModelConfig) -> list[_Entry]:
    """Every HF tensor name the config implies, with its HF shape and our parameter path."""
    c = config
    d, f, v, n, k, h = (c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads,
                        c.num_kv_heads, c.head_dim)
    same = (lambda w: w, lambda w: w)
    entries = [_Entry("model.embed_tokens.weight", (v, d), ("embed",), *same)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        ours = ("layers", i)
        entries += [
            _Entry(p + "input_layernorm.weight", (d,), ours + ("attn_norm",), *same),
            _Entry(p + "self_attn.q_proj.weight", (n * h, d), ours + ("attn", "q_proj"), *_linear(n, h)),
            _Entry(p + "self_attn.k_proj.weight", (k * h, d), ours + ("attn", "k_proj"), *_linear(k, h)),
            _Entry(p + "self_attn.v_proj.weight", (k * h, d), ours + ("attn", "v_proj"), *_linear(k, h)),
            _Entry(p + "self_attn.o_proj.weight", (d, n * h), ours + ("attn", "o_proj"),
                   lambda w, n=n, h=h: w.T.reshape(n, h, w.shape[0]),
                   lambda w: w.reshape(-1, w.shape[-1]).T),
            _Entry(p + "post_attention_layernorm.weight", (d,), ours + ("mlp_norm",), *same),
            _Entry(p + "mlp.gate_proj.weight", (f, d), ours + ("mlp", "gate_proj"), *_linear(f)),
            _Entry(p + "mlp.up_proj.weight", (f, d), ours + ("mlp", "up_proj"), *_linear(f)),
            _Entry(p + "mlp.down_proj.weight", (d, f), ours + ("mlp", "down_proj"), *_linear(d)),
        ]
        if c.qkv_bias:
            for name, heads in (("q", n), ("k", k), ("v", k)):
                entries.append(_Entry(p + f"self_attn.{name}_proj.bias", (heads * h,),
                                      ours + ("attn", f"{name}_bias"),
                                      lambda b, heads=heads: b.reshape(heads, h),
                                      lambda b: b.reshape(-1)))
        if c.qk_norm:
            entries += [_Entry(p + "self_attn.q_norm.weight", (h,), ours + ("attn", "q_norm"), *same),
                        _Entry(p + "self_attn.k_norm.weight", (h,), ours + ("attn", "k_norm"), *same)]
    entries.append(_Entry("model.norm.weight", (d,), ("final_norm",), *same))
    if not c.tie_embeddings:
        entries.append(_Entry("lm_head.weight", (v, d), ("lm_head",), *_linear(v)))
    return entries


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it (sharded index, single file, or all files)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        mapping = read_json_object(index).get("weight_map")
        if not isinstance(mapping, dict) or not all(isinstance(f, str) for f in mapping.values()):
            raise ValueError(f"{index}: expected a \"weight_map\" object of tensor name -> "
                             f"safetensors file name, got {str(mapping)[:80]!r}")
        return {name: path / file for name, file in mapping.items()}
    files = [path / "model.safetensors"] if (path / "model.safetensors").is_file() else sorted(
        path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"weights not found in checkpoint directory {path}: no "
                                "model.safetensors, model.safetensors.index.json or *.safetensors")
    out = {}
    for file in files:
        with _open_safetensors(file) as f:
            out.update({name: file for name in f.keys()})
    return out


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def load_model(path: str | pathlib.Path, dtype: str = "float32", *, param_dtype: str | None = None,
               remat: bool | str = False, attention_impl: str = "auto") -> Transformer:
    """Reads an HF checkpoint directory into a Transformer; model(tokens_BxT) -> logits_BxTxV.

    `dtype` is the compute dtype and, unless `param_dtype` is given, the weights' dtype too.
    A tensor that is missing, misshapen or unexpected is an error naming it.
    """
    path = pathlib.Path(path)
    hf_config = read_config(path)
    try:
        config = config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                attention_impl=attention_impl)
    except (KeyError, TypeError, ValueError) as e:  # a field missing or of the wrong type
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{path / 'config.json'}: {detail}") from None
    np_dtype = _NP_DTYPES[config.param_dtype]
    files = _tensor_files(path)
    entries = weight_map(config)
    expected = {e.hf_name for e in entries}
    ignorable = [name for name in files
                 if name.endswith(_IGNORED_SUFFIXES) or (config.tie_embeddings and name == "lm_head.weight")]
    unexpected = sorted(set(files) - expected - set(ignorable))
    if unexpected:
        raise ValueError(f"checkpoint {path} has tensors the {architecture_of(hf_config)} "
                         f"mapping does not use: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")

    # Build the module abstractly (no random init of weights we are about to overwrite).
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    handles: dict[pathlib.Path, Any] = {}
    try:
        for e in entries:
            if e.hf_name not in files:
                raise ValueError(f"checkpoint {path} is missing tensor {e.hf_name} "
                                 f"(expected shape {e.hf_shape})")
            file = files[e.hf_name]
            if file not in handles:
                if not file.is_file():
                    raise FileNotFoundError(f"safetensors file {file} (listed for {e.hf_name}) not found")
                handles[file] = _open_safetensors(file).__enter__()
            try:
                array = handles[file].get_tensor(e.hf_name)
            except SafetensorError as err:
                raise ValueError(f"{file}: cannot read tensor {e.hf_name} ({err})") from None
            if tuple(array.shape) != e.hf_shape:
                raise ValueError(f"tensor {e.hf_name} in {file.name} has shape {tuple(array.shape)}, "
                                 f"expected {e.hf_shape} from config.json")
            ours = e.to_ours(array.astype(np_dtype, copy=False))
            target = _get(pure, e.path)
            assert ours.shape == target.shape, (e.hf_name, ours.shape, target.shape)
            _set(pure, e.path, jnp.asarray(ours))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _architecture_for(config: ModelConfig) -> str:
    if config.qkv_bias and config.qk_norm:
        raise ValueError("no supported HF architecture has both qkv_bias and qk_norm; supported: "
                         "LlamaForCausalLM (neither), Qwen2ForCausalLM (qkv_bias), "
                         "Qwen3ForCausalLM (qk_norm)")
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
    (("rope_theta", "rope_scaling"), ("rope_theta", "rope_scaling", "rope_parameters")),
    (("rms_norm_eps",), ("rms_norm_eps",)),
    (("tie_embeddings",), ("tie_word_embeddings",)),
    (("qkv_bias", "qk_norm"), ("architectures", "model_type", "attention_bias", "mlp_bias")),
    (("sliding_window", "layer_types"), ("use_sliding_window", "sliding_window", "layer_types",
                                         "max_window_layers")),
)
_DTYPE_KEYS = ("torch_dtype", "dtype")  # transformers < 5 writes torch_dtype, 5.x dtype


def _fresh_hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json for `config` alone: every key the model defines, in the spelling every reader
    understands (transformers 4 and 5, vLLM)."""
    arch = _architecture_for(config)
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
        "rope_scaling": None if c.rope_scaling is None else {
            "rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)},
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
    elif arch == "Qwen2ForCausalLM":
        out["use_sliding_window"] = False
    return out


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


# A tokenizer as Hugging Face checkpoints ship it: everything transformers' AutoTokenizer and the
# `tokenizers` package read, whichever of them the source has (chat_templates/ is a folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model")


def _umask() -> int:
    """This process's umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _copy_new_file(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Copies src's bytes into a new file dst (mode from the umask, not src's: a read-only source,
    such as a shared model store, must not make the export read-only)."""
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    shutil.copyfile(src, dst)


def _token_ids_of(tokenizer) -> tuple[dict[str, Any], list[int]]:
    """({"bos_token_id", "eos_token_id", "pad_token_id"} for config.json, all stop ids)."""
    eos_ids = [int(i) for i in (getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))]
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos_ids[0], "pad_token_id": tokenizer.pad_id}
    return ids, eos_ids


def save_model(model: Transformer, path: str | pathlib.Path, *,
               source_dir: str | pathlib.Path | None = None,
               base_config: dict[str, Any] | None = None, tokenizer=None) -> pathlib.Path:
    """Writes a Hugging Face checkpoint of `model` into directory `path`, and returns `path`.

    Always: config.json and model.safetensors (HF layout, param dtype). With `source_dir` (the
    checkpoint the model came from): config.json keeps the source's keys (`hf_config_from`;
    `base_config` overrides the source's config.json), and its generation_config.json and tokenizer
    files (`TOKENIZER_FILES`, chat_templates/) are copied, so the export loads and chats like the
    source. Without a source, token ids come from `tokenizer` (any `grpo_jax.io.tokenizer` one) where
    given, and generation_config.json lists its stop ids. Files get the mode a new file gets under
    the umask (0644 under umask 022). transformers' `from_pretrained(path)` and vLLM load the result.
    """
    path = pathlib.Path(path)
    _architecture_for(model.config)  # fail before any work when no HF architecture fits
    if (path / "model.safetensors.index.json").exists():
        raise FileExistsError(f"{path} already holds a sharded checkpoint "
                              "(model.safetensors.index.json); save into an empty directory")
    source = None if source_dir is None else pathlib.Path(source_dir)
    if source is not None:
        if base_config is None:
            base_config = read_config(source)  # also: "checkpoint directory not found: ..."
        if path.exists() and path.resolve() == source.resolve():
            raise ValueError(f"save_model path {path} is its source_dir; export into another directory")
    token_ids, stop_ids = _token_ids_of(tokenizer) if tokenizer is not None else ({}, [])
    config = model.config
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = {}
    for e in weight_map(config):
        array = np.ascontiguousarray(e.to_hf(np.asarray(_get(pure, e.path))))
        assert array.shape == e.hf_shape, (e.hf_name, array.shape, e.hf_shape)
        tensors[e.hf_name] = array
    path.mkdir(parents=True, exist_ok=True)
    weights = path / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # safetensors >= 0.8 writes a temp file (created 0600) and renames it over the target, so the
    # export would be readable by its owner only (safetensors issue #782): give it a new file's mode.
    os.chmod(weights, 0o666 & ~_umask())
    hf_config = hf_config_from(config, base_config, token_ids)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    copied = set()
    if source is not None:
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (source / name).is_file():
                _copy_new_file(source / name, path / name)
                copied.add(name)
        if (source / "chat_templates").is_dir():
            (path / "chat_templates").mkdir(exist_ok=True)
            for file in sorted((source / "chat_templates").glob("*.jinja")):
                _copy_new_file(file, path / "chat_templates" / file.name)
    if "generation_config.json" not in copied and hf_config.get("eos_token_id") is not None:
        generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if hf_config.get(key) is not None}
        if len(stop_ids) > 1:
            generation["eos_token_id"] = stop_ids
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return path
