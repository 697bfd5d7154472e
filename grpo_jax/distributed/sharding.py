"""Mesh, shardings and multi-host set-up: how the trainer's arrays are laid out over devices.

One mesh with four axes (the only place they are named):

    data    splits the batch; every weight is whole (replicated) along it.
    fsdp    splits the batch too, and shards every weight matrix on its hidden dimension D
            (ZeRO-3 / FSDP): each weight is all-gathered just before use, and its gradient
            reduce-scattered, by XLA.
    expert  splits the batch too, and a mixture-of-experts layer's experts (expert parallelism):
            each device holds E / expert of them, and tokens travel to their experts' devices
            (`grpo_jax.model.expert_dispatch`). Dense weights are whole along it.
    tensor  shards heads, the MLP width F (and each expert's width I) and the vocabulary V
            (Megatron-style tensor parallel).

Weights take their PartitionSpec from the one table in `model.SHARDING` (the training layout);
`decode_param_shardings` is the rollout variant, the same table without "fsdp", so the decode loop
does not all-gather every weight at every generated token. Where a dimension does not divide by the
mesh axes assigned to it (4 kv heads on tensor=8, a vocabulary of 151,936 on fsdp=3), that dimension
is replicated instead: correct everywhere, only less memory-efficient.

Adam's mu and nu are laid out like their params; step counters and other scalars are replicated.
Batch rows (rollout prompts and answers, update micro-batches) are split over ("data", "fsdp", "expert").

Everything here uses `jax.jit` with explicit shardings (no `jax.pmap`), and mesh axes of type
`Auto`, so XLA's partitioner inserts the collectives. Multi-host: every process runs the same
program on the global arrays; `initialize_distributed` joins them, `host_slice` says which prompts
this process loads, `global_batch` assembles process-local rows into one global array, and
`process_rows` / `allgather_rows` bring results back to the host.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax import model as model_lib

log = logging.getLogger("grpo_jax")

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# Batch rows are split over every batch-like axis: fsdp and expert devices hold different rows too.
BATCH_AXES = ("data", "fsdp", "expert")


# ----------------------------------------------------------------------------------------------
# The mesh.

def mesh_shape(data: int = -1, fsdp: int = 1, tensor: int = 1, num_devices: int | None = None, *,
               expert: int = 1) -> tuple[int, int, int, int]:
    """(data, fsdp, expert, tensor), MESH_AXES' order, with at most one -1 replaced by the devices left over."""
    n = jax.device_count() if num_devices is None else num_devices
    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"mesh.{name}={size!r}: must be a positive int or -1 (the devices left)")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free} = -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if n % fixed:
            raise ValueError(f"mesh: {n} devices do not divide by the fixed axes "
                             f"({', '.join(f'{k}={v}' for k, v in sizes.items() if v != -1)}, product {fixed})")
        sizes[free[0]] = n // fixed
    if math.prod(sizes.values()) != n:
        raise ValueError(f"mesh: {'*'.join(MESH_AXES)} = {'*'.join(str(sizes[a]) for a in MESH_AXES)} = "
                         f"{math.prod(sizes.values())} but there are {n} devices; use -1 for one axis")
    return tuple(sizes[a] for a in MESH_AXES)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None, *, expert: int = 1) -> Mesh:
    """A ("data", "fsdp", "expert", "tensor") mesh over `devices` (default: all, every host's).

    tensor is the innermost (fastest-varying) axis, so tensor-parallel groups sit on neighbouring
    devices (the same host / ICI ring), expert groups next to them (their tokens' all-gather and
    reduce-scatter every sparse layer), and data-parallel groups span hosts.
    """
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(data, fsdp, tensor, num_devices=len(devices), expert=expert)
    # Auto axes: shardings come from in/out_shardings and propagate through unannotated model code.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`spec` with every entry whose mesh size does not divide its dimension set to None."""
    if len(spec) > len(shape):
        raise ValueError(f"fit_spec: spec {spec} has {len(spec)} entries for a shape {shape}")
    fitted = [entry if dim % _axis_size(mesh, entry) == 0 else None
              for entry, dim in zip(tuple(spec), shape)]
    return P(*fitted)


