"""Routing replay in the trainer (`off_policy.router_replay="R3"`): the experts the sampler routed each
token to travel with the batch into every log-prob pass and the update's forward.

The worked example: a sampling engine whose router computes its logits slightly differently from the
trainer's (here: the same weights plus a fixed perturbation of every router matrix, as an engine with
other gating kernels or precision would). With one expert per token and `norm_topk_prob` the mixing
weight is p_e / p_e = 1 exactly, so the perturbation changes *which* expert runs and nothing else:
the only difference between sampler and trainer is routing. Replaying the sampler's experts then
gives the sampler's log-probs up to the forward's float rounding, and the sampler correction's
metrics (`sampling/sampling_logp_difference/*`) drop from the routing difference to ~0.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.config import (Config, ConfigError, EvalSection, GRPOSection, ModelSection, OffPolicySection,
                             OptimSection, RewardsSection, SamplingSection, TaskSection, TrainSection)
from grpo_jax.core import losses
from grpo_jax.model import ModelConfig, init_model
from grpo_jax.sampling import sampler as S
from grpo_jax.training import rollout, run_context, step_loss, train
from grpo_jax.training import step as step_lib
from grpo_jax.training.update_batch import UpdateBatch
from test_train import SevensTask
from tolerances import FORWARD_REL_ERR

# Two sparse layers (0 and 2) of 4 experts, one per token; layer 1 dense (as tests/test_qwen3_moe.py's TINY).
ONE_EXPERT = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
                         num_kv_heads=1, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=1,
                         moe_intermediate_size=12, norm_topk_prob=True, mlp_only_layers=(1,))
C = 6  # completion tokens
TESTS = pathlib.Path(__file__).parent


def skewed_router(params, sigma: float):
    """`params` with sigma * a fixed pseudo-random matrix added to every router [D, E]: the engine
    that routes differently. Other weights are untouched."""

    def skew(path, x):
        if "router" not in jax.tree_util.keystr(path):
            return x
        return x + sigma * jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * 12.9898).reshape(x.shape)

    return jax.tree_util.tree_map_with_path(skew, params)


def _sharpened(config):
    # Random init routes near-uniformly; larger weights give decided, token-dependent routing.
    graphdef, params = nnx.split(init_model(config, 0), nnx.Param)
    return graphdef, jax.tree.map(lambda p: p * 10.0 if p.ndim > 1 else p, params)


def _rollout(graphdef, params, config, sigma: float):
    """8 answers (2 prompts x 4) sampled with the router skewed by sigma, recording experts."""
    sampler = S.Sampler(graphdef, config, eos_id=2, pad_id=0, prompt_buckets=(8,), engine="static")
    sampling = S.SamplingConfig(max_new_tokens=C, record_experts=True)
    out = sampler(skewed_router(params, sigma), [[5, 9, 3], [7, 1, 4, 8, 6, 11]], num_samples=4,
                  sampling=sampling, rng=jax.random.key(0))
    tokens = jnp.concatenate([out.prompt_tokens_BxP, out.tokens_BxC], axis=1)
    attention = jnp.concatenate([out.prompt_mask_BxP, out.mask_BxC], axis=1)
    experts = jnp.asarray(rollout.token_major_experts(np.asarray(out.experts_BxLxSxK)))
    return out, tokens, attention, experts


def test_replay_gives_the_sampler_log_probs_and_the_correction_metrics_show_the_routing_difference():
    graphdef, params = _sharpened(ONE_EXPERT)
    out, tokens, attention, experts = _rollout(graphdef, params, ONE_EXPERT, sigma=0.5)
    real = np.asarray(out.mask_BxC) > 0
    sampler_logp = np.asarray(out.logprobs_BxC)
    assert experts.shape == (8, 8 + C, 2, 1)  # [B, P + C, L_sparse, K], token slots on axis 1 as the tokens'
    assert experts.dtype == jnp.int16  # rollout.EXPERTS_DTYPE: half the bytes of the sampler's int32
    # The trainer's own router routes some of these tokens elsewhere: the skew is really a routing difference.
    own = np.asarray(step_loss.layer_major(experts))  # [B, L, S, K]
    from grpo_jax.model import moe
    _, routing = jax.jit(moe.forward_with_routing, static_argnums=0)(graphdef, params, tokens, attention)
    rerouted = np.stack(routing.expert_indices, axis=1) != own
    completion_rerouted = rerouted[:, :, 8:][np.broadcast_to(real[:, None, :, None], rerouted[:, :, 8:].shape)]
    assert 0 < completion_rerouted.mean() < 1

    # pi_old as the trainer computes it (the log-prob pass), per row and with shared prompts (G = 4).
    # Error argument for replay on: the same experts with mixing weight exactly 1, so the two sides
    # differ only in the order a prefill + one-token decode steps and one full forward sum the same
    # products (tests/tolerances.py FORWARD_REL_ERR, relative to the largest |log-prob|).
    tol = FORWARD_REL_ERR * np.abs(sampler_logp[real]).max()
    for group_size, row_chunks in ((1, 2), (4, 1)):  # rows in two chunks of a scan; prompts shared
        logprob_fn = step_lib.make_logprob_fn(graphdef, 1.0, group_size=group_size, row_chunks=row_chunks)
        replayed = np.asarray(logprob_fn(params, tokens, attention, num_targets=C, experts=experts))
        np.testing.assert_allclose(replayed[real], sampler_logp[real], rtol=0, atol=tol)

    # The loss's sampler-correction metrics (pi_old in the loss: one update per batch), prompts shared.
    # Without replay the rerouted tokens' log-probs move by far more than rounding.
    grpo = GRPOSection(num_generations=4, prompts_per_step=2)
    loss_fn = step_loss.make_loss_fn(graphdef, grpo, 1.0, 4)
    mask = out.mask_BxC.astype(jnp.int32)
    advantages = jnp.asarray([1.0, -1.0, 0.5, -0.5] * 2, jnp.float32)
    normalizer = losses.loss_normalizer(mask, grpo.resolved_aggregation(), max_len=C)
    metrics = {}
    for name, replay in (("on", experts), ("off", None)):
        mb = UpdateBatch(tokens=tokens, attention=attention, completion_mask=mask, advantages=advantages,
                         old_logp=None, sampler_logp=out.logprobs_BxC, ref_logp=None, experts=replay)
        metrics[name] = {k: float(v) for k, v in jax.jit(loss_fn)(params, mb, normalizer)[1][0].items()}
    on, off = metrics["on"], metrics["off"]
    print({k: (on[k], off[k]) for k in on if k.startswith("sampling/")})
    assert on["sampling/sampling_logp_difference/max"] <= tol
    # Sequence weights are exp(sum of <= 6 differences), each <= tol: 1 within 6 * tol (and e^x ~ 1 + x).
    assert abs(on["sampling/importance_sampling_ratio/mean"] - 1.0) <= 6 * tol * 1.01
    assert on["sampling/importance_sampling_masked_fraction"] == 0.0
    assert off["sampling/sampling_logp_difference/max"] > 100 * tol
    assert off["sampling/sampling_logp_difference/mean"] > 100 * on["sampling/sampling_logp_difference/mean"]


def test_the_update_trains_the_router_through_the_replayed_experts():
    # Two experts per token (norm_topk_prob): the mixing weights p_e / (p_e + p_e') at the replayed
    # experts depend on the router, so it gets a gradient; experts nobody was routed to get none.
    config = dataclasses.replace(ONE_EXPERT, num_experts_per_tok=2)
    graphdef, params = _sharpened(config)
    out, tokens, attention, experts = _rollout(graphdef, params, config, sigma=0.5)
    # Replay a routing the trainer's router would never choose: every token to experts 0 and 1.
    forced = jnp.broadcast_to(jnp.asarray([0, 1], jnp.int32), experts.shape)
    grpo = GRPOSection(num_generations=4, prompts_per_step=2)
    loss_fn = step_loss.make_loss_fn(graphdef, grpo, 1.0, 1)
    mask = out.mask_BxC.astype(jnp.int32)
    mb = UpdateBatch(tokens=tokens, attention=attention, completion_mask=mask,
                     advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5] * 2, jnp.float32), old_logp=None,
                     sampler_logp=out.logprobs_BxC, ref_logp=None, experts=forced)
    normalizer = losses.loss_normalizer(mask, grpo.resolved_aggregation(), max_len=C)
    grads = jax.jit(jax.grad(lambda p: loss_fn(p, mb, normalizer)[0]))(params)
    for layer in (0, 2):
        mlp = nnx.to_pure_dict(grads)["layers"][layer]["mlp"]
        assert np.isfinite(np.asarray(mlp["router"])).all() and np.abs(np.asarray(mlp["router"])).max() > 0
        norms = np.abs(np.asarray(mlp["expert_gate"])).sum(axis=(1, 2))
        assert (norms[:2] > 0).all() and (norms[2:] == 0).all(), norms


# ---------------------------------------------------------------- configuration


def test_replay_is_refused_where_no_engine_records_experts_or_the_model_has_none():
    with pytest.raises(ConfigError, match=r"off_policy.router_replay='R3' with sampling.engine='continuous'"):
        Config(sampling=SamplingSection(engine="continuous"), off_policy=OffPolicySection(router_replay="R3"))
    with pytest.raises(ConfigError, match=r"sampling.engine='vllm'"):
        Config(sampling=SamplingSection(engine="vllm"), off_policy=OffPolicySection(router_replay="R3"))
    # "auto" picks the continuous engine for long answers: named in the message.
    with pytest.raises(ConfigError, match=r"'auto' picks 'continuous' for sampling.max_new_tokens=512"):
        Config(sampling=SamplingSection(max_new_tokens=512), off_policy=OffPolicySection(router_replay="R3"))
    with pytest.raises(ConfigError, match=r"task.tools set"):
        Config(task=TaskSection(tools=("math:sqrt",)), off_policy=OffPolicySection(router_replay="R3"))
    with pytest.raises(ConfigError, match=r"'R2' .* is not implemented"):
        OffPolicySection(router_replay="R2").validate()
    Config(off_policy=OffPolicySection(router_replay="R3"))  # static engine (auto, 8 tokens): accepted
    dense = dataclasses.replace(ONE_EXPERT, num_experts=0, num_experts_per_tok=0)
    with pytest.raises(ConfigError, match=r"off_policy.router_replay='R3' on a dense model"):
        run_context.check_router_replay(Config(off_policy=OffPolicySection(router_replay="R3")), dense)
    run_context.check_router_replay(Config(), dense)


# ---------------------------------------------------------------- the training loop


class SkewedEngine:
    """The trainer's static sampler called with its router skewed (`skewed_router`)."""

    def __init__(self, inner, sigma):
        self.inner, self.sigma, self.mesh = inner, sigma, inner.mesh

    def __call__(self, params, prompts, **kwargs):
        return self.inner(skewed_router(params, self.sigma), prompts, **kwargs)


