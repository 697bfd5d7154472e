"""The policy as training sees it, for both kinds of fine-tuning: every weight trains (the
reference is a frozen copy), or LoRA adapters (`lora.r > 0`) train over a frozen base that
is also the reference. One `Policy` answers what trains, what the sampler reads, what the
reference is, what the update takes besides the trainable params, what a checkpoint holds and how
an export is written; the rest of training asks it and does not branch on the kind.

`build(config, mesh, params)` makes it with its trainable params and frozen base, concretely
(arrays born in their shardings) or abstractly (`abstract=True`: ShapeDtypeStructs with the same
shardings, for `check`), through the same code.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_jax import config as config_lib
from grpo_jax.distributed import sharding
from grpo_jax.model import lora as lora_lib
from grpo_jax.training import step as step_lib


@dataclasses.dataclass(frozen=True)
class Policy:
    """Full fine-tuning (`adapters` None), or adapters over a frozen base (`RunState.base_params`)."""

    adapters: lora_lib.LoraSpec | None = None
    merge_fn: Any = None  # adapters: jitted (adapters, base) -> full params, the base's training layout
    base_dtype: Any = None  # adapters: the frozen base's dtype after an SFT warm-up (None: as it is)
    base_in_checkpoint: bool = False  # adapters: the SFT warm-up changed the base, so checkpoints hold it
    alpha: float = 0.0  # adapters: lora.alpha, for the PEFT export
    export_peft: bool = True  # adapters: the export writes them as peft does too (train.export_peft)

    @property
    def trains_adapters(self) -> bool:
        return self.adapters is not None

    @property
    def model_params_fn(self) -> Callable | None:
        """For the loss: (trainable, frozen) -> the model's params, merged inside the gradient;
        None when the trainable params are the model's."""
        return None if self.adapters is None else self.adapters.model_params

    def full_params(self, state):
        """What the sampler, evaluation, the pi_old pass and the export read: the params, or the
        base with the adapters merged in."""
        return state.params if self.adapters is None else self.merge_fn(state.params, state.base_params)

    def reference(self, state):
        """The reference policy's params: the frozen copy, or the base itself."""
        return state.ref_params if self.adapters is None else state.base_params

    def abstract_full_params(self, state):
        """`full_params` of an abstract state (ShapeDtypeStructs): their shapes and layout."""
        if self.adapters is None:
            return state.params
        with jax.set_mesh(self.merge_fn.mesh):  # as MeshJit runs it
            return jax.eval_shape(self.merge_fn.jitted, state.params, state.base_params)

    def sampler_copy_is_separate(self, mesh, params) -> bool:
        """Whether the sampler's weights are a second copy beside the model `params`: always with
        adapters (it decodes from a merged copy), else where the decode layout differs."""
        return self.adapters is not None or sharding.decode_copy_is_separate(mesh, params)

    def update_extra_args(self, state) -> tuple:
        """What the update takes after (params, opt_state, batch): the frozen base, or nothing."""
        return () if state.base_params is None else (state.base_params,)

    def for_snapshots(self) -> Policy:
        """The policy of a context whose params are full snapshots already (the rollout thread's)."""
        return Policy()

    def initial_reference(self, params, ref_dtype, *, abstract: bool = False, mesh=None):
        """The reference made from the (warmed-up) policy `params` at the start: a frozen copy in
        `ref_dtype`; None with adapters (the base is the reference). `abstract`: its shapes in the
        params' layout (on `mesh`), allocating nothing."""
        if self.adapters is not None:
            return None
        if not abstract:
            return step_lib.frozen_copy(params, ref_dtype)
        return _cast(params, ref_dtype, mesh, abstract=True)

    # ------------------------------------------------------------------------------------------
    # Checkpoints.

    def checkpoint_tree(self, state) -> dict:
        """What a checkpoint holds of `state`: the trainable params and their optimizer state, the
        reference (full fine-tuning with one), the base only when the warm-up changed it (else it is
        the init or `model.hf_path` again on resume), and asynchronous rollouts' snapshots."""
        tree = {"params": state.params, "opt_state": state.opt_state}
        if state.ref_params is not None:
            tree["ref_params"] = state.ref_params
        if self.base_in_checkpoint:
            tree["base_params"] = state.base_params
        if state.rollout_params:  # asynchronous rollouts: the snapshots the next steps sample from
            tree["rollout_params"] = {str(j): p for j, p in enumerate(state.rollout_params)}
        return tree

    def abstract_checkpoint(self, fresh, *, ref_dtype, uses_reference: bool, snapshot_shardings=None,
                            staleness: int = 0) -> dict:
        """`checkpoint_tree` as ShapeDtypeStructs with shardings, to restore into: from the fresh
        state, with the reference (full fine-tuning) and the base in the dtypes a run stores them
        in, and `staleness` full-params snapshots in `snapshot_shardings` (the sampler's layout)."""
        abstract = self.checkpoint_tree(fresh)
        if uses_reference and self.adapters is None:
            abstract["ref_params"] = step_lib.as_dtype(fresh.params, ref_dtype)
        if "base_params" in abstract and self.base_dtype is not None:
            abstract["base_params"] = step_lib.as_dtype(fresh.base_params, self.base_dtype)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract)
        if staleness:
            full = fresh.params if self.adapters is None else jax.eval_shape(
                self.adapters.model_params, fresh.params, fresh.base_params)
            snapshot = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                    full, snapshot_shardings)
            abstract["rollout_params"] = {str(j): snapshot for j in range(staleness)}
        return abstract

    # ------------------------------------------------------------------------------------------
    # The SFT warm-up, which trains every weight: with adapters it warms up the base.

    def warm_up_params(self, fresh):
        return fresh.params if self.adapters is None else fresh.base_params

    def after_warm_up(self, fresh, params, *, ref_dtype, uses_reference: bool, warmed_up: bool, mesh,
                      abstract: bool = False):
        """The fresh state with the warmed-up `params` in place (the reference copied from them,
        or, with adapters, the base in its configured dtype; the adapters start after it): the
        state GRPO's steps run with. `abstract`: of ShapeDtypeStructs (`check`)."""
        if self.adapters is not None:
            if warmed_up and self.base_dtype is not None:
                params = _cast(params, self.base_dtype, mesh, abstract)
            return dataclasses.replace(fresh, base_params=params)
        ref_params = self.initial_reference(params, ref_dtype, abstract=abstract, mesh=mesh) if uses_reference else None
        return dataclasses.replace(fresh, params=params, ref_params=ref_params)

    # ------------------------------------------------------------------------------------------
    # Export.

    def export_trees(self, state, all_rows: Callable) -> dict:
        """The trees an export writes beside the full params, gathered whole with `all_rows` (every
        process joins): the adapters, and the base when the warm-up changed it."""
        if self.adapters is None or not self.export_peft:
            return {}
        trees = {"adapters": all_rows(state.params)}
        if self.base_in_checkpoint:
            trees["base"] = all_rows(state.base_params)
        return trees

    def write_export(self, trees: dict, local: str, save: Callable, *, source: str | None, run_dir) -> None:
        """Writes `export_trees`' adapters as peft does under local/peft (with local/peft/base, the
        base they apply to, when the warm-up changed it); `save(tree, dir)` writes full params."""
        if "adapters" not in trees or not self.export_peft:
            return
        peft_dir = os.path.join(local, "peft")
        base_model = source
        if "base" in trees:
            save(trees["base"], os.path.join(peft_dir, "base"))
            base_model = os.fspath(run_dir / "peft" / "base")
        from grpo_jax.io import peft  # noqa: PLC0415 - only an export writes adapter files

        peft.save_peft(trees["adapters"], peft_dir, spec=self.adapters, alpha=self.alpha, base_model=base_model)


