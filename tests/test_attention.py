"""Every attention kernel against the reference (materialised-scores) kernel: values and gradients,
with left padding, right padding, a query offset (the shared-prompt layout), GQA and sliding windows.

Tolerances (float32). Each output element is a convex combination sum_j p_j v_j over S keys. The
kernels differ in summation order (tiles, an online softmax rescaled by exp(m_old - m_new)) and in
how each score q.k / sqrt(H) (H products) is rounded. A reordered sum of n terms moves by at most
gamma_n ~ n u of the sum of the terms' magnitudes (Higham 4.2), so an output moves by at most
~(S + H) u max|v| from the sums, plus the relative error of the weights p_j: exp of a score with
absolute error ~H u |s| (|s| <= ~4 for unit normal inputs), a few more u from the rescaling and the
division. Taken together, with a factor 4 for the constants:

    ATOL(S, H) = 4 (S + H) u max|v|        (forward, u = 2^-24)

A gradient is a sum of the same kind with one more factor (the cotangent, or a key or query of
size ~1) and one more reduction over the queries or keys (T or S terms): the same bound with
(T + S + H) terms, relative to the largest gradient element (norm-wise: a coordinate that cancels
to ~0 keeps the absolute error of the large terms it came from; tests/tolerances.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model import attention, blockwise, fused
from tolerances import FLOAT32_UNIT_ROUNDOFF as U
from tolerances import normwise_violation


def _atol(s: int, h: int, v) -> float:
    return 4 * (s + h) * U * float(jnp.max(jnp.abs(v)))


def _reference(q, k, v, valid, offset=0, window=None):
    """The reference kernel in the blockwise layout: ([B, T, N, H], which queries see any key)."""
    b, t, n, h = q.shape
    visible = attention.causal_visible(valid, t, offset, window)
    out = attention.attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), visible)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h), visible.any(-1)


def _inputs(b, t, s, n, kv, h, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, n, h), dtype)
    k = jax.random.normal(ks[1], (b, s, kv, h), dtype)
    v = jax.random.normal(ks[2], (b, s, kv, h), dtype)
    cot = jax.random.normal(ks[3], (b, t, n, h), jnp.float32)
    return q, k, v, cot


def _padded(b, s, left=(0, 5, 11), right=(0, 3, 0)):
    """Rows with left padding (a prompt) and right padding (a completion that stopped)."""
    slot = jnp.arange(s)[None, :]
    lo, hi = jnp.array(left[:b])[:, None], s - jnp.array(right[:b])[:, None]
    return ((slot >= lo) & (slot < hi)).astype(jnp.int32)


# (B, T, S, N, K, H, query offset, window, block): plain causal, GQA 3:1 with an offset (the
# shared-prompt layout: T completion queries after S - T prompt slots), MQA with a window,
# windows that span tiles, tiles that do not divide the lengths.
CASES = [
    (2, 37, 37, 4, 2, 8, 0, None, 16),
    (2, 40, 70, 6, 2, 8, 30, None, 16),
    (3, 50, 50, 4, 1, 8, 0, 7, 16),
    (2, 33, 60, 4, 2, 8, 27, 5, 8),
    (3, 64, 64, 4, 4, 16, 0, 24, 512),
]


@pytest.mark.parametrize("b, t, s, n, kv, h, offset, window, block", CASES)
def test_blockwise_equals_the_reference_kernel_values_and_gradients(b, t, s, n, kv, h, offset, window, block):
    q, k, v, cot = _inputs(b, t, s, n, kv, h)
    valid = _padded(b, s)
    ref, sees = _reference(q, k, v, valid, offset, window)
    got = blockwise.blockwise_attention(q, k, v, valid, query_offset=offset, window=window,
                                        block_q=block, block_k=block)
    real = sees[..., None, None]  # queries that see no key (left padding) differ by design
    assert float(jnp.max(jnp.abs(jnp.where(real, got - ref, 0)))) <= _atol(s, h, v)

    def loss(kernel):
        return lambda q, k, v: jnp.sum(jnp.where(real, kernel(q, k, v), 0) * cot)

    g_ref = jax.grad(loss(lambda *a: _reference(*a, valid, offset, window)[0]), (0, 1, 2))(q, k, v)
    g_got = jax.grad(loss(lambda *a: blockwise.blockwise_attention(
        *a, valid, query_offset=offset, window=window, block_q=block, block_k=block)), (0, 1, 2))(q, k, v)
    for name, a, r in zip("qkv", g_got, g_ref):
        assert normwise_violation(a, r, 4 * (t + s + h) * U) <= 0, name


def test_blockwise_in_bfloat16_matches_float32_to_bfloat16_rounding():
    # bf16 inputs, float32 statistics and accumulators: the output carries the inputs' rounding
    # and one rounding of p to bf16 before p @ v, each 2^-8 relative, and its own final rounding:
    # <= ~3 * 2^-8 of max|v|, the reference's own error in bf16.
    q, k, v, _ = _inputs(2, 48, 48, 4, 2, 16, dtype=jnp.bfloat16)
    valid = _padded(2, 48)
    ref32, sees = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), valid)
    got = blockwise.blockwise_attention(q, k, v, valid, block_q=16, block_k=16)
    assert got.dtype == jnp.bfloat16
    err = jnp.max(jnp.abs(jnp.where(sees[..., None, None], got.astype(jnp.float32) - ref32, 0)))
    assert float(err) <= 3 * 2.0**-8 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))


def test_blockwise_skips_tiles_no_query_can_see():
    # 4 x 4 tiles, causal: the forward visits the 10 tiles on or below the diagonal, not 16; with
    # a window of one tile, the 7 tiles of the band. Counted from the loops' trip counts.
    tiles = blockwise._Tiles(0, None, 8, 8)
    visits = sum(int(hi - lo) for lo, hi in (tiles.key_tiles(i, 4) for i in range(4)))
    assert visits == 10
    banded = blockwise._Tiles(0, 8, 8, 8)
    assert sum(int(hi - lo) for lo, hi in (banded.key_tiles(i, 4) for i in range(4))) == 7
    # The backward's view (query tiles per key tile) covers the same tiles.
    assert sum(int(hi - lo) for lo, hi in (banded.query_tiles(j, 4) for j in range(4))) == 7


def test_the_update_at_8k_tokens_never_holds_a_score_matrix():
    # One row of 8,192 tokens, Qwen2.5-0.5B's heads (14 query, 2 kv, head_dim 64), bf16: the
    # gradient program's temporaries. The reference kernel's scores alone would be 14 x 8192^2 x 4
    # bytes = 3.5 GiB; the blockwise kernel's tiles and residuals stay below 256 MiB (measured:
    # ~145 MB, most of it the float32 gradient accumulators [T, N, H]).
    t, dt = 8192, jnp.bfloat16
    q = jax.ShapeDtypeStruct((1, t, 14, 64), dt)
    k = jax.ShapeDtypeStruct((1, t, 2, 64), dt)
    valid = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, k, v, valid):
        return jnp.sum(blockwise.blockwise_attention(q, k, v, valid).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k, valid).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * 2**20


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("block", [8, 16, 64])
def test_blocked_decode_equals_one_query_over_the_whole_cache(window, block):
    b, s, n, kv, h = 3, 50, 4, 2, 8
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (b, 1, n, h))
    keys = jax.random.normal(ks[1], (b, kv, h, s))
    values = jax.random.normal(ks[2], (b, kv, s, h))
    key_mask = jnp.ones((b, s), jnp.int32).at[0, :4].set(0)
    q_slot = jnp.array([20, 33, 41])
    rel = q_slot[:, None, None] - jnp.arange(s)[None, None, :]
    visible = (key_mask[:, None, :] > 0) & (rel >= 0) & (True if window is None else rel < window)
    ref = attention.attend_one_query(q, keys, values, visible)
    got = blockwise.decode_attention(q, keys, values, key_mask, q_slot, (q_slot.min(), q_slot.max()),
                                     window=window, block=block)
    assert float(jnp.max(jnp.abs(got - ref))) <= _atol(s, h, values)


def test_cudnn_layout_rolls_rows_to_their_real_tokens():
    # The cuDNN path (real tokens rolled to the front, sequence lengths, is_causal, a left window),
    # run through jax.nn.dot_product_attention's XLA implementation with the same arguments: equal
    # to the reference on left- and right-padded rows, values and gradients.
    b, t, n, kv, h = 3, 40, 4, 2, 8
    q, k, v, cot = _inputs(b, t, t, n, kv, h, seed=2)
    valid = _padded(b, t)
    for window in (None, 6):
        ref, sees = _reference(q, k, v, valid, 0, window)
        real = sees[..., None, None] & (valid[:, :, None, None] > 0)  # cuDNN zeroes padding queries

        def run(q, k, v, window=window):
            return fused.cudnn_attention(q, k, v, valid, window=window, implementation="xla")

        assert float(jnp.max(jnp.abs(jnp.where(real, run(q, k, v) - ref, 0)))) <= _atol(t, h, v)
        g_got = jax.grad(lambda *a: jnp.sum(jnp.where(real, run(*a), 0) * cot), (0, 1, 2))(q, k, v)
        g_ref = jax.grad(lambda *a: jnp.sum(jnp.where(real, _reference(*a, valid, 0, window)[0], 0) * cot),
                         (0, 1, 2))(q, k, v)
        for name, a, r in zip("qkv", g_got, g_ref):
            assert normwise_violation(a, r, 4 * (2 * t + h) * U) <= 0, (window, name)


def test_one_splash_kernel_serves_two_jitted_programs():
    # The cached kernel (one per length, heads and window) is first built inside a trace; the
    # second program of the same shapes reuses it. Before, its mask tables were the first trace's
    # tracers and the second program failed with UnexpectedTracerError (the update and the
    # log-prob pass on a TPU are two such programs).
    q, k = jnp.ones((1, 16, 2, 8)), jnp.ones((1, 16, 1, 8))
    valid = jnp.ones((1, 16), jnp.int32)
    first = jax.jit(lambda q: fused.splash_attention(q, k, k, valid, window=3))(q)
    second = jax.jit(lambda q: fused.splash_attention(2 * q, k, k, valid, window=3))(q)
    np.testing.assert_array_equal(first, second)  # uniform values: the scale does not matter


@pytest.mark.parametrize("window", [None, 20])
def test_splash_in_interpret_mode_equals_the_reference(window):
    # Pallas splash attention as a TPU runs it, interpreted on the CPU: padding as segment ids, the
    # causal or local mask, rows padded to 128, GQA through its MQA kernel per kv head.
    b, t, n, kv, h = 2, 100, 4, 2, 8
    q, k, v, cot = _inputs(b, t, t, n, kv, h, seed=3)
    valid = _padded(b, t, left=(0, 9), right=(4, 0))
    ref, sees = _reference(q, k, v, valid, 0, window)
    real = sees[..., None, None] & (valid[:, :, None, None] > 0)

    def run(q, k, v):
        return fused.splash_attention(q, k, v, valid, window=window, interpret=True)

    assert float(jnp.max(jnp.abs(jnp.where(real, run(q, k, v) - ref, 0)))) <= _atol(t, h, v)
    g_got = jax.grad(lambda *a: jnp.sum(jnp.where(real, run(*a), 0) * cot), (0, 1, 2))(q, k, v)
    g_ref = jax.grad(lambda *a: jnp.sum(jnp.where(real, _reference(*a, valid, 0, window)[0], 0) * cot),
                     (0, 1, 2))(q, k, v)
    for name, a, r in zip("qkv", g_got, g_ref):
        assert normwise_violation(a, r, 4 * (2 * t + h) * U) <= 0, name


@pytest.mark.parametrize("impl", ["blockwise", "splash"])
def test_shared_prompt_attention_equals_the_rows_it_shares(impl):
    # The shared-prompt layout ([prompt | G completions] per prompt) through each kernel equals
    # the reference kernel on the N * G unshared rows [prompt, completion], with a window.
    n, g, p, c, heads, kv, h, window = 2, 3, 12, 9, 4, 2, 8, 7
    l = p + g * c
    q, k, v, _ = _inputs(n, l, l, heads, kv, h, seed=4)
    prompt_mask = _padded(n, p, left=(0, 4), right=(0, 0))
    completion_mask = (jnp.arange(c)[None, None, :] < jnp.array([[9, 5, 1], [7, 9, 3]])[..., None]).astype(jnp.int32)
    got = attention.shared_prompt_attention(q, k, v, prompt_mask, completion_mask, impl=impl, window=window)

    def rows(x):  # [N*G, P + C, ...]
        own = x[:, p:].reshape(n * g, c, *x.shape[2:])
        return jnp.concatenate([jnp.repeat(x[:, :p], g, axis=0), own], axis=1)

    valid = jnp.concatenate([jnp.repeat(prompt_mask, g, axis=0), completion_mask.reshape(n * g, c)], axis=1)
    ref, sees = _reference(rows(q), rows(k), rows(v), valid, 0, window)
    real = (sees & (valid > 0))[..., None, None]
    got_rows = rows(got)
    assert float(jnp.max(jnp.abs(jnp.where(real, got_rows - ref, 0)))) <= _atol(p + c, h, v)


def test_auto_picks_per_backend_and_size():
    small, large = 4 * 4 * 256 * 256, 1 << 40
    f32, bf16 = jnp.float32, jnp.bfloat16
    resolve = attention.resolve
    assert resolve("auto", dtype=f32, head_dim=64, score_bytes=small, backend="cpu") == "xla"
    assert resolve("auto", dtype=f32, head_dim=64, score_bytes=large, backend="cpu") == "blockwise"
    assert resolve("auto", dtype=bf16, head_dim=64, score_bytes=small, backend="gpu") == "cudnn"
    assert resolve("auto", dtype=f32, head_dim=64, score_bytes=large, backend="gpu") == "blockwise"  # fp32
    assert resolve("auto", dtype=bf16, head_dim=256, score_bytes=large, backend="gpu") == "blockwise"
    assert resolve("auto", dtype=bf16, head_dim=128, score_bytes=large, backend="tpu") == "splash"
    assert resolve("auto", dtype=bf16, head_dim=64, score_bytes=large, backend="tpu") == "blockwise"
    assert resolve("cudnn", dtype=bf16, head_dim=64, score_bytes=large, backend="cpu") == "blockwise"
    assert resolve("xla", dtype=f32, head_dim=64, score_bytes=large, backend="cpu") == "xla"
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        resolve("flash", dtype=f32, head_dim=64, score_bytes=small)
    line = attention.describe("auto", dtype=f32, head_dim=64, backend="cpu")
    assert "xla up to 16 MiB of scores per call, blockwise beyond on cpu" in line
    assert "cudnn needs a GPU" in attention.describe("cudnn", dtype=bf16, head_dim=64, backend="cpu")


def _saved_shapes(capsys, f, *args) -> list[tuple[int, ...]]:
    jax.ad_checkpoint.print_saved_residuals(f, *args)
    shapes = re.findall(r"\w+\[([\d,]*)\]", capsys.readouterr().out)
    return [tuple(int(d) for d in s.split(",") if d) for s in shapes]


@pytest.mark.parametrize("remat, impl, keeps_scores", [
    ("none", "xla", True),            # the control: without remat the reference kernel keeps them
    ("layer_inputs", "xla", False),
    ("dots", "xla", False),
    ("none", "blockwise", False),
    ("dots", "blockwise", False),
])
def test_no_remat_policy_keeps_attention_scores(capsys, remat, impl, keeps_scores):
    # The residuals the update's backward keeps, as jax lists them: no array with two axes of the
    # sequence's length (37 tokens, a length no other dimension has) under any remat policy or the
    # blockwise kernel; "dots" keeps the projections (an array with the fused q|k|v width).
    from flax import nnx

    from grpo_jax import model as M

    config = M.ModelConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, remat=remat, attention_impl=impl)
    graphdef, params = nnx.split(M.init_model(config, 0), nnx.Param)
    tokens = jnp.arange(2 * 37).reshape(2, 37) % 29
    mask = jnp.ones((2, 37), jnp.int32)

    def loss(params):
        return jnp.sum(M.token_logprobs(graphdef, params, tokens, mask, num_targets=5))

    shapes = _saved_shapes(capsys, loss, params)
    assert any(s.count(37) >= 2 for s in shapes) == keeps_scores, shapes
    if remat == "dots":
        assert (2, 37, (4 + 2 * 2) * 8) in shapes, shapes  # q|k|v [B, T, (N + 2K) H]


@pytest.mark.parametrize("group_size", [1, 3])
def test_the_models_log_probs_and_gradients_agree_across_kernels(group_size):
    # A 2-layer model whose second layer slides (window 4 over 18-token rows), GQA 4:2, left-padded
    # prompts and right-padded completions, each prompt shared by 3 completions (or not): the
    # log-probs and the gradient of a masked sum agree between the reference and blockwise kernels
    # (and splash, interpreted, for the shared layout). Bounds from tests/tolerances.py: the
    # kernels differ only in float32 summation order.
    from flax import nnx

    from grpo_jax import model as M
    from tolerances import FORWARD_REL_ERR, GRAD_REL_ERR

    base = dict(vocab_size=29, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, sliding_window=4, layer_types=("full_attention", "sliding_attention"))
    p, c, n = 8, 10, 2
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 29, (n, p))
    tokens = np.concatenate([np.repeat(prompts, 3, axis=0), rng.integers(1, 29, (3 * n, c))], axis=1)
    mask = np.ones_like(tokens)
    mask[3:6, :3] = 0                                   # the second prompt left-padded by 3
    for row, stop in enumerate([10, 6, 2, 9, 10, 4]):   # completions stopped at different lengths
        mask[row, p + stop:] = 0
    targets = jnp.asarray(mask[:, p:], jnp.float32)
    out = {}
    for impl in ("xla", "blockwise") + (("splash",) if group_size > 1 else ()):
        config = M.ModelConfig(**base, attention_impl=impl)
        graphdef, params = nnx.split(M.init_model(config, 0), nnx.Param)

        def loss(params):
            logp = M.token_logprobs(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), num_targets=c,
                                    group_size=group_size)
            return jnp.sum(logp * targets), logp

        (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params)
        out[impl] = (np.asarray(logp) * mask[:, p:], jax.tree.leaves(grads))
    ref_logp, ref_grads = out["xla"]
    for impl, (logp, grads) in out.items():
        np.testing.assert_allclose(logp, ref_logp, rtol=FORWARD_REL_ERR, atol=1e-6, err_msg=impl)
        for g, r in zip(grads, ref_grads):
            assert normwise_violation(g, r, GRAD_REL_ERR) <= 0, impl


@pytest.mark.slow
def test_blockwise_on_8_devices_equals_one_and_its_loops_stay_on_each_device(tmp_path):
    # tests/attention_sharding_check.py: the model's gradient through the blockwise kernel on
    # meshes (8,1,1), (2,2,2), (1,4,2) against one device. Equal to float32 summation order
    # (GRAD_REL_ERR, tests/tolerances.py); the program's collectives are the reference kernel's
    # (the model's tensor-parallel reductions), none added: each device attends its own rows and
    # kv heads.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tolerances import GRAD_REL_ERR

    out = tmp_path / "attention.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    tests = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(tests / "attention_sharding_check.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=tests.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    for mesh, entry in json.loads(out.read_text()).items():
        assert entry["max_rel_diff"] <= GRAD_REL_ERR, mesh
        assert entry["blockwise_collectives"] == entry["xla_collectives"], mesh
        if mesh != "8,1,1":  # split weights: the model's reductions are there to compare
            assert entry["xla_collectives"], mesh


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
@pytest.mark.parametrize("window", [None, 64])
def test_cudnn_on_a_gpu_equals_the_reference(window):
    # The real cuDNN kernel (bf16, as it requires) against the reference in float32 on the same
    # bf16 inputs: both round p to bf16 once before p @ v, so they differ by <= ~3 * 2^-8 max|v|
    # (as the bf16 blockwise test above). benchmarks/gpu_check.sh runs this on a lent GPU.
    b, t, n, kv, h = 2, 384, 8, 2, 64
    q, k, v, _ = _inputs(b, t, t, n, kv, h, seed=5, dtype=jnp.bfloat16)
    valid = _padded(b, t, left=(0, 37), right=(21, 0))
    assert attention.resolve("auto", dtype=jnp.bfloat16, head_dim=h, score_bytes=1 << 40) == "cudnn"
    ref, sees = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), valid, 0, window)
    got = fused.cudnn_attention(q, k, v, valid, window=window).astype(jnp.float32)
    real = (sees & (valid > 0))[..., None, None]
    err = jnp.max(jnp.abs(jnp.where(real, got - ref, 0)))
    assert float(err) <= 3 * 2.0**-8 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
