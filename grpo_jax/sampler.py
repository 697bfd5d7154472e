"""KV-cache sampler: jitted prefill once per prompt, then a `jax.lax.while_loop` decode.

Flow for N prompts x G samples (B = N * G rows; row r is prompt r // G, sample r % G):
  1. Host: left-pad the prompts to the smallest bucket P >= longest prompt.
  2. `prefill` (jit): one forward over the N prompts (not N * G: each prompt is prefilled once),
     then each prompt's keys/values are repeated for its G samples into a cache of exactly
     S = P + max_new_tokens slots per row, sized tightly (a generous cache makes every decode step
     attend over empty slots).
  3. `decode` (jit, the state pytree donated so the cache is updated in place): loop: sample a
     token from the current logits, feed it at cache slot P + step (written with
     dynamic_update_slice) to get the next logits. Rows that emitted EOS keep feeding pad tokens and
     are masked; the loop exits early once every row is done (unless `ignore_eos`).
Both functions are compiled once per (P, N, G, SamplingConfig) and cached on the Sampler.

Log-probs are those of the full-vocabulary softmax(logits / temperature), before top-k / top-p,
so they equal `model.token_logprobs(..., temperature=T)` recomputed by the trainer (pi_old).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.model import KVCache, ModelConfig, default_positions

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 1.0      # 1.0: no nucleus filter
    greedy: bool = False
    ignore_eos: bool = False   # benchmarks: every row generates exactly max_new_tokens

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplingConfig.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    """Row r is prompt r // G, sample r % G. B = num_prompts * G, P bucketed, C = max_new_tokens."""

    prompt_tokens_BxP: jax.Array   # int32, left padded with pad_id
    prompt_mask_BxP: jax.Array     # int32, 1 = real token
    tokens_BxC: jax.Array          # int32, completion incl. EOS, pad_id after it
    mask_BxC: jax.Array            # int32, 1 for real completion tokens (EOS included)
    truncated_B: jax.Array         # bool, no EOS within max_new_tokens
    logprobs_BxC: jax.Array        # float32, log softmax(logits / T)[token]; 0 on padding


class DecodeState(NamedTuple):
    caches: list[KVCache]          # per layer, keys [B, K, H, S], values [B, K, S, H]
    key_mask_BxS: jax.Array        # 1 where a slot may hold a real token (prompt pads are 0)
    logits_BxV: jax.Array          # float32 logits for the next token to sample
    positions_B: jax.Array         # RoPE position of the next sampled token
    step: jax.Array                # int32 scalar: tokens sampled so far
    tokens_BxC: jax.Array
    logprobs_BxC: jax.Array
    done_B: jax.Array              # bool: EOS already emitted


_MAX_SEGMENTS = 8  # each segment is one more compiled loop body (~1-2 s of compile on a CPU)


