"""grpo_jax.model: the decoder against a plain-numpy reference, padding, RoPE scaling, log-probs."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from grpo_jax import model as M
from full_forward import full_forward

TINY = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8)


# Jitted once per graphdef: op-by-op execution compiles every op and is slow on a small CPU.
_token_logprobs = jax.jit(M.token_logprobs, static_argnums=0,
                          static_argnames=("num_targets", "temperature", "return_entropy", "chunk_size"))


@jax.jit
def _perturb(params):
    # Norm scales start at 1 and biases at 0; perturb every weight so the reference checks them.
    leaves, treedef = jax.tree.flatten(params)
    noise = jax.random.normal(jax.random.key(7), (sum(x.size for x in leaves),))
    out, offset = [], 0
    for x in leaves:
        out.append(x + 0.1 * noise[offset : offset + x.size].reshape(x.shape))
        offset += x.size
    return jax.tree.unflatten(treedef, out)


def _split(config, seed=0):
    graphdef, params = nnx.split(M.init_model(config, seed), nnx.Param)
    return graphdef, _perturb(params)


def _numpy_reference(config, params, tokens, mask):
    """Logits [B, T, V] written token by token in float64 numpy, in HF's layout and order."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(params))
    c = config
    b, t = tokens.shape
    h, n, k = c.head_dim, c.num_heads, c.num_kv_heads
    inv_freq = np.asarray(M.rope_inv_freq(c), np.float64)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * w

    def rope(x, pos):  # x [heads, H]
        ang = pos * inv_freq
        x1, x2 = x[:, : h // 2], x[:, h // 2 :]
        return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)

    out = np.zeros((b, t, c.vocab_size))
    for row in range(b):
        real = [i for i in range(t) if mask[row, i]]
        x = p["embed"][tokens[row]]  # [T, D]
        for layer in p["layers"].values():
            a = layer["attn"]
            y = norm(x, layer["attn_norm"])
            new = x.copy()
            ks, vs, qs = {}, {}, {}
            for pos, i in enumerate(real):
                q = np.einsum("d,dnh->nh", y[i], a["q_proj"]) + a.get("q_bias", 0)
                kk = np.einsum("d,dkh->kh", y[i], a["k_proj"]) + a.get("k_bias", 0)
                vv = np.einsum("d,dkh->kh", y[i], a["v_proj"]) + a.get("v_bias", 0)
                if c.qk_norm:
                    q, kk = norm(q, a["q_norm"]), norm(kk, a["k_norm"])
                qs[i], ks[i], vs[i] = rope(q, pos), rope(kk, pos), vv
            for pos, i in enumerate(real):
                heads = []
                for head in range(n):
                    kv = head // (n // k)  # HF repeat_kv: consecutive query heads share a kv head
                    sc = np.array([qs[i][head] @ ks[j][kv] for j in real[: pos + 1]]) / math.sqrt(h)
                    w = np.exp(sc - sc.max())
                    w /= w.sum()
                    heads.append(sum(wj * vs[j][kv] for wj, j in zip(w, real[: pos + 1])))
                new[i] = x[i] + np.einsum("nh,nhd->d", np.stack(heads), a["o_proj"])
            x = new
            z = norm(x, layer["mlp_norm"])
            m = layer["mlp"]
            gate, up = z @ m["gate_proj"], z @ m["up_proj"]
            x = x + (gate / (1 + np.exp(-gate)) * up) @ m["down_proj"]
        x = norm(x, p["final_norm"])
        head_w = p["embed"].T if c.tie_embeddings else p["lm_head"]
        out[row] = x @ head_w
    return out


def test_config_errors_name_the_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"ModelConfig.dtype must be one of \['bfloat16', 'float32'\], got 'float16'"):
        M.ModelConfig(**TINY, dtype="float16")
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        M.ModelConfig(**{**TINY, "num_kv_heads": 3})
    with pytest.raises(ValueError, match=r"ModelConfig.hidden_size must be a positive int, got 0"):
        M.ModelConfig(**{**TINY, "hidden_size": 0})
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        M.RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                      original_max_position_embeddings=8192)


def test_parameter_tree_names_and_shapes_are_the_documented_layout():
    # hf.py maps Hugging Face tensors onto exactly these names and shapes.
    config = M.ModelConfig(**TINY, qkv_bias=True, qk_norm=True)
    _, params = nnx.split(M.init_model(config, 0), nnx.Param)
    shapes = jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(params))
    assert shapes["embed"] == (37, 16) and shapes["lm_head"] == (16, 37) and shapes["final_norm"] == (16,)
    assert shapes["layers"][1] == {
        "attn_norm": (16,), "mlp_norm": (16,),
        "attn": {"q_proj": (16, 4, 8), "k_proj": (16, 2, 8), "v_proj": (16, 2, 8), "o_proj": (4, 8, 16),
                 "q_bias": (4, 8), "k_bias": (2, 8), "v_bias": (2, 8), "q_norm": (8,), "k_norm": (8,)},
        "mlp": {"gate_proj": (16, 24), "up_proj": (16, 24), "down_proj": (24, 16)},
    }
    tied = nnx.to_pure_dict(nnx.split(M.init_model(M.ModelConfig(**TINY, tie_embeddings=True), 0), nnx.Param)[1])
    assert "lm_head" not in tied and "q_bias" not in tied["layers"][0]["attn"]


