"""Typed configuration for a grpo_jax run: one dataclass per section, validated on construction.

A config file is a Python module with `get_config() -> Config` (big_vision style). The command line
changes single fields with `--set section.field=value`; values are parsed by the field's declared type,
and an unknown key or a bad value is a `ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import traceback
import types
import typing
from typing import Any, Literal


DEFAULT_TOKENIZER = "char:0123456789+="


class ConfigError(ValueError):
    """A config key or value that is not allowed; the message names it and what would be right."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy. Either `hf_path` (a Hugging Face checkpoint directory) or the shape fields below."""

    hf_path: str | None = None
    # See grpo_jax.io.tokenizer.load_tokenizer for accepted specs. None: the checkpoint's own tokenizer
    # (`hf_path`), else the demo's 14-symbol "char:0123456789+=".
    tokenizer: str | None = None
    vocab_size: int = 0  # 0: taken from the tokenizer
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # The stored (master) weights; only float32 trains (validation says why). `dtype` is the compute
    # dtype: bfloat16 there runs the forward and backward in bf16 on float32 masters.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # What each layer keeps for the backward pass (jax.checkpoint per layer). False / "none":
    # everything. True / "layer_inputs": only its input, the rest recomputed (~1/3 more forward
    # compute; activation memory about one layer's plus each layer's input). "dots": also its
    # projections' outputs, only attention and elementwise work recomputed. `check` shows each.
    remat: bool | Literal["none", "layer_inputs", "dots"] = False
    # The attention kernel (grpo_jax.model.attention): "auto" picks cuDNN on GPUs, splash on TPUs
    # where they apply, else the reference "xla" kernel for small calls and "blockwise" (memory
    # linear in the length) beyond. The choice is logged at start-up.
    attention_impl: Literal["auto", "xla", "blockwise", "cudnn", "splash"] = "auto"
    init_seed: int = 0
    # LoRA (TRL's ModelConfig names; grpo_jax.model.lora): lora_r > 0 trains rank-r adapters on the
    # lora_target_modules (HF names, or the presets "attention" / "all-linear") of a frozen base,
    # which is also the reference policy; 0 trains every weight. B starts at 0 (step 0 = the base);
    # A as peft's "kaiming" (default) or "gaussian". The base may be stored in bfloat16.
    lora_r: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    lora_init: Literal["kaiming", "gaussian"] = "kaiming"
    lora_base_dtype: Literal["float32", "bfloat16"] = "float32"
    # Bounds on rendering the tokenizer's chat template (it comes with the checkpoint: untrusted
    # code; grpo_jax.io.chat_template_bounds): wall time and characters, output and any value built.
    chat_template_max_seconds: float = 2.0
    chat_template_max_chars: int = 4_000_000

    def tokenizer_spec(self) -> str:
        """The tokenizer this model uses: `tokenizer`, else `hf_path`'s, else the demo's."""
        return self.tokenizer or self.hf_path or DEFAULT_TOKENIZER


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """The data: a built-in generator or a JSONL file (`grpo_jax.tasks.make_task(name, **options)`)."""

    name: str = "arithmetic"
    options: dict = dataclasses.field(default_factory=dict)
    # A data file's example whose prompt is longer than the sampler's largest prompt bucket: "skip"
    # (checked once at start-up, counted in a warning) or "error" (naming file and line).
    overlong_prompts: Literal["skip", "error"] = "skip"
    # Your own reward functions, in place of the task's: import paths "package.module:function"
    # (TRL's reward_funcs), each called as TRL calls it; reward_weights: one per function (TRL's
    # name; empty: 1.0 each). See grpo_jax.tasks.user_rewards.
    reward_funcs: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = False  # benchmarks: every completion runs to max_new_tokens
    # Host threads that each decode an equal share of the prompts (same samples for any count).
    # 0: auto, 2 on a one-device CPU backend with >= 2 cores (a decode loop keeps one core busy), else 1.
    threads: int = 0
    # "static": all rows decode until the longest stops. "continuous" (grpo_jax.sampling.continuous): a stopped
    # row's decode slot takes the next waiting row. "auto": continuous when completions can run long
    # (max_new_tokens > 128, EOS not ignored), where length tails make a static batch mostly padding.
    engine: Literal["auto", "static", "continuous"] = "auto"
    # Continuous engine: decode slots over all devices, per sampler thread (0: auto, see
    # grpo_jax.sampling.sampler.slots_per_device), and how often (in tokens) stopped rows' slots are refilled.
    decode_slots: int = 0
    refill_every: int = 8

    def resolved_engine(self) -> str:
        """The engine `engine` names, "auto" resolved."""
        if self.engine != "auto":
            return self.engine
        return "continuous" if self.max_new_tokens > 128 and not self.ignore_eos else "static"


