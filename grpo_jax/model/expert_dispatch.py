"""A mixture-of-experts layer on a device mesh: each device routes its own tokens, and the experts
are split over the mesh's `expert` axis (expert parallelism).

With mesh.expert = X > 1, device j of an expert group holds experts [j*E/X, (j+1)*E/X) (the
SHARDING table splits E over "expert") and 1/X of the group's tokens (rows are split over
"expert" as over "data"). One sparse layer then runs, inside `jax.shard_map`:

    x_all   = all_gather(x, "expert")                      [X*n, D]  the group's tokens, and their
                                                                     experts and weights [X*n, K]
    y_part  = experts_ffn(x_all, ..., local experts only)  [X*n, D]  pairs routed elsewhere add 0
    y       = psum_scatter(y_part, "expert")               [n, D]    each token's K experts summed
                                                                     on its own device

(and a psum over "tensor" when each expert's width I is split over it). Exact: the same pairs,
the same grouped matmuls, the same weights; the sum over a token's K experts runs in a different
order (by device), so results equal one device's to float rounding.

With mesh.expert = 1 the layer runs the same way (the gather and the scatter are over one device):
each device sorts its own tokens' pairs. Left to XLA's partitioner, the sort over the flattened
(token, choice) pairs of the whole batch is not split, so every device gathered every row's pairs:
`check` measured 933 GiB per device in Qwen3-30B-A3B's update on 64 devices at 8k tokens.

Why all-gather + reduce-scatter and not all-to-all. An all-to-all sends each (token, choice) pair
to its expert's device: every device sends and receives about n*K*(X-1)/X rows of D. The
all-gather receives n*(X-1) rows and the reduce-scatter sends as many: the same bytes when K = X,
fewer when X < K (Qwen3-30B-A3B: K = 8, so any X <= 8). And it needs no capacity: an all-to-all
with static shapes must size its buffers for the worst case or drop tokens (GShard's capacity
factor); here nothing is dropped and nothing depends on how tokens route. The price: each device's
grouped matmuls are sized for all X*n*K pairs of the group (static shapes), though on average
only n*K of them are its own: the tiled form (`grouped_matmul`, off TPU) computes every tile, so
its expert FLOPs grow X-fold; rows outside every group cost `jax.lax.ragged_dot` what its backend
makes them cost.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax.model import kernels

AXIS = "expert"


def expert_devices(mesh) -> int:
    """X, the devices the experts split over (1 for no mesh or no expert axis)."""
    return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def on_mesh(mesh) -> bool:
    """Whether a sparse layer runs per device (`experts_ffn_over_mesh`): under a mesh that splits rows."""
    return bool(kernels.row_axes(mesh))


def experts_ffn_over_mesh(mesh, experts_ffn, x_NxD, experts_NxK, weights_NxK, gate_ExDxI, up_ExDxI, down_ExIxD,
                          *, impl: str = "auto") -> jax.Array:
    """`experts_ffn(x, experts, weights, gate, up, down)` [N, D] computed with the experts split
    over the mesh's expert axis (module docstring). experts_ffn: `grpo_jax.model.moe.experts_ffn`
    (passed in: moe imports this module). N need not divide the row devices (padded rows route
    to expert 0 with weight 0 and are cut off again)."""
    num_experts, _, width = gate_ExDxI.shape
    x_devices = expert_devices(mesh)
    if num_experts % x_devices:  # (config.MeshSection.check_model refuses it first)
        raise ValueError(f"{num_experts} experts do not split over mesh.expert={x_devices}")
    rows = kernels.row_axes(mesh)
    n = x_NxD.shape[0]
    pad = -n % kernels.row_devices(mesh)
    if pad:
        x_NxD, experts_NxK, weights_NxK = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_NxD, experts_NxK, weights_NxK))
    tensor = mesh.shape.get("tensor", 1)
    width_axis = "tensor" if tensor > 1 and width % tensor == 0 else None
    local = functools.partial(_local, experts_ffn=experts_ffn, impl=impl, width_axis=width_axis,
                              experts_per_device=num_experts // x_devices)
    row_spec = P(rows, None)
    out = jax.shard_map(
        local, mesh=mesh,
        in_specs=(row_spec, row_spec, row_spec, P(AXIS, None, width_axis), P(AXIS, None, width_axis),
                  P(AXIS, width_axis, None)),
        out_specs=row_spec, check_vma=False,
    )(x_NxD, experts_NxK, weights_NxK, gate_ExDxI, up_ExDxI, down_ExIxD)
    return out[:n]


def _local(x_nxD, experts_nxK, weights_nxK, gate, up, down, *, experts_ffn, impl, width_axis, experts_per_device):
    """One device's share: its expert group's tokens through its own experts, summed back per token."""
    gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, axis=0, tiled=True)
    first_expert = jax.lax.axis_index(AXIS) * experts_per_device
    y_part = experts_ffn(gather(x_nxD), gather(experts_nxK), gather(weights_nxK), gate, up, down, impl,
                         first_expert=first_expert)
    y_nxD = jax.lax.psum_scatter(y_part, AXIS, scatter_dimension=0, tiled=True)
    return jax.lax.psum(y_nxD, width_axis) if width_axis else y_nxD
