"""The routers' load-balancing loss in the update (`grpo.router_aux_loss_coef`, transformers' name).

Worked example: 8 answers (2 prompts x 4) of a tiny Qwen3-MoE (two sparse layers of 4 experts, top-2).
The update's loss with the coefficient c is the loss without it plus c times Switch Transformer's
loss over every real token of the 8 rows, exactly what `moe.load_balancing_loss` (transformers'
formula, checked against transformers in tests/test_qwen3_moe.py) gives on the rows one by one:

    loss(c) - loss(0) = c * E * sum_e f_e * P_e        (f_e: share of top-2 picks, P_e: mean probability)

whether the prompts run once per group (the shared-prompt layout, each prompt token weighing G)
or once per row, and however the rows are cut into micro-batches (each one's loss weighs its
tokens' share).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.config import ConfigError, GRPOSection
from grpo_jax.core import losses
from grpo_jax.model import ModelConfig, init_model, moe
from grpo_jax.training import run_context, step_loss
from grpo_jax.training import step as step_lib
from grpo_jax.training.update_batch import UpdateBatch

TOP2 = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                   head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                   norm_topk_prob=True, mlp_only_layers=(1,))
P, C, G = 5, 4, 4


def _batch():
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 40, (2, P))
    prompts[1, :2] = 0  # the second prompt is left-padded
    tokens = np.concatenate([np.repeat(prompts, G, axis=0), rng.integers(3, 40, (2 * G, C))], axis=1)
    attention = (tokens > 0).astype(np.int32)
    attention[3, -2:] = 0  # a short answer
    mask = attention[:, P:]
    return UpdateBatch(tokens=jnp.asarray(tokens, jnp.int32), attention=jnp.asarray(attention),
                       completion_mask=jnp.asarray(mask), advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5] * 2),
                       old_logp=None, sampler_logp=jnp.zeros(mask.shape, jnp.float32), ref_logp=None)


def _loss(graphdef, params, mb, coef: float, group_size: int, router_tokens):
    grpo = GRPOSection(num_generations=G, prompts_per_step=2, router_aux_loss_coef=coef)
    normalizer = losses.loss_normalizer(mb.completion_mask, grpo.resolved_aggregation(), max_len=C)
    loss_fn = jax.jit(step_loss.make_loss_fn(graphdef, grpo, 1.0, group_size))
    loss, (metrics, _) = loss_fn(params, mb, normalizer, None, None, router_tokens)
    return float(loss), {k: float(v) for k, v in metrics.items()}


def test_the_update_adds_the_load_balancing_loss_of_every_real_token():
    graphdef, params = nnx.split(init_model(TOP2, 0), nnx.Param)
    params = jax.tree.map(lambda p: p * 5.0 if p.ndim > 1 else p, params)  # decided, uneven routing
    mb = _batch()
    _, routing = jax.jit(moe.forward_with_routing, static_argnums=0)(graphdef, params, mb.tokens, mb.attention)
    expected = float(moe.load_balancing_loss(routing.router_logits, 2, mb.attention))
    assert expected > 2.0  # above a balanced router's K = 2: there is something to balance
    tokens = step_lib.router_token_count(mb.attention)
    # Error argument: the same router logits (the shared-prompt forward runs the same products in
    # another order, tests/tolerances.py FORWARD_REL_ERR 1e-4 relative) enter sums of ~60 tokens;
    # the policy loss cancels to ~0.1 in float32. 1e-4 relative to E * sum f P ~ 2.5 covers both.
    for group_size in (1, G):
        base, _ = _loss(graphdef, params, mb, 0.0, group_size, tokens)
        with_aux, metrics = _loss(graphdef, params, mb, 0.5, group_size, tokens)
        assert metrics["aux_loss"] == pytest.approx(expected, rel=1e-4), group_size
        assert (with_aux - base) / 0.5 == pytest.approx(expected, rel=1e-4), group_size
    # Two micro-batches of 4 rows (one prompt each): each adds its own loss times its tokens' share of
    # the update's, and the shares add up to the token-weighted mean of the two.
    halves = [jax.tree.map(lambda x: None if x is None else x[i * G:(i + 1) * G], mb) for i in range(2)]
    shares = [_loss(graphdef, params, half, 1.0, G, tokens)[1]["aux_loss"] for half in halves]
    own = []
    for half in halves:
        _, r = jax.jit(moe.forward_with_routing, static_argnums=0)(graphdef, params, half.tokens, half.attention)
        own.append(float(moe.load_balancing_loss(r.router_logits, 2, half.attention))
                   * float(half.attention.sum()) / float(tokens))
    np.testing.assert_allclose(shares, own, rtol=1e-4)


def test_the_load_balancing_loss_moves_the_router_and_needs_experts():
    graphdef, params = nnx.split(init_model(TOP2, 0), nnx.Param)
    params = jax.tree.map(lambda p: p * 5.0 if p.ndim > 1 else p, params)
    mb = _batch()
    tokens = step_lib.router_token_count(mb.attention)

    def router_grad(coef):
        grpo = GRPOSection(num_generations=G, prompts_per_step=2, router_aux_loss_coef=coef)
        normalizer = losses.loss_normalizer(mb.completion_mask, grpo.resolved_aggregation(), max_len=C)
        loss_fn = step_loss.make_loss_fn(graphdef, grpo, 1.0, G)
        grads = jax.jit(jax.grad(lambda p: loss_fn(p, mb, normalizer, None, None, tokens)[0]))(params)
        return np.asarray(nnx.to_pure_dict(grads)["layers"][0]["mlp"]["router"])

    # The aux loss is differentiable in the router probabilities P_e: it changes the router's gradient.
    assert np.abs(router_grad(1.0) - router_grad(0.0)).max() > 1e-3
    # A dense model has no router: the coefficient is refused once the model is known.
    config = dataclasses.replace(run_context.config_lib.Config(), grpo=GRPOSection(router_aux_loss_coef=0.001))
    dense = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match="grpo.router_aux_loss_coef=0.001 on a dense model"):
        run_context.check_router_replay(config, dense)
    with pytest.raises(ConfigError, match="grpo.router_aux_loss_coef"):
        GRPOSection(router_aux_loss_coef=-1.0).validate()
