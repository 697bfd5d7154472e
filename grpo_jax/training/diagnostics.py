"""Warnings from the seed's diagnosis cheat sheet (Part 1), raised from the metrics the trainer logs.

| what you see                               | likely cause                  | what to try                                   |
|--------------------------------------------|-------------------------------|-----------------------------------------------|
| training reward up, held-out flat or down  | reward hacking or overfitting | read samples, tighten the verifier            |
| reward flat, zero-variance fraction high   | data too easy or too hard     | filter by difficulty                          |
| entropy -> 0 (zero-variance up, pass@k down)| entropy collapse             | raise temperature, lower LR, asymmetric clip  |
| KL spikes suddenly                         | new behaviour, maybe a hack   | read samples from that step                   |
| length up, accuracy flat, truncation up    | rambling or loops             | length penalty, length-bias fix, check verifier|
| clip fraction high, reward unstable        | updates too big               | lower LR, fewer epochs per batch              |
| reward NaN (or one rewards/<name>/mean NaN)| a reward never applies (None) | check its field names and the answer format   |
| every advantage 0, rewards unequal         | rewards overflow float32 stats| scale the rewards to about [-10, 10]          |

The last two rows are ours, not the seed's: a reward function that returns None for every completion
gives zero advantages, so GRPO trains on nothing, silently; so does a reward of 1e30 (the group's
float32 std overflows to inf).

Each warning fires once per episode: when its condition starts to hold. It can fire again only
after the condition has been clear for ``rearm_steps`` consecutive checks, so a noisy signal
hovering at a threshold does not repeat the same warning every step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping

import numpy as np

log = logging.getLogger(__name__)

_PASS_AT_K = re.compile(r"^eval/pass@(\d+)$")
_REWARD_PART = re.compile(r"^rewards/(.+)/mean$")


@dataclasses.dataclass(frozen=True)
class DiagnosticsThresholds:
    """Thresholds of the warnings; every window is counted in logged steps (calls to ``update``).

    window: steps in each moving average; also the history needed before judging a trend.
    rearm_steps: consecutive clear checks before a warning that fired can fire again.
    entropy_collapse_ratio: entropy (window mean) below this fraction of its starting level
      (mean of the first ``window`` values) is a collapse.
    kl_spike_factor: KL above this multiple of the median of the previous ``window`` values ...
    kl_spike_min: ... and above this absolute value (nats/token; early KL is ~0, so ratios alone
      would flag noise) is a spike.
    hack_reward_rise: training reward (window mean) rising at least this much across the last
      ``hack_evals`` held-out evaluations ...
    hack_eval_gain: ... while held-out accuracy gains at most this much, suggests a hack.
    hack_evals: held-out evaluations compared (first vs last).
    zero_std_max: zero-variance fraction (window mean) at or above this is high; seed Part 1:
      0.43 of groups are wasted at p = 0.9 or 0.1 with G = 8.
    reward_flat_tol: reward window mean moving less than this from the previous window is flat.
    truncation_max: truncated fraction (window mean) at or above this ...
    truncation_rise: ... and at least this much above its starting level is rising truncation.
    clip_max: clip fraction (window mean) at or above this is high ...
    reward_jitter: ... when the mean absolute step-to-step reward change is at least this.
    no_reward_steps: ``reward`` NaN (no reward function applied to any completion), or one
      function's ``rewards/<name>/mean`` NaN (it returned None for all), this many logged steps in
      a row is a reward that never applies.
    """

    window: int = 10
    rearm_steps: int = 10
    entropy_collapse_ratio: float = 0.25
    kl_spike_factor: float = 5.0
    kl_spike_min: float = 0.01
    hack_reward_rise: float = 0.1
    hack_eval_gain: float = 0.02
    hack_evals: int = 3
    zero_std_max: float = 0.5
    reward_flat_tol: float = 0.05
    truncation_max: float = 0.1
    truncation_rise: float = 0.05
    clip_max: float = 0.1
    reward_jitter: float = 0.1
    no_reward_steps: int = 5

    def __post_init__(self):
        for name in ("window", "rearm_steps", "hack_evals", "no_reward_steps"):
            least = 2 if name in ("window", "hack_evals") else 1
            if getattr(self, name) < least:
                raise ValueError(f"Diagnostics {name} must be >= {least}, got {getattr(self, name)}")


@dataclasses.dataclass
class _Episode:
    active: bool = False
    clear_count: int = 0


class Diagnostics:
    """Feed it every logged metrics dict; it returns (and logs at WARNING) the warnings that start.

    >>> diag = Diagnostics(kl_spike_factor=10.0)
    >>> for step, metrics in enumerate(stream):      # doctest: +SKIP
    ...     for message in diag.update(step, metrics):
    ...         print(message)
    """

    def __init__(self, **thresholds: float):
        allowed = {f.name for f in dataclasses.fields(DiagnosticsThresholds)}
        unknown = sorted(set(thresholds) - allowed)
        if unknown:
            raise TypeError(f"unknown Diagnostics threshold(s) {unknown}; allowed: {sorted(allowed)}")
        self.t = DiagnosticsThresholds(**thresholds)
        self._history: dict[str, list[float]] = {}  # metric -> values in update order (train steps)
        self._evals: list[tuple[int, float, float]] = []  # (step, eval accuracy, train reward mean)
        self._episodes: dict[str, _Episode] = {}
        self._nan_run: dict[str, int] = {}  # metric -> consecutive NaN values up to now (the history skips NaN)

    # -- history helpers ----------------------------------------------------------------------

    def _values(self, name: str) -> list[float]:
        return self._history.get(name, [])

    def _recent_mean(self, name: str, offset: int = 0) -> float | None:
        """Mean of the ``window`` values ending ``offset`` values before the newest; None if too few."""
        values = self._values(name)
        w = self.t.window
        end = len(values) - offset
        if end < w:
            return None
        return float(np.mean(values[end - w:end]))

    def _start_mean(self, name: str) -> float | None:
        values = self._values(name)
        return float(np.mean(values[: self.t.window])) if len(values) >= 2 * self.t.window else None

    def _clip_fraction(self, metrics: Mapping[str, float]) -> float | None:
        if "clip_ratio/region_mean" in metrics:
            return metrics["clip_ratio/region_mean"]
        if "clip_ratio/low_mean" in metrics or "clip_ratio/high_mean" in metrics:
            return metrics.get("clip_ratio/low_mean", 0.0) + metrics.get("clip_ratio/high_mean", 0.0)
        return None

    # -- the checks: each returns (holds: bool | None, message); None = no information this step --

    def _entropy_collapse(self, step: int):
        start, now = self._start_mean("entropy"), self._recent_mean("entropy")
        if start is None or now is None or start <= 0:
            return None, ""
        holds = now < self.t.entropy_collapse_ratio * start
        evidence = [f"entropy fell from {start:.3g} to {now:.3g} (< {self.t.entropy_collapse_ratio:.0%} of its start)"]
        z0, z1 = self._start_mean("frac_reward_zero_std"), self._recent_mean("frac_reward_zero_std")
        if z0 is not None and z1 is not None:
            evidence.append(f"zero-variance fraction {z0:.2f} -> {z1:.2f}")
        for name in sorted(self._history, key=lambda n: int(_PASS_AT_K.match(n).group(1)) if _PASS_AT_K.match(n) else 0):
            m = _PASS_AT_K.match(name)
            if m and int(m.group(1)) > 1 and len(self._values(name)) >= 2:
                evidence.append(f"{name} {self._values(name)[0]:.3f} -> {self._values(name)[-1]:.3f}")
        return holds, _message(
            step, "entropy_collapse", "; ".join(evidence),
            cause="entropy collapse: the policy stopped exploring, so groups agree and pass@k stops improving",
            fix="raise the sampling temperature, lower the learning rate, use asymmetric clipping "
                "(a larger upper epsilon, 'clip-higher')",
        )

    def _kl_spike(self, step: int):
        values = self._values("kl")
        w = self.t.window
        if len(values) < w + 1:
            return None, ""
        kl, baseline = values[-1], float(np.median(values[-w - 1:-1]))
        holds = kl > self.t.kl_spike_min and kl > self.t.kl_spike_factor * baseline
        return holds, _message(
            step, "kl_spike",
            f"KL {kl:.4g} is {kl / max(baseline, 1e-12):.1f}x the median {baseline:.3g} of the previous {w} steps",
            cause="new behaviour, maybe a reward hack",
            fix=f"read the samples from step {step} (samples.jsonl), the highest-reward ones first",
        )

    def _reward_up_eval_flat(self, step: int, metrics: Mapping[str, float]):
        eval_name = next((n for n in ("eval/pass@1", "eval/greedy_accuracy") if n in metrics), None)
        reward_mean = self._recent_mean("reward")
        if eval_name is None or reward_mean is None:
            return None, ""
        self._evals.append((step, float(metrics[eval_name]), reward_mean))
        if len(self._evals) < self.t.hack_evals:
            return None, ""
        (s0, acc0, r0), (_, acc1, r1) = self._evals[-self.t.hack_evals], self._evals[-1]
        holds = r1 - r0 >= self.t.hack_reward_rise and acc1 - acc0 <= self.t.hack_eval_gain
        return holds, _message(
            step, "reward_up_heldout_flat",
            f"since step {s0} training reward rose {r0:.3f} -> {r1:.3f} while {eval_name} went {acc0:.3f} -> {acc1:.3f}",
            cause="reward hacking or overfitting: the model pleases the training verifier without solving more",
            fix="read the highest-reward samples, tighten the verifier, check it against an independent one",
        )

    def _zero_variance(self, step: int):
        z, r_now, r_before = (self._recent_mean("frac_reward_zero_std"), self._recent_mean("reward"),
                              self._recent_mean("reward", offset=self.t.window))
        if z is None or r_now is None or r_before is None:
            return None, ""
        holds = z >= self.t.zero_std_max and abs(r_now - r_before) < self.t.reward_flat_tol
        which = "too easy" if r_now >= 0.5 else "too hard"
        return holds, _message(
            step, "high_zero_variance",
            f"{z:.0%} of groups have identical rewards (no gradient) and reward is flat at {r_now:.3f}",
            cause=f"data too easy or too hard for the current policy (with a 0/1 reward, mean {r_now:.2f} "
                  f"suggests {which})",
            fix="filter prompts by difficulty (keep those solved sometimes, not always or never), "
                "or resample zero-variance groups",
        )

    def _truncation(self, step: int):
        start, now = self._start_mean("completions/clipped_ratio"), self._recent_mean("completions/clipped_ratio")
        if start is None or now is None:
            return None, ""
        holds = now >= self.t.truncation_max and now - start >= self.t.truncation_rise
        evidence = [f"truncated fraction rose {start:.2f} -> {now:.2f}"]
        l0, l1 = self._start_mean("completions/mean_length"), self._recent_mean("completions/mean_length")
        if l0 is not None and l1 is not None:
            evidence.append(f"mean length {l0:.0f} -> {l1:.0f} tokens")
        return holds, _message(
            step, "truncation_rising", "; ".join(evidence),
            cause="rambling or loops (truncated answers have no final answer)",
            fix="add a length penalty (soft overlong), use the length-bias fix (Dr. GRPO constant "
                "normaliser), check the verifier",
        )

    def _clip_unstable(self, step: int):
        clip, rewards = self._recent_mean("clip_fraction"), self._values("reward")
        if clip is None or len(rewards) < self.t.window + 1:
            return None, ""
        jitter = float(np.mean(np.abs(np.diff(rewards[-self.t.window - 1:]))))
        holds = clip >= self.t.clip_max and jitter >= self.t.reward_jitter
        return holds, _message(
            step, "clip_high_reward_unstable",
            f"clip fraction {clip:.2f} with reward jumping {jitter:.2f} per step on average",
            cause="updates too big",
            fix="lower the learning rate, fewer epochs (inner updates) per batch",
        )

    def _no_reward(self, step: int, metrics: Mapping[str, float]):
        run, k = self._nan_run.get("reward", 0), self.t.no_reward_steps
        names = sorted(m.group(1) for m in map(_REWARD_PART.match, metrics) if m)
        which = f" ({', '.join(repr(n) for n in names)})" if names else ""
        return run >= k, _message(
            step, "no_reward",
            f"reward is NaN for {run} steps in a row: every reward function{which} returned None for every "
            "completion, so every advantage is 0 and nothing is learned",
            cause="the reward functions never apply to this data: an example field they read is missing or "
                  "named differently, or the completions never match the format they parse",
            fix="call the reward functions by hand on a few logged samples (samples.jsonl) with their example's "
                "fields; check the field names against the data's keys and what makes them return None",
        )

    def _reward_fn_never_applies(self, step: int, name: str):
        run, k = self._nan_run.get(f"rewards/{name}/mean", 0), self.t.no_reward_steps
        if self._nan_run.get("reward", 0) >= k:
            return False, ""  # no reward applies at all: that is the no_reward warning, which names them
        return run >= k, _message(
            step, "reward_fn_never_applies",
            f"rewards/{name}/mean is NaN for {run} steps in a row: reward function {name!r} returned None for "
            "every completion, so its weight does nothing",
            cause=f"{name!r} does not apply to this data: a field-name or format mismatch (the example field "
                  "it reads is missing or named differently, or no completion matches what it parses)",
            fix=f"call {name!r} by hand on a few logged samples (samples.jsonl) with their example's fields; "
                "check the field names it reads against the data's keys and what makes it return None",
        )

    def _advantages_vanished(self, step: int, metrics: Mapping[str, float]):
        """Every advantage 0 while some group's rewards differ: not the equal-rewards case (that is
        high_zero_variance's) but arithmetic: float32 group statistics of huge rewards overflow
        (|r| ~ 1e19 and up: the squares pass 3.4e38, the std is inf, every advantage (r - mean) / inf = 0)."""
        lo, hi = metrics.get("advantages/min"), metrics.get("advantages/max")
        zero_std = metrics.get("frac_reward_zero_std")
        if lo is None or hi is None or zero_std is None or math.isnan(zero_std):
            return None, ""
        holds = lo == 0.0 and hi == 0.0 and zero_std < 1.0
        reward = metrics.get("reward", float("nan"))
        return holds, _message(
            step, "advantages_all_zero",
            f"every advantage is 0 although {1 - zero_std:.0%} of groups have unequal rewards (mean reward "
            f"{reward:.3g}), so nothing is learned",
            cause="rewards too large for float32 group statistics (their squares overflow, the std is inf)",
            fix="scale the reward functions' outputs to about [-10, 10] (a weight, or the function itself)",
        )

    # -- the window, saved with the run state ---------------------------------------------------

    def state_dict(self) -> dict:
        """What the checks remember, as JSON: a resumed run given it (``load_state_dict``) warns at
        the same steps as a run that never stopped. Bounded: each metric keeps its first ``window``
        values (the starting level) and its last ``2 * window + 1`` (the longest look back, a
        window ``offset`` one window back; the KL and jitter checks read ``window + 1``); no check
        reads a history's length beyond ``2 * window``, so the cut changes no warning."""
        w = self.t.window
        keep = 3 * w + 1
        history = {k: v if len(v) <= keep else v[:w] + v[-(2 * w + 1):] for k, v in self._history.items()}
        return {
            "history": history,
            "evals": [list(e) for e in self._evals[-self.t.hack_evals:]],
            "episodes": {k: [e.active, e.clear_count] for k, e in self._episodes.items()},
            "nan_run": dict(self._nan_run),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restores what ``state_dict`` returned (a checkpoint's ``diagnostics`` meta field)."""
        self._history = {k: [float(x) for x in v] for k, v in state["history"].items()}
        self._evals = [(int(s), float(a), float(r)) for s, a, r in state["evals"]]
        self._episodes = {k: _Episode(bool(a), int(c)) for k, (a, c) in state["episodes"].items()}
        self._nan_run = {k: int(v) for k, v in state["nan_run"].items()}

    # -- public ----------------------------------------------------------------------------------

    def update(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Records one step's metrics; returns the warnings that start at this step (also logged)."""
        values = {k: float(v) for k, v in metrics.items()}
        clip = self._clip_fraction(values)
        if clip is not None:
            values["clip_fraction"] = clip
        no_reward = math.isnan(values.get("reward", 0.0))
        if no_reward:  # all-None groups count as zero-variance (1.0): no_reward's case, not difficulty's
            values.pop("frac_reward_zero_std", None)
        for name, v in values.items():
            if math.isfinite(v):
                self._history.setdefault(name, []).append(v)
            if name == "reward" or _REWARD_PART.match(name):
                self._nan_run[name] = self._nan_run.get(name, 0) + 1 if math.isnan(v) else 0

        checks = {
            "entropy_collapse": lambda: self._entropy_collapse(step) if "entropy" in values else (None, ""),
            "kl_spike": lambda: self._kl_spike(step) if "kl" in values else (None, ""),
            "reward_up_heldout_flat": lambda: self._reward_up_eval_flat(step, values),
            "high_zero_variance": lambda: self._zero_variance(step) if "frac_reward_zero_std" in values else (None, ""),
            "truncation_rising": lambda: self._truncation(step) if "completions/clipped_ratio" in values else (None, ""),
            "clip_high_reward_unstable": lambda: self._clip_unstable(step) if clip is not None else (None, ""),
            "no_reward": lambda: self._no_reward(step, values) if "reward" in values else (None, ""),
            "advantages_all_zero": lambda: self._advantages_vanished(step, values),
        }
        for fn_name in (m.group(1) for m in map(_REWARD_PART.match, values) if m):  # one episode each
            checks[f"reward_fn_never_applies/{fn_name}"] = (
                lambda name=fn_name: self._reward_fn_never_applies(step, name))
        fired = []
        for name, check in checks.items():
            holds, message = check()
            if holds is None:
                continue
            episode = self._episodes.setdefault(name, _Episode())
            if holds:
                episode.clear_count = 0
                if not episode.active:
                    episode.active = True
                    fired.append(message)
                    log.warning(message)
            elif episode.active:
                episode.clear_count += 1
                if episode.clear_count >= self.t.rearm_steps:
                    episode.active = False
        return fired


def _message(step: int, name: str, evidence: str, *, cause: str, fix: str) -> str:
    return f"[step {step}] {name}: {evidence}. Likely cause: {cause}. What to try: {fix}."
