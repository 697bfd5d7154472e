"""The phases of one GRPO step (seed, Step 5), each a function you can read and test alone:

    sample_and_score    G answers to each prompt from pi_old (the sampler), scored by the reward
                        functions; DAPO dynamic sampling tops the batch up with informative groups
    compute_advantages  group advantages, and which completion tokens train
    logprobs            reference (and optionally recomputed pi_old) log-probs of every row
    update              mu passes x minibatches of Optax updates over A micro-batches each
    sync_reference      every `grpo.ref_resync_every` steps the reference becomes the policy
    report              the step's metrics (TRL's names where TRL has one)

`grpo_jax.training.train` runs them in order around `RunState`; pi_old <- pi_theta is implicit (the next
rollout samples with the new params). Host arrays hold every row of the step (each process samples
its slice and the results are gathered, `Processes`), so every process computes the same
advantages, minibatches and metrics. The phases that dispatch device work return a
`timing.ReadyAt` handle of it, so the loop can time them without waiting.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.core import advantage_estimators as estimators
from grpo_jax.core import advantages as adv_lib
from grpo_jax.training import length_buckets
from grpo_jax.training.episode_rollout import episode_metrics, turn_steps
from grpo_jax.training import metric_rules
from grpo_jax.training import rollout as rollout_lib
from grpo_jax.training import sample_rounds
from grpo_jax.training.sample_rounds import select_groups
from grpo_jax.io import sample_view
from grpo_jax.training import step as step_lib
from grpo_jax.training.run_context import RunContext, RunState, replays_routing
from grpo_jax.training.timing import ReadyAt

@dataclasses.dataclass
class StepBatch:
    """Every row of one step's batch, host numpy, B = prompts_per_step * G rows in groups of G."""

    # prompt_tokens/prompt_mask [B, P], tokens/mask/tool_mask/logprobs [B, C]; with routing replay
    # experts [B, P + C, L_sparse, K].
    arrays: dict[str, np.ndarray]
    rewards: np.ndarray  # [B] float32 after the truncation rule; NaN where no reward function applied
    reward_parts: dict[str, np.ndarray]  # name -> [B], each function's own values
    lengths: np.ndarray  # [B] completion tokens, EOS included
    truncated: np.ndarray  # [B] bool: no EOS within max_new_tokens
    samples: list[dict]  # this process's rows of the batch, for the samples log
    sampled: dict[str, float]  # what was sampled before the dynamic-sampling filter
    rounds: int  # sampler calls (1 without dynamic sampling)
    device_start: float  # when the devices started this step's rollout
    reward_seconds: float
    finished_at: float  # when the batch was complete on the host
    data_position: int  # the data position after this batch's examples (where the next step starts)
    # [B] bool: a reward function scored it above 0, and the truncation rule ("at_most_zero") made it 0.
    zeroed_by_truncation: np.ndarray | None = None
    reward_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # TRL's log_metric, this process's
    episode_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # turns, tools (every process's)
    # Episodes: each row's turns as process-reward steps, "ends" / "rewards" [B, max_turns]
    # (`training.episode_rollout.turn_steps`); None for single answers.
    turn_steps: dict[str, np.ndarray] | None = None


def truncation_rule(rewards: np.ndarray, truncated: np.ndarray, rule: str) -> np.ndarray:
    """A truncated completion never reached its final answer (seed, Part 2, defence 3): under
    "at_most_zero" it earns nothing, min(reward, 0), so a correct box followed by runaway text no
    longer scores 1 while penalties (DAPO's overlong penalty) still apply. "as_scored" keeps the
    reward functions' values. NaN (no function applied) stays NaN."""
    if rule == "as_scored":
        return rewards
    return np.where(truncated & (rewards > 0), np.float32(0.0), rewards).astype(np.float32)


def dispatch_round(ctx: RunContext, params, step: int, data_position: int, round_index: int):
    """Starts one sampler call with `params` (the sampling policy's full params) on this process's
    slice of the `prompts_per_step` examples from `data_position`."""
    g = ctx.config.grpo
    examples = [ctx.task.train_example(data_position + i) for i in range(g.prompts_per_step)]
    local = examples[ctx.processes.prompt_slice(g.prompts_per_step)]
    rng = jax.random.fold_in(ctx.step_key(step), round_index)
    factory = getattr(ctx.task, "environment_factory", None)
    if factory is not None:  # episodes: played to their end here, turn by turn
        return rollout_lib.play_rollout(ctx.sampler, params, ctx.tokenizer, local, environment_factory=factory,
                                        limits=rollout_lib.episode_limits(ctx.config), num_samples=g.num_generations,
                                        sampling=ctx.rollout_sampling, rng=rng, processes=ctx.processes)
    return rollout_lib.dispatch_rollout(ctx.sampler, params, ctx.tokenizer, local, num_samples=g.num_generations,
                                        sampling=ctx.rollout_sampling, rng=rng)


