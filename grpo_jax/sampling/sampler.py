"""KV-cache sampler: jitted prefill once per prompt, then a `jax.lax.while_loop` decode.

Flow for N prompts x G samples (B = N * G rows; row r is prompt r // G, sample r % G):
  1. Host: left-pad the prompts to the smallest bucket P >= longest prompt.
  2. `prefill` (jit): one forward over the prompts (not N * G rows: each prompt is prefilled once
     per device that holds its rows), then each prompt's keys/values are repeated for its samples
     into a cache of exactly S = P + max_new_tokens slots per row.
  3. `decode` (jit, the state pytree donated so the cache is updated in place): loop: sample a
     token from the current logits, feed it at cache slot P + step (written with
     dynamic_update_slice) to get the next logits. Rows that emitted EOS keep feeding pad tokens and
     are masked; the loop exits early once every row is done (unless `ignore_eos`). A step attends
     only over the cache blocks written so far (`grpo_jax.model.blockwise.decode_attention`), so an
     unused max_new_tokens budget costs memory for the cache, not time.
Both functions are compiled once per (P, N, G, SamplingConfig) and cached on the Sampler.

On a mesh (one process or many, the same path), rows are split over ("data", "fsdp") from prefill
to the outputs: each device prefills M / (data * fsdp) rows, M = lcm(N, data * fsdp) (each prompt
copied M / N times, so a device's prompts are exactly those of its rows), repeats them locally to
its B / (data * fsdp) rows and decodes only those. The weights are moved once per call into the
decode layout (`sharding.decode_param_shardings`: whole along fsdp, split over tensor), so the
loop body has no weight collectives. Every row's noise is keyed by its global row index
(`row_keys`), so the samples do not depend on the mesh or the thread split.

Log-probs are those of the full-vocabulary softmax(logits / temperature), before top-k / top-p,
so they equal `model.token_logprobs(..., temperature=T)` recomputed by the trainer (pi_old).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.distributed import sharding
from grpo_jax.model import KVCache, ModelConfig, default_positions
from grpo_jax.model.config import DTYPES


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


def _pad_slots(x: jax.Array, axis: int, slots: int) -> jax.Array:
    """`slots` zeros appended along the cache's slot axis."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, slots)
    return jnp.pad(x, widths)


def prefill(graphdef, params, tokens_NxP, mask_NxP, *, num_samples: int, max_new_tokens: int) -> DecodeState:
    """Forward over N left-padded prompts once; repeat each row's KV G = `num_samples` times into
    S = P + max_new_tokens slots (row n * G + g of the state is prompt n). With rows sharded, the
    repeat is local: each device's G copies of its prompts are its own rows.
    """
    model = nnx.merge(graphdef, params)
    g, c = num_samples, max_new_tokens
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


