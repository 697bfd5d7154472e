"""Qwen3-MoE: routing and grouped expert matmuls (grpo_jax.model.moe), transformers parity on the
committed fixture (tests/fixtures/hf_qwen3_moe, made by tests/fixtures/make_hf_fixtures.py),
import/export, training gradients, routing replay, and the experts' sharding on a device mesh.
"""

import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from grpo_jax.io import hf
from grpo_jax.model import ModelConfig, Transformer, init_model, moe, partition_specs
from tolerances import metric_tolerance

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf_qwen3_moe"
REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                   head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                   norm_topk_prob=True, mlp_only_layers=(1,))

_routing = jax.jit(moe.forward_with_routing, static_argnums=0)


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _fixture_run(moe_impl: str = "auto"):
    model = hf.load_model(FIXTURE)
    expected = np.load(FIXTURE / "expected.npz")
    _, params = nnx.split(model, nnx.Param)
    config = dataclasses.replace(model.config, moe_impl=moe_impl)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)[0]
    logits, routing = _routing(graphdef, params, jnp.asarray(expected["tokens_BxT"]),
                               jnp.asarray(expected["mask_BxT"]))
    return model, expected, np.asarray(logits), routing


# ---------------------------------------------------------------- the math, on hand-sized inputs

def test_router_takes_the_top_k_softmax_and_renormalises():
    # One token, router logits log([0.1, 0.2, 0.3, 0.4]): the softmax gives those probabilities back.
    probs = jax.nn.softmax(jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]])))
    experts = moe.top_k_experts(probs, 2)
    assert experts.tolist() == [[3, 2]]  # most probable first, as torch.topk
    np.testing.assert_allclose(moe.choice_weights(probs, experts, False), [[0.4, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(moe.choice_weights(probs, experts, True), [[0.4 / 0.7, 0.3 / 0.7]], rtol=1e-6)


@pytest.mark.parametrize("impl", ["ragged", "tiled"])
def test_grouped_experts_equal_a_per_token_loop(impl):
    # 5 tokens, 3 experts, top-2; expert 1 is chosen by nobody (an empty group of the ragged dot).
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    gate, up = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    down = rng.standard_normal((3, 6, 4)).astype(np.float32)
    experts = np.array([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2]], np.int32)
    weights = rng.uniform(size=(5, 2)).astype(np.float32)
    out = moe.experts_ffn(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), gate, up, down, impl)
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    loop = np.stack([sum(weights[n, j] * (silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e]
                         for j, e in enumerate(experts[n])) for n in range(5)])
    # Same products summed in another order: float32 rounding of sums of ~10 terms of size ~10
    # (u * 10 * 10 ~ 6e-6 relative to the output's ~10), so 1e-5 relative.
    np.testing.assert_allclose(np.asarray(out), loop, rtol=1e-5, atol=1e-5)


def test_load_balancing_loss_is_k_for_a_uniform_router():
    # Uniform probabilities 1/E: f sums to K over the experts, so E * sum_e f_e / E = K.
    logits = (jnp.zeros((2, 3, 4)),)
    np.testing.assert_allclose(moe.load_balancing_loss(logits, top_k=2), 2.0, rtol=1e-6)


def test_dense_config_is_unchanged_and_sparse_layers_follow_transformers_rule():
    dense = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=4)
    assert not any(dense.is_sparse(i) for i in range(2))
    assert "router" not in str(jax.tree.structure(_params(init_model(dense, 0))))
    # decoder_sparse_step 2: layers 1, 3, 5 ((i + 1) % 2 == 0), less mlp_only_layers (3).
    c = ModelConfig(**{**TINY.__dict__, "num_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": (3,)})
    assert [c.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    # Recording and replay address the sparse layers in layer order, layer 10 after layer 9.
    twelve = init_model(ModelConfig(**{**TINY.__dict__, "num_layers": 12, "mlp_only_layers": (3,)}), 0)
    found = [next(i for i, layer in enumerate(twelve.layers) if layer.mlp is m) for m in moe.sparse_layers(twelve)]
    assert found == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="num_experts_per_tok \\(5\\) must be <= num_experts \\(4\\)"):
        ModelConfig(**{**TINY.__dict__, "num_experts_per_tok": 5})


def test_expert_weights_are_sharded_on_the_expert_dimension():
    specs = partition_specs(_params(init_model(TINY, 0)))["layers"][0]["mlp"]
    # E over the expert axis, each expert's width I over tensor (as the dense MLP's F), D over fsdp.
    assert tuple(specs["expert_gate"]) == ("expert", "fsdp", "tensor")
    assert tuple(specs["expert_down"]) == ("expert", "tensor", "fsdp")
    assert tuple(specs["router"]) == ("fsdp", None)


# ---------------------------------------------------------------- transformers parity (fixture)

