"""The GRPO loop (seed Step 5): the host-side loop around the jitted step pieces (`grpo_jax.step`).

    1. take `prompts_per_step` examples          5. reference (and optionally pi_old) log-probs
    2. G answers each from pi_old (the sampler)  6. mu passes x minibatches of Optax updates
    3. rewards from the task's reward functions  7. pi_old <- pi_theta (the next rollout uses new params)
    4. group advantages

The policy params and the optimizer state are donated to the update; the reference params are a
separate frozen tree that the optimizer never sees (Simply's layout).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import advantages as adv_lib
from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax import rollout as rollout_lib
from grpo_jax import sft as sft_lib
from grpo_jax import sharding
from grpo_jax.checkpoint import CheckpointManager
from grpo_jax.diagnostics import Diagnostics
from grpo_jax.metrics import MetricsWriter
from grpo_jax.sampler import Sampler, SamplingConfig
from grpo_jax.step import (  # noqa: F401 - UpdateBatch and the builders stay importable from here
    UpdateBatch,
    as_dtype,
    frozen_copy,
    make_logprob_fn,
    make_optimizer,
    make_update_fn,
    prompt_groups,
)
from grpo_jax.tasks import make_task
from grpo_jax.tokenizer import load_tokenizer

log = logging.getLogger("grpo_jax")


# ----------------------------------------------------------------------------------------------
# Building blocks.


def build_model(config: config_lib.Config, tokenizer, mesh) -> tuple[model_lib.ModelConfig, Any, Any]:
    """(model config, graphdef, params): a Hugging Face checkpoint or a fresh init, sharded on `mesh`.

    A fresh model is initialised through `jax.eval_shape` + `jax.jit(out_shardings=...)`, so it is
    never built whole on one device.
    """
    m = config.model
    if m.hf_path:
        from grpo_jax import hf  # only needed for real checkpoints

        model = hf.load_model(m.hf_path, dtype=m.dtype)
        graphdef, params = nnx.split(model)
        return model.config, graphdef, sharding.put_sharded(params, sharding.param_shardings(mesh, params))
    vocab = m.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise config_lib.ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids ({m.tokenizer})"
        )
    model_config = model_lib.ModelConfig(
        vocab_size=vocab,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.rms_norm_eps,
        tie_embeddings=m.tie_embeddings,
        qkv_bias=m.qkv_bias,
        qk_norm=m.qk_norm,
        param_dtype=m.param_dtype,
        dtype=m.dtype,
    )
    graphdef, params = sharding.init_params_sharded(mesh, model_config, m.init_seed)
    return model_config, graphdef, params


def _auto_sampler_threads() -> int:
    """2 on a one-device CPU backend with >= 2 cores, else 1: XLA runs one decode loop on one
    core, and two half batches decoded from two threads take 0.59 s instead of 0.73 s on W1
    (benchmarks/NOTES.md). Accelerators and multi-device meshes keep one stream."""
    one_cpu_device = jax.default_backend() == "cpu" and jax.device_count() == 1
    return 2 if one_cpu_device and (os.cpu_count() or 1) >= 2 else 1


class _CompileCounter:
    """Counts XLA compilations, so a recompile after warm-up can be reported."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            return
        if "backend_compile" in event:
            self.count += 1


_COMPILES = None


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and returns at the end of the step."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, no graceful stop
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum
        log.warning(
            "received %s: finishing this step, saving a checkpoint, then stopping",
            signal.Signals(signum).name,
        )

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


# ----------------------------------------------------------------------------------------------
# Host-side batch assembly.


def _pad_left(x: np.ndarray, width: int, value) -> np.ndarray:
    if x.shape[1] == width:
        return x
    pad = np.full((x.shape[0], width - x.shape[1]), value, x.dtype)
    return np.concatenate([pad, x], axis=1)


