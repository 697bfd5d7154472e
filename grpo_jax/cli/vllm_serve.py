"""python -m grpo_jax vllm-serve: the vLLM engine of sampling.vllm_mode="server" (TRL's `trl vllm-serve`).

    python -m grpo_jax vllm-serve --config configs/qwen25_05b_gpu.py            # on the inference GPUs
    python -m grpo_jax train --config configs/qwen25_05b_gpu.py \\
        --set sampling.engine=vllm --set sampling.vllm_mode=server                # on the training ones

Give it the trainer's config (and the same --set overrides that change the model or sampling.vllm_*):
it listens at sampling.vllm_server_host:sampling.vllm_server_port (--host / --port override them)
and starts the engine from what the trainer would start it from: `model.hf_path`, or an export of a
fresh init of the config's model (the trainer sends its own weights before its first rollout, so
this only fixes the architecture, which the trainer checks against its own at connect time). The
engine's options are the config's sampling.vllm_* fields (`vllm_setup.engine_options`).

It prints "vLLM server ready at http://HOST:PORT" once it accepts requests and serves until
SIGTERM or Ctrl-C. One server serves one run at a time: a run loads its weights into it.
Exit status: 0 after a signal, 2 for a config error, 1 for anything else.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import threading

log = logging.getLogger("grpo_jax")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the trainer's config file (get_config() -> Config)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field, as for train (repeatable)")
    parser.add_argument("--host", help="address to listen on (default: sampling.vllm_server_host)")
    parser.add_argument("--port", type=int, help="TCP port (default: sampling.vllm_server_port; 0: a free one)")


def starting_model_dir(config) -> str:
    """The checkpoint directory the engine starts from, as the trainer's `build_engine` picks it."""
    from grpo_jax.sampling import vllm_setup

    if config.model.hf_path:
        return vllm_setup.starting_checkpoint(config, None, None, None)
    from flax import nnx

    from grpo_jax.model import init_model
    from grpo_jax.training import run_context

    tokenizer = run_context.configured_tokenizer(config)
    m = config.model
    vocab = m.vocab_size or tokenizer.vocab_size
    run_context.check_vocab(vocab, tokenizer, f"model.vocab_size={vocab}", m)
    graphdef, params = nnx.split(init_model(m.model_config(vocab), m.init_seed))
    return vllm_setup.starting_checkpoint(config, graphdef, params, tokenizer)


def run(args) -> int:
    from grpo_jax import config as config_lib

    try:
        config = config_lib.apply_overrides(config_lib.load_config_file(args.config), list(args.set))
        model_dir = starting_model_dir(config)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        return _serve(config, model_dir, args.host, args.port)
    finally:
        if not config.model.hf_path:  # our export of the fresh model, not the user's checkpoint
            shutil.rmtree(model_dir, ignore_errors=True)


def _serve(config, model_dir: str, host: str | None, port: int | None) -> int:
    """Starts the engine on `model_dir`, listens, and serves until SIGTERM / SIGINT."""
    from grpo_jax.sampling import vllm_setup
    from grpo_jax.sampling.vllm_engine import EngineError
    from grpo_jax.sampling.vllm_server import EngineHTTPServer, EngineService

    s = config.sampling
    host = host if host is not None else s.vllm_server_host
    port = port if port is not None else s.vllm_server_port
    try:
        service = EngineService(vllm_setup.engine_options(config, model_dir))
    except EngineError as e:
        print(f"inference engine error: {e}", file=sys.stderr)
        return 1
    try:
        server = EngineHTTPServer(service, host, port)
    except OSError as e:
        service.close()
        print(f"cannot listen at {host}:{port}: {e} (set --port or sampling.vllm_server_port)", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="vllm-serve", daemon=True)
    thread.start()
    bound_host, bound_port = server.server_address[:2]
    print(f"vLLM server ready at http://{bound_host}:{bound_port}", flush=True)
    while not stop.wait(0.5):  # a short wait: the signal handler runs between waits
        pass
    log.info("vllm-serve: stopping")
    server.shutdown()  # waits for serve_forever to return; a running request finishes first
    server.server_close()
    service.close()
    return 0
