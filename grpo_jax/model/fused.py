"""Vendor attention kernels behind the model's mask: cuDNN flash attention (GPUs) and Pallas splash
attention (TPUs), each for causal self-attention over rows whose real tokens are contiguous.

Both take the layout of `grpo_jax.model.blockwise.blockwise_attention` with query_offset 0: q
[B, L, N, H], k and v [B, L, K, H], key_valid [B, L], and return [B, L, N, H]. Every layout the
model runs is such a row: a left-padded prompt, then a completion, then right padding (the
shared-prompt layout is rebuilt into such rows by the caller). What each vendor kernel needs:

- cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) masks padding only as sequence
  lengths (real tokens first). Each row is rolled left by its leading padding so its real tokens
  start at slot 0, attended with `query_seq_lengths = key_value_seq_lengths = real tokens` and
  `is_causal`, and rolled back. Attention depends only on the q.k products and the mask, so the
  roll changes nothing for a real token (RoPE was applied before). Sliding windows go in as
  `local_window_size=(window - 1, 0)`.
- Splash (`jax.experimental.pallas.ops.tpu.splash_attention`) masks padding with segment ids:
  real tokens in segment 1, padding in segment 0, so a real query sees only real keys and a
  padding query at least itself (no empty row, no NaN). Causal or local masks are static, the
  sequence is padded to a multiple of 128, queries are pre-scaled (splash does not scale), and
  the kernel runs per kv head (its MQA form, R query heads each) under `vmap`. Under a mesh it
  runs inside `shard_map` over the rows and kv heads (a Pallas call is not partitioned by XLA).
  Off a TPU it runs in Pallas interpret mode: exact, slow, for tests.

Supported shapes (`cudnn_supports`, `splash_supports`) are what `attention.resolve` consults for
`attention_impl="auto"`; outside them the portable blockwise kernel runs instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax.model import kernels


def cudnn_supports(dtype, head_dim: int) -> bool:
    """cuDNN's fused flash attention: half-precision inputs and a head_dim <= 128, a multiple of 8
    (the constraints of jax.nn.dot_product_attention's cudnn path; outside them it raises)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim <= 128 \
        and head_dim % 8 == 0


def splash_supports(head_dim: int) -> bool:
    """Splash's TPU tiles are 128 lanes wide along head_dim: multiples of 128 run at speed."""
    return head_dim % 128 == 0


def _row_spans(key_valid_BxL):
    """(leading padding, real tokens) per row, int32 [B] each; real tokens contiguous."""
    valid = key_valid_BxL > 0
    length = jnp.sum(valid, axis=1, dtype=jnp.int32)
    first = jnp.where(length > 0, jnp.argmax(valid, axis=1).astype(jnp.int32), 0)
    return first, length


def _roll_rows(x_BxLx, shift_B):
    """Row b rolled left by shift_B[b] along axis 1 (a gather; its transpose is the inverse roll)."""
    l = x_BxLx.shape[1]
    index = (jnp.arange(l, dtype=jnp.int32)[None, :] + shift_B[:, None]) % l
    return jnp.take_along_axis(x_BxLx, index.reshape(index.shape + (1,) * (x_BxLx.ndim - 2)), axis=1)


def cudnn_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, key_valid_BxL, *, window: int | None = None,
                    implementation: str = "cudnn") -> jax.Array:
    """Causal self-attention through jax.nn.dot_product_attention (module docstring): [B, L, N, H].

    `implementation="xla"` runs the same call through XLA's reference implementation (any backend,
    materialised scores): what the tests use to check the roll and the lengths on a CPU.
    """
    first, length = _row_spans(key_valid_BxL)
    q, k, v = (_roll_rows(x, first) for x in (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH))
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=length, key_value_seq_lengths=length,
        local_window_size=None if window is None else (window - 1, 0), implementation=implementation)
    # Queries past a row's length (its padding) come back as whatever the kernel leaves there;
    # zeros keep them finite for the next layer whatever that is.
    real = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :] < length[:, None]
    out = jnp.where(real[:, :, None, None], out, 0).astype(q_BxLxNxH.dtype)
    return _roll_rows(out, -first)


