"""Length buckets: the update and the log-prob passes pay for real tokens, not for the budget.

Every row of a step is padded to the sampler's budget C (`sampling.max_new_tokens`). With
long-tailed completion lengths (W3: median 97 of C = 512, real tokens ~27% of [B, C]) most of
what the update's forward and backward and the reference / pi_old passes run is padding. Here the
rows of each minibatch are sorted by the length the loss reads (`needed_lengths`), cut into chunks
of R rows, and each chunk's completion axis is cut to the smallest rung of a fixed ladder that holds
its longest row. The compiled shapes are therefore fixed in advance:

    lengths L   ceil(C * f) for f in 1, 3/4, 1/2, 3/8, 1/4, 3/16, 1/8, 3/32, 1/16, 3/64, 1/32:
                at most 11 rungs (C = 512: 16 24 32 48 64 96 128 192 256 384 512)
    rows R      `chunk_rows`: the largest multiple of data * fsdp that divides the minibatch and is
                <= max(data * fsdp, min(CHUNK_ROWS = 8, rows per micro-batch))
    shapes      tokens [R, P + L] for L in the ladder: at most 11 update programs and 11 log-prob
                programs (per prompt bucket P), plus one AdamW program, whatever the lengths are.

Exact. A causal model's outputs at a position do not depend on later columns, so cutting trailing
columns changes no log-prob the loss reads; every chunk's loss is over the whole minibatch's
normaliser (`step.ChunkedUpdate`), so any partition of the rows sums to the full-batch gradient
under every aggregation ("constant" divides by rows x C, the budget, not by L).

Shared prompts. A chunk holds rows of different groups, so in bucketed passes every row runs its
own copy of the prompt (group_size 1, not `step.prompt_groups`'s G). `grpo.bucket_by_length="auto"`
weighs that: a pass is bucketed only when it executes fewer token slots (prompt + completion per
row, the prompt once per group where the unbucketed pass shares it, DISPATCH_SLOTS per program
call) than the unbucketed pass. W1 (every answer 64 tokens) stays unbucketed: splitting it would
remove no padding and run its 4 prompts 32 times.

Why R = 8 (benchmarks/NOTES.md, "Length buckets"): on this 2-core CPU a gradient costs about the
same per token slot at 8 rows as at 64, and a sorted chunk of 8 of W3's 128 rows spans a narrow
range of lengths. With 16 rows the longest chunk holds lengths ~270..512 padded to 512: over 20
seeds of W3's lengths the executed padding is 22-33% against 16-24% with 8 (27-38% with 8 rows on a
ladder of powers of two).

Compile cost: every rung a run meets compiles one update program and one log-prob program (and
small gathers and scatters) the first time, against one of each unbucketed. W3 on this 2-core CPU
(benchmarks/NOTES.md): 9 rungs, 49 programs in 36.6 s against 3 in 6.6 s unbucketed, ~3.3 s per
rung, repaid by the first step (the phase is 21.5 s shorter per step). Since the shapes come from
the fixed ladder, a run stops compiling once its lengths have visited their rungs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.core import losses
from grpo_jax.distributed import sharding
from grpo_jax.training import step as step_lib
from grpo_jax.config.batch_plan import BatchPlan

LADDER_FRACTIONS = (1, 3 / 4, 1 / 2, 3 / 8, 1 / 4, 3 / 16, 1 / 8, 3 / 32, 1 / 16, 3 / 64, 1 / 32)
CHUNK_ROWS = 8
# What one more program call costs, in token slots of W1's model on this CPU: a gradient call's
# fixed part (dispatch, the gather of its rows, the add into the gradient sum) measured ~10-20 ms
# against ~0.25-0.4 ms per slot. Only decides "auto" when the slot counts are close.
DISPATCH_SLOTS = 64


def length_ladder(max_len: int) -> tuple[int, ...]:
    """The completion lengths a bucketed chunk may have, ascending; the last is `max_len`."""
    return tuple(sorted({max(1, math.ceil(max_len * f)) for f in LADDER_FRACTIONS}))


def chunk_rows(num_rows: int, rows_per_micro: int, row_multiple: int) -> int:
    """R, the rows of every chunk of a `num_rows`-row minibatch: a multiple of `row_multiple`
    (data * fsdp, so each device takes R / row_multiple rows) that divides `num_rows` (every chunk
    full, so one R per run), at most CHUNK_ROWS unless the devices need more, and never more than
    the unbucketed micro-batch (`rows_per_micro`), whose memory the user sized."""
    if num_rows % row_multiple:
        raise ValueError(f"chunk_rows: {num_rows} rows do not split over {row_multiple} devices")
    cap = max(row_multiple, min(CHUNK_ROWS, rows_per_micro))
    return max(r for r in range(row_multiple, cap + 1, row_multiple) if num_rows % r == 0)


def needed_lengths(completion_mask_BxC: np.ndarray) -> np.ndarray:
    """[B] int: the completion columns the loss reads per row, last nonzero mask column + 1 (0 for
    a row with none, e.g. a truncated answer under `grpo.mask_truncated_completions`)."""
    real_BxC = np.asarray(completion_mask_BxC) != 0
    last_B = real_BxC.shape[1] - np.argmax(real_BxC[:, ::-1], axis=1)
    return np.where(real_BxC.any(axis=1), last_B, 0).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One bucketed micro-batch: `rows` (int32 [R], indices into the step's batch, shortest
    first) run with their completion axis cut to `length` (a ladder rung >= each row's length)."""

    rows: np.ndarray
    length: int


