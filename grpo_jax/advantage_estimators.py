"""`grpo_jax.advantage_estimators` is `grpo_jax.core.advantage_estimators`: the path research code imports, kept."""

import sys

from grpo_jax.core import advantage_estimators as _module

sys.modules[__name__] = _module
