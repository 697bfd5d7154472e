"""LoRA adapters as an explicit pytree beside the frozen base weights (`lora.r > 0`).

For each targeted weight W (HF module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj) the adapters hold A [in, r] and B [r, out], with in / out W's input and output
dimensions flattened (q_proj [D, N, H]: in = D, out = N * H; o_proj [N, H, D]: in = N * H,
out = D). The policy is the base with every targeted weight replaced by

    W' = W + (alpha / r) * (A @ B).reshape(W.shape)            (`merge`)

Experts (Qwen3-MoE, grpo_jax.model.moe) are targets by their own names, expert_gate [E, D, I],
expert_up [E, D, I], expert_down [E, I, D], or the preset "experts" for the three: E is a batch
dimension (partitioning.BATCH_DIMS), so each expert e gets its own pair A [E, in, r], B [E, r, out]
and W'[e] = W[e] + (alpha / r) * A[e] @ B[e]. The router [D, E] is a target only when named
("router"): no preset holds it, as peft's all-linear leaves it out too. "all-linear" means what
peft's all-linear means on a transformers 5 Qwen3-MoE: every nn.Linear but the output layer, i.e. the
attention and the dense MLPs of `mlp_only_layers`; transformers 5 keeps the experts fused as
nn.Parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj) and the router as a parameter of
its own module, which peft's all-linear does not select. (transformers 4 had one nn.Linear per
expert and the router as nn.Linear, so all-linear there adapted both; name them here for that.)

B starts at 0, so W' == W bit for bit and step 0 is the base model. The trainer differentiates
through `merge` with respect to the adapters only; the reference policy is the base itself (no
second copy of the weights), and the sampler decodes from a merged copy made once per rollout.

Why merged weights and not an on-the-fly x @ A @ B in the model (qwix's LoRA, peft's): the model's
kernels fuse q/k/v and gate/up into one matmul and run a shared-prompt layout, and the merge keeps
every one of them unchanged; `benchmarks/bench_lora.py` measures both ways for the sampler. What it
costs: no dropout on the adapter path (`lora_dropout` must be 0), and one transient merged copy of
the targeted weights per forward pass.

Adapters tree: nested dicts mirroring the params' paths with string keys,
{"layers": {"0": {"attn": {"q_proj": {"lora_a": A, "lora_b": B}}}}}; `grpo_jax.io.peft` writes them
under peft's names for export.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.model.partitioning import BATCH_DIMS, IN_DIMS

PRESETS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all-linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "experts": ("expert_gate", "expert_up", "expert_down"),
}
# Targets with no module of peft's LoRA format (the experts are fused parameters in transformers
# 5, the router a parameter of its own module): `grpo_jax.io.peft` refuses to export them.
NOT_PEFT_LINEAR = ("router", "expert_gate", "expert_up", "expert_down")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the trainer needs to know of a LoRA run: rank, scale alpha / r, the targeted weight
    names, and the dtype merged weights are computed in (the model's compute dtype). Built from the
    config by `grpo_jax.config.LoraSection.spec`."""

    rank: int
    scale: float
    targets: tuple[str, ...]
    merge_dtype: Any = jnp.float32

    def model_params(self, adapters: dict, base):
        """The policy's full params: `merge(base, adapters)`."""
        return merge(base, adapters, self.scale, self.merge_dtype)


def resolve_targets(names: Iterable[str]) -> tuple[str, ...]:
    """Weight names from `lora.target_modules`: presets expanded, order kept, no repeats."""
    out: list[str] = []
    for name in names:
        for weight in PRESETS.get(name, (name,)):
            if weight not in IN_DIMS:
                raise ValueError(f"unknown LoRA target {weight!r}; choose from {sorted(IN_DIMS)} or a preset "
                                 f"{sorted(PRESETS)}")
            if weight not in out:
                out.append(weight)
    return tuple(out)


