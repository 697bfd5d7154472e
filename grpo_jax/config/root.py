"""The whole config: `Config` (one field per section), its validation on construction (each
section's own rules, then the few rules between sections), and the mesh-time validation that
needs only the config and the device and process counts (`validate_for_devices`)."""

from __future__ import annotations

import dataclasses

from grpo_jax.config.batch_plan import BatchPlan
from grpo_jax.config.checks import ConfigError
from grpo_jax.config.data import RewardsSection, SamplingSection, TaskSection
from grpo_jax.config.grpo import GRPOSection
from grpo_jax.config.model import LoraSection, ModelSection
from grpo_jax.config.off_policy import OffPolicySection
from grpo_jax.config.run import EvalSection, MeshSection, OptimSection, SFTSection, TrainSection


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    rewards: RewardsSection = dataclasses.field(default_factory=RewardsSection)
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)
    off_policy: OffPolicySection = dataclasses.field(default_factory=OffPolicySection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)

    def __post_init__(self):
        validate(self)

    def resolved_old_logprobs(self) -> str:
        """Where pi_old comes from ("sampler", "recompute" or "in_loss"; OffPolicySection says how)."""
        return self.off_policy.resolved_old_logprobs(self.grpo.updates_per_batch())


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def validate(config: Config) -> None:
    """Each section's own checks (types from the annotations, ranges, rules between its fields),
    then the rules between sections; ConfigError naming the key."""
    for name in SECTIONS:
        section = getattr(config, name)
        if type(section) is not SECTIONS[name]().__class__:
            raise ConfigError(f"Config.{name} must be a {SECTIONS[name]().__class__.__name__}, got "
                              f"{type(section).__name__}")
        section.validate()
    if config.sampling.engine == "vllm" and config.off_policy.rollout_devices:
        raise ConfigError(
            f"off_policy.rollout_devices={config.off_policy.rollout_devices} with sampling.engine=vllm: vLLM places "
            "its own engine; give it devices of its own with sampling.vllm_mode=server, or set "
            "off_policy.rollout_devices=0")
    if config.sampling.engine == "vllm" and config.off_policy.max_staleness:
        raise ConfigError(
            f"off_policy.max_staleness={config.off_policy.max_staleness} with sampling.engine=vllm: asynchronous "
            "rollouts on a vLLM engine are not supported yet (an in-process engine crashed when synced from the "
            "rollout thread); set off_policy.max_staleness=0")
    _check_router_replay(config)
    if config.task.turn_rewards == "process" and config.grpo.adv_estimator != "grpo":
        raise ConfigError(
            f"task.turn_rewards='process' with grpo.adv_estimator={config.grpo.adv_estimator!r}: per-turn rewards "
            "are normalised over the group as the seed's process supervision does (GRPO's baseline); set "
            "grpo.adv_estimator='grpo' or task.turn_rewards='episode'")
    if config.lora.r:
        _refuse_adapters_peft_cannot_hold(config)
    if config.lora.r and config.grpo.ref_resync_every:
        raise ConfigError(
            f"grpo.ref_resync_every={config.grpo.ref_resync_every} with lora.r={config.lora.r}: the reference is "
            "the frozen base itself; set grpo.ref_resync_every=0")


def _refuse_adapters_peft_cannot_hold(config: Config) -> None:
    """Adapters on the experts or the router go nowhere peft's LoRA format reaches: refused here,
    before a run starts, where they would be written as one (the export's run_dir/peft, the vLLM
    engine's adapter syncs) rather than after the last step."""
    from grpo_jax.model.lora import NOT_PEFT_LINEAR, resolve_targets  # noqa: PLC0415 - the model layer, on demand

    bad = [t for t in resolve_targets(config.lora.target_modules) if t in NOT_PEFT_LINEAR]
    if not bad:
        return
    if config.train.export_hf and config.train.export_peft:
        raise ConfigError(
            f"lora.target_modules={list(config.lora.target_modules)} adapts {bad}, which peft's LoRA adapter format "
            "has no module for (transformers 5 keeps Qwen3-MoE's experts as fused parameters), so "
            "train.export_hf cannot write them to run_dir/peft; set train.export_peft=false to export the merged "
            "weights only (run_dir/hf), or leave them out of lora.target_modules")
    if config.sampling.engine == "vllm":
        raise ConfigError(
            f"lora.target_modules={list(config.lora.target_modules)} adapts {bad} with sampling.engine=vllm: the "
            "engine takes adapters as a peft LoRA directory, which has no module for them; use another "
            "sampling.engine or leave them out of lora.target_modules")


