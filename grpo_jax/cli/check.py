"""python -m grpo_jax check: will this config fit? Built abstractly, compiled, nothing allocated.

    python -m grpo_jax check --config configs/arith_cpu.py
    python -m grpo_jax check --config configs/qwen25_05b_gpu.py --model-shape qwen2.5-0.5b --devices 8
    python -m grpo_jax check --config configs/tpu_pod.py --model-shape qwen2.5-7b --devices 16 \\
        --set mesh.data=1 --set mesh.fsdp=4 --set mesh.tensor=4 --memory-per-device 16GiB
    python -m grpo_jax check --config configs/qwen3_30b_a3b_tpu.py --model-shape qwen3-30b-a3b \\
        --devices 64 --memory-per-device 95GiB

The run is built as `train` builds it (run_context: mesh, sampler, optimizer, update and log-prob
functions, sharding tables) but from `jax.eval_shape` of the params, Adam state and reference, so
no weight is allocated and no checkpoint is read. The shape comes from `model.hf_path`'s
config.json when that directory exists, else from `--model-shape` (`MODEL_SHAPES`), else from the
config's `model.*` shape fields. The update, the log-prob pass and the rollout's prefill and decode
are lowered and compiled for the config's mesh on N devices (`--devices`, default all; fake CPU
devices in a subprocess when the machine has fewer), at the config's sizes: prompts_per_step * G
rows of `--prompt-tokens` (rounded up to the sampler's bucket) + sampling.max_new_tokens.

Printed per device: params, Adam state, reference, gradients, KV cache, the sampler's decode-layout
weights, the step's row arrays, for a MoE model one sparse layer's (token, choice) pairs in the
update and the log-prob pass (`check_moe`; with --no-compile the only scratch in the lower
bounds), each compiled program's argument / output / alias / temp bytes
(`compiled.memory_analysis()`), each phase's peak (what lives then plus the program running), the
PartitionSpec of every weight, and the peak against `--memory-per-device` (default: the devices'
own limit on an accelerator, none on CPU). Argument and output sizes are exact on any backend (the
SPMD partitioner fixes every per-device shape); temp sizes come from the backend that compiled. A
CPU compile estimates a TPU/GPU one (other fusions, no memory-driven rematerialisation); a compile
on the target is exact for that program. Not counted: held-out evaluation rollouts, the runtime's
own overhead and fragmentation (on a GPU give XLA's pool, not the card: XLA_PYTHON_CLIENT_MEM_FRACTION).

With sampling.engine="vllm" the rollout runs on vLLM, not on our sampler: no prefill or decode
program is compiled and no KV cache is counted on JAX's side. A colocated engine
(vllm_mode="colocate") takes vllm_gpu_memory_utilization of each device: give --memory-per-device
the whole device then; the update's peak is judged against the fraction JAX keeps beside it, and
the engine's share must hold its weights plus one max-length sequence's KV cache (`check_engine`).

Exit status: 0, 2 for a config error ("config error: ..."), 3 when the peak exceeds
--memory-per-device (with a colocated vLLM engine: JAX's share of it, or the engine's share is too
small for the engine), 1 for anything else.
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

from grpo_jax.config.batch_plan import BatchPlan  # pure arithmetic: no jax before the device flags
from grpo_jax.cli.check_report import count, format_report, gib, weight_specs  # noqa: F401 (re-exported)
from grpo_jax.cli.check_shapes import MODEL_SHAPES, resolve_shape  # noqa: F401 (re-exported)

EXIT_CONFIG, EXIT_TOO_BIG = 2, 3
_MANY_LAYERS = 256  # more than any public model (Llama 3.1 405B: 126); building them takes minutes
_CHILD_ENV = "GRPO_CHECK_FAKE_DEVICES"  # set in the re-executed child: do not re-exec again
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184; GiB/MiB/KiB (and bare G/M/K) are powers of 2, GB/MB/KB of 10."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 16GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a Python file with get_config() -> Config")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable)")
    parser.add_argument("--devices", type=int, help="devices of the mesh (default: this machine's); more than "
                        "the machine has: fake CPU devices in a subprocess")
    parser.add_argument("--memory-per-device", type=parse_bytes, metavar="SIZE",
                        help="budget per device, e.g. 16GiB (default: the device's limit; none on CPU); with a "
                        "colocated vLLM engine the whole device, which it shares with JAX")
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
        print(too_big_message(figures), file=sys.stderr)
        return EXIT_TOO_BIG
    return 0


def too_big_message(figures: dict) -> str:
    """Why the run does not fit: the update's peak over its budget, the engine's share too small, or both."""
    p, engine, lines = figures["peak"], figures.get("vllm"), []
    if engine and engine["engine_fits"] is False:
        needs = engine["needs"]
        lines.append(f"too small: sampling.vllm_gpu_memory_utilization={engine['utilization']} gives the vLLM engine "
                     f"{gib(engine['engine_bytes'])} per device < {gib(needs['needs_bytes'])} for its "
                     f"{needs['dtype']} weights ({gib(needs['weights_bytes'])}) and one {needs['sequence_tokens']}"
                     f"-token sequence's KV cache ({gib(needs['kv_cache_bytes'])}); raise it")
    if p["bytes"] > figures["budget"]:
        where = f"--memory-per-device {gib(figures['memory_per_device'])}"
        if engine and engine["mode"] == "colocate":
            where = (f"the {gib(figures['budget'])} JAX keeps beside the colocated vLLM engine "
                     f"(XLA_PYTHON_CLIENT_MEM_FRACTION={engine['jax_fraction']:.2f} of "
                     f"--memory-per-device {gib(figures['memory_per_device'])})")
        lines.append(f"too big: the {p['phase']} phase needs {gib(p['bytes'])} per device ({p['parts']}) > {where}")
    return "\n".join(lines)


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
# The check.

def bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract tree (ShapeDtypeStructs with shardings; even splits)."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class Abstract:
    """The run's state as shapes and shardings: what `run_context.build` allocates, built by the
    same code (`trainable.build_training(abstract=True)`)."""

    graphdef: object
    training: object  # trainable.Training: the policy, optimizer and the trainer's step functions
    state: object  # run_context.RunState of ShapeDtypeStructs: trainable params, opt_state, reference, base
    decode_shardings: object  # the sampler's layout (sharding.decode_param_shardings)
    separate_decode_copy: bool  # whether the sampler's weights are a second copy
    teacher: object | None = None  # on-policy distillation: (graphdef, frozen params), grpo_jax.training.teacher

    @property
    def params(self):
        """The model's params in the training layout: what trains, or the frozen base adapters merge into."""
        return self.state.params if self.state.base_params is None else self.state.base_params

    @property
    def adapters(self):
        """What trains when it is not the model's params (adapters), else None."""
        return None if self.state.base_params is None else self.state.params


def abstract_state(config, model_config, mesh) -> Abstract:
    """The run as `run_context.build` makes it, over `jax.eval_shape` params: the trainer's
    policy, optimizer state, reference and step functions (`trainable.build_training`)."""
    from grpo_jax.distributed import sharding
    from grpo_jax.training import run_context
    from grpo_jax.training import teacher as teacher_lib
    from grpo_jax.training import trainable

    graphdef, params = run_context.abstract_model(model_config, mesh, config.model.init_seed)
    tr = trainable.build_training(config, mesh, model_config, graphdef, params, abstract=True)
    # The state GRPO's steps run with, as run_state.initial_state makes it (after the SFT warm-up).
    fresh = run_context.RunState(step=0, data_position=0, params=tr.params, opt_state=tr.opt_state,
                                 ref_params=None, base_params=tr.base)
    state = tr.policy.after_warm_up(fresh, tr.policy.warm_up_params(fresh), mesh=mesh, abstract=True,
                                    ref_dtype=run_context.reference_dtype(config), uses_reference=config.grpo.beta > 0,
                                    warmed_up=config.sft.steps > 0)
    model = state.params if state.base_params is None else state.base_params
    # jax.device_put into an equivalent layout moves nothing (fsdp=1: the two layouts coincide).
    return Abstract(graphdef, tr, state, sharding.decode_param_shardings(mesh, model),
                    tr.policy.sampler_copy_is_separate(mesh, model),
                    teacher=teacher_lib.abstract_teacher(config, mesh, model_config.vocab_size))


def _trainer_mesh(config, devices: int | None):
    """(mesh, the sampler's own devices, every device here): the trainer's refusals and device
    split (off_policy.rollout_devices), with train's words, on the first `devices` devices."""
    import jax

    from grpo_jax import config as config_lib
    from grpo_jax.training import run_context

    all_devices = jax.devices()
    n = devices or len(all_devices)
    if n > len(all_devices):
        raise config_lib.ConfigError(f"--devices={n} but this process has {len(all_devices)} devices")
    _, rollout_devices = run_context.split_devices(config, all_devices[:n])
    mesh = run_context.configured_mesh(config, all_devices[:n])
    run_context.check_batch_fits_mesh(config, mesh)
    return mesh, rollout_devices, all_devices[:n]


