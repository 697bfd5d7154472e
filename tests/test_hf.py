"""Hugging Face import/export: our logits equal transformers', tensors map exactly, errors say what.

The committed fixtures (tests/fixtures/hf_*, made by tests/fixtures/make_hf_fixtures.py with
transformers) run without torch. Tests marked `parity` build fresh models with transformers and
skip when torch/transformers are not installed (`pip install -e '.[parity]'`).
"""

import dataclasses
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from grpo_jax.io import hf
from grpo_jax.io import tokenizer as tk
from grpo_jax.model import ModelConfig, RopeScaling
from full_forward import full_forward
from hf_fixtures import make_tiny_instruct_checkpoint

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _masked_max_diff(model, expected) -> float:
    tokens, mask = jnp.asarray(expected["tokens_BxT"]), jnp.asarray(expected["mask_BxT"])
    graphdef, params = nnx.split(model, nnx.Param)
    # Jitted: op-by-op eager execution of the model takes ~20 s on a busy 2-core machine.
    logits = np.asarray(full_forward(graphdef, params, tokens, mask))
    real = expected["mask_BxT"].astype(bool)  # padding positions' logits are unused by design
    return float(np.abs(logits - expected["logits_BxTxV"])[real].max())


@pytest.fixture
def ckpt(tmp_path):
    """A writable copy of a fixture checkpoint."""
    def copy(name):
        dst = tmp_path / name
        shutil.copytree(FIXTURES / f"hf_{name}", dst)
        return dst
    return copy


# ---------------------------------------------------------------- logits vs transformers (fixtures)

@pytest.mark.parametrize("name", ARCHS)
def test_fixture_logits_match_transformers(name):
    # transformers' float32 logits on the same tokens (row 1 left-padded, per-row positions):
    # measured max abs diff ~5e-6 on logits of magnitude ~4, i.e. float32 rounding.
    model = hf.load_model(FIXTURES / f"hf_{name}")
    assert _masked_max_diff(model, np.load(FIXTURES / f"hf_{name}" / "expected.npz")) < 1e-4


def test_fixture_is_sensitive_to_llama3_rope_scaling(ckpt):
    # Without the Llama-3 frequency scaling the same weights give visibly different logits, so the
    # fixture comparison above really checks the scaling (and not just the weight mapping).
    path = ckpt("llama")
    cfg = hf.read_config(path)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    assert _masked_max_diff(hf.load_model(path), np.load(path / "expected.npz")) > 1e-2


# ---------------------------------------------------------------- config.json -> ModelConfig

def test_config_from_hf_qwen25_05b():
    # Qwen2.5-0.5B's config.json (transformers 4.x spelling): head_dim = 896 / 14 = 64.
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
           "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768,
           "hidden_act": "silu", "rope_scaling": None}
    assert hf.config_from_hf(cfg, dtype="bfloat16") == ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, rope_theta=1e6, rope_scaling=None, rms_norm_eps=1e-6,
        tie_embeddings=True, qkv_bias=True, qk_norm=False, param_dtype="bfloat16", dtype="bfloat16")


def test_config_from_hf_llama31_rope_scaling_both_spellings():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "rms_norm_eps": 1e-5}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    v4 = hf.config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": scaling})
    v5 = hf.config_from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert v4 == v5
    assert (v4.head_dim, v4.rope_theta, v4.qkv_bias, v4.qk_norm) == (128, 500000.0, False, False)
    assert v4.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


def test_config_from_hf_qwen3_takes_head_dim_from_config():
    # Qwen3-0.6B: 16 heads x head_dim 128 = 2048 != hidden 1024, so head_dim must be read, not derived.
    cfg = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
           "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0,
           "tie_word_embeddings": True}
    c = hf.config_from_hf(cfg)
    assert (c.head_dim, c.qk_norm, c.qkv_bias, c.tie_embeddings) == (128, True, False, True)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GemmaForCausalLM"]},
     "unsupported architecture.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'.*'llama3'"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention layers are not supported for "
                                                               "LlamaForCausalLM"),
])
def test_config_from_hf_rejects_what_the_model_lacks(change, message):
    cfg = {**hf.read_config(FIXTURES / "hf_llama"), **change}
    with pytest.raises(ValueError, match=message):
        hf.config_from_hf(cfg)


