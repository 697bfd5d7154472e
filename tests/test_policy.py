"""Policy (grpo_jax.training.policy): full fine-tuning and adapters answer the same questions (what
trains, what the sampler and the reference read, what the update takes, what a checkpoint holds),
and the abstract build `check` uses is the real build's shapes, dtypes and shardings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.training import policy as policy_lib
from grpo_jax.training import run_context, trainable
from grpo_jax.training.run_context import RunState
from test_train import tiny_config


def _config(tmp_path, **lora):
    cfg = tiny_config(tmp_path)
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, **lora))


def _model(cfg):
    mesh = run_context.configured_mesh(cfg)
    tokenizer = run_context.configured_tokenizer(cfg)
    model_config, graphdef, params = run_context.build_model(cfg, tokenizer, mesh)
    return mesh, model_config, graphdef, params


def test_full_fine_tuning_trains_the_params_and_copies_the_reference(tmp_path):
    cfg = _config(tmp_path)
    mesh, _, _, params = _model(cfg)
    policy, trainable, base = policy_lib.build(cfg, mesh, params)
    assert not policy.trains_adapters and trainable is params and base is None
    fresh = RunState(step=0, data_position=0, params=trainable, opt_state={}, ref_params=None)
    state = policy.after_warm_up(fresh, policy.warm_up_params(fresh), ref_dtype=jnp.bfloat16, uses_reference=True,
                                 warmed_up=False, mesh=mesh)
    # The sampler reads the params themselves; the reference is a bf16 copy of them, its own buffers.
    assert policy.full_params(state) is state.params and policy.reference(state) is state.ref_params
    assert {x.dtype for x in jax.tree.leaves(state.ref_params)} == {jnp.dtype(jnp.bfloat16)}
    assert policy.update_extra_args(state) == ()
    assert set(policy.checkpoint_tree(state)) == {"params", "opt_state", "ref_params"}


def test_adapters_train_over_the_base_which_is_the_reference(tmp_path):
    cfg = _config(tmp_path, r=4)
    mesh, _, _, params = _model(cfg)
    policy, adapters, base = policy_lib.build(cfg, mesh, params)
    assert policy.trains_adapters and base is params  # float32 base (lora.base_dtype default)
    state = RunState(step=0, data_position=0, params=adapters, opt_state={}, ref_params=None, base_params=base)
    # B = 0 at the start: the merged policy the sampler reads is the base, bit for bit.
    for merged, w in zip(jax.tree.leaves(policy.full_params(state)), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(merged), np.asarray(w))
    assert policy.reference(state) is base and policy.update_extra_args(state) == (base,)
    # No SFT warm-up: the base is the init again on resume, so checkpoints hold adapters and Adam only.
    assert set(policy.checkpoint_tree(state)) == {"params", "opt_state"}
    # The rollout thread's snapshots are full params already.
    assert not policy.for_snapshots().trains_adapters


@pytest.mark.parametrize("lora", [{}, {"r": 4, "base_dtype": "bfloat16"}], ids=["full", "adapters"])
def test_the_abstract_build_is_the_real_one(tmp_path, lora):
    # `check` builds the run with build_training(abstract=True): every array it counts must have the
    # shape, dtype and sharding of what train allocates (sft.steps = 0, so the base is cast at once).
    cfg = _config(tmp_path, **lora)
    cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=0))
    mesh, model_config, graphdef, params = _model(cfg)
    real = trainable.build_training(cfg, mesh, model_config, graphdef, params)
    _, abstract_params = run_context.abstract_model(model_config, mesh, cfg.model.init_seed)
    fake = trainable.build_training(cfg, mesh, model_config, graphdef, abstract_params, abstract=True)

    def described(tree):
        return [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(tree)]

    for name in ("params", "base", "opt_state"):
        assert described(getattr(fake, name)) == described(getattr(real, name)), name
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((fake.params, fake.opt_state)))
