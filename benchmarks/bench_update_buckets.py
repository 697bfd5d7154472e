"""W3's update phase (reference log-probs + the GRPO update) with and without length bucketing.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_update_buckets.py [--repeats 3] [--workload w3|w1]

One JSON line. The batch is built directly (no rollout): W1's model, 16 prompts x G=8 = 128 rows,
prompts of 32 tokens, completions of `bench.w3_completion_lengths()` (max_new_tokens 512), beta 0.04,
pi_old from the sampler, so the phase is `phases.logprobs` (the reference pass) then
`phases.update`, exactly as the trainer runs them (`run_context.build`). For each setting of
`grpo.bucket_by_length` (`--modes`, default "off,on") it reports the first call, the seconds JAX
spent compiling in it (its monitoring events: trace, lowering, XLA compile) and how many programs,
then the median of `--repeats` calls run interleaved (off, on, off, on, ...: the machine's load
moves), the executed completion padding and shapes of each pass, and how many programs compiled
after the first calls (0: no recompiles). `--workload w1`: W1's batch (4 x 8 rows of exactly 64
tokens), where "auto" keeps both passes unbucketed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import jax
import numpy as np

from grpo_jax.cli import bench
from grpo_jax.training import length_buckets, phases, run_context
from grpo_jax.training import step as step_lib
from grpo_jax.io.tokenizer import load_tokenizer


def workload(name: str, mode: str):
    """(config, completion lengths [B]) of the workload."""
    if name == "w3":
        config = bench.w1_config(tempfile.mkdtemp(), prompts_per_step=16, max_new_tokens=bench.W3_MAX_NEW_TOKENS)
        lengths = bench.w3_completion_lengths(128)
    else:
        config = bench.w1_config(tempfile.mkdtemp())
        lengths = np.full(32, 64)
    config = dataclasses.replace(config, grpo=dataclasses.replace(config.grpo, bucket_by_length=mode))
    return config, lengths


def synthetic_rows(ctx, lengths: np.ndarray, prompt_len: int, max_len: int) -> dict:
    """A step's rows as `phases.device_rows` makes them: random prompt and answer tokens, answers of
    `lengths` (EOS included), log-probs near a random policy's, advantages standardised per group."""
    g = ctx.config.grpo
    b, vocab = len(lengths), ctx.model_config.vocab_size
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, vocab, (b, prompt_len + max_len)).astype(np.int32)
    tokens[:, : prompt_len] = np.repeat(tokens[:: g.num_generations, : prompt_len], g.num_generations, axis=0)
    mask = (np.arange(max_len)[None, :] < lengths[:, None]).astype(np.int32)
    rewards = rng.random(b).reshape(-1, g.num_generations)
    adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)).reshape(b)
    host = {"tokens": tokens, "attention": np.concatenate([np.ones((b, prompt_len), np.int32), mask], axis=1),
            "completion_mask": mask, "advantages": adv.astype(np.float32),
            "sampler_logp": (-np.log(vocab) + 0.1 * rng.standard_normal((b, max_len))).astype(np.float32)}
    rows = ctx.processes.to_global(host)
    rows["completion_lengths"] = length_buckets.needed_lengths(mask)
    return rows


class Compiles:
    """Seconds JAX spent tracing, lowering and compiling programs (its monitoring events)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.seconds, self.programs = 0.0, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, duration, **_):
        if name in self.EVENTS:
            self.seconds += duration
            self.programs += name.endswith("backend_compile_duration")


class Setting:
    """One value of grpo.bucket_by_length: its RunContext, state and batch, and its timings."""

    def __init__(self, name: str, mode: str):
        config, self.lengths = workload(name, mode)
        tokenizer = bench.WideVocabTokenizer(load_tokenizer(config.model.tokenizer_spec()))
        self.mode, self.max_len = mode, config.sampling.max_new_tokens
        self.ctx, state = run_context.build(config, task=bench.AdditionTask(), tokenizer=tokenizer)
        self.state = dataclasses.replace(state, ref_params=step_lib.frozen_copy(state.params, self.ctx.ref_dtype))
        self.rows = synthetic_rows(self.ctx, self.lengths, bench.W1_PROMPT_LEN, self.max_len)
        self.calls, self.seconds = 0, []

    def call(self) -> tuple[float, float, dict]:
        """(log-prob seconds, update seconds, the last update's metrics) of one update phase."""
        i, self.calls = self.calls, self.calls + 1
        t0 = time.perf_counter()
        ref_logp, old_logp, logprobs_ready = phases.logprobs(self.ctx, self.state, self.rows)
        jax.block_until_ready(ref_logp)
        t1 = time.perf_counter()
        self.state, metrics, update_ready = phases.update(self.ctx, self.state, self.rows, ref_logp, old_logp, i)
        jax.block_until_ready(metrics)
        t2 = time.perf_counter()
        logprobs_ready.time(), update_ready.time()  # their watcher threads end before the next call
        return t1 - t0, t2 - t1, metrics[-1]

    def plan(self) -> dict:
        if self.ctx.bucketing is None:
            return {}
        out, p, lengths = {}, bench.W1_PROMPT_LEN, self.rows["completion_lengths"]
        lp = self.ctx.bucketing.logprob_chunks(lengths, prompt_len=p, max_len=self.max_len)
        up = self.ctx.bucketing.update_chunks(lengths, np.arange(len(lengths)), prompt_len=p, max_len=self.max_len)
        for key, chunks in (("logprobs", lp), ("update", up)):
            out[f"{key}_bucketed"] = chunks is not None
            if chunks is not None:
                out[f"{key}_padding"] = round(length_buckets.padding_fraction(chunks, lengths), 4)
                out[f"{key}_shapes"] = sorted({(len(ch.rows), ch.length) for ch in chunks})
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("w3", "w1"), default="w3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="off,on")
    args = parser.parse_args()
    config, lengths = workload(args.workload, "off")
    result = {"workload": args.workload, "rows": len(lengths), "mean_length": float(lengths.mean()),
              "real_fraction": round(float(lengths.sum() / (len(lengths) * config.sampling.max_new_tokens)), 4),
              "device": jax.devices()[0].device_kind}
    compiles = Compiles()
    settings = [Setting(args.workload, mode) for mode in args.modes.split(",")]
    for s in settings:
        before = compiles.seconds, compiles.programs
        lp, up, metrics = s.call()
        result[s.mode] = {"first_call_s": round(lp + up, 2), "compile_s": round(compiles.seconds - before[0], 2),
                          "programs_compiled": compiles.programs - before[1], **s.plan()}
    warm = compiles.programs
    # Interleaved (off, on, off, on, ...), so a change in the machine's load hits every setting alike.
    for _ in range(args.repeats):
        for s in settings:
            lp, up, metrics = s.call()
            s.seconds.append((lp, up))
            result[s.mode]["loss"], result[s.mode]["num_tokens"] = float(metrics["loss"]), float(metrics["num_tokens"])
    result["programs_compiled_after_first_calls"] = compiles.programs - warm
    for s in settings:
        r = result[s.mode]
        r["logprobs_s"] = round(statistics.median(a for a, _ in s.seconds), 3)
        r["update_s"] = round(statistics.median(b for _, b in s.seconds), 3)
        r["phase_s"] = round(statistics.median(a + b for a, b in s.seconds), 3)
        r["runs"] = [[round(a, 3), round(b, 3)] for a, b in s.seconds]
    if "off" in result and "on" in result:
        result["speedup"] = round(result["off"]["phase_s"] / result["on"]["phase_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
