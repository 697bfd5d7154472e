"""The `grpo` section: the GRPO objective (TRL's GRPOConfig names where TRL has one, verl's where
only verl does), its batch and update counts, the reference and the on-policy distillation term.
Validates itself (`GRPOSection.validate`); the sampler correction and pi_old's source are in
`off_policy` (grpo_jax.config.off_policy)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from grpo_jax.config.batch_plan import BatchPlan
from grpo_jax.config.checks import ConfigError, check_fields, nonnegative, positive


@dataclasses.dataclass(frozen=True)
class GRPOSection:
    """GRPO proper. Names follow TRL's GRPOConfig where one exists."""

    NAME: ClassVar[str] = "grpo"
    prompts_per_step: int = 16
    num_generations: int = 8  # G, answers per prompt
    scale_rewards: Literal["group", "batch", "none"] = "group"
    advantage_eps: float = 1e-4
    eps_low: float = 0.2
    eps_high: float | None = None  # DAPO clip-higher; None: eps_low
    beta: float = 0.0  # KL weight; 0 skips the reference forward entirely
    # Mixture-of-experts models: the routers' load-balancing loss (Switch Transformer's, as transformers
    # computes it, `grpo_jax.model.moe.load_balancing_loss`) times this is added to the loss. transformers'
    # name; it adds it only with output_router_logits, at the checkpoint's coefficient (0.001 for
    # Qwen3-MoE). 0: off (RL recipes usually leave it off: the policy loss alone moves the routers).
    router_aux_loss_coef: float = 0.0
    kl: Literal["k1", "k2", "k3"] = "k3"
    # The policy objective (grpo_jax.core.objectives): TRL's loss_type names where TRL has the family, verl's
    # loss_mode names otherwise. None: PPO's clipped term aggregated by `aggregation` (the seed's).
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "luspo", "cispo", "sapo", "vespo", "geo_mean",
                       "dppo_tv", "dppo_kl", "gpg", "clip_cov", "kl_cov"] | None = None
    # None: the loss_type's ("sequence" without one); TRL's loss types fix it (a different value is an error).
    aggregation: Literal["sequence", "token", "constant", "sequence_sum"] | None = None
    ratio: Literal["token", "sequence"] | None = None  # None: "sequence" for gspo and luspo, else "token"
    sapo_temperature_pos: float = 1.0  # SAPO's gate temperature where A > 0 (TRL's name and default)
    sapo_temperature_neg: float = 1.05  # ... where A <= 0
    vespo_k_pos: float = 2.0  # VESPO's phi(w) = e^lambda w^k e^(-lambda w) for A >= 0 (TRL's names, defaults)
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # ... for A < 0
    vespo_lambda_neg: float = 2.0
    clip_ratio_c: float = 3.0  # DPPO's truncation of the importance weight (verl's name and default)
    clip_cov_ratio: float = 0.0002  # Clip-Cov: fraction of tokens detached (verl's names and defaults)
    clip_cov_lb: float = 1.0  # ... drawn among those with clip_cov_lb < covariance < clip_cov_ub
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # KL-Cov: fraction of tokens penalised by ppo_kl_coef * |log r|
    ppo_kl_coef: float = 0.1
    num_iterations: int = 1  # mu: passes over each batch
    num_minibatches: int = 1  # optimizer steps per pass
    grad_accum_steps: int = 1  # micro-batches summed into one optimizer step
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups, top the batch up
    max_resample_rounds: int = 4
    ref_dtype: Literal["float32", "bfloat16"] = "float32"
    # Run each prompt through the model once per group of G rows in the reference and update
    # passes (the same log-probs, fewer tokens: benchmarks/NOTES.md). Off: every row runs its own copy.
    share_prompt_prefix: bool = True
    ref_resync_every: int = 0  # 0: never; else copy the policy into the reference every N steps (beta > 0)
    # Update/log-prob passes on length-sorted rows cut to bucketed lengths; auto: where it runs fewer tokens.
    bucket_by_length: Literal["auto", "on", "off"] = "auto"
    # On-policy distillation (grpo_jax.core.distillation, grpo_jax.training.teacher): the student's reverse KL to a
    # frozen teacher on its own samples, added to the policy loss. Grouped here, not in a section of
    # its own: it is one more term of this loss over the same tokens and normaliser, and the update
    # reads it from this section as it reads `beta` (no new argument through step/length_buckets).
    # TRL's names (DistillationConfig) where TRL has one; prime-rl's `teacher_tau` for the weight.
    teacher_model_name_or_path: str | None = None  # a local HF checkpoint directory; None: no teacher
    teacher_tau: float = 1.0  # loss = policy loss + teacher_tau * distillation loss
    # 0: the sampled token's log-ratio (Thinking Machines' estimate; TRL's 0 means the full
    # vocabulary, which here is loss_top_k = vocab size); K > 0: exact KL over the teacher's top K.
    loss_top_k: int = 0
    loss_add_tail: bool = True  # top-k: one bucket for the mass outside the K ids (TRL's default)
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"  # as ref_dtype: the teacher's weights
    # Advantage estimator by verl's name (grpo_jax.core.advantage_estimators); "grpo": group_advantages.
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo", "opo",
                           "grpo_passk"] = "grpo"
    # TRL's: the k3 KL times the differentiable ratio pi_theta / pi_old (DeepSeek-V3.2); only with beta > 0.
    use_bias_correction_kl: bool = True
    # Entropy control, TRL's names: loss -= entropy_coef * H (H aggregated like the policy loss), and
    # the policy term only on the top `top_entropy_quantile` of tokens by entropy (Beyond the 80/20 Rule).
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    # Skywork-OR1's adaptive coefficient: applied only while entropy <= entropy_target, moved by
    # entropy_coef_delta each update (up below the target, down above it) within [min, max].
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2

    def resolved_loss(self) -> tuple[str, str, str]:
        """(loss_type, aggregation, ratio) the update runs: loss_type None is the clipped term
        ("grpo" family) with `aggregation` ("sequence" when None) and `ratio` ("token" when None)."""
        if self.loss_type is None:
            return "grpo", self.aggregation or "sequence", self.ratio or "token"
        from grpo_jax.core import objectives  # noqa: PLC0415 - the core layer, on demand

        aggregation, ratio = objectives.resolve_loss_type(self.loss_type, self.aggregation, self.ratio)
        return self.loss_type, aggregation, ratio

    def resolved_aggregation(self) -> str:
        """The aggregation (and so the loss normaliser) the update uses; see `resolved_loss`."""
        return self.resolved_loss()[1]

    def objective_options(self) -> dict[str, float]:
        """The families' own settings, as `objectives.surrogate_for` takes them."""
        names = ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                 "vespo_lambda_neg", "clip_ratio_c", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                 "ppo_kl_coef")
        return {name: getattr(self, name) for name in names}

    def updates_per_batch(self) -> int:
        """Optimizer updates each batch gets: num_iterations passes of num_minibatches steps."""
        return self.num_iterations * self.num_minibatches

    def validate(self) -> None:
        """Types, ranges and the rules between this section's fields; ConfigError naming the key."""
        check_fields(self)
        positive(self, "prompts_per_step", "num_iterations", "num_minibatches", "grad_accum_steps")
        nonnegative(self, "beta", "eps_low", "ref_resync_every", "advantage_eps", "max_resample_rounds",
                    "router_aux_loss_coef")
        if self.ref_resync_every and self.beta == 0:
            raise ConfigError(
                f"grpo.ref_resync_every={self.ref_resync_every} does nothing with grpo.beta=0: no reference model "
                "is used (or kept, or checkpointed); set grpo.beta > 0 or grpo.ref_resync_every=0")
        self._validate_distillation()
        self._validate_estimator_and_entropy()
        self._validate_objective()
        if self.num_generations < 2:
            raise ConfigError(f"grpo.num_generations={self.num_generations} must be >= 2: a group of one answer "
                              "has no baseline, so every advantage would be 0")
        if self.eps_high is not None and self.eps_high < 0:
            raise ConfigError(f"grpo.eps_high={self.eps_high} must be >= 0 or None")
        if not self.eps_low < 1:  # the clip range is [1 - eps_low, 1 + eps_high]: its floor must stay above 0
            raise ConfigError(f"grpo.eps_low={self.eps_low} must be in [0, 1) (the ratio is clipped to 1 - eps_low "
                              "from below; PPO and GRPO use 0.1-0.3)")
        plan = BatchPlan.of(self)
        batch, per_update = plan.rows, plan.micro_batches_per_step
        if batch % per_update:
            raise ConfigError(
                f"grpo.num_minibatches * grpo.grad_accum_steps = {per_update} must divide the batch of "
                f"grpo.prompts_per_step * grpo.num_generations = {batch} completions")

    def _validate_distillation(self) -> None:
        """The on-policy distillation rules; the teacher's path and vocabulary are checked where it
        is read (grpo_jax.training.teacher.load, and `check`)."""
        if self.teacher_tau < 0:
            raise ConfigError(f"grpo.teacher_tau={self.teacher_tau} must be >= 0 (the distillation loss's weight)")
        if self.loss_top_k < 0:
            raise ConfigError(f"grpo.loss_top_k={self.loss_top_k} must be >= 0 (0: the sampled token; K: the "
                              "teacher's top K tokens)")
        path = self.teacher_model_name_or_path
        if path is not None and not path.strip():
            raise ConfigError("grpo.teacher_model_name_or_path is empty; give a checkpoint directory or None")
        if path and self.bucket_by_length == "on":
            raise ConfigError("grpo.bucket_by_length='on' with grpo.teacher_model_name_or_path: the teacher's pass "
                              "runs over whole rows; set grpo.bucket_by_length='off' (or 'auto', which turns off)")

    def _validate_estimator_and_entropy(self) -> None:
        if self.adv_estimator == "grpo_passk" and self.scale_rewards == "batch":
            raise ConfigError("grpo.adv_estimator='grpo_passk' divides by its group's std ('group') or by nothing "
                              "('none'); grpo.scale_rewards='batch' has no meaning there")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ConfigError(f"grpo.top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1 keeps "
                              "every token; the 80/20 paper uses 0.2)")
        nonnegative(self, "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
        if self.use_adaptive_entropy and self.bucket_by_length == "on":
            raise ConfigError("grpo.use_adaptive_entropy keeps its controller in the optimizer state, which the "
                              "length-bucketed update does not read: set grpo.bucket_by_length='auto' or 'off'")
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise ConfigError(f"grpo.entropy_coef={self.entropy_coef} (the adaptive controller's start) must lie in "
                              f"[grpo.entropy_coef_min, grpo.entropy_coef_max] = "
                              f"[{self.entropy_coef_min}, {self.entropy_coef_max}]")

    def _validate_objective(self) -> None:
        """loss_type against aggregation and ratio, and the families' own settings."""
        if self.loss_type is not None:
            from grpo_jax.core import objectives  # noqa: PLC0415

            try:
                objectives.resolve_loss_type(self.loss_type, self.aggregation, self.ratio)
            except ValueError as e:
                raise ConfigError(f"grpo.loss_type={self.loss_type!r} conflicts with "
                                  + ("grpo.aggregation" if "aggregation=" in str(e) else "grpo.ratio")
                                  + f": {e}") from None
        positive(self, "sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg",
                 "clip_cov_ratio", "kl_cov_ratio")
        nonnegative(self, "vespo_k_pos", "vespo_k_neg", "ppo_kl_coef")
        if self.clip_ratio_c <= 1:
            raise ConfigError(f"grpo.clip_ratio_c={self.clip_ratio_c} must be > 1 (DPPO truncates the ratio at it)")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(f"grpo.clip_cov_lb={self.clip_cov_lb} must be below grpo.clip_cov_ub={self.clip_cov_ub}")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if getattr(self, key) > 1:
                raise ConfigError(f"grpo.{key}={getattr(self, key)} must be in (0, 1] (a fraction of the tokens)")