def _drop_axis(spec: P, axis: str) -> P:
    def drop(entry):
        if entry == axis:
            return None
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a != axis)
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return entry

    return P(*(drop(e) for e in tuple(spec)))


def _is_spec(x) -> bool:
    return isinstance(x, P)


# ----------------------------------------------------------------------------------------------
# Shardings of the trainer's state.

def param_specs(mesh: Mesh, params, *, decode: bool = False):
    """PartitionSpec per weight (the tree of `params`): model.SHARDING, fitted to the shapes.

    decode=True: the rollout variant, with "fsdp" removed (weights whole along fsdp).
    """
    table = model_lib.partition_specs(params)

    def one(spec, leaf):
        if decode:
            spec = _drop_axis(spec, "fsdp")
        return fit_spec(spec, np.shape(leaf), mesh)

    return jax.tree.map(one, table, params, is_leaf=_is_spec)


def param_shardings(mesh: Mesh, params):
    """NamedSharding per weight for training (policy and reference alike)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(mesh, params), is_leaf=_is_spec)


def decode_param_shardings(mesh: Mesh, params):
    """NamedSharding per weight for the sampler: tensor-sharded, whole along fsdp and data.

    Costs (weights / tensor) bytes per device while it lives; `jax.device_put(params, this)` is
    one all-gather per rollout instead of one per generated token.
    """
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(mesh, params, decode=True),
                        is_leaf=_is_spec)


def decode_copy_is_separate(mesh: Mesh, params) -> bool:
    """Whether the sampler's layout differs from the params' (fsdp > 1: weights whole along fsdp),
    so `decode_params` makes a second copy rather than passing the params through."""
    return not all(d.is_equivalent_to(x.sharding, x.ndim)
                   for d, x in zip(jax.tree.leaves(decode_param_shardings(mesh, params)), jax.tree.leaves(params)))


def decode_params(mesh: Mesh, params, dtype=None):
    """The sampler's copy of the policy: `decode_param_shardings`, its floating weights in `dtype`.

    `dtype` applies only where a separate copy is made anyway (`decode_copy_is_separate`): then it
    costs no memory beyond the copy, and is cast before the gather, so the all-gather moves (and
    each device holds) the compute dtype's bytes: half of float32's for bfloat16. The model casts
    every weight to its compute dtype before use, so the copy samples exactly the same tokens.
    `jax.device_put` moves each weight device to device and leaves one already in place as it is.
    """
    import jax.numpy as jnp

    shardings = decode_param_shardings(mesh, params)
    if dtype is not None and decode_copy_is_separate(mesh, params):
        in_shardings = jax.tree.map(lambda x: x.sharding, params)
        params = jax.jit(lambda tree: jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree),
            out_shardings=in_shardings)(params)
    return jax.device_put(params, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def opt_state_shardings(mesh: Mesh, opt_state, params):
    """Shardings for an Optax state: every params-shaped subtree (Adam mu, nu) like the params,
    every other leaf (step counts, scalars) replicated."""
    params_def = jax.tree.structure(params)
    p_shardings = param_shardings(mesh, params)
    params_shapes = [np.shape(x) for x in jax.tree.leaves(params)]

    def is_params_like(x) -> bool:
        try:
            if jax.tree.structure(x) != params_def:
                return False
        except Exception:  # noqa: BLE001 - unhashable / non-pytree nodes are simply not params-like
            return False
        return [np.shape(y) for y in jax.tree.leaves(x)] == params_shapes

    def one(x):
        if is_params_like(x):
            return p_shardings
        return replicated(mesh)

    return jax.tree.map(one, opt_state, is_leaf=is_params_like)


def batch_sharding(mesh: Mesh, row_axis: int = 0) -> NamedSharding:
    """Rows (axis `row_axis`) over BATCH_AXES; other axes whole. row_axis=1 for UpdateBatch
    arrays, which are [A micro-batches, M rows, ...]."""
    return NamedSharding(mesh, P(*([None] * row_axis), BATCH_AXES))


def batch_size_multiple(mesh: Mesh) -> int:
    """Rows of every sharded batch must be a multiple of this (data * fsdp * expert)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


# ----------------------------------------------------------------------------------------------
# Building and moving sharded state.

