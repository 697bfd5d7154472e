"""What a run is built from, once: tokenizer, task, mesh, model, sampler, optimizer, jitted step
functions. `build(config)` returns a `RunContext`; nothing in it changes while the run goes on
(what does change - step, data position, params, optimizer state, reference - is `RunState`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from grpo_jax import config as config_lib
from grpo_jax.training import policy as policy_lib
from grpo_jax.config.batch_plan import BatchPlan
from grpo_jax import model as model_lib
from grpo_jax.training import trainable
from grpo_jax.training import rollout as rollout_lib
from grpo_jax.io import run_paths
from grpo_jax.distributed import sharding
from grpo_jax.training import step as step_lib
from grpo_jax.training import teacher as teacher_lib
from grpo_jax.io.chat_template_bounds import RenderLimits
from grpo_jax.distributed.processes import Processes
from grpo_jax.sampling.sampler import Sampler, SamplingConfig
from grpo_jax.rewards import calling
from grpo_jax.tasks import make_task
from grpo_jax.tasks.user_rewards import with_reward_funcs
from grpo_jax.io.tokenizer import load_tokenizer

log = logging.getLogger("grpo_jax")

# Powers of two from 8: short built-in prompts ("07+45=") are not padded to 16, which would double
# the update's sequence length; a few buckets keep recompiles to the first steps.
PROMPT_BUCKETS = tuple(8 << i for i in range(12))


@dataclasses.dataclass
class RunState:
    """Everything a step changes; a checkpoint holds exactly this (plus the config)."""

    step: int  # GRPO steps done
    data_position: int  # training examples drawn so far (every round of dynamic sampling counts)
    params: Any  # the policy, training layout
    opt_state: Any  # Optax state, laid out like the params
    ref_params: Any | None  # the frozen reference (None when grpo.beta == 0)
    # Asynchronous rollouts (off_policy.max_staleness = k): the k params snapshots the next k steps'
    # rollouts sample from, slot j for step `step + 1 + j` (grpo_jax.training.async_rollouts); () otherwise.
    rollout_params: tuple = ()
    # Adapters (grpo_jax.training.policy): `params` are the adapters and this is the frozen base
    # they merge into, which is also the reference. None under full fine-tuning.
    base_params: Any | None = None
    # The diagnostics' window restored from a checkpoint (`Diagnostics.state_dict`), else None.
    diagnostics: dict | None = None


@dataclasses.dataclass(frozen=True)
class RolloutPlacement:
    """Where asynchronous rollouts run: on the trainer's devices from a second host thread
    (`split` False), or on a mesh of their own (`off_policy.rollout_devices`). `to_sampler(params)` is
    the sampler's copy of the policy: a device copy (the update donates the params it read) or a
    reshard onto the sampler's devices (the weight sync)."""

    sampler: Sampler
    mesh: jax.sharding.Mesh
    split: bool
    param_shardings: Any  # of the sampler's copy

    def to_sampler(self, params):
        if self.split:
            return jax.device_put(params, self.param_shardings)
        return step_lib.frozen_copy(params, jnp.float32)


@dataclasses.dataclass(frozen=True)
class RunContext:
    config: config_lib.Config
    run_dir: Any  # etils.epath.Path: a local directory or object storage (gs://...)
    tokenizer: Any
    task: Any
    mesh: jax.sharding.Mesh
    processes: Processes
    model_config: model_lib.ModelConfig
    graphdef: Any
    sampler: Sampler
    rollout_sampling: SamplingConfig
    tx: Any  # optax.GradientTransformation
    schedule: Any  # optax.Schedule, per optimizer update
    update_fn: Any  # step.make_update_fn, sharded for the mesh
    logprob_fn: Any  # step.make_logprob_fn, rows over the mesh
    bucketing: Any  # length_buckets.Bucketing, or None (grpo.bucket_by_length="off")
    base_key: jax.Array
    eval_examples: list[dict]
    pool: Any  # rewards.VerifierPool or None
    rollout: RolloutPlacement | None = None  # off_policy.max_staleness > 0
    # What trains, what the sampler and the reference read (full fine-tuning or adapters).
    policy: policy_lib.Policy = policy_lib.Policy()
    # On-policy distillation (grpo.teacher_model_name_or_path): the frozen teacher (grpo_jax.training.teacher),
    # here and not in RunState: never trained, never checkpointed, read from its path again on resume.
    teacher: Any = None

    @property
    def uses_reference(self) -> bool:
        return self.config.grpo.beta > 0

    def policy_params(self, state: RunState):
        """The policy's full params (for the sampler, evaluation, pi_old passes and export)."""
        return self.policy.full_params(state)

    def sampler_params(self, state: RunState):
        """What the sampler is called with: the policy's full params, or for a vLLM engine with
        adapters training (`VllmEngine`) the adapters and base, so only the adapters go over."""
        if self.policy.trains_adapters and self.config.sampling.engine == "vllm":
            from grpo_jax.sampling.vllm_engine import AdapterWeights

            return AdapterWeights(adapters=state.params, base=state.base_params, spec=self.policy.adapters,
                                  alpha=self.policy.alpha)
        return self.policy_params(state)

    def reference_params(self, state: RunState):
        """The reference policy's params (`Policy.reference`)."""
        return self.policy.reference(state)

    @property
    def ref_dtype(self):
        return reference_dtype(self.config)

    @property
    def updates_per_step(self) -> int:
        return BatchPlan.of(self.config.grpo).updates_per_step

    def step_key(self, step: int) -> jax.Array:
        return jax.random.fold_in(self.base_key, step)