@pytest.mark.parametrize("moe_impl", ["ragged", "tiled"])
def test_fixture_logits_and_routing_match_transformers(moe_impl):
    model, expected, logits, routing = _fixture_run(moe_impl)
    assert [model.config.is_sparse(i) for i in range(3)] == [True, False, True]
    real = expected["mask_BxT"].astype(bool)
    # Same experts for every real token: the fixture's smallest gap between the 2nd and 3rd router
    # probability is 2e-3 (make_hf_fixtures._margin), ~10^4 times the router logits' difference.
    hf_logits = expected["router_logits_LxNxE"]
    hf_experts = np.argsort(-jax.nn.softmax(hf_logits), axis=-1, kind="stable")[..., :2]
    ours = np.stack([np.asarray(e).reshape(-1, 2) for e in routing.expert_indices])
    assert np.array_equal(ours[:, real.reshape(-1)], hf_experts[:, real.reshape(-1)])
    # With the same experts the rest is float32 summation order: a logit (|logit| <= 4) sums
    # k ~ 10^3 rounded products through three layers, so |error| <= k * u * 4 ~ 2.4e-4 in the worst
    # case, ~sqrt(k) * u * 4 ~ 1e-5 typically; measured 2.2e-6. A wrong weight mapping or a swapped
    # gate/up moves logits by ~1.
    assert float(np.abs(logits - expected["logits_BxTxV"])[real].max()) < 1e-4
    # The auxiliary loss over the real tokens, as transformers computes it (2.29 here): E * sum of
    # 8 products of averages over 36 token-layers, each exact to ~1e-6 relative.
    aux = moe.load_balancing_loss(routing.router_logits, 2, jnp.asarray(expected["mask_BxT"]))
    np.testing.assert_allclose(float(aux), float(expected["aux_loss"]), rtol=1e-5)


def test_config_json_maps_both_spellings_of_num_experts():
    cfg = hf.read_config(FIXTURE)
    assert "num_local_experts" in cfg  # transformers 5 writes this spelling (its attribute_map)
    qwen_spelling = {**{k: v for k, v in cfg.items() if k != "num_local_experts"}, "num_experts": 8}
    assert hf.config_from_hf(cfg) == hf.config_from_hf(qwen_spelling)
    c = hf.config_from_hf(cfg)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
            c.mlp_only_layers, c.qk_norm) == (8, 2, 24, True, (1,), True)
    with pytest.raises(ValueError, match="use_sliding_window=true is not supported for Qwen3MoeForCausalLM"):
        hf.config_from_hf({**cfg, "use_sliding_window": True, "sliding_window": 4})


def test_export_reload_is_exact_and_writes_transformers_names(tmp_path):
    model = hf.load_model(FIXTURE)
    out = hf.save_model(model, tmp_path / "export", source_dir=FIXTURE)
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(FIXTURE / "model.safetensors")))
    back = hf.load_model(out)
    assert back.config == model.config
    jax.tree.map(np.testing.assert_array_equal, _params(back), _params(model))
    fresh = hf.hf_config_from(model.config)  # without a source: every MoE key written afresh
    assert (fresh["architectures"], fresh["model_type"], fresh["num_experts"], fresh["mlp_only_layers"]) == (
        ["Qwen3MoeForCausalLM"], "qwen3_moe", 8, [1])
    assert hf.config_from_hf(fresh) == model.config
    # With the source's config.json as the base its spelling is kept (num_local_experts), and a
    # changed expert count rewrites the whole group in the fresh spelling.
    source = hf.read_config(FIXTURE)
    kept = hf.hf_config_from(model.config, source)
    assert kept["num_local_experts"] == 8 and "num_experts" not in kept
    changed = hf.hf_config_from(dataclasses.replace(model.config, num_experts=4), source)
    assert changed["num_experts"] == 4 and "num_local_experts" not in changed


def test_fused_expert_layout_loads_the_same_weights(tmp_path):
    # transformers 5 holds experts fused in memory (experts.gate_up_proj [E, 2I, D], gate rows first;
    # experts.down_proj [E, D, I]); a checkpoint written in that layout loads to the same params.
    path = tmp_path / "fused"
    shutil.copytree(FIXTURE, path)
    tensors = load_file(str(path / "model.safetensors"))
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts."
        pop = lambda name: [tensors.pop(f"{p}{x}.{name}.weight") for x in range(8)]  # noqa: E731
        gate, up, down = pop("gate_proj"), pop("up_proj"), pop("down_proj")
        tensors[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        tensors[p + "down_proj"] = np.stack(down)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    jax.tree.map(np.testing.assert_array_equal, _params(hf.load_model(path)), _params(hf.load_model(FIXTURE)))


def test_a_missing_expert_tensor_is_named(tmp_path):
    path = tmp_path / "missing"
    shutil.copytree(FIXTURE, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight "
                                         r"\(expected shape \(24, 32\)\)"):
        hf.load_model(path)


# ---------------------------------------------------------------- training and replay

def _lm_loss(params, graphdef, tokens, mask, coef):
    """Next-token cross-entropy over real targets plus coef times the load-balancing loss."""
    logits, routing = moe.forward_with_routing(graphdef, params, tokens, mask)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    weight = (mask[:, :-1] * mask[:, 1:]).astype(jnp.float32)  # real predictions of real tokens
    ce = jnp.sum(nll * weight) / jnp.sum(weight)
    return ce + coef * moe.load_balancing_loss(routing.router_logits, 2, mask), routing


def test_a_few_gradient_steps_train_the_experts_and_the_router():
    model = hf.load_model(FIXTURE)
    expected = np.load(FIXTURE / "expected.npz")
    tokens, mask = jnp.asarray(expected["tokens_BxT"]), jnp.asarray(expected["mask_BxT"])
    graphdef, params = nnx.split(model, nnx.Param)
    step = jax.jit(jax.value_and_grad(_lm_loss, has_aux=True), static_argnums=1)
    losses, first = [], None
    for _ in range(3):
        (loss, routing), grads = step(params, graphdef, tokens, mask, model.config.router_aux_loss_coef)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
        losses.append(float(loss))
        first = first if losses[1:] else (grads, routing)
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    assert losses[-1] < losses[0]
    # An expert's weights get a gradient exactly when a real token chose it (padding tokens are
    # routed too, but attention masks them and the loss skips them). At the first step layer 0 uses
    # all 8 experts, layer 2 leaves experts 1 and 7 to nobody.
    grads, routing = first
    for layer, chosen in zip((0, 2), routing.expert_indices):
        mlp = nnx.to_pure_dict(grads)["layers"][layer]["mlp"]
        assert float(jnp.abs(mlp["router"]).max()) > 0
        used = np.zeros(8, bool)
        used[np.unique(np.asarray(chosen)[np.asarray(mask).astype(bool)])] = True
        for name in ("expert_gate", "expert_up", "expert_down"):
            norms = np.asarray(jnp.abs(mlp[name]).sum(axis=(1, 2)))
            assert np.array_equal(norms > 0, used), (layer, name, norms, used)
    assert used.tolist() == [True, False, True, True, True, True, True, False]


def test_replay_of_recorded_experts_reproduces_the_forward_exactly():
    model = init_model(TINY, 0)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (2, 7)), jnp.int32)
    logits, recorded = _routing(graphdef, params, tokens)
    replayed, again = _routing(graphdef, params, tokens, None, recorded.expert_indices)
    assert np.array_equal(np.asarray(replayed), np.asarray(logits))
    jax.tree.map(np.testing.assert_array_equal, again, recorded)
    # Recording changes nothing: the plain call gives the same logits, and keeps no state.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(tokens))(params)),
                                  np.asarray(logits))
    # Other experts give other logits: the replayed indices are really used.
    shifted = tuple((e + 1) % TINY.num_experts for e in recorded.expert_indices)
    assert not np.allclose(np.asarray(_routing(graphdef, params, tokens, None, shifted)[0]), np.asarray(logits))
    # Under remat (each layer a jax.checkpoint) recording and replay work the same, bit for bit.
    remat_graphdef, _ = nnx.split(init_model(dataclasses.replace(TINY, remat="dots"), 0), nnx.Param)
    remat_logits, remat_recorded = _routing(remat_graphdef, params, tokens, None, recorded.expert_indices)
    assert np.array_equal(np.asarray(remat_logits), np.asarray(logits))
    jax.tree.map(np.testing.assert_array_equal, remat_recorded, recorded)


