"""grpo_jax.sampling.sampler: cached decode against the full forward, filters, log-probs, EOS, compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import model as M
from grpo_jax.sampling import ops, static
from grpo_jax.sampling import sampler as S
from full_forward import full_forward

# One layer keeps compiles short; the cached-decode test uses two so the per-layer caches chain.
CONFIG = M.ModelConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=8, qkv_bias=True)
EOS, PAD = 2, 0
PROMPTS = [[5, 9, 3], [7, 1, 4, 8, 6, 11, 12]]  # different lengths: the first is left padded



@jax.jit
def _sharpen(params):
    # Random init gives near-uniform next-token distributions; a larger output head and random
    # norms make them peaked and distinct, so filters and frequencies test something.
    leaves, treedef = jax.tree.flatten(params)
    noise = jax.random.normal(jax.random.key(3), (sum(x.size for x in leaves),))
    out, offset = [], 0
    for x in leaves:
        out.append(x + 0.3 * noise[offset : offset + x.size].reshape(x.shape))
        offset += x.size
    return jax.tree.unflatten(treedef, out)


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(M.init_model(CONFIG, 0), nnx.Param)
    return graphdef, _sharpen(params)


@pytest.fixture(scope="module")
def sampler(model):
    # Shared so tests with equal shapes and SamplingConfig reuse one compiled pair.
    return S.Sampler(model[0], CONFIG, eos_id=EOS, pad_id=PAD)


def _full_logits(graphdef, params, out):
    """Full-forward logits over prompt + completion; [:, P - 1 + i] predicts completion token i."""
    tokens = jnp.concatenate([out.prompt_tokens_BxP, out.tokens_BxC], axis=1)
    mask = jnp.concatenate([out.prompt_mask_BxP, jnp.ones_like(out.tokens_BxC)], axis=1)
    p, c = out.prompt_tokens_BxP.shape[1], out.tokens_BxC.shape[1]
    return np.asarray(full_forward(graphdef, params, tokens, mask)[:, p - 1 : p - 1 + c])


def test_cached_decode_reproduces_full_forward_logits_step_by_step():
    config = M.ModelConfig(**{**CONFIG.__dict__, "num_layers": 2})
    graphdef, params = nnx.split(M.init_model(config, 0), nnx.Param)
    params = _sharpen(params)
    # Prompts left padded to 8; teacher-force 5 completion tokens through prefill + decode_step.
    p, c, g = 8, 5, 2
    tokens = np.zeros((2, p), np.int32)
    mask = np.zeros((2, p), np.int32)
    for i, prompt in enumerate(PROMPTS):
        tokens[i, p - len(prompt):], mask[i, p - len(prompt):] = prompt, 1
    forced = np.array([[3, 14, 27, 1, 6]] * 2 + [[20, 20, 5, 9, 2]] * 2, np.int32)  # B = 4 rows
    state = jax.jit(lambda pr, t, m: static.prefill(graphdef, pr, t, m, num_samples=g, max_new_tokens=c))(
        params, tokens, mask)
    step = jax.jit(lambda pr, caches, km, tok, pos, w: ops.decode_step(graphdef, pr, caches, km, tok, pos, w))
    cached = [np.asarray(state.logits_BxV)]
    caches, positions = state.caches, state.positions_B
    for i in range(c - 1):
        logits, caches = step(params, caches, state.key_mask_BxS, forced[:, i], positions + i, p + i)
        cached.append(np.asarray(logits))
    cached = np.stack(cached, axis=1)  # [B, C, V]

    full_tokens = np.concatenate([np.repeat(tokens, g, 0), forced], axis=1)
    full_mask = np.concatenate([np.repeat(mask, g, 0), np.ones_like(forced)], axis=1)
    full = np.asarray(full_forward(graphdef, params, full_tokens, full_mask))[:, p - 1 : p - 1 + c]
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)


def test_greedy_equals_argmax_of_full_forward_at_every_step(model, sampler):
    graphdef, params = model
    sampling = S.SamplingConfig(max_new_tokens=6, greedy=True, ignore_eos=True)
    out = sampler(params, PROMPTS, num_samples=2, sampling=sampling, rng=jax.random.key(0))
    assert out.tokens_BxC.shape == (4, 6) and out.prompt_tokens_BxP.shape == (4, 16)
    np.testing.assert_array_equal(out.tokens_BxC, _full_logits(graphdef, params, out).argmax(-1))
    # Both samples of a prompt are identical under greedy decoding.
    np.testing.assert_array_equal(out.tokens_BxC[0], out.tokens_BxC[1])


def test_returned_logprobs_equal_token_logprobs_recomputed(model, sampler):
    graphdef, params = model
    sampling = S.SamplingConfig(max_new_tokens=7, temperature=0.7, top_k=10, top_p=0.95)
    out = sampler(params, PROMPTS, num_samples=3, sampling=sampling, rng=jax.random.key(1))
    tokens = jnp.concatenate([out.prompt_tokens_BxP, out.tokens_BxC], axis=1)
    mask = jnp.concatenate([out.prompt_mask_BxP, out.mask_BxC], axis=1)
    recomputed = M.token_logprobs(graphdef, params, tokens, mask, num_targets=7, temperature=0.7)
    np.testing.assert_allclose(out.logprobs_BxC, recomputed * out.mask_BxC, atol=1e-5)
    assert out.logprobs_BxC.dtype == jnp.float32


def test_sampled_frequencies_match_softmax_over_temperature(model, sampler):
    graphdef, params = model
    n, temperature = 4000, 0.8
    out = sampler(params, [PROMPTS[0]], num_samples=n,
                  sampling=S.SamplingConfig(max_new_tokens=1, temperature=temperature),
                  rng=jax.random.key(2))
    counts = np.bincount(np.asarray(out.tokens_BxC[:, 0]), minlength=CONFIG.vocab_size)
    logits = _full_logits(graphdef, params, out)[0, 0]

    def chi_square(temp):
        probs = np.exp(logits / temp - np.logaddexp.reduce(logits / temp))
        expected = n * probs
        big = expected >= 5  # pool the rare tokens into one bin, the usual chi-square rule
        obs, exp = counts[big], expected[big]
        if (~big).any():
            obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
        return ((obs - exp) ** 2 / exp).sum(), len(obs) - 1

    stat, dof = chi_square(temperature)
    # 99.9% quantile of chi-square(dof) is below dof + 4.5 * sqrt(2 * dof) + 10 for dof <= 28.
    assert stat < dof + 4.5 * np.sqrt(2 * dof) + 10, (stat, dof)
    wrong, _ = chi_square(1.0)  # the same samples are far from softmax(logits / 1.0)
    assert wrong > dof + 4.5 * np.sqrt(2 * dof) + 10, wrong


def test_top_k_and_top_p_never_sample_outside_their_sets(model, sampler):
    graphdef, params = model
    for sampling in (S.SamplingConfig(max_new_tokens=5, top_k=3, ignore_eos=True),
                     S.SamplingConfig(max_new_tokens=5, top_p=0.6, temperature=1.3, ignore_eos=True)):
        out = sampler(params, PROMPTS, num_samples=16, sampling=sampling, rng=jax.random.key(4))
        logits = _full_logits(graphdef, params, out) / sampling.temperature  # [B, C, V]
        tokens = np.asarray(out.tokens_BxC)
        order = np.argsort(-logits, axis=-1)
        rank = np.argmax(order == tokens[..., None], axis=-1)  # 0 = most likely
        if sampling.top_k:
            assert rank.max() < 3
            assert len(np.unique(rank)) == 3  # and all three ranks do occur
        else:
            probs = np.exp(logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True))
            sorted_probs = np.take_along_axis(probs, order, axis=-1)
            mass_before = np.cumsum(sorted_probs, -1) - sorted_probs
            nucleus_size = (mass_before < 0.6).sum(-1)
            assert (rank < nucleus_size).all()
            assert (nucleus_size > 1).any() and (rank > 0).any()  # the filter did leave choices


def test_filter_logits_worked_example():
    # probs 0.5, 0.25, 0.125, 0.125: top_p 0.7 keeps the first two (0.5 < 0.7, 0.75 >= 0.7).
    logits = jnp.log(jnp.array([[0.125, 0.5, 0.125, 0.25]]))
    kept = np.isfinite(np.asarray(ops.filter_logits(logits, top_k=0, top_p=0.7)))
    np.testing.assert_array_equal(kept, [[False, True, False, True]])
    kept = np.isfinite(np.asarray(ops.filter_logits(logits, top_k=1, top_p=1.0)))
    np.testing.assert_array_equal(kept, [[False, True, False, False]])


def test_eos_ends_a_row_and_masks_the_rest(model, sampler):
    graphdef, params = model
    greedy = S.SamplingConfig(max_new_tokens=6, greedy=True, ignore_eos=True)
    free = sampler(params, PROMPTS, num_samples=2, sampling=greedy, rng=jax.random.key(0))
    free.tokens_BxC = free.tokens_BxC[::2]  # one row per prompt
    row0 = np.asarray(free.tokens_BxC[0])
    eos = int(row0[2])  # make row 0's third greedy token the EOS
    first = int(np.argmax(row0 == eos))
    sampler = S.Sampler(graphdef, CONFIG, eos_id=eos, pad_id=PAD)
    out = sampler(params, PROMPTS, num_samples=1,
                  sampling=S.SamplingConfig(max_new_tokens=6, greedy=True), rng=jax.random.key(0))
    tokens, mask = np.asarray(out.tokens_BxC), np.asarray(out.mask_BxC)
    np.testing.assert_array_equal(tokens[0, : first + 1], row0[: first + 1])
    assert (tokens[0, first + 1 :] == PAD).all()
    np.testing.assert_array_equal(mask[0], [1] * (first + 1) + [0] * (5 - first))
    assert not out.truncated_B[0]
    assert (np.asarray(out.logprobs_BxC)[0, first + 1 :] == 0).all()
    row1_has_eos = eos in free.tokens_BxC[1].tolist()
    assert bool(out.truncated_B[1]) == (not row1_has_eos)


def test_any_of_several_stop_ids_ends_a_row(model, sampler):
    # Qwen2.5-Instruct stops on <|im_end|> or <|endoftext|>: with one stop id a model that emits
    # the other kept generating. Row 0's greedy tokens: stop on its 2nd token (id a) or its 4th
    # (id b); with both ids given it ends at whichever comes first, in every row.
    graphdef, params = model
    greedy = S.SamplingConfig(max_new_tokens=6, greedy=True, ignore_eos=True)
    free = np.asarray(sampler(params, PROMPTS, num_samples=1, sampling=greedy, rng=jax.random.key(0)).tokens_BxC)
    a, b = int(free[0, 1]), int(free[0, 3])
    stops = tuple(sorted({a, b} - {PAD}))
    both = S.Sampler(graphdef, CONFIG, eos_id=stops, pad_id=PAD)
    out = both(params, PROMPTS, num_samples=1, sampling=S.SamplingConfig(max_new_tokens=6, greedy=True),
               rng=jax.random.key(0))
    mask, truncated = np.asarray(out.mask_BxC), np.asarray(out.truncated_B)
    for row in range(len(PROMPTS)):
        hits = [t for t in range(6) if free[row, t] in stops]
        length = hits[0] + 1 if hits else 6
        assert mask[row].sum() == length, row
        assert bool(truncated[row]) == (not hits), row
    with pytest.raises(ValueError, match="eos_id 999"):
        S.Sampler(graphdef, CONFIG, eos_id=(1, 999), pad_id=PAD)


def test_same_key_same_samples_other_key_differs(model, sampler):
    graphdef, params = model
    sampling = S.SamplingConfig(max_new_tokens=7, temperature=0.7, top_k=10, top_p=0.95)
    a = sampler(params, PROMPTS, num_samples=3, sampling=sampling, rng=jax.random.key(5))
    b = sampler(params, PROMPTS, num_samples=3, sampling=sampling, rng=jax.random.key(5))
    c = sampler(params, PROMPTS, num_samples=3, sampling=sampling, rng=jax.random.key(6))
    np.testing.assert_array_equal(a.tokens_BxC, b.tokens_BxC)
    np.testing.assert_array_equal(a.logprobs_BxC, b.logprobs_BxC)
    assert not np.array_equal(a.tokens_BxC, c.tokens_BxC)


def test_one_compile_per_prompt_bucket(model, sampler):
    graphdef, params = model
    sampling = S.SamplingConfig(max_new_tokens=6, greedy=True, ignore_eos=True)
    sampler(params, PROMPTS, num_samples=2, sampling=sampling, rng=jax.random.key(0))
    before = sampler.num_traces
    for prompts in ([[1, 2, 3], [4, 5]], [[6] * 16, [3]]):  # both bucket P = 16: no new compile
        sampler(params, prompts, num_samples=2, sampling=sampling, rng=jax.random.key(0))
    assert sampler.num_traces == before
    out = sampler(params, [[5] * 17, [1]], num_samples=2, sampling=sampling, rng=jax.random.key(0))
    assert out.prompt_tokens_BxP.shape == (4, 32) and sampler.num_traces == before + 1
    sampler(params, [[5] * 30, [1, 2]], num_samples=2, sampling=sampling, rng=jax.random.key(1))
    assert sampler.num_traces == before + 1
    small = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD, prompt_buckets=(8, 16))
    with pytest.raises(ValueError, match="longer than the largest prompt bucket 16"):
        small(params, [[5] * 17], num_samples=2, sampling=sampling, rng=jax.random.key(0))


def test_bad_inputs_name_the_field():
    graphdef, _ = nnx.split(M.init_model(CONFIG, 0), nnx.Param)
    with pytest.raises(ValueError, match=r"SamplingConfig.top_p must be in \(0, 1\], got 1.5"):
        S.SamplingConfig(max_new_tokens=4, top_p=1.5)
    with pytest.raises(ValueError, match="SamplingConfig.temperature must be > 0, got 0"):
        S.SamplingConfig(max_new_tokens=4, temperature=0)
    with pytest.raises(ValueError, match=r"eos_id 29 must be in \[0, vocab_size=29\), got 29"):
        S.Sampler(graphdef, CONFIG, eos_id=29, pad_id=0)
    sampler = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD)
    with pytest.raises(ValueError, match=r"prompts\[1\] has token ids outside \[0, vocab_size=29\)"):
        sampler(None, [[1], [3, 40]], num_samples=1, sampling=S.SamplingConfig(max_new_tokens=2),
                rng=jax.random.key(0))


def test_blocked_decode_attention_samples_the_same(model, monkeypatch):
    # Attending block by block up to the rows' position (blocks of 2 slots of the 16 + 6 slot
    # cache) must give the samples of one pass over the whole P + C cache: the blocks it skips
    # are masked out anyway. Log-probs differ by the softmax's float32 summation order over <= 22
    # slots (a few ulps of logits of size ~1 through the layer: ~1e-6; 1e-5 leaves a factor 10).
    from grpo_jax.model import blockwise

    graphdef, params = model
    prompts = [[3, 4, 5], [6, 7]]
    sampling = S.SamplingConfig(max_new_tokens=6, temperature=1.0)
    whole = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD)
    a = whole(params, prompts, num_samples=3, sampling=sampling, rng=jax.random.PRNGKey(7))
    monkeypatch.setattr(blockwise, "DECODE_BLOCK", 2)
    calls = []
    real = blockwise.decode_attention
    monkeypatch.setattr(blockwise, "decode_attention", lambda *a, **k: calls.append(k["block"]) or real(*a, **k))
    blocked = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD)
    b = blocked(params, prompts, num_samples=3, sampling=sampling, rng=jax.random.PRNGKey(7))
    assert calls and set(calls) == {2}  # the blocked kernel ran, once per layer when traced
    np.testing.assert_array_equal(np.asarray(a.tokens_BxC), np.asarray(b.tokens_BxC))
    np.testing.assert_array_equal(np.asarray(a.mask_BxC), np.asarray(b.mask_BxC))
    np.testing.assert_allclose(np.asarray(a.logprobs_BxC), np.asarray(b.logprobs_BxC), atol=1e-5)


def test_threads_split_the_prompts_and_sample_the_same(model):
    # Four prompts decoded as two halves on two threads (and as four quarters) give the rows of
    # one batch: each row's noise is keyed by its global row index, not by its batch.
    graphdef, params = model
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    sampling = S.SamplingConfig(max_new_tokens=5, temperature=1.0)
    outs = {}
    for threads in (1, 2, 4):
        sampler = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD, threads=threads)
        outs[threads] = sampler(params, prompts, num_samples=3, sampling=sampling, rng=jax.random.PRNGKey(5))
        # One compiled program, for parts of 4 / threads prompts each: the split did happen.
        assert sampler.num_traces == 1 and list(sampler._compiled)[0][2] == 4 // threads
    assert outs[1].tokens_BxC.shape == (12, 5)
    for threads in (2, 4):
        for field in ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxC", "mask_BxC", "truncated_B"):
            np.testing.assert_array_equal(np.asarray(getattr(outs[threads], field)),
                                          np.asarray(getattr(outs[1], field)), err_msg=field)
        np.testing.assert_allclose(np.asarray(outs[threads].logprobs_BxC), np.asarray(outs[1].logprobs_BxC),
                                   atol=1e-5)
    # Rows of one prompt differ (distinct keys), and a different key gives different samples.
    assert len({tuple(r) for r in np.asarray(outs[1].tokens_BxC)[:3]}) > 1
    other = sampler(params, prompts, num_samples=3, sampling=sampling, rng=jax.random.PRNGKey(6))
    assert not np.array_equal(np.asarray(other.tokens_BxC), np.asarray(outs[1].tokens_BxC))
    # 3 prompts over 2 threads: no equal split, so one part (no second compiled shape).
    odd = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD, threads=2)
    odd(params, prompts[:3], num_samples=2, sampling=sampling, rng=jax.random.PRNGKey(5))
    assert odd.num_traces == 1 and list(odd._compiled)[0][2] == 3
    with pytest.raises(ValueError, match="threads"):
        S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD, threads=0)


def test_prefill_rows_put_each_prompt_once_on_every_device_that_holds_its_rows():
    # 16 prompts over 8 row devices: each prompt once, 2 per device.
    assert S.prefill_rows(16, 8, 8) == 16
    # W1 on 8 devices, 4 prompts x G=8: one prompt per device, each prompt on the two devices
    # that hold its 8 rows (4 each), instead of all 4 prompts on every device.
    assert S.prefill_rows(4, 8, 8) == 8
    # 6 prompts x G=2 over 4: M = lcm(6, 4) = 12 (3 per device); device 0's rows 0-2 are prompts
    # 0, 0, 1, so it prefills prompt 0 twice: at most one copy too many per device.
    assert S.prefill_rows(6, 2, 4) == 12
    assert S.prefill_rows(3, 5, 1) == 3
    with pytest.raises(ValueError, match=r"3 prompts x 2 samples = 6 rows do not split over data\*fsdp = 4"):
        S.prefill_rows(3, 2, 4)


def test_threads_on_a_one_device_mesh_sample_the_same_rows_sharded(model):
    # The trainer always passes a mesh (one device on a laptop) and 2 threads on a CPU.
    from grpo_jax.distributed import sharding

    graphdef, params = model
    mesh = sharding.make_mesh()
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    sampling = S.SamplingConfig(max_new_tokens=5, temperature=1.0)
    plain = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD)(
        params, prompts, num_samples=3, sampling=sampling, rng=jax.random.PRNGKey(5))
    sampler = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD, mesh=mesh, threads=2)
    out = sampler(params, prompts, num_samples=3, sampling=sampling, rng=jax.random.PRNGKey(5))
    assert list(sampler._compiled)[0][2] == 2  # two parts of 2 prompts
    for field in ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxC", "mask_BxC", "truncated_B"):
        got = getattr(out, field)
        assert got.sharding.is_equivalent_to(sharding.batch_sharding(mesh), got.ndim), field
        np.testing.assert_array_equal(sharding.process_rows(got), np.asarray(getattr(plain, field)), err_msg=field)
    # The same per-row arithmetic, its matmuls blocked for 6 rows instead of 12: a few float32 ulps
    # of log-probs below 10 in size (ulp(8) = 1e-6).
    np.testing.assert_allclose(np.asarray(out.logprobs_BxC), np.asarray(plain.logprobs_BxC), atol=1e-5)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_lower_abstract_lowers_the_programs_a_real_call_runs(model, engine):
    # `check` compiles the sampler from shapes alone (no params in memory): lowering from
    # ShapeDtypeStructs that carry the decode layout must give the very programs that a call with
    # real params and prompts of that bucket runs (same module text: same shapes, layouts, ops).
    from grpo_jax.distributed import sharding
    from grpo_jax.model.config import DTYPES

    graphdef, params = model
    mesh = sharding.make_mesh()
    sampling = S.SamplingConfig(max_new_tokens=4)
    real = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD, mesh=mesh, engine=engine)
    lowered = real.lower(params, [[3, 4, 5], [6, 7]], num_samples=2, sampling=sampling, rng=jax.random.PRNGKey(0))
    decode_params = sharding.decode_params(mesh, params, dtype=DTYPES[CONFIG.dtype])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), decode_params)
    abstract = S.Sampler(graphdef, CONFIG, eos_id=EOS, pad_id=PAD, mesh=mesh, engine=engine)
    from_shapes = abstract.lower_abstract(shapes, prompt_len=16, num_prompts=2, num_samples=2, sampling=sampling)
    for name, a, b in zip(("prefill", "decode"), lowered, from_shapes):
        assert a.as_text() == b.as_text(), name
    with pytest.raises(ValueError, match=r"prompt_len=10 is not one of the prompt buckets"):
        abstract.lower_abstract(shapes, prompt_len=10, num_prompts=2, num_samples=2, sampling=sampling)
