"""Mixture-of-experts feed-forward (Qwen3-MoE): top-k routing, the experts as grouped matmuls over
the tokens sorted by expert, the router's load-balancing loss, and routing replay.

A sparse layer (`ModelConfig.is_sparse`) replaces the dense MLP with

    p_NxE   = softmax(x_NxD @ router_DxE)                        (float32, as transformers)
    e_NxK   = top_k(p, K)'s indices,   w_NxK = p at them, / sum_K when norm_topk_prob
    out_NxD = sum_k w[n, k] * down_e(silu(x_n @ gate_e) * (x_n @ up_e)),   e = e[n, k]

computed without any [tokens, experts, ...] tensor: the N*K (token, choice) pairs are sorted by
expert, each expert's contiguous run is one group of a grouped matmul (`jax.lax.ragged_dot`, or
its tiled form where XLA would expand ragged_dot densely: `grouped_matmul`, ModelConfig.moe_impl),
and the results are put back in (token, choice) order.

Parameters of a sparse layer (HF names on the right, transformers 5 writes them per expert):

    layers[i].mlp.router       [D, E]     HF mlp.gate.weight [E, D] -> .T
    layers[i].mlp.expert_gate  [E, D, I]  HF mlp.experts.e.gate_proj.weight [I, D] -> .T, stacked over e
    layers[i].mlp.expert_up    [E, D, I]  HF mlp.experts.e.up_proj.weight [I, D] -> .T, stacked over e
    layers[i].mlp.expert_down  [E, I, D]  HF mlp.experts.e.down_proj.weight [D, I] -> .T, stacked over e

Recording and replay. `forward_with_routing` runs the model once with every sparse layer recording
its router logits and chosen experts; given `expert_indices` (the experts a sampler chose, one
[B, T, K] per sparse layer) it uses them instead of each router's top-k, with the weights still
the current router's probabilities at those experts (so the router keeps its gradient). Plain
`model(tokens)` records nothing and keeps no state. The static sampler records the experts of
every prompt and completion token the same way (`grpo_jax.sampling.static.prefill(record_experts=
True)`, `SamplingConfig.record_experts`), which `token_logprobs(expert_indices_BxLxSxK=...)`
replays.

Letters: N tokens (B*T), D hidden, E experts, K experts per token, I moe_intermediate_size,
M = N*K (token, choice) pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from grpo_jax.model import expert_dispatch
from grpo_jax.model.config import DTYPES, ModelConfig
from grpo_jax.model.grouped_matmul import grouped_matmul
from grpo_jax.model.partitioning import SHARDING


def num_weights(config: ModelConfig) -> int:
    """Random weights of one sparse layer's feed-forward: the router and E experts' three matrices."""
    c = config
    return c.hidden_size * c.num_experts + 3 * c.num_experts * c.hidden_size * c.moe_intermediate_size


def router_probs(x_NxD: jax.Array, router_DxE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(router logits [N, E] in x's dtype, their softmax [N, E] float32), as transformers computes them."""
    logits_NxE = jnp.einsum("nd,de->ne", x_NxD, router_DxE.astype(x_NxD.dtype))
    return logits_NxE, jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)


def choice_weights(probs_NxE: jax.Array, experts_NxK: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """The mixing weights [N, K] float32 of the chosen experts: their probabilities, renormalised
    to sum to 1 over the K choices when norm_topk_prob."""
    w_NxK = jnp.take_along_axis(probs_NxE, experts_NxK, axis=-1)
    return w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True) if norm_topk_prob else w_NxK


def top_k_experts(probs_NxE: jax.Array, k: int) -> jax.Array:
    """The K most probable experts of each token [N, K] int32, most probable first (as torch.topk)."""
    return jax.lax.top_k(probs_NxE, k)[1].astype(jnp.int32)


