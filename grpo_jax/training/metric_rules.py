"""Two rules every logged step row obeys, applied on the host to the finished row.

1. A step whose completions are all masked (every one truncated under
   `grpo.mask_truncated_completions`, or every group dropped) trained on no token: its per-token
   metrics (entropy, kl, ratio/*, clip_ratio/*, sampling/*) and its loss and grad_norm (exactly 0,
   since nothing was differentiated) describe nothing. They are left out of the row, never written
   as 0, so plots, TensorBoard and the diagnostics' windows skip the step; the row says
   `masked_step: 1` instead.
2. A mean lies within its min and max. A token mean weighted in float64 can land one ulp outside
   (values all 1.7489662 over 5 and 20 tokens average to 1.7489662170410158 > the max
   ...156), which reads as a bug in a plot's band; it is clamped into [min, max].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# The update's metrics that do not depend on tokens: a count of updates not applied.
_TOKEN_FREE = ("skipped_updates",)


def unmasked_tokens(update_metrics: Sequence[Mapping[str, float]]) -> float:
    """Completion tokens the step's updates trained on, summed over updates (`num_tokens` each)."""
    return float(sum(float(m.get("num_tokens", 0.0)) for m in update_metrics))


def without_masked_step_metrics(row: dict[str, float], update_metrics: Sequence[Mapping[str, float]]
                                ) -> dict[str, float]:
    """`row` unchanged when the step trained on at least one token; else without every metric that
    came from the updates (but `skipped_updates`), with `masked_step: 1.0`."""
    if not update_metrics or unmasked_tokens(update_metrics) > 0:
        return row
    from_updates = {name for m in update_metrics for name in m} | {"grad_norm/max"}
    out = {k: v for k, v in row.items() if k not in from_updates or k in _TOKEN_FREE}
    out["masked_step"] = 1.0
    return out


def means_within_bounds(row: dict[str, float]) -> dict[str, float]:
    """`row` with every "X/mean" (and "grad_norm", the mean of "grad_norm/max"'s values) clamped into
    ["X/min", "X/max"] where both bounds are logged."""
    out = dict(row)
    pairs = [(k, k[: -len("/mean")]) for k in row if k.endswith("/mean")]
    pairs.append(("grad_norm", "grad_norm"))
    for mean_key, stem in pairs:
        lo, hi = row.get(f"{stem}/min"), row.get(f"{stem}/max")
        if mean_key not in row or (lo is None and hi is None):
            continue
        value = row[mean_key]
        if hi is not None and value > hi:
            value = hi
        if lo is not None and value < lo:
            value = lo
        out[mean_key] = value
    return out