def test_config_from_hf_reads_sliding_windows_as_transformers_does():
    # Qwen2 / Qwen3: a window only with use_sliding_window; layers from layer_types, or without it
    # the layers from max_window_layers on (transformers' Qwen2Config); none sliding -> full.
    base = {**hf.read_config(FIXTURES / "hf_qwen2"), "num_hidden_layers": 4, "sliding_window": 6}
    del base["layer_types"]  # transformers 5 writes it (all full_attention here); derived below
    assert hf.config_from_hf({**base, "use_sliding_window": False}).layer_types is None
    c = hf.config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert c.sliding_window == 6 and c.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert [c.window(i) for i in range(4)] == [None, None, 6, 6]
    mixed = ["sliding_attention", "full_attention"] * 2
    c = hf.config_from_hf({**base, "use_sliding_window": True, "layer_types": mixed})
    assert c.layer_types == tuple(mixed)
    assert hf.config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 4}).layer_types is None
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        hf.config_from_hf({**base, "use_sliding_window": True, "sliding_window": 0})
    with pytest.raises(ValueError, match="layer_types must name full_attention or sliding_attention for each"):
        hf.config_from_hf({**base, "use_sliding_window": True, "layer_types": ["sliding_attention"]})


def test_sliding_window_export_round_trips(tmp_path):
    # A Qwen2-shaped model with its last layer sliding writes use_sliding_window, sliding_window,
    # layer_types and max_window_layers, and reads back as the same ModelConfig.
    source = {k: v for k, v in hf.read_config(FIXTURES / "hf_qwen2").items() if k != "layer_types"}
    cfg = hf.config_from_hf({**source, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1})
    assert cfg.layer_types == ("full_attention", "sliding_attention")
    written = hf.hf_config_from(cfg)
    assert (written["use_sliding_window"], written["sliding_window"], written["max_window_layers"]) == (True, 4, 1)
    assert hf.config_from_hf(written) == cfg
    # A Llama (no q/k/v bias, no q/k norm) has no sliding window to write.
    with pytest.raises(ValueError, match="LlamaForCausalLM has no sliding window"):
        hf.hf_config_from(dataclasses.replace(cfg, qkv_bias=False))


# ---------------------------------------------------------------- bad checkpoints

def _rewrite_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_names_it_and_its_shape(ckpt):
    path = ckpt("qwen2")
    _rewrite_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.bias "
                                         r"\(expected shape \(16,\)\)"):
        hf.load_model(path)


def test_misshapen_tensor_names_both_shapes(ckpt):
    path = ckpt("llama")
    name = "model.layers.0.self_attn.q_proj.weight"  # [N*H, D] = [32, 32]; make it [32, 31]
    _rewrite_tensors(path, lambda t: t.update({name: t[name][:, :31].copy()}))
    with pytest.raises(ValueError, match=rf"{name} in model.safetensors has shape \(32, 31\), "
                                         r"expected \(32, 32\)"):
        hf.load_model(path)


def test_unexpected_tensor_is_an_error_but_stale_rope_tables_are_not(ckpt):
    path = ckpt("llama")
    _rewrite_tensors(path, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
    hf.load_model(path)  # old Llama exports carry RoPE tables; they are recomputed, not read
    _rewrite_tensors(path, lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.bias": np.ones(32, np.float32)}))
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.0\.self_attn\.o_proj\.bias'\]"):
        hf.load_model(path)


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found: .*nowhere"):
        hf.load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found: .*nowhere"):
        hf.read_config(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json not found .*config.json"):
        hf.load_model(tmp_path)
    shutil.copy(FIXTURES / "hf_llama" / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="weights not found .*no model.safetensors"):
        hf.load_model(tmp_path)


def _truncate_half(file: pathlib.Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


# (file, damage, what the one-line message must say besides the file's path). The old messages
# were bare: "SafetensorError: Error while deserializing header: header too large",
# "JSONDecodeError: Expecting value: line 1 column 1 (char 0)", "KeyError: 'weight_map'".
_CORRUPTIONS = [
    ("model.safetensors", lambda f: f.write_bytes(b"garbage garbage garbage"), "header too large"),
    ("model.safetensors", _truncate_half, "file not fully covered"),
    ("model.safetensors", lambda f: f.write_bytes(b""), "header too small"),
    ("config.json", lambda f: f.write_text('{"hidden_size": 32,,\n}'), "line 1, column 20"),
    ("config.json", lambda f: f.write_text(""), "empty file"),
    ("config.json", lambda f: f.write_text("[1, 2]"), "expected a JSON object, got list"),
    ("config.json", lambda f: f.write_bytes(b'{"a":\n "\xff"}'), "byte 0xff at line 2, column 3"),
    ("config.json", lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), "hidden_size": None})),
     "field 'hidden_size' must be a number, got None"),
    ("config.json", lambda f: f.write_text(json.dumps(
        {k: v for k, v in json.loads(f.read_text()).items() if k != "vocab_size"})), "missing field 'vocab_size'"),
    ("model.safetensors.index.json", lambda f: f.write_text('{"weight_map": '), "line 1, column 16"),
    ("model.safetensors.index.json", lambda f: f.write_text("{}"), "weight_map"),
]