def wait_for_tokens(pending) -> float:
    """Blocks until the sampler call `pending` (`dispatch_round`'s) is done and its rows are on the
    host; returns time.perf_counter() then. Scoring it afterwards (`sample_and_score`) does not wait
    for the devices: the asynchronous rollouts sample one step while another step's rewards run
    (`async_rollouts.RolloutWorker`)."""
    for x in jax.tree.leaves(pending.sample):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            np.asarray(x)  # a jax.Array keeps its host copy: `score_rollout`'s read of it is then free
        elif isinstance(x, jax.Array):
            x.block_until_ready()  # rows of other processes: each reads its own shards when scoring
    return time.perf_counter()


def sample_and_score(ctx: RunContext, params, step: int, data_position: int, first, device_free_at: float,
                     should_stop=None) -> StepBatch:
    """Phases 1-3: scores `first` (the round already dispatched with `params`, the sampling policy's
    full params, on the examples from `data_position`) and, under dynamic sampling, samples
    further rounds with `params` until `prompts_per_step` informative groups are found or
    `max_resample_rounds` are spent. `device_free_at`: when the devices finished their previous
    work (the rollout's time starts then at the earliest).

    User reward functions get `rewards.timeout_s` per batch (0: none); `should_stop()`
    interrupts one that is still running (`rewards.RewardInterrupted`)."""
    g, processes = ctx.config.grpo, ctx.processes
    G, B = g.num_generations, g.prompts_per_step
    max_rounds = 1 + (g.max_resample_rounds if g.dynamic_sampling else 0)
    device_start = max(first.dispatched_at, device_free_at)
    data_position += B
    rounds, pending = [], first
    while True:
        # A reward function's error (or timeout) on one process stops every process here.
        ro = processes.agreed(lambda: rollout_lib.score_rollout(
            pending, ctx.tokenizer, ctx.task, step=step, pool=ctx.pool,
            timeout_s=ctx.config.rewards.timeout_s or None, should_stop=should_stop,
            max_steps=ctx.config.train.steps),
            f"scoring step {step}'s rewards")
        rewards = truncation_rule(ro.rewards, ro.truncated, ctx.config.rewards.truncated_reward)
        rounds.append((ro, {
            "rewards": processes.gather(rewards),
            "zeroed": processes.gather(ro.truncated & (ro.rewards > 0) & (rewards == 0)),
            "parts": {name: processes.gather(v) for name, v in ro.reward_parts.items()},
            "lengths": processes.gather(ro.lengths),
            "truncated": processes.gather(ro.truncated),
            "arrays": {name: processes.gather(ro.arrays[name]) for name in sample_rounds.row_names(ro.arrays)},
            **_gathered_episodes(processes, ro.episodes, ctx.config.task.max_turns),
        }))
        all_rewards = np.concatenate([r["rewards"] for _, r in rounds])
        chosen, informative = select_groups(all_rewards, G, B, g.dynamic_sampling)
        if not g.dynamic_sampling or informative >= B or len(rounds) == max_rounds:
            break
        pending = dispatch_round(ctx, params, step, data_position, len(rounds))
        data_position += B
    return _chosen_batch(ctx, step, rounds, chosen, all_rewards, device_start, data_position)


def _gathered_episodes(processes, episodes, max_turns: int) -> dict:
    """A round's episode rows (every process's) and the environments' wall seconds (the slowest
    process's); nothing for single answers."""
    if episodes is None:
        return {}
    seconds = processes.gather(np.array([episodes.environment_seconds], np.float64)).max()
    rows = {**episodes.row_values(), **{f"turn_{k}": v for k, v in turn_steps(episodes, max_turns).items()}}
    return {"episode_rows": {k: processes.gather(v) for k, v in rows.items()}, "environment_seconds": float(seconds)}


