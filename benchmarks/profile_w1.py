"""Times the W1 step's device pieces one at a time (each synced), to see where the step goes.

    .venv/bin/python benchmarks/profile_w1.py [--repeats 5] [--trace /tmp/w1_trace]

Pieces: the rollout (prefill + while_loop decode), the reference log-probs, the policy update
(forward + backward + AdamW), and for reference the policy forward alone and a grad without the
optimizer. With --trace, one step of each piece is recorded with jax.profiler (open in Perfetto /
TensorBoard). Figures are medians; FLOP/s use grpo_jax.cli.bench's shape counts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.cli import bench
from grpo_jax.training import optim
from grpo_jax.training import step as step_lib
from grpo_jax import model as model_lib
from grpo_jax.sampling.sampler import Sampler, SamplingConfig


def _median_time(fn, repeats):
    jax.block_until_ready(fn())  # compile / warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trace", default="")
    parser.add_argument("--pieces", default="rollout,reference,update,forward,grad")
    parser.add_argument("--threads", type=int, default=2, help="sampler threads")
    parser.add_argument("--no-share-prompt", dest="share_prompt", action="store_false",
                        help="every row runs its own copy of the prompt (grpo.share_prompt_prefix=False)")
    args = parser.parse_args()
    pieces = args.pieces.split(",")

    cfg = bench.w1_config("/tmp/unused")
    m = cfg.model
    mc = model_lib.ModelConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                               intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                               num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                               qkv_bias=True)
    graphdef, params = nnx.split(model_lib.init_model(mc, 0))
    ref = step_lib.frozen_copy(params, jnp.float32)
    n, g, p, c = cfg.grpo.prompts_per_step, cfg.grpo.num_generations, bench.W1_PROMPT_LEN, cfg.sampling.max_new_tokens
    b = n * g
    rng = np.random.default_rng(0)
    sampler = Sampler(graphdef, mc, eos_id=1, pad_id=0, threads=args.threads)
    sampling = SamplingConfig(max_new_tokens=c, temperature=1.0, ignore_eos=True)
    prompts = [rng.integers(2, 448, 29).tolist() for _ in range(n)]
    # G answers per prompt: rows of a group share their first P tokens (as in training).
    prompt_tokens = np.repeat(rng.integers(2, 1024, (n, p)), g, axis=0)
    tokens = jnp.asarray(np.concatenate([prompt_tokens, rng.integers(2, 1024, (b, c))], 1), jnp.int32)
    attention = jnp.asarray(np.concatenate([np.zeros((b, 3)), np.ones((b, p + c - 3))], 1), jnp.int32)
    # FLOPs as run: each prompt once per group unless --no-share-prompt.
    flops = bench.grpo_step_flops(mc, num_prompts=n, group=g, prompt_len=p, new_tokens=c,
                                  shared_prompt=args.share_prompt)
    tx, _ = optim.make_optimizer(cfg.optim, 100)
    opt_state = tx.init(params)
    group = g if args.share_prompt else 1
    update_fn = step_lib.make_update_fn(graphdef, tx, cfg.grpo, 1.0, group_size=group)
    logprob_fn = step_lib.make_logprob_fn(graphdef, 1.0, group_size=group)
    old = jnp.asarray(rng.normal(-7, 0.1, (b, c)), jnp.float32)
    batch = step_lib.UpdateBatch(tokens=tokens[None], attention=attention[None],
                                 completion_mask=jnp.ones((1, b, c), jnp.int32),
                                 advantages=jnp.asarray(rng.normal(size=(1, b)), jnp.float32),
                                 old_logp=old[None], sampler_logp=old[None], ref_logp=old[None])
    # A copy: the update donates its params, and the other pieces keep using `params`.
    state = {"params": jax.tree.map(jnp.copy, params), "opt": opt_state}

    def update():
        # The update donates params/opt_state: keep feeding it its own outputs.
        state["params"], state["opt"], metrics = update_fn(state["params"], state["opt"], batch)
        return metrics

    def loss(prm):
        lp = model_lib.token_logprobs(graphdef, prm, tokens, attention, num_targets=c, group_size=group)
        return jnp.sum(lp)

    forward = jax.jit(loss)
    grad = jax.jit(jax.grad(loss))
    fns = {
        "rollout": (lambda: sampler(params, prompts, num_samples=g, sampling=sampling,
                                    rng=jax.random.key(0)).tokens_BxC, flops.rollout),
        "reference": (lambda: logprob_fn(ref, tokens, attention, num_targets=c), flops.reference),
        "update": (update, flops.policy),
        "forward": (lambda: forward(ref), flops.reference),
        "grad": (lambda: grad(ref), flops.policy),
    }
    for name in pieces:
        fn, fl = fns[name]
        t = _median_time(fn, args.repeats)
        print(f"{name:10s} {t * 1e3:8.1f} ms  {fl / 1e9:6.1f} GFLOP  {fl / t / 1e9:6.1f} GFLOP/s", flush=True)
    if args.trace:
        with jax.profiler.trace(args.trace, create_perfetto_trace=True):
            for name in pieces:
                jax.block_until_ready(fns[name][0]())
        print(f"trace written to {args.trace}")


if __name__ == "__main__":
    main()