def _concat_rollouts(parts: list[rollout_lib.Rollout], pad_id: int) -> dict[str, np.ndarray]:
    """Stacks selected rows of several rollouts into host arrays with one common prompt width."""
    width = max(p.sample.prompt_tokens_BxP.shape[1] for p in parts)
    rows = sharding.process_rows  # this process's rows; the plain arrays on one process
    out = {
        "prompt_tokens": np.concatenate(
            [_pad_left(rows(p.sample.prompt_tokens_BxP), width, pad_id) for p in parts]
        ),
        "prompt_mask": np.concatenate([_pad_left(rows(p.sample.prompt_mask_BxP), width, 0) for p in parts]),
        "tokens": np.concatenate([rows(p.sample.tokens_BxC) for p in parts]),
        "mask": np.concatenate([rows(p.sample.mask_BxC) for p in parts]),
        "logprobs": np.concatenate([rows(p.sample.logprobs_BxC) for p in parts]),
    }
    return out


def _select_groups(rollouts, group_size, num_groups, dynamic: bool):
    """DAPO dynamic sampling: keep groups whose rewards differ, first come first kept; fill the rest
    with zero-variance groups (they get zero advantage) so the batch shape never changes."""
    keep, spare = [], []
    for r_i, ro in enumerate(rollouts):
        for g in range(len(ro.rewards) // group_size):
            rows = slice(g * group_size, (g + 1) * group_size)
            vals = ro.rewards[rows]
            finite = vals[np.isfinite(vals)]
            informative = finite.size > 1 and np.ptp(finite) > 0
            (keep if (informative or not dynamic) else spare).append((r_i, g))
    chosen = (keep + spare)[:num_groups]
    return chosen, len(keep)


# ----------------------------------------------------------------------------------------------
# The run.


@dataclasses.dataclass
class RunResult:
    run_dir: str
    step: int
    history: list[dict]  # every metrics row written
    evals: list[dict]  # the held-out evaluation rows
    params: Any = None


def run(config: config_lib.Config, *, resume: bool = False, task=None, tokenizer=None) -> RunResult:
    """Trains per `config`; writes metrics, samples and checkpoints to `config.train.run_dir`.

    `task` and `tokenizer` replace the ones the config names (research code brings its own objects
    implementing `grpo_jax.tasks.Task` and `grpo_jax.tokenizer.Tokenizer`).
    """
    global _COMPILES
    if _COMPILES is None:
        _COMPILES = _CompileCounter()
    t_cfg, g_cfg, s_cfg, e_cfg = config.train, config.grpo, config.sampling, config.eval
    run_dir = os.path.abspath(t_cfg.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    primary = jax.process_index() == 0  # multi-host: one writer of the run directory's files
    if primary:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config_lib.to_dict(config), f, indent=2)

    tokenizer = tokenizer or load_tokenizer(config.model.tokenizer)
    task = task or make_task(config.task.name, **config.task.options)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    rows_per_micro = (
        g_cfg.prompts_per_step * g_cfg.num_generations // (g_cfg.num_minibatches * g_cfg.grad_accum_steps)
    )
    if rows_per_micro % sharding.batch_size_multiple(mesh):
        raise config_lib.ConfigError(
            f"a micro-batch of {rows_per_micro} completions (grpo.prompts_per_step * grpo.num_generations / "
            f"(grpo.num_minibatches * grpo.grad_accum_steps)) must split evenly over mesh.data * mesh.fsdp = "
            f"{sharding.batch_size_multiple(mesh)} devices"
        )
    # Multi-host: each process samples and scores its host slice of the step's prompts; per-row
    # results are gathered to every host, so advantages and metrics are the single-host ones.
    multi = jax.process_count() > 1
    if multi:
        _check_multihost(config, mesh)
    model_config, graphdef, params = build_model(config, tokenizer, mesh)
    # Powers of two from 8: short built-in prompts ("07+45=") are not padded to 16, which would
    # double the update's sequence length; a few buckets keep recompiles to the first steps.
    sampler = Sampler(
        graphdef,
        model_config,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        prompt_buckets=tuple(8 << i for i in range(12)),
        mesh=mesh,
        threads=s_cfg.threads or _auto_sampler_threads(),
    )
    rollout_sampling = SamplingConfig(
        max_new_tokens=s_cfg.max_new_tokens,
        temperature=s_cfg.temperature,
        top_k=s_cfg.top_k,
        top_p=s_cfg.top_p,
        ignore_eos=s_cfg.ignore_eos,
    )
    G, B = g_cfg.num_generations, g_cfg.prompts_per_step
    updates_per_step = g_cfg.num_iterations * g_cfg.num_minibatches
    tx, schedule = make_optimizer(config.optim, t_cfg.steps * updates_per_step)
    base_key = jax.random.PRNGKey(t_cfg.seed)
    eval_examples = task.eval_examples()[: e_cfg.num_questions] if e_cfg.num_questions else []

    ckpt = CheckpointManager(
        os.path.join(run_dir, "checkpoints"),
        max_to_keep=t_cfg.keep_checkpoints,
        async_save=t_cfg.async_checkpoints,
    )
    start_step, data_position = 0, 0
    use_ref = g_cfg.beta > 0 or g_cfg.ref_resync_every > 0
    ref_dtype = jnp.bfloat16 if g_cfg.ref_dtype == "bfloat16" else jnp.float32
    latest = ckpt.latest_step() if resume else None
    if resume and latest is None:
        log.warning("--resume: no checkpoint in %s; starting from scratch", ckpt_dir_of(run_dir))
    if latest is None:
        if config.sft.steps > 0:
            params, sft_stats = sft_lib.warm_up(
                graphdef,
                params,
                sampler,
                tokenizer,
                task,
                config.sft,
                max_new_tokens=s_cfg.max_new_tokens,
                seed=t_cfg.seed,
                log_fn=log.info,
            )
            if primary:
                with open(os.path.join(run_dir, "sft.json"), "w") as f:
                    json.dump(sft_stats, f, indent=2)
        opt_state = sharding.init_opt_state_sharded(mesh, tx, params)
        ref_params = frozen_copy(params, ref_dtype) if use_ref else None
    else:
        opt_state = sharding.init_opt_state_sharded(mesh, tx, params)
        abstract = {"params": params, "opt_state": opt_state}
        if use_ref:
            abstract["ref_params"] = as_dtype(params, ref_dtype)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract
        )
        start_step, state, meta = ckpt.restore(abstract)
        params, opt_state = state["params"], state["opt_state"]
        ref_params = state.get("ref_params")
        data_position = int(meta["data_position"])
        log.info("resumed from step %d (data position %d)", start_step, data_position)

    update_group, logprob_group = prompt_groups(g_cfg, rows_per_micro, sharding.batch_size_multiple(mesh))
    update_fn = sharding.shard_update_fn(
        make_update_fn(graphdef, tx, g_cfg, s_cfg.temperature, group_size=update_group),
        mesh,
        params,
        opt_state,
    )
    logprob_fn = make_logprob_fn(graphdef, s_cfg.temperature, group_size=logprob_group)
    writer = MetricsWriter(
        run_dir,
        total_steps=t_cfg.steps,
        console=t_cfg.progress,
        key_metrics=("reward", "frac_reward_zero_std", "kl", "entropy", "eval/pass@1"),
    )
    diagnostics = Diagnostics()
    history, evals = [], []
    pool = None
    if t_cfg.verifier_workers > 0:
        from grpo_jax.rewards import VerifierPool

        pool = VerifierPool(t_cfg.verifier_workers)

    def run_eval(step):
        t0 = time.perf_counter()
        res = rollout_lib.evaluate(
            sampler,
            params,
            tokenizer,
            task,
            eval_examples,
            num_samples=e_cfg.num_samples,
            ks=e_cfg.ks,
            temperature=e_cfg.temperature,
            max_new_tokens=s_cfg.max_new_tokens,
            greedy=e_cfg.greedy,
            rng=jax.random.fold_in(base_key, 10_000_000 + step),
        )
        res["time/eval"] = time.perf_counter() - t0
        evals.append({"step": step, **res})
        return res

    def save(step):
        state = {"params": params, "opt_state": opt_state}
        if ref_params is not None:
            state["ref_params"] = ref_params
        meta = {"step": step, "data_position": data_position, "config": config_lib.to_dict(config)}
        ckpt.save(step, state, meta, force=True)

    step = start_step
    stopped_by = None
    steps_this_run = 0
    try:
        with _StopFlag() as stop:
            if start_step == 0 and eval_examples:
                row = {"step": 0, **run_eval(0)}
                writer.write(0, row)
                history.append(row)
            while step < t_cfg.steps:
                step += 1
                t_step = time.perf_counter()
                compiles_before = _COMPILES.count
                step_key = jax.random.fold_in(base_key, step)

                # 1-3: sample prompts, G answers each, rewards; DAPO dynamic sampling tops the batch up.
                t0 = time.perf_counter()
                rollouts = []
                for round_i in range(1 + (g_cfg.max_resample_rounds if g_cfg.dynamic_sampling else 0)):
                    examples = [task.train_example(data_position + i) for i in range(B)]
                    if multi:
                        examples = examples[sharding.host_slice(B, mesh)]
                    data_position += B
                    ro = rollout_lib.generate_and_score(
                        sampler,
                        params,
                        tokenizer,
                        task,
                        examples,
                        num_samples=G,
                        sampling=rollout_sampling,
                        rng=jax.random.fold_in(step_key, round_i),
                        step=step,
                        pool=pool,
                    )
                    rollouts.append(ro)
                    chosen, informative = _select_groups(rollouts, G, B, g_cfg.dynamic_sampling)
                    if not g_cfg.dynamic_sampling or informative >= B:
                        break
                t_rollout = time.perf_counter() - t0
                reward_seconds = sum(ro.reward_seconds for ro in rollouts)
                # Stack every round's rollout, then pick each chosen group's rows out of that stack.
                offsets = np.cumsum([0] + [len(ro.rewards) for ro in rollouts[:-1]])
                row_index = np.concatenate(
                    [np.arange(offsets[r] + g * G, offsets[r] + (g + 1) * G) for r, g in chosen]
                )
                host = _concat_rollouts(rollouts, tokenizer.pad_id)
                host = {k: v[row_index] for k, v in host.items()}

                def pick(field):
                    return np.concatenate([getattr(ro, field) for ro in rollouts])[row_index]

                rewards, lengths, truncated = pick("rewards"), pick("lengths"), pick("truncated")
                parts = {
                    name: np.concatenate([ro.reward_parts[name] for ro in rollouts])[row_index]
                    for name in rollouts[0].reward_parts
                }
                if multi:
                    # Host slices hold whole groups (prompts), in process order: gathering them gives
                    # the single-host rows, so advantages and metrics match it.
                    host = {k: sharding.allgather_rows(v) for k, v in host.items()}
                    rewards, lengths, truncated = (
                        sharding.allgather_rows(x) for x in (rewards, lengths, truncated)
                    )
                    parts = {name: sharding.allgather_rows(v) for name, v in parts.items()}

                # 4: advantages, optionally zero for truncated answers (they are also masked out below).
                advantages = np.asarray(
                    adv_lib.group_advantages(
                        jnp.asarray(rewards), G, scale=g_cfg.scale_rewards, eps=g_cfg.advantage_eps
                    )
                )
                completion_mask = host["mask"].astype(np.int32)
                if g_cfg.mask_truncated_completions:
                    completion_mask = completion_mask * (~truncated)[:, None]

                # 5: reference and (optionally) recomputed pi_old log-probs.
                t0 = time.perf_counter()
                tokens = jnp.asarray(np.concatenate([host["prompt_tokens"], host["tokens"]], axis=1))
                attention = jnp.asarray(
                    np.concatenate([host["prompt_mask"], host["mask"]], axis=1).astype(np.int32)
                )
                C = host["tokens"].shape[1]
                sampler_logp = jnp.asarray(host["logprobs"])
                if multi:
                    tokens, attention = _global_rows(mesh, (np.asarray(tokens), np.asarray(attention)))
                    sampler_logp = host["logprobs"]
                ref_logp = logprob_fn(ref_params, tokens, attention, C) if g_cfg.beta > 0 else None
                old_logp = (
                    logprob_fn(params, tokens, attention, C)
                    if g_cfg.old_logprobs == "recompute"
                    else sampler_logp
                )
                # Wait for them so time/logprobs is their compute, not just the dispatch (the
                # update needs them next anyway, so this costs no overlap).
                jax.block_until_ready((ref_logp, old_logp))
                t_logprobs = time.perf_counter() - t0
                if multi:
                    # Every row on every host, so minibatches are cut exactly as on one host.
                    tokens, attention, ref_logp, old_logp = (
                        None if x is None else _all_rows(x) for x in (tokens, attention, ref_logp, old_logp)
                    )

                # 6: mu passes over the batch in minibatches of A micro-batches each.
                t0 = time.perf_counter()
                n_rows = tokens.shape[0]
                A = g_cfg.grad_accum_steps
                M = n_rows // (g_cfg.num_minibatches * A)
                full = {
                    "tokens": tokens,
                    "attention": attention,
                    "completion_mask": jnp.asarray(completion_mask),
                    "advantages": jnp.asarray(advantages, jnp.float32),
                    "old_logp": old_logp,
                    "sampler_logp": sampler_logp,
                    "ref_logp": ref_logp,
                }
                step_metrics = []
                for it in range(g_cfg.num_iterations):
                    order = (
                        np.arange(n_rows)
                        if g_cfg.num_minibatches == 1
                        else np.asarray(
                            jax.random.permutation(jax.random.fold_in(step_key, 1000 + it), n_rows)
                        )
                    )
                    for mb in range(g_cfg.num_minibatches):
                        idx = order[mb * A * M : (mb + 1) * A * M]
                        batch = UpdateBatch(
                            **{
                                k: (None if v is None else v[idx].reshape((A, M) + v.shape[1:]))
                                for k, v in full.items()
                            }
                        )
                        if multi:
                            local = sharding.host_slice(M, mesh)
                            batch = sharding.global_batch(
                                mesh, jax.tree.map(lambda x: np.asarray(x)[:, local], batch), M, row_axis=1
                            )
                        else:
                            batch = jax.device_put(batch, sharding.batch_sharding(mesh, row_axis=1))
                        params, opt_state, m = update_fn(params, opt_state, batch)
                        step_metrics.append(m)
                metrics = {k: float(v) for k, v in step_metrics[0].items()}  # first update: on-policy figures
                metrics["loss"] = float(np.mean([float(m["loss"]) for m in step_metrics]))
                t_update = time.perf_counter() - t0

                # 7: pi_old <- pi_theta is implicit (the next rollout samples with `params`); reference resync.
                if g_cfg.ref_resync_every and step % g_cfg.ref_resync_every == 0:
                    ref_params = frozen_copy(params, ref_dtype)

                # Metrics (TRL's names).
                finite = np.isfinite(rewards)
                metrics.update(
                    {
                        "reward": float(np.nanmean(rewards)) if finite.any() else float("nan"),
                        "reward_std": float(np.nanstd(rewards)) if finite.any() else float("nan"),
                        "frac_reward_zero_std": float(adv_lib.zero_std_fraction(jnp.asarray(rewards), G)),
                        "completions/mean_length": float(lengths.mean()),
                        "completions/min_length": float(lengths.min()),
                        "completions/max_length": float(lengths.max()),
                        "completions/clipped_ratio": float(truncated.mean()),
                        "advantages/mean": float(advantages.mean()),
                        "advantages/std": float(advantages.std()),
                        "advantages/max": float(advantages.max()),
                        "advantages/min": float(advantages.min()),
                        "learning_rate": float(schedule(max(0, (step - 1) * updates_per_step))),
                        # TRL splits generation from scoring: time/rollout is sampling + decoding text.
                        "time/rollout": t_rollout - reward_seconds,
                        "time/reward": reward_seconds,
                        "time/logprobs": t_logprobs,
                        "time/update": t_update,
                        "data_position": data_position,
                    }
                )
                if g_cfg.dynamic_sampling:
                    metrics["dynamic_sampling/rounds"] = len(rollouts)
                for name, vals in parts.items():
                    metrics[f"rewards/{name}/mean"] = (
                        float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")
                    )
                    metrics[f"rewards/{name}/std"] = (
                        float(np.nanstd(vals)) if np.isfinite(vals).any() else float("nan")
                    )
                metrics["time/step"] = time.perf_counter() - t_step
                metrics["tokens_per_second"] = float(host["mask"].sum()) / max(metrics["time/step"], 1e-9)
                if step > start_step + 2 and _COMPILES.count > compiles_before:
                    log.warning(
                        "step %d recompiled %d XLA program(s); shapes changed after warm-up "
                        "(prompt length bucket or batch shape)",
                        step,
                        _COMPILES.count - compiles_before,
                    )
                    metrics["recompiles"] = _COMPILES.count - compiles_before

                if t_cfg.samples_every and (step % t_cfg.samples_every == 0 or step == 1):
                    writer.write_samples(step, _sample_rows(rollouts, chosen, G, host, parts, rewards))
                if eval_examples and e_cfg.every and step % e_cfg.every == 0 and step != t_cfg.steps:
                    metrics.update(run_eval(step))
                if step == t_cfg.steps and eval_examples:
                    metrics.update(run_eval(step))
                metrics = {"step": step, **metrics}
                diagnostics.update(step, metrics)  # logs each warning itself
                if step % t_cfg.log_every == 0 or "eval/pass@1" in metrics:
                    writer.write(step, metrics)
                history.append(metrics)

                steps_this_run += 1
                if stop.signal is not None:
                    stopped_by = signal.Signals(stop.signal).name
                if t_cfg.stop_after_steps and steps_this_run >= t_cfg.stop_after_steps and step < t_cfg.steps:
                    stopped_by = "stop_after_steps"
                if (
                    t_cfg.checkpoint_every
                    and step % t_cfg.checkpoint_every == 0
                    or stopped_by
                    or step == t_cfg.steps
                ):
                    save(step)
                if stopped_by:
                    log.warning("stopped at step %d (%s); resume with --resume", step, stopped_by)
                    break
    finally:
        ckpt.wait_until_finished()
        ckpt.close()
        writer.close()
        if pool is not None:
            pool.close()

    if step == t_cfg.steps and t_cfg.export_hf:
        from grpo_jax import hf

        export = params
        if multi:  # every process joins the gather of the whole weights; process 0 writes them
            export = jax.tree.map(jnp.asarray, _all_rows_tree(params))
        if primary:
            hf.save_model(nnx.merge(graphdef, export), os.path.join(run_dir, "hf"))
    return RunResult(run_dir=run_dir, step=step, history=history, evals=evals, params=params)