@pytest.mark.parametrize("flags", [
    dict(),                                                     # Llama
    dict(qkv_bias=True, tie_embeddings=True),                   # Qwen2 (small, tied)
    dict(qk_norm=True, rope_theta=1e6),                         # Qwen3
    dict(rope_scaling=M.RopeScaling(8.0, 1.0, 4.0, 16)),        # Llama 3.1 scaling
])
def test_forward_matches_numpy_reference_with_left_padding(flags):
    config = M.ModelConfig(**TINY, **flags)
    graphdef, params = _split(config)
    tokens = np.array([[3, 9, 1, 30, 7, 2], [0, 0, 5, 11, 36, 4]], np.int32)
    mask = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], np.int32)
    got = np.asarray(full_forward(graphdef, params, tokens, mask))
    want = _numpy_reference(config, params, tokens, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=1e-5)
    assert np.isfinite(got).all()  # padding queries see no key: finite, not NaN


def test_left_padding_does_not_change_real_token_logits():
    # The same 4 tokens alone, or after 3 pads: positions restart at 0 on the first real token.
    config = M.ModelConfig(**TINY)
    graphdef, params = _split(config)
    alone = full_forward(graphdef, params, jnp.array([[4, 8, 15, 16]]), jnp.ones((1, 4), jnp.int32))
    padded = full_forward(graphdef, params, jnp.array([[0, 0, 0, 4, 8, 15, 16]]),
                       jnp.array([[0, 0, 0, 1, 1, 1, 1]]))
    np.testing.assert_allclose(padded[:, 3:], alone, atol=1e-5)
    # Tokens-only call: causal over everything, positions 0..T-1.
    model = nnx.merge(graphdef, params)
    np.testing.assert_allclose(model(jnp.array([[4, 8, 15, 16]])), alone, atol=1e-6)


def test_llama3_rope_scaling_bands():
    # factor 8, low 1, high 4, original context 16, head_dim 8, theta 10000:
    # inv_freq = 1, 0.1, 0.01, 0.001 -> wavelengths 6.28, 62.8, 628, 6283.
    # wavelen < 16/4 = 4: none; 4..16 (medium): 2*pi -> smooth = (16/6.283 - 1)/3 = 0.5155,
    #   freq = (1 - s) * 1/8 + s * 1 = 0.5758; > 16 (low band): divided by 8.
    config = M.ModelConfig(**{**TINY, "head_dim": 8}, rope_scaling=M.RopeScaling(8.0, 1.0, 4.0, 16))
    got = np.asarray(M.rope_inv_freq(config))
    smooth = (16 / (2 * math.pi) - 1) / 3
    np.testing.assert_allclose(got, [(1 - smooth) / 8 + smooth, 0.1 / 8, 0.01 / 8, 0.001 / 8], rtol=1e-6)


def test_token_logprobs_equal_log_softmax_of_full_forward_and_entropy_formula():
    config = M.ModelConfig(**TINY)
    graphdef, params = _split(config)
    tokens = jnp.array([[0, 0, 5, 11, 36, 4, 9], [3, 9, 1, 30, 7, 2, 2]])
    mask = jnp.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    temperature = 0.7
    logits = full_forward(graphdef, params, tokens, mask)
    logp_all = jax.nn.log_softmax(logits / temperature, -1)
    # Token t is predicted at position t - 1: targets 4..6 come from positions 3..5.
    want = np.take_along_axis(np.asarray(logp_all[:, 3:6]), np.asarray(tokens[:, 4:, None]), -1)[..., 0]
    probs = np.exp(np.asarray(logp_all[:, 3:6], np.float64))
    want_entropy = -(probs * np.log(probs)).sum(-1)

    logp, entropy = _token_logprobs(graphdef, params, tokens, mask, num_targets=3,
                                     temperature=temperature, return_entropy=True)
    assert logp.shape == (2, 3) and logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, want, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, atol=1e-5)
    # Chunked path (2 positions per chunk, last chunk padded) gives the same numbers.
    logp_c, entropy_c = _token_logprobs(graphdef, params, tokens, mask, num_targets=3,
                                         temperature=temperature, return_entropy=True, chunk_size=2)
    np.testing.assert_allclose(logp_c, want, atol=1e-5)
    np.testing.assert_allclose(entropy_c, want_entropy, atol=1e-5)
    with pytest.raises(ValueError, match=r"num_targets must be in \[1, S - 1\] = \[1, 6\], got 7"):
        _token_logprobs(graphdef, params, tokens, mask, num_targets=7)


