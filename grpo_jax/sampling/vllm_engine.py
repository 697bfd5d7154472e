"""engine="vllm": the trainer's rollouts on an existing vLLM engine (`SamplingEngine`).

`VllmEngine` turns one sampler call (N prompts x G samples) into N * G single-sample requests,
each with its own seed drawn from the call's `rng` (vLLM seeds a request, so G samples of one
request would share a seed's stream; separate requests with prefix caching still prefill each
prompt once). The engine's answers come back into the same `SampleOutput` arrays as the built-in
sampler's: prompts left-padded to the same bucket, completions (stop id included) padded to
`max_new_tokens`, the engine's per-token log-probs beside them, `truncated` where a row hit the
length limit. So the sampler correction, truncation rule, masks and metrics need nothing else.

Weights follow the params passed in: when a call's params are not the ones last sent (identity
of a leaf, kept by weak reference), they go over first, under their Hugging Face names
(`grpo_jax.io.hf.hf_tensors`) in the engine's dtype, and the engine's prefix cache is reset (its
cached prompts were computed by the old weights). `AdapterWeights` (LoRA) sends only the adapters, as
a PEFT adapter the engine loads under a new id; the base goes over once. `weights_version` counts
the syncs and `pop_weight_sync_seconds` hands the last one's time to the step record
(`time/weight_sync`).

Where the engine runs is a backend's job (`vllm_backends`): in this process (colocate) or behind
HTTP (server). Log-probs: vLLM's "processed_logprobs", log softmax(logits / T) of the distribution
sampled from, which is the built-in sampler's when top_k = 0 and top_p = 1; with top-k / top-p
they are the truncated distribution's (the one the tokens really came from).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
import weakref
from typing import Any, Protocol, Sequence

import jax
import ml_dtypes
import numpy as np

from grpo_jax.io import hf, peft
from grpo_jax.model import ModelConfig
from grpo_jax.model.lora import LoraSpec
from grpo_jax.sampling.engine import SampleOutput, SamplingConfig
from grpo_jax.sampling.sampler import bucket_length

ENGINE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


class EngineError(RuntimeError):
    """The inference engine failed or cannot be reached; the message says which and what to do."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion to sample: the prompt's token ids and the row's seed."""

    prompt_ids: list[int]
    seed: int
    max_tokens: int | None = None  # None: the call's max_tokens (benchmarks force a row's length)


@dataclasses.dataclass(frozen=True)
class Completion:
    """What the engine sampled for one `Request`: token ids (the stop id included when it stopped),
    each token's log-prob, and whether it hit max_tokens without a stop id."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool


class Backend(Protocol):
    """Where the engine runs (`vllm_backends.Colocated` or `vllm_backends.ServerClient`)."""

    def generate(self, requests: Sequence[Request], params: dict) -> list[Completion]:
        """One completion per request; `params` as `sampling_params` makes them."""

    def load_weights(self, named_arrays: list[tuple[str, np.ndarray]]) -> None:
        """Replaces the named weights (HF names, HF layouts) and resets the prefix cache."""

    def load_adapter(self, adapter_dir: str, version: int) -> None:
        """Later generate calls sample with this PEFT adapter (a new id per version)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class AdapterWeights:
    """The policy as LoRA adapters over a frozen base: what the trainer passes a vLLM engine when
    lora.r > 0, so only the adapters go over at each sync (the base once, and again only if it
    changes)."""

    adapters: dict
    base: Any
    spec: LoraSpec
    alpha: float


def sampling_params(sampling: SamplingConfig, stop_ids: Sequence[int]) -> dict:
    """The call's `SamplingConfig` as vLLM's SamplingParams fields (the same for every row; each
    row adds its seed). Greedy is temperature 0; top_k 0 and top_p 1 are off in both."""
    return {
        "temperature": 0.0 if sampling.greedy else float(sampling.temperature),
        "top_k": int(sampling.top_k),
        "top_p": float(sampling.top_p),
        "max_tokens": int(sampling.max_new_tokens),
        # ignore_eos: every row runs to max_tokens, as in the built-in sampler; vLLM's own ignore_eos
        # covers only the checkpoint's EOS, so the stop ids are not sent either.
        "stop_token_ids": [] if sampling.ignore_eos else [int(i) for i in stop_ids],
        "ignore_eos": bool(sampling.ignore_eos),
    }


def row_seeds(rng: jax.Array, num_rows: int) -> list[int]:
    """One seed per row from the call's key: equal calls, equal seeds (so equal samples). With
    several processes each samples its own slice of the prompts from the same key, so the
    process index is folded in: no two processes' rows share a seed."""
    if jax.process_count() > 1:
        rng = jax.random.fold_in(rng, jax.process_index())
    return [int(s) for s in np.asarray(jax.random.randint(rng, (num_rows,), 0, 2**31 - 1))]