@pytest.mark.parametrize("file_name,damage,detail", _CORRUPTIONS,
                         ids=[f"{c[0]}-{c[2]}" for c in _CORRUPTIONS])
def test_corrupt_checkpoint_file_is_named_in_a_one_line_error(ckpt, file_name, damage, detail):
    path = ckpt("llama")
    damage(path / file_name)
    with pytest.raises(ValueError) as err:
        hf.load_model(path)
    message = str(err.value)
    # One line (the traceback's last line) holding the file's path and the cause.
    assert message.splitlines() == [message]
    assert str(path / file_name) in message and detail in message


# ---------------------------------------------------------------- sharded checkpoints

def test_sharded_checkpoint_loads_the_same_weights(ckpt, tmp_path):
    single = ckpt("qwen3")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(single / "config.json", sharded)
    tensors = load_file(str(single / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = _params(hf.load_model(single)), _params(hf.load_model(sharded))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    with pytest.raises(FileExistsError, match="sharded checkpoint"):
        hf.save_model(hf.load_model(single), sharded)


# ---------------------------------------------------------------- export

@pytest.mark.parametrize("name", ARCHS)
def test_save_then_load_is_exact(name, tmp_path):
    src = FIXTURES / f"hf_{name}"
    model = hf.load_model(src)
    out = hf.save_model(model, tmp_path / "out", base_config=hf.read_config(src))
    # The written tensors are transformers' own, bit for bit (a tied model writes no lm_head).
    original, saved = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    if model.config.tie_embeddings:
        original.pop("lm_head.weight", None)
    assert sorted(saved) == sorted(original)
    for k in original:
        np.testing.assert_array_equal(saved[k], original[k], err_msg=k)
    again = hf.load_model(out)
    assert again.config == model.config
    jax.tree.map(np.testing.assert_array_equal, _params(again), _params(model))
    # The model is the source's, in the source's dtype: config.json is the source's, key by key
    # (its transformers-5 spelling too: rope_parameters, dtype, layer_types).
    assert hf.read_config(out) == hf.read_config(src)


def test_bfloat16_load_and_save_round_trip(tmp_path):
    model = hf.load_model(FIXTURES / "hf_qwen2", dtype="bfloat16")
    params = _params(model)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    expected = np.load(FIXTURES / "hf_qwen2" / "expected.npz")
    # bf16 weights and activations: ~1% of the logit scale (~4), not float32's 1e-6.
    assert _masked_max_diff(model, expected) < 0.25
    out = hf.save_model(model, tmp_path / "bf16")
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == jnp.bfloat16
    assert hf.read_config(out)["torch_dtype"] == "bfloat16"
    jax.tree.map(np.testing.assert_array_equal, _params(hf.load_model(out, dtype="bfloat16")), params)
    # A bf16 checkpoint (as Qwen and Llama ship) read into float32 is the exact upcast.
    up = _params(hf.load_model(out, dtype="float32"))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b, np.float32)), up, params)


def test_save_refuses_a_config_no_hf_architecture_has(tmp_path):
    from grpo_jax.model import Transformer

    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=4, qkv_bias=True, qk_norm=True)
    with pytest.raises(ValueError, match="both qkv_bias and qk_norm"):
        hf.save_model(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), tmp_path)


def _json(path):
    return json.loads(pathlib.Path(path).read_text())


def _new_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@pytest.fixture(scope="module")
def tiny_instruct(tmp_path_factory):
    return make_tiny_instruct_checkpoint(tmp_path_factory.mktemp("src") / "tiny")