def decode_segments(max_new_tokens: int, segment: int) -> tuple[int, ...]:
    """Ends (in generated tokens) of the decode segments; segment k attends over P + end_k slots.

    A fixed cache of P + C slots makes every step multiply all of them, masked ones included, so
    long generations pay for slots not yet written. Growing the cache segment by segment attends
    only over (about) the filled part; each extra segment costs one more compiled loop body, so
    short generations (C <= segment) keep a single one.
    """
    seg = max(segment, -(-max_new_tokens // _MAX_SEGMENTS), 1)
    return tuple(range(seg, max_new_tokens, seg)) + (max_new_tokens,)


def _pad_slots(x: jax.Array, axis: int, slots: int) -> jax.Array:
    """`slots` zeros appended along the cache's slot axis."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, slots)
    return jnp.pad(x, widths)


def _grow(state: "DecodeState", slots: int) -> "DecodeState":
    """Appends `slots` empty cache slots (visible once written: the causal test hides the rest)."""
    if slots == 0:
        return state
    b = state.key_mask_BxS.shape[0]
    return state._replace(
        caches=[KVCache(_pad_slots(layer.k_BxKxHxS, 3, slots), _pad_slots(layer.v_BxKxSxH, 2, slots))
                for layer in state.caches],
        key_mask_BxS=jnp.concatenate([state.key_mask_BxS, jnp.ones((b, slots), jnp.int32)], axis=1))


def prefill(graphdef, params, tokens_NxP, mask_NxP, *, num_samples: int, max_new_tokens: int,
            cache_tokens: int | None = None) -> DecodeState:
    """Forward over N left-padded prompts once; repeat each row's KV G times into S = P + c slots.

    c = `cache_tokens` (default max_new_tokens): the slots the first decode segment needs
    (`decode_segments`); later segments grow the cache.
    """
    model = nnx.merge(graphdef, params)
    g, c = num_samples, cache_tokens or max_new_tokens
    p = tokens_NxP.shape[1]
    h_NxPxD, kv = model.hidden_states(tokens_NxP, default_positions(mask_NxP), mask_NxP, max_position=p)
    # Left padding puts every prompt's last real token in slot P - 1.
    logits_NxV = model.logits(h_NxPxD[:, -1:])[:, 0]

    caches = [KVCache(_pad_slots(jnp.repeat(layer.k_BxKxHxS, g, axis=0), 3, c),
                      _pad_slots(jnp.repeat(layer.v_BxKxSxH, g, axis=0), 2, c)) for layer in kv]
    mask_BxP = jnp.repeat(mask_NxP, g, axis=0).astype(jnp.int32)
    b = mask_BxP.shape[0]
    # Completion slots count as real; the causal slot test hides the ones not yet written.
    key_mask_BxS = jnp.concatenate([mask_BxP, jnp.ones((b, c), jnp.int32)], axis=1)
    return DecodeState(
        caches=caches,
        key_mask_BxS=key_mask_BxS,
        logits_BxV=jnp.repeat(logits_NxV, g, axis=0),
        positions_B=mask_BxP.sum(axis=1),
        step=jnp.zeros((), jnp.int32),
        tokens_BxC=jnp.zeros((b, max_new_tokens), jnp.int32),
        logprobs_BxC=jnp.zeros((b, max_new_tokens), jnp.float32),
        done_B=jnp.zeros((b,), bool),
    )


def decode_step(graphdef, params, caches, key_mask_BxS, tokens_B, positions_B, write_index):
    """Feeds one token per row at cache slot write_index: (next logits_BxV float32, new caches)."""
    model = nnx.merge(graphdef, params)
    h_Bx1xD, caches = model.hidden_states(tokens_B[:, None], positions_B[:, None], key_mask_BxS,
                                          caches, write_index)
    return model.logits(h_Bx1xD)[:, 0], caches


def filter_logits(logits_BxV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets logits outside the top-k set, then outside the top-p nucleus, to -inf."""
    neg_inf = jnp.array(-jnp.inf, logits_BxV.dtype)
    if top_k and top_k < logits_BxV.shape[-1]:
        kth_B = jax.lax.top_k(logits_BxV, top_k)[0][:, -1]
        logits_BxV = jnp.where(logits_BxV < kth_B[:, None], neg_inf, logits_BxV)
    if top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_BxV, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass strictly
        # before it is still below top_p (the most likely token always stays).
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum(before < top_p, axis=-1)
        threshold_B = jnp.take_along_axis(sorted_BxV, (kept - 1)[:, None], axis=-1)
        logits_BxV = jnp.where(logits_BxV < threshold_B, neg_inf, logits_BxV)
    return logits_BxV


def argmax_last(x_BxV: jax.Array) -> jax.Array:
    """First index of the maximum over the last axis, int32 [B].

    Two plain reductions (max, then min index where equal): XLA's CPU lowering of argmax is a
    (value, index) pair reduction that took ~1.7 ms per decode step at [32, 1024].
    """
    v = x_BxV.shape[-1]
    top_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x_BxV == top_Bx1, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def row_keys(rng: jax.Array, row_ids_B: jax.Array) -> jax.Array:
    """One PRNG key per row, fold_in(rng, global row index): a row's samples do not depend on
    which other rows share its batch, so splitting the batch (threads, devices) changes nothing."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, row_ids_B)


def _sample(logits_BxV, keys_B, step, sampling: SamplingConfig):
    """(token_B, log-prob_B under the unfiltered softmax(logits / T)); row b's noise is drawn
    from fold_in(keys_B[b], step)."""
    scaled = logits_BxV.astype(jnp.float32) / sampling.temperature
    logp_BxV = jax.nn.log_softmax(scaled, axis=-1)
    if sampling.greedy:
        token_B = argmax_last(scaled)
    else:
        # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
        filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
        v = filtered.shape[-1]
        noise_BxV = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, step), (v,), jnp.float32))(keys_B)
        token_B = argmax_last(filtered + noise_BxV)
    token_B = token_B.astype(jnp.int32)
    return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]


def decode(graphdef, params, state: DecodeState, rng, *, prompt_len: int, sampling: SamplingConfig,
           eos_id: int, pad_id: int, segment: int | None = None, first_row=0) -> DecodeState:
    """Samples up to max_new_tokens per row with a while_loop; stops early when all rows are done.

    With `segment`, the loop runs in segments (`decode_segments`) and the cache grows between them,
    so attention covers only the slots the segment can have filled; the samples are the same.
    Row b of this batch is global row first_row + b: its noise comes from `row_keys`.
    """
    c = sampling.max_new_tokens
    ends = decode_segments(c, segment or c)
    b = state.done_B.shape[0]
    keys_B = row_keys(rng, jnp.asarray(first_row, jnp.int32) + jnp.arange(b, dtype=jnp.int32))

    def record(st: DecodeState) -> DecodeState:
        token_B, logp_B = _sample(st.logits_BxV, keys_B, st.step, sampling)
        token_B = jnp.where(st.done_B, pad_id, token_B)
        logp_B = jnp.where(st.done_B, 0.0, logp_B)
        start = (jnp.zeros((), jnp.int32), st.step)
        done_B = st.done_B if sampling.ignore_eos else st.done_B | (token_B == eos_id)
        return st._replace(
            tokens_BxC=jax.lax.dynamic_update_slice(st.tokens_BxC, token_B[:, None], start),
            logprobs_BxC=jax.lax.dynamic_update_slice(st.logprobs_BxC, logp_B[:, None], start),
            done_B=done_B,
            step=st.step + 1,
        )

    def cond_until(end):
        return lambda st: (st.step < end) & ~jnp.all(st.done_B)

    def body(st: DecodeState) -> DecodeState:
        # Sample, then feed the new token (slot P + step) to get the next logits. After the last
        # token this forward is wasted (1 of C steps), but sampling is traced once, not twice:
        # each threefry + sort instance costs seconds of compile time on a CPU.
        st = record(st)
        token_B = jax.lax.dynamic_index_in_dim(st.tokens_BxC, st.step - 1, axis=1, keepdims=False)
        logits_BxV, caches = decode_step(graphdef, params, st.caches, st.key_mask_BxS, token_B,
                                         st.positions_B, prompt_len + st.step - 1)
        return st._replace(caches=caches, logits_BxV=logits_BxV, positions_B=st.positions_B + 1)

    state = state._replace(tokens_BxC=jnp.full_like(state.tokens_BxC, pad_id))
    for end in ends:
        # Slots for this segment's tokens; a no-op for the first (prefill sized it).
        state = _grow(state, prompt_len + end - state.key_mask_BxS.shape[1])
        state = jax.lax.while_loop(cond_until(end), body, state)
    return state


@functools.cache
def _decode_compiler_options() -> dict | None:
    """XLA options for the decode loop. On a CPU: no YNNPACK fusions. Decode multiplies a few rows
    by each weight matrix, and the YNNPACK kernels (fast for the update's large matmuls) spend
    more on each call's setup than on the arithmetic there: W1's rollout 0.61-0.68 s -> 0.55-0.60
    s (benchmarks/NOTES.md). The option is experimental: a jaxlib that does not know it gets None
    (checked once on a tiny program) instead of a decode that fails to compile."""
    if jax.default_backend() != "cpu":
        return None
    options = {"xla_cpu_experimental_ynn_fusion_type": ""}
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except Exception:  # noqa: BLE001 - any rejection means: compile without it
        return None
    return options


def bucket_length(length: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= length."""
    for b in sorted(buckets):
        if b >= length:
            return b
    raise ValueError(f"prompt of {length} tokens is longer than the largest prompt bucket "
                     f"{max(buckets)}; prompt_buckets={tuple(buckets)}")


class Sampler:
    """Samples G completions per prompt. Holds only static fields and its compiled functions."""

    def __init__(self, graphdef, config: ModelConfig, *, eos_id: int, pad_id: int,
                 prompt_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048),
                 decode_segment: int = 64, mesh=None, threads: int = 1):
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < config.vocab_size:
                raise ValueError(f"Sampler {name} must be in [0, vocab_size={config.vocab_size}), got {value}")
        if not prompt_buckets or any(b <= 0 for b in prompt_buckets):
            raise ValueError(f"Sampler prompt_buckets must be positive lengths, got {prompt_buckets!r}")
        self.graphdef = graphdef
        self.config = config
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        if decode_segment <= 0:
            raise ValueError(f"Sampler decode_segment must be a positive number of tokens, got {decode_segment}")
        # Tokens per decode segment: generations longer than this grow the cache in segments and
        # attend only over what can be filled (see decode_segments); shorter ones use one loop.
        self.decode_segment = decode_segment
        # Multi-host (jax.process_count() > 1): each process passes its own prompts (its host
        # slice); they are assembled into global arrays with rows over ("data", "fsdp") and the
        # SampleOutput arrays are global too (read a process's rows with sharding.process_rows).
        self.mesh = mesh
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"Sampler threads must be an int >= 1, got {threads!r}")
        # Single process: the prompts are split into this many equal parts, each prefilled and
        # decoded by its own host thread. XLA's CPU backend runs a decode loop (small matmuls) on
        # one core, and executions dispatched from different threads run side by side; the
        # samples are the same for any split (`row_keys`).
        self.threads = threads
        self._compiled: dict[tuple, tuple] = {}
        self.num_traces = 0  # times a prefill/decode pair was traced (= compiled); tests read it

    def _functions(self, prompt_len: int, num_prompts: int, num_samples: int, sampling: SamplingConfig):
        key = (prompt_len, num_prompts, num_samples, sampling)
        if key not in self._compiled:
            ends = decode_segments(sampling.max_new_tokens, self.decode_segment)

            def prefill_fn(params, tokens, mask):
                self.num_traces += 1
                return prefill(self.graphdef, params, tokens, mask, num_samples=num_samples,
                               max_new_tokens=sampling.max_new_tokens, cache_tokens=ends[0])

            def decode_fn(params, state, rng, first_row):
                st = decode(self.graphdef, params, state, rng, prompt_len=prompt_len, sampling=sampling,
                            eos_id=self.eos_id, pad_id=self.pad_id, segment=self.decode_segment,
                            first_row=first_row)
                mask_BxP = state.key_mask_BxS[:, :prompt_len]
                c = sampling.max_new_tokens
                # 1 up to and including the first EOS; all 1 when EOS is ignored.
                if sampling.ignore_eos:
                    mask_BxC = jnp.ones_like(st.tokens_BxC)
                else:
                    is_eos = st.tokens_BxC == self.eos_id
                    eos_before = jnp.cumsum(is_eos, axis=1) - is_eos
                    mask_BxC = ((eos_before == 0) & (jnp.arange(c) < st.step)).astype(jnp.int32)
                truncated_B = ~jnp.any((st.tokens_BxC == self.eos_id) & (mask_BxC > 0), axis=1)
                # The final state goes back out so every donated buffer (the KV cache above all)
                # aliases an output: XLA then reuses the prefill's cache memory in place.
                return st, (mask_BxP, st.tokens_BxC, mask_BxC, truncated_B, st.logprobs_BxC * mask_BxC)

            # One segment: the prefill's cache is updated in place (donated, aliased by the output).
            # Several: each segment's larger cache is new memory, so donating would only warn.
            donate = (1,) if len(ends) == 1 else ()
            self._compiled[key] = (jax.jit(prefill_fn),
                                   jax.jit(decode_fn, donate_argnums=donate, compiler_options=_decode_compiler_options()))
        return self._compiled[key]

    def __call__(self, params, prompts: list[list[int]], *, num_samples: int, sampling: SamplingConfig,
                 rng: jax.Array) -> SampleOutput:
        if not prompts:
            raise ValueError("Sampler: prompts is empty; pass at least one list of token ids")
        if not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(f"Sampler: num_samples must be a positive int, got {num_samples!r}")
        v = self.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"Sampler: prompts[{i}] is empty; every prompt needs >= 1 token")
            if min(p) < 0 or max(p) >= v:
                raise ValueError(f"Sampler: prompts[{i}] has token ids outside [0, vocab_size={v}): "
                                 f"min {min(p)}, max {max(p)}")
        multi = self.mesh is not None and jax.process_count() > 1
        longest = max(len(p) for p in prompts)
        num_prompts = len(prompts)
        if multi:
            from jax.experimental import multihost_utils

            # Every process must compile the same program: agree on the bucket and the row count.
            agreed = np.asarray(multihost_utils.process_allgather(np.array([longest, num_prompts], np.int32)))
            agreed = agreed.reshape(-1, 2)
            if len(set(agreed[:, 1].tolist())) != 1:
                raise ValueError(f"Sampler: processes passed different numbers of prompts {agreed[:, 1].tolist()}; "
                                 "each process must pass an equal share (its host slice)")
            longest = int(agreed[:, 0].max())
            num_prompts = int(agreed[:, 1].sum())
        prompt_len = bucket_length(longest, self.prompt_buckets)
        tokens = np.full((len(prompts), prompt_len), self.pad_id, np.int32)
        mask = np.zeros((len(prompts), prompt_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, prompt_len - len(p):] = p
            mask[i, prompt_len - len(p):] = 1
        if multi:
            prefill_fn, decode_fn = self._functions(prompt_len, num_prompts, num_samples, sampling)
            return self._call_global(params, tokens, mask, num_prompts, num_samples, rng, prefill_fn, decode_fn)
        # Equal parts (one compiled program): the largest part count <= threads dividing the prompts.
        parts = max(k for k in range(1, min(self.threads, num_prompts) + 1) if num_prompts % k == 0)
        n = num_prompts // parts
        prefill_fn, decode_fn = self._functions(prompt_len, n, num_samples, sampling)

        def run_part(i):
            rows = slice(i * n, (i + 1) * n)
            state = prefill_fn(params, tokens[rows], mask[rows])
            return decode_fn(params, state, rng, np.int32(i * n * num_samples))[1]

        if parts == 1:
            outs = run_part(0)
        else:
            with concurrent.futures.ThreadPoolExecutor(parts) as pool:
                # Each thread waits for its own result, so the parts run concurrently.
                results = list(pool.map(lambda i: jax.block_until_ready(run_part(i)), range(parts)))
            outs = tuple(jnp.concatenate(xs, axis=0) for xs in zip(*results))
        mask_BxP, tokens_BxC, mask_BxC, truncated_B, logprobs_BxC = outs
        return SampleOutput(
            prompt_tokens_BxP=jnp.asarray(np.repeat(tokens, num_samples, axis=0)),
            prompt_mask_BxP=mask_BxP,
            tokens_BxC=tokens_BxC,
            mask_BxC=mask_BxC,
            truncated_B=truncated_B,
            logprobs_BxC=logprobs_BxC,
        )

    def _call_global(self, params, tokens, mask, num_prompts, num_samples, rng, prefill_fn, decode_fn):
        """Multi-host: this process's prompt rows -> global arrays -> global SampleOutput."""
        from grpo_jax import sharding

        mesh = self.mesh
        if num_prompts % sharding.batch_size_multiple(mesh):
            raise ValueError(f"Sampler: {num_prompts} prompts over all processes must be a multiple of "
                             f"data*fsdp = {sharding.batch_size_multiple(mesh)} on a multi-host mesh")
        tokens_g, mask_g = sharding.global_batch(mesh, (tokens, mask), num_prompts)
        # The key as host data: the same value on every process, replicated by jit.
        rng = np.asarray(rng)
        _, outs = decode_fn(params, prefill_fn(params, tokens_g, mask_g), rng, np.int32(0))
        # Rows over ("data", "fsdp") whatever layout XLA chose, so process_rows reads this host's rows.
        mask_BxP, tokens_BxC, mask_BxC, truncated_B, logprobs_BxC = sharding.put_sharded(
            outs, sharding.batch_sharding(mesh))
        prompt_tokens = sharding.global_batch(mesh, np.repeat(tokens, num_samples, axis=0),
                                              num_prompts * num_samples)
        return SampleOutput(
            prompt_tokens_BxP=prompt_tokens,
            prompt_mask_BxP=mask_BxP,
            tokens_BxC=tokens_BxC,
            mask_BxC=mask_BxC,
            truncated_B=truncated_B,
            logprobs_BxC=logprobs_BxC,
        )
