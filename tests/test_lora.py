"""LoRA (`lora.r`): the merge as a worked example, B = 0 is the base bit for bit, gradients
are the chain rule of the full gradient, only adapters train, the reference is the base, exact
resume, peft's layout on export, and the trainable state of a Qwen2.5-0.5B shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.cli import check as check_command
from grpo_jax.model import lora
from grpo_jax.training import run_context, run_state, train
from grpo_jax import model as model_lib
from grpo_jax.io.checkpoint import CheckpointManager
from grpo_jax.config import Config, ConfigError
from test_train import SevensTask, tiny_config
from tolerances import FORWARD_REL_ERR, GRAD_REL_ERR, metric_tolerance

TESTS = Path(__file__).parent
SMALL = model_lib.ModelConfig(vocab_size=14, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                              num_kv_heads=1, head_dim=16)


def _lora_config(run_dir, r=4, **train_overrides) -> Config:
    cfg = tiny_config(run_dir)
    return dataclasses.replace(cfg,
                               train=dataclasses.replace(cfg.train, **train_overrides),
                               lora=dataclasses.replace(cfg.lora, r=r))


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_merge_worked_example():
    # W = [[1, 2], [3, 4]] ([in 2, out 2]), A = [[1], [2]] ([2, r=1]), B = [[0.5, -1]], alpha/r = 2:
    # A @ B = [[0.5, -1], [1, -2]], W' = W + 2 A B = [[2, 0], [5, 0]].
    base = {"layers": {0: {"mlp": {"up_proj": jnp.asarray([[1.0, 2.0], [3.0, 4.0]])}}}}
    adapters = {"layers": {"0": {"mlp": {"up_proj": {"lora_a": jnp.asarray([[1.0], [2.0]]),
                                                     "lora_b": jnp.asarray([[0.5, -1.0]])}}}}}
    merged = lora.merge(base, adapters, scale=2.0)
    np.testing.assert_array_equal(merged["layers"][0]["mlp"]["up_proj"], [[2.0, 0.0], [5.0, 0.0]])


def test_fresh_adapters_are_the_base_model_bit_for_bit():
    # B = 0: W + scale * A @ 0 == W exactly, so the merged params and the logits are the base's.
    graphdef, base = nnx.split(model_lib.init_model(SMALL, 0))
    adapters = lora.init_adapters(base, lora.resolve_targets(["all-linear"]), 8, jax.random.PRNGKey(1))
    assert np.all(np.asarray(adapters["layers"]["0"]["attn"]["q_proj"]["lora_a"]) != 0)
    merged = lora.merge(base, adapters, scale=32 / 8)
    assert _bits(merged) == _bits(base)
    tokens = jnp.asarray([[3, 5, 7, 11, 2, 1]])
    logits = [nnx.merge(graphdef, p)(tokens) for p in (base, merged)]
    assert np.asarray(logits[0]).tobytes() == np.asarray(logits[1]).tobytes()
    # Shapes: q_proj [D, N, H] -> A [D, r], B [r, N*H]; o_proj [N, H, D] -> A [N*H, r], B [r, D].
    attn = adapters["layers"]["0"]["attn"]
    assert attn["q_proj"]["lora_a"].shape == (32, 8) and attn["q_proj"]["lora_b"].shape == (8, 32)
    assert attn["o_proj"]["lora_a"].shape == (32, 8) and attn["o_proj"]["lora_b"].shape == (8, 32)
    assert set(adapters["layers"]["0"]) == {"attn", "mlp"}
    assert set(lora.init_adapters(base, lora.resolve_targets(["attention"]), 8, jax.random.PRNGKey(1))
               ["layers"]["0"]) == {"attn"}


def test_adapter_gradients_are_the_chain_rule_of_the_weight_gradient():
    # L(W + s A B): dL/dA = s * G @ B.T and dL/dB = s * A.T @ G, with G = dL/dW' the full model's
    # gradient at the merged weights (each a sum reordered: GRAD_REL_ERR, tests/tolerances.py).
    graphdef, base = nnx.split(model_lib.init_model(SMALL, 0))
    adapters = lora.init_adapters(base, ("q_proj", "down_proj"), 4, jax.random.PRNGKey(1))
    adapters = jax.tree.map(lambda x: x + 0.05 * jnp.ones_like(x), adapters)  # B != 0
    tokens, scale = jnp.asarray([[3, 5, 7, 11, 2, 1], [4, 4, 9, 1, 0, 2]]), 2.0

    def loss(params):
        return model_lib.token_logprobs(graphdef, params, tokens, jnp.ones_like(tokens), num_targets=4).sum()

    grad_adapters = jax.grad(lambda ad: loss(lora.merge(base, ad, scale)))(adapters)
    grad_weights = jax.grad(loss)(lora.merge(base, adapters, scale))
    for weight, part in (("q_proj", "attn"), ("down_proj", "mlp")):
        a, b = (adapters["layers"]["1"][part][weight][k] for k in ("lora_a", "lora_b"))
        g = grad_weights["layers"][1][part][weight][...]
        g = g.reshape(a.shape[0], b.shape[1])
        got = grad_adapters["layers"]["1"][part][weight]
        np.testing.assert_allclose(got["lora_a"], scale * g @ b.T, rtol=GRAD_REL_ERR, atol=1e-7)
        np.testing.assert_allclose(got["lora_b"], scale * a.T @ g, rtol=GRAD_REL_ERR, atol=1e-7)


def test_only_adapters_train_and_the_reference_is_the_base(tmp_path):
    cfg = _lora_config(tmp_path, steps=3)
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, num_minibatches=1))  # one update per step
    ctx, fresh = run_context.build(cfg, task=SevensTask())
    base_before = _bits(fresh.base_params)
    result = train.run(cfg, task=SevensTask())
    with CheckpointManager(run_state.ckpt_dir_of(tmp_path)) as ckpt:
        state = run_state.initial_state(ctx, fresh, ckpt, resume=True)
    # The optimizer holds Adam's two moments of the adapters and nothing of the base.
    moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    assert lora.count(moments) == 2 * lora.count(state.params)
    assert state.ref_params is None and _bits(state.base_params) == base_before
    assert lora.count(state.params) < 0.25 * lora.count(state.base_params)
    # The checkpoint holds adapters and optimizer state only (no SFT warm-up: the base is the init).
    assert set(run_state._checkpoint_state(ctx, state)) == {"params", "opt_state"}
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(state.params))  # B has moved
    # Step 1: the policy is the base (B = 0), so the KL to the reference is 0 up to the two log-prob
    # passes' summation order: k3 ~ d^2 / 2 with |d| <= FORWARD_REL_ERR * |logp| (|logp| <= ~10).
    assert result.history[0]["kl"] <= (10 * FORWARD_REL_ERR) ** 2
    assert result.history[-1]["kl"] > result.history[0]["kl"]


def test_lora_resume_equals_a_straight_run(tmp_path):
    straight = train.run(_lora_config(tmp_path / "straight", steps=4), task=SevensTask())
    first = train.run(_lora_config(tmp_path / "split", steps=4, stop_after_steps=2), task=SevensTask())
    assert first.step == 2
    resumed = train.run(_lora_config(tmp_path / "split", steps=4), resume=True, task=SevensTask())
    assert _bits(resumed.params) == _bits(straight.params)
    drop = ("time/", "tokens_per_second", "recompiles")
    rows = {r["step"]: {k: v for k, v in r.items() if not k.startswith(drop)} for r in straight.history}
    for row in resumed.history:
        assert {k: v for k, v in row.items() if not k.startswith(drop)} == rows[row["step"]]


def test_lora_with_asynchronous_rollouts_resumes_exactly(tmp_path):
    # The rollout snapshots are merged policies (what the sampler reads), checkpointed and restored.
    def config(run_dir, **kw):
        cfg = _lora_config(run_dir, steps=4, **kw)
        return dataclasses.replace(cfg,
                                   off_policy=dataclasses.replace(cfg.off_policy, max_staleness=1))

    straight = train.run(config(tmp_path / "straight"), task=SevensTask())
    assert [r["async/staleness"] for r in straight.history] == [0.0, 1, 1, 1]
    train.run(config(tmp_path / "split", stop_after_steps=2), task=SevensTask())
    resumed = train.run(config(tmp_path / "split"), resume=True, task=SevensTask())
    assert _bits(resumed.params) == _bits(straight.params)


def test_export_writes_the_merged_model_and_peft_adapters(tmp_path):
    from grpo_jax.io import hf
    from safetensors.numpy import load_file

    cfg = _lora_config(tmp_path, steps=2, export_hf=True)
    result = train.run(cfg, task=SevensTask())
    ctx, fresh = run_context.build(cfg, task=SevensTask())
    state = dataclasses.replace(fresh, params=result.params)
    merged = ctx.policy_params(state)
    exported = nnx.split(hf.load_model(tmp_path / "hf"))[1]
    for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(merged)):
        np.testing.assert_array_equal(got, want)
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert peft_config["r"] == 4 and peft_config["lora_alpha"] == 32.0 and peft_config["peft_type"] == "LORA"
    assert set(peft_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"}
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    stem = "base_model.model.model.layers.1.self_attn.q_proj"
    lora_a, lora_b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
    assert lora_a.shape == (4, 32) and lora_b.shape == (32, 4)  # torch Linear layouts: [r, in], [out, r]
    # peft's merge in HF's layout: W_hf + (alpha / r) * lora_B @ lora_A is the exported weight.
    hf_base = np.asarray(fresh.base_params["layers"][1]["attn"]["q_proj"][...]).reshape(32, 32).T
    hf_merged = np.asarray(merged["layers"][1]["attn"]["q_proj"][...]).reshape(32, 32).T
    np.testing.assert_allclose(hf_base + 8.0 * lora_b @ lora_a, hf_merged, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fixture", ["hf_qwen3_moe", "hf_gemma3"])
def test_peft_names_of_qwen3_moe_and_gemma3_adapters_are_their_hf_weights(fixture):
    # Every peft key `base_model.model.{W}.lora_A.weight` names an HF weight `{W}.weight` of the
    # checkpoint, and peft's merge in HF's layout, W_hf + scale * lora_B @ lora_A, is our merged
    # weight exported (Gemma's o_proj in = N * H = 64; Qwen3-MoE's dense layer 1 has gate/up/down).
    from grpo_jax.io import hf, peft

    model = hf.load_model(TESTS / "fixtures" / fixture)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    adapters = lora.init_adapters(params, lora.resolve_targets(["all-linear"]), 2, jax.random.PRNGKey(0))
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # B != 0, so the merge moves every target
    merged_hf = dict(hf.hf_tensors(lora.merge(params, adapters, 4.0), model.config))
    base_hf = dict(hf.hf_tensors(params, model.config))
    tensors = peft.peft_state_dict(adapters)
    stems = sorted({k[len("base_model.model."):-len(".lora_A.weight")] for k in tensors if "lora_A" in k})
    layers = model.config.num_layers
    assert len(stems) == 4 * layers + 3 * (1 if fixture == "hf_qwen3_moe" else layers)
    for stem in stems:
        a, b = tensors[f"base_model.model.{stem}.lora_A.weight"], tensors[f"base_model.model.{stem}.lora_B.weight"]
        # float32: W + 4 * (A @ B) with r = 2 on both sides, the same few roundings (<= 4u relative
        # of |W| + 4 |A| |B| ~ 1): 1e-6 absolute.
        np.testing.assert_allclose(base_hf[f"{stem}.weight"] + 4.0 * b @ a, merged_hf[f"{stem}.weight"],
                                   rtol=0, atol=1e-6, err_msg=stem)


def test_lora_config_errors_name_the_field(tmp_path):
    cfg = tiny_config(tmp_path)
    for fields, words in [({"r": 4, "dropout": 0.05}, "lora.dropout=0.05"),
                          ({"r": 4, "target_modules": ("qkv",)}, "unknown LoRA target 'qkv'"),
                          ({"r": -1}, "lora.r=-1")]:
        with pytest.raises(ConfigError, match=words):
            dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, **fields))
    with pytest.raises(ConfigError, match="grpo.ref_resync_every=5 with lora.r=4"):
        dataclasses.replace(cfg,
                            grpo=dataclasses.replace(cfg.grpo, ref_resync_every=5),
                            lora=dataclasses.replace(cfg.lora, r=4))


def test_trainable_state_of_a_qwen25_05b_shape_is_under_5_percent():
    # Rank 16 on every linear layer of Qwen2.5-0.5B (24 layers, D 896, F 4864, 14 / 2 heads of 64):
    # per layer r * (in + out) summed over q (896 -> 896), k and v (896 -> 128 each), o (896 -> 896),
    # gate, up, down (896 <-> 4864) = 16 * (1792 + 2 * 1024 + 1792 + 3 * 5760) = 16 * 22,912 = 366,592,
    # so 8,798,208 adapter params against 494,032,768 (1.78%).
    cfg = dataclasses.replace(tiny_config("/tmp/unused"), grpo=dataclasses.replace(tiny_config("/tmp/unused").grpo,
                                                                                     beta=0.0))
    full = check_command.check(cfg, devices=1, model_shape="qwen2.5-0.5b", compile_programs=False)
    cfg_lora = dataclasses.replace(cfg,
                                   lora=dataclasses.replace(cfg.lora, r=16))
    with_lora = check_command.check(cfg_lora, devices=1, model_shape="qwen2.5-0.5b", compile_programs=False)
    assert with_lora["model"]["trainable_params"] == 24 * 366_592
    # Trainable state: params (or adapters) + gradients + Adam's two moments, all float32.
    assert full["trainable_state_bytes"] == pytest.approx(16 * 494_032_768, rel=1e-6)
    ratio = with_lora["trainable_state_bytes"] / full["trainable_state_bytes"]
    assert ratio == pytest.approx(24 * 366_592 / 494_032_768, rel=1e-3) and ratio <= 0.05


def _device_run(tmp_path, devices: int) -> dict:
    out = tmp_path / f"lora{devices}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, str(TESTS / "lora_devices_check.py"), str(out), str(tmp_path / out.stem)],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two subprocess runs (~20 s); CI runs it with the slow tests
def test_lora_on_eight_devices_equals_one_device(tmp_path):
    one, eight = _device_run(tmp_path, 1), _device_run(tmp_path, 8)
    assert eight["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    # Per device: q_proj's A [32, 4] splits its input D over fsdp, B [4, 32] its heads over tensor.
    assert eight["q_proj_lora_a_shard"] == [16, 4] and eight["q_proj_lora_b_shard"] == [4, 16]
    assert one["q_proj_lora_a_shard"] == [32, 4]
    for got, want in zip(eight["history"], one["history"]):
        for k in ("reward", "completions/mean_length", "data_position"):
            assert got[k] == want[k], (got["step"], k)
        for k in ("loss", "kl", "grad_norm", "entropy"):
            assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)


@pytest.mark.parity
def test_parity_peft_applies_the_exported_adapters_as_the_merged_export(tmp_path):
    # peft loads run_dir/peft onto the base (written as HF weights here) and computes the logits
    # transformers computes from the merged export run_dir/hf, and ours from the merged params.
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from grpo_jax.io import hf

    cfg = _lora_config(tmp_path / "run", steps=2, export_hf=True)
    result = train.run(cfg, task=SevensTask())
    ctx, fresh = run_context.build(cfg, task=SevensTask())
    hf.save_model(nnx.merge(ctx.graphdef, fresh.base_params), tmp_path / "base", tokenizer=ctx.tokenizer)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "peft").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).eval()
    tokens = np.asarray([[3, 5, 7, 11, 2, 1, 9, 4]])
    with torch.no_grad():
        got = with_adapters(torch.tensor(tokens)).logits.numpy()
        want = merged(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(nnx.merge(ctx.graphdef, ctx.policy_params(dataclasses.replace(fresh, params=result.params)))(
        jnp.asarray(tokens)))
    # Three float32 forwards of the same weights, summed in other orders: FORWARD_REL_ERR of the
    # logits' scale (|logit| <= ~5 for this model), as the other parity tests (tests/test_hf.py).
    np.testing.assert_allclose(got, want, atol=5 * FORWARD_REL_ERR)
    np.testing.assert_allclose(ours, want, atol=5 * FORWARD_REL_ERR)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()  # (peft wraps `base`)
    with torch.no_grad():
        assert np.abs(got - plain(torch.tensor(tokens)).logits.numpy()).max() > 1e-4  # the adapters moved it
