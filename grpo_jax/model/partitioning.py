"""The PartitionSpec table: weight name -> mesh axes, and `partition_specs` applying it to a param tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# One table: weight name -> PartitionSpec over mesh axes ("data", "fsdp", "expert", "tensor").
# "data" never shards weights (it splits the batch); "fsdp" shards the hidden dimension D of
# every matrix; "expert" shards a MoE layer's experts E (and splits the batch elsewhere);
# "tensor" shards heads, the MLP width and the vocabulary (Megatron style).
SHARDING: dict[str, tuple[str | None, ...]] = {
    "embed": ("tensor", "fsdp"),            # [V, D]
    "attn_norm": (None,),                   # [D]
    "q_proj": ("fsdp", "tensor", None),     # [D, N, H]
    "k_proj": ("fsdp", "tensor", None),     # [D, K, H]
    "v_proj": ("fsdp", "tensor", None),     # [D, K, H]
    "o_proj": ("tensor", None, "fsdp"),     # [N, H, D]
    "q_bias": ("tensor", None),             # [N, H]
    "k_bias": ("tensor", None),             # [K, H]
    "v_bias": ("tensor", None),             # [K, H]
    "q_norm": (None,),                      # [H]
    "k_norm": (None,),                      # [H]
    "mlp_norm": (None,),                    # [D]
    "post_attn_norm": (None,),              # [D] (sandwich_norms only)
    "post_mlp_norm": (None,),               # [D] (sandwich_norms only)
    "gate_proj": ("fsdp", "tensor"),        # [D, F]
    "up_proj": ("fsdp", "tensor"),          # [D, F]
    "down_proj": ("tensor", "fsdp"),        # [F, D]
    # Experts (grpo_jax.model.moe): E over "expert" (expert parallelism; tokens travel to their
    # experts, grpo_jax.model.expert_dispatch), each expert's width I over "tensor" as the dense MLP's
    # F, D over fsdp as every matrix's. The router is small and stays whole on E.
    "router": ("fsdp", None),               # [D, E]
    "expert_gate": ("expert", "fsdp", "tensor"),  # [E, D, I]
    "expert_up": ("expert", "fsdp", "tensor"),    # [E, D, I]
    "expert_down": ("expert", "tensor", "fsdp"),  # [E, I, D]
    "final_norm": (None,),                  # [D]
    "lm_head": ("fsdp", "tensor"),          # [D, V]
}


# The leading dimensions of a weight that index a stack of independent matrices (the experts' E):
# neither input nor output, each matrix of the stack gets its own adapter pair.
BATCH_DIMS = {"expert_gate": 1, "expert_up": 1, "expert_down": 1}

# The dimensions of each matrix, after its BATCH_DIMS, that are its inputs (the rest are outputs):
# q_proj [D, N, H] maps D to N x H, o_proj [N, H, D] maps N x H to D, expert_down [E, I, D] maps I
# to D per expert. LoRA adapters (grpo_jax.model.lora) are A [batch..., inputs, r] and
# B [batch..., r, outputs] and take their shardings from these.
IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1,
           "router": 1, "expert_gate": 1, "expert_up": 1, "expert_down": 1}


def adapter_spec(weight: str, which: str) -> tuple[str | None, ...]:
    """A LoRA adapter's spec from its weight's: A [batch..., in, r] splits its input like the
    weight's first input dimension, B [batch..., r, out] its output like the first output dimension
    (a flattened N x H splits over heads as [N, H] does); batch dimensions (the experts' E) split as
    the weight's do; the rank stays whole. expert_gate ("tensor", "fsdp", None): A ("tensor", "fsdp",
    None), B ("tensor", None, None)."""
    spec = SHARDING[weight]
    nb = BATCH_DIMS.get(weight, 0)
    batch = tuple(spec[:nb])
    return batch + (spec[nb], None) if which == "lora_a" else batch + (None, spec[nb + IN_DIMS[weight]])


def partition_specs(params):
    """PartitionSpec per weight, same tree as `params`, read from the SHARDING table by name.
    LoRA adapters (`.../q_proj/lora_a`) take theirs from their weight's (`adapter_spec`)."""

    def spec(path, leaf):
        # Innermost named key wins: ('layers', 0, 'attn', 'q_proj', .value) -> 'q_proj'.
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if len(names) >= 2 and names[-1] in ("lora_a", "lora_b") and names[-2] in IN_DIMS:
            return P(*adapter_spec(names[-2], names[-1]))
        for name in reversed(names):
            if name in SHARDING:
                if len(SHARDING[name]) != jnp.ndim(leaf):
                    raise ValueError(
                        f"partition_specs: weight {name!r} has shape {jnp.shape(leaf)} but the "
                        f"SHARDING table gives {SHARDING[name]} ({len(SHARDING[name])} dims)"
                    )
                return P(*SHARDING[name])
        raise ValueError(
            f"partition_specs: no SHARDING entry for {jax.tree_util.keystr(path)}; "
            f"known weights: {sorted(SHARDING)}"
        )

    return jax.tree_util.tree_map_with_path(spec, params)
