"""One warning, once, when a setting is silently eating the training signal.

Each of these leaves a run that looks healthy in its logs while it learns little or nothing:
- `rewards.truncated_reward="at_most_zero"` zeroing rewards the functions gave (the completions hit
  `sampling.max_new_tokens` before their end; `rewards/<fn>/mean` > 0 but `reward` near 0);
- every completion of a step masked (`grpo.mask_truncated_completions` with all of them truncated):
  the step trains on no token (its row says `masked_step: 1`; the run's count is logged at the end);
- `optim.warmup_steps` at least the run's updates: the learning rate never reaches its setting;
- a learning rate below half a unit in the last place of a typical weight in the float32 masters:
  Adam moves each weight by about the learning rate per update, so the update rounds away (float32:
  below ~1.2e-9, a typo's size, e.g. 1e-10 for 1e-6; master weights are never bfloat16).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from grpo_jax import config as config_lib

log = logging.getLogger("grpo_jax")

# The share of a step's completions whose positive reward the truncation rule set to 0 that is worth
# a warning: below it the rule does what it is for (seed Part 2, defence 3) on a few runaway answers.
ZEROED_SHARE_WARN = 0.1
# A typical weight's magnitude in a transformer (the init std of GPT-2, Llama and Qwen; their
# trained matrices stay near it). Layer norms (~1) round away at 50x larger learning rates still.
TYPICAL_WEIGHT = 0.02
_EPS = {"float32": float(np.finfo(np.float32).eps), "bfloat16": 2.0**-7}  # bfloat16: 8 bits of mantissa


def startup_warnings(config: config_lib.Config, updates_per_step: int) -> list[str]:
    """The settings that waste the run before it starts (warm-up, learning rate), as messages."""
    o, t = config.optim, config.train
    out = []
    total_updates = t.steps * updates_per_step
    if o.warmup_steps and o.warmup_steps >= total_updates:
        reached = o.learning_rate * total_updates / o.warmup_steps
        out.append(
            f"optim.warmup_steps={o.warmup_steps} updates is not shorter than the run ({total_updates} updates: "
            f"train.steps={t.steps} x {updates_per_step} per step): the learning rate rises linearly and ends at "
            f"{reached:.3g}, never reaching optim.learning_rate={o.learning_rate:g}. Lower optim.warmup_steps "
            f"(e.g. to {max(1, total_updates // 10)}) or raise train.steps")
    half_ulp = 0.5 * TYPICAL_WEIGHT * _EPS["float32"]
    if 0 < o.learning_rate < half_ulp:
        out.append(
            f"optim.learning_rate={o.learning_rate:g} is below half a unit in the last place of a typical weight "
            f"(|w| ~ {TYPICAL_WEIGHT}) in the float32 master weights ({half_ulp:.2g}): Adam moves "
            "a weight by about the learning rate per update, so most updates round away. Raise "
            "optim.learning_rate (GRPO on LLMs uses 1e-6 to 1e-5; LoRA about 10x more)")
    return out


class SignalWatch:
    """Reads every step's row; logs each kind of warning once (at WARNING) and counts masked steps."""

    def __init__(self, config: config_lib.Config, updates_per_step: int):
        self.config = config
        self.masked_steps = 0
        self.warned: set[str] = set()
        for message in startup_warnings(config, updates_per_step):
            log.warning(message)

    def _once(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            log.warning(message)

    def update(self, step: int, row: Mapping[str, float]) -> None:
        zeroed = row.get("completions/truncated_reward_zeroed", 0.0)
        if zeroed >= ZEROED_SHARE_WARN:
            self._once("truncated_reward", (
                f"step {step}: rewards.truncated_reward='at_most_zero' set {zeroed:.0%} of the completions' rewards to 0 "
                f"where the reward functions gave more (completions/clipped_ratio={row.get('completions/clipped_ratio', 0):.2f}, "
                f"reward={row.get('reward', float('nan')):.3g}): they ran into sampling.max_new_tokens="
                f"{self.config.sampling.max_new_tokens} before their end. Raise sampling.max_new_tokens, or set "
                "rewards.truncated_reward='as_scored' to keep the functions' values"))
        if row.get("masked_step"):
            self.masked_steps += 1
            self._once("masked_step", (
                f"step {step}: every completion was masked (grpo.mask_truncated_completions=True and all "
                f"{self.config.grpo.num_generations * self.config.grpo.prompts_per_step} ran into "
                f"sampling.max_new_tokens={self.config.sampling.max_new_tokens}): nothing trained this step; its "
                "per-token metrics are left out (masked_step=1). Raise sampling.max_new_tokens"))

    def close(self) -> None:
        if self.masked_steps:
            log.warning("%d step(s) had every completion masked and trained on no token (rows with masked_step=1)",
                        self.masked_steps)
