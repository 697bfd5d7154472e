"""Supervised warm-up on (prompt, answer) pairs.

GRPO learns only from groups whose answers disagree: a policy that never succeeds gets zero advantage
everywhere. A short SFT run gives it a foothold. For the demo it is deliberately cut short (stop once
greedy validation accuracy reaches `target_accuracy`), so GRPO has something left to do.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax.training import rollout
from grpo_jax.distributed import sharding
from grpo_jax.model import remat
from grpo_jax.distributed.processes import Processes
from grpo_jax.sampling.sampler import Sampler, SamplingConfig

# SFT examples come from their own index range of the task's training stream, so the warm-up and the
# validation never draw the same indices as each other, and never touch the held-out split.
_SFT_OFFSET = 1 << 40
_VALID_OFFSET = 1 << 41


def sft_batch(tokenizer, examples, *, max_answer_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt (left-padded) then answer + EOS (right-padded to `max_answer_tokens`).

    Returns tokens [B, P + C], attention [B, P + C] and the answer mask [B, C] (C = max_answer_tokens).
    """
    prompts = [rollout.encode_prompt(tokenizer, ex["prompt"]) for ex in examples]
    answers = [tokenizer.encode(ex["answer"]) + [tokenizer.eos_id] for ex in examples]
    too_long = [ex["answer"] for ex, a in zip(examples, answers) if len(a) > max_answer_tokens]
    if too_long:
        raise ValueError(
            f"SFT answer {too_long[0]!r} needs more than sampling.max_new_tokens="
            f"{max_answer_tokens} tokens (EOS included); raise sampling.max_new_tokens"
        )
    P = -(-max(len(p) for p in prompts) // 16) * 16  # bucketed, so prompt lengths don't recompile
    B, C = len(examples), max_answer_tokens
    tokens = np.full((B, P + C), tokenizer.pad_id, np.int32)
    attention = np.zeros((B, P + C), np.int32)
    answer_mask = np.zeros((B, C), np.int32)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        tokens[i, P - len(p) : P] = p
        attention[i, P - len(p) : P] = 1
        tokens[i, P : P + len(a)] = a
        attention[i, P : P + len(a)] = 1
        answer_mask[i, : len(a)] = 1
    return tokens, attention, answer_mask


def make_sft_step(graphdef, tx, compiler_options: dict | None = None):
    """Jitted `step(params, opt_state, tokens, attention, answer_mask) -> (params, opt_state, loss)`;
    `compiler_options` as `model.remat.backward_compiler_options` gives them."""

    def loss_fn(params, tokens, attention, answer_mask):
        logp = model_lib.token_logprobs(graphdef, params, tokens, attention, num_targets=answer_mask.shape[1])
        mask = answer_mask.astype(jnp.float32)
        return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1), compiler_options=compiler_options)
    def step(params, opt_state, tokens, attention, answer_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, attention, answer_mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def greedy_accuracy(sampler: Sampler, params, tokenizer, task, examples, *, max_new_tokens: int,
                    processes: Processes | None = None) -> float:
    """Fraction of `examples` whose greedy answer passes the task's checker.

    On a mesh the sampler splits rows over data x fsdp, so the batch is padded with repeats of the
    last example to a multiple of that (the repeats are not counted). Several processes: each
    answers its slice and the hits are summed over processes."""
    processes = processes or Processes()
    mesh = getattr(sampler, "mesh", None)
    multiple = sharding.batch_size_multiple(mesh) if mesh is not None else 1
    padded = list(examples) + [examples[-1]] * (-len(examples) % multiple)
    local = processes.prompt_slice(len(padded))
    out = sampler(
        params,
        [rollout.encode_prompt(tokenizer, ex["prompt"]) for ex in padded[local]],
        num_samples=1,
        sampling=SamplingConfig(max_new_tokens=max_new_tokens, greedy=True),
        rng=jax.random.PRNGKey(0),
    )
    tokens = sharding.process_rows(out.tokens_BxC)
    lengths = sharding.process_rows(out.mask_BxC).sum(1)
    truncated = sharding.process_rows(out.truncated_B).astype(bool)
    hits = np.zeros(len(examples), np.int32)
    for row, i in enumerate(range(local.start, min(local.stop, len(examples)))):
        ok = not truncated[row] and task.eval_correct(tokenizer.decode(tokens[row, : lengths[row]]), examples[i])
        hits[i] = int(bool(ok))
    return float(np.mean(processes.sum(hits)))


def warm_up(
    graphdef,
    params,
    sampler: Sampler,
    tokenizer,
    task,
    sft: config_lib.SFTSection,
    *,
    max_new_tokens: int,
    seed: int,
    log_fn: Callable[[str], None] = print,
    mesh=None,
    should_stop: Callable[[], bool] = lambda: False,
    processes: Processes | None = None,
):
    """Runs up to `sft.steps` AdamW steps of answer-token cross-entropy; returns (params, stats).

    With `mesh`, each batch's rows are split over the batch axes ("data", "fsdp", "expert") like the GRPO update's (a batch
    that does not divide is replicated on one process). Several processes (`processes`) draw the
    same batches and each feeds its devices' rows. `should_stop()` true on any process (SIGTERM,
    Ctrl-C) ends the warm-up after the current step on all of them; the stats then say "stopped"."""
    processes = processes or Processes(mesh)
    tx = optax.adamw(sft.learning_rate, b1=0.9, b2=0.99, weight_decay=0.0)
    opt_state = tx.init(params)
    step_fn = make_sft_step(graphdef, tx, remat.backward_compiler_options(sampler.config))
    rng = np.random.default_rng(seed)
    # A task may warm up on examples of its own (a tool task teaches calling and reading the tool, not
    # the answers the tool gives); by default the warm-up trains on the task's training stream.
    example = getattr(task, "warmup_example", None) or task.train_example
    valid = [example(_VALID_OFFSET + i) for i in range(sft.eval_size)]
    history = []
    t0 = time.perf_counter()
    acc = greedy_accuracy(sampler, params, tokenizer, task, valid, max_new_tokens=max_new_tokens,
                          processes=processes)
    history.append({"step": 0, "valid_greedy_accuracy": acc})
    log_fn(f"sft step 0: validation greedy accuracy {acc:.3f}")
    step = 0
    for step in range(1, sft.steps + 1):
        if processes.any(should_stop()):
            log_fn(f"sft: stopped before step {step}")
            return params, {"steps": step - 1, "seconds": time.perf_counter() - t0, "history": history,
                            "stopped": True}
        start = int(rng.integers(0, 1 << 30))
        batch = [example(_SFT_OFFSET + start + i) for i in range(sft.batch_size)]
        tokens, attention, answer_mask = sft_batch(tokenizer, batch, max_answer_tokens=max_new_tokens)
        if mesh is not None and len(batch) % sharding.batch_size_multiple(mesh) == 0:
            tokens, attention, answer_mask = processes.to_global((tokens, attention, answer_mask))
        params, opt_state, loss = step_fn(params, opt_state, tokens, attention, answer_mask)
        if step % sft.eval_every == 0 or step == sft.steps:
            acc = greedy_accuracy(sampler, params, tokenizer, task, valid, max_new_tokens=max_new_tokens,
                                  processes=processes)
            history.append({"step": step, "loss": float(loss), "valid_greedy_accuracy": acc})
            log_fn(f"sft step {step}: loss {float(loss):.4f}, validation greedy accuracy {acc:.3f}")
            if sft.target_accuracy and acc >= sft.target_accuracy:
                break
    return params, {"steps": step, "seconds": time.perf_counter() - t0, "history": history}
