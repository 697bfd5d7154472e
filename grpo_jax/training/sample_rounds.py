"""One step's rows from several sampling rounds (DAPO dynamic sampling tops a batch up with more
rounds): which groups are kept, and the rounds' per-row arrays joined into one batch."""

from __future__ import annotations

import numpy as np

ROW_ARRAYS = ("prompt_tokens", "prompt_mask", "tokens", "mask", "tool_mask", "logprobs")
# Routing replay's per-row array, [B, P + C, L_sparse, K] int16 (`rollout.token_major_experts`).
EXPERTS = "experts"


def row_names(arrays: dict) -> tuple[str, ...]:
    """The per-row arrays a rollout carries: `ROW_ARRAYS`, and the experts when it recorded them."""
    return ROW_ARRAYS + ((EXPERTS,) if EXPERTS in arrays else ())


def select_groups(rewards: np.ndarray, group_size: int, num_groups: int, dynamic: bool) -> tuple[list[int], int]:
    """(indices of the kept groups, number of informative groups) among the groups of `rewards`.

    DAPO dynamic sampling keeps groups whose rewards differ, first come first kept, and fills the
    rest with zero-variance groups (zero advantage) so the batch shape never changes. Without it,
    the first `num_groups` groups in order."""
    keep, spare = [], []
    for group in range(len(rewards) // group_size):
        values = rewards[group * group_size : (group + 1) * group_size]
        finite = values[np.isfinite(values)]
        informative = finite.size > 1 and np.ptp(finite) > 0
        (keep if (informative or not dynamic) else spare).append(group)
    return (keep + spare)[:num_groups], len(keep)


def join_rows(rounds_arrays: list[dict[str, np.ndarray]], row_index: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    """The rows `row_index` of the rounds' arrays concatenated in order, prompts of rounds of
    different widths left-padded to the widest (with `pad_id`, mask 0), and the experts' prompt
    slots with them (expert 0 on padding)."""
    width = max(a["prompt_tokens"].shape[1] for a in rounds_arrays)
    pad = {"prompt_tokens": pad_id, "prompt_mask": 0}

    def padded(name, arrays):
        a = arrays[name]
        if name == EXPERTS:  # prompt slots first: left-padded as the prompt is
            return _pad_left(a, a.shape[1] + width - arrays["prompt_tokens"].shape[1], 0)
        return _pad_left(a, width, pad[name]) if name in pad else a

    return {name: np.concatenate([padded(name, a) for a in rounds_arrays])[row_index]
            for name in row_names(rounds_arrays[0])}


def _pad_left(x: np.ndarray, width: int, value) -> np.ndarray:
    """`x` [B, W, ...] with columns of `value` put before its first, to `width` columns."""
    if x.shape[1] == width:
        return x
    return np.concatenate([np.full((x.shape[0], width - x.shape[1]) + x.shape[2:], value, x.dtype), x], axis=1)
