"""`check` with sampling.engine="vllm" (grpo_jax/cli/check_engine.py): a colocated engine's share of
each device, what it leaves JAX, whether the share holds the engine, and that a server engine takes
nothing. None of this needs vLLM: `check` never starts an engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
ARITH = str(ROOT / "configs/arith_cpu.py")
VLLM = ["--set", "sampling.engine=vllm"]
# configs/arith_cpu.py's model: 2 layers, d=128, 4 heads of 32 (kv too), MLP 512, vocab 14, untied:
# 2 x (4 * 128*128 + 3 * 128*512 + 2 * 128) + 2 * 14*128 + 128 parameters.
ARITH_PARAMS = 2 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 2 * 14 * 128 + 128
# Its --no-compile update bound: fp32 params + Adam (m, v and a step count: 8 B over params + 8)
# + fp32 gradients + the step's rows, 128 rows x (4 B x (2 x 13 tokens + 2 x 5 + 1)) = 18,944.
ARITH_UPDATE_BOUND = 4 * ARITH_PARAMS + (8 * ARITH_PARAMS + 8) + 4 * ARITH_PARAMS + 128 * 4 * (2 * 13 + 2 * 5 + 1)


def _config(*overrides: str, path: str = ARITH):
    from grpo_jax import config as config_lib

    return config_lib.apply_overrides(config_lib.load_config_file(path), list(overrides))


def _run(argv: list[str], capsys, tmp_path) -> tuple[int, str, str, dict]:
    from grpo_jax.cli import check as check_command

    parser = argparse.ArgumentParser()
    check_command.add_arguments(parser)
    out_json = tmp_path / "f.json"
    code = check_command.run(parser.parse_args([*argv, "--json", str(out_json)]))
    out = capsys.readouterr()
    figures = json.loads(out_json.read_text()) if out_json.exists() else {}
    return code, out.out, out.err, figures


def _no_fraction(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)


def test_a_16_gib_device_at_utilization_0_3_worked_example(monkeypatch):
    # The engine takes 0.3 x 16 GiB = 4.8 GiB; JAX gets 0.95 - 0.3 = 0.65 of the device, 10.4 GiB
    # (the other 0.05 is both runtimes' overhead).
    from grpo_jax.cli import check_engine, check_shapes
    from grpo_jax.io import hf

    _no_fraction(monkeypatch)
    config = _config("sampling.engine=vllm", "sampling.vllm_gpu_memory_utilization=0.3", "sampling.max_new_tokens=512",
                     "sampling.vllm_dtype=bfloat16")
    qwen = hf.config_from_hf(check_shapes.MODEL_SHAPES["qwen2.5-0.5b"])
    e = check_engine.engine_share(config, qwen, device_bytes=16 * GIB, prompt_len=512)
    assert e["engine_bytes"] == int(0.3 * 16 * GIB) == 5_153_960_755  # 4.8 GiB
    assert e["jax_fraction"] == 0.65 and e["jax_bytes"] == int(0.65 * 16 * GIB) == 11_166_914_969  # 10.4 GiB
    # Qwen2.5-0.5B in bfloat16: its 494,032,768 published parameters x 2 B; one sequence of
    # 512 prompt + 512 new tokens: 2 (K, V) x 24 layers x 2 kv heads x 64 head_dim x 2 B x 1024.
    n = e["needs"]
    assert n["weights_bytes"] == 494_032_768 * 2 and n["kv_cache_bytes"] == 2 * 24 * 2 * 64 * 2 * 1024 == 12_582_912
    assert n["needs_bytes"] == 1_000_648_448 and e["engine_fits"] is True  # 0.93 GiB <= 4.8 GiB
    # sampling.vllm_max_model_length, when set, is the sequence the engine must hold instead.
    longer = _config("sampling.engine=vllm", "sampling.vllm_max_model_length=4096", "sampling.vllm_dtype=bfloat16")
    assert check_engine.engine_needs(longer, qwen, prompt_len=512)["kv_cache_bytes"] == 2 * 24 * 2 * 64 * 2 * 4096
    # 0.05 x 16 GiB = 0.8 GiB cannot hold the 0.93 GiB: flagged.
    small = _config("sampling.engine=vllm", "sampling.vllm_gpu_memory_utilization=0.05",
                    "sampling.max_new_tokens=512", "sampling.vllm_dtype=bfloat16")
    assert check_engine.engine_share(small, qwen, device_bytes=16 * GIB, prompt_len=512)["engine_fits"] is False


def test_tensor_parallelism_splits_the_weights_and_the_kv_heads():
    # Qwen2.5-0.5B has 2 kv heads: tp=2 gives each device 1; tp=4 still keeps 1 (vLLM replicates).
    from grpo_jax.cli import check_engine, check_shapes
    from grpo_jax.io import hf

    qwen = hf.config_from_hf(check_shapes.MODEL_SHAPES["qwen2.5-0.5b"])
    for tp, kv_heads in ((1, 2), (2, 1), (4, 1)):
        config = _config("sampling.engine=vllm", f"sampling.vllm_tensor_parallel_size={tp}",
                         "sampling.vllm_dtype=float32", "sampling.max_new_tokens=8")
        n = check_engine.engine_needs(config, qwen, prompt_len=8)
        assert n["weights_bytes"] == 494_032_768 * 4 // tp
        assert n["kv_cache_bytes"] == 2 * 24 * kv_heads * 64 * 4 * 16


def test_jax_fraction_is_the_one_train_sets(monkeypatch):
    # train (grpo_jax.__main__._share_memory_with_vllm) writes XLA_PYTHON_CLIENT_MEM_FRACTION; check
    # must judge the update against the same number, and against the user's own when set.
    import os

    from grpo_jax import __main__ as main_module
    from grpo_jax.cli import check_engine

    for utilization in (0.1, 0.3, 0.45, 0.9, 1.0):
        _no_fraction(monkeypatch)
        config = _config("sampling.engine=vllm", f"sampling.vllm_gpu_memory_utilization={utilization}")
        main_module._share_memory_with_vllm(config)
        assert check_engine.jax_memory_fraction(config, {}) == float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    config = _config("sampling.engine=vllm")
    e = check_engine.engine_share(config, _arith_model(), device_bytes=16 * GIB, prompt_len=8,
                                  environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    assert e["jax_bytes"] == 8 * GIB and e["engine_bytes"] == int(0.3 * 16 * GIB)
    assert check_engine.jax_memory_fraction(_config("sampling.engine=vllm", "sampling.vllm_mode=server"), {}) is None
    # On a GPU without --memory-per-device, JAX's pool (0.75 of the card by default) gives the card.
    assert check_engine.whole_device(12 * GIB, "gpu", {}) == 16 * GIB
    assert check_engine.whole_device(12 * GIB, "tpu", {}) == 12 * GIB


def _arith_model():
    from grpo_jax.cli import check_shapes

    return check_shapes.resolve_shape(_config(), None)[0]


def test_an_update_that_fits_the_device_but_not_what_the_engine_leaves_is_flagged(capsys, tmp_path, monkeypatch):
    # --no-compile's update bound is 8,475,144 B. A 12 MiB device (12,582,912 B) holds it, but JAX
    # keeps 0.65 of it beside a colocated engine: 8,178,892 B < 8,475,144 B. The engine's 0.3 share
    # (3,774,873 B) holds its fp32 weights (2,114,048 B) and one 13-token sequence's KV cache
    # (2 x 2 layers x 4 heads x 32 x 4 B x 13 = 26,624 B).
    _no_fraction(monkeypatch)
    assert ARITH_UPDATE_BOUND == 8_475_144
    device = ["--no-compile", "--prompt-tokens", "8", "--memory-per-device", "12MiB"]
    code, out, err, f = _run(["--config", ARITH, *device], capsys, tmp_path)
    # Our own sampler: the whole device is the budget (its peak is the rollout's KV cache there).
    assert code == 0 and f["fits"] is True and f["vllm"] is None and f["budget"] == 12 * 2**20
    code, out, err, f = _run(["--config", ARITH, *device, *VLLM], capsys, tmp_path)
    assert code == 3, err
    assert f["peak"] == {"phase": "update (no temp)", "bytes": ARITH_UPDATE_BOUND, "parts": f["peak"]["parts"]}
    assert f["vllm"]["engine_bytes"] == int(0.3 * 12 * 2**20) == 3_774_873
    assert f["budget"] == f["vllm"]["jax_bytes"] == int(0.65 * 12 * 2**20) == 8_178_892
    needs = f["vllm"]["needs"]
    assert (needs["weights_bytes"], needs["kv_cache_bytes"]) == (4 * ARITH_PARAMS, 26_624) and f["vllm"]["engine_fits"]
    assert f["per_device_bytes"]["kv_cache"] == 0  # the KV cache is the engine's, inside its share
    assert "too big: the update (no temp) phase needs" in err and "JAX keeps beside the colocated vLLM engine" in err
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.65" in err and "too small" not in err
    assert "EXCEEDS the 0.01 GiB JAX keeps of 0.01 GiB beside the vLLM engine" in out

    # A server engine runs on devices of its own: the update gets the whole 12 MiB again.
    code, out, err, f = _run(["--config", ARITH, *device, *VLLM, "--set", "sampling.vllm_mode=server"], capsys,
                             tmp_path)
    assert code == 0, err
    assert f["vllm"]["engine_bytes"] == 0 and f["budget"] == 12 * 2**20 and f["fits"] is True
    assert "rollout on vLLM: a server at 127.0.0.1:8000 on devices of its own; it takes none" in out


def test_an_engine_share_too_small_for_the_engine_is_refused(capsys, tmp_path, monkeypatch):
    # 0.03 of 64 MiB = 2,013,265 B < 2,140,672 B (fp32 weights + one sequence's KV); JAX's 0.92
    # share (61,740,154 B) holds the update, so only the engine's share is named.
    _no_fraction(monkeypatch)
    code, out, err, f = _run(["--config", ARITH, "--no-compile", "--prompt-tokens", "8", "--memory-per-device",
                              "64MiB", *VLLM, "--set", "sampling.vllm_gpu_memory_utilization=0.03"], capsys, tmp_path)
    assert code == 3
    assert f["vllm"]["engine_bytes"] == 2_013_265 and f["vllm"]["needs"]["needs_bytes"] == 2_140_672
    assert f["vllm"]["engine_fits"] is False and f["fits"] is False
    assert err.startswith("too small: sampling.vllm_gpu_memory_utilization=0.03 gives the vLLM engine") and \
        "too big" not in err
    assert "ENGINE SHARE TOO SMALL" in out


def test_engine_vllm_compiles_no_sampler_and_starts_no_engine(capsys, tmp_path, monkeypatch):
    # build_sampler with engine=vllm would start a real vLLM engine: check must not call it, nor
    # compile our prefill/decode; the rollout phase holds the JAX state while the engine samples.
    from grpo_jax.training import run_context

    def no_engine(*_, **__):
        raise AssertionError("check built the sampler with engine=vllm")

    monkeypatch.setattr(run_context, "build_sampler", no_engine)
    _no_fraction(monkeypatch)
    code, out, err, f = _run(["--config", ARITH, "--prompt-tokens", "8", *VLLM], capsys, tmp_path)
    assert code == 0, err
    assert set(f["programs"]) == {"update"}
    sizes = f["per_device_bytes"]
    assert f["phases"]["rollout"] == sizes["params"] + sizes["opt_state"]  # beta=0: no reference
    assert "rollout on vLLM, colocated" in out and "no --memory-per-device: bytes unknown" in out
    assert f["fits"] is None and f["vllm"]["engine_bytes"] is None
