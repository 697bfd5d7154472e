"""`grpo_jax.evaluation` is `grpo_jax.core.evaluation`: the path research code imports, kept."""

import sys

from grpo_jax.core import evaluation as _module

sys.modules[__name__] = _module
