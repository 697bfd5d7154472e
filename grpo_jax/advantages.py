"""`grpo_jax.advantages` is `grpo_jax.core.advantages`: the path research code imports, kept."""

import sys

from grpo_jax.core import advantages as _module

sys.modules[__name__] = _module
