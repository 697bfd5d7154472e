"""Reward functions written for TRL's GRPOTrainer; grpo_jax calls them the same way (unchanged).

The prompts are messages, so each completion is [{"role": "assistant", "content": text}].
"""

import re


def correct(completions, answer, **kwargs):
    """1.0 when the last number in the reply is the data set's `answer` column."""
    out = []
    for completion, gold in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        out.append(1.0 if numbers and numbers[-1] == gold else 0.0)
    return out


def brevity(completions, completion_ids, **kwargs):
    """Shorter is better: minus the share of a 32-token budget used (TRL's completion_ids)."""
    return [-min(len(ids), 32) / 32 for ids in completion_ids]