class VllmEngine:
    """G completions per prompt from a vLLM engine (`backend`), with the params' weights synced
    into it first when they changed. Outputs are host arrays; `mesh` is None."""

    mesh = None

    def __init__(self, backend: Backend, model_config: ModelConfig, *, eos_ids: Sequence[int], pad_id: int,
                 prompt_buckets: tuple[int, ...], dtype: str = "float32", sleep_between_calls: bool = False):
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"VllmEngine dtype must be one of {sorted(ENGINE_DTYPES)}, got {dtype!r}")
        self.backend = backend
        self.config = model_config
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self.dtype = dtype
        self.sleep_between_calls = sleep_between_calls
        self.weights_version = 0  # syncs so far (0: the engine holds what it started with)
        self._synced = None  # weak reference to a leaf of the params last sent
        self._synced_base = None  # adapters: the base last sent
        self._sync_seconds: float | None = None
        self._adapter_dirs: list[str] = []
        self.owned_dirs: list[str] = []  # removed by `close` (the exported starting checkpoint)
        self._asleep = False

    # -- weights ---------------------------------------------------------------------------------

    @staticmethod
    def _leaf(tree):
        return jax.tree_util.tree_leaves(tree)[0]

    def _is_synced(self, ref, tree) -> bool:
        return ref is not None and ref() is self._leaf(tree)

    def sync_weights(self, params) -> None:
        """Sends `params` (the policy's full params, or `AdapterWeights`) into the engine now."""
        self._wake()
        # The update that made `params` may still run (JAX dispatches asynchronously): the sync's
        # time starts when they exist, so time/weight_sync is the copy alone, not the update too.
        jax.block_until_ready(params.adapters if isinstance(params, AdapterWeights) else params)
        t0 = time.perf_counter()
        if isinstance(params, AdapterWeights):
            if not self._is_synced(self._synced_base, params.base):
                self._send_full(params.base)
                self._synced_base = weakref.ref(self._leaf(params.base))
            self._send_adapters(params)
            self._synced = weakref.ref(self._leaf(params.adapters))
        else:
            self._send_full(params)
            self._synced = weakref.ref(self._leaf(params))
            self._synced_base = None  # the engine now holds these params, not an adapters' base
        self.weights_version += 1
        self._sync_seconds = (self._sync_seconds or 0.0) + time.perf_counter() - t0

    def _send_full(self, params) -> None:
        self.backend.load_weights(list(hf.hf_tensors(params, self.config, ENGINE_DTYPES[self.dtype])))

    def _send_adapters(self, weights: AdapterWeights) -> None:
        directory = tempfile.mkdtemp(prefix=f"grpo_jax_adapter_{self.weights_version + 1}_")
        host = jax.tree.map(np.asarray, weights.adapters)
        peft.save_peft(host, directory, spec=weights.spec, alpha=weights.alpha, base_model=None)
        self.backend.load_adapter(directory, self.weights_version + 1)
        self._adapter_dirs.append(directory)
        while len(self._adapter_dirs) > 2:  # the engine has read the older ones
            shutil.rmtree(self._adapter_dirs.pop(0), ignore_errors=True)

    def pop_weight_sync_seconds(self) -> float | None:
        """Seconds the weight syncs since the last pop took (None: there was none). The trainer pops
        it as it reads a step's row, so a row holds the sync of the weights its update made (the
        next rollout's, as asynchronous rollouts count it), plus an evaluation's when one synced."""
        seconds, self._sync_seconds = self._sync_seconds, None
        return seconds

    def _wake(self) -> None:
        if self._asleep:
            self.backend.wake_up()
            self._asleep = False

    # -- sampling --------------------------------------------------------------------------------

    def __call__(self, params, prompts: Sequence[Sequence[int]], *, num_samples: int, sampling: SamplingConfig,
                 rng: jax.Array, forced_lengths=None) -> SampleOutput:
        """`SamplingEngine.__call__`. forced_lengths ([B] ints, benchmarks only, as the built-in
        sampler's): row r samples exactly that many tokens, stop ids ignored."""
        if not prompts:
            raise ValueError("VllmEngine: prompts is empty; pass at least one list of token ids")
        if not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(f"VllmEngine: num_samples must be a positive int, got {num_samples!r}")
        current = params.adapters if isinstance(params, AdapterWeights) else params
        if not self._is_synced(self._synced, current):
            self.sync_weights(params)
        self._wake()
        rows = [list(map(int, p)) for p in prompts for _ in range(num_samples)]
        lengths = [None] * len(rows) if forced_lengths is None else [int(n) for n in forced_lengths]
        requests = [Request(p, s, n) for p, s, n in zip(rows, row_seeds(rng, len(rows)), lengths)]
        if forced_lengths is not None:
            sampling = dataclasses.replace(sampling, ignore_eos=True)
        completions = self.backend.generate(requests, sampling_params(sampling, self.eos_ids))
        if self.sleep_between_calls:
            self.backend.sleep()
            self._asleep = True
        return self._pack(rows, completions, sampling.max_new_tokens)

    def _pack(self, rows: list[list[int]], completions: list[Completion], max_new_tokens: int) -> SampleOutput:
        """The rows as the built-in sampler lays them out (see `SampleOutput`)."""
        P = bucket_length(max(len(p) for p in rows), self.prompt_buckets)
        B, C = len(rows), max_new_tokens
        prompt_tokens = np.full((B, P), self.pad_id, np.int32)
        prompt_mask = np.zeros((B, P), np.int32)
        tokens = np.full((B, C), self.pad_id, np.int32)
        mask = np.zeros((B, C), np.int32)
        logprobs = np.zeros((B, C), np.float32)
        truncated = np.zeros((B,), bool)
        for r, (prompt, done) in enumerate(zip(rows, completions)):
            n = len(done.token_ids)
            if n > C or len(done.logprobs) != n:
                raise EngineError(f"vLLM returned {n} tokens and {len(done.logprobs)} log-probs for row {r} "
                                  f"with max_tokens={C}; the engine's answer is malformed")
            prompt_tokens[r, P - len(prompt):] = prompt
            prompt_mask[r, P - len(prompt):] = 1
            tokens[r, :n] = done.token_ids
            mask[r, :n] = 1
            logprobs[r, :n] = done.logprobs
            truncated[r] = done.truncated
        return SampleOutput(prompt_tokens_BxP=prompt_tokens, prompt_mask_BxP=prompt_mask, tokens_BxC=tokens,
                            mask_BxC=mask, truncated_B=truncated, logprobs_BxC=logprobs)

    def close(self) -> None:
        self.backend.close()
        for directory in self._adapter_dirs + self.owned_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self._adapter_dirs.clear()
        self.owned_dirs.clear()