def decode_step(graphdef, params, caches, key_mask_BxS, tokens_B, positions_B, write_index, slot_bounds=None):
    """Feeds one token per row at cache slot write_index (one for all rows, or [B]): (next logits_BxV
    float32, new caches). slot_bounds: the lowest and highest write_index of the rows that count
    (`Attention.__call__`; computed from write_index when None)."""
    model = nnx.merge(graphdef, params)
    h_Bx1xD, caches = model.hidden_states(tokens_B[:, None], positions_B[:, None], key_mask_BxS,
                                          caches, write_index, slot_bounds=slot_bounds)
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
    (value, index) pair reduction, several times slower per decode step (benchmarks/NOTES.md).
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
    from fold_in(keys_B[b], step) (`step` one for all rows, or one per row [B])."""
    scaled = logits_BxV.astype(jnp.float32) / sampling.temperature
    logp_BxV = jax.nn.log_softmax(scaled, axis=-1)
    if sampling.greedy:
        token_B = argmax_last(scaled)
    else:
        # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
        filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
        v = filtered.shape[-1]
        if jnp.ndim(step) == 0:  # one step for all rows (the static engine): fold it in as a constant
            noise_BxV = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, step), (v,), jnp.float32))(keys_B)
        else:
            noise_BxV = jax.vmap(lambda k, t: jax.random.gumbel(jax.random.fold_in(k, t), (v,), jnp.float32))(
                keys_B, step)
        token_B = argmax_last(filtered + noise_BxV)
    token_B = token_B.astype(jnp.int32)
    return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]


def is_stop(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """True where a token is any of the stop ids (a chat model may have several: Qwen2.5-Instruct
    stops on <|im_end|> and <|endoftext|>). `eos_ids` is static: a few unrolled compares."""
    hit = tokens == eos_ids[0]
    for eos in eos_ids[1:]:
        hit = hit | (tokens == eos)
    return hit


def force_lengths(logits_SxV, step_S, length_S, eos_id: int, stop_ids: tuple[int, ...]):
    """Logits that make a row stop after exactly length_S[s] tokens (0: leave the row alone):
    every logit but `eos_id`'s is -inf at step length - 1, and every stop id's before it. For
    benchmarks whose completion lengths are fixed in advance (the same for every engine)."""
    v = logits_SxV.shape[-1]
    ids = jnp.arange(v, dtype=jnp.int32)
    is_stop_V = jnp.zeros((v,), bool)
    for e in stop_ids:
        is_stop_V = is_stop_V | (ids == e)
    forced = length_S > 0
    last = forced & (step_S == length_S - 1)
    before = forced & (step_S < length_S - 1)
    neg_inf = jnp.array(-jnp.inf, logits_SxV.dtype)
    logits_SxV = jnp.where(last[:, None] & (ids != eos_id)[None, :], neg_inf, logits_SxV)
    return jnp.where(before[:, None] & is_stop_V[None, :], neg_inf, logits_SxV)


def decode(graphdef, params, state: DecodeState, rng, *, prompt_len: int, sampling: SamplingConfig,
           eos_id: int | tuple[int, ...], pad_id: int, first_row=0, forced_length_B=None) -> DecodeState:
    """Samples up to max_new_tokens per row with a while_loop; stops early when all rows are done.

    A row is done once it samples any of the stop ids `eos_id` (one id or a tuple of them).
    Row b of this batch is global row first_row + b: its noise comes from `row_keys`.
    forced_length_B (benchmarks): row b stops after exactly that many tokens (`force_lengths`).
    """
    c = sampling.max_new_tokens
    eos_ids = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    b = state.done_B.shape[0]
    keys_B = row_keys(rng, jnp.asarray(first_row, jnp.int32) + jnp.arange(b, dtype=jnp.int32))

    def record(st: DecodeState) -> DecodeState:
        logits_BxV = st.logits_BxV
        if forced_length_B is not None:
            logits_BxV = force_lengths(logits_BxV, jnp.broadcast_to(st.step, (b,)), forced_length_B, eos_ids[0], eos_ids)
        token_B, logp_B = _sample(logits_BxV, keys_B, st.step, sampling)
        token_B = jnp.where(st.done_B, pad_id, token_B)
        logp_B = jnp.where(st.done_B, 0.0, logp_B)
        start = (jnp.zeros((), jnp.int32), st.step)
        done_B = st.done_B if sampling.ignore_eos else st.done_B | is_stop(token_B, eos_ids)
        return st._replace(
            tokens_BxC=jax.lax.dynamic_update_slice(st.tokens_BxC, token_B[:, None], start),
            logprobs_BxC=jax.lax.dynamic_update_slice(st.logprobs_BxC, logp_B[:, None], start),
            done_B=done_B,
            step=st.step + 1,
        )

    def cond(st: DecodeState):
        if sampling.ignore_eos:
            # No row ever finishes early: a trip count, and (rows sharded) no all-reduce of the
            # rows' done flags across devices before every token.
            return st.step < c
        return (st.step < c) & ~jnp.all(st.done_B)

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
    return jax.lax.while_loop(cond, body, state)


@functools.cache
def _decode_compiler_options() -> dict | None:
    """XLA options for the decode loop. On a CPU: no YNNPACK fusions. Decode multiplies a few rows
    by each weight matrix, and the YNNPACK kernels (fast for the update's large matmuls) spend
    more on each call's setup than on the arithmetic there (W1's rollout: benchmarks/NOTES.md). The option is experimental: a jaxlib that does not know it gets None
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