def build_model(config: config_lib.Config, tokenizer, mesh) -> tuple[model_lib.ModelConfig, Any, Any]:
    """(model config, graphdef, params): a Hugging Face checkpoint or a fresh init, sharded on `mesh`.

    Float32 master weights always (`model.param_dtype`; config validation refuses bfloat16 masters),
    whatever `model.dtype` computes in. A fresh model is initialised through `jax.eval_shape` +
    `jax.jit(out_shardings=...)`, so it is never built whole on one device.
    """
    m = config.model
    if m.hf_path:
        from flax import nnx

        from grpo_jax.io import hf

        try:
            model = hf.load_model(m.hf_path, dtype=m.dtype, param_dtype="float32", remat=m.remat,
                                  attention_impl=m.attention_impl)
        except FileNotFoundError as e:
            raise config_lib.ConfigError(f"model.hf_path={m.hf_path!r}: {e}") from None
        check_vocab(model.config.vocab_size, tokenizer, f"model.hf_path={m.hf_path!r}'s config.json", m)
        log_attention(model.config)
        graphdef, params = nnx.split(model)
        return model.config, graphdef, sharding.put_sharded(params, sharding.param_shardings(mesh, params))
    vocab = m.vocab_size or tokenizer.vocab_size
    check_vocab(vocab, tokenizer, f"model.vocab_size={vocab}", m)
    model_config = m.model_config(vocab)
    log_attention(model_config)
    graphdef, params = sharding.init_params_sharded(mesh, model_config, m.init_seed)
    return model_config, graphdef, params


def abstract_model(model_config: model_lib.ModelConfig, mesh, seed: int) -> tuple[Any, Any]:
    """(graphdef, params) of a fresh model as `build_model` lays it out, as ShapeDtypeStructs with
    their shardings (`jax.eval_shape`: no weight allocated); `check` builds the run from these."""
    from flax import nnx

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(model_config, seed)))
    params = jax.eval_shape(lambda: nnx.split(model_lib.init_model(model_config, seed))[1])
    return graphdef, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                                  sharding.param_shardings(mesh, params))


def reference_dtype(config: config_lib.Config):
    """The frozen reference's dtype (`grpo.ref_dtype`)."""
    return jnp.bfloat16 if config.grpo.ref_dtype == "bfloat16" else jnp.float32


def log_attention(model_config: model_lib.ModelConfig) -> None:
    """The attention kernel this backend runs and the remat policy, once at start-up."""
    from grpo_jax.model import attention
    from grpo_jax.model.config import DTYPES

    c = model_config
    windows = "" if c.layer_types is None else (
        f"; sliding window {c.sliding_window} in {c.layer_types.count('sliding_attention')} of {c.num_layers} layers")
    log.info("%s; remat=%s%s", attention.describe(c.attention_impl, dtype=DTYPES[c.dtype],
                                                   head_dim=c.head_dim), c.remat_policy, windows)


def replays_routing(config: config_lib.Config) -> bool:
    """Whether the trainer replays the sampler's routing (`off_policy.router_replay="R3"`): the
    rollout then records each token's experts and every trainer pass uses them."""
    return config.off_policy.router_replay == "R3"