def test_qwen3_30b_a3b_config_has_its_published_parameter_count():
    # Qwen/Qwen3-30B-A3B's config.json (the MoE fields and shapes): 30.5B parameters, 3.3B active.
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
           "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False,
           "use_sliding_window": False, "sliding_window": None}
    c = hf.config_from_hf(cfg, dtype="bfloat16")
    shapes = nnx.state(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))), nnx.Param)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    experts = 48 * 3 * 128 * 2048 * 768
    active = total - experts + experts * 8 // 128
    # 30.53e9 and 3.35e9 (embedding and head counted in both): the model card's 30.5B and 3.3B, as
    # it writes them (one decimal, cut).
    assert (int(total / 1e8), int(active / 1e8)) == (305, 33)


# ---------------------------------------------------------------- a device mesh

_MESH_CHECK = """
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
sys.path.insert(0, "tests")
from grpo_jax.distributed.sharding import make_mesh, param_shardings
from grpo_jax.model import init_model
from test_qwen3_moe import TINY
model = init_model(TINY, 0)
graphdef, params = nnx.split(model, nnx.Param)
tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (4, 7)), jnp.int32)
fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
one = np.asarray(fwd(params, tokens))
mesh = make_mesh(data=1, fsdp=2, tensor=2, expert=2)
with jax.set_mesh(mesh):
    sharded = jax.device_put(params, param_shardings(mesh, params))
    compiled = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(sharded, tokens).compile()
    many = np.asarray(compiled(sharded, tokens))
gate = nnx.to_pure_dict(sharded)["layers"][0]["mlp"]["expert_gate"]
hlo = compiled.as_text()
sort_sizes = lambda text: sorted({int(n) for n in re.findall(r"= \\(s32\\[(\\d+)\\]\\{0\\}, s32\\[\\d+\\]\\{0\\}\\) sort\\(", text)})
# No expert axis (data 2 x fsdp 2 x tensor 2): each device still routes only its own tokens.
rows_mesh = make_mesh(data=2, fsdp=2, tensor=2)
with jax.set_mesh(rows_mesh):
    on_rows = jax.device_put(params, param_shardings(rows_mesh, params))
    compiled_rows = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(on_rows, tokens).compile()
    rows_diff = float(np.abs(np.asarray(compiled_rows(on_rows, tokens)) - one).max())
# The sampler on the mesh records the same experts as on one device (decided routing: weights x 10).
from grpo_jax.sampling import sampler as S
params = jax.tree.map(lambda p: p * 10.0 if p.ndim > 1 else p, params)
sampling = S.SamplingConfig(max_new_tokens=3, greedy=True, ignore_eos=True, record_experts=True)
runs = [S.Sampler(graphdef, TINY, eos_id=2, pad_id=0, prompt_buckets=(8,), mesh=m)(
    params, [[5, 9, 3], [7, 1, 4, 8]], num_samples=2, sampling=sampling, rng=jax.random.key(0)) for m in (None, mesh)]
real = np.concatenate([np.asarray(runs[0].prompt_mask_BxP), np.ones((4, 3), np.int32)], 1).astype(bool)
same = [np.array_equal(np.moveaxis(np.asarray(r.experts_BxLxSxK), 1, 2)[real],
                       np.moveaxis(np.asarray(runs[0].experts_BxLxSxK), 1, 2)[real]) for r in runs]
print(json.dumps({"diff": float(np.abs(many - one).max()), "scale": float(np.abs(one).max()),
                  "gate_shard": list(gate.addressable_shards[0].data.shape), "experts_same": same[1],
                  "reduce_scatters": hlo.count("reduce-scatter("), "all_gathers": hlo.count("all-gather("),
                  "sorts": sort_sizes(hlo), "rows_sorts": sort_sizes(compiled_rows.as_text()), "rows_diff": rows_diff,
                  "experts_rows_shard": list(runs[1].experts_BxLxSxK.addressable_shards[0].data.shape)}))
"""