def _check_router_replay(config: Config) -> None:
    """Routing replay needs a sampler that records each token's experts: the static engine on
    single answers. (Whether the model has experts at all is known once it is loaded:
    `training.run_context.check_router_replay`.)"""
    if config.off_policy.router_replay == "disabled":
        return
    mode, engine = config.off_policy.router_replay, config.sampling.resolved_engine()
    if engine != "static":
        auto = f" (sampling.engine='auto' picks {engine!r} for sampling.max_new_tokens=" \
               f"{config.sampling.max_new_tokens})" if config.sampling.engine == "auto" else ""
        raise ConfigError(
            f"off_policy.router_replay={mode!r} with sampling.engine={config.sampling.engine!r}{auto}: only the "
            "static engine records the experts each token was routed to; set sampling.engine='static' or "
            "off_policy.router_replay='disabled'")
    if config.task.environment or config.task.tools:
        field = "task.environment" if config.task.environment else "task.tools"
        raise ConfigError(
            f"off_policy.router_replay={mode!r} with {field} set: an episode's turns are separate sampler calls "
            "whose experts are not stitched together yet; set off_policy.router_replay='disabled'")


def validate_for_devices(config: Config, num_devices: int, num_processes: int = 1, backend: str = "", *,
                         batch: bool = True) -> tuple[int, int, int]:
    """The mesh-time rules: what must split over `num_devices` devices (all of them, the sampler's
    included) and `num_processes` processes. Returns the trainer's (data, fsdp, tensor) mesh shape.
    `train` and `check` both call this, so they refuse the same configs with the same words;
    `backend` (e.g. "cpu") only names the devices in the messages. `batch=False`: only the device
    split and the mesh (what `eval` needs), not how a training step's rows split."""
    kind = f"{backend} devices" if backend else "devices"
    g, r, staleness = config.grpo, config.off_policy.rollout_devices, config.off_policy.max_staleness
    if r and r >= num_devices:
        raise ConfigError(f"off_policy.rollout_devices={r} leaves no device to train on ({num_devices} {kind})")
    if staleness and num_processes > 1:
        raise ConfigError(f"off_policy.max_staleness={staleness} runs in one process; this run has {num_processes}. "
                          "Use off_policy.max_staleness=0 on several processes")
    rows = g.prompts_per_step * g.num_generations
    if r and rows % r:
        raise ConfigError(f"grpo.prompts_per_step * grpo.num_generations = {rows} completions must split evenly over "
                          f"off_policy.rollout_devices={r}")
    try:
        shape = config.mesh.shape(num_devices - r)
    except ConfigError as e:
        where = " left for training by off_policy.rollout_devices" if r else ""
        raise ConfigError(f"{e} ({num_devices - r} {kind}{where})") from None
    if not batch:
        return shape
    multiple = shape[0] * shape[1] * shape[2]  # rows split over data x fsdp x expert
    rows_per_micro = BatchPlan.of(g, multiple).rows_per_micro_batch
    if rows_per_micro % multiple:
        raise ConfigError(
            f"a micro-batch of {rows_per_micro} completions (grpo.prompts_per_step * grpo.num_generations / "
            f"(grpo.num_minibatches * grpo.grad_accum_steps)) must split evenly over mesh.data * mesh.fsdp * mesh.expert = "
            f"{multiple} devices")
    if num_processes > 1 and (g.prompts_per_step % num_processes or g.prompts_per_step % multiple):
        raise ConfigError(
            f"grpo.prompts_per_step={g.prompts_per_step} must split evenly over {num_processes} processes and over "
            f"mesh.data * mesh.fsdp * mesh.expert = {multiple} devices (each process samples its share of the prompts)")
    if num_processes > 1 and config.sft.steps > 0 and config.sft.batch_size % multiple:
        raise ConfigError(
            f"sft.batch_size={config.sft.batch_size} must split evenly over mesh.data * mesh.fsdp * mesh.expert = {multiple} devices "
            "on several processes (each process feeds its devices' rows)")
    return shape
