"""python -m grpo_jax check: will this config fit? Built abstractly, compiled, nothing allocated.

    python -m grpo_jax check --config configs/arith_cpu.py
    python -m grpo_jax check --config configs/qwen25_05b_gpu.py --model-shape qwen2.5-0.5b --devices 8
    python -m grpo_jax check --config configs/tpu_pod.py --model-shape qwen2.5-7b --devices 16 \\
        --set mesh.data=1 --set mesh.fsdp=4 --set mesh.tensor=4 --memory-per-device 16GiB

The run is built as `train` builds it (run_context: mesh, sampler, optimizer, update and log-prob
functions, sharding tables) but from `jax.eval_shape` of the params, Adam state and reference, so
no weight is allocated and no checkpoint is read. The shape comes from `model.hf_path`'s
config.json when that directory exists, else from `--model-shape` (`MODEL_SHAPES`), else from the
config's `model.*` shape fields. The update, the log-prob pass and the rollout's prefill and decode
are lowered and compiled for the config's mesh on N devices (`--devices`, default all; fake CPU
devices in a subprocess when the machine has fewer), at the config's sizes: prompts_per_step * G
rows of `--prompt-tokens` (rounded up to the sampler's bucket) + sampling.max_new_tokens.

Printed per device: params, Adam state, reference, gradients, KV cache, the sampler's decode-layout
weights, the step's row arrays, each compiled program's argument / output / alias / temp bytes
(`compiled.memory_analysis()`), each phase's peak (what lives then plus the program running), the
PartitionSpec of every weight, and the peak against `--memory-per-device` (default: the devices'
own limit on an accelerator, none on CPU). Argument and output sizes are exact on any backend (the
SPMD partitioner fixes every per-device shape); temp sizes come from the backend that compiled. A
CPU compile estimates a TPU/GPU one (other fusions, no memory-driven rematerialisation); a compile
on the target is exact for that program. Not counted: held-out evaluation rollouts, the runtime's
own overhead and fragmentation (on a GPU give XLA's pool, not the card: XLA_PYTHON_CLIENT_MEM_FRACTION).

Exit status: 0, 2 for a config error ("config error: ..."), 3 when the peak exceeds
--memory-per-device, 1 for anything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import subprocess
import sys
import time

EXIT_CONFIG, EXIT_TOO_BIG = 2, 3
_MANY_LAYERS = 256  # more than any public model (Llama 3.1 405B: 126); building them takes minutes
_CHILD_ENV = "GRPO_CHECK_FAKE_DEVICES"  # set in the re-executed child: do not re-exec again

# --model-shape presets: the shape fields of each model's public Hugging Face config.json
# (huggingface.co/<repo>/blob/main/config.json, the Instruct repos the shipped configs use;
# Qwen/Qwen2.5-{0.5B,1.5B,7B,32B}-Instruct, meta-llama/Llama-3.1-8B-Instruct). Only fields that
# hf.config_from_hf reads; the base models have the same shapes.
MODEL_SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                     "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 151645},
    "qwen2.5-1.5b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                     "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 151645},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                   "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 151645},
    "qwen2.5-32b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120, "intermediate_size": 27648,
                    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "vocab_size": 152064, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                    "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 151645},
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
                     "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                     "mlp_bias": False, "head_dim": 128, "bos_token_id": 128000,
                     "eos_token_id": [128001, 128008, 128009],
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184; GiB/MiB/KiB (and bare G/M/K) are powers of 2, GB/MB/KB of 10."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 16GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def count(n: int) -> str:
    """494032768 -> '494.0M', 7615616512 -> '7.62B'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a Python file with get_config() -> Config")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable)")
    parser.add_argument("--devices", type=int, help="devices of the mesh (default: this machine's); more than "
                        "the machine has: fake CPU devices in a subprocess")
    parser.add_argument("--memory-per-device", type=parse_bytes, metavar="SIZE",
                        help="budget per device, e.g. 16GiB (default: the device's limit; none on CPU)")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES),
                        help="the model's shape (needed when model.hf_path is not on this machine; wins over "
                        "its config.json and the model.* fields)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="longest prompt, rounded up to the sampler's bucket (default 512)")
    parser.add_argument("--no-compile", action="store_true", help="state figures only: no lowering or compiling")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here as JSON")