def plan(row_index: np.ndarray, lengths: np.ndarray, rows_per_chunk: int, ladder: tuple[int, ...]) -> list[Chunk]:
    """The rows `row_index` (of a batch whose rows need `lengths`, [B]) sorted by length (stable,
    so ties keep their order and every process plans the same) and cut into chunks of
    `rows_per_chunk`, shortest chunk first."""
    row_index = np.asarray(row_index)
    if len(row_index) % rows_per_chunk:
        raise ValueError(f"plan: {len(row_index)} rows do not cut into chunks of {rows_per_chunk}")
    order = row_index[np.argsort(lengths[row_index], kind="stable")]
    rungs = np.asarray(ladder)
    chunks = []
    for start in range(0, len(order), rows_per_chunk):
        rows = order[start : start + rows_per_chunk].astype(np.int32)
        longest = max(int(lengths[rows].max()), 1)
        chunks.append(Chunk(rows, int(rungs[np.searchsorted(rungs, longest)])))
    return chunks


def padding_fraction(chunks: list[Chunk], lengths: np.ndarray) -> float:
    """Padded completion slots over the completion slots the chunks execute (sum of R x L)."""
    executed = sum(len(c.rows) * c.length for c in chunks)
    real = sum(int(lengths[c.rows].sum()) for c in chunks)
    return 1.0 - real / executed


def bucketed_slots(chunks: list[Chunk], prompt_len: int) -> int:
    """Token slots the chunks execute (prompt copy + cut completion per row) plus their calls."""
    return sum(len(c.rows) * (prompt_len + c.length) + DISPATCH_SLOTS for c in chunks)


def unbucketed_slots(num_rows: int, *, prompt_len: int, max_len: int, group_size: int, calls: int) -> int:
    """Token slots of the same rows at full width in `calls` programs, each prompt run once per
    group of `group_size` rows (1: every row its own copy)."""
    return num_rows * max_len + (num_rows // group_size) * prompt_len + calls * DISPATCH_SLOTS


@dataclasses.dataclass(frozen=True)
class Bucketing:
    """A run's length bucketing: its mode ("auto" / "on", `grpo.bucket_by_length`), R, and the
    programs of the bucketed passes (group_size 1); `update_group` / `logprob_group` and
    `num_micro` describe the unbucketed passes "auto" compares with."""

    mode: str
    rows: int
    update: step_lib.ChunkedUpdate
    logprob_fn: Any  # step.make_logprob_fn(group_size=1)
    update_group: int
    logprob_group: int
    num_micro: int  # grpo.grad_accum_steps

    def update_chunks(self, lengths, row_index, *, prompt_len: int, max_len: int) -> list[Chunk] | None:
        """The chunks of one optimizer update's rows, or None where it runs unbucketed."""
        chunks = plan(row_index, lengths, self.rows, length_ladder(max_len))
        plain = unbucketed_slots(len(row_index), prompt_len=prompt_len, max_len=max_len,
                                 group_size=self.update_group, calls=self.num_micro)
        return chunks if self.mode == "on" or bucketed_slots(chunks, prompt_len) < plain else None

    def logprob_chunks(self, lengths, *, prompt_len: int, max_len: int) -> list[Chunk] | None:
        """The chunks of a log-prob pass over every row of the step, or None (unbucketed)."""
        chunks = plan(np.arange(len(lengths)), lengths, self.rows, length_ladder(max_len))
        plain = unbucketed_slots(len(lengths), prompt_len=prompt_len, max_len=max_len,
                                 group_size=self.logprob_group, calls=1)
        return chunks if self.mode == "on" or bucketed_slots(chunks, prompt_len) < plain else None


def make_bucketing(mode: str, graphdef, tx, grpo, temperature: float, *, mesh, params, opt_state,
                   update_group: int, logprob_group: int, model_params_fn=None, frozen=None,
                   compiler_options: dict | None = None, off_policy=None) -> Bucketing | None:
    """The run's `Bucketing` (None for mode "off"); R from the minibatch and the mesh. With a
    `frozen` tree, `params` are what trains, merged into it by `model_params_fn` (the policy's
    adapters over their base: `grpo_jax.training.policy`); the log-prob pass runs on full params.
    `off_policy`: the sampler correction's settings (config.off_policy; None: the defaults)."""
    if mode == "off":
        return None
    multiple = sharding.batch_size_multiple(mesh)
    plan = BatchPlan.of(grpo, multiple)
    return Bucketing(
        mode=mode,
        rows=chunk_rows(plan.rows_per_minibatch, plan.rows_per_micro_batch, multiple),
        update=step_lib.make_chunked_update(graphdef, tx, grpo, temperature, mesh=mesh, params=params,
                                            opt_state=opt_state, model_params_fn=model_params_fn, frozen=frozen,
                                            compiler_options=compiler_options,
                                            **({} if off_policy is None else {"off_policy": off_policy})),
        logprob_fn=step_lib.make_logprob_fn(graphdef, temperature, mesh=mesh,
                                            params=params if frozen is None else frozen),
        update_group=update_group,
        logprob_group=logprob_group,
        num_micro=grpo.grad_accum_steps,
    )


# ----------------------------------------------------------------------------------------------
# Running the chunks (device work; host ints in, every process the same).


@functools.cache
def _take_fn(mesh, drop: int):
    """Jitted: rows `row_index` of every [B, ...] array of a tree, the last `drop` columns (axis 1)
    of each one of 2 or more axes cut (tokens [B, P + C] -> [R, P + L], completion arrays [B, C]
    -> [R, L], routing replay's experts [B, P + C, L_sparse, K] -> [R, P + L, L_sparse, K])."""

    def take(tree, row_index):
        return jax.tree.map(lambda x: x[row_index] if x.ndim == 1 else x[row_index, : x.shape[1] - drop], tree)

    return jax.jit(take, out_shardings=sharding.batch_sharding(mesh))


def take(tree, chunk: Chunk, max_len: int, mesh):
    """The chunk's rows of `tree` (global arrays [B, ...]) cut to its length, rows over the mesh."""
    return _take_fn(mesh, max_len - chunk.length)(tree, chunk.rows)


@functools.cache
def _normalizer_fn(mesh, aggregation: str):
    def normalizer(completion_mask_BxC, row_index):
        mask = completion_mask_BxC[row_index]
        return losses.loss_normalizer(mask, aggregation, max_len=mask.shape[1])

    return jax.jit(normalizer, out_shardings=sharding.replicated(mesh))


@functools.cache
def _router_tokens_fn(mesh):
    return jax.jit(lambda attention_BxS, row_index: step_lib.router_token_count(attention_BxS[row_index]),
                   out_shardings=sharding.replicated(mesh))


@functools.cache
def _zeros_fn(mesh, shape: tuple[int, int]):
    return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding.batch_sharding(mesh))


