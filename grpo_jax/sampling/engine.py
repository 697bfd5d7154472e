"""What a rollout asks of a sampling engine: the request (`SamplingConfig`), the answer
(`SampleOutput`) and the one call between them (`SamplingEngine`). The built-in `Sampler` (static or
continuous batching) satisfies it; an external engine (a vLLM server, another process) does by
implementing the same call.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence, runtime_checkable

import jax


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 1.0      # 1.0: no nucleus filter
    greedy: bool = False
    ignore_eos: bool = False   # benchmarks: every row generates exactly max_new_tokens
    # MoE models, static engine: also return each token's experts (SampleOutput.experts_BxLxSxK).
    record_experts: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplingConfig.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    """Row r is prompt r // G, sample r % G. B = num_prompts * G, P bucketed, C = max_new_tokens."""

    prompt_tokens_BxP: jax.Array   # int32, left padded with pad_id
    prompt_mask_BxP: jax.Array     # int32, 1 = real token
    tokens_BxC: jax.Array          # int32, completion incl. EOS, pad_id after it
    mask_BxC: jax.Array            # int32, 1 for real completion tokens (EOS included)
    truncated_B: jax.Array         # bool, no EOS within max_new_tokens
    logprobs_BxC: jax.Array        # float32, log softmax(logits / T)[token]; 0 on padding
    # int32 [B, L_sparse, P + C, K], SamplingConfig.record_experts only (else None): the experts each
    # sparse layer chose for every prompt and completion slot, for routing replay (`token_logprobs`).
    experts_BxLxSxK: jax.Array | None = None


@runtime_checkable
class SamplingEngine(Protocol):
    """G completions per prompt from the policy `params`: what the trainer's rollout, `evaluate` and
    the SFT warm-up's accuracy check call.

    `mesh`: the device mesh the output rows are laid over ("data" x "fsdp"), or None (plain arrays
    on one device). With a mesh and several processes each process passes its host slice of the
    prompts and reads its rows back with `sharding.process_rows`; callers pad their prompt count to
    a multiple of `sharding.batch_size_multiple(mesh)`.

    `__call__`: prompts are token ids (not padded); the result's rows are in prompt-major order, row
    r = prompt r // num_samples. Its completion length is `mask_BxC.sum(1)` (the stop id included),
    `logprobs_BxC` the log-probs of the sampled tokens under softmax(logits / temperature) before
    top-k / top-p (0 on padding), which the trainer's pi_old must match. Equal calls should give
    equal samples (the built-in engines key row r's noise by (`rng`, r) alone).
    """

    mesh: object | None

    def __call__(self, params, prompts: Sequence[Sequence[int]], *, num_samples: int, sampling: SamplingConfig,
                 rng: jax.Array) -> SampleOutput: ...
