"""A `VllmEngine` from a run's config: the engine's starting checkpoint, its options from the
`sampling.vllm_*` fields, and the backend `sampling.vllm_mode` names.

The engine starts from `model.hf_path` when the run has one, else from an export of the trainer's
starting params into a local directory (a fresh model, like the CPU demo's). Either way the first
sampler call sends the policy's weights, so what the engine started from only fixes the architecture.
"""

from __future__ import annotations

import logging
import pathlib
import tempfile

from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.io import hf
from grpo_jax.sampling.vllm_backends import Colocated, EngineOptions, ServerClient
from grpo_jax.sampling.vllm_engine import EngineError, VllmEngine

log = logging.getLogger(__name__)

# vLLM's LoRA kernels take these maximum ranks; a run's lora.r is rounded up to the next one.
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def engine_dtype(config: config_lib.Config) -> str:
    s = config.sampling
    return config.model.dtype if s.vllm_dtype == "auto" else s.vllm_dtype


def engine_options(config: config_lib.Config, model_dir: str) -> EngineOptions:
    s = config.sampling
    rank = config.lora.r
    return EngineOptions(
        model_dir=model_dir,
        dtype=engine_dtype(config),
        gpu_memory_utilization=s.vllm_gpu_memory_utilization,
        tensor_parallel_size=s.vllm_tensor_parallel_size,
        max_model_len=s.vllm_max_model_length or None,
        enable_sleep_mode=s.vllm_enable_sleep_mode,
        max_lora_rank=next((r for r in LORA_RANKS if r >= rank), rank) if rank else 0,
        seed=config.train.seed,
    )


def starting_checkpoint(config: config_lib.Config, graphdef, params, tokenizer) -> str:
    """The directory the engine loads first: `model.hf_path`, or an export of `params`."""
    if config.model.hf_path:
        return str(config.model.hf_path)
    directory = pathlib.Path(tempfile.mkdtemp(prefix="grpo_jax_vllm_model_"))
    hf.save_model(nnx.merge(graphdef, params), directory, tokenizer=tokenizer)
    log.info("vLLM engine: the starting params exported to %s", directory)
    return str(directory)


SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def check_served_model(config: config_lib.Config, model_config, client: ServerClient) -> None:
    """A server started from another config serves another architecture: its weights would not
    load (or, worse, load into a model of another vocabulary). Refused at connect time, both shapes
    named; likewise a server whose LoRA rank cannot hold the run's adapters."""
    served = (client.info or {}).get("model") or {}
    ours = {name: getattr(model_config, name) for name in SHAPE_FIELDS}
    theirs = {name: served.get(name) for name in SHAPE_FIELDS}
    if ours != theirs:
        raise EngineError(f"the vLLM server at {client.url} serves a model of shape {theirs}, but this run's model "
                          f"is {ours}; start the server with this run's config (python -m grpo_jax vllm-serve "
                          "--config <this config> and the same --set overrides)")
    rank = int((client.info or {}).get("max_lora_rank") or 0)
    if config.lora.r > rank:
        raise EngineError(f"the vLLM server at {client.url} takes LoRA adapters up to rank {rank}, but lora.r="
                          f"{config.lora.r}; start the server with this run's config (its lora.r)")


def build_engine(config: config_lib.Config, graphdef, model_config, params, tokenizer,
                 prompt_buckets: tuple[int, ...]) -> VllmEngine:
    """The run's `VllmEngine` (sampling.engine="vllm"), its backend started or connected."""
    s = config.sampling
    exported = None
    if s.vllm_mode == "server":
        backend = ServerClient(s.vllm_server_host, s.vllm_server_port, connect_timeout=s.vllm_server_timeout)
        check_served_model(config, model_config, backend)
    else:
        model_dir = starting_checkpoint(config, graphdef, params, tokenizer)
        exported = None if config.model.hf_path else model_dir
        backend = Colocated(engine_options(config, model_dir))
    engine = VllmEngine(backend, model_config,
                        eos_ids=tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,)),
                        pad_id=tokenizer.pad_id, prompt_buckets=prompt_buckets, dtype=engine_dtype(config),
                        sleep_between_calls=s.vllm_mode == "colocate" and s.vllm_enable_sleep_mode)
    if exported is not None:
        engine.owned_dirs.append(exported)
    return engine
