"""Completions verified per second: `python benchmarks/bench_verifier.py [--n 20000] [--workers 2]`.

Typical arithmetic completions (an R1-formatted answer with one boxed integer, decimal or fraction,
half right) go through `math_accuracy_reward`: fast path inline, the symbolic remainder to a pool.
MATH-style completions are MATH-500's real answers (grpo_jax/assets/data/math500_test.jsonl): each
problem's gold answer boxed (right) and the next problem's gold answer boxed (wrong), 1,000
verifications of intervals, matrices, sets, equations, words and surds, with sympy's cache cleared
(and the verifier's normalisation cache) before each cold run so that repeats do not flatter it.
The lenient location (evaluation's, issue 25) reads MATH-500's worked solutions as completions:
each solution against its own answer (right) and against the next problem's (wrong), so the answer
is found in real prose, displayed maths and boxes.
Targets: >= 1,000 typical completions per second (issue 4), >= 5,000 MATH-style verifications
per second (issue "Real checkpoints, tokenizers and data", part 4) and >= 10,000 on one core
(issue 25), on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import sympy.core.cache

from grpo_jax.rewards import VerifierPool, math_accuracy_reward, math_accuracy_reward_fn, normalize_answer
from grpo_jax.rewards.math_read import read_answer

MATH500 = pathlib.Path(__file__).resolve().parent.parent / "grpo_jax" / "assets" / "data" / "math500_test.jsonl"


def typical_batch(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    completions, answers = [], []
    for _ in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        kind = rng.randrange(3)
        truth = {0: str(a + b), 1: f"{a / 8:.3f}", 2: f"{a}/{b}"}[kind]
        guess = truth if rng.random() < 0.5 else str(a + b + 1)
        if kind == 2 and rng.random() < 0.5:
            guess = f"\\frac{{{a}}}{{{b}}}"
        completions.append(f"<think>\nI add {a} and {b} step by step.\n</think>\n<answer>\n\\boxed{{{guess}}}\n</answer>")
        answers.append(truth)
    return completions, answers


def symbolic_batch(n: int) -> tuple[list[str], list[str]]:
    comps = [f"\\boxed{{\\frac{{\\sqrt{{{2 * k * k}}}}}{{2}}}}" for k in range(1, n + 1)]
    return comps, [f"\\frac{{{k}}}{{\\sqrt{{2}}}}" for k in range(1, n + 1)]


def math500_batch(path: pathlib.Path = MATH500) -> tuple[list[str], list[str]]:
    """Each gold answer boxed against itself, then the next problem's gold answer against it."""
    gold = [json.loads(line)["answer"] for line in path.read_text().splitlines()]
    wrong = gold[1:] + gold[:1]
    return [f"\\boxed{{{a}}}" for a in gold + wrong], gold + gold


def math500_solutions_batch(path: pathlib.Path = MATH500) -> tuple[list[str], list[str]]:
    """Each worked solution against its own answer, then against the next problem's answer."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    gold = [r["answer"] for r in rows]
    return [r["solution"] for r in rows] * 2, gold + gold[1:] + gold[:1]


def rate(completions, answers, pool, *, cold: bool = False, reward=math_accuracy_reward) -> float:
    prompts = [""] * len(completions)
    if cold:
        sympy.core.cache.clear_cache()
        normalize_answer.cache_clear()
        read_answer.cache_clear()
    start = time.perf_counter()
    reward(prompts, completions, answer=answers, pool=pool)
    return len(completions) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--n_symbolic", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    completions, answers = typical_batch(args.n)
    print(f"typical, inline (no pool):   {rate(completions, answers, None, cold=True):10.0f} completions/s")
    mc, ma = math500_batch()
    print(f"MATH-500, inline, cold:      {rate(mc, ma, None, cold=True):10.0f} verifications/s")
    print(f"MATH-500, inline, warm:      {rate(mc, ma, None):10.0f} verifications/s")
    sc, sa = math500_solutions_batch()
    lenient = math_accuracy_reward_fn(location="lenient")
    print(f"MATH-500 solutions, lenient: {rate(sc, sa, None, cold=True, reward=lenient):10.0f} verifications/s (cold)")
    t0 = time.perf_counter()
    with VerifierPool(num_workers=args.workers, timeout_s=2.0) as pool:
        pool.map(abs, [(1,)] * args.workers)  # wait for the workers to import
        print(f"pool start-up:               {time.perf_counter() - t0:10.2f} s")
        print(f"typical, with pool:          {rate(completions, answers, pool):10.0f} completions/s")
        print(f"MATH-500, pool x{args.workers}:          {rate(mc, ma, pool):10.0f} verifications/s")
        sc, sa = symbolic_batch(args.n_symbolic)
        print(f"symbolic (sympy), inline:    {rate(sc, sa, None):10.0f} completions/s")
        print(f"symbolic (sympy), pool x{args.workers}:   {rate(sc, sa, pool):10.0f} completions/s")


if __name__ == "__main__":
    main()