def test_experts_split_over_the_expert_axis_give_the_one_device_logits_and_routing():
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MESH_CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Mesh fsdp=2 x expert=2 x tensor=2: [E, D, I] = [4, 16, 12] split E / expert, D / fsdp, I / tensor.
    assert result["gate_shard"] == [2, 8, 6]
    # The tokens travel, not the experts: each of the 2 sparse layers gathers its expert group's
    # tokens (and their experts and weights) and reduce-scatters the outputs back.
    assert result["reduce_scatters"] >= 2 and result["all_gathers"] >= 2, result
    # Each device sorts the (token, choice) pairs of its expert group only: 4 rows x 7 tokens over
    # fsdp 2 x expert 2 are 7 tokens a device, 14 a group, 28 pairs (top-2). Without an expert axis
    # (data 2 x fsdp 2 x tensor 2) its own 7 tokens' 14 pairs, not the batch's 56.
    assert result["sorts"] == [28] and result["rows_sorts"] == [14], result
    assert result["rows_diff"] <= 1e-4 * result["scale"]
    # The recorded experts [B, L, S, K] = [4, 2, 11, 2] come back with their rows split over fsdp x expert.
    assert result["experts_same"] and result["experts_rows_shard"] == [1, 2, 11, 2]
    # Sharded matmuls sum the same products in another order (tests/tolerances.py FORWARD_REL_ERR).
    assert result["diff"] <= 1e-4 * result["scale"]


def _moe_run(tmp_path, devices: int) -> dict:
    out = tmp_path / f"moe{devices}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "moe_devices_check.py"), str(out),
                           str(tmp_path / out.stem)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two subprocess training runs (~20 s and ~35 s); CI runs it with the slow tests
def test_moe_trains_on_eight_devices_with_experts_split_as_on_one_device(tmp_path):
    one, eight = _moe_run(tmp_path, 1), _moe_run(tmp_path, 8)
    assert eight["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    # [E, D, I] = [8, 32, 24]: each device holds 4 experts, half of D (fsdp), half of I (tensor).
    assert one["expert_gate_shard"] == [8, 32, 24] and eight["expert_gate_shard"] == [4, 16, 12]
    assert len(eight["history"]) == len(one["history"]) == 3
    for got, want in zip(eight["history"], one["history"]):
        # The same answers sampled (the same tokens, so the same rewards and lengths) ...
        for k in ("reward", "completions/mean_length", "data_position"):
            assert got[k] == want[k], (got["step"], k)
        # ... and the same update, to the reordered sums' rounding (tests/tolerances.py).
        for k in ("loss", "kl", "grad_norm", "entropy"):
            assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)


_ADAPTER_MESH_CHECK = """
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
sys.path.insert(0, "tests")
from grpo_jax.distributed.sharding import make_mesh, param_shardings
from grpo_jax.model import init_model, lora
from test_qwen3_moe import TINY
params = nnx.to_pure_dict(nnx.state(init_model(TINY, 0), nnx.Param))
adapters = lora.init_adapters(params, lora.resolve_targets(["experts"]), 2, jax.random.key(1))
adapters = jax.tree.map(lambda x: x + 0.5, adapters)  # B != 0
one = lora.merge(params, adapters, 2.0)
mesh = make_mesh(data=1, fsdp=2, tensor=2, expert=2)
with jax.set_mesh(mesh):
    p = jax.device_put(params, param_shardings(mesh, params))
    a = jax.device_put(adapters, param_shardings(mesh, adapters))
    many = jax.jit(lambda a, p: lora.merge(p, a, 2.0), out_shardings=param_shardings(mesh, params))(a, p)
mlp = a["layers"]["0"]["mlp"]
shard = lambda x: list(x.addressable_shards[0].data.shape)
print(json.dumps({"gate_a": shard(mlp["expert_gate"]["lora_a"]), "gate_b": shard(mlp["expert_gate"]["lora_b"]),
                  "down_a": shard(mlp["expert_down"]["lora_a"]), "down_b": shard(mlp["expert_down"]["lora_b"]),
                  "merged_gate": shard(many["layers"][0]["mlp"]["expert_gate"]),
                  "equal": all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(many)))}))
"""


def test_expert_adapters_split_like_their_weights_and_merge_as_on_one_device():
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _ADAPTER_MESH_CHECK], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # fsdp 2 x expert 2 x tensor 2; E 4, D 16, I 12, r 2. expert_gate [E, D, I] splits E / expert,
    # D / fsdp, I / tensor: its A [E, D, r] splits E and D as the weight does, its B [E, r, I] E and
    # I; expert_down [E, I, D]'s A [E, I, r] E and I, its B [E, r, D] E and D. The rank stays whole.
    assert (result["gate_a"], result["gate_b"]) == ([2, 8, 2], [2, 2, 6])
    assert (result["down_a"], result["down_b"]) == ([2, 6, 2], [2, 2, 8])
    assert result["merged_gate"] == [2, 8, 6]
    # Each merged entry is the same r = 2 products on every layout (the rank is never split): bit-equal.
    assert result["equal"]


