"""`grpo_jax.objectives` is `grpo_jax.core.objectives`: the path research code imports, kept."""

import sys

from grpo_jax.core import objectives as _module

sys.modules[__name__] = _module
