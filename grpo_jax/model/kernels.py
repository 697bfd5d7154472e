"""Elementwise and matmul kernels of the decoder: `rms_norm`, and `dense` and `swiglu`, whose custom
VJPs lay out the backward pass for XLA's CPU backend (each docstring says what autodiff did instead).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * scale over the last axis, statistics in float32 (as HF).

    offset (Gemma): the weight is stored as scale - 1, and the product is taken in float32 before
    the cast back to x's dtype (Gemma's order; Llama's casts first, then multiplies).
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def gelu_tanh_glu(gate_up_BxTx2F: jax.Array) -> jax.Array:
    """gelu(gate) * up from the fused [..., 2F] projection (gate first), GELU's tanh approximation
    (HF "gelu_pytorch_tanh": 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))): [B, T, F]."""
    gate, up = jnp.split(gate_up_BxTx2F, 2, axis=-1)
    return jax.nn.gelu(gate, approximate=True) * up


# The mesh axes that split batch rows (grpo_jax.distributed.sharding.BATCH_AXES; repeated here so the model
# does not import the trainer's sharding module).
ROW_AXES = ("data", "fsdp", "expert")


def row_axes(mesh) -> tuple[str, ...]:
    """The batch axes of `mesh` (ROW_AXES that it has; () for no mesh): every model-side shard_map
    and constraint splits rows over these."""
    return () if mesh.empty else tuple(a for a in ROW_AXES if a in mesh.axis_names)


def row_devices(mesh) -> int:
    """Devices the rows split over (1 for no mesh)."""
    return math.prod(mesh.shape[a] for a in row_axes(mesh))


def constrain_rows(x: jax.Array) -> jax.Array:
    """`x` with its leading (row) axis split over the mesh's batch axes (`row_axes`) (the rest as XLA
    chooses, which can then no longer split them over fsdp).

    Only under a mesh set with `jax.set_mesh` (the trainer's jitted calls); a no-op otherwise or
    when the rows do not divide. Why: with the weights sharded on their hidden dimension over fsdp,
    XLA's partitioner otherwise chose to split activations on that dimension too and to keep every
    row of the batch on every device: for a 0.5B model on fsdp=8 the update's temporaries were ~53
    GiB per device instead of a share of the rows (`python -m grpo_jax check` shows it).
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = row_axes(mesh)
    if not axes or x.shape[0] % row_devices(mesh):
        return x
    # The other axes unconstrained: a tensor-parallel dimension (heads, MLP width) stays split.
    return jax.lax.with_sharding_constraint(x, P(axes, *([P.UNCONSTRAINED] * (x.ndim - 1))))


def dense(x_BxTxD: jax.Array, w_DxF: jax.Array) -> jax.Array:
    """x_BxTxD @ w_DxF -> [B, T, F] (`_dense`), input and output rows split over the batch axes
    (`constrain_rows`; their transposes split the backward's row gradients the same way)."""
    return constrain_rows(_dense(constrain_rows(x_BxTxD), w_DxF))


@jax.custom_vjp
def _dense(x_BxTxD: jax.Array, w_DxF: jax.Array) -> jax.Array:
    """x_BxTxD @ w_DxF -> [B, T, F], with a backward pass laid out for XLA's CPU matmul kernels.

    dy is materialised once. The input gradient is dy @ w^T contracting both minor axes (no copy
    of w). The weight gradient x^T @ dy uses an explicit transposed copy of x when D <= F (a plain
    [D, BT] x [BT, F] matmul), else contracts the row axis of x and dy directly: the fastest of
    the layouts measured on W1's shapes. Left to itself XLA transposed dy (the larger operand),
    fused with the elementwise backward of SwiGLU into slow strided loops (benchmarks/NOTES.md).
    """
    return jnp.einsum("btd,df->btf", x_BxTxD, w_DxF)


def _dense_fwd(x_BxTxD, w_DxF):
    return _dense(x_BxTxD, w_DxF), (x_BxTxD, w_DxF)


def _dense_bwd(res, dy_BxTxF):
    x_BxTxD, w_DxF = res
    d, f = w_DxF.shape
    barrier = jax.lax.optimization_barrier
    # dy materialised once (not recomputed inside each matmul that reads it).
    dy_NxF = barrier(dy_BxTxF.reshape(-1, f).astype(x_BxTxD.dtype))
    x_NxD = x_BxTxD.reshape(-1, d)
    dx_NxD = jax.lax.dot_general(dy_NxF, w_DxF.astype(dy_NxF.dtype), (((1,), (1,)), ((), ())))
    if d <= f:
        dw = jnp.dot(barrier(x_NxD.T), dy_NxF, preferred_element_type=jnp.float32)
    else:  # [N, D] x [N, F] contracting N: as fast as it gets here when D > F (measured)
        dw = jax.lax.dot_general(x_NxD, dy_NxF, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx_NxD.reshape(x_BxTxD.shape).astype(x_BxTxD.dtype), dw.astype(w_DxF.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


@jax.custom_vjp
def swiglu(gate_up_BxTx2F: jax.Array) -> jax.Array:
    """silu(gate) * up from the fused [..., 2F] projection (gate first): [B, T, F].

    The backward writes d(gate | up) as one [..., 2F] array with the sigmoid computed once;
    differentiated as two slices, XLA formed each half's padded gradient and added them.
    """
    gate, up = jnp.split(gate_up_BxTx2F, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate_up_BxTx2F):
    gate, up = jnp.split(gate_up_BxTx2F, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    # The sigmoid is kept for the backward (one exp per element in all, not two).
    return gate * sig * up, (gate, up, sig)


def _swiglu_bwd(res, dh_BxTxF):
    gate, up, sig = res
    # d silu(a) / da = s + a s (1 - s) = s (1 + a (1 - s))
    d_gate = dh_BxTxF * up * sig * (1 + gate * (1 - sig))
    return (jnp.concatenate([d_gate, dh_BxTxF * gate * sig], axis=-1),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