def init_sharded(mesh: Mesh, init_fn: Callable, *args, shardings_fn: Callable = param_shardings):
    """`init_fn(*args)` computed directly into its shardings: nothing is built whole on one device.

    jax.eval_shape gives the output's shapes (no FLOPs, no memory); `shardings_fn(mesh, abstract)`
    its layout; jax.jit(init_fn, out_shardings=...) then materialises each shard on its device.
    `args` are traced (arrays such as params for `tx.init`); close over static things (configs,
    seeds): `init_sharded(mesh, lambda: nnx.split(init_model(cfg, seed))[1])`.
    """
    abstract = jax.eval_shape(init_fn, *args)
    return jax.jit(init_fn, out_shardings=shardings_fn(mesh, abstract))(*args)


def init_opt_state_sharded(mesh: Mesh, tx, params):
    """`tx.init(params)` with Adam's moments born in their params' shardings."""
    return init_sharded(mesh, tx.init, params,
                        shardings_fn=lambda m, abstract: opt_state_shardings(m, abstract, params))


def init_params_sharded(mesh: Mesh, model_config: model_lib.ModelConfig, seed: int):
    """(graphdef, params) of `model.init_model(model_config, seed)`, params sharded for training.

    The values equal the single-device `nnx.split(init_model(...))` (threefry is partitionable).
    """
    from flax import nnx

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(model_config, seed)))
    params = init_sharded(mesh, lambda: nnx.split(model_lib.init_model(model_config, seed))[1])
    return graphdef, params


def put_sharded(tree, shardings):
    """Moves (reshards) an existing tree, e.g. a Hugging Face checkpoint loaded on the host.

    jit'ed identity with out_shardings, so the data moves device to device and works with arrays
    that span hosts (jax.device_put of host numpy would need the whole array on every host)."""
    return jax.jit(lambda t: t, out_shardings=shardings)(tree)


class MeshJit:
    """A jitted function traced, lowered and run under `jax.set_mesh(mesh)`, so the model's row
    constraints (`model.kernels.constrain_rows`) see the mesh. Calls and `.lower(...)` as jit's."""

    def __init__(self, jitted: Callable, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)


def shard_update_fn(update_fn: Callable, mesh: Mesh, params, opt_state, *, row_axis: int = 1, frozen=None,
                    compiler_options: dict | None = None):
    """`update_fn(params, opt_state, batch[, frozen]) -> (params, opt_state, metrics)` jitted for the mesh.

    In: params and opt_state in their training shardings (donated: updated in place), every batch
    array with its rows (axis `row_axis`) over BATCH_AXES, and `frozen` (LoRA's base params,
    read only; None: the update takes three arguments) in its training shardings. Out: the same
    shardings, metrics replicated, so every host can read them. `update_fn` may be plain Python or
    already jitted (train.make_update_fn); the outer shardings win either way, and so do the outer
    `compiler_options` (`grpo_jax.model.remat.backward_compiler_options`).
    """
    p_sh = param_shardings(mesh, params)
    o_sh = opt_state_shardings(mesh, opt_state, params)
    in_sh = (p_sh, o_sh, batch_sharding(mesh, row_axis))
    if frozen is not None:
        in_sh += (param_shardings(mesh, frozen),)
    return MeshJit(jax.jit(update_fn, in_shardings=in_sh, out_shardings=(p_sh, o_sh, replicated(mesh)),
                           donate_argnums=(0, 1), compiler_options=compiler_options), mesh)


# ----------------------------------------------------------------------------------------------
# Multi-host.