def per_device_sizes(config, model_config, mesh, st: Abstract, *, prompt_len: int) -> dict[str, int]:
    """Bytes per device of the state, the KV cache, the sampler's weights and the step's rows."""
    from grpo_jax.cli import check_moe, check_programs
    from grpo_jax.distributed import sharding
    from grpo_jax.sampling import sampler as sampler_lib

    g, c = config.grpo, config.sampling.max_new_tokens
    plan = BatchPlan.of(g, sharding.batch_size_multiple(mesh))
    seq = prompt_len + c
    tensor, kv_heads = mesh.shape["tensor"], model_config.num_kv_heads
    kv_local = kv_heads // tensor if kv_heads % tensor == 0 else kv_heads  # the cache's heads follow k_proj
    act_bytes = 2 if model_config.dtype == "bfloat16" else 4
    # The step's rows during the log-prob pass and the update (phases.device_rows): tokens and
    # attention [S], completion mask and sampler log-probs [C], an advantage, ref / old log-probs [C].
    per_row = 4 * (2 * seq + 2 * c + 1) + 4 * c * ((g.beta > 0) + (config.resolved_old_logprobs() == "recompute"))
    if g.teacher_model_name_or_path:  # the teacher's log-probs [C], or top-k log-probs and ids [C, K]
        per_row += 4 * c * (1 if g.loss_top_k == 0 else 2 * g.loss_top_k)
    kv_per_token = model_config.num_layers * 2 * kv_local * model_config.head_dim * act_bytes
    cache_tokens = plan.rows_per_device * seq
    if config.sampling.engine == "vllm":  # the engine's KV cache lives in its own share (check_engine)
        cache_tokens = 0
    if config.sampling.resolved_engine() == "continuous":  # its slots, plus the prompt store
        m_local = sampler_lib.prefill_rows(g.prompts_per_step, g.num_generations, plan.row_devices) // plan.row_devices
        slots = check_programs.target_slots(config, plan.rows, plan.row_devices)
        cache_tokens = slots * seq + m_local * prompt_len
    return {
        "params": bytes_per_device(st.params),
        "adapters": bytes_per_device(st.adapters) if st.adapters is not None else 0,
        "opt_state": bytes_per_device(st.state.opt_state),
        "reference": bytes_per_device(st.state.ref_params) if st.state.ref_params is not None else 0,
        "teacher": bytes_per_device(st.teacher[1]) if st.teacher is not None else 0,
        # float32 in the trainable's layout, inside the update's temp
        "gradients": bytes_per_device(st.state.params),
        "kv_cache": cache_tokens * kv_per_token,
        "decode_weights": bytes_per_device(check_programs.decode_copy(st, model_config))
        if st.separate_decode_copy and config.sampling.engine != "vllm" else 0,
        "step_rows": plan.rows_per_device * per_row,
        # MoE: one sparse layer's (token, choice) pairs, inside the update's and the log-prob pass's temp.
        **check_moe.moe_pairs(config, model_config, plan.row_devices, mesh.shape["expert"], prompt_len=prompt_len,
                              runs_logprob_pass=g.beta > 0 or config.resolved_old_logprobs() == "recompute"),
    }


def check(config, *, devices: int | None = None, model_shape: str | None = None,
          prompt_tokens: int = 512, compile_programs: bool = True, memory_per_device: int | None = None) -> dict:
    """The figures `check` prints, as a JSON-able dict (bytes are per device). ConfigError on a bad config."""
    import jax

    from grpo_jax import config as config_lib
    from grpo_jax.cli import check_engine, check_programs
    from grpo_jax.sampling import sampler as sampler_lib
    from grpo_jax.training import run_context

    model_config, source, stop_ids, pad_id = resolve_shape(config, model_shape)
    config.mesh.check_model(model_config.num_experts)
    if model_config.num_layers > _MANY_LAYERS:  # not silent for minutes: say what is slow and why
        logging.getLogger("grpo_jax").warning(
            "check: %d layers (from %s): the abstract build takes ~0.07 s a layer on a CPU, and compiling the "
            "programs much longer, so this check runs for minutes; --no-compile gives the state figures sooner",
            model_config.num_layers, source)
    mesh, rollout_devices, devices_used = _trainer_mesh(config, devices)
    try:
        prompt_len = sampler_lib.bucket_length(prompt_tokens, run_context.PROMPT_BUCKETS)
    except ValueError as e:
        raise config_lib.ConfigError(f"--prompt-tokens={prompt_tokens}: {e}") from None
    st = abstract_state(config, model_config, mesh)
    sizes = per_device_sizes(config, model_config, mesh, st, prompt_len=prompt_len)
    state = sizes["params"] + sizes["adapters"] + sizes["opt_state"] + sizes["reference"] + sizes["teacher"]
    programs = {}
    if compile_programs:
        programs = check_programs.compiled_programs(config, model_config, mesh, st, prompt_len=prompt_len,
                                                    stop_ids=stop_ids, pad_id=pad_id)
        phases = check_programs.phase_peaks(sizes, programs, st.separate_decode_copy)
        phase_bytes = {name: sum(res.values()) + prog.peak for name, (res, prog) in phases.items()}
        peak_name = max(phase_bytes, key=phase_bytes.get)
        res, prog = phases[peak_name]
        parts = ", ".join([f"{k} {gib(v)}" for k, v in res.items() if v] + [f"{prog.name} program {gib(prog.peak)}"])
    else:  # lower bounds: the arrays above, of the programs' scratch only a MoE layer's pairs
        phase_bytes = {"rollout (no temp)": state + sizes["decode_weights"] + sizes["kv_cache"],
                       "update (no temp)": state + sizes["gradients"] + sizes["step_rows"]
                       + sizes["moe_pairs_update"]}
        if sizes["moe_pairs_logprobs"]:
            phase_bytes["logprobs (no temp)"] = state + sizes["step_rows"] + sizes["moe_pairs_logprobs"]
        peak_name = max(phase_bytes, key=phase_bytes.get)
        parts = ("state, sampler copy and KV cache or gradients (a MoE layer's pairs); no program compiled "
                 "(--no-compile)")
    if memory_per_device is None and jax.default_backend() != "cpu":
        memory_per_device = (devices_used[0].memory_stats() or {}).get("bytes_limit")
        if check_engine.colocated(config):  # the engine's share and JAX's are both of the whole device
            memory_per_device = check_engine.whole_device(memory_per_device, jax.default_backend())
    engine = check_engine.engine_share(config, model_config, device_bytes=memory_per_device, prompt_len=prompt_len)
    peak = {"phase": peak_name, "bytes": phase_bytes[peak_name], "parts": parts}
    return _figures(config, model_config, mesh, st, source=source, devices=devices_used,
                    rollout_devices=rollout_devices, prompt_len=prompt_len, sizes=sizes, state_bytes=state,
                    programs=programs, phase_bytes=phase_bytes, peak=peak, memory_per_device=memory_per_device,
                    engine=engine)


