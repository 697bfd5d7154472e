"""sampling.vllm_mode="server": `python -m grpo_jax vllm-serve` as a separate process, reached by
`ServerClient` (TRL's `trl vllm-serve`).

The request parsing, the weights body and the HTTP layer (around a fake engine) are tested without
vLLM (default suite). The rest needs
vLLM (marked `vllm`): one server process serves the module; the kill test starts one more and
kills it. The model is the CPU demo's with two heads of 64 (vLLM's CPU attention refuses head_dim
32), as configs/arith_vllm_cpu.py has it.
"""

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from grpo_jax.sampling.vllm_backends import ServerClient, decode_arrays, encode_arrays
from grpo_jax.sampling.vllm_engine import EngineError
from grpo_jax.sampling.vllm_server import BadRequest, parse_adapter, parse_generate

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The demo's model with head_dim 64, a server-mode engine, and a run small enough for this CPU.
MODEL_AND_ENGINE = ["model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=64", "sampling.engine=vllm",
                    "sampling.vllm_mode=server", "sampling.vllm_gpu_memory_utilization=0.05",
                    "sampling.vllm_max_model_length=64"]
SMALL_RUN = ["grpo.prompts_per_step=4", "grpo.num_generations=4", "sft.steps=0", "eval.num_questions=0",
             "train.checkpoint_every=1", "train.samples_every=0"]


# -- without vLLM ------------------------------------------------------------------------------------


def test_weights_body_round_trips_every_dtype_bit_for_bit():
    named = [("model.embed_tokens.weight", np.arange(12, dtype=np.float32).reshape(3, 4) / 7),
             ("model.norm.weight", (np.arange(5) / 3).astype(ml_dtypes.bfloat16)),
             ("scalar", np.array(2.5, np.float32)), ("ids", np.array([1, -2], np.int64))]
    decoded = decode_arrays(encode_arrays(named))
    assert [n for n, _ in decoded] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, decoded):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()  # bf16 included: the raw bits, no float detour


def test_a_weights_body_with_bytes_missing_or_left_over_is_refused():
    body = encode_arrays([("w", np.ones((2, 3), np.float32))])
    with pytest.raises(ValueError, match="4 bytes after its 1 arrays"):
        decode_arrays(body + b"\0\0\0\0")
    with pytest.raises(ValueError):  # 20 of 24 bytes: numpy cannot fill a (2, 3) float32 array
        decode_arrays(body[:-4])
    with pytest.raises(ValueError):  # no header line
        decode_arrays(b"no header")


def generate_body(**changes):
    body = {"params": {"temperature": 0.0, "max_tokens": 4}, "prompts": [[1, 2], [3]], "seeds": [7, 8]}
    return json.dumps({**body, **changes}).encode()


def test_generate_requests_are_parsed_and_bad_fields_named():
    requests, params = parse_generate(generate_body(), vocab_size=14)
    assert [(r.prompt_ids, r.seed) for r in requests] == [([1, 2], 7), ([3], 8)]
    assert params == {"temperature": 0.0, "max_tokens": 4}
    cases = [(generate_body(seeds=[7]), "seeds has 1 entries for 2 prompts"),
             (generate_body(prompts=[[1], ["a"]]), r"prompts\[1\] must be a list of ints"),
             # vLLM's CPU kernels abort the process on an id past the vocabulary: refused before
             (generate_body(prompts=[[1], [14]]), r"prompts\[1\] has token id 14, outside .* \[0, 14\)"),
             (generate_body(params={"temperature": 1.0, "n": 4}), "params.n is not a field"),
             (generate_body(prompts=[]), "prompts must be a non-empty list"),
             (b"[1, 2]", "must be a JSON object"), (b"{not json", "not JSON")]
    for body, message in cases:
        with pytest.raises(BadRequest, match=message):
            parse_generate(body, vocab_size=14)


def test_adapter_files_are_read_from_hex_and_paths_refused():
    version, files = parse_adapter(json.dumps({"version": 3, "files": {"a.json": b"{}".hex()}}).encode())
    assert (version, files) == (3, {"a.json": b"{}"})
    for payload, message in [({"version": 0, "files": {"a": ""}}, "version must be a positive int"),
                             ({"version": 1, "files": {"../x": ""}}, "not a plain file name"),
                             ({"version": 1, "files": {"a": "zz"}}, r"files\['a'\] is not hex")]:
        with pytest.raises(BadRequest, match=message):
            parse_adapter(json.dumps(payload).encode())