_ENV = ("GRPO_COORDINATOR", "GRPO_NUM_PROCESSES", "GRPO_PROCESS_ID")


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, environ: Mapping[str, str] | None = None
                           ) -> bool:
    """Joins this process to the others with `jax.distributed.initialize`; returns True if joined.

    Explicit arguments win, then GRPO_COORDINATOR / GRPO_NUM_PROCESSES / GRPO_PROCESS_ID from the
    environment. With none of them, GRPO_DISTRIBUTED=auto (set by launch/tpu_pod.sh and
    launch/slurm.sbatch) lets JAX detect the cluster (Cloud TPU metadata, SLURM variables).
    Otherwise, or with num_processes == 1, this is a single-process run and nothing happens.
    Must run before anything touches a device.
    """
    env = os.environ if environ is None else environ
    coordinator = coordinator or env.get("GRPO_COORDINATOR") or None
    if num_processes is None and env.get("GRPO_NUM_PROCESSES"):
        num_processes = _env_int(env, "GRPO_NUM_PROCESSES")
    if process_id is None and env.get("GRPO_PROCESS_ID"):
        process_id = _env_int(env, "GRPO_PROCESS_ID")
    if jax.distributed.is_initialized():
        return True
    explicit = (coordinator, num_processes, process_id)
    if all(v is None for v in explicit):
        mode = env.get("GRPO_DISTRIBUTED", "")
        if mode == "auto":
            jax.distributed.initialize()
            log.info("jax.distributed: process %d of %d (auto-detected cluster)",
                     jax.process_index(), jax.process_count())
            return True
        if mode not in ("", "off"):
            raise ValueError(f"GRPO_DISTRIBUTED={mode!r}: allowed values are 'auto', 'off' or unset")
        return False
    if num_processes == 1:
        return False
    if None in explicit:
        missing = [n for n, v in zip(("coordinator", "num_processes", "process_id"), explicit) if v is None]
        raise ValueError(f"initialize_distributed: {missing} not given (flags or {', '.join(_ENV)}); "
                         f"a multi-process run needs all three, got coordinator={coordinator!r}, "
                         f"num_processes={num_processes!r}, process_id={process_id!r}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"initialize_distributed: process_id={process_id} must be in [0, {num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    log.info("jax.distributed: process %d of %d via %s", process_id, num_processes, coordinator)
    return True


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment {name}={env[name]!r} must be an integer") from None


def host_slice(num_items: int, mesh: Mesh | None = None) -> slice:
    """This process's share of `num_items` rows (prompts of a step): a contiguous slice.

    With `mesh`, exactly the rows that this process's devices hold under `batch_sharding(mesh)`,
    so `global_batch` can assemble them without moving data between hosts. Without, the
    process_index-th of process_count equal blocks.
    """
    n_proc, idx = jax.process_count(), jax.process_index()
    if mesh is None:
        if num_items % n_proc:
            raise ValueError(f"host_slice: {num_items} items do not split over {n_proc} processes")
        per = num_items // n_proc
        return slice(idx * per, (idx + 1) * per)
    multiple = batch_size_multiple(mesh)
    if num_items % multiple:
        raise ValueError(f"host_slice: {num_items} rows must be a multiple of data*fsdp*expert = {multiple}")
    index_map = batch_sharding(mesh).addressable_devices_indices_map((num_items,))
    starts = sorted({(ix[0].start or 0, ix[0].stop if ix[0].stop is not None else num_items)
                     for ix in index_map.values()})
    lo, hi = starts[0][0], starts[-1][1]
    covered = sum(b - a for a, b in starts)
    if covered != hi - lo:
        raise ValueError(f"host_slice: process {idx}'s devices hold non-contiguous rows {starts}; "
                         "build the mesh with make_mesh (devices in process order)")
    return slice(lo, hi)


def global_batch(mesh: Mesh, local_tree, num_rows: int, row_axis: int = 0):
    """Process-local host arrays (this host's `host_slice` rows) -> global arrays sharded by rows.

    On one process the local arrays are the whole batch. `num_rows` is the global row count.
    """
    sharding = batch_sharding(mesh, row_axis)

    def one(x):
        if x is None:
            return None
        x = np.asarray(x)
        shape = list(x.shape)
        shape[row_axis] = num_rows
        return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

    return jax.tree.map(one, local_tree, is_leaf=lambda x: x is None)


def process_rows(x: jax.Array, row_axis: int = 0) -> np.ndarray:
    """This process's rows of a row-sharded global array, in order (the inverse of global_batch)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    pieces = {}
    for shard in x.addressable_shards:
        start = shard.index[row_axis].start or 0
        pieces.setdefault(start, np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=row_axis)


def allgather_rows(x) -> np.ndarray:
    """Every process's host array concatenated on axis 0 in process order (for metrics that must
    agree across hosts: reward means, lengths). Identity on one process."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def bytes_per_device(tree) -> dict[Any, int]:
    """Bytes each device holds of the arrays in `tree` (summed over its addressable shards)."""
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals
