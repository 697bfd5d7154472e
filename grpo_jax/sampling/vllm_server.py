"""The engine process of sampling.vllm_mode="server" (TRL's `trl vllm-serve`): a `Colocated`
vLLM engine behind HTTP, answering exactly what `vllm_backends.ServerClient` sends.

    GET  /health        {"status": "ok", "model": {vocab_size, hidden_size, num_layers, num_heads,
                        num_kv_heads, head_dim} (the starting checkpoint's config.json),
                        "max_lora_rank", "weights_loads"}
    POST /generate      {"params": SamplingParams fields, "prompts": [[id, ...], ...], "seeds": [int, ...],
                         "max_tokens": [int or null, ...] (optional)}
                        -> [{"token_ids", "logprobs", "truncated"}, ...], one per prompt
    POST /load_weights  an `encode_arrays` body -> the engine's weights replaced
    POST /load_adapter  {"version": int, "files": {name: hex}} -> a PEFT adapter the engine samples with
    POST /sleep, /wake_up

A malformed request is a 400 whose text names the field; an engine failure a 500 with the error's
text (the client raises both as EngineError). One engine call runs at a time (a lock): vLLM's
`LLM` is not thread-safe, and the trainer sends one call at a time anyway. /health does not wait
for the lock, so a client can see the server is up while a long generate runs.

The command that starts it is `python -m grpo_jax vllm-serve` (`grpo_jax.cli.vllm_serve`).
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import tempfile
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo_jax.io.hf_config import config_from_hf, read_config
from grpo_jax.sampling.engine import SamplingConfig
from grpo_jax.sampling.vllm_backends import Colocated, EngineOptions, decode_arrays
from grpo_jax.sampling.vllm_engine import Request, sampling_params

log = logging.getLogger(__name__)

# The SamplingParams fields a client may set: exactly those `VllmEngine` sends (`sampling_params`).
SAMPLING_FIELDS = frozenset(sampling_params(SamplingConfig(max_new_tokens=1), ()))
ADAPTER_DIRS_KEPT = 2  # the adapter in use and the one before it (vLLM may still read it lazily)


class BadRequest(ValueError):
    """A request the server cannot run; its text names the field (answered 400)."""


def model_shape(model_dir: str) -> dict:
    """The shape fields `build_engine` compares with the trainer's model, from config.json."""
    c = config_from_hf(read_config(model_dir))
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_layers,
            "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}