def check_router_replay(config: config_lib.Config, model_config: model_lib.ModelConfig) -> None:
    """Routing replay and the load-balancing loss need a model with experts; known only once the
    model is loaded (the engine's rules are `config.validate`'s)."""
    where = f"model.hf_path={config.model.hf_path!r}" if config.model.hf_path else "a fresh model from model.*"
    if config.grpo.router_aux_loss_coef and not model_config.num_experts:
        raise config_lib.ConfigError(
            f"grpo.router_aux_loss_coef={config.grpo.router_aux_loss_coef} on a dense model ({where} has "
            "num_experts=0): there is no router to balance; set grpo.router_aux_loss_coef=0")
    if config.off_policy.router_replay != "disabled" and not model_config.num_experts:
        raise config_lib.ConfigError(
            f"off_policy.router_replay={config.off_policy.router_replay!r} on a dense model ({where} has "
            "num_experts=0): there is no routing to replay; set off_policy.router_replay='disabled'")


def check_vocab(model_vocab: int, tokenizer, where: str, m: config_lib.ModelSection) -> None:
    """At start-up, not at the first evaluation inside the sampler: every id the tokenizer can
    produce (its vocabulary, its stop and pad ids) must be a row of the model's embedding."""
    ids = [tokenizer.vocab_size - 1, tokenizer.pad_id, *(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))]
    if max(ids) >= model_vocab:
        raise config_lib.ConfigError(
            f"the tokenizer ({m.tokenizer_spec()}) has ids up to {max(ids)} but the model has {model_vocab} "
            f"({where}); use the checkpoint's own tokenizer or a model.vocab_size >= {max(ids) + 1}"
        )


def auto_sampler_threads() -> int:
    """2 on a one-device CPU backend with >= 2 cores, else 1: XLA runs one decode loop on one core,
    and two half batches decoded from two threads run side by side (benchmarks/NOTES.md).
    Accelerators and multi-device meshes keep one stream."""
    one_cpu_device = jax.default_backend() == "cpu" and jax.device_count() == 1
    return 2 if one_cpu_device and (os.cpu_count() or 1) >= 2 else 1


def build_sampler(config: config_lib.Config, graphdef, model_config, tokenizer, mesh, params=None):
    """The trainer's (and `eval`'s) sampler: every stop id of the tokenizer, rows over the mesh; with
    sampling.engine="vllm" a `VllmEngine` (started from `params` when the run has no checkpoint)."""
    if config.sampling.engine == "vllm":
        from grpo_jax.sampling import vllm_setup

        return vllm_setup.build_engine(config, graphdef, model_config, params, tokenizer, PROMPT_BUCKETS)
    return Sampler(
        graphdef,
        model_config,
        eos_id=tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,)),
        pad_id=tokenizer.pad_id,
        prompt_buckets=PROMPT_BUCKETS,
        mesh=mesh,
        threads=config.sampling.threads or auto_sampler_threads(),
        engine=config.sampling.resolved_engine(),
        decode_slots=config.sampling.decode_slots,
        refill_every=config.sampling.refill_every,
    )


def check_batch_fits_mesh(config: config_lib.Config, mesh) -> None:
    """Row counts that must split over the mesh's devices (and processes), as ConfigErrors naming
    the fields (config validation's mesh-time half: `config.validate_for_devices`)."""
    config_lib.validate_for_devices(config, mesh.size + config.off_policy.rollout_devices, jax.process_count(),
                                    jax.default_backend())


def configured_tokenizer(config: config_lib.Config):
    """`model.tokenizer`, or the checkpoint's own (`model.hf_path`) when it is not set; a bad spec
    or a missing path is a ConfigError naming the field."""
    spec = config.model.tokenizer_spec()
    try:
        tokenizer = load_tokenizer(spec)
    except (ValueError, FileNotFoundError, OSError) as e:
        field = "model.tokenizer" if config.model.tokenizer else "model.hf_path (its tokenizer)"
        raise config_lib.ConfigError(f"{field}={spec!r}: {e}") from None
    tokenizer.chat_template_limits = RenderLimits(max_seconds=config.model.chat_template_max_seconds,
                                                  max_chars=config.model.chat_template_max_chars)
    return tokenizer


def configured_task(config: config_lib.Config, tokenizer=None):
    """The configured task; unknown names or options, and unreadable data, are ConfigErrors.
    `tokenizer`: whose chat template says how tools are called (`task.tool_call_parser="auto"`)."""
    try:
        task = make_task(config.task.name, **config.task.options)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as e:
        raise config_lib.ConfigError(f"task {config.task.name!r} (task.options={config.task.options}): {e}") from None
    return with_configured_environment(config, with_configured_rewards(config, task), tokenizer)