@pytest.mark.parity
def test_parity_transformers_loads_our_export_with_a_fresh_config(tmp_path):
    # No source config: the export writes num_experts (Qwen's spelling), which transformers 5 reads
    # into its num_local_experts; the same weights in, the same logits out (measured: bit-equal).
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(FIXTURE.parent))
    import make_hf_fixtures

    out = hf.save_model(hf.load_model(FIXTURE), tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected = np.load(FIXTURE / "expected.npz")
    logits = make_hf_fixtures.hf_logits(reloaded, expected["tokens_BxT"], expected["mask_BxT"])
    real = expected["mask_BxT"].astype(bool)
    np.testing.assert_allclose(logits[real], expected["logits_BxTxV"][real], atol=1e-5)


# ---------------------------------------------------------------- the rest of the stack on a MoE model

def _sharpened_tiny():
    # Random init routes near-uniformly; larger weights give decided, token-dependent routing.
    graphdef, params = nnx.split(init_model(TINY, 0), nnx.Param)
    params = jax.tree.map(lambda p: p * 10.0 if p.ndim > 1 else p, params)
    return graphdef, params


def test_cached_decode_and_the_sampler_agree_with_the_full_forward():
    from grpo_jax.sampling import ops, static
    from grpo_jax.sampling import sampler as S
    from full_forward import full_forward

    graphdef, params = _sharpened_tiny()
    # Two prompts left padded to 6, 4 completion tokens teacher-forced through prefill + decode_step.
    tokens = np.array([[0, 0, 0, 5, 9, 3], [7, 1, 4, 8, 6, 11]], np.int32)
    mask = (tokens > 0).astype(np.int32)
    forced = np.array([[3, 14, 27, 1], [20, 20, 5, 9]], np.int32)
    state = static.prefill(graphdef, params, tokens, mask, num_samples=1, max_new_tokens=4)
    cached, caches = [np.asarray(state.logits_BxV)], state.caches
    step = jax.jit(lambda pr, caches, km, tok, pos, w: ops.decode_step(graphdef, pr, caches, km, tok, pos, w))
    for i in range(3):
        logits, caches = step(params, caches, state.key_mask_BxS, forced[:, i], state.positions_B + i, 6 + i)
        cached.append(np.asarray(logits))
    full = np.asarray(full_forward(graphdef, params, np.concatenate([tokens, forced], 1),
                                   np.concatenate([mask, np.ones_like(forced)], 1)))[:, 5:9]
    # One token at a time routes each token as the whole sequence does (routing is per token);
    # the attention sums in another order (tests/tolerances.py FORWARD_REL_ERR, |logits| ~ 10).
    np.testing.assert_allclose(np.stack(cached, 1), full, rtol=1e-4, atol=1e-4 * np.abs(full).max())
    # Both engines' greedy answers are the full forward's argmax, token by token.
    for engine in ("static", "continuous"):
        sampler = S.Sampler(graphdef, TINY, eos_id=2, pad_id=0, engine=engine, decode_slots=2)
        out = sampler(params, [[5, 9, 3], [7, 1, 4, 8, 6, 11]], num_samples=2,
                      sampling=S.SamplingConfig(max_new_tokens=5, greedy=True, ignore_eos=True),
                      rng=jax.random.key(0))
        all_tokens = jnp.concatenate([out.prompt_tokens_BxP, out.tokens_BxC], axis=1)
        all_mask = jnp.concatenate([out.prompt_mask_BxP, jnp.ones_like(out.tokens_BxC)], axis=1)
        p = out.prompt_tokens_BxP.shape[1]
        greedy = np.asarray(full_forward(graphdef, params, all_tokens, all_mask))[:, p - 1 : p + 4].argmax(-1)
        np.testing.assert_array_equal(out.tokens_BxC, greedy, err_msg=engine)


def test_shared_prompt_log_probs_and_remat_gradients_equal_the_plain_ones():
    from grpo_jax.model import token_logprobs

    graphdef, params = _sharpened_tiny()
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 40, (4, 10)), jnp.int32)
    tokens = tokens.at[:, :6].set(tokens[::2, :6].repeat(2, axis=0))  # pairs of rows share a prompt
    mask = jnp.ones_like(tokens)

    def grads(graphdef, group_size):
        loss = lambda p: token_logprobs(graphdef, p, tokens, mask, num_targets=4, group_size=group_size).sum()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    (plain, g_plain), (shared, g_shared) = grads(graphdef, 1), grads(graphdef, 2)
    # The shared layout computes the same products in another grouping (FORWARD_REL_ERR, GRAD_REL_ERR).
    np.testing.assert_allclose(shared, plain, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * np.abs(b).max()),
                 g_shared, g_plain)
    remat_graphdef, _ = nnx.split(init_model(dataclasses.replace(TINY, remat="dots"), 0), nnx.Param)
    value, g_remat = grads(remat_graphdef, 1)
    # Remat replays the same computation: bit-equal.
    assert float(value) == float(plain)
    jax.tree.map(np.testing.assert_array_equal, g_remat, g_plain)