@dataclasses.dataclass(frozen=True)
class GRPOSection:
    """GRPO proper. Names follow TRL's GRPOConfig where one exists."""

    prompts_per_step: int = 16
    num_generations: int = 8  # G, answers per prompt
    scale_rewards: Literal["group", "batch", "none"] = "group"
    advantage_eps: float = 1e-4
    eps_low: float = 0.2
    eps_high: float | None = None  # DAPO clip-higher; None: eps_low
    beta: float = 0.0  # KL weight; 0 skips the reference forward entirely
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
    # pi_old of the clipped ratio. "auto": the trainer's log-probs when the sampler correction is
    # on (read inside the loss when each batch gets one update, else a separate pass: "recompute"),
    # the sampler's when it is off. "sampler" takes the sampler's as pi_old (no correction possible).
    old_logprobs: Literal["auto", "sampler", "recompute"] = "auto"
    # Sampler/trainer mismatch (TRL's names and defaults): each token's clipped term is weighted by
    # pi_old / pi_sampler, truncated to or masked outside the clip band (losses.sampler_correction).
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    # None: 1 / clip_max in the mask modes, no lower bound in the truncate modes (TRL: none in both).
    vllm_importance_sampling_clip_min: float | None = None
    mask_truncated_completions: bool = False
    # A truncated completion never reached its final answer (seed, defence 3): "at_most_zero" caps
    # its reward at 0 (penalties still apply); "as_scored" keeps what the reward functions said.
    truncated_reward: Literal["at_most_zero", "as_scored"] = "at_most_zero"
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
        from grpo_jax.core import objectives

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

    def resolved_old_logprobs(self) -> Literal["sampler", "recompute", "in_loss"]:
        """Where pi_old comes from: the sampler's log-probs, a separate trainer pass over the batch
        before its updates, or the trainer's own log-probs inside the loss (stop_gradient): exact
        when the batch gets one update, whose params are pi_old's, and free."""
        if self.old_logprobs == "auto":
            if not self.vllm_importance_sampling_correction:
                return "sampler"
            return "in_loss" if self.num_iterations * self.num_minibatches == 1 else "recompute"
        return self.old_logprobs


