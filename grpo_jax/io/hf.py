"""Hugging Face checkpoints in and out: Llama, Qwen2/2.5, Qwen3, Qwen3-MoE and Gemma 3 (text) causal
LMs, safetensors only.

    model = hf.load_model("/ckpt/Qwen2.5-0.5B", dtype="bfloat16")   # model(tokens_BxT) -> logits_BxTxV
    hf.save_model(model, "/out/policy", source_dir="/ckpt/Qwen2.5-0.5B")  # config, tokenizer, weights

Weights are read with `safetensors` into numpy (no torch), one tensor at a time, and mapped onto
the parameter tree documented in `grpo_jax/model/transformer.py` (HF Linear weights are [out, in];
ours are [in, ...] with heads split out, so loading is a transpose and a reshape, saving the inverse).
Both directions are exact, so save-then-load returns bit-identical parameters. config.json's side
(fields to ModelConfig and back) is `grpo_jax.io.hf_config`; its functions are importable from here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
from typing import Any, Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from grpo_jax.io.hf_config import (  # noqa: F401 (config_from_hf, hf_config_from, ...: importable from here)
    SUPPORTED_ARCHITECTURES,
    architecture_for,
    architecture_of,
    config_from_hf,
    hf_config_from,
    read_config,
)
from grpo_jax.io.tokenizer_files import read_json_object
from grpo_jax.model import ModelConfig, Transformer

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Tensors some checkpoints carry that hold nothing we need (old Llama exports saved RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _open_safetensors(file: pathlib.Path):
    """safe_open(file), with safetensors' own errors ("header too large") naming the file."""
    try:
        return safe_open(str(file), framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); the file is truncated "
                         "or corrupt, copy it again from its source") from None


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor: its name and shape, where it lives in our tree, and both conversions."""

    hf_name: str
    hf_shape: tuple[int, ...]
    path: tuple[Any, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    # Experts: HF stores one tensor per expert, we stack them; this one is slice `expert` of `path`.
    expert: int | None = None


def _linear(*out_dims: int) -> tuple[Callable, Callable]:
    """HF Linear [prod(out), in] <-> ours [in, *out] (out split into e.g. heads x head_dim)."""
    def to_ours(w):
        return w.T.reshape(w.shape[1], *out_dims)

    def to_hf(w):
        return w.reshape(w.shape[0], -1).T
    return to_ours, to_hf


def _expert_entries(c: ModelConfig, p: str, ours: tuple) -> list[_Entry]:
    """A sparse layer's router and its experts' weights, one HF tensor per expert (the layout
    transformers 5 writes, as 4 did, and Qwen's checkpoints ship), each a slice of our stacked
    [E, ...] weight (`grpo_jax.model.moe`)."""
    d, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
    entries = [_Entry(p + "mlp.gate.weight", (e, d), ours + ("mlp", "router"), *_linear(e))]
    for x in range(e):
        q = f"{p}mlp.experts.{x}."
        entries += [_Entry(q + "gate_proj.weight", (i, d), ours + ("mlp", "expert_gate"), *_linear(i), expert=x),
                    _Entry(q + "up_proj.weight", (i, d), ours + ("mlp", "expert_up"), *_linear(i), expert=x),
                    _Entry(q + "down_proj.weight", (d, i), ours + ("mlp", "expert_down"), *_linear(d), expert=x)]
    return entries


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
        ]
        entries += _expert_entries(c, p, ours) if c.is_sparse(i) else [
            _Entry(p + "mlp.gate_proj.weight", (f, d), ours + ("mlp", "gate_proj"), *_linear(f)),
            _Entry(p + "mlp.up_proj.weight", (f, d), ours + ("mlp", "up_proj"), *_linear(f)),
            _Entry(p + "mlp.down_proj.weight", (d, f), ours + ("mlp", "down_proj"), *_linear(d)),
        ]
        if c.sandwich_norms:  # Gemma: post_attention_layernorm is the attention's output norm
            entries += [
                _Entry(p + "post_attention_layernorm.weight", (d,), ours + ("post_attn_norm",), *same),
                _Entry(p + "pre_feedforward_layernorm.weight", (d,), ours + ("mlp_norm",), *same),
                _Entry(p + "post_feedforward_layernorm.weight", (d,), ours + ("post_mlp_norm",), *same)]
        else:
            entries.append(_Entry(p + "post_attention_layernorm.weight", (d,), ours + ("mlp_norm",), *same))
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


def hf_tensors(params, config: ModelConfig, dtype=None):
    """(HF name, host array in HF layout) for every weight of `params` (an `nnx.State` of the
    model's params, or its pure dict), in `weight_map` order; `dtype` (a numpy or ml_dtypes dtype):
    each weight cast to it on its device before the copy to the host (None: as stored)."""
    pure = params if isinstance(params, dict) else nnx.to_pure_dict(params)
    for e in weight_map(config):
        value = _get(pure, e.path)
        if e.expert is not None:
            value = value[e.expert]
        if dtype is not None and value.dtype != dtype:
            value = value.astype(dtype)
        array = np.ascontiguousarray(e.to_hf(np.asarray(value)))
        assert array.shape == e.hf_shape, (e.hf_name, array.shape, e.hf_shape)
        yield e.hf_name, array


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


def _read_tensor(handles: dict, files: dict[str, pathlib.Path], name: str) -> np.ndarray:
    """Tensor `name` from its safetensors file (opened once, kept in `handles`); errors name both."""
    file = files[name]
    if file not in handles:
        if not file.is_file():
            raise FileNotFoundError(f"safetensors file {file} (listed for {name}) not found")
        handles[file] = _open_safetensors(file).__enter__()
    try:
        return handles[file].get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"{file}: cannot read tensor {name} ({err})") from None


def _fused_source(name: str, files) -> tuple[str, Callable] | None:
    """(fused tensor name, slicer) for a per-expert tensor stored in transformers 5's in-memory
    layout instead: mlp.experts.gate_up_proj [E, 2I, D] (expert x's gate rows, then its up rows)
    and mlp.experts.down_proj [E, D, I]. None when `name` is not an expert's or not stored fused."""
    m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
    if m is None:
        return None
    x, kind = int(m.group(2)), m.group(3)
    source = f"{m.group(1)}.{'down_proj' if kind == 'down' else 'gate_up_proj'}"
    if source not in files:
        return None
    if kind == "down":
        return source, lambda w: w[x]
    return source, lambda w: np.split(w[x], 2, axis=0)[0 if kind == "gate" else 1]


def _stacked(stacks: dict, pure: dict, e: _Entry, dtype) -> np.ndarray:
    """The host buffer [E, ...] that entry `e`'s expert slice goes into (made on first use)."""
    if e.path not in stacks:
        stacks[e.path] = np.empty(_get(pure, e.path).shape, dtype)
    return stacks[e.path]


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
    fused = {e.hf_name: src for e in entries if e.hf_name not in files and (src := _fused_source(e.hf_name, files))}
    expected = {e.hf_name for e in entries} | {name for name, _ in fused.values()}
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
    stacks: dict[tuple, np.ndarray] = {}
    last_fused: dict[str, np.ndarray] = {}  # the fused tensor being sliced (one at a time)
    try:
        for e in entries:
            if e.hf_name in fused:
                name, take = fused[e.hf_name]
                if name not in last_fused:
                    last_fused = {name: _read_tensor(handles, files, name)}
                array, file = take(last_fused[name]), files[name]
            elif e.hf_name not in files:
                raise ValueError(f"checkpoint {path} is missing tensor {e.hf_name} "
                                 f"(expected shape {e.hf_shape})")
            else:
                array, file = _read_tensor(handles, files, e.hf_name), files[e.hf_name]
            if tuple(array.shape) != e.hf_shape:
                raise ValueError(f"tensor {e.hf_name} in {file.name} has shape {tuple(array.shape)}, "
                                 f"expected {e.hf_shape} from config.json")
            ours = e.to_ours(array.astype(np_dtype, copy=False))
            if e.expert is not None:  # experts are stacked on the host, then moved once
                _stacked(stacks, pure, e, np_dtype)[e.expert] = ours
                continue
            target = _get(pure, e.path)
            assert ours.shape == target.shape, (e.hf_name, ours.shape, target.shape)
            _set(pure, e.path, jnp.asarray(ours))
        for where, stack in stacks.items():
            _set(pure, where, jnp.asarray(stack))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


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
    architecture_for(model.config)  # fail before any work when no HF architecture fits
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
    tensors = dict(hf_tensors(nnx.state(model, nnx.Param), config))
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