def test_lora_all_linear_adapts_attention_and_the_dense_layer_not_the_experts():
    from grpo_jax.model import lora

    params = _params(init_model(TINY, 0))
    adapters = lora.init_adapters(params, lora.resolve_targets(["all-linear"]), 2, jax.random.key(0))
    assert sorted(adapters["layers"]["1"]["mlp"]) == ["down_proj", "gate_proj", "up_proj"]  # the dense layer
    assert "mlp" not in adapters["layers"]["0"] and "mlp" not in adapters["layers"]["2"]
    merged = lora.merge(params, adapters, 1.0)
    np.testing.assert_array_equal(merged["layers"][0]["mlp"]["expert_gate"], params["layers"][0]["mlp"]["expert_gate"])


# ---------------------------------------------------------------- LoRA on the experts

def test_expert_adapters_merge_per_expert_worked_example():
    # Two experts, each a [in 2, out 1] matrix of zeros; rank 1, alpha / r = 2.
    # Expert 0: A = [[1], [0]], B = [[3]] -> W'[0] = 2 * [[3], [0]] = [[6], [0]].
    # Expert 1: A = [[0], [1]], B = [[5]] -> W'[1] = 2 * [[0], [5]] = [[0], [10]].
    # One shared A @ B (E folded into the input) would mix the experts; per-expert products do not.
    from grpo_jax.model import lora

    base = {"layers": {0: {"mlp": {"expert_up": jnp.zeros((2, 2, 1))}}}}
    adapters = {"layers": {"0": {"mlp": {"expert_up": {"lora_a": jnp.asarray([[[1.0], [0.0]], [[0.0], [1.0]]]),
                                                       "lora_b": jnp.asarray([[[3.0]], [[5.0]]])}}}}}
    merged = lora.merge(base, adapters, scale=2.0)["layers"][0]["mlp"]["expert_up"]
    np.testing.assert_array_equal(merged, [[[6.0], [0.0]], [[0.0], [10.0]]])


def test_expert_targets_are_named_and_their_adapters_are_per_expert():
    from grpo_jax.model import lora

    assert lora.resolve_targets(["experts"]) == ("expert_gate", "expert_up", "expert_down")
    assert lora.resolve_targets(["attention", "expert_down", "router"]) == (
        "q_proj", "k_proj", "v_proj", "o_proj", "expert_down", "router")
    params = _params(init_model(TINY, 0))  # E 4, D 16, I 12; layer 1 dense
    adapters = lora.init_adapters(params, lora.resolve_targets(["experts"]), 2, jax.random.key(0))
    mlp = adapters["layers"]["0"]["mlp"]
    assert mlp["expert_gate"]["lora_a"].shape == (4, 16, 2) and mlp["expert_gate"]["lora_b"].shape == (4, 2, 12)
    assert mlp["expert_down"]["lora_a"].shape == (4, 12, 2) and mlp["expert_down"]["lora_b"].shape == (4, 2, 16)
    assert sorted(adapters["layers"]) == ["0", "2"] and "router" not in mlp  # the dense layer 1 has no experts
    # Kaiming bound 1 / sqrt(one expert's fan-in), not of E * fan-in.
    assert float(jnp.abs(mlp["expert_down"]["lora_a"]).max()) <= 1 / math.sqrt(12)
    # Shardings follow the weight's: E on "expert" as the weight's E, A's input and B's output as its.
    specs = partition_specs(adapters)["layers"]["0"]["mlp"]
    assert tuple(specs["expert_gate"]["lora_a"]) == ("expert", "fsdp", None)
    assert tuple(specs["expert_gate"]["lora_b"]) == ("expert", None, "tensor")
    assert tuple(specs["expert_down"]["lora_a"]) == ("expert", "tensor", None)
    assert tuple(specs["expert_down"]["lora_b"]) == ("expert", None, "fsdp")


def test_attention_targets_make_no_expert_adapter():
    from grpo_jax.model import lora

    adapters = lora.init_adapters(_params(init_model(TINY, 0)), lora.resolve_targets(["attention"]), 2,
                                  jax.random.key(0))
    assert all(sorted(layer) == ["attn"] for layer in adapters["layers"].values())


def test_expert_adapters_with_zero_b_give_the_base_logits_bit_for_bit():
    from grpo_jax.model import lora

    graphdef, params = nnx.split(init_model(TINY, 0), nnx.Param)
    adapters = lora.init_adapters(params, lora.resolve_targets(["experts", "all-linear"]), 2, jax.random.key(1))
    assert float(jnp.abs(adapters["layers"]["0"]["mlp"]["expert_up"]["lora_a"]).min()) > 0
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 7)), jnp.int32)
    base_logits, base_routing = _routing(graphdef, params, tokens)
    logits, routing = _routing(graphdef, lora.merge(params, adapters, 16.0), tokens)
    np.testing.assert_array_equal(logits, base_logits)
    jax.tree.map(np.testing.assert_array_equal, routing, base_routing)


def test_expert_adapters_merge_to_w_plus_scale_a_b_for_every_expert():
    from grpo_jax.model import lora

    params = _params(init_model(TINY, 0))
    adapters = lora.init_adapters(params, lora.resolve_targets(["experts"]), 2, jax.random.key(1))
    rng = np.random.default_rng(2)
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), jnp.float32) if path[-1].key == "lora_b" else x,
        adapters)
    merged = lora.merge(params, adapters, 4.0)
    for layer in (0, 2):
        for name in ("expert_gate", "expert_up", "expert_down"):
            w = np.asarray(params["layers"][layer]["mlp"][name], np.float64)
            pair = adapters["layers"][str(layer)]["mlp"][name]
            a, b = np.asarray(pair["lora_a"], np.float64), np.asarray(pair["lora_b"], np.float64)
            for e in range(4):
                # float32 W + 4 * (A @ B) with r = 2: two rounded products, one sum, one scale, one add
                # (each <= u = 6e-8 relative) against float64: <= 5u * (|W| + 4 |A| |B|) ~ 3e-7 * 10.
                np.testing.assert_allclose(merged["layers"][layer]["mlp"][name][e], w[e] + 4.0 * a[e] @ b[e],
                                           rtol=1e-6, atol=3e-6)
    np.testing.assert_array_equal(merged["layers"][0]["mlp"]["router"], params["layers"][0]["mlp"]["router"])
    np.testing.assert_array_equal(merged["layers"][1]["mlp"]["up_proj"], params["layers"][1]["mlp"]["up_proj"])