@dataclasses.dataclass(frozen=True)
class OptimSection:
    learning_rate: float = 2e-4
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised warm-up on (prompt, answer) pairs; `steps=0` skips it."""

    steps: int = 0
    batch_size: int = 128
    learning_rate: float = 1e-3
    target_accuracy: float = 0.0  # stop once greedy validation accuracy reaches this (0: never stop early)
    eval_every: int = 10
    eval_size: int = 256


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int = 100  # 0: only at the start and the end
    num_questions: int = 200  # 0: no held-out evaluation
    num_samples: int = 8  # n answers per question for pass@k / maj@k
    ks: tuple[int, ...] = (1, 8)
    temperature: float = 1.0
    greedy: bool = True  # also report greedy accuracy


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = 600
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 1
    samples_every: int = 50
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    stop_after_steps: int = 0  # >0: stop cleanly (with a checkpoint) after this many steps in this process
    export_hf: bool = False  # write the final policy as HF safetensors to run_dir/hf
    verifier_workers: int = 0  # 0: verify in-process (fast built-in checkers); >0: a process pool
    # Per batch and reward function: a function that takes longer stops the run with an error
    # (in worker processes, killed, when verifier_workers > 0). 0: no limit.
    reward_timeout_s: float = 600.0
    # Updates whose loss or gradient norm is not finite are skipped (params unchanged) and counted;
    # this many steps in a row with a skipped update stop the run.
    max_nonfinite_steps: int = 3
    progress: bool = True
    # Scalar sinks besides metrics.jsonl (TRL's name): "tensorboard", "wandb" (WANDB_MODE=offline
    # works without a network); () for none. Each is skipped with a log line when not installed.
    report_to: tuple[str, ...] = ("tensorboard",)
    wandb_project: str = "grpo_jax"
    # Asynchronous rollouts: step n's batch is sampled from the params of step max(0, n - 1 - k),
    # so it runs while the k steps before it update. 0: the synchronous loop. See grpo_jax.training.async_rollouts.
    max_staleness: int = 0


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh (grpo_jax.distributed.sharding): batch rows over data x fsdp, weights over fsdp and tensor.

    -1 takes the devices left over. The default puts every local device on `data`.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # > 0 (with train.max_staleness >= 1): the last this-many devices sample, on their own mesh
    # (rows over them, weights whole on each); data x fsdp x tensor is laid over the rest and trains.
    rollout_devices: int = 0


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)

    def __post_init__(self):
        validate(self)


# ----------------------------------------------------------------------------------------------
# Validation: types from the annotations, then the few cross-field rules.


def _check_type(key: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
        return
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                _check_type(key, value, arg)
                return
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}={value!r} has the wrong type")
    if origin is tuple:
        if not isinstance(value, tuple):
            raise ConfigError(f"{key}={value!r} must be a tuple")
        (elem,) = typing.get_args(hint)[:1]
        for v in value:
            _check_type(key, v, elem)
        return
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            # `nan < 0` is False, so a NaN learning rate would pass every range check below.
            raise ConfigError(f"{key}={value!r} must be a finite number")
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is dict:
        ok = isinstance(value, dict)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ConfigError(f"{key}={value!r} must be of type {getattr(hint, '__name__', hint)}")


def _positive(key, value, *, allow_zero=False):
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def validate(config: Config) -> None:
    """Checks every field's type and the cross-field rules; raises ConfigError naming the key."""
    for section in dataclasses.fields(config):
        sec = getattr(config, section.name)
        hints = typing.get_type_hints(type(sec))
        for f in dataclasses.fields(sec):
            _check_type(f"{section.name}.{f.name}", getattr(sec, f.name), hints[f.name])
    g, o, t, s, e, sft, m = (
        config.grpo,
        config.optim,
        config.train,
        config.sampling,
        config.eval,
        config.sft,
        config.model,
    )
    for key, value in [
        ("grpo.prompts_per_step", g.prompts_per_step),
        ("grpo.num_iterations", g.num_iterations),
        ("grpo.num_minibatches", g.num_minibatches),
        ("grpo.grad_accum_steps", g.grad_accum_steps),
        ("sampling.max_new_tokens", s.max_new_tokens),
        ("sampling.refill_every", s.refill_every),
        ("train.steps", t.steps),
        ("eval.num_samples", e.num_samples),
        ("optim.learning_rate", o.learning_rate),
        ("sft.batch_size", sft.batch_size),
        ("train.keep_checkpoints", t.keep_checkpoints),
        ("train.log_every", t.log_every),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps),
    ]:
        _positive(key, value)
    for key, value in [
        ("grpo.beta", g.beta),
        ("grpo.eps_low", g.eps_low),
        ("sft.steps", sft.steps),
        ("optim.warmup_steps", o.warmup_steps),
        ("optim.weight_decay", o.weight_decay),
        ("optim.max_grad_norm", o.max_grad_norm),
        ("eval.every", e.every),
        ("eval.num_questions", e.num_questions),
        ("train.checkpoint_every", t.checkpoint_every),
        ("train.samples_every", t.samples_every),
        ("sampling.top_k", s.top_k),
        ("sampling.threads", s.threads),
        ("sampling.decode_slots", s.decode_slots),
        ("train.stop_after_steps", t.stop_after_steps),
        ("grpo.ref_resync_every", g.ref_resync_every),
        ("train.verifier_workers", t.verifier_workers),
        ("train.reward_timeout_s", t.reward_timeout_s),
        ("grpo.advantage_eps", g.advantage_eps),
        ("grpo.max_resample_rounds", g.max_resample_rounds),
        ("train.max_staleness", t.max_staleness),
        ("mesh.rollout_devices", config.mesh.rollout_devices),
    ]:
        _positive(key, value, allow_zero=True)
    for sink in t.report_to:
        if sink not in ("tensorboard", "wandb"):
            raise ConfigError(f"train.report_to contains {sink!r}; choose from ['tensorboard', 'wandb'] (or [] for none)")
    if not t.run_dir.strip():
        raise ConfigError("train.run_dir is empty; give the directory for checkpoints, metrics and plots")
    if m.param_dtype == "bfloat16":
        raise ConfigError(
            "model.param_dtype='bfloat16': bf16 master weights do not train at RL learning rates. Near a "
            "weight of 0.02 bf16 values are ~1.2e-4 apart, so an AdamW step of lr 1e-6 rounds away and the "
            "weight never moves. Keep model.param_dtype='float32' and set model.dtype='bfloat16' to compute "
            "in bf16 (and grpo.ref_dtype='bfloat16' for a bf16 reference)"
        )
    _validate_lora(m, g)
    if g.ref_resync_every and g.beta == 0:
        raise ConfigError(
            f"grpo.ref_resync_every={g.ref_resync_every} does nothing with grpo.beta=0: no reference model is "
            "used (or kept, or checkpointed); set grpo.beta > 0 or grpo.ref_resync_every=0"
        )
    _validate_off_policy(config)
    _validate_distillation(g)
    _validate_estimator_and_entropy(g)
    _validate_objective(g)
    if g.num_generations < 2:
        raise ConfigError(
            f"grpo.num_generations={g.num_generations} must be >= 2: a group of one answer "
            "has no baseline, so every advantage would be 0"
        )
    if g.eps_high is not None and g.eps_high < 0:
        raise ConfigError(f"grpo.eps_high={g.eps_high} must be >= 0 or None")
    if not g.eps_low < 1:  # the clip range is [1 - eps_low, 1 + eps_high]: its floor must stay above 0
        raise ConfigError(f"grpo.eps_low={g.eps_low} must be in [0, 1) (the ratio is clipped to 1 - eps_low "
                          "from below; PPO and GRPO use 0.1-0.3)")
    for key, value in (("optim.b1", o.b1), ("optim.b2", o.b2)):
        if not 0 <= value < 1:  # Adam's moving averages: 1 or more never forgets or diverges
            raise ConfigError(f"{key}={value} must be in [0, 1) (Adam's decay rates; usual: b1 0.9, b2 0.99-0.999)")
    _positive("model.chat_template_max_seconds", m.chat_template_max_seconds)
    _positive("model.chat_template_max_chars", m.chat_template_max_chars)
    if s.temperature <= 0:
        raise ConfigError(f"sampling.temperature={s.temperature} must be > 0 (use eval.greedy for argmax)")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"sampling.top_p={s.top_p} must be in (0, 1]")
    if e.temperature <= 0:
        raise ConfigError(f"eval.temperature={e.temperature} must be > 0")
    batch = g.prompts_per_step * g.num_generations
    per_update = g.num_minibatches * g.grad_accum_steps
    if batch % per_update:
        raise ConfigError(
            f"grpo.num_minibatches * grpo.grad_accum_steps = {per_update} must divide the batch of "
            f"grpo.prompts_per_step * grpo.num_generations = {batch} completions"
        )
    for k in e.ks:
        if not 1 <= k <= e.num_samples:
            raise ConfigError(
                f"eval.ks contains {k}; each k must be in [1, eval.num_samples={e.num_samples}]"
            )
    if not 0 <= sft.target_accuracy <= 1:
        raise ConfigError(f"sft.target_accuracy={sft.target_accuracy} must be in [0, 1]")
    for key in ("data", "fsdp", "tensor"):
        value = getattr(config.mesh, key)
        if value == 0 or value < -1:
            raise ConfigError(f"mesh.{key}={value} must be a positive device count or -1 (the rest)")
    if m.hf_path is None:
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            _positive(f"model.{key}", getattr(m, key))
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={m.num_heads} must be a multiple of " f"model.num_kv_heads={m.num_kv_heads}"
            )


