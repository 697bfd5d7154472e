"""The optimizer: AdamW with global-norm clipping, a warm-up then constant or cosine schedule, and
weight decay on the weight matrices only.

Used directly as Optax (`tx.init(params)`, `tx.update(grads, opt_state, params)`); the trainer and
the SFT warm-up build theirs here.
"""

from __future__ import annotations

import jax
import optax

from grpo_jax import config as config_lib

# Weight decay pulls every weight towards 0. For a matrix that is the regulariser; for an RMSNorm
# scale (whose neutral value is 1) and a bias it is only a bias towards a different function, so
# Hugging Face's Trainer decays neither. Token embeddings are not decayed either (as GPT-2, nanoGPT
# and OLMo do): a row only gets a gradient when its token occurs, so decay would shrink rare tokens
# every step. Names are the leaves of the parameter tree (grpo_jax.model's table).
# Experts' matrices and the router's are matrices like the rest (as Hugging Face's Trainer treats them).
DECAYED_WEIGHTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                             "expert_gate", "expert_up", "expert_down", "router"})
UNDECAYED_WEIGHTS = frozenset(
    {"embed", "attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "final_norm", "q_norm", "k_norm",
     "q_bias", "k_bias", "v_bias"}
)


def _weight_name(path) -> str:
    """The innermost named key of a parameter's path: ('layers', 0, 'attn', 'q_proj', 'value') -> 'q_proj'."""
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str) and name in DECAYED_WEIGHTS | UNDECAYED_WEIGHTS:
            return name
    raise ValueError(
        f"weight decay mask: no known weight name in {jax.tree_util.keystr(path)}; "
        f"decayed: {sorted(DECAYED_WEIGHTS)}, not decayed: {sorted(UNDECAYED_WEIGHTS)}"
    )


def weight_decay_mask(params):
    """A tree of bools like `params`: True where AdamW's weight decay applies (weight matrices)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _weight_name(path) in DECAYED_WEIGHTS, params)


def learning_rate_schedule(optim: config_lib.OptimSection, total_updates: int) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup_steps` updates, then constant or cosine decay to 0."""
    if optim.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, optim.learning_rate, optim.warmup_steps, max(total_updates, optim.warmup_steps + 1)
        )
    if optim.warmup_steps:
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, optim.learning_rate, optim.warmup_steps),
                optax.constant_schedule(optim.learning_rate),
            ],
            [optim.warmup_steps],
        )
    return optax.constant_schedule(optim.learning_rate)


def make_optimizer(
    optim: config_lib.OptimSection, total_updates: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(AdamW with clipping and the schedule, the schedule) for `total_updates` optimizer steps."""
    schedule = learning_rate_schedule(optim, total_updates)
    parts = [optax.clip_by_global_norm(optim.max_grad_norm)] if optim.max_grad_norm > 0 else []
    parts.append(
        optax.adamw(
            schedule,
            b1=optim.b1,
            b2=optim.b2,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            mask=weight_decay_mask,
        )
    )
    return optax.chain(*parts), schedule