def test_export_with_source_dir_round_trips_config_generation_and_tokenizer(tiny_instruct, tmp_path):
    src = tiny_instruct
    model = hf.load_model(src, dtype="bfloat16")  # the dtype Qwen ships, and this checkpoint has
    out = hf.save_model(model, tmp_path / "out", source_dir=src)
    # config.json, key by key: nothing the weights changed, so everything is the source's
    # (before: max_position_embeddings 256 -> 4096, bos/eos/pad_token_id dropped).
    source_cfg, cfg = _json(src / "config.json"), _json(out / "config.json")
    assert sorted(cfg) == sorted(source_cfg)
    for key in source_cfg:
        assert cfg[key] == source_cfg[key], key
    # generation_config.json (two stop ids) and every tokenizer file, byte for byte.
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert _json(out / "generation_config.json")["eos_token_id"] == list(tk.load_tokenizer(str(src)).eos_ids)
    # The export chats like the source and loads to the same weights.
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    a, b = tk.load_tokenizer(str(src)), tk.load_tokenizer(str(out))
    assert (b.apply_chat_template(chat), b.eos_ids, b.pad_id) == (a.apply_chat_template(chat), a.eos_ids, a.pad_id)
    jax.tree.map(np.testing.assert_array_equal, _params(hf.load_model(out, dtype="bfloat16")), _params(model))
    # A float32 export rewrites exactly the one key the weights changed.
    out32 = hf.save_model(hf.load_model(src), tmp_path / "out32", source_dir=src)
    changed = {k for k in source_cfg if _json(out32 / "config.json")[k] != source_cfg[k]}
    assert changed == {"torch_dtype"} and _json(out32 / "config.json")["torch_dtype"] == "float32"


def test_export_files_get_a_new_files_mode_not_0600(tiny_instruct, tmp_path):
    # safetensors >= 0.8 writes a 0600 temp file and renames it into place; the export chmods it
    # to what the umask gives a new file, as every other file here gets.
    src = tmp_path / "src"
    shutil.copytree(tiny_instruct, src)
    for file in src.iterdir():
        file.chmod(0o444)  # a read-only model store must not make the export read-only
    model = hf.load_model(src, dtype="bfloat16")
    previous = os.umask(0o002)
    try:
        out = hf.save_model(model, tmp_path / "out", source_dir=src)
        hf.save_model(model, out, source_dir=src)  # and again over itself
        modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    finally:
        os.umask(previous)
    assert modes == dict.fromkeys(modes, 0o664) and "model.safetensors" in modes
    out = hf.save_model(model, tmp_path / "default_umask")
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {_new_file_mode()}