def _validate_estimator_and_entropy(g: GRPOSection) -> None:
    if g.adv_estimator == "grpo_passk" and g.scale_rewards == "batch":
        raise ConfigError("grpo.adv_estimator='grpo_passk' divides by its group's std ('group') or by nothing "
                          "('none'); grpo.scale_rewards='batch' has no meaning there")
    if not 0 <= g.top_entropy_quantile <= 1:
        raise ConfigError(f"grpo.top_entropy_quantile={g.top_entropy_quantile} must be in [0, 1] (1 keeps every token; "
                          "the 80/20 paper uses 0.2)")
    for key in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"):
        _positive(f"grpo.{key}", getattr(g, key), allow_zero=True)
    if g.use_adaptive_entropy and g.bucket_by_length == "on":
        raise ConfigError("grpo.use_adaptive_entropy keeps its controller in the optimizer state, which the "
                          "length-bucketed update does not read: set grpo.bucket_by_length='auto' or 'off'")
    if g.use_adaptive_entropy and not g.entropy_coef_min <= g.entropy_coef <= g.entropy_coef_max:
        raise ConfigError(f"grpo.entropy_coef={g.entropy_coef} (the adaptive controller's start) must lie in "
                          f"[grpo.entropy_coef_min, grpo.entropy_coef_max] = [{g.entropy_coef_min}, {g.entropy_coef_max}]")


