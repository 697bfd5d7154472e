"""python -m grpo_jax eval: pass@1, pass@k, maj@k and greedy accuracy of a policy on a data set.

    python -m grpo_jax eval --config configs/qwen25_05b_gpu.py --hf /models/Qwen2.5-0.5B-Instruct --data gsm8k
    python -m grpo_jax eval --checkpoint runs/qwen25_05b_gpu --data math500 --num-samples 8 --ks 1,8
    python -m grpo_jax eval --config configs/arith_cpu.py --checkpoint runs/arith_cpu   # the task's held-out set

The policy: `--checkpoint RUN_DIR` (that run's newest checkpoint that loads, or `--step N`; the
config defaults to RUN_DIR/config.json), `--hf DIR` (a Hugging Face directory; `model.hf_path=DIR`
and its own tokenizer unless `--set model.tokenizer=...`), or neither (the config's model as it
starts: a baseline). The data: `--data gsm8k` / `--data math500` (shipped with grpo_jax), a JSONL or
Parquet file, or none (the configured task's own held-out examples). A file is read with the
configured jsonl task's fields (`eval_question_field`, else `question_field`, ...) unless
`--question-field` / `--answer-field` / `--answer-format` say otherwise; prompts and checking follow
the configured task's `template` and `eval_answer_location` (by default the lenient reading when the
task trains on `\\boxed{}`; plain and `\\boxed{}` for other tasks).

The figures come from `grpo_jax.training.rollout.evaluate`, the trainer's held-out evaluation: the same
sampler, prompt encoding, checker and sampling keys (`train.seed` folded with the checkpoint's step,
as the trainer does at that step). Defaults are the config's `eval.num_samples`, `eval.ks`,
`eval.temperature`, `eval.greedy` and `sampling.max_new_tokens`.

`--hf DIR` alone (no --config) takes everything from the checkpoint: the model, its tokenizer and
stop ids, its chat template (text questions are asked as user turns when it has one), and
generation_config.json's max_new_tokens (else 512) and temperature (else 1.0).

Written to `--out` (default beside the policy: RUN_DIR/eval/<data>-step<N> with --checkpoint,
DIR/eval/<data> with --hf, else runs/eval/<data>); a directory holding a result is refused without
`--overwrite`:
  summary.json   the figures, counts and settings (keys below)
  samples.jsonl  one line per question: reference, prompt, every sampled completion (its extracted
                 answer, correct, truncated, length in tokens) and the greedy one
Exit status: 0, 2 for a config error (printed as "config error: ..."), 1 for anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np

log = logging.getLogger("grpo_jax")

def _no_run_dir(run_dir) -> str:
    return (f"--checkpoint {run_dir}: no such directory; give the train.run_dir of a training run "
            "(it holds checkpoints/ and config.json)")


# Where the trainer keeps a run's checkpoints and what their "state" item holds
# (run_state.ckpt_dir_of, checkpoint.CheckpointManager.save, run_state._checkpoint_state).
_CHECKPOINTS, _STATE_ITEM, _PARAMS_KEY = "checkpoints", "state", "params"
_EVAL_BATCH = 64  # questions per sampler call, as the trainer's held-out evaluation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a Python file with get_config() -> Config (default with --checkpoint: "
                        "RUN_DIR/config.json)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable)")
    policy = parser.add_mutually_exclusive_group()
    policy.add_argument("--checkpoint", metavar="RUN_DIR", help="restore the policy from this run's checkpoints")
    policy.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory (config.json, "
                        "*.safetensors, tokenizer.json)")
    parser.add_argument("--step", type=int, help="with --checkpoint: this step rather than the newest that loads")
    parser.add_argument("--data", help="gsm8k, math500, or a JSONL / Parquet file (default: the configured "
                        "task's held-out examples)")
    parser.add_argument("--question-field", help="the data file's question field")
    parser.add_argument("--answer-field", help="the data file's reference answer field")
    parser.add_argument("--answer-format", help="how the reference is written: auto, gsm8k, boxed or raw")
    parser.add_argument("--num-samples", type=int, help="answers per question for pass@k / maj@k (eval.num_samples)")
    parser.add_argument("--ks", help="comma-separated k for pass@k and maj@k, e.g. 1,8 (eval.ks)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (eval.temperature)")
    parser.add_argument("--limit", type=int, help="only the first K questions")
    parser.add_argument("--out", help="output directory for summary.json and samples.jsonl (default: beside the "
                        "policy, RUN_DIR/eval/<data>-step<N> or DIR/eval/<data>; else runs/eval/<data>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier result in the output directory")


def run(args: argparse.Namespace) -> int:
    """Runs the evaluation `args` describe (see the module docstring); returns the exit status."""
    from grpo_jax import config as config_lib

    try:
        return _run(args)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------------------
# Config, data and policy.


def eval_config(args: argparse.Namespace):
    """The config the evaluation runs with: the file (or the run's config.json), --set, the flags."""
    from grpo_jax import config as config_lib

    if args.config:
        base = config_lib.load_config_file(args.config)
    elif args.checkpoint:
        path = os.path.join(args.checkpoint, "config.json")
        if not os.path.isdir(args.checkpoint):
            raise config_lib.ConfigError(_no_run_dir(args.checkpoint))
        if not os.path.isfile(path):
            raise config_lib.ConfigError(f"--checkpoint {args.checkpoint}: no config.json there; give --config FILE")
        try:
            with open(path) as f:
                base = config_lib.from_dict(json.load(f))
        except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise config_lib.ConfigError(f"{path}: {e}") from None
    elif args.hf:
        if args.data is None:
            raise config_lib.ConfigError("--hf DIR without --config needs --data (gsm8k, math500 or a JSONL / "
                                         "Parquet file): a checkpoint has no held-out set of its own")
        base = hf_only_config(args.hf)
    else:
        raise config_lib.ConfigError("give --config FILE (or --checkpoint RUN_DIR, whose config.json is used, or "
                                     "--hf DIR alone)")
    if args.step is not None and not args.checkpoint:
        raise config_lib.ConfigError("--step needs --checkpoint RUN_DIR")
    overrides = list(args.set)
    if args.hf:
        overrides.append(f"model.hf_path={args.hf}")
        if not any(item.split("=", 1)[0].strip() == "model.tokenizer" for item in args.set):
            overrides.append("model.tokenizer=none")  # the checkpoint's own tokenizer
    ks = None
    if args.ks is not None:
        try:
            ks = tuple(int(k) for k in args.ks.split(",") if k.strip())
        except ValueError:
            raise config_lib.ConfigError(f"--ks {args.ks!r}: expected comma-separated integers, e.g. 1,8") from None
        if not ks:
            raise config_lib.ConfigError(f"--ks {args.ks!r}: give at least one k, e.g. 1,8")
    config = config_lib.apply_overrides(base, overrides)
    e = config.eval
    n = args.num_samples if args.num_samples is not None else max(e.num_samples, max(ks or (1,)))
    if ks is None:
        ks = e.ks if args.num_samples is None else tuple(sorted({1, n}))
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise config_lib.ConfigError(f"--temperature {args.temperature}: must be > 0")
    if args.limit is not None and args.limit < 1:
        raise config_lib.ConfigError(f"--limit {args.limit}: must be >= 1")
    flags = [f"eval.num_samples={n}", f"eval.ks={json.dumps(list(ks))}"]
    if args.temperature is not None:
        flags.append(f"eval.temperature={args.temperature!r}")
    try:
        return config_lib.apply_overrides(config, flags)
    except config_lib.ConfigError as err:
        raise config_lib.ConfigError(f"{err} (from --num-samples / --ks / --temperature)") from None


def hf_only_config(hf_dir: str):
    """The config of `eval --hf DIR` without --config: the checkpoint's model, tokenizer (its stop
    ids) and chat template (text questions asked as user turns when it has one), its
    generation_config.json's `max_new_tokens` (else 512) and `temperature` (else 1.0)."""
    from grpo_jax import config as config_lib
    from grpo_jax.io.tokenizer import load_tokenizer, read_json_object

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise config_lib.ConfigError(f"--hf {hf_dir}: no config.json there (a Hugging Face checkpoint directory)")
    try:
        tokenizer = load_tokenizer(hf_dir)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise config_lib.ConfigError(f"--hf {hf_dir}: its tokenizer: {e} (or give --config FILE with "
                                     "model.tokenizer)") from None
    generation_path = os.path.join(hf_dir, "generation_config.json")
    generation = read_json_object(generation_path) if os.path.isfile(generation_path) else {}
    max_new_tokens = generation.get("max_new_tokens")
    temperature = generation.get("temperature")
    chat = getattr(tokenizer, "chat_templates", None) is not None
    return config_lib.Config(
        model=config_lib.ModelSection(hf_path=hf_dir),
        task=config_lib.TaskSection(name="jsonl", options={"chat": chat}),
        sampling=config_lib.SamplingSection(
            max_new_tokens=max_new_tokens if isinstance(max_new_tokens, int) and max_new_tokens > 0 else 512),
        eval=config_lib.EvalSection(
            temperature=float(temperature) if isinstance(temperature, (int, float)) and temperature > 0 else 1.0),
    )


def out_directory(args: argparse.Namespace, name: str, step: int) -> str:
    """Where the results go: --out, else beside the policy (RUN_DIR/eval/<data>-step<N>,
    DIR/eval/<data> for --hf DIR), else runs/eval/<data>. A directory that holds a result is not
    overwritten without --overwrite (a ConfigError saying so, before any work)."""
    from grpo_jax import config as config_lib

    if args.out:
        out = args.out
    elif args.checkpoint:
        out = os.path.join(args.checkpoint, "eval", f"{name}-step{step}")
    elif args.hf:
        out = os.path.join(args.hf, "eval", name)
    else:
        out = os.path.join("runs", "eval", name)
    summary = os.path.join(out, "summary.json")
    if os.path.exists(summary) and not getattr(args, "overwrite", False):
        raise config_lib.ConfigError(
            f"{os.path.abspath(out)} holds an earlier result ({summary}); pass --overwrite to replace it, or "
            "--out DIR for a new directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise config_lib.ConfigError(f"cannot write the results to {out} ({e}); give --out DIR") from None
    return out


def eval_examples(config, args: argparse.Namespace) -> tuple[str, str | None, Any, list[dict]]:
    """(data name, data path or None, the checker, the examples): `task.eval_correct` and
    `task.extract_answer` come from the checker."""
    from grpo_jax import config as config_lib
    from grpo_jax.training import run_context
    from grpo_jax.tasks import EVAL_SETS, Fields, read_examples
    from grpo_jax.tasks.jsonl import eval_data

    opts = dict(config.task.options) if config.task.name == "jsonl" else {}
    if args.data is None:
        if args.question_field or args.answer_field or args.answer_format:
            raise config_lib.ConfigError("--question-field / --answer-field / --answer-format need --data")
        task = run_context.configured_task(config)
        examples = task.eval_examples()
        if not examples:
            raise config_lib.ConfigError(f"task {config.task.name!r} has no held-out examples; give --data")
        return "heldout", None, task, examples[: args.limit]
    checker = run_checker(config)
    fields = Fields(question=opts.get("eval_question_field") or opts.get("question_field", "question"),
                    answer=opts.get("eval_answer_field") or opts.get("answer_field", "answer"),
                    messages=opts.get("messages_field", "prompt"),
                    answer_format=opts.get("eval_answer_format") or opts.get("answer_format", "auto"))
    try:
        path, fields = eval_data(args.data, fields, args.question_field, args.answer_field, args.answer_format)
        rows = read_examples(path, fields)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise config_lib.ConfigError(f"--data {args.data}: {e}") from None
    name = args.data if args.data in EVAL_SETS else pathlib.Path(path).stem
    return name, path, checker, [checker.example(r) for _, r in rows[: args.limit]]


def run_checker(config):
    """The run's prompt format and answer checks (`AnswerChecker`), so `--data` questions are asked
    as training asked its own: as messages when the run's jsonl task wraps text questions for the
    chat template (`chat`, and with `chat` unset, when its training rows are messages)."""
    from grpo_jax import config as config_lib
    from grpo_jax.training import run_context
    from grpo_jax.tasks.jsonl import AnswerChecker

    opts = dict(config.task.options) if config.task.name == "jsonl" else {}
    chat = opts.get("chat")
    if config.task.name == "jsonl" and chat is None:
        try:
            return run_context.configured_task(config).checker  # auto: reads the training rows
        except config_lib.ConfigError as e:
            log.warning("cannot read the run's training data to learn its prompt format (%s); asking the "
                        "questions as text (set task.options.chat to say which)", e)
            chat = False
    try:
        return AnswerChecker(template=opts.get("template", "plain"),
                             answer_location=opts.get("answer_location", "boxed"),
                             eval_answer_location=opts.get("eval_answer_location"),
                             approx_rtol=opts.get("approx_rtol", 0.0),
                             number_format=opts.get("number_format", "en"),
                             chat=False if chat is None else chat, system_prompt=opts.get("system_prompt"))
    except ValueError as e:
        raise config_lib.ConfigError(f"task.options: {e}") from None


def check_prompts(tokenizer, examples: list[dict], name: str) -> None:
    """Every prompt tokenises (a chat template exists for messages) and fits the sampler's largest
    prompt bucket: found before the model is built, as a config error naming the question."""
    from grpo_jax import config as config_lib
    from grpo_jax.training import rollout, run_context

    limit = max(run_context.PROMPT_BUCKETS)
    for i, ex in enumerate(examples):
        try:
            n = len(rollout.encode_prompt(tokenizer, ex["prompt"]))
        except Exception as e:  # noqa: BLE001 -- the tokenizer's error, located
            raise config_lib.ConfigError(f"{name}, question {i}: cannot tokenise the prompt with {tokenizer!r} "
                                         f"({type(e).__name__}: {e})") from None
        if n > limit:
            raise config_lib.ConfigError(f"{name}, question {i}: prompt of {n} tokens is longer than the "
                                         f"sampler's largest prompt bucket ({limit} tokens)")


def restore_params(run_dir: str, abstract_params, step: int | None = None) -> tuple[int, Any]:
    """(step, params) from a run's checkpoints: its newest step whose params load (or `step`).

    Only the params are read (Orbax's partial restore: no optimizer state or reference is built),
    into `abstract_params`' shapes, dtypes and shardings. Read-only: unlike the trainer's
    CheckpointManager, nothing in the run directory is created, cleaned or moved aside, so a run
    that is still training (an async save in flight) can be evaluated safely.
    """
    import orbax.checkpoint as ocp

    from grpo_jax.io import checkpoint as checkpoint_lib
    from grpo_jax import config as config_lib

    directory = pathlib.Path(run_dir).expanduser().absolute() / _CHECKPOINTS
    if not os.path.isdir(run_dir):
        raise config_lib.ConfigError(_no_run_dir(run_dir))
    if not directory.is_dir():
        raise config_lib.ConfigError(f"--checkpoint {run_dir}: no checkpoints directory {directory}")
    # Orbax writes a step into a temporary directory and renames it to the step number when complete.
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()), reverse=True)
    if step is not None:
        if step not in steps:
            raise config_lib.ConfigError(f"--step {step}: not in {directory}; steps there: {sorted(steps)}")
        steps = [step]
    if not steps:
        raise config_lib.ConfigError(f"--checkpoint {run_dir}: no checkpoint steps in {directory}")
    # Orbax prints a traceback per abandoned read when a step fails to load; the trainer's filters
    # for that noise apply here too.
    checkpoint_lib.silence_abandoned_reads(directory)
    item = {_PARAMS_KEY: abstract_params}
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    failures = []
    with ocp.PyTreeCheckpointer() as checkpointer:
        for candidate in steps:
            try:
                restored = checkpointer.restore(
                    directory / str(candidate) / _STATE_ITEM,
                    args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
                params = restored[_PARAMS_KEY]
                _check_like(abstract_params, params)
                checkpoint_lib.verify_partial_restore(directory / str(candidate), {_PARAMS_KEY: params})
            except Exception as e:  # noqa: BLE001 -- any failure means "this step is unusable"
                cause = (str(e).strip().splitlines() or [repr(e)])[0][:300]
                failures.append(f"step {candidate} ({directory / str(candidate)}): {type(e).__name__}: {cause}")
                if step is None:
                    log.warning("checkpoint %s cannot be read, trying an older one", failures[-1])
                continue
            return candidate, params
    raise RuntimeError("no checkpoint params could be read; if every step fails the same way the config's "
                       "model does not match the run's (give the run's config or none):\n  " + "\n  ".join(failures))


def _check_like(abstract, restored) -> None:
    """Every leaf restored with the requested shape and dtype (a wrong model config fails here)."""
    import jax

    want, got = jax.tree_util.tree_flatten_with_path(abstract)[0], jax.tree.leaves(restored)
    if len(want) != len(got):
        raise ValueError(f"restored {len(got)} arrays, the model has {len(want)}")
    for (path, w), g in zip(want, got):
        if tuple(w.shape) != tuple(g.shape) or w.dtype != g.dtype:
            raise ValueError(f"{jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)} in the checkpoint, "
                             f"the model has {w.dtype}{list(w.shape)}")


# ----------------------------------------------------------------------------------------------
# The run.


class _Progress:
    """A one-line progress bar on stderr, redrawn per batch (a line per batch when not a terminal)."""

    def __init__(self, label: str, width: int = 30):
        self.label, self.width, self.t0 = label, width, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        filled = self.width * done // max(total, 1)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} batches "
                f"{time.perf_counter() - self.t0:.1f} s")
        if self.tty:
            print("\r" + line, end="\n" if done == total else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    import jax

    from grpo_jax.training import rollout, run_context
    from grpo_jax.distributed import sharding
    from grpo_jax.distributed.processes import Processes

    config = eval_config(args)
    tokenizer = run_context.configured_tokenizer(config)
    name, data_path, checker, examples = eval_examples(config, args)
    check_prompts(tokenizer, examples, name)
    if not args.checkpoint:
        out_dir = out_directory(args, name, 0)  # before the work: an earlier result is not overwritten
    mesh = run_context.configured_mesh(config)
    model_config, graphdef, params = run_context.build_model(config, tokenizer, mesh)
    step = 0
    if args.checkpoint:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        del params  # the fresh init only gave the shapes; the checkpoint's params replace it
        step, params = restore_params(args.checkpoint, abstract, args.step)
        policy = {"checkpoint": os.path.abspath(args.checkpoint), "step": step}
        out_dir = out_directory(args, name, step)
    elif config.model.hf_path:
        policy = {"hf": os.path.abspath(config.model.hf_path)}
    else:
        policy = {"init_seed": config.model.init_seed}  # an untrained model: a baseline
    sampler = run_context.build_sampler(config, graphdef, model_config, tokenizer, mesh, params)
    processes = Processes(mesh)
    # Up to 64 questions per sampler call (fewer when there are fewer), a multiple of the devices.
    multiple = sharding.batch_size_multiple(mesh)
    batch_prompts = -(-min(_EVAL_BATCH, len(examples)) // multiple) * multiple
    e_cfg = config.eval
    label = f"eval {name}"
    log.info("%s: %d questions x %d samples, temperature %g, max_new_tokens %d", label, len(examples),
             e_cfg.num_samples, e_cfg.temperature, config.sampling.max_new_tokens)
    samples: list[dict] = []
    t0 = time.perf_counter()
    figures = rollout.evaluate(
        sampler, params, tokenizer, checker, examples,
        num_samples=e_cfg.num_samples, ks=e_cfg.ks, temperature=e_cfg.temperature,
        max_new_tokens=config.sampling.max_new_tokens, greedy=e_cfg.greedy,
        rng=jax.random.fold_in(jax.random.PRNGKey(config.train.seed), 10_000_000 + step),  # as train._Loop.evaluate
        batch_prompts=batch_prompts, processes=processes, episode_limits=rollout.episode_limits(config),
        on_batch=_Progress(label) if processes.is_primary else None, samples=samples)
    seconds = time.perf_counter() - t0
    summary = _summary(figures, samples, name=name, data_path=data_path, policy=policy, config=config,
                       num_questions=len(examples), seconds=seconds, config_file=args.config)
    if processes.is_primary:
        _write(out_dir, summary, samples)
        print(_report(summary, out_dir))
    return 0


def _summary(figures: dict, samples: list[dict], *, name, data_path, policy, config, num_questions, seconds,
             config_file) -> dict:
    sampled = [s for record in samples for s in record["sampled"]]
    return {
        "data": name,
        "data_path": data_path,
        "policy": policy,
        "config": config_file,
        "num_questions": num_questions,
        "num_samples": config.eval.num_samples,
        "ks": list(config.eval.ks),
        "temperature": config.eval.temperature,
        "max_new_tokens": config.sampling.max_new_tokens,
        **{k.removeprefix("eval/"): v for k, v in figures.items()},
        # Of the sampled completions: how many gave an answer the checker could read, how many ran
        # out of tokens (a model that never answers in the asked-for place scores 0 for that reason).
        "answered": float(np.mean([s["answer"] is not None for s in sampled])) if sampled else 0.0,
        "truncated": float(np.mean([s["truncated"] for s in sampled])) if sampled else 0.0,
        "mean_length": float(np.mean([s["length"] for s in sampled])) if sampled else 0.0,
        "seconds": round(seconds, 3),
    }


def _sample_line(record: dict) -> dict:
    ex = record["example"]
    line = {"index": record["index"], "question": ex.get("question"), "reference": ex.get("answer"),
            "prompt": ex.get("prompt"), "correct": sum(s["correct"] for s in record["sampled"]),
            "samples": record["sampled"]}
    if "greedy" in record:
        line["greedy"] = record["greedy"]
    return line


def _write(out_dir: str, summary: dict, samples: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "samples.jsonl"), "w") as f:
        for record in samples:
            f.write(json.dumps(_sample_line(record), ensure_ascii=False, default=str) + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


def _report(summary: dict, out_dir: str) -> str:
    policy = summary["policy"]
    who = (f"{policy['checkpoint']} step {policy['step']}" if "checkpoint" in policy
           else policy.get("hf") or f"untrained model (init_seed {policy['init_seed']})")
    figures = "  ".join(f"{k} {summary[k]:.4f}" for k in summary
                        if k.startswith(("pass@", "maj@")) or k == "greedy_accuracy")
    return (f"{summary['data']}: {summary['num_questions']} questions x {summary['num_samples']} samples "
            f"(temperature {summary['temperature']:g}, max_new_tokens {summary['max_new_tokens']}), {who}\n"
            f"{figures}\n"
            f"answered {summary['answered']:.1%}  truncated {summary['truncated']:.1%}  "
            f"mean length {summary['mean_length']:.1f} tokens  ({summary['seconds']:.1f} s)\n"
            f"wrote {os.path.join(out_dir, 'summary.json')} and {os.path.join(out_dir, 'samples.jsonl')}")


def main(argv=None) -> int:
    """`python -m grpo_jax.cli.eval ...`: the same as `python -m grpo_jax eval ...`."""
    parser = argparse.ArgumentParser(prog="python -m grpo_jax eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("jax", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
