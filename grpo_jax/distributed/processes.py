"""What differs between one process and several, in one place; on one process each method is the
identity (or a plain `jax.device_put`).

Multi-controller JAX runs the same program on every process over global arrays. The trainer's host
work is split the same way: each process samples and scores its slice of the step's prompts, then
the per-row host results (rewards, lengths, tokens) are gathered so every process holds every row
and computes the same advantages, minibatches and metrics. The only crossings are:

    prompt_slice   which of a batch's prompts this process samples
    gather         this process's host rows -> every process's, in process order
    sum            a host array summed over processes (per-question counts in evaluation)
    any            a flag true on any process (a SIGTERM that reached only some of them)
    agreed         a host function whose error on one process is raised on every process
    to_global      host rows known on every process -> one global array, rows over (data, fsdp)
    local_rows     a global row-sharded array -> this process's rows on the host
    all_rows       a global array -> the whole array on this host
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from grpo_jax.distributed import sharding


@dataclasses.dataclass(frozen=True)
class Processes:
    mesh: Mesh | None = None

    @property
    def count(self) -> int:
        return jax.process_count()

    @property
    def index(self) -> int:
        return jax.process_index()

    @property
    def is_primary(self) -> bool:
        """Process 0 writes the run directory's files (logs, samples, config, export)."""
        return self.index == 0

    def prompt_slice(self, num_prompts: int) -> slice:
        """This process's contiguous share of `num_prompts` prompts (all of them on one process)."""
        if self.count == 1:
            return slice(0, num_prompts)
        return sharding.host_slice(num_prompts, self.mesh)

    def gather(self, x) -> np.ndarray:
        """Every process's rows of a host array, concatenated on axis 0 in process order."""
        return sharding.allgather_rows(x)

    def sum(self, x) -> np.ndarray:
        """A host array (the same shape everywhere) summed over processes."""
        x = np.asarray(x)
        if self.count == 1:
            return x
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x)).sum(axis=0)

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is true on at least one: decisions that must agree
        (stop after this step) are taken from it, so no process waits alone at the next gather."""
        if self.count == 1:
            return bool(flag)
        return bool(self.sum(np.array([int(bool(flag))], np.int32))[0] > 0)

    def agreed(self, fn, what: str):
        """fn() on this process; if it raises on any process it raises on all of them, so none goes
        on alone to the next gather and waits there for good. The failing process raises its own
        error; the others a `RuntimeError` naming it (its log has the traceback)."""
        error = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the agreement
            error = e
        if self.count > 1:
            failed = np.flatnonzero(self.gather(np.array([int(error is not None)], np.int32)))
            if error is None and failed.size:
                raise RuntimeError(f"{what} failed on process(es) {failed.tolist()} (see that process's log); "
                                   f"process {self.index} stops with it")
        if error is not None:
            raise error
        return result

    def to_global(self, tree, row_axis: int = 0):
        """Host arrays holding every row (the same on every process) -> global arrays with rows
        (axis `row_axis`) over the batch axes ("data", "fsdp", "expert"); each device receives only its rows."""
        row_sharding = sharding.batch_sharding(self.mesh, row_axis)
        if self.count == 1:
            return jax.device_put(tree, row_sharding)

        def one(x):
            local = sharding.host_slice(np.shape(x)[row_axis], self.mesh)
            index = [slice(None)] * np.ndim(x)
            index[row_axis] = local
            return sharding.global_batch(self.mesh, np.asarray(x)[tuple(index)], np.shape(x)[row_axis], row_axis)

        return jax.tree.map(one, tree)

    def local_rows(self, x) -> np.ndarray:
        """This process's rows of a row-sharded global array, in order."""
        return sharding.process_rows(x)

    def all_rows(self, tree):
        """Every element of (a tree of) global arrays, whole, on this host; all processes must call it."""
        if self.count == 1:
            return jax.tree.map(np.asarray, tree)
        from jax.experimental import multihost_utils

        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