def tool_call_parser(config: config_lib.Config, tokenizer) -> str:
    """`task.tool_call_parser`, "auto" read off the tokenizer's chat template (text prompts, or a
    template that shows no tool-call format: "hermes")."""
    from grpo_jax.episodes.tool_calls import tool_family_for

    if config.task.tool_call_parser != "auto":
        return config.task.tool_call_parser
    templates = getattr(tokenizer, "chat_templates", None)
    try:
        return tool_family_for(templates.select(tools=[]) if templates is not None else None)
    except ValueError:
        return "hermes"


def with_configured_environment(config: config_lib.Config, task, tokenizer=None):
    """`task` played as episodes against `task.environment` or over `task.tools` (import paths), if set."""
    spec = config.task.environment or list(config.task.tools)
    if not spec:
        return task
    from grpo_jax.episodes.task import with_environment
    from grpo_jax.episodes.tools import make_environment_factory

    field = "task.environment" if config.task.environment else "task.tools"
    try:
        factory = make_environment_factory(spec, family=tool_call_parser(config, tokenizer))
    except ValueError as e:
        raise config_lib.ConfigError(f"{field}={spec!r}: {e}") from None
    return with_environment(task, factory)


def with_configured_rewards(config: config_lib.Config, task):
    """`task` with `rewards.reward_funcs` (import paths) in place of its own reward functions, if set."""
    if not config.rewards.reward_funcs:  # (weights without functions: RewardsSection.validate refuses them)
        return task
    try:
        return with_reward_funcs(task, config.rewards.reward_funcs, config.rewards.reward_weights)
    except ValueError as e:
        raise config_lib.ConfigError(f"rewards.reward_funcs={list(config.rewards.reward_funcs)}: {e}") from None


def split_devices(config: config_lib.Config, devices: list | None = None) -> tuple[list, list]:
    """(the trainer's devices, the sampler's) of `devices` (default: all): the last
    `off_policy.rollout_devices` sample. Refuses a split that leaves no trainer device, or rows that do
    not split over the sampler's devices, or asynchronous rollouts over several processes (`train`
    and `check` both call this, so they refuse the same configs with the same words)."""
    devices = list(jax.devices() if devices is None else devices)
    config_lib.validate_for_devices(config, len(devices), jax.process_count(), jax.default_backend(), batch=False)
    r = config.off_policy.rollout_devices
    return (devices[: len(devices) - r], devices[len(devices) - r:]) if r else (devices, [])


def configured_mesh(config: config_lib.Config, devices: list | None = None):
    """The (data, fsdp, expert, tensor) mesh over the trainer's devices (every device of `devices`, default
    all, unless `off_policy.rollout_devices`); a size that does not fit is a ConfigError."""
    m = config.mesh
    devices, _ = split_devices(config, devices)
    try:
        mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices, expert=m.expert)
    except ValueError as e:
        where = " left for training by off_policy.rollout_devices" if config.off_policy.rollout_devices else ""
        raise config_lib.ConfigError(f"{e} ({len(devices)} {jax.default_backend()} devices{where})") from None
    log.info("backend %s, %d device(s) on %d process(es) (%s); mesh %s", jax.default_backend(), jax.device_count(),
             jax.process_count(), jax.devices()[0].device_kind, " ".join(f"{a}={n}" for a, n in mesh.shape.items()))
    return mesh


def rollout_placement(config: config_lib.Config, graphdef, model_config, tokenizer, mesh, sampler,
                      params) -> RolloutPlacement | None:
    """Asynchronous rollouts' sampler and devices (None when off_policy.max_staleness = 0). One process
    only: the rollout thread's gathers would interleave with the trainer's across processes."""
    if config.off_policy.max_staleness == 0:
        return None
    _, rollout_devices = split_devices(config)  # its refusals ran in configured_mesh already
    if not rollout_devices:
        return RolloutPlacement(sampler=sampler, mesh=mesh, split=False,
                                param_shardings=sharding.param_shardings(mesh, params))
    # The sampler's mesh: rows over its devices, each holding the whole weights (as a data-parallel
    # inference server does).
    rollout_mesh = sharding.make_mesh(len(rollout_devices), 1, 1, devices=rollout_devices)
    return RolloutPlacement(sampler=build_sampler(config, graphdef, model_config, tokenizer, rollout_mesh),
                            mesh=rollout_mesh, split=True,
                            param_shardings=sharding.param_shardings(rollout_mesh, params))


