"""The `off_policy` section: everything about batches sampled by other params or another engine
than the ones that train on them. Asynchronous rollouts (`max_staleness`), the sampler's own
devices (`rollout_devices`), the per-token correction for a sampler/trainer mismatch (TRL's
`vllm_importance_sampling_*` names and defaults), where pi_old comes from (`old_logprobs`), and
routing replay for mixture-of-experts models (`router_replay`, verl's `router_replay.mode`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from grpo_jax.config.checks import ConfigError, check_fields, nonnegative


@dataclasses.dataclass(frozen=True)
class OffPolicySection:
    NAME: ClassVar[str] = "off_policy"
    # Asynchronous rollouts: step n's batch is sampled from the params of step max(0, n - 1 - k), so
    # it runs while the k steps before it update. 0: the synchronous loop (grpo_jax.training.async_rollouts).
    max_staleness: int = 0
    # > 0 (with max_staleness >= 1): the last this-many devices sample, on their own mesh (rows over
    # them, weights whole on each); mesh.data x fsdp x tensor is laid over the rest and trains.
    rollout_devices: int = 0
    # Sampler/trainer mismatch: each token's clipped term is weighted by pi_old / pi_sampler,
    # truncated to or masked outside the clip band (grpo_jax.core.losses.sampler_correction).
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    # None: 1 / clip_max in the mask modes, no lower bound in the truncate modes (TRL: none in both).
    vllm_importance_sampling_clip_min: float | None = None
    # pi_old of the clipped ratio. "auto": the trainer's log-probs when the correction is on (read
    # inside the loss when each batch gets one update, else a separate pass: "recompute"), the
    # sampler's when it is off. "sampler" takes the sampler's as pi_old (no correction possible).
    old_logprobs: Literal["auto", "sampler", "recompute"] = "auto"
    # Routing replay (MoE models; verl's `router_replay.mode`, NeMo-RL's `router_replay.enabled`):
    # "R3" (rollout routing replay) records the experts the sampler chose for every token and makes
    # every trainer pass use them instead of its router's top-k: the pi_old pass, the reference
    # pass and every update micro-batch (the mixing weights stay the current router's
    # probabilities at those experts, so the router still trains). Sampler and trainer then differ
    # only in numerics, never in which experts ran. Needs the static engine (the one that records).
    # "R2" (replaying the pi_old pass's routing in the update) is not implemented; "disabled": each
    # pass routes by its own top-k.
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"

    def resolved_old_logprobs(self, updates_per_batch: int) -> Literal["sampler", "recompute", "in_loss"]:
        """Where pi_old comes from: the sampler's log-probs, a separate trainer pass over the batch
        before its updates, or the trainer's own log-probs inside the loss (stop_gradient): exact
        when the batch gets one update (`updates_per_batch`, grpo's), whose params are pi_old's."""
        if self.old_logprobs == "auto":
            if not self.vllm_importance_sampling_correction:
                return "sampler"
            return "in_loss" if updates_per_batch == 1 else "recompute"
        return self.old_logprobs

    def validate(self) -> None:
        check_fields(self)
        nonnegative(self, "max_staleness", "rollout_devices")
        clip_max, clip_min = self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_clip_min
        if clip_max is not None and clip_max <= 0:
            raise ConfigError(f"off_policy.vllm_importance_sampling_clip_max={clip_max} must be > 0 (or None: no "
                              "upper bound)")
        if clip_min is not None and clip_min < 0:
            raise ConfigError(f"off_policy.vllm_importance_sampling_clip_min={clip_min} must be >= 0 (or None)")
        if clip_min is not None and clip_max is not None and clip_min >= clip_max:
            raise ConfigError(f"off_policy.vllm_importance_sampling_clip_min={clip_min} must be below "
                              f"off_policy.vllm_importance_sampling_clip_max={clip_max}")
        if self.vllm_importance_sampling_correction and self.old_logprobs == "sampler":
            raise ConfigError(
                "off_policy.old_logprobs='sampler' with off_policy.vllm_importance_sampling_correction=True: the "
                "correction weighs each token by pi_old / pi_sampler, which is 1 when pi_old is the sampler's. "
                "Use off_policy.old_logprobs='auto' (the trainer's pi_old) or turn the correction off")
        if self.router_replay == "R2":
            raise ConfigError(
                "off_policy.router_replay='R2' (replaying the pi_old pass's routing in the update) is not "
                "implemented; 'R3' replays the sampler's routing in the pi_old pass, the reference pass and the "
                "update, or use 'disabled'")
        if self.rollout_devices and self.max_staleness == 0:
            raise ConfigError(
                f"off_policy.rollout_devices={self.rollout_devices} needs off_policy.max_staleness >= 1: synchronous "
                "steps would leave the trainer's devices idle while the sampler's sample, and the other way round")
