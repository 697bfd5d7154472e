"""`grpo_jax.losses` is `grpo_jax.core.losses`: the path research code imports, kept."""

import sys

from grpo_jax.core import losses as _module

sys.modules[__name__] = _module
