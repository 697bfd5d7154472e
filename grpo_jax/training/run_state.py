"""The run's state in and out of storage: restore it from the newest good checkpoint or start it
(after the SFT warm-up), save it (never from non-finite values), export the policy for Hugging Face.

`RunState` (grpo_jax.training.run_context) is exactly what a checkpoint holds, plus the config in its meta.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.io import run_paths
from grpo_jax.training import sft as sft_lib
from grpo_jax.io.checkpoint import CheckpointManager
from grpo_jax.training.run_context import RunContext, RunState

log = logging.getLogger("grpo_jax")



def _checkpoint_state(ctx: RunContext, state: RunState) -> dict:
    """What a checkpoint holds of `state` (`Policy.checkpoint_tree`)."""
    return ctx.policy.checkpoint_tree(state)


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                                if jnp.issubdtype(x.dtype, jnp.floating)]))


class NonFiniteStateError(RuntimeError):
    """The run's params or optimizer state hold NaN/inf; no checkpoint is written from them."""


# Meta fields a resume reads: a checkpoint without one of them is corrupt (falls back to an older one).
REQUIRED_META = ("step", "data_position", "config")


def save(ctx: RunContext, ckpt: CheckpointManager, state: RunState, diagnostics: dict | None = None) -> None:
    """Writes `state` (every process joins; Orbax writes asynchronously unless configured not to).

    Never from non-finite params or optimizer state: rotating good checkpoints out for a NaN one
    would lose the run (NonFiniteStateError instead; the earlier checkpoints stay). `diagnostics`:
    the warnings' window (`Diagnostics.state_dict`), so a resumed run warns where a straight one would."""
    tree = _checkpoint_state(ctx, state)
    # One check per device set: the rollout snapshots may live on the sampler's own devices.
    trainer_side = {k: v for k, v in tree.items() if k != "rollout_params"}
    if not all(bool(_all_finite(t)) for t in (trainer_side, tree.get("rollout_params", {})) if t):
        raise NonFiniteStateError(
            f"step {state.step}: params or optimizer state are not finite; no checkpoint written (the previous "
            f"ones in {ckpt_dir_of(ctx.run_dir)} are kept)"
        )
    meta = {"step": state.step, "data_position": state.data_position, "config": config_lib.to_dict(ctx.config)}
    if diagnostics is not None:
        meta["diagnostics"] = diagnostics
    ckpt.save(state.step, tree, meta, force=True)


def initial_state(ctx: RunContext, fresh: RunState, ckpt: CheckpointManager, resume: bool,
                  should_stop=lambda: False) -> RunState | None:
    """The state to start from: the newest good checkpoint with `resume`, else `fresh` after the SFT
    warm-up (if configured), with its reference copied from the warmed-up policy. None when
    `should_stop()` ended the warm-up early (nothing is saved: a new start repeats the warm-up)."""
    latest = ckpt.latest_step() if resume else None
    if resume and latest is None:
        log.warning("--resume: no checkpoint in %s; starting from scratch", ckpt_dir_of(ctx.run_dir))
    if latest is not None:
        # off_policy.max_staleness snapshots (full params) are restored in the sampler's layout.
        abstract = ctx.policy.abstract_checkpoint(
            fresh, ref_dtype=ctx.ref_dtype, uses_reference=ctx.uses_reference,
            snapshot_shardings=None if ctx.rollout is None else ctx.rollout.param_shardings,
            staleness=0 if ctx.rollout is None else ctx.config.off_policy.max_staleness)
        step, tree, meta = ckpt.restore(abstract, required_meta=REQUIRED_META)
        log.info("resumed from step %d (data position %d)", step, int(meta["data_position"]))
        return RunState(
            step=step,
            data_position=int(meta["data_position"]),
            params=tree["params"],
            opt_state=tree["opt_state"],
            ref_params=tree.get("ref_params"),
            rollout_params=tuple(tree["rollout_params"][str(j)] for j in range(len(tree.get("rollout_params", {})))),
            base_params=tree.get("base_params", fresh.base_params),
            diagnostics=meta.get("diagnostics"),
        )
    # The SFT warm-up trains every weight (with adapters: their base; they start after it).
    params = ctx.policy.warm_up_params(fresh)
    if ctx.config.sft.steps > 0:
        params, sft_stats = sft_lib.warm_up(
            ctx.graphdef,
            params,
            ctx.sampler,
            ctx.tokenizer,
            ctx.task,
            ctx.config.sft,
            max_new_tokens=ctx.config.sampling.max_new_tokens,
            seed=ctx.config.train.seed,
            log_fn=log.info,
            mesh=ctx.mesh,
            should_stop=should_stop,
            processes=ctx.processes,
        )
        if sft_stats.get("stopped"):
            return None
        if ctx.processes.is_primary:
            (ctx.run_dir / "sft.json").write_text(json.dumps(sft_stats, indent=2))
    return ctx.policy.after_warm_up(fresh, params, ref_dtype=ctx.ref_dtype, uses_reference=ctx.uses_reference,
                                    warmed_up=ctx.config.sft.steps > 0, mesh=ctx.mesh)


def export_hf(ctx: RunContext, state: RunState) -> None:
    """The policy as Hugging Face safetensors in run_dir/hf: every process joins the gather of the
    whole weights, process 0 writes them. With adapters that is the merged policy, and the policy
    writes its own files beside it (`Policy.write_export`: run_dir/peft)."""
    from grpo_jax.io import hf

    weights = ctx.processes.all_rows(ctx.policy_params(state))
    extra = ctx.policy.export_trees(state, ctx.processes.all_rows)
    if not ctx.processes.is_primary:
        return
    # From a checkpoint: its config, generation config and tokenizer files travel with the
    # weights (a round trip); from scratch: the ids our tokenizer gives.
    source = ctx.config.model.hf_path

    def write(local: str) -> None:
        save = lambda tree, where: hf.save_model(  # noqa: E731
            nnx.merge(ctx.graphdef, jax.tree.map(jax.numpy.asarray, tree)), where, source_dir=source,
            tokenizer=None if source else ctx.tokenizer)
        save(weights, os.path.join(local, "hf"))
        ctx.policy.write_export(extra, local, save, source=source, run_dir=ctx.run_dir)

    if run_paths.is_local(ctx.run_dir):
        write(os.fspath(ctx.run_dir))
        return
    # Object storage: written on the local disk, then copied file by file.
    with tempfile.TemporaryDirectory(prefix="grpo_jax_hf_") as local:
        write(local)
        for path in epath.Path(local).rglob("*"):
            if path.is_file():
                dst = ctx.run_dir / os.fspath(path.relative_to(local))
                dst.parent.mkdir(parents=True, exist_ok=True)
                path.copy(dst, overwrite=True)


def ckpt_dir_of(run_dir):
    return run_paths.as_path(run_dir) / "checkpoints"