def write_one_expert_checkpoint(path) -> str:
    """ONE_EXPERT (sharpened, 14 tokens: the char tokenizer's) as a Hugging Face checkpoint."""
    from grpo_jax.io import hf
    from grpo_jax.io.tokenizer import load_tokenizer

    model = init_model(dataclasses.replace(ONE_EXPERT, vocab_size=14), 0)
    _, params = nnx.split(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * 10.0 if p.ndim > 1 else p, params))  # decided routing
    return str(hf.save_model(model, path, tokenizer=load_tokenizer("char:0123456789+=")))


@pytest.fixture
def one_expert_checkpoint(tmp_path):
    return write_one_expert_checkpoint(tmp_path / "moe")


def run_skewed(run_dir, hf_path, replay: str, monkeypatch, steps: int = 2, **grpo):
    """`train.run` of SevensTask on the checkpoint, its sampler's router skewed (`SkewedEngine`)."""
    build = run_context.build_sampler
    monkeypatch.setattr(run_context, "build_sampler", lambda *a, **k: SkewedEngine(build(*a, **k), 0.5))
    config = Config(
        model=ModelSection(hf_path=hf_path, tokenizer="char:0123456789+="),
        sampling=SamplingSection(max_new_tokens=4, engine="static"),
        grpo=GRPOSection(prompts_per_step=2, num_generations=4, **grpo),
        off_policy=OffPolicySection(router_replay=replay),
        optim=OptimSection(learning_rate=1e-3),
        eval=EvalSection(every=0, num_questions=0),
        train=TrainSection(steps=steps, seed=3, run_dir=str(run_dir), checkpoint_every=0, samples_every=0,
                           progress=False),
        rewards=RewardsSection(truncated_reward="as_scored"),
    )
    return train.run(config, task=SevensTask()).history


