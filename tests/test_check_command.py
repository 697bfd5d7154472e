"""`python -m grpo_jax check`: every shipped config passes, the per-device figures are the sharding
table's arithmetic and what a real build holds, and errors exit with their codes (2 config, 3 too big).

Run as a script (`python tests/test_check_command.py OUT.json ARGS...`) it is the multi-device half
of `test_figures_equal_the_table_and_a_real_build`: check's figures and a real `run_context.build`
measured with `sharding.bytes_per_device`, on the fake devices its environment gives it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_jax.model import RopeScaling

ROOT = Path(__file__).resolve().parents[1]
FAST_COMPILE = "--xla_backend_optimization_level=0"  # argument/output/alias sizes do not depend on it


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    from grpo_jax.cli import check as check_command

    parser = argparse.ArgumentParser()
    check_command.add_arguments(parser)
    code = check_command.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _cli(args: list[str], devices: int, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.run([sys.executable, "-m", "grpo_jax.cli.check", *args, "--devices", str(devices)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


# ----------------------------------------------------------------------------------------------
# Shipped configs.

def test_arith_cpu_passes_and_prints_the_table(capsys, tmp_path):
    code, out, err = _run(["--config", "configs/arith_cpu.py", "--prompt-tokens", "8",
                           "--json", str(tmp_path / "f.json")], capsys)
    assert code == 0, err
    for line in ("params (fp32 masters)", "Adam state", "KV cache", "compiled programs", "prefill", "decode",
                 "update", "phase peaks", "layers.*.mlp.gate_proj", "P('fsdp', 'tensor')", "summary:"):
        assert line in out, line
    f = json.loads((tmp_path / "f.json").read_text())
    # 2 layers x (4 * 128*128 attention + 3 * 128*512 MLP + 2 * 128 norms) + 2 * 14*128 + 128: whole
    # on one device, 4 B each.
    num_params = 2 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 2 * 14 * 128 + 128
    assert f["model"]["num_params"] == num_params
    assert f["per_device_bytes"]["params"] == 4 * num_params
    assert f["per_device_bytes"]["reference"] == 0  # beta = 0: no reference
    assert set(f["programs"]) == {"prefill", "decode", "update"}  # no log-prob pass without beta or recompute
    assert f["fits"] is None and f["rollout"] == {"rows": 128, "prompt_tokens": 8, "new_tokens": 5,
                                                  "rows_per_device": 128, "update_rows_per_micro_batch": 128,
                                                  "micro_batches": 1}


def test_memory_per_device_too_small_exits_3_naming_the_figure(capsys):
    code, out, err = _run(["--config", "configs/arith_cpu.py", "--prompt-tokens", "8",
                           "--memory-per-device", "1MiB"], capsys)
    assert code == 3
    assert "EXCEEDS 0.00 GiB" in out
    # The phase, what it is made of, and the budget it broke.
    assert "too big: the update phase needs" in err and "update program" in err
    assert "> --memory-per-device" in err


def test_a_bad_set_exits_2_naming_the_field(capsys):
    code, _, err = _run(["--config", "configs/arith_cpu.py", "--set", "grpo.num_generations=0"], capsys)
    assert code == 2 and err.startswith("config error: ") and "grpo.num_generations" in err
    code, _, err = _run(["--config", "configs/arith_cpu.py", "--set", "mesh.data=3"], capsys)
    assert code == 2 and "config error: " in err and "mesh" in err


def test_an_absent_checkpoint_without_model_shape_says_to_pass_it(capsys):
    code, _, err = _run(["--config", "configs/qwen25_05b_gpu.py", "--no-compile"], capsys)
    assert code == 2 and "model.hf_path='/models/Qwen2.5-0.5B-Instruct'" in err and "--model-shape" in err


def test_a_present_checkpoint_is_read_from_its_config_json(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**_shape("qwen2.5-0.5b"), "num_hidden_layers": 2}))
    code, out, err = _run(["--config", "configs/qwen25_05b_gpu.py", "--no-compile",
                           "--set", f"model.hf_path={ckpt}"], capsys)
    assert code == 0, err
    assert f"model.hf_path={ckpt}/config.json" in out and "(2 layers" in out


def test_parse_bytes():
    from grpo_jax.cli.check import parse_bytes

    assert parse_bytes("16GiB") == 16 * 2**30 == parse_bytes("16G")
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5 MiB") == 3 * 2**19 and parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_bytes("16 gigs")


def _shape(name: str) -> dict:
    from grpo_jax.cli.check import MODEL_SHAPES

    return MODEL_SHAPES[name]


@pytest.mark.parametrize("name, published", [
    # Parameter counts as Hugging Face's model pages give them (safetensors metadata).
    ("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304), ("qwen2.5-7b", 7_615_616_512),
    ("qwen2.5-32b", 32_763_876_352), ("llama-3.1-8b", 8_030_261_248), ("gemma-3-1b", 999_885_952)])
def test_model_shapes_have_the_published_parameter_counts(name, published):
    from grpo_jax.io import hf

    config = hf.config_from_hf(_shape(name))
    assert sum(math.prod(e.hf_shape) for e in hf.weight_map(config)) == published


def test_moe_and_gemma_presets_read_as_their_config_json():
    from grpo_jax.io import hf

    q = hf.config_from_hf(_shape("qwen3-30b-a3b"))
    # Qwen/Qwen3-30B-A3B: every one of the 48 layers sparse (decoder_sparse_step 1, no mlp_only_layers),
    # 128 experts of width 768, 8 a token, their weights renormalised; full attention everywhere.
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim) == (48, 2048, 32, 4, 128)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob) == (128, 8, 768, True)
    assert all(q.is_sparse(i) for i in range(48)) and q.layer_types is None and q.sliding_window is None
    assert (q.qk_norm, q.qkv_bias, q.tie_embeddings, q.vocab_size, q.rope_theta) == (True, False, False, 151936, 1e6)
    # 30.53B in all, 3.35B active (embedding and head counted in both): the model card's 30.5B and 3.3B.
    total = sum(math.prod(e.hf_shape) for e in hf.weight_map(q))
    experts = 48 * 3 * 128 * 2048 * 768
    assert (total, int((total - experts + experts * 8 // 128) / 1e8)) == (30_532_122_624, 33)
    g = hf.config_from_hf(_shape("gemma-3-1b"))
    # google/gemma-3-1b-it: sliding_window_pattern 6 puts full attention on every 6th layer.
    assert [i for i in range(26) if g.window(i) is None] == [5, 11, 17, 23] and g.sliding_window == 512
    assert (g.rope_theta, g.rope_local_theta, g.rope_scaling, g.query_pre_attn_scalar) == (1e6, 1e4, None, 256.0)
    assert (g.num_heads, g.num_kv_heads, g.head_dim, g.tie_embeddings, g.num_experts) == (4, 1, 256, True, 0)
    assert hf.architecture_for(g) == "Gemma3ForCausalLM"
    g4 = hf.config_from_hf(_shape("gemma-3-4b"))
    # gemma-3-4b-it's language model: a 1024-token window, global layers' RoPE linear x 8, 3.88B
    # parameters (its 4.30B less the SigLIP vision tower and projector).
    assert (g4.sliding_window, g4.rope_scaling, g4.vocab_size) == (1024, RopeScaling(8.0, rope_type="linear"), 262208)
    assert [i for i in range(34) if g4.window(i) is None] == [5, 11, 17, 23, 29]
    assert sum(math.prod(e.hf_shape) for e in hf.weight_map(g4)) == 3_880_263_168
    # The stop ids check reads: Qwen's <|im_end|>; Gemma's <eos> and <end_of_turn>, pad 0.
    from grpo_jax.cli.check import resolve_shape
    from grpo_jax import config as config_lib

    config = config_lib.load_config_file(str(ROOT / "configs/qwen25_05b_gpu.py"))
    assert resolve_shape(config, "qwen3-30b-a3b")[2:] == ((151645,), 151645)
    assert resolve_shape(config, "gemma-3-1b")[2:] == ((1, 106), 0)


# A small Qwen3-MoE: layer 0 dense (mlp_only_layers), layer 1 sparse with 8 experts of width 32.
_SMALL_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 128, "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0],
              "eos_token_id": 1}


def test_moe_state_figures_are_the_expert_weights_bytes(tmp_path):
    ckpt = tmp_path / "moe"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(_SMALL_MOE))
    sets = [a for s in (f"model.hf_path={ckpt}", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "model.remat=false")
            for a in ("--set", s)]
    proc = _cli(["--config", "configs/qwen25_05b_gpu.py", "--no-compile", *sets, "--json", str(tmp_path / "f.json")],
                devices=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    f = json.loads((tmp_path / "f.json").read_text())
    d, v, n, k, h, dense_f, e, i = 64, 128, 4, 2, 16, 128, 8, 32
    # Float32 elements a device holds on fsdp=2 x tensor=2. Matrices split 4 ways: embed, lm_head,
    # q/k/v/o, the dense layer's gate/up/down and the experts [E, D, I] (D over fsdp, I over tensor;
    # E over the expert axis, 1 here).
    # The router [D, E] splits over fsdp only; norms are whole (attn, mlp and final [D], q/k [H]).
    attention = (d * n * h + 2 * d * k * h + n * h * d) // 4 + 2 * h + 2 * d
    dense = 3 * d * dense_f // 4
    sparse = d * e // 2 + 3 * e * d * i // 4
    per_device = 2 * v * d // 4 + d + 2 * attention + dense + sparse
    sizes = f["per_device_bytes"]
    assert sizes["params"] == 4 * per_device == 4 * 29_312
    # Adam's mu and nu are laid out like the params, plus its replicated step counts (a few bytes).
    assert 2 * sizes["params"] < sizes["opt_state"] < 2 * sizes["params"] + 64
    assert sizes["gradients"] == sizes["params"]
    # Every weight once, the 8 experts' three matrices included: the checkpoint's own count.
    from grpo_jax.io import hf

    assert f["model"]["num_params"] == sum(math.prod(w.hf_shape) for w in hf.weight_map(hf.config_from_hf(_SMALL_MOE)))
    whole_attention = d * n * h + 2 * d * k * h + n * h * d + 2 * h + 2 * d
    assert f["model"]["num_params"] == 2 * v * d + d + 2 * whole_attention + 3 * d * dense_f + d * e + 3 * e * d * i
    experts = {w["name"]: w for w in f["weights"] if "expert" in w["name"]}
    assert experts["layers.*.mlp.expert_gate"]["shape"] == [e, d, i]
    assert experts["layers.*.mlp.expert_gate"]["train"] == "P('expert', 'fsdp', 'tensor')"


@pytest.mark.slow  # compiles a MoE step on 4 fake devices (~30 s of CPU); CI runs it with the slow tests
def test_moe_pairs_are_each_devices_share_and_bound_the_compiled_update(tmp_path):
    # configs/qwen25_05b_gpu.py's step, cut to 4 prompts x 4 samples, on the small MoE over
    # data=1 x fsdp=2 x tensor=2: 16 rows of 16 prompt + 16 new tokens; 2 minibatches x 2
    # accumulation steps = micro-batches of 4 rows.
    ckpt = tmp_path / "moe"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(_SMALL_MOE))
    sets = [a for s in (f"model.hf_path={ckpt}", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                        "sampling.max_new_tokens=16", "grpo.prompts_per_step=4", "grpo.num_generations=4")
            for a in ("--set", s)]
    proc = _cli(["--config", "configs/qwen25_05b_gpu.py", "--prompt-tokens", "16", *sets,
                 "--json", str(tmp_path / "f.json")], devices=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    f = json.loads((tmp_path / "f.json").read_text())
    sizes, update = f["per_device_bytes"], f["programs"]["update"]
    d, i, k, bf16 = 64, 32, 2, 2
    # The update: minibatches draw rows in random order, so each row runs its own prompt: 4 rows
    # x 32 tokens, 2 rows on each of the 2 fsdp devices, each routing its own 64 tokens x K = 128
    # pairs (module check_moe), [M, D] + [M, I] in bf16.
    assert sizes["moe_pairs_update"] == 2 * 32 * k * (d + i) * bf16 == 24_576
    # The reference pass (beta 0.04) runs in 2 chunks of 8 rows (whole groups on both row
    # devices): 2 groups of 4 sharing one prompt, 2 x (16 + 4 x 16) = 160 tokens, 80 a device.
    assert sizes["moe_pairs_logprobs"] == 80 * k * (d + i) * bf16
    # A lower bound on the compiled programs' scratch (the update's also holds the gradients).
    assert update["temp"] >= sizes["moe_pairs_update"] + sizes["gradients"]
    assert f["programs"]["logprobs_ref"]["temp"] >= sizes["moe_pairs_logprobs"]


# ----------------------------------------------------------------------------------------------
# The figures: the table's arithmetic, and a real build's bytes on 4 devices.

SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=16", "model.vocab_size=15", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
         "grpo.beta=0.04", "grpo.ref_dtype=bfloat16", "sft.steps=0"]


def _small_table_bytes() -> int:
    """configs/arith_cpu.py's 2 layers at D=64, F=128, 4 heads, 2 kv heads of 16, V=15, fsdp=2 x tensor=2:
    4 B x elements / (fsdp x tensor) for weights whose dims divide, whole for norms; V=15 does not
    divide tensor=2, so embed [V, D] and lm_head [D, V] are split over fsdp only."""
    d, f, n, k, h, v, layers = 64, 128, 4, 2, 16, 15, 2
    per_layer = (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) / 4 + 2 * d
    return int(4 * (layers * per_layer + 2 * v * d / 2 + d))


def test_figures_equal_the_table_and_a_real_build(tmp_path):
    out = tmp_path / "measured.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}")
    proc = subprocess.run([sys.executable, str(Path(__file__)), str(out), *SMALL], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    sizes, measured, programs = result["figures"]["per_device_bytes"], result["measured"], result["figures"]["programs"]
    assert sizes["params"] == _small_table_bytes() == 78_848
    # A real build holds exactly that on every device, and Adam (mu, nu and step counts) and the
    # bf16 reference what check says.
    assert measured["params"] == [sizes["params"]]
    assert measured["opt_state"] == [sizes["opt_state"]]
    assert measured["reference"] == [sizes["reference"]] == [sizes["params"] // 2]
    assert 2 * sizes["params"] < sizes["opt_state"] < 2 * sizes["params"] + 64
    # The update donates params and Adam state: exactly those bytes are written in place.
    assert programs["update"]["alias"] == sizes["params"] + sizes["opt_state"]
    # The KV cache: 64 rows per device (128 over data x fsdp = 2) x 2 layers x (k, v) x 1 kv head
    # (2 over tensor = 2) x 16 x (8 prompt + 5 new) slots x 4 B (float32 model).
    assert sizes["kv_cache"] == 64 * 2 * 2 * 1 * 16 * 13 * 4
    # The prefill returns it with the decode state's small arrays (key mask [64, 13], logits
    # [64, 15], positions, step, tokens and log-probs [64, 5], done) and the prompts [64, 8], and
    # XLA counts the output tuple's table of 12 pointers (8 B each).
    small = 4 * (64 * 13 + 64 * 15 + 64 + 1 + 2 * 64 * 5 + 64 * 8) + 64 + 12 * 8
    assert programs["prefill"]["output"] == sizes["kv_cache"] + small
    # Sampler layout: whole along fsdp, so a separate copy; split over tensor only.
    assert sizes["decode_weights"] > sizes["params"]
    assert result["figures"]["rollout"]["rows_per_device"] == 64
    assert {"prefill", "decode", "logprobs_ref", "update"} == set(programs)


def _measure(out_path: str, overrides: list[str]) -> None:
    """check's figures and a real build's bytes per device (set of values over the devices)."""
    from grpo_jax.cli import check as check_command
    from grpo_jax.training import run_context, step
    from grpo_jax.distributed import sharding
    from grpo_jax import config as config_lib

    config = config_lib.apply_overrides(config_lib.load_config_file(str(ROOT / "configs/arith_cpu.py")), overrides)
    figures = check_command.check(config, prompt_tokens=8)
    ctx, state = run_context.build(config)
    ref = step.frozen_copy(state.params, ctx.ref_dtype)

    def per_device(tree):
        return sorted(set(sharding.bytes_per_device(tree).values()))

    measured = {"params": per_device(state.params), "opt_state": per_device(state.opt_state),
                "reference": per_device(ref)}
    Path(out_path).write_text(json.dumps({"figures": figures, "measured": measured}))


# ----------------------------------------------------------------------------------------------
# fsdp splits the update's rows like data does.

# Two Qwen2.5-0.5B-wide layers (d=896, F=4864, 14/2 heads of 64, its 151,936-token vocabulary) with
# 64 new tokens: at this width XLA's partitioner, left alone, split activations over fsdp along the
# hidden dimension and kept every row on every device (before model.kernels.constrain_rows).
_WIDE = ["--set", "model.hidden_size=896", "--set", "model.intermediate_size=4864", "--set", "model.num_heads=14",
         "--set", "model.num_kv_heads=2", "--set", "model.head_dim=64", "--set", "model.vocab_size=151936",
         "--set", "sampling.max_new_tokens=64"]


def test_fsdp_update_holds_its_share_of_rows_like_data(tmp_path):
    figures = {}
    for name, mesh in (("data", ["mesh.data=8", "mesh.fsdp=1"]), ("fsdp", ["mesh.data=1", "mesh.fsdp=8"])):
        sets = [a for m in mesh for a in ("--set", m)]
        proc = _cli(["--config", "configs/arith_cpu.py", *_WIDE, *sets, "--json", str(tmp_path / f"{name}.json")],
                    devices=8)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        figures[name] = json.loads((tmp_path / f"{name}.json").read_text())
    data, fsdp = figures["data"], figures["fsdp"]
    assert data["rollout"]["rows_per_device"] == fsdp["rollout"]["rows_per_device"] == 16
    # Error argument: both meshes give each device the same 16 of the 128 rows, so the same
    # activations. fsdp=8 holds 1/8 of the float32 gradient instead of all of it (saving 7/8 of
    # 4 B x params) and gathers weights one at a time (at most the largest, lm_head or embed:
    # 151,936 x 896 x 4 B, once more for its gradient's reduce-scatter input). Rows kept whole
    # on every device cost 7 x 16 rows' activations more: 3.80 GB against data's 3.52 GB here,
    # above the bound; with the rows split, 2.11 GB.
    params = data["model"]["num_params"]
    largest_weight = 151_936 * 896 * 4
    bound = data["programs"]["update"]["temp"] - 7 * 4 * params // 8 + 2 * largest_weight
    assert fsdp["programs"]["update"]["temp"] <= bound, (fsdp["programs"]["update"]["temp"], bound)


# ----------------------------------------------------------------------------------------------
# The shipped GPU and pod configs at their real sizes (minutes of CPU compile each).

@pytest.mark.slow
def test_qwen25_05b_gpu_config_on_8_devices(tmp_path):
    proc = _cli(["--config", "configs/qwen25_05b_gpu.py", "--model-shape", "qwen2.5-0.5b",
                 "--json", str(tmp_path / "f.json")], devices=8)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "summary:" in proc.stdout and "fake CPU devices" in proc.stderr
    f = json.loads((tmp_path / "f.json").read_text())
    assert f["mesh"] == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    # data=8 splits rows only: every device holds the whole 494,032,768-parameter model.
    assert f["per_device_bytes"]["params"] == 4 * 494_032_768
    assert f["per_device_bytes"]["reference"] == 2 * 494_032_768  # ref_dtype bfloat16
    # Two minibatches and the sampler correction (on by default): pi_old is a trainer pass.
    assert set(f["programs"]) == {"prefill", "decode", "logprobs_ref", "logprobs_policy", "update"}


@pytest.mark.slow
def test_tpu_pod_config_7b_on_16_devices(tmp_path):
    from grpo_jax.io import hf

    proc = _cli(["--config", "configs/tpu_pod.py", "--model-shape", "qwen2.5-7b", "--set", "mesh.data=1",
                 "--set", "mesh.fsdp=4", "--set", "mesh.tensor=4", "--json", str(tmp_path / "f.json")], devices=16)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    f = json.loads((tmp_path / "f.json").read_text())
    # Every matrix divides by fsdp=4 x tensor=4 (28 heads, 4 kv heads, F, V): 4 B / 16 each; the
    # q/k/v biases [heads, 128] split over tensor only; the norms whole.
    shapes = {e.hf_name: math.prod(e.hf_shape) for e in hf.weight_map(hf.config_from_hf(_shape("qwen2.5-7b")))}
    biases = sum(v for name, v in shapes.items() if name.endswith("bias"))
    norms = sum(v for name, v in shapes.items() if "norm" in name)
    matrices = sum(shapes.values()) - biases - norms
    assert f["per_device_bytes"]["params"] == 4 * (matrices // 16 + biases // 4 + norms)
    assert f["per_device_bytes"]["reference"] == 0  # beta = 0
    assert set(f["programs"]) == {"prefill", "decode", "logprobs_policy", "update"}


if __name__ == "__main__":
    _measure(sys.argv[1], sys.argv[2:])


def test_check_refuses_what_train_refuses_with_the_same_words(capsys, tmp_path):
    # Issue 30: `check --set off_policy.rollout_devices=2 --set off_policy.max_staleness=1` on one device exited 0
    # and printed "mesh data=1" (it ignored the split), while `train` refused the config with exit 2.
    sets = ["--set", "off_policy.rollout_devices=2", "--set", "off_policy.max_staleness=1"]
    code, out, err = _run(["--config", "configs/arith_cpu.py", "--no-compile", *sets], capsys)
    assert code == 2 and out == ""
    assert err == "config error: off_policy.rollout_devices=2 leaves no device to train on (1 cpu devices)\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    train = subprocess.run([sys.executable, "-m", "grpo_jax", "train", "--config", "configs/arith_cpu.py", *sets,
                            "--set", f"train.run_dir={tmp_path / 'run'}"], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=300, check=False)
    assert train.returncode == 2 and err.strip() in train.stderr, train.stderr[-2000:]


def test_check_shows_the_rollout_device_split(tmp_path):
    # 8 devices, 4 of them sampling: the trainer's mesh is data=4, and the sampler's devices each
    # take 128 / 4 = 32 rows and hold max_staleness = 1 whole fp32 snapshot of the policy.
    out_json = tmp_path / "f.json"
    proc = _cli(["--config", "configs/arith_cpu.py", "--no-compile", "--prompt-tokens", "8", "--set",
                 "off_policy.rollout_devices=4", "--set", "off_policy.max_staleness=1", "--json", str(out_json)], devices=8)
    assert proc.returncode == 0, proc.stderr[-2000:]
    f = json.loads(out_json.read_text())
    num_params = 2 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 2 * 14 * 128 + 128  # as in the first test
    assert f["mesh"] == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1}
    # KV cache: 32 rows x (8 + 5) tokens x 2 layers x (k, v) x 4 kv heads x 32 head dim x 4 B.
    assert f["rollout_devices"] == {"devices": 4, "rows_per_device": 32, "snapshot_bytes_per_device": 4 * num_params,
                                    "kv_cache_bytes_per_device": 32 * 13 * 2 * 2 * 4 * 32 * 4}
    assert "mesh data=4 fsdp=1 expert=1 tensor=1 over the trainer's 4; rollouts on 4 more device(s) of their own" in proc.stdout


def test_a_very_deep_model_says_at_once_that_the_check_takes_minutes(monkeypatch, caplog):
    # Issue 30: `check` with 10,000 layers was silent for minutes (1,000 layers: 68 s without
    # compiling on a 2-core CPU). The line comes before the slow build, which is stopped here.
    import logging

    from grpo_jax.cli import check as check_command
    from grpo_jax import config as config_lib

    def stop(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(check_command, "abstract_state", stop)
    config = config_lib.apply_overrides(config_lib.load_config_file(ROOT / "configs/arith_cpu.py"),
                                        ["model.num_layers=10000"])
    with caplog.at_level(logging.WARNING, logger="grpo_jax"), pytest.raises(KeyboardInterrupt):
        check_command.check(config, compile_programs=False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("check: 10000 layers (from the config's model.* fields): ") and "minutes" in line
