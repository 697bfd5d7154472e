"""What trains and the programs that train it, built once for `train` and `check`: the policy
(full fine-tuning or adapters, `grpo_jax.training.policy`), the optimizer and its state, and the
jitted update, log-prob pass and length-bucketed passes for the mesh. `build_training` makes them
concretely (arrays born in their shardings) or abstractly (ShapeDtypeStructs with the same
shardings, through the same code: `check` compiles the trainer's own programs with them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from grpo_jax import config as config_lib
from grpo_jax.core import entropy_control
from grpo_jax.distributed import sharding
from grpo_jax.model import remat as remat_lib
from grpo_jax.training import length_buckets
from grpo_jax.training import optim
from grpo_jax.training import policy as policy_lib
from grpo_jax.training import step as step_lib
from grpo_jax.config.batch_plan import BatchPlan


def step_functions(g_cfg: config_lib.GRPOSection, temperature: float, graphdef, tx, *, mesh, params, opt_state,
                   frozen=None, model_params_fn=None, model_config=None,
                   off_policy: config_lib.OffPolicySection = config_lib.OffPolicySection()):
    """(update_fn, logprob_fn, bucketing): the jitted update and log-prob pass for the mesh, each
    prompt run once per group where `step.prompt_groups` allows it, and the length-bucketed
    passes (`length_buckets.Bucketing`, None when grpo.bucket_by_length="off"). `params` are what
    trains; with a `frozen` base (`Policy.model_params_fn` merges the two inside the loss) the
    update takes it last and the log-prob pass runs on full params in its layout. `model_config`:
    for the compiler options its remat policy needs (`model.remat.backward_compiler_options`)."""
    options = remat_lib.backward_compiler_options(model_config)
    row_devices = sharding.batch_size_multiple(mesh)
    plan = BatchPlan.of(g_cfg, row_devices)
    update_group, logprob_group = step_lib.prompt_groups(g_cfg, plan.rows_per_micro_batch, row_devices)
    update_fn = sharding.shard_update_fn(
        step_lib.make_update_fn(graphdef, tx, g_cfg, temperature, group_size=update_group,
                                model_params_fn=model_params_fn, off_policy=off_policy),
        mesh, params, opt_state, frozen=frozen, compiler_options=options,
    )
    model_params = params if frozen is None else frozen
    logprob_fn = step_lib.make_logprob_fn(
        graphdef, temperature, mesh=mesh, params=model_params, group_size=logprob_group,
        row_chunks=step_lib.logprob_row_chunks(g_cfg, row_devices, logprob_group))
    # The teacher's pass runs over whole rows, not length buckets (config validation refuses "on"); the
    # adaptive entropy controller lives in opt_state, which only the unbucketed update reads.
    bucket_mode = "off" if g_cfg.teacher_model_name_or_path or g_cfg.use_adaptive_entropy else g_cfg.bucket_by_length
    bucketing = length_buckets.make_bucketing(
        bucket_mode, graphdef, tx, g_cfg, temperature, mesh=mesh, params=params, opt_state=opt_state,
        update_group=update_group, logprob_group=logprob_group, model_params_fn=model_params_fn, frozen=frozen,
        compiler_options=options, off_policy=off_policy,
    )
    return update_fn, logprob_fn, bucketing


@dataclasses.dataclass(frozen=True)
class Training:
    """The trainable side of a run as `build` lays it out, concrete or abstract (`check`)."""

    policy: policy_lib.Policy
    params: Any  # what trains: the model's params, or adapters
    base: Any | None  # adapters: the frozen base; None under full fine-tuning
    tx: Any  # optax.GradientTransformation
    schedule: Any  # optax.Schedule, per optimizer update
    opt_state: Any
    update_fn: Any
    logprob_fn: Any
    bucketing: Any


def build_training(config: config_lib.Config, mesh, model_config, graphdef, params, *,
                   abstract: bool = False) -> Training:
    """The policy (full fine-tuning or adapters), the optimizer and its state, and the jitted step
    functions over the model `params` (training layout). `abstract`: `params` are ShapeDtypeStructs
    with shardings, and so are the returned params, base and optimizer state (`jax.eval_shape` of
    the same programs: `check` builds the run with this, allocating nothing)."""
    g_cfg = config.grpo
    policy, params, base = policy_lib.build(config, mesh, params, abstract=abstract)
    tx, schedule = optim.make_optimizer(config.optim, BatchPlan.of(g_cfg).total_updates(config.train.steps))
    tx = entropy_control.with_controller(tx, g_cfg)  # adaptive entropy: its state rides in opt_state

    if abstract:  # as sharding.init_opt_state_sharded lays it out
        opt_state = jax.eval_shape(tx.init, params)
        opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_state,
                                 sharding.opt_state_shardings(mesh, opt_state, params))
    else:
        opt_state = sharding.init_opt_state_sharded(mesh, tx, params)
    update_fn, logprob_fn, bucketing = step_functions(
        g_cfg, config.sampling.temperature, graphdef, tx, mesh=mesh, params=params, opt_state=opt_state,
        frozen=base, model_params_fn=policy.model_params_fn, model_config=model_config,
        off_policy=config.off_policy)
    return Training(policy=policy, params=params, base=base, tx=tx, schedule=schedule, opt_state=opt_state,
                    update_fn=update_fn, logprob_fn=logprob_fn, bucketing=bucketing)
