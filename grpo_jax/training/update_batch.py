"""What one optimizer step consumes: the `UpdateBatch` pytree the update and its loss read."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class UpdateBatch:
    """What one optimizer step consumes; every array has a leading [A] micro-batch axis, then [M].

    tokens/attention: prompt then completion, [A, M, P+C]; the others [A, M, C] or [A, M].
    """

    tokens: jax.Array
    attention: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array | None  # None: pi_old is the loss's own log-probs (one update per batch)
    sampler_logp: jax.Array
    ref_logp: jax.Array | None
    # On-policy distillation (grpo.teacher_model_name_or_path; grpo_jax.training.teacher): the teacher's
    # log-prob of each completion token [A, M, C] (grpo.loss_top_k = 0), or its top-K ids and their
    # log-probs [A, M, C, K]; None without a teacher.
    teacher_logp: jax.Array | None = None
    teacher_topk_logp: jax.Array | None = None
    teacher_topk_ids: jax.Array | None = None
    # Routing replay (off_policy.router_replay="R3"): the experts the sampler routed each token slot
    # to, [A, M, P+C, L_sparse, K] int16, token slots on the same axis as `tokens` so every cut of the
    # columns cuts them alike; the loss's forward uses them instead of its routers' top-k. None: off.
    experts: jax.Array | None = None


jax.tree_util.register_dataclass(
    UpdateBatch, data_fields=[f.name for f in dataclasses.fields(UpdateBatch)], meta_fields=[]
)
