"""The R1 format reward (seed Part 3): `<think>`, `</think>`, `<answer>`, `</answer>` on their own lines.

Stricter than the seed's regex in two ways that close hacks: each tag must occur exactly once
(a lazy `.*?` lets a second `<answer>` block hide inside the first), and the reasoning must not be
empty (`<think></think>` is the "no reasoning" hack of seed Part 2).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_R1_RE = re.compile(r"<think>\n(?P<think>.*?)\n</think>\n<answer>\n(?P<answer>.*?)\n</answer>", re.DOTALL)


def format_reward(completion: str) -> float:
    """1.0 when `completion` (stripped) is exactly the R1 template with non-empty parts, else 0.0.

    The template, each tag alone on its line:
        <think>\\n...reasoning...\\n</think>\\n<answer>\\n...answer...\\n</answer>
    """
    if not isinstance(completion, str):
        return 0.0
    text = completion.strip()
    if any(text.count(tag) != 1 for tag in _TAGS):
        return 0.0
    m = _R1_RE.fullmatch(text)
    if m is None or not m.group("think").strip() or not m.group("answer").strip():
        return 0.0
    return 1.0


def format_reward_fn(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
    """RewardFn: `format_reward` for each completion (prompts and fields are not needed)."""
    return [format_reward(c) for c in completions]
