"""Command line: flags to a config to `train.run`; nothing else.

python -m grpo_jax train --config configs/arith_cpu.py [--set grpo.beta=0.04 ...] [--resume | --overwrite]
python -m grpo_jax eval --config FILE [--checkpoint RUN_DIR | --hf DIR] --data gsm8k|math500|PATH [--limit K]
python -m grpo_jax check --config FILE [--set ...] [--devices N] [--memory-per-device 16GiB]
python -m grpo_jax vllm-serve --config FILE [--set ...] [--host H] [--port P]   (sampling.vllm_mode=server)

Exit status: 0 when the run finished, 75 (EX_TEMPFAIL: run it again with --resume) when SIGTERM,
Ctrl-C or train.stop_after_steps stopped it after saving a checkpoint, 2 for a config or run
directory error, 1 for any other error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv=None) -> int:
    """Parses `argv` and runs the command; returns the exit status (module docstring)."""
    args = _parser().parse_args(argv)
    if args.command == "check":  # no jax.distributed, no platform check: checking a pod config here is the point
        from grpo_jax.cli import check as check_command

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        return check_command.run(args)
    from grpo_jax.distributed import sharding

    sharding.initialize_distributed()  # a no-op unless flags/environment describe several processes
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("jax", "absl", "orbax"):  # backend probing and per-save Orbax chatter
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command == "eval":
        from grpo_jax.cli import eval as eval_command

        return eval_command.run(args)
    if args.command == "vllm-serve":
        from grpo_jax.cli import vllm_serve

        return vllm_serve.run(args)
    return _train(args)


def _parser() -> argparse.ArgumentParser:
    """The commands and their flags; `train --help` lists every config field by section."""
    parser = argparse.ArgumentParser(
        prog="python -m grpo_jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    from grpo_jax.cli import check as check_command
    from grpo_jax.cli import eval as eval_command

    evaluate = sub.add_parser("eval", help="pass@k, maj@k and greedy accuracy of a policy on a data set",
                              description=eval_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    eval_command.add_arguments(evaluate)
    check = sub.add_parser("check", help="build a config abstractly and report its memory per device",
                           description=check_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check_command.add_arguments(check)
    from grpo_jax.cli import vllm_serve

    serve = sub.add_parser("vllm-serve", help="the vLLM engine process of sampling.vllm_mode=server",
                           description=vllm_serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vllm_serve.add_arguments(serve)
    return parser


def _add_train(sub) -> None:
    from grpo_jax.config import describe_fields
    from grpo_jax.tasks import describe_task_options

    train = sub.add_parser(
        "train", help="run SFT warm-up (if configured) then GRPO", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config sections and their fields (--set SECTION.FIELD=VALUE; tuples as a comma list a,b or JSON, "
        "dicts as JSON):\n" + describe_fields()
        + "\n\ntask options (--set task.options.NAME=VALUE, read as JSON where it parses):\n" + describe_task_options())
    train.add_argument("--config", required=True, help="a Python file with get_config() -> Config")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       help="override one config field (repeatable)")
    train.add_argument("--run-dir", help="shortcut for --set train.run_dir=...")
    train.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="replace a previous run in the run directory (its checkpoints and metrics are deleted)")
    train.add_argument("--allow-config-change", action="store_true",
                       help="with --resume: continue even where the config changes what the run means")
    train.add_argument("--allow-cpu", action="store_true",
                       help="run a config that asks for accelerators (a multi-device mesh, bf16, a checkpoint) on CPU")


def _train(args) -> int:
    """`train`: the config (file, then --set), the platform check, then the run and its report."""
    from grpo_jax import config as config_lib

    overrides = list(args.set) + ([f"train.run_dir={args.run_dir}"] if args.run_dir else [])
    try:
        config = config_lib.apply_overrides(config_lib.load_config_file(args.config), overrides)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _share_memory_with_vllm(config)
    refused = _platform_refusal(config, args.allow_cpu)
    if refused:
        return 2
    from grpo_jax.cli import report
    from grpo_jax.io.checkpoint import CheckpointWriteError
    from grpo_jax.io.run_dir import RunDirError
    from grpo_jax.sampling.vllm_engine import EngineError

    try:
        result = report.run_and_report(config, resume=args.resume, overwrite=args.overwrite,
                                       allow_config_change=args.allow_config_change)
    except RunDirError as e:
        print(f"run directory error: {e}", file=sys.stderr)
        return 2
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:  # the last finished step was saved (train.run's save on error)
        print(f"inference engine error: {e}", file=sys.stderr)
        return 1
    except (CheckpointWriteError, OSError) as e:
        return _storage_failure(e)
    if result.stopped_by:
        print(f"stopped at step {result.step} ({result.stopped_by}); continue with --resume", file=sys.stderr)
        return EXIT_STOPPED
    return 0


def _share_memory_with_vllm(config) -> None:
    """A colocated vLLM engine takes sampling.vllm_gpu_memory_utilization of the accelerator; JAX
    would otherwise preallocate 75% of it before vLLM starts. Unless the user set
    XLA_PYTHON_CLIENT_MEM_FRACTION, JAX gets what is left less a 5% margin for both runtimes' own
    overheads. Set before JAX starts its backend (the platform check below does)."""
    s = config.sampling
    if s.engine != "vllm" or s.vllm_mode != "colocate" or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{max(0.05, 0.95 - s.vllm_gpu_memory_utilization):.2f}"


def _platform_refusal(config, allow_cpu: bool) -> bool:
    """A config that expects accelerators, started on a CPU backend (a venv without the CUDA/TPU
    jaxlib), would run, slowly and quietly, on the CPU: refused (True) unless --allow-cpu; the
    verdict, if any, is printed either way."""
    import jax

    from grpo_jax.distributed import platform_check

    verdict = platform_check.backend_verdict(platform_check.accelerator_expected(config), jax.default_backend(),
                                             allow_cpu=allow_cpu, jax_platforms=os.environ.get("JAX_PLATFORMS"))
    if verdict is None:
        return False
    print(verdict.message, file=sys.stderr)
    return verdict.action == "refuse"


def _storage_failure(error: BaseException) -> int:
    """A checkpoint that could not be written, or a full disk: one line, then exit 1 at once. Not
    through the interpreter's shutdown: Orbax's abandoned writes and the writers' atexit handlers
    (TensorBoard's) would print a traceback each on the same full disk."""
    import errno

    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__context__
    from grpo_jax.io.checkpoint import CheckpointWriteError

    written = next((c for c in chain if isinstance(c, CheckpointWriteError)), None)
    full = next((c for c in chain if isinstance(c, OSError) and c.errno == errno.ENOSPC), None)
    if written is None and full is None:
        raise error
    line = (f"checkpoint error: {written}" if written is not None else
            f"disk full: {full} (free space there, or set train.run_dir on a bigger disk; then --resume)")
    print(line, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: not finished, safe to run again (with --resume)


if __name__ == "__main__":
    sys.exit(main())