def _figures(config, model_config, mesh, st: Abstract, *, source, devices, rollout_devices, prompt_len, sizes,
             state_bytes, programs, phase_bytes, peak, memory_per_device, engine=None) -> dict:
    """`check`'s figures dict from its parts (module docstring: what each one counts). `engine`:
    check_engine.engine_share's figures (sampling.engine="vllm"), whose `jax_bytes` is the budget."""
    import jax

    from grpo_jax.distributed import sharding
    from grpo_jax.training import policy as policy_lib

    g, c = config.grpo, config.sampling.max_new_tokens
    plan = BatchPlan.of(g, sharding.batch_size_multiple(mesh))
    act_bytes = 2 if model_config.dtype == "bfloat16" else 4
    trainable = st.state.params
    budget = memory_per_device if engine is None else engine["jax_bytes"]
    fits = None if budget is None else peak["bytes"] <= budget
    if engine is not None and engine["engine_fits"] is False:
        fits = False
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "mesh": dict(mesh.shape),
        "rollout_devices": _rollout_figures(config, st, rollout_devices, plan.rows, prompt_len + c,
                                            model_config.num_kv_heads, model_config, act_bytes),
        "model": {"source": source, "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(st.params)),
                  "trainable_params": policy_lib.trainable_count(trainable),
                  "lora_r": config.lora.r,
                  "num_layers": model_config.num_layers, "hidden_size": model_config.hidden_size,
                  "num_heads": model_config.num_heads, "num_kv_heads": model_config.num_kv_heads,
                  "vocab_size": model_config.vocab_size, "dtype": model_config.dtype,
                  "param_dtype": model_config.param_dtype},
        "rollout": {"rows": plan.rows, "prompt_tokens": prompt_len, "new_tokens": c,
                    "rows_per_device": plan.rows_per_device, "update_rows_per_micro_batch": plan.rows_per_micro_batch,
                    "micro_batches": plan.micro_batches},
        "per_device_bytes": sizes,
        "state_bytes": state_bytes + sizes["gradients"],
        # What training adds to the weights: the trainable params, their gradients and Adam state.
        "trainable_state_bytes": bytes_per_device(trainable) + sizes["opt_state"] + sizes["gradients"],
        "programs": {k: {**dataclasses.asdict(p), "peak": p.peak} for k, p in programs.items()},
        "phases": phase_bytes,
        "peak": peak,
        "memory_per_device": memory_per_device,
        "vllm": engine,
        "budget": budget,
        "fits": fits,
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
    weights = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(st.params))  # adapters: the merged policy, same shapes
    kv = (rows // r) * seq * model_config.num_layers * 2 * kv_heads * model_config.head_dim * act_bytes
    return {"devices": r, "rows_per_device": rows // r,
            "snapshot_bytes_per_device": weights * config.off_policy.max_staleness, "kv_cache_bytes_per_device": kv}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_jax check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