@pytest.mark.slow
def test_training_with_replay_on_and_off(tmp_path, one_expert_checkpoint, monkeypatch):
    # R3 through every pass: a reference (beta > 0), pi_old recomputed before two updates (two
    # minibatches), length buckets on; then the same run without replay. ~50 s on a 2-core CPU.
    on = run_skewed(tmp_path / "on", one_expert_checkpoint, "R3", monkeypatch, beta=0.04, num_minibatches=2,
              bucket_by_length="on")
    off = run_skewed(tmp_path / "off", one_expert_checkpoint, "disabled", monkeypatch, beta=0.04, num_minibatches=2,
               bucket_by_length="on")
    assert len(on) == len(off) == 2
    key = "sampling/sampling_logp_difference/max"
    print([(row[key], row["sampling/sampling_logp_difference/mean"]) for row in on],
          [(row[key], row["sampling/sampling_logp_difference/mean"]) for row in off])
    for row in on + off:
        for name in ("loss", "kl", "grad_norm", key, "sampling/importance_sampling_ratio/mean"):
            assert np.isfinite(row[name]), name
    # Log-probs are at most ~|-log(1/14)| ~ 3 here (FORWARD_REL_ERR relative); without replay the skewed
    # routing shows (the first step samples from the same params in both runs).
    assert all(row[key] <= FORWARD_REL_ERR * 10 for row in on)
    assert off[0][key] > 100 * FORWARD_REL_ERR * 10