def _validate_lora(m: ModelSection, g: GRPOSection) -> None:
    """The model.lora_* rules (validate)."""
    if m.lora_r < 0:
        raise ConfigError(f"model.lora_r={m.lora_r} must be >= 0 (0: full fine-tuning)")
    if m.lora_r:
        if m.lora_alpha <= 0:
            raise ConfigError(f"model.lora_alpha={m.lora_alpha} must be > 0 (the adapters' scale is alpha / r)")
        if m.lora_dropout:
            raise ConfigError(
                f"model.lora_dropout={m.lora_dropout}: grpo_jax merges the adapters into the weights (W + "
                "alpha/r * A @ B), which leaves no adapter-only input to drop; set it to 0")
        from grpo_jax.model.lora import resolve_targets  # noqa: PLC0415 - config stays importable on its own

        try:
            resolve_targets(m.lora_target_modules)
        except ValueError as e:
            raise ConfigError(f"model.lora_target_modules={list(m.lora_target_modules)}: {e}") from None
        if g.ref_resync_every:
            raise ConfigError(
                f"grpo.ref_resync_every={g.ref_resync_every} with model.lora_r={m.lora_r}: the reference is the "
                "frozen base itself; set grpo.ref_resync_every=0")


def _validate_distillation(g: GRPOSection) -> None:
    """The on-policy distillation rules (validate); the teacher's path and vocabulary are checked
    where it is read (grpo_jax.training.teacher.load, and `check`)."""
    if g.teacher_tau < 0:
        raise ConfigError(f"grpo.teacher_tau={g.teacher_tau} must be >= 0 (the distillation loss's weight)")
    if g.loss_top_k < 0:
        raise ConfigError(f"grpo.loss_top_k={g.loss_top_k} must be >= 0 (0: the sampled token; K: the teacher's "
                          "top K tokens)")
    if g.teacher_model_name_or_path is not None and not g.teacher_model_name_or_path.strip():
        raise ConfigError("grpo.teacher_model_name_or_path is empty; give a checkpoint directory or None")
    if g.teacher_model_name_or_path and g.bucket_by_length == "on":
        raise ConfigError("grpo.bucket_by_length='on' with grpo.teacher_model_name_or_path: the teacher's pass "
                          "runs over whole rows; set grpo.bucket_by_length='off' (or 'auto', which turns off)")


def _validate_objective(g: GRPOSection) -> None:
    """loss_type against aggregation and ratio, and the families' own settings (validate)."""
    if g.loss_type is not None:
        from grpo_jax.core import objectives

        try:
            objectives.resolve_loss_type(g.loss_type, g.aggregation, g.ratio)
        except ValueError as e:
            raise ConfigError(f"grpo.loss_type={g.loss_type!r} conflicts with "
                              + ("grpo.aggregation" if "aggregation=" in str(e) else "grpo.ratio")
                              + f": {e}") from None
    for key in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg",
                "clip_cov_ratio", "kl_cov_ratio"):
        _positive(f"grpo.{key}", getattr(g, key))
    for key in ("vespo_k_pos", "vespo_k_neg", "ppo_kl_coef"):
        _positive(f"grpo.{key}", getattr(g, key), allow_zero=True)
    if g.clip_ratio_c <= 1:
        raise ConfigError(f"grpo.clip_ratio_c={g.clip_ratio_c} must be > 1 (DPPO truncates the ratio at it)")
    if g.clip_cov_lb >= g.clip_cov_ub:
        raise ConfigError(f"grpo.clip_cov_lb={g.clip_cov_lb} must be below grpo.clip_cov_ub={g.clip_cov_ub}")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        if getattr(g, key) > 1:
            raise ConfigError(f"grpo.{key}={getattr(g, key)} must be in (0, 1] (a fraction of the tokens)")