def run(args: argparse.Namespace) -> int:
    """Checks the run `args` describe (module docstring); returns the exit status."""
    # Nothing is allocated: a GPU process need not grab 75% of the memory for XLA's pool.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from grpo_jax import config as config_lib

    try:
        config = config_lib.apply_overrides(config_lib.load_config_file(args.config), list(args.set))
        if args.devices is not None and args.devices < 1:
            raise config_lib.ConfigError(f"--devices={args.devices}: must be >= 1")
        if args.prompt_tokens < 1:
            raise config_lib.ConfigError(f"--prompt-tokens={args.prompt_tokens}: must be >= 1")
        child = _reexec_with_fake_devices(args)
        if child is not None:
            return child
        figures = check(config, devices=args.devices, model_shape=args.model_shape,
                        prompt_tokens=args.prompt_tokens, compile_programs=not args.no_compile,
                        memory_per_device=args.memory_per_device)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    figures["config_file"] = args.config
    print(format_report(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if figures["fits"] is False:
        p = figures["peak"]
        print(f"too big: the {p['phase']} phase needs {gib(p['bytes'])} per device ({p['parts']}) > "
              f"--memory-per-device {gib(figures['memory_per_device'])}", file=sys.stderr)
        return EXIT_TOO_BIG
    return 0


def _reexec_with_fake_devices(args) -> int | None:
    """With --devices N above this machine's count: runs this check again in a subprocess on N fake
    CPU devices (XLA reads its flags once, when the backend starts) and returns its exit status."""
    if args.devices is None or os.environ.get(_CHILD_ENV):
        return None
    import jax

    if jax.device_count() >= args.devices:
        return None
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_CHILD_ENV: str(args.devices)})
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    argv = [sys.executable, "-m", "grpo_jax.cli.check", "--config", args.config, "--devices", str(args.devices),
            "--prompt-tokens", str(args.prompt_tokens)]
    argv += [a for s in args.set for a in ("--set", s)]
    if args.memory_per_device is not None:
        argv += ["--memory-per-device", str(args.memory_per_device)]
    if args.model_shape:
        argv += ["--model-shape", args.model_shape]
    if args.no_compile:
        argv.append("--no-compile")
    if args.json:
        argv += ["--json", args.json]
    print(f"check: {jax.device_count()} {jax.default_backend()} device(s) here; running on {args.devices} fake "
          "CPU devices in a subprocess", file=sys.stderr)
    return subprocess.run(argv, env=env, check=False).returncode


# ----------------------------------------------------------------------------------------------
# The model's shape.

def resolve_shape(config, preset: str | None):
    """(ModelConfig, where the shape came from, stop ids, pad id); nothing but config.json is read."""
    from grpo_jax import config as config_lib
    from grpo_jax.io import hf
    from grpo_jax.training import run_context

    m = config.model
    if m.hf_path and os.path.isdir(m.hf_path) and not preset:
        try:
            hf_config = hf.read_config(m.hf_path)
        except (FileNotFoundError, ValueError) as e:
            raise config_lib.ConfigError(f"model.hf_path={m.hf_path!r}: {e}") from None
        source = f"model.hf_path={m.hf_path}/config.json"
    elif preset:
        hf_config, source = MODEL_SHAPES[preset], f"--model-shape {preset}"
    elif m.hf_path:
        raise config_lib.ConfigError(
            f"model.hf_path={m.hf_path!r} is not a directory on this machine, so its config.json cannot be read; "
            f"pass --model-shape with one of {sorted(MODEL_SHAPES)} (check reads no weights)")
    else:
        tokenizer = run_context.configured_tokenizer(config)
        vocab = m.vocab_size or tokenizer.vocab_size
        run_context.check_vocab(vocab, tokenizer, f"model.vocab_size={vocab}", m)
        eos = tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))
        return run_context.model_config_from_section(m, vocab), "the config's model.* fields", eos, tokenizer.pad_id
    try:
        model_config = hf.config_from_hf(hf_config, dtype=m.dtype, param_dtype="float32", remat=m.remat,
                                         attention_impl=m.attention_impl)
    except (KeyError, ValueError) as e:
        raise config_lib.ConfigError(f"{source}: {e}") from None
    eos = hf_config.get("eos_token_id", model_config.vocab_size - 1)
    eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
    pad = hf_config.get("pad_token_id")
    return model_config, source, eos, eos[0] if pad is None else int(pad)


# ----------------------------------------------------------------------------------------------
# The check.

def _with_shardings(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract tree (ShapeDtypeStructs with shardings; even splits)."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class Program:
    name: str
    argument: int
    output: int
    alias: int
    temp: int
    compile_s: float

    @property
    def peak(self) -> int:
        """Bytes live while it runs: inputs, outputs not written in place of an input, scratch."""
        return self.argument + self.output - self.alias + self.temp


def _compile(name: str, lowered) -> Program:
    t0 = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    if m is None:  # a backend without the analysis: the program's own arrays are still counted
        return Program(name, 0, 0, 0, 0, seconds)
    return Program(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                   m.temp_size_in_bytes, seconds)


def weight_specs(params, train_specs, decode_specs) -> list[dict]:
    """One row per distinct weight (layers folded into `layers.*`): name, shape, both PartitionSpecs."""
    import jax

    rows: dict[str, dict] = {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), train, decode in zip(flat, jax.tree.leaves(train_specs), jax.tree.leaves(decode_specs)):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        keys = ["*" if k.isdigit() else k for k in keys if k != "value"]
        name = ".".join(keys)
        row = rows.setdefault(name, {"name": name, "shape": list(leaf.shape), "train": str(train),
                                     "decode": str(decode), "count": 0})
        row["count"] += 1
    return list(rows.values())


@dataclasses.dataclass
class Abstract:
    """The run's state as shapes and shardings: what `run_context.build` would allocate."""

    graphdef: object
    params: object  # ShapeDtypeStructs in the training layout (under LoRA the frozen base)
    opt_state: object
    ref: object | None  # None when grpo.beta == 0 (and under LoRA, whose reference is the base)
    tx: object
    decode_shardings: object  # the sampler's layout (sharding.decode_param_shardings)
    separate_decode_copy: bool  # whether the sampler's weights are a second copy
    adapters: object | None = None  # LoRA: what trains (and what opt_state is over)
    lora: object | None = None  # LoRA: the lora.LoraSpec
    teacher: object | None = None  # on-policy distillation: (graphdef, frozen params), grpo_jax.training.teacher


def abstract_state(config, model_config, mesh) -> Abstract:
    """jax.eval_shape of the params, Adam state and reference, laid out as the trainer lays them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from grpo_jax import model as model_lib
    from grpo_jax.core import entropy_control
    from grpo_jax.training import optim
    from grpo_jax.distributed import sharding
    from grpo_jax.training import step as step_lib

    from grpo_jax.model import lora as lora_lib
    from grpo_jax.training import teacher as teacher_lib

    g, seed, m = config.grpo, config.model.init_seed, config.model
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(model_config, seed)))
    params = jax.eval_shape(lambda: nnx.split(model_lib.init_model(model_config, seed))[1])
    params = _with_shardings(params, sharding.param_shardings(mesh, params))
    tx, _ = optim.make_optimizer(config.optim, config.train.steps * g.num_iterations * g.num_minibatches)
    tx = entropy_control.with_controller(tx, g)  # as the trainer's (run_context.build)
    spec = config.lora.spec(config.model.dtype)
    if spec is not None:  # adapters train over a frozen base (run_context.lora_state)
        if config.lora.base_dtype == "bfloat16":
            params = _with_shardings(jax.eval_shape(lambda p: step_lib.as_dtype(p, jnp.bfloat16), params),
                                     sharding.param_shardings(mesh, params))
        adapters = jax.eval_shape(lambda p: lora_lib.init_adapters(p, spec.targets, spec.rank, jax.random.PRNGKey(0),
                                                                   config.lora.init), params)
        adapters = _with_shardings(adapters, sharding.param_shardings(mesh, adapters))
        opt_state = jax.eval_shape(tx.init, adapters)
        opt_state = _with_shardings(opt_state, sharding.opt_state_shardings(mesh, opt_state, adapters))
        decode_sh = sharding.decode_param_shardings(mesh, params)
        # The sampler decodes from a merged copy: always a second set of weights.
        return Abstract(graphdef, params, opt_state, None, tx, decode_sh, True, adapters=adapters, lora=spec,
                        teacher=teacher_lib.abstract_teacher(config, mesh, model_config.vocab_size))
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = _with_shardings(opt_state, sharding.opt_state_shardings(mesh, opt_state, params))
    ref = None
    if g.beta > 0:
        ref_dtype = jnp.bfloat16 if g.ref_dtype == "bfloat16" else jnp.float32
        ref = _with_shardings(jax.eval_shape(lambda p: step_lib.as_dtype(p, ref_dtype), params),
                              sharding.param_shardings(mesh, params))
    decode_sh = sharding.decode_param_shardings(mesh, params)
    # jax.device_put into an equivalent layout moves nothing (fsdp=1: the two layouts coincide).
    separate = sharding.decode_copy_is_separate(mesh, params)
    return Abstract(graphdef, params, opt_state, ref, tx, decode_sh, separate,
                    teacher=teacher_lib.abstract_teacher(config, mesh, model_config.vocab_size))


def target_slots(config, rows: int, row_devices: int) -> int:
    """The continuous engine's slots per device on the backend the config is for (an accelerator
    where its mesh, dtype or checkpoint say so), not on the CPU that `check` compiles with."""
    from grpo_jax.sampling import sampler as sampler_lib
    from grpo_jax.distributed.platform_check import accelerator_expected

    backend = "accelerator" if accelerator_expected(config) else "cpu"
    return sampler_lib.slots_per_device(rows, row_devices, config.sampling.decode_slots, backend=backend)


def decode_copy(st: Abstract, model_config):
    """The sampler's weights as `sharding.decode_params` makes them: in the compute dtype where
    they are a separate copy, else the params themselves."""
    import jax
    import jax.numpy as jnp

    from grpo_jax.model.config import DTYPES

    dtype = DTYPES[model_config.dtype] if st.separate_decode_copy else None
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=s),
        st.params, st.decode_shardings)


def merged_policy(st: Abstract):
    """LoRA: the merged policy params (what the pi_old pass and the sampler read), training layout."""
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, st.lora.merge_dtype, sharding=x.sharding), st.params)


def compiled_programs(config, model_config, mesh, st: Abstract, *, prompt_len: int, stop_ids, pad_id
                     ) -> dict[str, Program]:
    """The rollout's prefill and decode, the log-prob pass(es) the config runs, and the update,
    lowered on abstract arguments with the trainer's shardings and compiled."""
    import types

    import jax
    import jax.numpy as jnp

    from grpo_jax.training import run_context
    from grpo_jax.distributed import sharding
    from grpo_jax.sampling import sampler as sampler_lib
    from grpo_jax.training import step as step_lib
    from grpo_jax.model import remat

    g, s_cfg = config.grpo, config.sampling
    c = s_cfg.max_new_tokens
    seq, rows = prompt_len + c, g.prompts_per_step * g.num_generations
    rows_per_micro, row_devices = rows // (g.num_minibatches * g.grad_accum_steps), sharding.batch_size_multiple(mesh)
    rows_sh, whole = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    i32, f32 = jnp.int32, jnp.float32

    def arr(shape, dtype, sh=rows_sh):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    programs = {}
    # Rollout: the trainer's sampler (run_context.build_sampler) and its prefill/decode pair for this
    # size, params in the decode layout as Sampler._prepare lays them out (one part: no thread split).
    stop = types.SimpleNamespace(eos_ids=tuple(stop_ids), eos_id=stop_ids[0], pad_id=pad_id)
    smp = run_context.build_sampler(config, st.graphdef, model_config, stop, mesh)
    smp._param_shardings = st.decode_shardings
    if smp.engine == "continuous" and not smp.decode_slots:  # the target accelerator's auto slots
        smp.decode_slots = target_slots(config, rows, row_devices) * row_devices
    sampling = sampler_lib.SamplingConfig(max_new_tokens=c, temperature=s_cfg.temperature, top_k=s_cfg.top_k,
                                          top_p=s_cfg.top_p, ignore_eos=s_cfg.ignore_eos)
    m_rows = sampler_lib.prefill_rows(g.prompts_per_step, g.num_generations, row_devices)
    prefill_fn, decode_fn = smp._functions(prompt_len, m_rows, rows, sampling, None)
    decode_params = decode_copy(st, model_config)
    prefill = prefill_fn.lower(decode_params, arr((m_rows, prompt_len), i32), arr((m_rows, prompt_len), i32))
    programs["prefill"] = _compile("prefill", prefill)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), prefill.out_info[0])
    programs["decode"] = _compile("decode", decode_fn.lower(decode_params, state, arr((2,), jnp.uint32, whole),
                                                            arr((), i32, whole)))

    update_group, logprob_group = step_lib.prompt_groups(g, rows_per_micro, row_devices)
    logprob_fn = step_lib.make_logprob_fn(st.graphdef, s_cfg.temperature, mesh=mesh, params=st.params,
                                          group_size=logprob_group,
                                          row_chunks=step_lib.logprob_row_chunks(g, row_devices, logprob_group))
    tokens, attention = arr((rows, seq), i32), arr((rows, seq), i32)
    reference = st.ref if st.lora is None else (st.params if g.beta > 0 else None)
    if reference is not None:
        programs["logprobs_ref"] = _compile("logprobs_ref", logprob_fn.jitted.lower(reference, tokens, attention, c))
    if config.resolved_old_logprobs() == "recompute":
        policy = st.params if st.lora is None else merged_policy(st)
        programs["logprobs_policy"] = _compile("logprobs_policy",
                                               logprob_fn.jitted.lower(policy, tokens, attention, c))

    trainable, frozen = (st.params, ()) if st.lora is None else (st.adapters, (st.params,))
    update_fn = sharding.shard_update_fn(
        step_lib.make_update_fn(st.graphdef, st.tx, g, s_cfg.temperature, group_size=update_group, lora=st.lora,
                                off_policy=config.off_policy),
        mesh, trainable, st.opt_state, frozen=frozen[0] if frozen else None,
        compiler_options=remat.backward_compiler_options(model_config))
    a, mb_sh = g.grad_accum_steps, sharding.batch_sharding(mesh, row_axis=1)
    per_token = arr((a, rows_per_micro, c), f32, mb_sh)
    batch = step_lib.UpdateBatch(
        tokens=arr((a, rows_per_micro, seq), i32, mb_sh), attention=arr((a, rows_per_micro, seq), i32, mb_sh),
        completion_mask=arr((a, rows_per_micro, c), i32, mb_sh), advantages=arr((a, rows_per_micro), f32, mb_sh),
        old_logp=None if config.resolved_old_logprobs() == "in_loss" else per_token, sampler_logp=per_token,
        ref_logp=per_token if st.ref is not None else None, **teacher_fields(g, (a, rows_per_micro, c), mb_sh))
    programs["update"] = _compile("update", update_fn.lower(trainable, st.opt_state, batch, *frozen))
    if st.teacher is not None:  # the teacher's pass over the step's rows (its own shape and layout)
        from grpo_jax.training import teacher as teacher_lib

        t_graphdef, t_params = st.teacher
        pass_fn = teacher_lib.make_pass_fn(t_graphdef, s_cfg.temperature, g.loss_top_k, mesh=mesh, params=t_params,
                                           vocab=model_config.vocab_size)
        programs["logprobs_teacher"] = _compile("logprobs_teacher", _lower_teacher(pass_fn, t_params, tokens,
                                                                                   attention, c))
    return programs


def teacher_fields(g, shape, sharding_) -> dict:
    """UpdateBatch's teacher arrays as ShapeDtypeStructs of `shape` ([A, M, C]) plus [K] for top-k."""
    import jax
    import jax.numpy as jnp

    if not g.teacher_model_name_or_path:
        return {}
    if g.loss_top_k == 0:
        return {"teacher_logp": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding_)}
    topk = shape + (g.loss_top_k,)
    return {"teacher_topk_logp": jax.ShapeDtypeStruct(topk, jnp.float32, sharding=sharding_),
            "teacher_topk_ids": jax.ShapeDtypeStruct(topk, jnp.int32, sharding=sharding_)}


def _lower_teacher(pass_fn, params, tokens, attention, c):
    """The teacher pass lowered: `make_logprob_fn`'s (k = 0) exposes `.jitted`; the top-k pass is a MeshJit."""
    inner = getattr(pass_fn, "logprob_fn", None)
    if inner is not None:
        return inner.jitted.lower(params, tokens, attention, c)
    return pass_fn.lower(params, tokens, attention, c)


def phase_peaks(sizes: dict[str, int], programs: dict[str, Program], separate_decode_copy: bool
                ) -> dict[str, tuple[dict[str, int], Program]]:
    """phase -> (arrays alive meanwhile that the program does not take, the program in use)."""
    lora = sizes["adapters"] > 0  # then "params" is the frozen base, which is also the reference
    rollout = {"opt_state": sizes["opt_state"], "reference": sizes["reference"], "adapters": sizes["adapters"]}
    if separate_decode_copy:  # the training-layout params stay; the decode copy is an argument
        rollout["params"] = sizes["params"]
    phases = {"rollout": (rollout, max(programs["prefill"], programs["decode"], key=lambda p: p.peak))}
    # The reference pass reads the base under LoRA; the pi_old pass reads a merged copy beside it.
    for name, others in (("logprobs_ref", {"params": 0 if lora else sizes["params"]}),
                         ("logprobs_policy", {"reference": sizes["reference"],
                                              "params": sizes["params"] if lora else 0})):
        if name in programs:
            phases[name] = ({**others, "adapters": sizes["adapters"], "opt_state": sizes["opt_state"],
                             "step_rows": sizes["step_rows"]}, programs[name])
    phases["update"] = ({"reference": sizes["reference"], "step_rows": sizes["step_rows"]}, programs["update"])
    if "logprobs_teacher" in programs:  # beside it: everything but the teacher, its argument
        phases["logprobs_teacher"] = ({"params": sizes["params"], "adapters": sizes["adapters"],
                                       "opt_state": sizes["opt_state"], "reference": sizes["reference"],
                                       "step_rows": sizes["step_rows"]}, programs["logprobs_teacher"])
    for name, (resident, _) in phases.items():  # the frozen teacher stays on the devices throughout
        if name != "logprobs_teacher":
            resident["teacher"] = sizes.get("teacher", 0)
    return phases