def test_a_short_run_with_replay_finishes_with_its_metrics(tmp_path, one_expert_checkpoint, monkeypatch):
    # One step, unbucketed, prompts shared in the update and pi_old read in the loss.
    history = run_skewed(tmp_path / "short", one_expert_checkpoint, "R3", monkeypatch, steps=1)
    row = history[-1]
    assert row["sampling/sampling_logp_difference/max"] <= FORWARD_REL_ERR * 10  # as the slow test argues
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"])


def test_rounds_of_other_prompt_widths_pad_their_experts_as_their_prompts():
    # Dynamic sampling joins rounds whose prompts were bucketed to other widths (3 and 5 here, C = 2,
    # G = 2, one group per round): prompts are left padded to 5, and each row's experts (prompt slots
    # first, axis 1) by the same 2 slots, so slot j's experts stay those of token slot j.
    import types

    from grpo_jax.training import phases

    def round_of(width, first_token):
        rows, slots = 2, width + 2
        tokens = np.arange(first_token, first_token + rows * slots).reshape(rows, slots).astype(np.int32)
        arrays = {"prompt_tokens": tokens[:, :width], "prompt_mask": np.ones((rows, width), np.int32),
                  "tokens": tokens[:, width:], "mask": np.ones((rows, 2), np.int32),
                  "tool_mask": np.ones((rows, 2), np.int32), "logprobs": np.zeros((rows, 2), np.float32),
                  # One sparse layer, K = 1: each slot's "expert" is its token id, to follow it.
                  "experts": tokens[:, :, None, None]}
        ro = types.SimpleNamespace(completions=["", ""], prompts=["", ""], examples=[{}, {}], reward_extra={},
                                   reward_metrics={}, reward_seconds=0.0)
        return ro, {"rewards": np.zeros(2, np.float32), "zeroed": np.zeros(2, bool), "parts": {},
                    "lengths": np.full(2, 2), "truncated": np.zeros(2, bool), "arrays": arrays}

    config = types.SimpleNamespace(grpo=types.SimpleNamespace(num_generations=2, prompts_per_step=1),
                                   train=types.SimpleNamespace(samples_every=0))
    ctx = types.SimpleNamespace(config=config, tokenizer=types.SimpleNamespace(pad_id=0),
                                processes=types.SimpleNamespace(prompt_slice=lambda n: slice(0, n)))
    batch = phases._chosen_batch(ctx, 1, [round_of(3, 100), round_of(5, 200)], [0, 1], np.zeros(4, np.float32),
                                 0.0, 0)
    a = batch.arrays
    tokens = np.concatenate([a["prompt_tokens"], a["tokens"]], axis=1)
    assert a["experts"].shape == (4, 7, 1, 1)
    real = np.concatenate([a["prompt_mask"], a["mask"]], axis=1) > 0
    np.testing.assert_array_equal(a["experts"][..., 0, 0][real], tokens[real])  # every real slot: its own token's
    assert (a["experts"][:2, :2] == 0).all() and not real[:2, :2].any()  # the 2 pad slots of round 0


@pytest.mark.slow  # ~50 s on a 2-core CPU
def test_replay_on_two_devices_splits_the_experts_with_their_rows(tmp_path, one_expert_checkpoint):
    # tests/router_replay_devices_check.py: the short run on 2 fake CPU devices (mesh data=2): each
    # device holds its rows' tokens and experts; replay still gives the sampler's log-probs.
    out = tmp_path / "two.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, str(TESTS / "router_replay_devices_check.py"), str(out),
                           str(tmp_path / "run"), one_expert_checkpoint], env=env, cwd=TESTS.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["device_count"] == 2
    assert result["experts_sharding"] == [[0, 4], [4, 8]]  # rows of the [8, S, L, K] experts per device
    assert result["history"][-1]["sampling/sampling_logp_difference/max"] <= FORWARD_REL_ERR * 10