def _validate_off_policy(config: Config) -> None:
    """The sampler-correction and asynchronous-rollout rules (validate)."""
    g, t = config.grpo, config.train
    clip_max, clip_min = g.vllm_importance_sampling_clip_max, g.vllm_importance_sampling_clip_min
    if clip_max is not None and clip_max <= 0:
        raise ConfigError(f"grpo.vllm_importance_sampling_clip_max={clip_max} must be > 0 (or None: no upper bound)")
    if clip_min is not None and clip_min < 0:
        raise ConfigError(f"grpo.vllm_importance_sampling_clip_min={clip_min} must be >= 0 (or None)")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ConfigError(f"grpo.vllm_importance_sampling_clip_min={clip_min} must be below "
                          f"grpo.vllm_importance_sampling_clip_max={clip_max}")
    if g.vllm_importance_sampling_correction and g.old_logprobs == "sampler":
        raise ConfigError(
            "grpo.old_logprobs='sampler' with grpo.vllm_importance_sampling_correction=True: the correction "
            "weighs each token by pi_old / pi_sampler, which is 1 when pi_old is the sampler's. Use "
            "grpo.old_logprobs='auto' (the trainer's pi_old) or turn the correction off"
        )
    if config.mesh.rollout_devices and t.max_staleness == 0:
        raise ConfigError(
            f"mesh.rollout_devices={config.mesh.rollout_devices} needs train.max_staleness >= 1: synchronous "
            "steps would leave the trainer's devices idle while the sampler's sample, and the other way round"
        )


# ----------------------------------------------------------------------------------------------
# Overrides and files.