def test_a_gradient_step_on_expert_adapters_changes_only_the_experts():
    # The policy is merge(base, adapters): a step on the adapters moves the targeted expert
    # weights and leaves the base, the router, the attention and the dense layer bit-equal.
    from grpo_jax.model import lora

    graphdef, params = nnx.split(init_model(TINY, 0), nnx.Param)
    spec = lora.LoraSpec(rank=2, scale=2.0, targets=lora.resolve_targets(["experts"]))
    adapters = lora.init_adapters(params, spec.targets, spec.rank, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 7)), jnp.int32)
    mask = jnp.ones_like(tokens)

    def loss(adapters, base):
        return _lm_loss(spec.model_params(adapters, base), graphdef, tokens, mask, 0.001)[0]

    base_before = jax.tree.map(np.array, params)
    value, grads = jax.jit(jax.value_and_grad(loss))(adapters, params)
    # B = 0 at the start: dL/dA = scale * dL/dW @ B^T = 0, dL/dB = scale * A^T @ dL/dW != 0.
    assert float(jnp.abs(grads["layers"]["0"]["mlp"]["expert_up"]["lora_a"]).max()) == 0
    assert float(jnp.abs(grads["layers"]["0"]["mlp"]["expert_up"]["lora_b"]).max()) > 0
    stepped = jax.tree.map(lambda a, g: a - 0.5 * g, adapters, grads)
    jax.tree.map(np.testing.assert_array_equal, params, base_before)
    before, after = nnx.to_pure_dict(params), nnx.to_pure_dict(spec.model_params(stepped, params))
    for path, leaf in jax.tree_util.tree_flatten_with_path(after)[0]:
        name = path[-1].key
        same = np.array_equal(leaf, _at(before, path))
        assert same == (name not in ("expert_gate", "expert_up", "expert_down")), jax.tree_util.keystr(path)
    assert float(jax.jit(loss)(stepped, params)) < float(value)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_peft_export_names_attention_and_dense_adapters_and_refuses_expert_ones(tmp_path):
    from grpo_jax.io import peft
    from grpo_jax.model import lora

    params = _params(init_model(TINY, 0))
    adapters = lora.init_adapters(params, lora.resolve_targets(["all-linear"]), 2, jax.random.key(0))
    names = peft.peft_state_dict(adapters)
    assert len(names) == 2 * (3 * 4 + 3)  # A and B of q/k/v/o in 3 layers, gate/up/down in dense layer 1
    assert names["base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"].shape == (2, 16)  # [r, D]
    assert names["base_model.model.model.layers.2.self_attn.o_proj.lora_B.weight"].shape == (16, 2)  # [D, r]
    spec = lora.LoraSpec(rank=2, scale=1.0, targets=lora.resolve_targets(["attention", "experts"]))
    adapters = lora.init_adapters(params, spec.targets, 2, jax.random.key(0))
    out = tmp_path / "peft"
    with pytest.raises(ValueError, match=r"\['expert_down', 'expert_gate', 'expert_up'\].*export the merged weights"):
        peft.save_peft(adapters, out, spec=spec, alpha=2.0, base_model=None)
    assert not out.exists()  # refused before any file


def test_config_refuses_expert_adapters_where_a_peft_directory_would_be_written(tmp_path):
    from grpo_jax.config import Config, ConfigError, LoraSection, SamplingSection, TrainSection

    lora_cfg = LoraSection(r=4, target_modules=("attention", "experts"))
    with pytest.raises(ConfigError, match=r"adapts \['expert_gate', 'expert_up', 'expert_down'\].*"
                                          "train.export_peft=false"):
        Config(lora=lora_cfg, train=TrainSection(export_hf=True))
    with pytest.raises(ConfigError, match="sampling.engine=vllm"):
        Config(lora=lora_cfg, sampling=SamplingSection(engine="vllm"))
    Config(lora=lora_cfg, train=TrainSection(export_hf=True, export_peft=False))  # the merged weights only
    Config(lora=LoraSection(r=4, target_modules=("all-linear",)), train=TrainSection(export_hf=True))


def test_check_counts_expert_adapters_of_the_fixture():
    # `check` on the fixture's config.json (whose "eos_token_id": null, as transformers 5 writes it,
    # once crashed the stop-id read). Rank 2 on attention and experts, by hand: D 32, 4 heads and 2 kv
    # heads of 16, E 8, I 24, layers 0 and 2 sparse. Per layer q 32*2 + 2*64 = 192, k and v
    # 64 + 2*32 = 128 each, o 64*2 + 2*32 = 192: 640, x3 = 1920. Per sparse layer each of gate, up,
    # down 8 * (2*32 + 2*24) = 896: 2688, x2 = 5376. Total 7296.
    from grpo_jax.cli import check as check_command
    from grpo_jax.config import LoraSection, ModelSection
    from test_train import tiny_config

    symbols = "".join(chr(c) for c in range(32, 127) if chr(c) != "~")
    cfg = dataclasses.replace(tiny_config("/tmp/unused"),
                              model=ModelSection(hf_path=str(FIXTURE), tokenizer=f"char:{symbols}"),
                              lora=LoraSection(r=2, target_modules=("attention", "experts")))
    figures = check_command.check(cfg, devices=1, compile_programs=False)
    assert figures["model"]["trainable_params"] == 7296