def check(config, *, devices: int | None = None, model_shape: str | None = None,
          prompt_tokens: int = 512, compile_programs: bool = True, memory_per_device: int | None = None) -> dict:
    """The figures `check` prints, as a JSON-able dict (bytes are per device). ConfigError on a bad config."""
    import jax

    from grpo_jax import config as config_lib
    from grpo_jax.model import lora as lora_lib
    from grpo_jax.training import run_context
    from grpo_jax.distributed import sharding
    from grpo_jax.sampling import sampler as sampler_lib

    g, c = config.grpo, config.sampling.max_new_tokens
    model_config, source, stop_ids, pad_id = resolve_shape(config, model_shape)
    if model_config.num_layers > _MANY_LAYERS:  # not silent for minutes: say what is slow and why
        logging.getLogger("grpo_jax").warning(
            "check: %d layers (from %s): the abstract build takes ~0.07 s a layer on a CPU, and compiling the "
            "programs much longer, so this check runs for minutes; --no-compile gives the state figures sooner",
            model_config.num_layers, source)
    all_devices = jax.devices()
    n = devices or len(all_devices)
    if n > len(all_devices):
        raise config_lib.ConfigError(f"--devices={n} but this process has {len(all_devices)} devices")
    # The trainer's own refusals and device split (off_policy.rollout_devices), with train's words.
    _, rollout_devices = run_context.split_devices(config, all_devices[:n])
    mesh = run_context.configured_mesh(config, all_devices[:n])
    run_context.check_batch_fits_mesh(config, mesh)
    try:
        prompt_len = sampler_lib.bucket_length(prompt_tokens, run_context.PROMPT_BUCKETS)
    except ValueError as e:
        raise config_lib.ConfigError(f"--prompt-tokens={prompt_tokens}: {e}") from None
    seq, rows = prompt_len + c, g.prompts_per_step * g.num_generations
    local_rows = rows // sharding.batch_size_multiple(mesh)

    st = abstract_state(config, model_config, mesh)
    tensor, kv_heads = mesh.shape["tensor"], model_config.num_kv_heads
    kv_local = kv_heads // tensor if kv_heads % tensor == 0 else kv_heads  # the cache's heads follow k_proj
    act_bytes = 2 if model_config.dtype == "bfloat16" else 4
    # The step's rows during the log-prob pass and the update (phases.device_rows): tokens and
    # attention [S], completion mask and sampler log-probs [C], an advantage, ref / old log-probs [C].
    per_row = 4 * (2 * seq + 2 * c + 1) + 4 * c * ((g.beta > 0) + (config.resolved_old_logprobs() == "recompute"))
    if g.teacher_model_name_or_path:  # the teacher's log-probs [C], or top-k log-probs and ids [C, K]
        per_row += 4 * c * (1 if g.loss_top_k == 0 else 2 * g.loss_top_k)
    kv_per_token = model_config.num_layers * 2 * kv_local * model_config.head_dim * act_bytes
    cache_tokens = local_rows * seq
    if config.sampling.resolved_engine() == "continuous":  # its slots, plus the prompt store
        row_devices = sharding.batch_size_multiple(mesh)
        m_local = sampler_lib.prefill_rows(g.prompts_per_step, g.num_generations, row_devices) // row_devices
        slots = target_slots(config, rows, row_devices)
        cache_tokens = slots * seq + m_local * prompt_len
    trainable = st.params if st.lora is None else st.adapters
    sizes = {
        "params": bytes_per_device(st.params),
        "adapters": bytes_per_device(st.adapters) if st.lora is not None else 0,
        "opt_state": bytes_per_device(st.opt_state),
        "reference": bytes_per_device(st.ref) if st.ref is not None else 0,
        "teacher": bytes_per_device(st.teacher[1]) if st.teacher is not None else 0,
        "gradients": bytes_per_device(trainable),  # float32 in the trainable's layout, inside the update's temp
        "kv_cache": cache_tokens * kv_per_token,
        "decode_weights": bytes_per_device(decode_copy(st, model_config))
        if st.separate_decode_copy else 0,
        "step_rows": local_rows * per_row,
    }
    state = sizes["params"] + sizes["adapters"] + sizes["opt_state"] + sizes["reference"] + sizes["teacher"]

    programs = {}
    if compile_programs:
        programs = compiled_programs(config, model_config, mesh, st, prompt_len=prompt_len,
                                     stop_ids=stop_ids, pad_id=pad_id)
        phases = phase_peaks(sizes, programs, st.separate_decode_copy)
        phase_bytes = {name: sum(res.values()) + prog.peak for name, (res, prog) in phases.items()}
        peak_name = max(phase_bytes, key=phase_bytes.get)
        res, prog = phases[peak_name]
        parts = ", ".join([f"{k} {gib(v)}" for k, v in res.items() if v] + [f"{prog.name} program {gib(prog.peak)}"])
    else:  # lower bounds: the arrays above without any program's scratch
        phase_bytes = {"rollout (no temp)": state + sizes["decode_weights"] + sizes["kv_cache"],
                       "update (no temp)": state + sizes["gradients"] + sizes["step_rows"]}
        peak_name = max(phase_bytes, key=phase_bytes.get)
        parts = "state, sampler copy and KV cache or gradients; no program compiled (--no-compile)"
    if memory_per_device is None and jax.default_backend() != "cpu":
        memory_per_device = (all_devices[0].memory_stats() or {}).get("bytes_limit")
    peak = phase_bytes[peak_name]
    return {
        "backend": jax.default_backend(),
        "device_kind": all_devices[0].device_kind,
        "devices": n,
        "mesh": dict(mesh.shape),
        "rollout_devices": _rollout_figures(config, st, rollout_devices, rows, seq, kv_heads, model_config, act_bytes),
        "model": {"source": source, "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(st.params)),
                  "trainable_params": lora_lib.count(trainable),
                  "lora_r": config.lora.r,
                  "num_layers": model_config.num_layers, "hidden_size": model_config.hidden_size,
                  "num_heads": model_config.num_heads, "num_kv_heads": kv_heads, "vocab_size": model_config.vocab_size,
                  "dtype": model_config.dtype, "param_dtype": model_config.param_dtype},
        "rollout": {"rows": rows, "prompt_tokens": prompt_len, "new_tokens": c, "rows_per_device": local_rows,
                    "update_rows_per_micro_batch": rows // (g.num_minibatches * g.grad_accum_steps),
                    "micro_batches": g.grad_accum_steps},
        "per_device_bytes": sizes,
        "state_bytes": state + sizes["gradients"],
        # What training adds to the weights: the trainable params, their gradients and Adam state.
        "trainable_state_bytes": bytes_per_device(trainable) + sizes["opt_state"] + sizes["gradients"],
        "programs": {k: {**dataclasses.asdict(p), "peak": p.peak} for k, p in programs.items()},
        "phases": phase_bytes,
        "peak": {"phase": peak_name, "bytes": peak, "parts": parts},
        "memory_per_device": memory_per_device,
        "fits": None if memory_per_device is None else peak <= memory_per_device,
        "weights": weight_specs(st.params, sharding.param_specs(mesh, st.params),
                                sharding.param_specs(mesh, st.params, decode=True)),
    }