class FakeBackend:
    """`Colocated`'s methods without vLLM: records the calls, answers token i+1 per prompt token i."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, params):
        from grpo_jax.sampling.vllm_engine import Completion

        self.calls.append(("generate", params))
        return [Completion([t + 1 for t in r.prompt_ids], [-0.5] * len(r.prompt_ids), r.seed == 0) for r in requests]

    def load_weights(self, named):
        self.calls.append(("load_weights", [(n, a.dtype.name, a.shape) for n, a in named]))

    def load_adapter(self, directory, version):
        files = {p.name: p.read_bytes() for p in pathlib.Path(directory).iterdir()}
        self.calls.append(("load_adapter", directory, version, files))

    def sleep(self):
        raise RuntimeError("sleep mode is not enabled")  # what vLLM says without enable_sleep_mode

    def wake_up(self):
        self.calls.append(("wake_up",))

    def close(self):
        pass


@pytest.fixture
def fake_server(tmp_path):
    """An `EngineHTTPServer` on a free port around `FakeBackend`, and a `ServerClient` of it."""
    import threading

    from grpo_jax.io import hf
    from grpo_jax.model import ModelConfig, init_model
    from grpo_jax.sampling.vllm_backends import EngineOptions
    from grpo_jax.sampling.vllm_server import EngineHTTPServer, EngineService

    shape = ModelConfig(vocab_size=14, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    hf.save_model(init_model(shape, 0), tmp_path / "ckpt")
    backend = FakeBackend()
    service = EngineService(EngineOptions(model_dir=str(tmp_path / "ckpt"), max_lora_rank=8), backend=backend)
    server = EngineHTTPServer(service, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield ServerClient("127.0.0.1", server.server_address[1], connect_timeout=5), backend, service
    server.shutdown()
    server.server_close()


def test_the_server_answers_what_the_client_sends(fake_server):
    from grpo_jax.sampling.vllm_engine import Request

    client, backend, service = fake_server
    # /health: the checkpoint's shape (config.json), the LoRA rank it was started with.
    assert client.info["model"] == {"vocab_size": 14, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                                    "num_kv_heads": 1, "head_dim": 8}
    assert client.info["max_lora_rank"] == 8
    out = client.generate([Request([1, 2], 5), Request([3], 0)], {"temperature": 0.0, "max_tokens": 4})
    assert [(c.token_ids, c.logprobs, c.truncated) for c in out] == [([2, 3], [-0.5, -0.5], False), ([4], [-0.5], True)]
    client.load_weights([("w", np.ones((2, 3), ml_dtypes.bfloat16))])
    assert backend.calls[-1] == ("load_weights", [("w", "bfloat16", (2, 3))])
    # Adapters: the files travel in the body into a fresh directory per version; two are kept.
    source = pathlib.Path(service.options.model_dir).parent / "adapter"
    source.mkdir()
    dirs = []
    for version in (1, 2, 3):
        (source / "adapter_config.json").write_text(f'{{"r": 8, "v": {version}}}')
        client.load_adapter(str(source), version)
        _, directory, got_version, files = backend.calls[-1]
        assert got_version == version and files == {"adapter_config.json": f'{{"r": 8, "v": {version}}}'.encode()}
        dirs.append(directory)
    assert [os.path.isdir(d) for d in dirs] == [False, True, True]
    # An engine failure is a 500 with its text; both come back as EngineError.
    with pytest.raises(EngineError, match="answered 500: /sleep failed: RuntimeError: sleep mode is not enabled"):
        client.sleep()
    client.wake_up()
    assert backend.calls[-1] == ("wake_up",)
    with pytest.raises(EngineError, match=r"answered 400: bad /load_weights request: .*weights body"):
        client._call("POST", "/load_weights", b"not a body", content_type="application/octet-stream")
    with pytest.raises(EngineError, match="answered 404"):
        client._call("POST", "/nothing", b"{}")


def test_the_trainer_refuses_a_server_of_another_shape_naming_both(fake_server):
    from grpo_jax import config as config_lib
    from grpo_jax.io.tokenizer import load_tokenizer
    from grpo_jax.sampling.vllm_setup import build_engine

    client, _, _ = fake_server
    port = client.url.rsplit(":", 1)[1]
    # The demo's model (hidden 128, 2 layers) against a server started on hidden 16, 1 layer.
    config = config_lib.apply_overrides(config_lib.load_config_file(str(ROOT / "configs/arith_cpu.py")),
                                        MODEL_AND_ENGINE + [f"sampling.vllm_server_port={port}"])
    tokenizer = load_tokenizer(config.model.tokenizer)
    model_config = config.model.model_config(tokenizer.vocab_size)
    with pytest.raises(EngineError, match=rf"server at http://127.0.0.1:{port} serves a model of shape "
                                          r"\{'vocab_size': 14, 'hidden_size': 16, 'num_layers': 1.*\}, but this "
                                          r"run's model is \{'vocab_size': 14, 'hidden_size': 128, 'num_layers': 2"):
        build_engine(config, None, model_config, None, tokenizer, (8, 16))
    # A run with LoRA adapters of rank 16 on a server started for rank 8: refused too.
    config = config_lib.apply_overrides(config, ["lora.r=16"])
    same = dataclasses.replace(model_config, **client.info["model"])
    with pytest.raises(EngineError, match="takes LoRA adapters up to rank 8, but lora.r=16"):
        build_engine(config, None, same, None, tokenizer, (8, 16))


# -- with vLLM: a server process -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(directory: pathlib.Path, port: int) -> subprocess.Popen:
    """`vllm-serve` on `port`, its output in directory/server.log; returns once it is ready."""
    log = open(directory / "server.log", "w")
    command = [sys.executable, "-m", "grpo_jax", "vllm-serve", "--config", "configs/arith_cpu.py", "--port", str(port)]
    command += [a for s in MODEL_AND_ENGINE for a in ("--set", s)]
    # VLLM_CPU_KVCACHE_SPACE: 1 GiB of KV cache, set outright. Otherwise vLLM's CPU backend takes
    # gpu_memory_utilization of the machine's memory less the process's whole RSS (JAX included,
    # ~1.15 GiB here), which at 0.05 of 23.5 GiB left 0.03 GiB, and nothing on a smaller machine.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 240
    while f"vLLM server ready at http://127.0.0.1:{port}" not in (directory / "server.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("vllm-serve did not start:\n" + (directory / "server.log").read_text()[-3000:])
        time.sleep(0.5)
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("vllm")
    port = free_port()
    proc = start_server(tmp_path_factory.mktemp("server"), port)
    yield port
    stop_server(proc)
    assert proc.returncode == 0  # SIGTERM: a clean stop


def demo_config():
    from grpo_jax import config as config_lib

    return config_lib.apply_overrides(config_lib.load_config_file(str(ROOT / "configs/arith_cpu.py")), MODEL_AND_ENGINE)


@pytest.mark.vllm
def test_served_engine_samples_as_the_builtin_sampler_and_follows_the_weights(server):
    from test_vllm import LOGPROB_ATOL, trainer_logprobs

    from grpo_jax.io.tokenizer import load_tokenizer
    from grpo_jax.model import init_model
    from grpo_jax.sampling.engine import SamplingConfig
    from grpo_jax.sampling.sampler import Sampler
    from grpo_jax.sampling.vllm_engine import VllmEngine
    from grpo_jax.sampling.vllm_setup import check_served_model

    config = demo_config()
    tokenizer = load_tokenizer(config.model.tokenizer)
    model_config = config.model.model_config(tokenizer.vocab_size)
    client = ServerClient("127.0.0.1", server, connect_timeout=10)
    check_served_model(config, model_config, client)  # the server was started from this config: same shape
    # Weights other than the server's starting ones (init_seed 1): the first call must send them.
    graphdef, params = nnx.split(init_model(model_config, seed=5), nnx.Param)
    buckets = (8, 16, 32)
    engine = VllmEngine(client, model_config, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id,
                        prompt_buckets=buckets)
    prompts = [tokenizer.encode(text) for text in ("12+34=", "7+5=", "99+1=", "40+40=")]

    greedy = SamplingConfig(max_new_tokens=12, greedy=True)
    ours = Sampler(graphdef, model_config, eos_id=tokenizer.eos_ids, pad_id=tokenizer.pad_id,
                   prompt_buckets=buckets)(params, prompts, num_samples=1, sampling=greedy, rng=jax.random.PRNGKey(0))
    theirs = engine(params, prompts, num_samples=1, sampling=greedy, rng=jax.random.PRNGKey(0))
    assert engine.weights_version == 1
    np.testing.assert_array_equal(np.asarray(ours.tokens_BxC), theirs.tokens_BxC)
    np.testing.assert_array_equal(np.asarray(ours.mask_BxC), theirs.mask_BxC)
    np.testing.assert_array_equal(np.asarray(ours.truncated_B), theirs.truncated_B)

    # An update that moves every log-prob; the engine's are the new params' (LOGPROB_ATOL: test_vllm's
    # bound for two float32 forward passes by different kernels; the HTTP body carries the float32
    # weights bit for bit, test_weights_body_round_trips_every_dtype_bit_for_bit).
    moved = jax.tree.map(lambda w: w * 1.5 + 0.01, params)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    out = engine(moved, prompts, num_samples=2, sampling=sampling, rng=jax.random.PRNGKey(2))
    assert engine.weights_version == 2 and client.info["status"] == "ok"
    np.testing.assert_allclose(out.logprobs_BxC, trainer_logprobs(graphdef, moved, out, 1.0), atol=LOGPROB_ATOL)
    old = trainer_logprobs(graphdef, params, out, 1.0)
    assert np.abs(out.logprobs_BxC - old).max() > 100 * LOGPROB_ATOL  # the weights really moved


@pytest.mark.vllm
def test_a_server_of_another_shape_is_refused_naming_both(server):
    from grpo_jax.sampling.vllm_setup import check_served_model

    config = demo_config()
    client = ServerClient("127.0.0.1", server, connect_timeout=10)
    wider = dataclasses.replace(config.model.model_config(14), hidden_size=256)
    with pytest.raises(EngineError, match=r"serves a model of shape \{.*'hidden_size': 128.*\}, but this run's model "
                                          r"is \{.*'hidden_size': 256"):
        check_served_model(config, wider, client)
    # A malformed request comes back as EngineError with the server's 400 text.
    with pytest.raises(EngineError, match=r"answered 400: bad /generate request: seeds has 0 entries for 1 prompts"):
        client._call("POST", "/generate", json.dumps({"params": {}, "prompts": [[1]], "seeds": []}).encode())


def train_command(run_dir, port, *extra):
    sets = MODEL_AND_ENGINE + SMALL_RUN + [f"sampling.vllm_server_port={port}", f"train.run_dir={run_dir}"]
    return ([sys.executable, "-m", "grpo_jax", "train", "--config", "configs/arith_cpu.py"]
            + [a for s in sets for a in ("--set", s)] + list(extra))


def metrics_steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def checkpoint_steps(run_dir) -> list[int]:
    directory = run_dir / "checkpoints"
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if directory.is_dir() else []


@pytest.mark.vllm
def test_a_server_mode_run_survives_the_engine_being_killed(server, tmp_path):
    doomed_port = free_port()
    doomed = start_server(tmp_path, doomed_port)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    trainer = subprocess.Popen(train_command(run_dir, doomed_port, "--set", "train.steps=1000"), cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "train.err", "w"))
    try:
        deadline = time.monotonic() + 240
        while not any(s >= 2 for s in checkpoint_steps(run_dir)):
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "train.err").read_text()[-3000:]
            time.sleep(0.2)
        doomed.kill()  # SIGKILL: no goodbye, mid-request or between requests
        doomed.wait()
        assert trainer.wait(timeout=120) == 1
    finally:
        for proc in (trainer, doomed):
            if proc.poll() is None:
                proc.kill()
    errors = [line for line in (tmp_path / "train.err").read_text().splitlines()
              if line.startswith("inference engine error:")]
    assert len(errors) == 1 and f"vLLM server http://127.0.0.1:{doomed_port}/" in errors[0], errors
    # The last finished step (the last metrics row) is the latest checkpoint.
    last = max(metrics_steps(run_dir))
    assert last >= 2 and checkpoint_steps(run_dir)[-1] == last

    # A fresh server (the module's, at another port, holding other weights): --resume continues from
    # that step; one step more, then it stops as train.stop_after_steps asks (exit 75, resumable).
    resumed = subprocess.run(train_command(run_dir, server, "--set", "train.steps=1000", "--set",
                                           "train.stop_after_steps=1", "--resume"),
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             timeout=300)
    assert resumed.returncode == 75, resumed.stderr[-3000:]
    assert f"resumed from step {last} (" in resumed.stderr
    assert metrics_steps(run_dir)[-1] == last + 1 and checkpoint_steps(run_dir)[-1] == last + 1