@pytest.mark.slow
def test_grpo_with_expert_adapters_trains_the_experts_and_exports_merged_weights_only(tmp_path):
    # The trainer end to end on the fixture (~40 s on CPU): adapters per expert, the router frozen,
    # run_dir/hf written with the merged experts and no run_dir/peft (train.export_peft=false).
    from grpo_jax.config import LoraSection, ModelSection
    from grpo_jax.training import train
    from test_train import SevensTask, tiny_config

    symbols = "".join(chr(c) for c in range(32, 127) if chr(c) != "~")  # 94 + eos + pad = vocab 96
    cfg = tiny_config(tmp_path / "run", export_hf=True, export_peft=False)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2),
                              model=ModelSection(hf_path=str(FIXTURE), tokenizer=f"char:{symbols}"),
                              lora=LoraSection(r=2, target_modules=("attention", "experts")))
    result = train.run(cfg, task=SevensTask())
    assert result.params["layers"]["0"]["mlp"]["expert_down"]["lora_a"].shape == (8, 24, 2)
    base, out = hf.load_model(FIXTURE), hf.load_model(tmp_path / "run" / "hf")
    assert not np.array_equal(base.layers[0].mlp.expert_gate[...], out.layers[0].mlp.expert_gate[...])
    np.testing.assert_array_equal(base.layers[0].mlp.router[...], out.layers[0].mlp.router[...])
    assert not (tmp_path / "run" / "peft").exists()


def test_bfloat16_load_and_save_round_trip(tmp_path):
    model = hf.load_model(FIXTURE, dtype="bfloat16")
    assert model.layers[0].mlp.expert_gate[...].dtype == jnp.bfloat16
    back = hf.load_model(hf.save_model(model, tmp_path / "bf16"), dtype="bfloat16")
    jax.tree.map(np.testing.assert_array_equal, _params(back), _params(model))


def test_the_sampler_records_the_experts_that_token_logprobs_replays():
    from grpo_jax.model import token_logprobs
    from grpo_jax.sampling import sampler as S

    graphdef, params = _sharpened_tiny()
    sampling = S.SamplingConfig(max_new_tokens=4, greedy=True, ignore_eos=True, record_experts=True)
    sampler = S.Sampler(graphdef, TINY, eos_id=2, pad_id=0, prompt_buckets=(8,))
    out = sampler(params, [[5, 9, 3], [7, 1, 4, 8, 6, 11]], num_samples=2, sampling=sampling, rng=jax.random.key(0))
    experts = np.asarray(out.experts_BxLxSxK)
    assert experts.shape == (4, 2, 12, 2)  # 2 prompts x 2 samples, 2 sparse layers, P + C = 8 + 4 slots, top-2
    all_tokens = jnp.concatenate([out.prompt_tokens_BxP, out.tokens_BxC], axis=1)
    all_mask = jnp.concatenate([out.prompt_mask_BxP, out.mask_BxC], axis=1)
    # The full forward routes every real token to the experts the sampler recorded (prompt tokens
    # in the prefill, completion tokens one decode step at a time).
    logits, routing = _routing(graphdef, params, all_tokens, all_mask)
    real = np.asarray(all_mask).astype(bool)
    per_token = lambda x_BxLxSxK: np.moveaxis(np.asarray(x_BxLxSxK), 1, 2)[real]  # noqa: E731
    assert np.array_equal(per_token(np.stack(routing.expert_indices, 1)), per_token(experts))
    # Replaying the recorded experts gives that forward exactly at every real token (a padding
    # slot's experts are whatever its masked-out state chose, in the prefill or here; attention
    # never reads it), and its argmax is the greedy sample.
    replayed, _ = _routing(graphdef, params, all_tokens, all_mask, tuple(np.moveaxis(experts, 1, 0)))
    assert np.array_equal(np.asarray(replayed)[real], np.asarray(logits)[real])
    np.testing.assert_array_equal(np.asarray(replayed)[:, 7:11].argmax(-1), np.asarray(out.tokens_BxC))
    # token_logprobs replays them too, per row and in the shared-prompt layout (pairs of rows share
    # a prompt): the same experts at every real token, so the same log-probs bit for bit.
    for group_size in (1, 2):
        def logp(experts):
            return token_logprobs(graphdef, params, all_tokens, all_mask, num_targets=4, group_size=group_size,
                                  expert_indices_BxLxSxK=experts)

        plain = jax.jit(logp)(None)
        assert np.array_equal(np.asarray(jax.jit(logp)(jnp.asarray(experts))), np.asarray(plain))
        other = jax.jit(logp)(jnp.asarray((experts + 1) % TINY.num_experts))
        assert not np.allclose(np.asarray(other), np.asarray(plain))
    with pytest.raises(ValueError, match="record_experts needs Sampler engine='static'"):
        S.Sampler(graphdef, TINY, eos_id=2, pad_id=0, engine="continuous")(
            params, [[5, 9, 3]], num_samples=1, sampling=sampling, rng=jax.random.key(0))