def _chosen_batch(ctx: RunContext, step: int, rounds: list, chosen: list[int], all_rewards: np.ndarray,
                  device_start: float, data_position: int) -> StepBatch:
    """The step's batch from the `chosen` groups of `rounds` ((rollout, gathered arrays) per sampler
    call, in order); prompts of rounds of different widths left-padded to the widest."""
    G = ctx.config.grpo.num_generations
    row_index = np.concatenate([np.arange(c * G, (c + 1) * G) for c in chosen])
    arrays = sample_rounds.join_rows([r["arrays"] for _, r in rounds], row_index, ctx.tokenizer.pad_id)

    def pick(field):
        return np.concatenate([r[field] for _, r in rounds])[row_index]

    rewards = pick("rewards")
    parts = {name: np.concatenate([r["parts"][name] for _, r in rounds])[row_index] for name in rounds[0][1]["parts"]}
    return StepBatch(
        arrays=arrays,
        rewards=rewards,
        reward_parts=parts,
        lengths=pick("lengths"),
        truncated=pick("truncated"),
        samples=_sample_log(ctx, step, [ro for ro, _ in rounds], row_index, rewards, parts),
        sampled={
            "reward": _nan_mean(all_rewards),
            "frac_reward_zero_std": float(adv_lib.zero_std_fraction(jnp.asarray(all_rewards), G)),
        },
        rounds=len(rounds),
        device_start=device_start,
        reward_seconds=sum(ro.reward_seconds for ro, _ in rounds),
        finished_at=time.perf_counter(),
        data_position=data_position,
        zeroed_by_truncation=pick("zeroed"),
        reward_metrics=_mean_dicts([ro.reward_metrics for ro, _ in rounds]),
        **_chosen_episodes(rounds, row_index),
    )


def _chosen_episodes(rounds: list, row_index: np.ndarray) -> dict:
    """The chosen rows' episode metrics (`training.episode_rollout.episode_metrics`) and turns as steps
    (`training.episode_rollout.turn_steps`), as StepBatch fields; none for single answers."""
    if "episode_rows" not in rounds[0][1]:
        return {}
    rows = {k: np.concatenate([r["episode_rows"][k] for _, r in rounds])[row_index]
            for k in rounds[0][1]["episode_rows"]}
    return {"episode_metrics": episode_metrics(rows, sum(r["environment_seconds"] for _, r in rounds)),
            "turn_steps": {"ends": rows["turn_ends"], "rewards": rows["turn_rewards"]}}


def _sample_log(ctx: RunContext, step: int, rollouts: list, row_index: np.ndarray, rewards: np.ndarray,
                parts: dict[str, np.ndarray]) -> list[dict]:
    """The samples log: this process's rows among the chosen ones (`row_index` into the rows of
    every round), in batch order; `rewards` and `parts` are the chosen rows'."""
    g = ctx.config.grpo
    G, B = g.num_generations, g.prompts_per_step
    local = ctx.processes.prompt_slice(B)
    local_rows = {}
    for round_i, ro in enumerate(rollouts):
        first_row = round_i * B * G + local.start * G
        for j in range(len(ro.completions)):
            local_rows[first_row + j] = (ro, j)
    samples = []
    every = ctx.config.train.samples_every
    logged = bool(every) and (step % every == 0 or step == 1)  # the steps train.py writes samples for
    for i, row in enumerate(row_index):
        if row in local_rows:
            ro, j = local_rows[row]
            if logged:  # what the model saw and said, labelled (decoding costs: only when written)
                shown = sample_view.sample_record(
                    ctx.tokenizer, ctx.task, prompt_ids=ro.arrays["prompt_tokens"][j][ro.arrays["prompt_mask"][j] > 0],
                    completion_ids=ro.arrays["tokens"][j][: ro.lengths[j]], completion=ro.completions[j],
                    truncated=bool(ro.truncated[j]), example=ro.examples[j])
            else:
                shown = {"prompt": rollout_lib.prompt_text(ro.prompts[j]), "completion": ro.completions[j],
                         "reference": ro.examples[j].get("answer")}
            samples.append({
                **shown,
                **{f"extra/{c}": v[j] for c, v in ro.reward_extra.items()},  # TRL's log_extra columns
                "reward": float(rewards[i]),
                **{f"rewards/{n}": float(v[i]) for n, v in parts.items()},
            })
    return samples