def build(config: config_lib.Config, *, task=None, tokenizer=None) -> tuple[RunContext, RunState]:
    """(every fixed part of a run, its freshly initialised state) from `config`; `task` and
    `tokenizer` replace the configured ones."""
    t_cfg, s_cfg, e_cfg = config.train, config.sampling, config.eval
    tokenizer = tokenizer or configured_tokenizer(config)
    if task is None:
        task = configured_task(config, tokenizer)
    elif getattr(task, "environment_factory", None) is None:  # a task played as episodes keeps its own
        task = with_configured_environment(config, with_configured_rewards(config, task), tokenizer)
    # Data sets with a finite list of examples are checked once, here, so an over-long prompt is
    # skipped (or refused, naming file and line) before it can stop the run at the same step on
    # every resume. Counted as the rollout encodes prompts.
    check_lengths = getattr(task, "check_prompt_lengths", None)
    # An episode's later turns are prompted with everything so far: the prompt and up to
    # max_new_tokens of turns and replies, which must fit the largest bucket too.
    room = max(PROMPT_BUCKETS) - (s_cfg.max_new_tokens if getattr(task, "environment_factory", None) else 0)
    if room <= 0:
        raise config_lib.ConfigError(
            f"sampling.max_new_tokens={s_cfg.max_new_tokens}: an episode's context (prompt, turns and replies) must "
            f"fit the sampler's largest prompt bucket ({max(PROMPT_BUCKETS)} tokens); lower it")
    if check_lengths is not None:
        try:
            check_lengths(lambda prompt: len(rollout_lib.encode_prompt(tokenizer, prompt)), room,
                          config.task.overlong_prompts)
        except ValueError as e:  # the data's own problem, named with file and line: exit 2, one line
            text = str(e).replace("(on_overlong='skip')", "(task.overlong_prompts=skip)")
            raise config_lib.ConfigError(f"task.overlong_prompts={config.task.overlong_prompts}: {text}") from None
    # A reward function whose signature cannot take the trainer's call stops the run here, not at step 1.
    try:
        calling.check_signatures(task.reward_fns(), [k for k in task.train_example(0) if k != "prompt"])
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    mesh = configured_mesh(config)
    check_batch_fits_mesh(config, mesh)
    model_config, graphdef, params = build_model(config, tokenizer, mesh)
    config.mesh.check_model(model_config.num_experts)
    check_router_replay(config, model_config)
    sampler = build_sampler(config, graphdef, model_config, tokenizer, mesh, params)
    teacher = teacher_lib.load(config, tokenizer, mesh, model_config.vocab_size)
    # What trains: every weight, or adapters over a frozen base (grpo_jax.training.policy).
    tr = trainable.build_training(config, mesh, model_config, graphdef, params)
    pool = None
    if config.rewards.workers > 0:
        from grpo_jax.rewards import VerifierPool

        pool = VerifierPool(config.rewards.workers)
    context = RunContext(
        config=config,
        run_dir=run_paths.as_path(t_cfg.run_dir),
        tokenizer=tokenizer,
        task=task,
        mesh=mesh,
        processes=Processes(mesh),
        model_config=model_config,
        graphdef=graphdef,
        sampler=sampler,
        rollout_sampling=SamplingConfig(
            max_new_tokens=s_cfg.max_new_tokens,
            temperature=s_cfg.temperature,
            top_k=s_cfg.top_k,
            top_p=s_cfg.top_p,
            ignore_eos=s_cfg.ignore_eos,
            record_experts=replays_routing(config),
        ),
        tx=tr.tx,
        schedule=tr.schedule,
        update_fn=tr.update_fn,
        logprob_fn=tr.logprob_fn,
        bucketing=tr.bucketing,
        base_key=jax.random.PRNGKey(t_cfg.seed),
        eval_examples=task.eval_examples()[: e_cfg.num_questions] if e_cfg.num_questions else [],
        pool=pool,
        rollout=rollout_placement(config, graphdef, model_config, tokenizer, mesh, sampler,
                                  tr.params if tr.base is None else tr.base),
        policy=tr.policy,
        teacher=teacher,
    )
    return context, RunState(step=0, data_position=0, params=tr.params, opt_state=tr.opt_state, ref_params=None,
                             base_params=tr.base)
