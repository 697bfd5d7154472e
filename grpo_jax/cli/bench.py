"""Benchmark pieces shared by `benchmarks/`: the W1 workload, FLOP counts, the matmul peak.

    .venv/bin/python -m grpo_jax.cli.bench            # W1, same as benchmarks/bench_w1.py

W1 (benchmarks/NOTES.md, /work/shared/peers/WORKLOAD.md): a Qwen2-shaped decoder (hidden 256, MLP
704, 4 layers, 4 heads, 2 KV heads, head_dim 64, vocab 1024, untied, qkv bias, float32, random
init); each GRPO step samples G=8 answers of exactly 64 tokens to each of 4 prompts "What is A+B?
Put the answer in \\boxed{}." (29 tokens, bucketed to 32), then one reference forward and one
AdamW update. The figure is the median step time over steps 3..12.

FLOPs are counted from the shapes, as 2 per multiply-add of every matmul the code runs (weights,
attention scores and values, the logits), and not the elementwise work; a backward pass is
counted as twice its forward (weight and input gradients).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, SamplingSection,
                             TrainSection)
from grpo_jax.training import step as step_lib
from grpo_jax.config.batch_plan import BatchPlan
from grpo_jax.model import ModelConfig
from grpo_jax.rewards import extract_boxed, normalize_answer
from grpo_jax.rewards.math_verify import fast_number
from grpo_jax.tasks import RewardSpec
from grpo_jax.tasks.base import example_rng

W1_MODEL = ModelSection(tokenizer="builtin", vocab_size=1024, hidden_size=256, intermediate_size=704,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                        qkv_bias=True, tie_embeddings=False, dtype="float32")
W1_PROMPT_LEN = 32  # the sampler's bucket for the 29-token prompts
# W2 (benchmarks/bench_w2_gpu.py): a Qwen2.5-0.5B-shaped policy, bf16 compute on float32 masters.
W2_MODEL = ModelSection(tokenizer="builtin", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
                        qkv_bias=True, tie_embeddings=True, dtype="bfloat16")


def w1_config(run_dir: str, *, steps: int = 12, prompts_per_step: int = 4, num_generations: int = 8,
              max_new_tokens: int = 64, model: ModelSection = W1_MODEL) -> Config:
    """The W1 run: temperature 1, ignore_eos, beta 0.04 (k3), eps 0.2, AdamW 1e-5, no eval,
    one update per batch, a checkpoint only after the last step."""
    return Config(
        model=model,
        sampling=SamplingSection(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True),
        grpo=GRPOSection(prompts_per_step=prompts_per_step, num_generations=num_generations, beta=0.04,
                         kl="k3", eps_low=0.2),
        optim=OptimSection(learning_rate=1e-5, b1=0.9, b2=0.999, weight_decay=0.0, max_grad_norm=1.0),
        eval=EvalSection(num_questions=0),
        train=TrainSection(steps=steps, run_dir=run_dir, checkpoint_every=0, samples_every=0,
                           async_checkpoints=False, progress=False),
    )


def last_boxed(completion: str) -> str | None:
    """The content of the LAST `\\boxed{...}` in the text (W1's rule), or None when there is none."""
    start = completion.rfind("\\boxed")
    return None if start < 0 else extract_boxed(completion[start:])


def boxed_sum_reward(prompts, completions, *, answer, **_) -> list[float]:
    """1.0 iff the last \\boxed{} holds the number `answer` (exact, no sympy), else 0.0."""
    out = []
    for completion, truth in zip(completions, answer):
        boxed = last_boxed(completion)
        value = None if boxed is None else fast_number(normalize_answer(boxed))
        out.append(1.0 if value is not None and value == fast_number(str(truth)) else 0.0)
    return out


class AdditionTask:
    """W1's data: "What is A+B? Put the answer in \\boxed{}." with A, B random 2-digit ints."""

    name = "w1_addition"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def train_example(self, index: int) -> dict:
        rng = example_rng(self.name, self.seed, index)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return {"prompt": f"What is {a}+{b}? Put the answer in \\boxed{{}}.", "answer": str(a + b)}

    def eval_examples(self) -> list[dict]:
        return []

    def reward_fns(self) -> list[RewardSpec]:
        return [RewardSpec("boxed_sum", boxed_sum_reward, 1.0)]

    def eval_correct(self, completion: str, example: dict) -> bool:
        return boxed_sum_reward([example["prompt"]], [completion], answer=[example["answer"]])[0] == 1.0

    def extract_answer(self, completion: str) -> str | None:
        return last_boxed(completion)


class WideVocabTokenizer:
    """Wraps a tokenizer for a model whose vocabulary is larger than the tokenizer's (W1: 1024 model
    ids, 448 pieces). A random policy samples ids >= the tokenizer's size; they have no text, so
    `decode` drops them (sentencepiece raises OUT_OF_RANGE on them)."""

    def __init__(self, inner):
        self.inner = inner
        self.vocab_size, self.eos_id, self.pad_id = inner.vocab_size, inner.eos_id, inner.pad_id
        self.bos_id = getattr(inner, "bos_id", None)

    def encode(self, text: str, **kwargs) -> list[int]:
        return self.inner.encode(text, **kwargs)

    def batch_encode(self, texts, **kwargs):
        return self.inner.batch_encode(texts, **kwargs)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        return self.inner.decode(ids[ids < self.vocab_size])


# ----------------------------------------------------------------------------------------------
# FLOPs from shapes.

def matmul_params(c: ModelConfig) -> tuple[int, int]:
    """(weights multiplied per token in all layers, weights of the output projection [D, V])."""
    d, h = c.hidden_size, c.head_dim
    per_layer = d * h * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * d * c.intermediate_size
    return c.num_layers * per_layer, d * c.vocab_size


def forward_flops(c: ModelConfig, *, batch: int, queries: int, keys: int, logit_positions: int) -> int:
    """FLOPs of one forward: `batch` rows of `queries` new tokens attending over `keys` slots each
    (every slot is multiplied, masked or not: that is what the kernels do), logits formed at
    `logit_positions` positions per row."""
    layers, head = matmul_params(c)
    weights = 2 * batch * queries * layers
    attention = c.num_layers * batch * 4 * c.num_heads * c.head_dim * queries * keys  # QK^T and PV
    return weights + attention + 2 * batch * logit_positions * head


@dataclasses.dataclass(frozen=True)
class StepFlops:
    rollout: int     # prefill of each prompt once + decode of every sampled token
    reference: int   # the reference model's forward over prompt + completion
    policy: int      # the policy's forward and backward (3x a forward)

    @property
    def total(self) -> int:
        return self.rollout + self.reference + self.policy


def grpo_step_flops(c: ModelConfig, *, num_prompts: int, group: int, prompt_len: int, new_tokens: int,
                    with_reference: bool = True, shared_prompt: bool = False) -> StepFlops:
    """FLOPs of one GRPO step (see the module docstring for the convention).

    Rollout: the N prompts are prefilled once (logits only at the last slot), then each of the
    B = N * G rows decodes `new_tokens` steps over a cache of S = P + C slots (each step multiplies
    all S slots). Reference and policy: B rows of P + C tokens, logits at the C target positions
    (the workload as every trainer states it); with shared_prompt, as grpo_jax runs it by default
    (grpo.share_prompt_prefix): the N prompts once, and the B completions over P + C keys each.
    """
    b, s = num_prompts * group, prompt_len + new_tokens
    prefill = forward_flops(c, batch=num_prompts, queries=prompt_len, keys=prompt_len, logit_positions=1)
    decode = new_tokens * forward_flops(c, batch=b, queries=1, keys=s, logit_positions=1)
    if shared_prompt:
        full = forward_flops(c, batch=num_prompts, queries=prompt_len, keys=prompt_len, logit_positions=0) + \
            forward_flops(c, batch=b, queries=new_tokens, keys=s, logit_positions=new_tokens)
    else:
        full = forward_flops(c, batch=b, queries=s, keys=s, logit_positions=new_tokens)
    return StepFlops(rollout=prefill + decode, reference=full if with_reference else 0, policy=3 * full)


def executed_step_flops(config: Config, c: ModelConfig, *, prompt_len: int, num_devices: int) -> StepFlops:
    """`grpo_step_flops` of what the trainer runs under `config`: each prompt once per group in the
    reference and update passes where it chooses that (`step.prompt_groups`)."""
    g = config.grpo
    kw = dict(num_prompts=g.prompts_per_step, group=g.num_generations, prompt_len=prompt_len,
              new_tokens=config.sampling.max_new_tokens, with_reference=g.beta > 0)
    rows_per_micro = BatchPlan.of(g, num_devices).rows_per_micro_batch
    update_group, logprob_group = step_lib.prompt_groups(g, rows_per_micro, num_devices)
    per_row, shared = grpo_step_flops(c, **kw), grpo_step_flops(c, **kw, shared_prompt=True)
    return StepFlops(rollout=per_row.rollout,
                     reference=(shared if logprob_group > 1 else per_row).reference,
                     policy=(shared if update_group > 1 else per_row).policy)


def matmul_peak_flops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """FLOP/s of one jitted n x n x n matmul (median of `repeats`, after a warm-up call)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def summarize_steps(history: list[dict], first: int = 3, last: int = 12) -> dict:
    """Median of each time/* metric over steps first..last (1-based, inclusive), plus their count."""
    rows = [r for r in history if first <= r.get("step", 0) <= last]
    if not rows:
        raise ValueError(f"summarize_steps: no history rows with step in [{first}, {last}]; "
                         f"got steps {[r.get('step') for r in history]}")
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    out = {k: float(statistics.median([r[k] for r in rows if k in r])) for k in keys}
    out["steps_measured"] = len(rows)
    return out


W3_MAX_NEW_TOKENS = 512


def w3_completion_lengths(num_rows: int = 128, seed: int = 0, max_new_tokens: int = W3_MAX_NEW_TOKENS) -> np.ndarray:
    """W3's completion lengths (issue 15), int [num_rows]: row r stops after
    min(512, ceil(exp(log 96 + 0.9 z_r))) tokens, z_r standard normal from `seed` (population median
    97, mean ~136, ~3% at 512; seed 0: mean 143, 28% of 128 x 512 real)."""
    z = np.random.default_rng(seed).standard_normal(num_rows)
    return np.minimum(max_new_tokens, np.ceil(np.exp(np.log(96.0) + 0.9 * z))).astype(np.int64)


W4_MAX_NEW_TOKENS = 4096


def w4_completion_lengths(num_rows: int = 32, seed: int = 0, max_new_tokens: int = W4_MAX_NEW_TOKENS) -> np.ndarray:
    """W4's completion lengths (reasoning lengths), int [num_rows]: the (r + 1/2) / num_rows
    quantiles of a log-normal with median 500 and log-sd 1.2, capped at 4,096, in an order shuffled
    by `seed`. Quantiles, not draws, so every seed has the same long tail: for 32 rows, median ~500,
    mean ~890, four rows past 2,000 and the longest at 4,096 (benchmarks/NOTES.md)."""
    import statistics

    normal = statistics.NormalDist()
    z = np.array([normal.inv_cdf((r + 0.5) / num_rows) for r in range(num_rows)])
    lengths = np.minimum(max_new_tokens, np.ceil(np.exp(np.log(500.0) + 1.2 * z))).astype(np.int64)
    return np.random.default_rng(seed).permutation(lengths)


def fit_exponent(x, y) -> float:
    """Slope of log y against log x (least squares): y ~ x^slope."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2 or np.any(x <= 0) or np.any(y <= 0):
        raise ValueError(f"fit_exponent needs >= 2 positive points, got x={x.tolist()}, y={y.tolist()}")
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


if __name__ == "__main__":
    import runpy
    import pathlib
    import sys
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_w1.py"
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")


def train_cli(config_file: str, run_dir: str, overrides: list[str], *, cwd) -> tuple[float, list[dict]]:
    """Runs `python -m grpo_jax train --config config_file --run-dir run_dir --set ...` from `cwd`
    (the repository) as a user would, progress bar off; (wall seconds, the run's metrics rows).
    A failed run exits the benchmark with the command and the end of its stderr."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "grpo_jax", "train", "--config", config_file, "--run-dir", run_dir,
           "--set", "train.progress=false"]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(cwd)))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return wall, [json.loads(line) for line in open(pathlib.Path(run_dir) / "metrics.jsonl")]