def test_chunked_token_logprobs_gradient_matches_unchunked():
    config = M.ModelConfig(**{**TINY, "num_layers": 1})
    graphdef, params = _split(config)
    tokens = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    mask = jnp.ones_like(tokens)

    def loss(p, chunk):
        return M.token_logprobs(graphdef, p, tokens, mask, num_targets=5, chunk_size=chunk).sum()

    g_full = jax.jit(jax.grad(loss), static_argnums=1)(params, None)
    g_chunk = jax.jit(jax.grad(loss), static_argnums=1)(params, 2)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_partition_specs_table_matches_weight_annotations():
    config = M.ModelConfig(**TINY, qkv_bias=True, qk_norm=True)
    _, params = nnx.split(M.init_model(config, 0), nnx.Param)
    specs = M.partition_specs(params)
    assert specs["layers"][0]["attn"]["q_proj"].get_value() == P("fsdp", "tensor", None)
    assert specs["layers"][0]["attn"]["o_proj"].get_value() == P("tensor", None, "fsdp")
    assert specs["embed"].get_value() == P("tensor", "fsdp") and specs["lm_head"].get_value() == P("fsdp", "tensor")
    # Each weight's nnx metadata carries the same annotation the table gives.
    annotated = nnx.get_partition_spec(params)
    assert jax.tree.leaves(annotated) == jax.tree.leaves(specs)
    # A plain dict of arrays (e.g. after to_pure_dict) works too.
    plain = M.partition_specs(nnx.to_pure_dict(params))
    assert plain["layers"][1]["mlp"]["down_proj"] == P("tensor", "fsdp")


def test_bfloat16_compute_stays_close_to_float32():
    f32 = M.ModelConfig(**TINY)
    graphdef, params = _split(f32)
    bf16_graphdef, _ = nnx.split(M.init_model(M.ModelConfig(**TINY, dtype="bfloat16"), 0), nnx.Param)
    tokens, mask = jnp.array([[3, 9, 1, 30, 7]]), jnp.ones((1, 5), jnp.int32)
    a = full_forward(graphdef, params, tokens, mask)
    b = full_forward(bf16_graphdef, params, tokens, mask)
    assert b.dtype == jnp.float32
    np.testing.assert_allclose(a, b, atol=0.05)
    assert not np.allclose(a, b, atol=1e-6)  # bf16 really was used


def test_caller_positions_beyond_the_sequence_length_shift_rope_only():
    # RoPE encodes relative positions: tokens at positions 10..13 give the logits of positions
    # 0..3 (the per-position table used for default positions must not clamp caller positions).
    config = M.ModelConfig(**TINY)
    graphdef, params = _split(config)
    tokens = jnp.array([[5, 11, 36, 4]])
    mask = jnp.ones_like(tokens)
    base = full_forward(graphdef, params, tokens, mask)
    shifted = full_forward(graphdef, params, tokens, mask, jnp.arange(10, 14)[None])
    np.testing.assert_allclose(shifted, base, atol=1e-4)
    assert not np.allclose(full_forward(graphdef, params, tokens, mask, jnp.array([[0, 2, 4, 6]])), base, atol=1e-3)


@pytest.mark.parametrize("extra, atol", [(dict(qkv_bias=True), 1e-5), (dict(qk_norm=True), 1e-5),
                                         (dict(qkv_bias=True, dtype="bfloat16", param_dtype="bfloat16",
                                               tie_embeddings=True), 3e-2)],
                         ids=["qwen2", "qwen3", "bf16-tied"])