def trained_tokens(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """[B, C] int32, 1 on the tokens the loss may train: real completion tokens (`mask`) the model
    wrote itself (`tool_mask`; a batch made without one, as research code may, is all the model's)."""
    mask = arrays["mask"]
    return (mask * arrays.get("tool_mask", mask)).astype(np.int32)


def compute_advantages(ctx: RunContext, batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
    """Phase 4 (the rewards were scored in `sample_and_score`): (advantages [B] float32, completion mask [B, C] int32 of the tokens that train).

    Truncated completions are masked out of the loss with `grpo.mask_truncated_completions`; their
    rewards still count in their groups' baselines. `grpo.adv_estimator` picks the estimator
    (`advantage_estimators.estimator_advantages`); its lengths are the loss's real tokens per row."""
    g = ctx.config.grpo
    # The model's own tokens train; an environment's tokens (episodes) are context only.
    completion_mask = trained_tokens(batch.arrays)
    if g.mask_truncated_completions:
        completion_mask = completion_mask * (~batch.truncated)[:, None]
    per_func, weights = None, None
    if g.adv_estimator == "gdpo":
        # Each function's own values, under the same truncation rule as the total, in reward_fns order.
        specs = ctx.task.reward_fns()
        per_func = np.stack([truncation_rule(batch.reward_parts[r.name], batch.truncated, ctx.config.rewards.truncated_reward)
                             for r in specs], axis=1)
        weights = np.array([r.weight for r in specs], np.float32)
    if ctx.config.task.turn_rewards == "process" and batch.turn_steps is not None:
        return turn_advantages(batch, g.num_generations, g.advantage_eps), completion_mask
    advantages = np.asarray(
        estimators.estimator_advantages(
            g.adv_estimator, jnp.asarray(batch.rewards), g.num_generations,
            lengths=jnp.asarray(completion_mask.sum(axis=1)), rewards_per_func=per_func, weights=weights,
            scale=g.scale_rewards, eps=g.advantage_eps,
        ),
        np.float32,
    )
    return advantages, completion_mask


def turn_advantages(batch: StepBatch, group_size: int, eps: float) -> np.ndarray:
    """Per-token advantages [B, C] of episodes whose turns carry rewards (`task.turn_rewards =
    "process"`): each turn is a step whose reward is its Reply's, and the last turn's step also
    holds the reward functions' score of the episode (`batch.rewards`); the seed's process
    supervision normalises every step reward over the group and gives each token the sum of the
    normalised rewards of its turn and the turns after it (`core.advantages.process_advantages`).
    Environment tokens get values too; the completion mask keeps them out of the loss."""
    ends, rewards = batch.turn_steps["ends"], batch.turn_steps["rewards"].copy()
    real = ends > 0
    last = real.sum(axis=1) - 1  # every episode has at least one turn
    outcome = np.nan_to_num(batch.rewards, nan=0.0)
    rows = np.arange(len(rewards))
    rewards[rows, last] = np.nan_to_num(rewards[rows, last], nan=0.0) + outcome
    return np.asarray(adv_lib.process_advantages(jnp.asarray(rewards), jnp.asarray(ends), jnp.asarray(real),
                                                 group_size, batch.arrays["tokens"].shape[1], eps=eps), np.float32)


def device_rows(ctx: RunContext, batch: StepBatch, advantages: np.ndarray, completion_mask: np.ndarray) -> dict:
    """The batch as global arrays with rows over the batch axes ("data", "fsdp", "expert"): each device receives its rows;
    and "completion_lengths", host ints [B] (the columns the loss reads per row), which length
    bucketing plans from without a device round trip (every process holds every row). With
    routing replay also "experts" [B, P + C, L_sparse, K], the experts the sampler routed each
    token to, which every log-prob pass and the update replay."""
    a = batch.arrays
    if replays_routing(ctx.config) and sample_rounds.EXPERTS not in a:
        raise ValueError(
            "off_policy.router_replay='R3' but the rollout carries no experts: the sampling engine did not record "
            "them (a task played as episodes, or an engine other than the static one)")
    rows = ctx.processes.to_global({
        "tokens": np.concatenate([a["prompt_tokens"], a["tokens"]], axis=1).astype(np.int32),
        "attention": np.concatenate([a["prompt_mask"], a["mask"]], axis=1).astype(np.int32),
        "completion_mask": completion_mask.astype(np.int32),
        "advantages": advantages.astype(np.float32),
        "sampler_logp": a["logprobs"].astype(np.float32),
        **({sample_rounds.EXPERTS: a[sample_rounds.EXPERTS]} if replays_routing(ctx.config) else {}),
    })
    rows["completion_lengths"] = length_buckets.needed_lengths(completion_mask)
    return rows


def logprobs(ctx: RunContext, state: RunState, rows: dict):
    """Phase 5: (ref_logp or None, old_logp, when the passes were ready: None if none ran), [B, C]
    global arrays; dispatched, not waited for. With a distillation teacher (`ctx.teacher`), its pass's arrays are added to `rows`.

    pi_old (`Config.resolved_old_logprobs`): the sampler's log-probs, a pass of the policy
    over the batch ("recompute"), or None ("in_loss": the loss reads its own). With routing
    replay (`rows["experts"]`) both passes use the sampler's experts. Length-bucketed
    (`ctx.bucketing`), the passes run over length-sorted chunks of rows and their results are put
    back in row order, 0 in the columns the loss does not read."""
    num_targets = rows["completion_mask"].shape[1]
    chunks = None
    if ctx.bucketing is not None:
        chunks = ctx.bucketing.logprob_chunks(rows["completion_lengths"], max_len=num_targets,
                                              prompt_len=rows["tokens"].shape[1] - num_targets)

    experts = rows.get(sample_rounds.EXPERTS)  # routing replay: the sampler's experts, in every pass

    def pass_over_rows(params):
        if chunks is None:
            return ctx.logprob_fn(params, rows["tokens"], rows["attention"], num_targets=num_targets,
                                  **({} if experts is None else {"experts": experts}))
        return length_buckets.logprobs(ctx.bucketing.logprob_fn, params, rows["tokens"], rows["attention"],
                                       chunks, num_targets=num_targets, mesh=ctx.mesh, experts=experts)

    ref_logp = pass_over_rows(ctx.reference_params(state)) if ctx.uses_reference else None
    teacher = {}
    # getattr: research code (and tests) drive these phases with a context of their own making.
    if getattr(ctx, "teacher", None) is not None:  # on-policy distillation: the teacher's view of the rows
        teacher = ctx.teacher.targets(rows["tokens"], rows["attention"], num_targets=num_targets)
        rows.update(teacher)  # read by `update` (UpdateBatch's teacher fields)
    source = ctx.config.resolved_old_logprobs()
    old_logp = {"sampler": rows["sampler_logp"], "in_loss": None}.get(source)
    if source == "recompute":
        old_logp = pass_over_rows(ctx.policy_params(state))
    computed = [x for x in (ref_logp, old_logp if source == "recompute" else None) if x is not None]
    computed += list(teacher.values())
    return ref_logp, old_logp, (ReadyAt(computed) if computed else None)


def update(ctx: RunContext, state: RunState, rows: dict, ref_logp, old_logp, step: int):
    """Phase 6: `num_iterations` passes over the batch, each `num_minibatches` optimizer updates of
    `grad_accum_steps` micro-batches (length-bucketed: `ctx.bucketing`'s chunks of the minibatch
    instead). Returns the new state, the updates' metrics (device arrays, not read: the caller
    reads them one step later) and when those were ready."""
    g = ctx.config.grpo
    full = step_lib.UpdateBatch(
        tokens=rows["tokens"],
        attention=rows["attention"],
        completion_mask=rows["completion_mask"],
        advantages=rows["advantages"],
        old_logp=old_logp,
        sampler_logp=rows["sampler_logp"],
        ref_logp=ref_logp,
        teacher_logp=rows.get("teacher_logp"),
        teacher_topk_logp=rows.get("teacher_topk_logp"),
        teacher_topk_ids=rows.get("teacher_topk_ids"),
        experts=rows.get(sample_rounds.EXPERTS),
    )
    n_rows, num_targets = rows["completion_mask"].shape
    prompt_len = rows["tokens"].shape[1] - num_targets
    per_minibatch = n_rows // g.num_minibatches
    params, opt_state = state.params, state.opt_state
    frozen = ctx.policy.update_extra_args(state)  # the frozen base adapters merge into, if any
    metrics = []
    for iteration in range(g.num_iterations):
        # Minibatches draw rows in a random order (as TRL); host numpy, so every process agrees
        # without a device round trip and a resumed run draws the same order.
        order = (
            np.arange(n_rows)
            if g.num_minibatches == 1
            else np.random.default_rng([ctx.config.train.seed, step, iteration]).permutation(n_rows)
        )
        for mb in range(g.num_minibatches):
            rows_mb = order[mb * per_minibatch : (mb + 1) * per_minibatch]
            chunks = None
            if ctx.bucketing is not None:
                chunks = ctx.bucketing.update_chunks(rows["completion_lengths"], rows_mb, max_len=num_targets,
                                                     prompt_len=prompt_len)
            if chunks is None:
                batch = step_lib.minibatch(full, rows_mb, g.grad_accum_steps, ctx.mesh)
                params, opt_state, m = ctx.update_fn(params, opt_state, batch, *frozen)
            else:
                params, opt_state, m = length_buckets.update(ctx.bucketing.update, params, opt_state, full, chunks,
                                                             aggregation=g.resolved_aggregation(), mesh=ctx.mesh,
                                                             frozen=state.base_params)
            metrics.append(m)
    return dataclasses.replace(state, params=params, opt_state=opt_state), metrics, ReadyAt(metrics)


def sync_reference(ctx: RunContext, state: RunState, step: int) -> RunState:
    """After step `step`'s update: every `grpo.ref_resync_every` steps (TRL's ref_model_sync_steps,
    with mixup alpha 1) the reference becomes a frozen copy of the policy, so the KL term pulls
    toward a recent policy instead of the start."""
    g = ctx.config.grpo
    if ctx.uses_reference and g.ref_resync_every and step % g.ref_resync_every == 0:
        state = dataclasses.replace(state, ref_params=step_lib.frozen_copy(state.params, ctx.ref_dtype))
    return state


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Per name, the mean over the dicts that have it (rounds of one step)."""
    names = {k for d in dicts for k in d}
    return {k: float(np.mean([d[k] for d in dicts if k in d])) for k in sorted(names)}


def _nan_mean(x: np.ndarray) -> float:
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def _nan_std(x: np.ndarray) -> float:
    return float(np.nanstd(x)) if np.isfinite(x).any() else float("nan")


def _advantage_stats(values: np.ndarray) -> dict[str, float]:
    """Mean, std, max and min of the advantages (per answer, or per trained token of episodes)."""
    if values.size == 0:
        values = np.zeros(1, np.float32)
    return {"advantages/mean": float(values.mean()), "advantages/std": float(values.std()),
            "advantages/max": float(values.max()), "advantages/min": float(values.min())}


def report(ctx: RunContext, step: int, batch: StepBatch, advantages: np.ndarray,
           update_metrics: list[dict[str, float]], times: dict[str, float]) -> dict[str, float]:
    """Phase 7: the step's metrics row. `update_metrics` are every update's, read to floats;
    `times` the step's time/* seconds and tokens_per_second (`step_record.StepRecord.times`)."""
    g = ctx.config.grpo
    G = g.num_generations
    metrics = step_lib.combine_update_metrics(update_metrics)
    metrics.update({
        "reward": _nan_mean(batch.rewards),
        "reward_std": _nan_std(batch.rewards),
        "frac_reward_zero_std": float(adv_lib.zero_std_fraction(jnp.asarray(batch.rewards), G)),
        "completions/mean_length": float(batch.lengths.mean()),
        "completions/min_length": float(batch.lengths.min()),
        "completions/max_length": float(batch.lengths.max()),
        "completions/clipped_ratio": float(batch.truncated.mean()),
        # The share of completions whose positive reward rewards.truncated_reward="at_most_zero" took away.
        "completions/truncated_reward_zeroed": (float(batch.zeroed_by_truncation.mean())
                                                if batch.zeroed_by_truncation is not None else 0.0),
        **_advantage_stats(advantages if advantages.ndim == 1
                           else advantages[trained_tokens(batch.arrays) > 0]),
        "learning_rate": float(ctx.schedule(max(0, (step - 1) * ctx.updates_per_step))),
        **times,
        "data_position": batch.data_position,
    })
    if g.dynamic_sampling:
        metrics["dynamic_sampling/rounds"] = batch.rounds
        # What was sampled, before the filter kept the informative groups.
        metrics["dynamic_sampling/sampled_reward"] = batch.sampled["reward"]
        metrics["dynamic_sampling/sampled_frac_reward_zero_std"] = batch.sampled["frac_reward_zero_std"]
    metrics.update(batch.reward_metrics)  # what reward functions logged with log_metric, by their names
    metrics.update(batch.episode_metrics)
    for name, values in batch.reward_parts.items():
        metrics[f"rewards/{name}/mean"] = _nan_mean(values)
        metrics[f"rewards/{name}/std"] = _nan_std(values)
    # No per-token metric for a step that trained on no token; no mean outside its bounds.
    return metric_rules.means_within_bounds(metric_rules.without_masked_step_metrics(metrics, update_metrics))