def _rollout_figures(config, st, rollout_devices, rows, seq, kv_heads, model_config, act_bytes) -> dict | None:
    """off_policy.rollout_devices: the sampler's own devices, each with whole float32 snapshots of the
    policy (one per step of off_policy.max_staleness; grpo_jax.training.async_rollouts) and the KV cache of its
    share of the rows. None when the sampler shares the trainer's devices."""
    import jax

    if not rollout_devices:
        return None
    r = len(rollout_devices)
    weights = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(st.params))  # LoRA: the merged policy, same shapes
    kv = (rows // r) * seq * model_config.num_layers * 2 * kv_heads * model_config.head_dim * act_bytes
    return {"devices": r, "rows_per_device": rows // r,
            "snapshot_bytes_per_device": weights * config.off_policy.max_staleness, "kv_cache_bytes_per_device": kv}


# ----------------------------------------------------------------------------------------------
# Printing.

def format_report(f: dict) -> str:
    m, r, b = f["model"], f["rollout"], f["per_device_bytes"]
    mesh = " ".join(f"{k}={v}" for k, v in f["mesh"].items())
    split = f.get("rollout_devices")
    where = "" if not split else (
        f"; rollouts on {split['devices']} more device(s) of their own (off_policy.rollout_devices): "
        f"{split['rows_per_device']} rows each, {gib(split['snapshot_bytes_per_device'])} of policy snapshots "
        f"+ {gib(split['kv_cache_bytes_per_device'])} KV cache per device")
    trainer = f["devices"] - (split["devices"] if split else 0)
    lines = [f"check {f.get('config_file', '')}: {f['devices']} {f['backend']} device(s) ({f['device_kind']}), "
             f"mesh {mesh}" + (f" over the trainer's {trainer}" if split else "") + where,
             f"model: {count(m['num_params'])} params from {m['source']} ({m['num_layers']} layers, "
             f"d={m['hidden_size']}, {m['num_heads']}/{m['num_kv_heads']} heads, vocab {m['vocab_size']}, "
             f"compute {m['dtype']})",
             f"rollout: {r['rows']} rows ({r['rows_per_device']} per device) x ({r['prompt_tokens']} prompt + "
             f"{r['new_tokens']} new tokens); update: {r['micro_batches']} micro-batch(es) of "
             f"{r['update_rows_per_micro_batch']} rows", "",
             "per device                      bytes          GiB"]
    frozen = m.get("lora_r", 0) > 0
    labels = {"params": "frozen base (LoRA)" if frozen else "params (fp32 masters)",
              "adapters": f"LoRA adapters (r={m.get('lora_r')})", "opt_state": "Adam state", "reference": "reference",
              "teacher": "teacher (distillation)",
              "gradients": "gradients (in update temp)", "kv_cache": "KV cache (P+C tokens)",
              "decode_weights": "sampler weights copy", "step_rows": "step's row arrays"}
    lines += [f"  {labels[k]:<28}{v:>14,} {v / 2**30:>9.3f}" for k, v in b.items()
              if (k != "adapters" or frozen) and (k != "teacher" or v)]
    state_label = "params+Adam+ref+teacher+grads" if b.get("teacher") else "params+Adam+ref+grads"
    lines.append(f"  {state_label:<28}{f['state_bytes']:>14,} {f['state_bytes'] / 2**30:>9.3f}")
    lines.append(f"  {'trainable (+Adam, grads)':<28}{f['trainable_state_bytes']:>14,} "
                 f"{f['trainable_state_bytes'] / 2**30:>9.3f}   ({count(m['trainable_params'])} params train)")
    if f["programs"]:
        lines += ["", "compiled programs (per device)   argument     output      alias       temp   "
                      "in use   compile"]
        for name, p in f["programs"].items():
            lines.append(f"  {name:<28}" + "".join(f"{gib(p[k]):>11}" for k in ("argument", "output", "alias",
                                                                                 "temp", "peak"))
                         + f"  {p['compile_s']:6.1f} s")
    lines += ["", "phase peaks (resident state + program in use)" if f["programs"] else
              "phase lower bounds (no program compiled)"]
    lines += [f"  {name:<28}{gib(v):>11}" for name, v in f["phases"].items()]
    lines += ["", "weights                   shape              count  training layout            | sampler layout"]
    for w in f["weights"]:
        lines.append(f"  {w['name']:<24}{w['shape']!s:<19}{w['count']:>5}  {w['train']:<27}| {w['decode']}")
    p, limit = f["peak"], f["memory_per_device"]
    verdict = "no limit given" if limit is None else (
        f"fits {gib(limit)}" if f["fits"] else f"EXCEEDS {gib(limit)}")
    lines += ["", f"summary: {count(m['num_params'])} params on {f['devices']} devices ({mesh}): peak "
                  f"{gib(p['bytes'])} per device in the {p['phase']} phase; {verdict}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_jax check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