def test_shared_prompt_logprobs_entropy_and_gradients_equal_per_row_prompts(extra, atol):
    # 3 prompts x G=4 answers: each prompt once (group_size=4) or copied into all 4 rows must give
    # the same log-probs, entropies and gradients. Prompts are left padded by different amounts;
    # two answers end early (EOS then padding, mask 0) as the sampler leaves them.
    config = M.ModelConfig(**{**TINY, **extra})
    graphdef, params = _split(config)
    rng = np.random.default_rng(0)
    n, g, p, c = 3, 4, 6, 5
    prompt_mask = np.ones((n, p), np.int32)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :5] = 0
    prompts = rng.integers(3, 37, (n, p)) * prompt_mask
    comp_mask = np.ones((n, g, c), np.int32)
    comp_mask[0, 0, 1:] = 0
    comp_mask[1, 2, 3:] = 0
    answers = rng.integers(3, 37, (n, g, c)) * comp_mask
    tokens = jnp.asarray(np.concatenate([np.repeat(prompts[:, None], g, 1), answers], -1).reshape(n * g, p + c))
    mask = jnp.asarray(np.concatenate([np.repeat(prompt_mask[:, None], g, 1), comp_mask], -1).reshape(n * g, p + c))

    def logprobs(prm, group_size):
        return M.token_logprobs(graphdef, prm, tokens, mask, num_targets=c, temperature=0.9,
                                return_entropy=True, group_size=group_size)

    run = jax.jit(logprobs, static_argnums=1)
    (lp_row, ent_row), (lp_shared, ent_shared) = run(params, 1), run(params, g)
    np.testing.assert_allclose(lp_shared, lp_row, atol=atol)
    np.testing.assert_allclose(ent_shared, ent_row, atol=atol)
    if config.dtype == "bfloat16":  # bfloat16 rounds differently along the two paths: values only
        return
    weights = jnp.asarray(rng.normal(size=(n * g, c)) * comp_mask.reshape(n * g, c), jnp.float32)
    grad = jax.jit(jax.grad(lambda prm, gs: (logprobs(prm, gs)[0] * weights).sum()), static_argnums=1)
    grads_row, grads_shared = grad(params, 1), grad(params, g)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_row), jax.tree.leaves(grads_shared)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    with pytest.raises(ValueError, match="group_size must be an int >= 1 dividing the 12 rows, got 5"):
        M.token_logprobs(graphdef, params, tokens, mask, num_targets=c, group_size=5)


@pytest.mark.parametrize("d, f", [(6, 10), (10, 6)], ids=["d<f", "d>f"])
def test_dense_and_swiglu_custom_gradients_equal_plain_autodiff(d, f):
    # The hand-written backward passes (layouts for XLA's CPU kernels) against jax.grad of the
    # plain formulas: x @ w, and silu(gate) * up from the fused [.., 2F] projection.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 3, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, f)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(2, 3, f)), jnp.float32)
    got = jax.grad(lambda x, w: (M.dense(x, w) * cot).sum(), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: (jnp.einsum("btd,df->btf", x, w) * cot).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    gate_up = jnp.asarray(rng.normal(size=(2, 3, 2 * f)) * 3, jnp.float32)
    cot_h = cot[..., :f]
    np.testing.assert_allclose(M.swiglu(gate_up), jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:], rtol=1e-6)
    got = jax.grad(lambda gu: (M.swiglu(gu) * cot_h).sum())(gate_up)
    want = jax.grad(lambda gu: (jax.nn.silu(gu[..., :f]) * gu[..., f:] * cot_h).sum())(gate_up)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group_size", [1, 2])
def test_remat_keeps_only_each_layers_input_and_gives_the_same_gradient(group_size):
    """model.remat: the backward pass keeps [B, T, D]-sized arrays per layer, not the attention's
    [B, K, G, T, S] probabilities; the gradient is the same computation replayed, so bit-equal."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals  # the only public form: one line per residual

    def residual_sizes(f, *args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(f, *args)
        # "f32[4,24,16] output of add from ...": elements of every array that is not an argument.
        return [math.prod(int(d) for d in m.group(1).split(",") if d)
                for line in out.getvalue().splitlines() if "from the argument" not in line
                for m in [re.match(r"\w+\[([\d,]*)\]", line.strip())] if m]

    config = M.ModelConfig(**{**TINY, "num_layers": 3})
    b, s, c = 4, 24, 12
    tokens = jax.random.randint(jax.random.key(1), (b, s), 0, config.vocab_size)
    tokens = tokens.at[:, : s - c].set(tokens[:1, : s - c])  # groups share their prompt
    mask = jnp.ones_like(tokens)
    grads, largest = {}, {}
    for remat in (False, True):
        graphdef, params = _split(dataclasses.replace(config, remat=remat))

        def loss(p):
            return M.token_logprobs(graphdef, p, tokens, mask, num_targets=c, group_size=group_size).sum()

        grads[remat] = jax.jit(jax.grad(loss))(params)
        largest[remat] = max(residual_sizes(loss, params))
    # A layer's input is [B, S, D] (per-row) or [B/G, P + G*C, D] (shared prompt): <= B*S*D; after
    # the layers the log-softmax keeps [B, C, V]. Without remat the attention's probabilities
    # [B, K, G, S, S] (4 x 2 x 2 x 24 x 24 here) are kept too.
    bound = max(b * s * config.hidden_size, b * c * config.vocab_size)
    assert largest[True] <= bound < largest[False], (largest, bound)
    for x, y in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[True])):
        np.testing.assert_array_equal(x, y)