def _call(fn, *args):
    return fn(*args)


def _cast(params, dtype, mesh, abstract: bool):
    """`params`' floating leaves in `dtype`, in the params' training layout on `mesh`; `abstract`:
    their ShapeDtypeStructs (with shardings) only."""
    layout = sharding.param_shardings(mesh, params)
    if abstract:
        return jax.eval_shape(jax.jit(lambda p: step_lib.as_dtype(p, dtype), out_shardings=layout), params)
    return sharding.put_sharded(step_lib.as_dtype(params, dtype), layout)


def build(config: config_lib.Config, mesh, params, *, abstract: bool = False) -> tuple[Policy, Any, Any]:
    """(policy, trainable params, frozen base or None) over the model `params` (training layout).

    Adapters: fresh (B = 0) and born in their shardings from the base's shapes alone (one jitted
    init: no host copy, each process computes only its shards); the base cast to
    `lora.base_dtype` unless an SFT warm-up comes first (it trains float32 weights; the cast
    follows it, `Policy.after_warm_up`). `abstract`: `params` are ShapeDtypeStructs with shardings
    and so is everything returned (`jax.eval_shape` of the very same programs)."""
    m = config.model
    spec = config.lora.spec(config.model.dtype)
    if spec is None:
        return Policy(), params, None
    realize = jax.eval_shape if abstract else _call  # of jitted functions with out_shardings: laid out either way
    base_dtype = jnp.bfloat16 if config.lora.base_dtype == "bfloat16" else None
    base = params
    if config.sft.steps == 0 and base_dtype is not None:
        base = _cast(params, base_dtype, mesh, abstract)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), base)

    def init():
        return lora_lib.init_adapters(shapes, spec.targets, spec.rank, jax.random.PRNGKey(m.init_seed + 1), config.lora.init)

    adapters = realize(jax.jit(init, out_shardings=sharding.param_shardings(mesh, jax.eval_shape(init))))
    merge_fn = sharding.MeshJit(jax.jit(spec.model_params, out_shardings=sharding.param_shardings(mesh, base)), mesh)
    policy = Policy(adapters=spec, merge_fn=merge_fn, base_dtype=base_dtype, base_in_checkpoint=config.sft.steps > 0,
                    alpha=config.lora.alpha, export_peft=config.train.export_peft)
    return policy, adapters, base


def trainable_count(tree) -> int:
    """Parameters in a (trainable) tree."""
    return lora_lib.count(tree)