def experts_ffn(x_NxD, experts_NxK, weights_NxK, gate_ExDxI, up_ExDxI, down_ExIxD, impl: str = "auto",
                first_expert=0) -> jax.Array:
    """sum_k weights[n, k] * SwiGLU expert experts[n, k] applied to x[n]: [N, D] in x's dtype.

    The M = N*K (token, choice) pairs are sorted by expert (stable, so ties keep token order);
    each matmul is one grouped matmul whose group e is expert e's run of rows
    (`grouped_matmul`, `impl`: jax.lax.ragged_dot or its tiled form). Every intermediate this code
    makes is [M, D] or [M, I]: K times a dense MLP of width I, never E times.

    Expert parallelism (`grpo_jax.model.expert_dispatch`): the weights given may be a slice of the
    experts, E_local of them starting at expert `first_expert` (an int or a traced scalar). Pairs
    routed to other experts sort after every local group, fall in no group, and add nothing: the
    result is then this slice's share of the sum.
    """
    n, k = experts_NxK.shape
    num_local = gate_ExDxI.shape[0]
    dt = x_NxD.dtype
    local_M = experts_NxK.reshape(-1) - first_expert
    key_M = jnp.where((local_M >= 0) & (local_M < num_local), local_M, num_local)  # other experts last
    order_M = jnp.argsort(key_M, stable=True)  # pair order_M[j] is the j-th row of the sorted run
    sizes_E = jnp.bincount(key_M, length=num_local).astype(jnp.int32)  # (drops the key num_local)
    x_MxD = x_NxD[order_M // k]
    gate = grouped_matmul(x_MxD, gate_ExDxI.astype(dt), sizes_E, impl)
    up = grouped_matmul(x_MxD, up_ExDxI.astype(dt), sizes_E, impl)
    h_MxI = jax.nn.silu(checkpoint_name(gate, "gate_up_proj")) * checkpoint_name(up, "gate_up_proj")
    y_MxD = checkpoint_name(grouped_matmul(h_MxI, down_ExIxD.astype(dt), sizes_E, impl), "down_proj")
    y_NxKxD = y_MxD[jnp.argsort(order_M)].reshape(n, k, -1)  # back to (token, choice) order
    return jnp.einsum("nkd,nk->nd", y_NxKxD, weights_NxK.astype(dt))


def _param(name: str, value: jax.Array) -> nnx.Param:
    # As transformer._param: the sharding is metadata only (no mesh on one device).
    return nnx.Param(value, out_sharding=SHARDING[name], eager_sharding=False)


class ExpertChoice(nnx.Variable):
    """Expert indices [B, T, K] a sparse layer must use instead of its router's top-k (replay)."""


class RoutingRecord(nnx.Variable):
    """What a recording sparse layer saw: (router logits [B, T, E], experts used [B, T, K])."""


class SparseMoe(nnx.Module):
    """The sparse feed-forward of one layer (module docstring); called as the dense MLP is."""

    def __init__(self, config: ModelConfig, normals):
        c = config
        d, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
        self.config = config
        self.record = False  # set on a private copy by `forward_with_routing`
        self.router = _param("router", normals.take((d, e)))
        self.expert_gate = _param("expert_gate", normals.take((e, d, i)))
        self.expert_up = _param("expert_up", normals.take((e, d, i)))
        self.expert_down = _param("expert_down", normals.take((e, i, d)))

    def __call__(self, x_BxTxD):
        c = self.config
        b, t, d = x_BxTxD.shape
        x_NxD = x_BxTxD.astype(DTYPES[c.dtype]).reshape(b * t, d)
        logits_NxE, probs_NxE = router_probs(x_NxD, self.router[...])
        forced = getattr(self, "forced_experts", None)  # set on a private copy by `replay`
        if forced is not None:
            experts_NxK = forced[...].reshape(b * t, c.num_experts_per_tok).astype(jnp.int32)
        else:
            experts_NxK = top_k_experts(probs_NxE, c.num_experts_per_tok)
        # transformers casts the weights back to the hidden dtype before mixing.
        weights_NxK = choice_weights(probs_NxE, experts_NxK, c.norm_topk_prob).astype(x_NxD.dtype)
        if self.record:
            self.recorded = RoutingRecord((logits_NxE.reshape(b, t, -1), experts_NxK.reshape(b, t, -1)))
        weights = (self.expert_gate[...], self.expert_up[...], self.expert_down[...])
        mesh = jax.sharding.get_abstract_mesh()
        if expert_dispatch.on_mesh(mesh):  # each device sorts its own tokens; they travel to their experts
            out_NxD = expert_dispatch.experts_ffn_over_mesh(mesh, experts_ffn, x_NxD, experts_NxK, weights_NxK,
                                                            *weights, impl=c.moe_impl)
        else:
            out_NxD = experts_ffn(x_NxD, experts_NxK, weights_NxK, *weights, c.moe_impl)
        return out_NxD.reshape(b, t, d)


class Routing(NamedTuple):
    """One entry per sparse layer, in layer order: router logits [B, T, E] (compute dtype) and the
    experts used [B, T, K] int32. A pytree (a jitted function returns it)."""

    router_logits: tuple[jax.Array, ...]
    expert_indices: tuple[jax.Array, ...]


def sparse_layers(model) -> list[SparseMoe]:
    """The model's SparseMoe modules in layer order (paths ('layers', i, 'mlp'), sorted by i as a
    number: layer 10 after layer 9)."""
    found = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, SparseMoe)]

    def order(item):
        return tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in item[0])

    return [m for _, m in sorted(found, key=order)]


def start_recording(model) -> list[SparseMoe]:
    """Makes every sparse layer of `model` (a private, merged copy) record its routing on its next
    call; returns them in layer order for `recorded_experts`."""
    layers = sparse_layers(model)
    for layer in layers:
        layer.record = True
    return layers


def recorded_experts(layers: list[SparseMoe]) -> jax.Array:
    """The experts the recording layers used in their last call, stacked: [L_sparse, B, T, K] int32."""
    if not layers:
        raise ValueError("recorded_experts: the model has no sparse layer (num_experts is 0)")
    return jnp.stack([layer.recorded.get_value()[1] for layer in layers])