def test_export_without_source_writes_ids_from_the_tokenizer(tiny_instruct, tmp_path):
    model = hf.load_model(tiny_instruct)
    tok = tk.load_tokenizer(str(tiny_instruct))
    out = hf.save_model(model, tmp_path / "with_tok", tokenizer=tok)
    cfg = _json(out / "config.json")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (None, tok.eos_id, tok.pad_id)
    assert _json(out / "generation_config.json") == {"eos_token_id": list(tok.eos_ids), "pad_token_id": tok.pad_id}
    # Nothing known: ids are null (as transformers writes unknown ids), no generation_config.json,
    # and max_position_embeddings, which the model does not know, is 4096.
    bare = hf.save_model(model, tmp_path / "bare")
    cfg = _json(bare / "config.json")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["max_position_embeddings"]) == \
        (None, None, None, 4096)
    assert sorted(os.listdir(bare)) == ["config.json", "model.safetensors"]
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found: .*nowhere"):
        hf.save_model(model, tmp_path / "x", source_dir=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is its source_dir"):
        hf.save_model(model, tiny_instruct, source_dir=tiny_instruct)


def test_hf_config_from_rewrites_only_the_groups_the_model_changed():
    base = hf.read_config(FIXTURES / "hf_qwen3")  # transformers 5 spelling: rope_parameters, dtype
    config = hf.config_from_hf(base)
    assert hf.hf_config_from(config, base) == base
    # A resized embedding: vocab_size changes, nothing else.
    wider = hf.hf_config_from(dataclasses.replace(config, vocab_size=128), base)
    assert {k for k in base if wider[k] != base[k]} == {"vocab_size"} and wider["vocab_size"] == 128
    # A new RoPE base: written in the spelling every reader knows, the stale 5.x spelling removed.
    rope = hf.hf_config_from(dataclasses.replace(config, rope_theta=5e5), base)
    assert "rope_parameters" not in rope and (rope["rope_theta"], rope["rope_scaling"]) == (5e5, None)
    assert {k for k in base if k != "rope_parameters" and rope[k] != base[k]} == set()
    # bfloat16 weights: the key the source used for the dtype says so.
    assert hf.hf_config_from(dataclasses.replace(config, param_dtype="bfloat16"), base)["dtype"] == "bfloat16"


# ---------------------------------------------------------------- parity with live transformers

def _transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys
    sys.path.insert(0, str(FIXTURES))
    import make_hf_fixtures
    return torch, make_hf_fixtures


@pytest.mark.parity
@pytest.mark.parametrize("name", ARCHS)
def test_parity_fresh_transformers_model_and_export_back(name, tmp_path):
    torch, mk = _transformers()
    from transformers import AutoModelForCausalLM

    config = mk.hf_configs()[name]
    hf_model = mk.random_hf_model(config, seed=100 + ARCHS.index(name))
    hf_model.save_pretrained(tmp_path / "hf")
    tokens, mask = mk.fixed_tokens(seed=7)
    expected = {"tokens_BxT": tokens, "mask_BxT": mask,
                "logits_BxTxV": mk.hf_logits(hf_model, tokens, mask)}
    ours = hf.load_model(tmp_path / "hf")
    assert _masked_max_diff(ours, expected) < 1e-4
    # And back: transformers loads what we write and computes the same logits.
    hf.save_model(ours, tmp_path / "ours", base_config=hf.read_config(tmp_path / "hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    again = mk.hf_logits(reloaded, tokens, mask)
    np.testing.assert_allclose(again[mask.astype(bool)], expected["logits_BxTxV"][mask.astype(bool)],
                               atol=1e-5)


@pytest.mark.parity
@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_parity_qwen2_sliding_window_logits_equal_transformers(impl, tmp_path):
    # Layer 1 of 2 sliding with a window of 4 over 9-token rows (one left-padded by 3), so the
    # window cuts into every row; transformers' eager attention with its sliding-window mask.
    torch, mk = _transformers()
    from transformers import Qwen2Config

    config = Qwen2Config(**mk.SMALL, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1, attn_implementation="eager",
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    hf_model = mk.random_hf_model(config, seed=5)
    hf_model.save_pretrained(tmp_path / "hf")
    tokens, mask = mk.fixed_tokens(seed=11)
    expected = {"tokens_BxT": tokens, "mask_BxT": mask, "logits_BxTxV": mk.hf_logits(hf_model, tokens, mask)}
    ours = hf.load_model(tmp_path / "hf", attention_impl=impl)
    assert ours.config.layer_types == ("full_attention", "sliding_attention")
    assert _masked_max_diff(ours, expected) < 1e-4
    # The window matters: the same weights with full attention give other logits.
    full = hf.load_model(tmp_path / "hf", attention_impl=impl)
    full.config = dataclasses.replace(full.config, layer_types=None)
    for layer in full.layers:
        layer.attn.window = None
    assert _masked_max_diff(full, expected) > 1e-3


@pytest.mark.parity
def test_parity_transformers_loads_the_export_with_the_sources_config(tiny_instruct, tmp_path):
    torch, mk = _transformers()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = tiny_instruct
    ours = hf.load_model(src, dtype="bfloat16")
    out = hf.save_model(ours, tmp_path / "out", source_dir=src)
    # transformers reads both configs to the same values, key by key (but the path each came from).
    a, b = AutoConfig.from_pretrained(src).to_dict(), AutoConfig.from_pretrained(out).to_dict()
    assert sorted(a) == sorted(b) and a.pop("_name_or_path") != b.pop("_name_or_path")
    for key in a:
        assert a[key] == b[key], key
    assert GenerationConfig.from_pretrained(out).eos_token_id == GenerationConfig.from_pretrained(src).eos_token_id
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    ids = AutoTokenizer.from_pretrained(out).apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert list(ids) == tk.load_tokenizer(str(out)).apply_chat_template(chat)
    # And the weights: transformers' logits on the export equal ours (float32 compute on bf16 weights).
    model32 = hf.load_model(out, dtype="float32")
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens, mask = mk.fixed_tokens(seed=3)
    expected = {"tokens_BxT": tokens, "mask_BxT": mask, "logits_BxTxV": mk.hf_logits(hf_model, tokens, mask)}
    assert _masked_max_diff(model32, expected) < 1e-4
