"""One process of a multi-process `train.run` on the CPU backend (run by tests/test_multihost_train.py).

    python tests/multihost_train_check.py OUT.json --process-id 0 --num-processes 2 --port 12345
    python tests/multihost_train_check.py OUT.json   # one process (the reference)

Trains the tiny SevensTask config of tests/test_train.py for 2 steps on a data-parallel mesh and
writes the metrics rows of every step to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from grpo_jax.distributed import sharding


def _lenient_task():
    from test_train import SevensTask

    class LenientSevens(SevensTask):
        """Eval: correct when the answer starts with a low digit, so an untrained model scores
        neither 0 nor 1 and pass@k / maj@k compare meaningfully (the final answer: the first char)."""

        def eval_examples(self):
            return [self.train_example(100_000 + i) for i in range(8)]

        def eval_correct(self, completion, example):
            return completion[:1] in ("0", "1", "2", "3", "4")

        def extract_answer(self, completion):
            return completion[:1] or None

    return LenientSevens()


def _preempted_task(step: int):
    from test_train import SevensTask, sevens_reward
    from grpo_jax.tasks import RewardSpec

    class PreemptedSevens(SevensTask):
        """The sevens task, whose reward function on process 1 alone sends SIGTERM at `step`."""

        def reward_fns(self):
            def sevens(prompts, completions, *, step=0, **fields):
                if step == stop_at and jax.process_index() == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                return sevens_reward(prompts, completions)

            return [RewardSpec("sevens", sevens, 1.0)]

    stop_at = step
    return PreemptedSevens()


def _failing_task(step: int):
    from test_train import SevensTask, sevens_reward
    from grpo_jax.tasks import RewardSpec

    class FailingSevens(SevensTask):
        """The sevens task, whose reward function on process 1 alone raises at `step` (a user's bug
        that only one host's completions trigger)."""

        def reward_fns(self):
            def sevens(prompts, completions, *, step=0, **fields):
                if step == fail_at and jax.process_index() == 1:
                    raise ValueError("sevens: a completion this reward cannot parse")
                return sevens_reward(prompts, completions)

            return [RewardSpec("sevens", sevens, 1.0)]

    fail_at = step
    return FailingSevens()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stop-after", type=int, default=0, help="train.stop_after_steps")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--eval", action="store_true", help="held-out eval at steps 0 and the last")
    parser.add_argument("--dynamic", action="store_true", help="DAPO dynamic sampling (2 resample rounds)")
    parser.add_argument("--episodes", action="store_true",
                        help="play each row as an episode of up to 3 turns against test_episodes_train's environment")
    parser.add_argument("--sft", type=int, default=0, help="SFT warm-up steps (batch 4)")
    parser.add_argument("--sigterm-at", type=int, default=0,
                        help="process 1 (only) sends itself SIGTERM while scoring this step, as a preempted VM")
    parser.add_argument("--reward-error-at", type=int, default=0,
                        help="process 1's (only) reward function raises while scoring this step")
    args = parser.parse_args(argv)
    if args.num_processes > 1:
        sharding.initialize_distributed(f"localhost:{args.port}", args.num_processes, args.process_id)

    import dataclasses

    from grpo_jax.training import train
    from grpo_jax.config import EvalSection, MeshSection, SFTSection
    from test_train import SevensTask, tiny_config
    from tolerances import ADAM_EPS_FOR_COMPARISONS

    cfg = tiny_config(args.run_dir)
    train_cfg = dataclasses.replace(cfg.train, steps=args.steps, checkpoint_every=0, export_hf=True,
                                    stop_after_steps=args.stop_after)
    cfg = dataclasses.replace(cfg, train=train_cfg,
                              mesh=MeshSection(data=-1),
                              # Adam eps 1e-4 (not 1e-8), as weight comparisons need (tests/tolerances.py).
                              optim=dataclasses.replace(cfg.optim, eps=ADAM_EPS_FOR_COMPARISONS))
    if args.dynamic:
        cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, dynamic_sampling=True, max_resample_rounds=2))
    if args.sft:
        # "7777" + EOS needs 5 new tokens.
        cfg = dataclasses.replace(cfg, sft=SFTSection(steps=args.sft, batch_size=4, learning_rate=1e-2, eval_every=2,
                                                      eval_size=4),
                                  sampling=dataclasses.replace(cfg.sampling, max_new_tokens=5))
    task = SevensTask() if not args.sigterm_at else _preempted_task(args.sigterm_at)
    if args.reward_error_at:
        task = _failing_task(args.reward_error_at)
    if args.eval:
        cfg = dataclasses.replace(cfg, eval=EvalSection(every=0, num_questions=8, num_samples=2, ks=(1, 2)))
        task = _lenient_task()
    if args.episodes:
        from grpo_jax.episodes import with_environment
        from test_episodes_train import AskThenAnswer

        # Turns of at most 4 tokens in 12: a random model stops within 4 tokens in about 1 row in 4,
        # so later turns play on a varying number of rows (padded differently on 1 and 8 devices).
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, max_turns=3, max_tokens_per_turn=4),
                                  sampling=dataclasses.replace(cfg.sampling, max_new_tokens=12))
        task = with_environment(task, AskThenAnswer)
    result = train.run(cfg, task=task, resume=args.resume)
    out = {"process_index": jax.process_index(), "process_count": jax.process_count(),
           "device_count": jax.device_count(), "step": result.step, "stopped_by": result.stopped_by,
           "history": [{k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_second"}
                       for row in result.history]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