def _names(path) -> tuple[str, ...]:
    """('layers', 0, 'attn', 'q_proj', .value) -> ('layers', '0', 'attn', 'q_proj')."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", None))) for k in path if not hasattr(k, "name"))


def _split(shape: tuple[int, ...], weight: str) -> tuple[int, int]:
    """(in, out) of one matrix of the weight: its dims after the batch dims, flattened."""
    nb = BATCH_DIMS.get(weight, 0)
    k = nb + IN_DIMS[weight]
    return math.prod(shape[nb:k]), math.prod(shape[k:])


def adapter_shapes(shape: tuple[int, ...], weight: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A's shape, B's shape) for weight `weight` of `shape`: ([batch..., in, r], [batch..., r, out]);
    expert_down [E, I, D] -> ([E, I, r], [E, r, D]), o_proj [N, H, D] -> ([N*H, r], [r, D])."""
    batch = tuple(shape[:BATCH_DIMS.get(weight, 0)])
    n_in, n_out = _split(shape, weight)
    return batch + (n_in, rank), batch + (rank, n_out)


def targeted(params, targets: Iterable[str]) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(path names, shape) of every weight of `params` that gets an adapter, in tree order."""
    targets = set(targets)
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = _names(path)
        if names and names[-1] in targets:
            found.append((names, tuple(np.shape(leaf))))
    return found


def _nest(items: list[tuple[tuple[str, ...], Any]]) -> dict:
    root: dict = {}
    for names, value in items:
        node = root
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = value
    return root


def _lookup(tree: dict, names: tuple[str, ...]):
    node = tree
    for name in names:
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node


def init_adapters(params, targets: Iterable[str], rank: int, key: jax.Array, init: str = "kaiming") -> dict:
    """Fresh adapters for `params` (float32): B = 0, and A as peft initialises it:
    "kaiming" U(-1/sqrt(in), 1/sqrt(in)) (peft's default, kaiming-uniform with a = sqrt(5)),
    "gaussian" N(0, 1/r). Each A draws from fold_in(key, its index in tree order); an expert
    weight's A [E, in, r] draws all E experts' at once (in is one expert's fan-in)."""
    items = []
    for i, (names, shape) in enumerate(targeted(params, targets)):
        a_shape, b_shape = adapter_shapes(shape, names[-1], rank)
        n_in = a_shape[-2]
        k = jax.random.fold_in(key, i)
        if init == "kaiming":
            bound = 1.0 / math.sqrt(n_in)
            a = jax.random.uniform(k, a_shape, jnp.float32, -bound, bound)
        elif init == "gaussian":
            a = jax.random.normal(k, a_shape, jnp.float32) / rank
        else:
            raise ValueError(f"LoRA init must be 'kaiming' or 'gaussian', got {init!r}")
        items.append((names, {"lora_a": a, "lora_b": jnp.zeros(b_shape, jnp.float32)}))
    if not items:
        raise ValueError(f"no weight of the model matches the LoRA targets {tuple(targets)}")
    return _nest(items)


def merge(base, adapters: dict, scale: float, dtype=None):
    """The base params with W + scale * A @ B in every targeted weight (cast to `dtype`, default
    the weight's own); untargeted weights are passed through. Pure; differentiable in `adapters`.
    With B == 0 every weight is returned bit-equal (w + 0.0 == w). Batch dims (experts) pair up:
    A [E, in, r] @ B [E, r, out] is E products, not one."""

    def one(path, w):
        pair = _lookup(adapters, _names(path))
        if pair is None:
            return w
        # matmul batches the leading dims: [in, r] @ [r, out], or [E, in, r] @ [E, r, out] per expert.
        delta = jnp.matmul(pair["lora_a"].astype(jnp.float32), pair["lora_b"].astype(jnp.float32))
        merged = w.astype(jnp.float32) + scale * delta.reshape(w.shape)
        return merged.astype(dtype or w.dtype)

    return jax.tree_util.tree_map_with_path(one, base)


def count(tree) -> int:
    """Number of values in a tree of arrays (or ShapeDtypeStructs)."""
    return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree))
