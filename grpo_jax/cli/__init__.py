"""The commands behind `python -m grpo_jax`: train (in `grpo_jax.__main__`), eval, check, report,
and the benchmark pieces that `benchmarks/` shares.
"""