@functools.cache
def _scatter_fn(mesh):
    def put(out_BxC, row_index_R, x_RxL):
        return out_BxC.at[row_index_R, : x_RxL.shape[1]].set(x_RxL)

    return jax.jit(put, donate_argnums=0, out_shardings=sharding.batch_sharding(mesh))


def logprobs(logprob_fn, params, tokens_BxS, attention_BxS, chunks: list[Chunk], *, num_targets: int, mesh,
             experts=None):
    """logp_BxC float32 of `logprob_fn` (a `step.make_logprob_fn`) run chunk by chunk, in the
    batch's row order: each row's first `length` columns of its chunk, 0 beyond them (columns the
    loss does not read: `needed_lengths`). `experts` [B, S, L_sparse, K] (routing replay): cut
    with the tokens (their slots are axis 1 too) and replayed."""
    out = _zeros_fn(mesh, (tokens_BxS.shape[0], num_targets))()
    for chunk in chunks:
        tokens, attention, chunk_experts = take((tokens_BxS, attention_BxS, experts), chunk, num_targets, mesh)
        replay = {} if chunk_experts is None else {"experts": chunk_experts}
        out = _scatter_fn(mesh)(out, chunk.rows, logprob_fn(params, tokens, attention, num_targets=chunk.length,
                                                            **replay))
    return out


def update(fns: step_lib.ChunkedUpdate, params, opt_state, full: step_lib.UpdateBatch, chunks: list[Chunk], *,
           aggregation: str, mesh, frozen=None):
    """One optimizer update over the rows of `chunks` (`full`: the step's UpdateBatch of global
    arrays [B, ...], no [A] axis): (params, opt_state, metrics) as `step.make_update_fn` gives
    for the same rows. The normaliser is the update's whole set of rows'. `frozen`: the policy's
    frozen base, if it has one (`Policy.update_extra_args`)."""
    num_targets = full.completion_mask.shape[1]
    rows = np.concatenate([c.rows for c in chunks])
    normalizer = _normalizer_fn(mesh, aggregation)(full.completion_mask, rows)
    router_tokens = _router_tokens_fn(mesh)(full.attention, rows)
    grads = fns.zeros(params)
    metrics, tokens = [], []
    for chunk in chunks:
        extra = () if frozen is None else (frozen,)
        grads, m, t = fns.accumulate(params, grads, take(full, chunk, num_targets, mesh), normalizer, router_tokens,
                                     *extra)
        metrics.append(m)
        tokens.append(t)
    return fns.apply(params, opt_state, grads, metrics, tokens)