def _parse_value(key: str, text: str, hint: Any) -> Any:
    """Parses `text` by the field's type; JSON syntax for dicts and tuples."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() in ("none", "null") and type(None) in typing.get_args(hint):
            return None
        errors = []
        for arg in args:
            try:
                return _parse_value(key, text, arg)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # X | None: X's own message ("choose one of ...")
            raise errors[0]
        raise ConfigError(f"--set {key}={text!r}: cannot read it as {hint}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if text not in allowed:
            raise ConfigError(f"--set {key}={text!r} is not allowed; choose one of {list(allowed)}")
        return text
    try:
        if hint is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint is str:
            return text
        if origin is tuple:
            return _parse_tuple(key, text, hint)
        if hint is dict:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (ValueError, json.JSONDecodeError):
        pass
    raise ConfigError(f"--set {key}={text!r}: expected {_accepted_example(key, hint)}")


_EXAMPLES = {int: "8", float: "0.5", bool: "true", str: "text"}
_PAIRS = {int: (1, 8), float: (1.0, 0.5), str: ("a", "b")}


def _accepted_example(key: str, hint: Any) -> str:
    """What `--set key=...` takes, with an example, for a type error."""
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        one, two = ("tensorboard", "wandb") if key == "train.report_to" else _PAIRS.get(item, ("a", "b"))
        return (f"a comma list of {item.__name__} (e.g. {key}={one},{two}; {key}= for none) or a JSON list "
                f"(e.g. {key}='{json.dumps([one, two])}')")
    if hint is dict:
        return f"a JSON object (e.g. {key}='{{\"name\": 1}}')"
    name = getattr(hint, "__name__", str(hint))
    return f"a value of type {name} (e.g. {key}={_EXAMPLES.get(hint, '...')})"


def _parse_tuple(key: str, text: str, hint: Any) -> tuple:
    """A tuple field: a JSON list, or a comma list (`a,b`; empty for none), items by the item type."""
    item = typing.get_args(hint)[0]
    stripped = text.strip()
    if stripped.startswith("["):
        value = json.loads(stripped)
        if not isinstance(value, list):
            raise ValueError
        return tuple(value)
    parts = [p.strip() for p in stripped.split(",")] if stripped else []
    if any(not p for p in parts):
        raise ValueError  # "a,,b"
    return tuple(_parse_value(key, p, item) for p in parts)


def apply_overrides(config: Config, overrides: list[str]) -> Config:
    """Returns `config` with each `section.field=value` (or `task.options.name=value`) applied.

    All overrides are applied first and the result is validated once, so the order of the flags
    does not matter (`eval.num_samples=2` then `eval.ks=[1,2]` is the same as the reverse)."""
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if parts[0] not in sections:
            raise ConfigError(f"--set {key}: unknown section {parts[0]!r}; sections are {sorted(sections)}")
        section = sections[parts[0]]
        if parts[:2] == ["task", "options"] and len(parts) == 3:
            # Task options are checked by the task itself; values are read as JSON when they parse.
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            new_section = dataclasses.replace(section, options={**section.options, parts[2]: value})
        else:
            if len(parts) != 2:
                raise ConfigError(f"--set {key}: expected section.field (or task.options.name)")
            hints = typing.get_type_hints(type(section))
            if parts[1] not in hints:
                raise ConfigError(
                    f"--set {key}: unknown field {parts[1]!r} in section {parts[0]!r}; "
                    f"fields are {sorted(hints)}"
                )
            new_section = dataclasses.replace(section, **{parts[1]: _parse_value(key, text, hints[parts[1]])})
        sections[parts[0]] = new_section
    return Config(**sections)  # validates once


def describe_fields() -> str:
    """Every `--set` key with its type and default, one per line, section by section (for --help)."""
    lines = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory().__class__
        hints = typing.get_type_hints(cls)
        defaults = section.default_factory()
        lines.append(f"  {section.name}:")
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            args = typing.get_args(hint)
            if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args and any(
                    typing.get_origin(a) is Literal for a in args):  # Literal[...] | None
                literal = next(a for a in args if typing.get_origin(a) is Literal)
                kind = "one of " + ", ".join(repr(a) for a in typing.get_args(literal) + (None,))
            elif typing.get_origin(hint) is Literal:
                kind = "one of " + ", ".join(repr(a) for a in args)
            else:
                kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            lines.append(f"    {section.name}.{f.name} = {getattr(defaults, f.name)!r}  ({kind})")
    return "\n".join(lines)


@contextlib.contextmanager
def _config_file_errors(path: str):
    """A config file that does not parse or raises: one ConfigError line with its file and line
    (a syntax error's own, else the deepest frame in that file), not a traceback through importlib."""
    try:
        yield
    except SyntaxError as e:
        raise ConfigError(f"{path}, line {e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - whatever the user's file raised, named with its line
        frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(path)]
        where = f"{path}, line {frames[-1].lineno}" if frames else path
        hint = ""
        if isinstance(e, TypeError) and "unexpected keyword argument" in str(e):
            hint = " (an unknown field: `python -m grpo_jax train --help` lists every section's fields)"
        raise ConfigError(f"{where}: {type(e).__name__}: {e}{hint}") from None


def load_config_file(path: str | os.PathLike) -> Config:
    """Imports a config file and calls its `get_config()`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_grpo_jax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    with _config_file_errors(path):
        spec.loader.exec_module(module)  # the user's own config file, not model output
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} has no get_config() function")
    with _config_file_errors(path):
        config = module.get_config()
    if not isinstance(config, Config):
        raise ConfigError(
            f"{path}: get_config() returned {type(config).__name__}, expected grpo_jax.config.Config"
        )
    return config


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def from_dict(data: dict) -> Config:
    """Inverse of `to_dict` (JSON round trip: lists become tuples where the field is a tuple)."""
    sections = {}
    for section in dataclasses.fields(Config):
        cls = section.default_factory().__class__
        values = dict(data.get(section.name, {}))
        hints = typing.get_type_hints(cls)
        unknown = set(values) - set(hints)
        if unknown:
            raise ConfigError(f"section {section.name!r} has unknown fields {sorted(unknown)}")
        for k, v in values.items():
            if typing.get_origin(hints[k]) is tuple and isinstance(v, list):
                values[k] = tuple(v)
        sections[section.name] = cls(**values)
    return Config(**sections)
