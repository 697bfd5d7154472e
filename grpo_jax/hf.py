"""`grpo_jax.hf` is `grpo_jax.io.hf`: the path research code imports, kept."""

import sys

from grpo_jax.io import hf as _module

sys.modules[__name__] = _module