def _check_multihost(config: config_lib.Config, mesh) -> None:
    """Settings a multi-process run does not support (yet), as ConfigErrors."""
    g = config.grpo
    n_proc, multiple = jax.process_count(), sharding.batch_size_multiple(mesh)
    if g.prompts_per_step % n_proc or g.prompts_per_step % multiple:
        raise config_lib.ConfigError(
            f"grpo.prompts_per_step={g.prompts_per_step} must split evenly over {n_proc} processes and over "
            f"mesh.data * mesh.fsdp = {multiple} devices (each process samples its share of the prompts)"
        )
    if g.dynamic_sampling:
        raise config_lib.ConfigError("grpo.dynamic_sampling is not supported on several processes yet")
    if config.sft.steps > 0:
        raise config_lib.ConfigError("sft.steps > 0 (SFT warm-up) is not supported on several processes yet")


def _global_rows(mesh, arrays):
    """Full host arrays (every row, the same on every process) -> global arrays, rows sharded."""
    n = arrays[0].shape[0]
    local = sharding.host_slice(n, mesh)
    return tuple(sharding.global_batch(mesh, x[local], n) for x in arrays)


def _all_rows(x) -> np.ndarray:
    """Every row of a (possibly global) array, on this host."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _all_rows_tree(tree):
    """Every leaf of a tree of global arrays, whole, on this host (all processes must call it)."""
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def ckpt_dir_of(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _sample_rows(rollouts, chosen, G, host, parts, rewards) -> list[dict]:
    """Every completion of the step as a dict for the samples log (the writer picks what to print)."""
    rows = []
    i = 0
    for r, g in chosen:
        ro = rollouts[r]
        for j in range(g * G, (g + 1) * G):
            rows.append(
                {
                    "prompt": ro.prompts[j],
                    "completion": ro.completions[j],
                    "answer": ro.examples[j].get("answer"),
                    "reward": float(rewards[i]),
                    **{f"rewards/{n}": float(v[i]) for n, v in parts.items()},
                }
            )
            i += 1
    return rows
