"""Held-out evaluation metrics: pass@1, the unbiased pass@k, and maj@k (seed, Part 1).

`pass_at_1` and `pass_at_k` are pure jnp (jit/vmap friendly, k static). `maj_at_k` works on the
host: it takes Python answers and a correctness function (a verifier).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _check_counts(n: Any, c: Any, k: int | None) -> None:
    """Validate concrete counts; traced ones are checked by the NaN in `pass_at_k`."""
    if isinstance(n, jax.core.Tracer) or isinstance(c, jax.core.Tracer):
        return
    n_arr, c_arr = np.asarray(n), np.asarray(c)
    if np.any(n_arr < 1):
        raise ValueError(f"n (samples per question) must be >= 1, got {n!r}")
    if np.any(c_arr < 0) or np.any(c_arr > n_arr):
        raise ValueError(f"c (correct samples) must be in [0, n], got c={c!r} with n={n!r}")
    if k is not None and np.any(n_arr < k):
        raise ValueError(f"pass@k needs n >= k samples per question, got n={n!r}, k={k}")


def pass_at_1(n: jax.Array | int, c: jax.Array | int) -> jax.Array:
    """pass@1 per question: c / n, the fraction of correct samples.

    Args:
      n: [...] samples per question.
      c: [...] correct samples per question.

    Returns:
      float32 [...]; the dataset's pass@1 is its mean (seed: n=8, c=2 gives 0.25).
    """
    _check_counts(n, c, None)
    return jnp.asarray(c, jnp.float32) / jnp.asarray(n, jnp.float32)


def pass_at_k(n: jax.Array | int, c: jax.Array | int, k: int) -> jax.Array:
    """Unbiased pass@k per question: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021).

    The binomial ratio is computed as prod_{j<k} (n - c - j) / (n - j): k factors in [0, 1], so
    nothing overflows for large n (C(1000, 500) does not fit any float) and the product is exactly
    0 once n - c < k (then some correct sample is always among the k).

    Args:
      n: [...] int, samples per question (>= k).
      c: [...] int, correct samples per question (0 <= c <= n).
      k: static Python int >= 1.

    Returns:
      float32 [...] in [0, 1]; NaN where n < k (only reachable under jit, where the inputs
      cannot be checked); the dataset's pass@k is the mean. Seed: n=8, c=2, k=4 gives 0.786.
    """
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive Python int, got {k!r}")
    _check_counts(n, c, k)
    n_f = jnp.asarray(n, jnp.float32)
    c_f = jnp.asarray(c, jnp.float32)
    j = jnp.arange(k, dtype=jnp.float32).reshape((k,) + (1,) * jnp.ndim(n_f + c_f))
    factors = jnp.clip((n_f - c_f - j) / jnp.maximum(n_f - j, 1.0), 0.0, 1.0)
    all_wrong = jnp.prod(factors, axis=0)
    return jnp.where(n_f >= k, 1.0 - all_wrong, jnp.nan)


def majority_answer(
    answers: Sequence[Any], key: Callable[[Any], Hashable] | None = None
) -> Any | None:
    """The most common answer, ignoring None (no extractable answer).

    Answers are grouped by `key(answer)` (default: the answer itself), so a canonicalising key
    (e.g. stripping spaces) can merge "1/3" and " 1/3". Ties go to the answer seen first, which
    keeps the result deterministic. Returns the first answer of the winning group, or None when
    there is no answer at all.
    """
    key = key or (lambda a: a)
    keyed = [(key(a), a) for a in answers if a is not None]
    if not keyed:
        return None
    counts = Counter(k for k, _ in keyed)
    best = max(counts.values())
    for k, a in keyed:  # first-seen order breaks ties
        if counts[k] == best:
            return a
    raise AssertionError("unreachable: some key has the maximal count")


def maj_at_k(
    answers: Sequence[Any],
    is_correct: Callable[[Any], bool],
    k: int | None = None,
    *,
    key: Callable[[Any], Hashable] | None = None,
) -> float:
    """maj@k of one question: take the first k answers, vote, check the winner (seed, Part 1).

    Args:
      answers: extracted final answers of the samples for one question, in sampling order; None
        for a sample with no extractable answer (it gets no vote).
      is_correct: verifier for one answer, e.g. `lambda a: verify(a, ground_truth)`.
      k: how many samples vote (default: all); must be 1 <= k <= len(answers).
      key: optional canonicalisation used to group equal answers (see `majority_answer`).

    Returns:
      1.0 if the majority answer is correct, else 0.0 (also 0.0 when no sample has an answer).
    """
    k = len(answers) if k is None else k
    if not 1 <= k <= len(answers):
        raise ValueError(f"k must be in [1, len(answers)={len(answers)}], got {k!r}")
    winner = majority_answer(answers[:k], key)
    return float(winner is not None and bool(is_correct(winner)))
