"""LoRA adapters out as a peft adapter directory (adapter_config.json, adapter_model.safetensors):
the adapter tree of `grpo_jax.model.lora` under peft's tensor names and layouts, loadable with
`PeftModel.from_pretrained(base, path)` on the base the run exported.

Qwen3-MoE's experts and router have no module in this format: transformers 5 keeps the experts as
fused nn.Parameters (mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I]), which
peft reaches only through `target_parameters` (its ParamWrapper, whose layout is peft's own and not
tested here). Adapters on them are refused before anything is written (`refuse_unexportable`);
the merged export (run_dir/hf) holds them.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
from safetensors.numpy import save_file

from grpo_jax.io import hf
from grpo_jax.model.lora import NOT_PEFT_LINEAR, LoraSpec

# The HF module each targeted weight belongs to (peft's key names).
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def refuse_unexportable(targets) -> None:
    """ValueError naming the targets among `targets` that peft's LoRA format cannot hold (the
    experts, the router), and what to do instead; nothing when there are none."""
    bad = sorted({t for t in targets if t in NOT_PEFT_LINEAR})
    if bad:
        raise ValueError(
            f"LoRA targets {bad} have no module in peft's LoRA adapter format (transformers 5 keeps Qwen3-MoE's "
            "experts as fused parameters and its router outside nn.Linear), so they cannot be exported as a peft "
            "adapter; export the merged weights instead (train.export_hf=true with train.export_peft=false writes "
            "run_dir/hf only), or leave them out of lora.target_modules")


def peft_state_dict(adapters: dict, prefix: str = "base_model.model.model.") -> dict[str, np.ndarray]:
    """The adapters under peft's names and layouts (torch's Linear: weight [out, in]):
    `{prefix}layers.{i}.self_attn.q_proj.lora_A.weight` = A.T [r, in] and `...lora_B.weight` =
    B.T [out, r]; W'_hf = W_hf + (alpha / r) * lora_B @ lora_A, as peft computes it.
    Expert or router adapters: ValueError (`refuse_unexportable`)."""
    pairs = list(_flatten_pairs(adapters))
    refuse_unexportable([names[-1] for names, _ in pairs])
    out = {}
    for names, pair in pairs:
        _, layer, _, weight = names
        stem = f"{prefix}layers.{layer}.{HF_MODULE[weight]}.{weight}"
        out[f"{stem}.lora_A.weight"] = np.ascontiguousarray(np.asarray(pair["lora_a"], np.float32).T)
        out[f"{stem}.lora_B.weight"] = np.ascontiguousarray(np.asarray(pair["lora_b"], np.float32).T)
    return out


def _flatten_pairs(adapters: dict, names: tuple[str, ...] = ()):
    if "lora_a" in adapters:
        yield names, adapters
        return
    for key, child in adapters.items():
        yield from _flatten_pairs(child, names + (key,))


def save_peft(adapters: dict, path, *, spec: LoraSpec, alpha: float, base_model: str | None) -> None:
    """A peft adapter directory: adapter_config.json and adapter_model.safetensors (peft's names,
    `peft_state_dict`), loadable with `PeftModel.from_pretrained(base, path)`. `base_model`: what
    the adapters apply to (peft's base_model_name_or_path). Expert or router targets: ValueError
    before any file is written."""
    refuse_unexportable(spec.targets)
    tensors = peft_state_dict(adapters)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(spec.targets),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = path / "adapter_model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o666 & ~hf._umask())  # safetensors writes 0600 (see hf.save_model)