def replay(model, experts_LxBxTxK) -> None:
    """Makes every sparse layer of `model` (a private, merged copy) use these experts, one
    [B, T, K] per sparse layer in layer order, instead of its top-k on its next call."""
    layers = sparse_layers(model)
    if len(experts_LxBxTxK) != len(layers):
        raise ValueError(f"expert indices for {len(experts_LxBxTxK)} sparse layers, the model has {len(layers)}")
    for layer, experts_BxTxK in zip(layers, experts_LxBxTxK):
        layer.forced_experts = ExpertChoice(jnp.asarray(experts_BxTxK, jnp.int32))


def shared_prompt_layout(experts_BxLxSxK, group_size: int, num_targets: int):
    """Per-row experts [B, L, S, K] (S = P + C; rows first, as the sampler returns them) in the
    layer-major layout the model runs (`replay`): [L, B, S, K] for group_size 1; for G > 1
    (`Transformer.shared_prompt_hidden_states`) each group's prompt once, from its first row, then
    its G completions: [L, B/G, P + G*C, K]."""
    experts_LxBxSxK = jnp.moveaxis(jnp.asarray(experts_BxLxSxK, jnp.int32), 1, 0)
    if group_size == 1:
        return experts_LxBxSxK
    l, b, s, k = experts_LxBxSxK.shape
    n, p = b // group_size, s - num_targets
    grouped = experts_LxBxSxK.reshape(l, n, group_size, s, k)
    return jnp.concatenate([grouped[:, :, 0, :p], grouped[:, :, :, p:].reshape(l, n, -1, k)], axis=2)


def routing_token_weights(attention_mask_BxS, group_size: int, num_targets: int) -> jax.Array:
    """Each token's weight in `load_balancing_loss`, in the layout the model ran (`token_logprobs`):
    the attention mask [B, S] for group_size 1; for G > 1 the shared-prompt layout [B/G, P + G*C]
    (`shared_prompt_layout`), where each group's prompt, run once, weighs G (its G rows' copies),
    so the loss is the one over every row's tokens."""
    mask_BxS = attention_mask_BxS.astype(jnp.float32)
    if group_size == 1:
        return mask_BxS
    b, s = mask_BxS.shape
    n, p = b // group_size, s - num_targets
    grouped = mask_BxS.reshape(n, group_size, s)
    return jnp.concatenate([grouped[:, 0, :p] * group_size, grouped[:, :, p:].reshape(n, -1)], axis=1)


def forward_with_routing(graphdef, params, tokens_BxT, attention_mask_BxT=None,
                         expert_indices: tuple[jax.Array, ...] | None = None, **call_kwargs):
    """(logits [B, T, V] float32, `Routing`) of the model `nnx.merge(graphdef, params)`.

    Pure (jit it): the model is merged privately, so recording leaves no state behind.
    expert_indices: one [B, T, K] per sparse layer; each layer uses them instead of its top-k
    (replay), and the returned Routing repeats them.
    """
    model = nnx.merge(graphdef, params)
    layers = start_recording(model)
    if expert_indices is not None:
        replay(model, expert_indices)
    logits = model(tokens_BxT, attention_mask_BxT=attention_mask_BxT, **call_kwargs)
    records = [m.recorded.get_value() for m in layers]
    routing = Routing(tuple(r[0] for r in records), tuple(r[1] for r in records))
    return logits, routing


def load_balancing_loss(router_logits: tuple[jax.Array, ...], top_k: int, attention_mask_BxT=None) -> jax.Array:
    """Switch Transformer's auxiliary loss as transformers computes it for Qwen3-MoE (scalar float32).

    Over all sparse layers' real tokens together: f_e = (times expert e is among a token's top-k) /
    (token-layers), P_e = mean router probability of e; loss = E * sum_e f_e * P_e. f sums to K, so a
    uniform router gives K; routing concentrated on few experts gives more. The training loss adds
    `router_aux_loss_coef` times it (transformers adds it when output_router_logits).
    """
    if not router_logits:
        return jnp.zeros((), jnp.float32)
    num_experts = router_logits[0].shape[-1]
    counts_E = jnp.zeros((num_experts,), jnp.float32)
    prob_sum_E = jnp.zeros((num_experts,), jnp.float32)
    rows = jnp.zeros((), jnp.float32)
    for logits_BxTxE in router_logits:
        probs = jax.nn.softmax(logits_BxTxE.astype(jnp.float32), axis=-1).reshape(-1, num_experts)
        real_N = (jnp.ones(probs.shape[:1], jnp.float32) if attention_mask_BxT is None
                  else attention_mask_BxT.reshape(-1).astype(jnp.float32))
        chosen_NxE = jnp.sum(jax.nn.one_hot(top_k_experts(probs, top_k), num_experts), axis=1)
        counts_E = counts_E + jnp.einsum("ne,n->e", chosen_NxE, real_N)
        prob_sum_E = prob_sum_E + jnp.einsum("ne,n->e", probs, real_N)
        rows = rows + jnp.sum(real_N)
    return num_experts * jnp.sum((counts_E / rows) * (prob_sum_E / rows))