def prefill_rows(num_prompts: int, num_samples: int, row_devices: int) -> int:
    """M, the prefill's rows for N prompts x G samples with rows over D = data * fsdp devices.

    M = lcm(N, D): each prompt is copied M / N times, so under the row sharding device d holds
    M / D prefill rows, exactly the prompts of its B / D rows, and repeating each prefill row
    B / M times on the device gives those rows (row b is prefill row b // (B / M), prompt b // G).
    D divides N: M = N, every prompt prefilled once. N divides D (4 prompts x G=8 on 8 devices):
    M = D, one prompt per device (two devices share each prompt's 8 rows). The alternative,
    every device prefilling all N prompts and keeping its rows, costs N prompts per device
    instead of N / gcd(N, D).
    """
    rows = num_prompts * num_samples
    if rows % row_devices:
        raise ValueError(f"Sampler: {num_prompts} prompts x {num_samples} samples = {rows} rows do not split "
                         f"over data*fsdp = {row_devices} devices; pass a number of prompts whose rows "
                         f"(prompts x num_samples) are a multiple of {row_devices}")
    return math.lcm(num_prompts, row_devices)


def slots_per_device(num_rows: int, row_devices: int, decode_slots: int, backend: str | None = None) -> int:
    """The continuous engine's decode slots on each device for `num_rows` rows over `row_devices`:
    `decode_slots` split over the devices, or (0: auto) on a CPU 8, on an accelerator a quarter of
    the device's rows and at least 8. Why: a CPU's decode step costs about linearly in its rows (W3
    on 2 cores: 8 slots per thread 5.9 s, 16 slots 7.4-8.4 s, 32 slots 15.2 s; benchmarks/NOTES.md),
    so the fewest slots that keep the loop's fixed costs small win; an accelerator's step is bound by
    reading the weights and costs about the same for 8 rows as for 64, so more slots finish sooner."""
    rows = num_rows // row_devices
    if decode_slots:
        return max(1, min(rows, decode_slots // row_devices))
    if (backend or jax.default_backend()) == "cpu":
        return min(rows, 8)
    return min(rows, max(8, rows // 4))


def _check_prompts(prompts, num_samples, vocab_size: int) -> None:
    if not prompts:
        raise ValueError("Sampler: prompts is empty; pass at least one list of token ids")
    if not isinstance(num_samples, int) or num_samples <= 0:
        raise ValueError(f"Sampler: num_samples must be a positive int, got {num_samples!r}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"Sampler: prompts[{i}] is empty; every prompt needs >= 1 token")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"Sampler: prompts[{i}] has token ids outside [0, vocab_size={vocab_size}): "
                             f"min {min(p)}, max {max(p)}")


class Sampler:
    """Samples G completions per prompt. Holds only static fields and its compiled functions."""

    def __init__(self, graphdef, config: ModelConfig, *, eos_id: int | Sequence[int], pad_id: int,
                 prompt_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048),
                 mesh=None, threads: int = 1, engine: str = "static",
                 decode_slots: int = 0, refill_every: int = 8):
        # Every stop id (`tokenizer.eos_ids`); a row's completion ends at the first of any of them.
        eos_ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
        if not eos_ids:
            raise ValueError("Sampler eos_id: give at least one stop id")
        for name, value in [*((f"eos_id {e}", e) for e in eos_ids), ("pad_id", pad_id)]:
            if not 0 <= value < config.vocab_size:
                raise ValueError(f"Sampler {name} must be in [0, vocab_size={config.vocab_size}), got {value}")
        if not prompt_buckets or any(b <= 0 for b in prompt_buckets):
            raise ValueError(f"Sampler prompt_buckets must be positive lengths, got {prompt_buckets!r}")
        self.graphdef = graphdef
        self.config = config
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.eos_id = self.eos_ids[0]
        self.pad_id = pad_id
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        # With a mesh, rows go over ("data", "fsdp") and the SampleOutput arrays are global arrays
        # sharded that way. One process passes all the prompts; several each pass their host slice
        # (`sharding.host_slice`) and read their rows back with `sharding.process_rows`. Without a
        # mesh, jit lays things out from the params' shardings (one device: plain arrays).
        self.mesh = mesh
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"Sampler threads must be an int >= 1, got {threads!r}")
        # One device (no mesh or a 1-device mesh): the prompts are split into this many equal parts,
        # each prefilled and decoded by its own host thread. XLA's CPU backend runs a decode loop
        # (small matmuls) on one core, and executions dispatched from different threads run side by
        # side; the samples are the same for any split (`row_keys`). Several devices already decode
        # their rows side by side, so there it is not used.
        self.threads = threads
        # "static": every row of a call decodes until the longest stops (cheapest for short or
        # equal lengths). "continuous" (`grpo_jax.sampling.continuous`): `decode_slots` slots over all devices
        # (0: auto), a stopped row's slot refilled with the next waiting row every `refill_every` steps.
        if engine not in ("static", "continuous"):
            raise ValueError(f"Sampler engine must be 'static' or 'continuous', got {engine!r}")
        if not isinstance(decode_slots, int) or decode_slots < 0:
            raise ValueError(f"Sampler decode_slots must be an int >= 0 (0: auto), got {decode_slots!r}")
        if not isinstance(refill_every, int) or refill_every < 1:
            raise ValueError(f"Sampler refill_every must be an int >= 1, got {refill_every!r}")
        self.engine, self.decode_slots, self.refill_every = engine, decode_slots, refill_every
        self._compiled: dict[tuple, tuple] = {}
        self._param_shardings = None  # the decode layout, from the first params seen
        self.num_traces = 0  # times a prefill/decode pair was traced (= compiled); tests read it

    def _row_devices(self) -> int:
        return 1 if self.mesh is None else sharding.batch_size_multiple(self.mesh)

    def _state_shardings(self) -> DecodeState:
        """Rows over ("data", "fsdp"); the caches' kv heads over "tensor" as in k_proj / v_proj."""
        mesh = self.mesh
        rows, whole = sharding.batch_sharding(mesh), sharding.replicated(mesh)
        heads = NamedSharding(mesh, sharding.fit_spec(P(sharding.BATCH_AXES, "tensor"),
                                                      (self._row_devices(), self.config.num_kv_heads), mesh))
        return DecodeState(caches=[KVCache(heads, heads) for _ in range(self.config.num_layers)],
                           key_mask_BxS=rows, logits_BxV=rows, positions_B=rows, step=whole,
                           tokens_BxC=rows, logprobs_BxC=rows, done_B=rows)

    def slots_per_device(self, num_rows: int) -> int:
        """Decode slots on each device for a call (or part) of `num_rows` rows (continuous engine)."""
        return slots_per_device(num_rows, self._row_devices(), self.decode_slots)

    def _functions(self, prompt_len: int, prefill_rows: int, num_rows: int, sampling: SamplingConfig,
                   rng_impl: str | None, forced: bool = False):
        if self.engine == "continuous":
            return self._continuous_functions(prompt_len, prefill_rows, num_rows, sampling, rng_impl, forced)
        key = ("static", prompt_len, prefill_rows, num_rows, sampling, rng_impl, forced)
        if key not in self._compiled:
            copies = num_rows // prefill_rows

            def prefill_fn(params, tokens_MxP, mask_MxP):
                self.num_traces += 1
                state = prefill(self.graphdef, params, tokens_MxP, mask_MxP, num_samples=copies,
                                max_new_tokens=sampling.max_new_tokens)
                return state, jnp.repeat(tokens_MxP, copies, axis=0)

            def decode_fn(params, state, rng, first_row, *forced_length_B):
                if rng_impl is not None:  # a typed key, passed as its bits (host data, replicated)
                    rng = jax.random.wrap_key_data(rng, impl=rng_impl)
                st = decode(self.graphdef, params, state, rng, prompt_len=prompt_len, sampling=sampling,
                            eos_id=self.eos_ids, pad_id=self.pad_id,
                            first_row=first_row, forced_length_B=forced_length_B[0] if forced else None)
                mask_BxP = state.key_mask_BxS[:, :prompt_len]
                c = sampling.max_new_tokens
                # 1 up to and including the first EOS; all 1 when EOS is ignored.
                if sampling.ignore_eos:
                    mask_BxC = jnp.ones_like(st.tokens_BxC)
                else:
                    is_eos = is_stop(st.tokens_BxC, self.eos_ids).astype(jnp.int32)
                    eos_before = jnp.cumsum(is_eos, axis=1) - is_eos
                    mask_BxC = ((eos_before == 0) & (jnp.arange(c) < st.step)).astype(jnp.int32)
                truncated_B = ~jnp.any(is_stop(st.tokens_BxC, self.eos_ids) & (mask_BxC > 0), axis=1)
                # The final state goes back out so every donated buffer (the KV cache above all)
                # aliases an output: XLA then reuses the prefill's cache memory in place.
                return st, (mask_BxP, st.tokens_BxC, mask_BxC, truncated_B, st.logprobs_BxC * mask_BxC)

            # The prefill's cache is updated in place (donated, aliased by the output).
            self._compiled[key] = self._jit_pair(prefill_fn, decode_fn, self._state_shardings, (1,), forced)
        return self._compiled[key]

    def _jit_pair(self, prefill_fn, decode_fn, state_shardings, donate, forced: bool):
        """(prefill, decode) jitted: with a mesh, explicit layouts, so each device's programs take
        its own rows: params in the decode layout, rows over ("data", "fsdp") in and out, the key
        and row offset whole."""
        options = _decode_compiler_options()
        if self.mesh is None:
            return jax.jit(prefill_fn), jax.jit(decode_fn, donate_argnums=donate, compiler_options=options)
        params_sh, state_sh = self._param_shardings, state_shardings()
        rows, whole = sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh)
        return (sharding.MeshJit(jax.jit(prefill_fn, in_shardings=(params_sh, rows, rows),
                                         out_shardings=(state_sh, rows)), self.mesh),
                sharding.MeshJit(jax.jit(decode_fn, in_shardings=(params_sh, state_sh, whole, whole) + (rows,) * forced,
                                         out_shardings=(state_sh, (rows,) * 5), donate_argnums=donate,
                                         compiler_options=options), self.mesh))

    def _continuous_functions(self, prompt_len: int, prefill_rows: int, num_rows: int, sampling: SamplingConfig,
                              rng_impl: str | None, forced: bool):
        """The continuous engine's pair (`grpo_jax.sampling.continuous`): prefill -> (slots, prompt store),
        then one loop that decodes every row through the slots."""
        from grpo_jax.sampling import continuous

        slots = self.slots_per_device(num_rows)
        key = ("continuous", prompt_len, prefill_rows, num_rows, sampling, rng_impl, forced, slots, self.refill_every)
        if key not in self._compiled:
            d = self._row_devices()
            copies, rows_per_device = num_rows // prefill_rows, num_rows // d

            def prefill_fn(params, tokens_MxP, mask_MxP):
                self.num_traces += 1
                store = continuous.prefill_prompts(nnx.merge(self.graphdef, params), tokens_MxP, mask_MxP)
                slot_state = continuous.empty_slots(store, devices=d, slots_per_device=slots,
                                                    rows_per_device=rows_per_device,
                                                    max_new_tokens=sampling.max_new_tokens, pad_id=self.pad_id)
                return (slot_state, store), jnp.repeat(tokens_MxP, copies, axis=0)

            def decode_fn(params, state, rng, first_row, *forced_length_B):
                if rng_impl is not None:
                    rng = jax.random.wrap_key_data(rng, impl=rng_impl)
                slot_state, store = state
                st = continuous.generate(self.graphdef, params, slot_state, store, rng, first_row, devices=d,
                                         rows_per_device=rows_per_device, sampling=sampling, eos_ids=self.eos_ids,
                                         pad_id=self.pad_id, refill_every=self.refill_every,
                                         forced_length_Q=forced_length_B[0] if forced else None)
                tokens, mask, truncated, logprobs = continuous.outputs(st, eos_ids=self.eos_ids,
                                                                       ignore_eos=sampling.ignore_eos)
                return (st, store), (jnp.repeat(store.mask_MxP, copies, axis=0), tokens, mask, truncated, logprobs)

            def state_shardings():
                rows, whole = sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh)
                heads = self._state_shardings().caches[0].k_BxKxHxS
                caches = [KVCache(heads, heads) for _ in range(self.config.num_layers)]
                slot_state = continuous.SlotState(caches, *([rows] * 10), whole)
                store = continuous.PromptStore([heads] * len(caches), [heads] * len(caches), rows, rows, rows)
                return slot_state, store

            self._compiled[key] = self._jit_pair(prefill_fn, decode_fn, state_shardings, (1,), forced)
        return self._compiled[key]

    def _prepare(self, params, prompts, num_samples: int, sampling: SamplingConfig, rng, forced_lengths=None):
        """Checks a call and lays it out: (params, [(tokens, mask, first_row) per part], the compiled
        pair, the key's bits). A part is one prefill + decode; only a one-device thread split has several."""
        _check_prompts(prompts, num_samples, self.config.vocab_size)
        longest, num_prompts = max(len(p) for p in prompts), len(prompts)
        d = self._row_devices()
        if self.mesh is not None and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            # Every process must compile the same program: agree on the bucket and the row count.
            agreed = np.asarray(multihost_utils.process_allgather(np.array([longest, num_prompts], np.int32)))
            agreed = agreed.reshape(-1, 2)
            if len(set(agreed[:, 1].tolist())) != 1:
                raise ValueError(f"Sampler: processes passed different numbers of prompts {agreed[:, 1].tolist()}; "
                                 "each process must pass an equal share (its host slice)")
            longest, num_prompts = int(agreed[:, 0].max()), int(agreed[:, 1].sum())
            if num_prompts % d:  # host slices of whole prompts are then whole devices' rows
                raise ValueError(f"Sampler: {num_prompts} prompts over all processes must be a multiple of "
                                 f"data*fsdp = {d} on a multi-process mesh (each passes its host slice)")
        prompt_len = bucket_length(longest, self.prompt_buckets)
        m = prefill_rows(num_prompts, num_samples, d)
        tokens = np.full((len(prompts), prompt_len), self.pad_id, np.int32)
        mask = np.zeros((len(prompts), prompt_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, prompt_len - len(p):] = p
            mask[i, prompt_len - len(p):] = 1
        # Each prompt once per device that holds its rows (several processes: M = N, no copies).
        tokens, mask = np.repeat(tokens, m // num_prompts, axis=0), np.repeat(mask, m // num_prompts, axis=0)
        if self.mesh is not None:
            if self._param_shardings is None:
                self._param_shardings = sharding.decode_param_shardings(self.mesh, params)
            # Once per call, not once per token: weights whole along fsdp (a no-op if already so).
            params = sharding.decode_params(self.mesh, params, dtype=DTYPES[self.config.dtype])
        one_device = self.mesh is None or self.mesh.size == 1
        # Equal parts (one compiled program): the largest part count <= threads dividing the rows.
        parts = max(k for k in range(1, min(self.threads if one_device else 1, m) + 1) if m % k == 0)
        n = m // parts
        pieces = []
        rows_per_part = num_prompts * num_samples // parts
        if forced_lengths is not None:
            forced_lengths = np.asarray(forced_lengths, np.int32)
            if forced_lengths.shape != (len(prompts) * num_samples,) or forced_lengths.min() < 1:
                raise ValueError(f"Sampler forced_lengths: one length >= 1 per row ({len(prompts) * num_samples}), "
                                 f"got shape {forced_lengths.shape}")
            forced_parts = np.split(forced_lengths, parts)
        for i, part in enumerate(zip(np.split(tokens, parts), np.split(mask, parts))):
            if self.mesh is not None:  # global arrays, rows over ("data", "fsdp")
                part = sharding.global_batch(self.mesh, part, n)
            extra = ()
            if forced_lengths is not None:
                extra = (forced_parts[i] if self.mesh is None
                         else sharding.global_batch(self.mesh, forced_parts[i], rows_per_part),)
            pieces.append((*part, i * n * num_samples, *extra))
        typed = isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
        rng_impl = str(jax.random.key_impl(rng)) if typed else None
        rng_bits = np.asarray(jax.random.key_data(rng) if typed else rng)
        fns = self._functions(prompt_len, n, rows_per_part, sampling, rng_impl, forced=forced_lengths is not None)
        return params, pieces, fns, rng_bits

    def __call__(self, params, prompts: list[list[int]], *, num_samples: int, sampling: SamplingConfig,
                 rng: jax.Array, forced_lengths=None) -> SampleOutput:
        """forced_lengths (benchmarks, tests): one int per row; row r then stops after exactly that
        many tokens (its last one eos_id), the same rows for either engine."""
        params, parts, (prefill_fn, decode_fn), rng_bits = self._prepare(params, prompts, num_samples, sampling, rng,
                                                                         forced_lengths)

        def run_part(part) -> SampleOutput:
            tokens, mask, first_row, *forced = part
            state, prompt_tokens_BxP = prefill_fn(params, tokens, mask)
            mask_BxP, tokens_BxC, mask_BxC, truncated_B, logprobs_BxC = decode_fn(
                params, state, rng_bits, np.int32(first_row), *forced)[1]
            return SampleOutput(prompt_tokens_BxP=prompt_tokens_BxP, prompt_mask_BxP=mask_BxP, tokens_BxC=tokens_BxC,
                                mask_BxC=mask_BxC, truncated_B=truncated_B, logprobs_BxC=logprobs_BxC)

        if len(parts) == 1:
            return run_part(parts[0])
        with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
            # Each thread waits for its own result, so the parts run concurrently.
            results = list(pool.map(lambda part: jax.block_until_ready(run_part(part)), parts))
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *results)
        if self.mesh is not None:  # the single part's layout (a 1-device mesh: no data moves)
            out = jax.device_put(out, sharding.batch_sharding(self.mesh))
        return out

    def lower(self, params, prompts: list[list[int]], *, num_samples: int, sampling: SamplingConfig,
              rng: jax.Array) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
        """The prefill and decode programs that `__call__` with these arguments runs (its first
        part), lowered: `.compile()` gives their input shardings and per-device HLO (`as_text()`)."""
        params, parts, (prefill_fn, decode_fn), rng_bits = self._prepare(params, prompts, num_samples, sampling, rng)
        tokens, mask, first_row, *_ = parts[0]
        prefill_lowered = prefill_fn.lower(params, tokens, mask)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), prefill_lowered.out_info[0])
        return prefill_lowered, decode_fn.lower(params, state, rng_bits, np.int32(first_row))
