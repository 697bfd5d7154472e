"""The built-in sampling engine's host side: `Sampler` checks a call, pads the prompts to a bucket,
lays rows over the mesh, splits them over host threads and runs one of two device engines' jitted
(prefill, decode) pair, compiled once per (P, N, G, SamplingConfig) and cached:

  "static" (`grpo_jax.sampling.static`): all rows decode until the longest stops.
  "continuous" (`grpo_jax.sampling.continuous`): a fixed number of decode slots; a stopped row's
      slot takes the next waiting row.

Flow for N prompts x G samples (B = N * G rows; row r is prompt r // G, sample r % G): left-pad the
prompts to the smallest bucket P >= longest prompt (host), prefill each prompt once per device that
holds its rows, decode, return a `SampleOutput`.

On a mesh (one process or many, the same path), rows are split over the batch axes ("data", "fsdp", "expert") from prefill
to the outputs: each device prefills M / (data * fsdp) rows, M = lcm(N, data * fsdp) (each prompt
copied M / N times, so a device's prompts are exactly those of its rows), repeats them locally to
its B / (data * fsdp) rows and decodes only those. The weights are moved once per call into the
decode layout (`sharding.decode_param_shardings`: whole along fsdp, split over tensor), so the
loop body has no weight collectives. Every row's noise is keyed by its global row index
(`ops.row_keys`), so the samples do not depend on the mesh or the thread split.

Log-probs are those of the full-vocabulary softmax(logits / temperature), before top-k / top-p,
so they equal `model.token_logprobs(..., temperature=T)` recomputed by the trainer (pi_old).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.distributed import sharding
from grpo_jax.model import ModelConfig
from grpo_jax.model.config import DTYPES
from grpo_jax.sampling import continuous, static
from grpo_jax.sampling.engine import SampleOutput, SamplingConfig


@functools.cache
def _decode_compiler_options() -> dict | None:
    """XLA options for the decode loop. On a CPU: no YNNPACK fusions. Decode multiplies a few rows
    by each weight matrix, and the YNNPACK kernels (fast for the update's large matmuls) spend
    more on each call's setup than on the arithmetic there (W1's rollout: benchmarks/NOTES.md).
    The option is experimental: a jaxlib that does not know it gets None (checked once on a tiny
    program) instead of a decode that fails to compile."""
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
    """Samples G completions per prompt: the built-in `engine.SamplingEngine`. Holds only static
    fields and its compiled (prefill, decode) pairs."""

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
        # With a mesh, rows go over the batch axes ("data", "fsdp", "expert") and the SampleOutput arrays are global arrays
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

    def slots_per_device(self, num_rows: int) -> int:
        """Decode slots on each device for a call (or part) of `num_rows` rows (continuous engine)."""
        return slots_per_device(num_rows, self._row_devices(), self.decode_slots)

    def _count_trace(self) -> None:
        self.num_traces += 1

    def _functions(self, prompt_len: int, prefill_rows: int, num_rows: int, sampling: SamplingConfig,
                   rng_impl: str | None, forced: bool = False):
        """The engine's jitted (prefill, decode) pair for this call shape, compiled on first use.
        The static pair's state is a `static.DecodeState`, the continuous one's (slots, prompt store)."""
        copies, layers, kv_heads = num_rows // prefill_rows, self.config.num_layers, self.config.num_kv_heads
        if self.engine == "continuous":
            if sampling.record_experts:
                raise ValueError("SamplingConfig.record_experts needs Sampler engine='static'; the continuous "
                                 "engine does not record experts")
            slots = self.slots_per_device(num_rows)
            key = ("continuous", prompt_len, prefill_rows, num_rows, sampling, rng_impl, forced, slots,
                   self.refill_every)
            if key not in self._compiled:
                d = self._row_devices()
                pair = continuous.programs(
                    self.graphdef, copies=copies, devices=d, rows_per_device=num_rows // d, slots_per_device=slots,
                    sampling=sampling, eos_ids=self.eos_ids, pad_id=self.pad_id, refill_every=self.refill_every,
                    rng_impl=rng_impl, forced=forced, on_trace=self._count_trace)
                self._compiled[key] = self._jit_pair(
                    *pair, lambda: continuous.state_shardings(self.mesh, layers, kv_heads), (1,), forced)
            return self._compiled[key]
        key = ("static", prompt_len, prefill_rows, num_rows, sampling, rng_impl, forced)
        if key not in self._compiled:
            pair = static.programs(self.graphdef, prompt_len=prompt_len, copies=copies, sampling=sampling,
                                   eos_ids=self.eos_ids, pad_id=self.pad_id, rng_impl=rng_impl, forced=forced,
                                   on_trace=self._count_trace)
            # The prefill's cache is updated in place (donated, aliased by the output).
            self._compiled[key] = self._jit_pair(
                *pair, lambda: static.state_shardings(self.mesh, layers, kv_heads, sampling.record_experts), (1,),
                forced)
        return self._compiled[key]

    def _jit_pair(self, prefill_fn, decode_fn, state_shardings, donate, forced: bool):
        """(prefill, decode) jitted: with a mesh, explicit layouts, so each device's programs take
        its own rows: params in the decode layout, rows over the batch axes ("data", "fsdp", "expert") in and out, the key
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
            if self.mesh is not None:  # global arrays, rows over the batch axes ("data", "fsdp", "expert")
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
            final, (mask_BxP, tokens_BxC, mask_BxC, truncated_B, logprobs_BxC) = decode_fn(
                params, state, rng_bits, np.int32(first_row), *forced)
            experts = final.experts_BxLxSxK if sampling.record_experts else None
            return SampleOutput(prompt_tokens_BxP=prompt_tokens_BxP, prompt_mask_BxP=mask_BxP, tokens_BxC=tokens_BxC,
                                mask_BxC=mask_BxC, truncated_B=truncated_B, logprobs_BxC=logprobs_BxC,
                                experts_BxLxSxK=experts)

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

    def lower_abstract(self, params, *, prompt_len: int, num_prompts: int, num_samples: int,
                       sampling: SamplingConfig) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
        """The prefill and decode programs of a call of `num_prompts` x `num_samples` rows with
        prompts bucketed to `prompt_len`, lowered from shapes alone (no device memory; `check`).
        params: `jax.ShapeDtypeStruct`s as `sharding.decode_params` makes them (with a mesh each
        carrying its `sharding.decode_param_shardings` entry as `.sharding`); on the first call they
        set the sampler's decode layout, as the first concrete params do in `__call__`. One part
        (no thread split) and a raw uint32 key, as one process's call on a mesh."""
        if prompt_len not in self.prompt_buckets:
            raise ValueError(f"Sampler.lower_abstract prompt_len={prompt_len} is not one of the prompt buckets "
                             f"{self.prompt_buckets}; use bucket_length(longest prompt, buckets)")
        m = prefill_rows(num_prompts, num_samples, self._row_devices())
        rows = whole = None
        if self.mesh is not None:
            shardings = jax.tree.map(lambda x: x.sharding, params)
            if any(s is None for s in jax.tree.leaves(shardings, is_leaf=lambda s: s is None)):
                raise ValueError("Sampler.lower_abstract: on a mesh every params leaf needs its decode-layout "
                                 ".sharding (sharding.decode_param_shardings)")
            if self._param_shardings is None:
                self._param_shardings = shardings
            rows, whole = sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh)
        prefill_fn, decode_fn = self._functions(prompt_len, m, num_prompts * num_samples, sampling, None)
        tokens_MxP = jax.ShapeDtypeStruct((m, prompt_len), jnp.int32, sharding=rows)
        prefill_lowered = prefill_fn.lower(params, tokens_MxP, tokens_MxP)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), prefill_lowered.out_info[0])
        rng_bits = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=whole)
        first_row = jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)
        return prefill_lowered, decode_fn.lower(params, state, rng_bits, first_row)
