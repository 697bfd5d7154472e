"""Fingerprints of a pytree of arrays: two 32-bit sums per leaf over its bit patterns, computed on
the devices that hold it, so that a checkpoint can prove on restore that it reads back what it wrote.

For a leaf viewed as unsigned 32-bit words w_0 .. w_{n-1} (row-major; 16- and 8-bit dtypes are
widened word by word, 64-bit ones split in two), the fingerprint is

    (sum_i w_i  mod 2**32,   sum_i (2i + 1) * w_i  mod 2**32)

Why these two: the sums are exact integer arithmetic, so they do not depend on the order of the
reduction, the sharding or the device count (a checkpoint restored into a new layout gives the
same numbers). Changing one word by d != 0 changes the first sum by d mod 2**32, which a flip of
one bit (d = +-2**k, k < 32) never leaves at 0: every single-bit error is caught. The second sum
weights each word by an odd number, so two words swapping places or a run of words changing
together (a 4 KB block inverted) would have to leave both sums unchanged at once to go unseen
(not a proof against a deliberate forgery: this is a check against damage, not a signature). Cost: one read of every byte on device, like a norm; see README
"Checkpoints and what is guaranteed" for the measured time per save.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _words_u32(x: jax.Array) -> jax.Array:
    """The leaf's bit patterns as uint32, same shape (64-bit dtypes: an extra trailing axis of 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"cannot fingerprint dtype {x.dtype} ({size} bytes per element)")


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """uint32[2]: (sum of the words, sum of (2i + 1) * word_i), both mod 2**32."""
    words = _words_u32(jnp.asarray(x))
    # The row-major index i of each word from per-axis iotas (no reshape: a reshape of a sharded
    # leaf would move data between devices). Strides wrap mod 2**32 like the sums.
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    weight = index * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weight, dtype=jnp.uint32)])


@jax.jit
def _group_fingerprints(leaves: list) -> list:
    return [_leaf_fingerprint(x) for x in leaves]


def _device_group(leaf: Any) -> Any:
    """Leaves on the same devices are fingerprinted by one jitted call (rollout snapshots may live
    on the sampler's own devices, which one program cannot mix with the trainer's)."""
    sharding = getattr(leaf, "sharding", None)
    return None if sharding is None else frozenset(d.id for d in sharding.device_set)


def tree_fingerprints(tree: Any) -> dict[str, list[int]]:
    """``{leaf path (jax.tree_util.keystr): [sum, weighted sum]}`` for every leaf of ``tree``.

    Leaves are jax/numpy arrays or Python scalars. Every process of a multi-host run gets the same
    dict (the sums are replicated), and each call costs one program launch per device set.
    """
    paths_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    groups: dict[Any, list[int]] = collections.defaultdict(list)
    for i, (_, leaf) in enumerate(paths_leaves):
        groups[_device_group(leaf)].append(i)
    result: list[Any] = [None] * len(paths_leaves)
    for indices in groups.values():
        sums = _group_fingerprints([paths_leaves[i][1] for i in indices])
        for i, s in zip(indices, jax.device_get(sums)):
            result[i] = [int(v) for v in np.asarray(s)]
    return {jax.tree_util.keystr(path): fp for (path, _), fp in zip(paths_leaves, result)}


def mismatches(saved: dict[str, list[int]], read: dict[str, list[int]]) -> list[str]:
    """One line per leaf whose fingerprint differs (or that only one side has); [] when they agree."""
    lines = []
    for path in sorted(set(saved) | set(read)):
        if path not in read:
            lines.append(f"leaf {path} has a saved fingerprint but was not restored")
        elif path not in saved:
            lines.append(f"leaf {path} has no saved fingerprint")
        elif list(saved[path]) != list(read[path]):
            lines.append(f"leaf {path} reads back with fingerprint {read[path]}, saved {list(saved[path])}")
    return lines