def _int_list(value, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadRequest(f"{field} must be a list of ints, got {str(value)[:80]}")
    return value


def parse_generate(body: bytes, vocab_size: int) -> tuple[list[Request], dict]:
    """(requests, SamplingParams fields) from a /generate body; BadRequest names a bad field. A
    token id outside [0, vocab_size) is refused here: vLLM's CPU kernels abort the whole process
    on one (an index out of bounds in compiled C++), so no error could go back."""
    payload = _json_object(body)
    params, prompts, seeds = payload.get("params"), payload.get("prompts"), payload.get("seeds")
    if not isinstance(params, dict):
        raise BadRequest(f"params must be an object of SamplingParams fields, got {str(params)[:80]}")
    unknown = sorted(set(params) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"params.{unknown[0]} is not a field this server takes (it takes {sorted(SAMPLING_FIELDS)})")
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest(f"prompts must be a non-empty list of token-id lists, got {str(prompts)[:80]}")
    prompts = [_int_list(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    for i, prompt in enumerate(prompts):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None or not prompt:
            raise BadRequest(f"prompts[{i}] " + ("is empty" if bad is None else
                             f"has token id {bad}, outside the model's vocabulary [0, {vocab_size})"))
    seeds = _int_list(seeds, "seeds")
    if len(seeds) != len(prompts):
        raise BadRequest(f"seeds has {len(seeds)} entries for {len(prompts)} prompts; give one per prompt")
    # Optional: a row's own max_tokens (null: the call's), as benchmarks force lengths.
    lengths = payload.get("max_tokens") or [None] * len(prompts)
    if not isinstance(lengths, list) or len(lengths) != len(prompts) or not all(
            n is None or (isinstance(n, int) and not isinstance(n, bool) and n > 0) for n in lengths):
        raise BadRequest(f"max_tokens must be a list of positive ints or nulls, one per prompt, got {str(lengths)[:80]}")
    return [Request(p, s, n) for p, s, n in zip(prompts, seeds, lengths)], params


def parse_adapter(body: bytes) -> tuple[int, dict[str, bytes]]:
    """(version, file name -> contents) from a /load_adapter body."""
    payload = _json_object(body)
    version, files = payload.get("version"), payload.get("files")
    if not isinstance(version, int) or isinstance(version, bool) or version <= 0:
        raise BadRequest(f"version must be a positive int, got {version!r}")
    if not isinstance(files, dict) or not files:
        raise BadRequest("files must be a non-empty object of file name -> hex contents")
    out = {}
    for name, text in files.items():
        if pathlib.PurePath(name).name != name or name in (".", ".."):
            raise BadRequest(f"files: {name!r} is not a plain file name")
        try:
            out[name] = bytes.fromhex(text)
        except (TypeError, ValueError):
            raise BadRequest(f"files[{name!r}] is not hex text") from None
    return version, out


def _json_object(body: bytes) -> dict:
    try:
        payload = json.loads(body or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(payload).__name__}")
    return payload


class EngineService:
    """The engine and what the handlers do with it; one engine call at a time."""

    def __init__(self, options: EngineOptions, backend: Colocated | None = None):
        self.options = options
        self.info = {"status": "ok", "model": model_shape(options.model_dir),
                     "max_lora_rank": options.max_lora_rank, "weights_loads": 0}
        self.backend = backend if backend is not None else Colocated(options)
        self.lock = threading.Lock()
        self.adapter_dirs: list[str] = []

    def health(self) -> dict:
        return dict(self.info)

    def generate(self, body: bytes) -> list[dict]:
        requests, params = parse_generate(body, self.info["model"]["vocab_size"])
        with self.lock:
            completions = self.backend.generate(requests, params)
        return [{"token_ids": c.token_ids, "logprobs": c.logprobs, "truncated": c.truncated} for c in completions]

    def load_weights(self, body: bytes) -> dict:
        try:
            named = decode_arrays(body)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise BadRequest(f"the weights body is not an encode_arrays body: {e}") from None
        with self.lock:
            self.backend.load_weights(named)
            self.info["weights_loads"] += 1
        return {"loaded": len(named)}

    def load_adapter(self, body: bytes) -> dict:
        version, files = parse_adapter(body)
        directory = tempfile.mkdtemp(prefix=f"grpo_jax_served_adapter_{version}_")
        for name, data in files.items():
            (pathlib.Path(directory) / name).write_bytes(data)
        with self.lock:
            self.backend.load_adapter(directory, version)
        self.adapter_dirs.append(directory)
        while len(self.adapter_dirs) > ADAPTER_DIRS_KEPT:
            shutil.rmtree(self.adapter_dirs.pop(0), ignore_errors=True)
        return {"version": version}

    def sleep(self, body: bytes) -> dict:
        with self.lock:
            self.backend.sleep()
        return {}

    def wake_up(self, body: bytes) -> dict:
        with self.lock:
            self.backend.wake_up()
        return {}

    def close(self) -> None:
        with self.lock:
            self.backend.close()
        for directory in self.adapter_dirs:
            shutil.rmtree(directory, ignore_errors=True)


POST_ROUTES = ("/generate", "/load_weights", "/load_adapter", "/sleep", "/wake_up")


class _Handler(BaseHTTPRequestHandler):
    server: "EngineHTTPServer"
    protocol_version = "HTTP/1.1"  # the response carries Content-Length: a client may keep the connection

    def do_GET(self):
        if self.path != "/health":
            return self._answer(HTTPStatus.NOT_FOUND, f"no GET {self.path}; GET /health")
        self._answer(HTTPStatus.OK, self.server.service.health())

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path not in POST_ROUTES:
            return self._answer(HTTPStatus.NOT_FOUND, f"no POST {self.path}; POST one of {', '.join(POST_ROUTES)}")
        try:
            answer = getattr(self.server.service, self.path[1:])(body)
        except BadRequest as e:
            return self._answer(HTTPStatus.BAD_REQUEST, f"bad {self.path} request: {e}")
        except Exception as e:  # noqa: BLE001 - the engine's failure goes back to the trainer as text
            log.exception("%s failed", self.path)
            return self._answer(HTTPStatus.INTERNAL_SERVER_ERROR, f"{self.path} failed: {type(e).__name__}: {e}")
        self._answer(HTTPStatus.OK, answer)

    def _answer(self, status: HTTPStatus, payload) -> None:
        data = (json.dumps(payload) if status == HTTPStatus.OK else str(payload)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if status == HTTPStatus.OK else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)


class EngineHTTPServer(ThreadingHTTPServer):
    """`service` behind HTTP at (host, port); port 0 picks a free one (`server_address` has it)."""

    daemon_threads = True

    def __init__(self, service: EngineService, host: str, port: int):
        self.service = service
        super().__init__((host, port), _Handler)