_SPLASH_ALIGN = 128


@functools.lru_cache(maxsize=64)
def _splash_kernel(length: int, heads_per_kv: int, window: int | None, interpret: bool,
                   softcap: float | None = None):
    """The splash MQA kernel for rows of `length` (a multiple of 128) and R query heads per kv head."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (length, length)
    one = masks.CausalMask(shape) if window is None else masks.LocalMask(shape, (window - 1, 0), 0)
    block = next(b for b in (512, 256, 128) if length % b == 0)
    sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # Built eagerly even when first asked for inside a jit trace: the kernel holds the mask's block
    # tables as arrays, and this cache hands it to later traces too; made under a trace they were
    # that trace's tracers, and the next program to use the kernel failed with a leaked tracer.
    with jax.ensure_compile_time_eval():
        return kernel.make_splash_mqa(masks.MultiHeadMask([one] * heads_per_kv), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, interpret=interpret, attn_logits_soft_cap=softcap)


def _splash_local(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, key_valid_BxL, window, interpret, softcap=None):
    """Splash on the rows and heads this device holds."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel

    b, l, n, hd = q_BxLxNxH.shape
    kv = k_BxLxKxH.shape[2]
    r = n // kv
    lp = -(-l // _SPLASH_ALIGN) * _SPLASH_ALIGN
    pad = ((0, 0), (0, lp - l), (0, 0), (0, 0))
    # [B, K, R, L, H] queries (scaled here: splash does not), [B, K, L, H] keys and values.
    q = jnp.pad(q_BxLxNxH / math.sqrt(hd), pad).reshape(b, lp, kv, r, hd).transpose(0, 2, 3, 1, 4)
    k = jnp.pad(k_BxLxKxH, pad).transpose(0, 2, 1, 3)
    v = jnp.pad(v_BxLxKxH, pad).transpose(0, 2, 1, 3)
    segments = jnp.pad((key_valid_BxL > 0).astype(jnp.int32), ((0, 0), (0, lp - l)))
    run = _splash_kernel(lp, r, window, interpret, softcap)

    def one_row(q_KxRxLxH, k_KxLxH, v_KxLxH, seg_L):
        ids = kernel.SegmentIds(q=seg_L, kv=seg_L)
        return jax.vmap(lambda qq, kk, vv: run(qq, kk, vv, segment_ids=ids))(q_KxRxLxH, k_KxLxH, v_KxLxH)

    out = jax.vmap(one_row)(q.astype(q_BxLxNxH.dtype), k, v, segments)  # [B, K, R, Lp, H]
    return out.transpose(0, 3, 1, 2, 4)[:, :l].reshape(b, l, n, hd).astype(q_BxLxNxH.dtype)


def splash_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, key_valid_BxL, *, window: int | None = None,
                     interpret: bool | None = None, softcap: float | None = None) -> jax.Array:
    """Causal self-attention through Pallas splash attention (module docstring): [B, L, N, H];
    softcap: splash's own attention logit soft-cap, on the scaled scores."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    local = functools.partial(_splash_local, window=window, interpret=interpret, softcap=softcap)
    mesh = jax.sharding.get_abstract_mesh()
    axes = kernels.row_axes(mesh)
    if not axes:
        return local(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, key_valid_BxL)
    row_spec = axes if q_BxLxNxH.shape[0] % kernels.row_devices(mesh) == 0 else None
    tensor = mesh.shape.get("tensor", 1)
    head_spec = "tensor" if "tensor" in mesh.axis_names and k_BxLxKxH.shape[2] % tensor == 0 else None
    heads = P(row_spec, None, head_spec, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, P(row_spec, None)), out_specs=heads,
                         check_vma=False)(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, key_valid_BxL)

