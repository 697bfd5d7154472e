"""Command line: flags to a config to `train.run`; nothing else.

python -m grpo_jax train --config configs/arith_cpu.py [--set grpo.beta=0.04 ...] [--resume]
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run SFT warm-up (if configured) then GRPO")
    train.add_argument("--config", required=True, help="a Python file with get_config() -> Config")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field (repeatable)",
    )
    train.add_argument("--run-dir", help="shortcut for --set train.run_dir=...")
    train.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint")
    args = parser.parse_args(argv)

    from grpo_jax import sharding

    sharding.initialize_distributed()  # a no-op unless flags/environment describe several processes
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("jax", "absl", "orbax"):  # backend probing and per-save Orbax chatter
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from grpo_jax import config as config_lib

    overrides = list(args.set) + ([f"train.run_dir={args.run_dir}"] if args.run_dir else [])
    try:
        config = config_lib.apply_overrides(config_lib.load_config_file(args.config), overrides)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from grpo_jax import report

    report.run_and_report(config, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
