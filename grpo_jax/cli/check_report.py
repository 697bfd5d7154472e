"""The report `python -m grpo_jax check` prints: sizes in GiB and parameter counts, one row per
weight with its two layouts, and the whole table from the figures dict (`check.check`)."""

from __future__ import annotations


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def count(n: int) -> str:
    """494032768 -> '494.0M', 7615616512 -> '7.62B'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def weight_specs(params, train_specs, decode_specs) -> list[dict]:
    """One row per distinct weight (layers folded into `layers.*`): name, shape, both PartitionSpecs."""
    import jax

    rows: dict[str, dict] = {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), train, decode in zip(flat, jax.tree.leaves(train_specs), jax.tree.leaves(decode_specs)):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        keys = ["*" if k.isdigit() else k for k in keys if k != "value"]
        name = ".".join(keys)
        row = rows.setdefault(name, {"name": name, "shape": list(leaf.shape), "train": str(train),
                                     "decode": str(decode), "count": 0})
        row["count"] += 1
    return list(rows.values())


def format_report(f: dict) -> str:
    m, r, b = f["model"], f["rollout"], f["per_device_bytes"]
    mesh = " ".join(f"{k}={v}" for k, v in f["mesh"].items())
    split = f.get("rollout_devices")
    where = "" if not split else (
        f"; rollouts on {split['devices']} more device(s) of their own (off_policy.rollout_devices): "
        f"{split['rows_per_device']} rows each, {gib(split['snapshot_bytes_per_device'])} of policy snapshots "
        f"+ {gib(split['kv_cache_bytes_per_device'])} KV cache per device")
    trainer = f["devices"] - (split["devices"] if split else 0)
    lines = [f"check {f.get('config_file', '')}: {f['devices']} {f['backend']} device(s) ({f['device_kind']}), "
             f"mesh {mesh}" + (f" over the trainer's {trainer}" if split else "") + where,
             f"model: {count(m['num_params'])} params from {m['source']} ({m['num_layers']} layers, "
             f"d={m['hidden_size']}, {m['num_heads']}/{m['num_kv_heads']} heads, vocab {m['vocab_size']}, "
             f"compute {m['dtype']})",
             f"rollout: {r['rows']} rows ({r['rows_per_device']} per device) x ({r['prompt_tokens']} prompt + "
             f"{r['new_tokens']} new tokens); update: {r['micro_batches']} micro-batch(es) of "
             f"{r['update_rows_per_micro_batch']} rows", "",
             "per device                      bytes          GiB"]
    frozen = m.get("lora_r", 0) > 0
    labels = {"params": "frozen base (LoRA)" if frozen else "params (fp32 masters)",
              "adapters": f"LoRA adapters (r={m.get('lora_r')})", "opt_state": "Adam state", "reference": "reference",
              "teacher": "teacher (distillation)",
              "gradients": "gradients (in update temp)", "kv_cache": "KV cache (P+C tokens)",
              "decode_weights": "sampler weights copy", "step_rows": "step's row arrays",
              "moe_pairs_update": "MoE pairs/layer (update)", "moe_pairs_logprobs": "MoE pairs/layer (logprob)"}
    lines += [f"  {labels[k]:<28}{v:>14,} {v / 2**30:>9.3f}" for k, v in b.items()
              if (k != "adapters" or frozen) and (k not in ("teacher", "moe_pairs_update", "moe_pairs_logprobs") or v)]
    state_label = "params+Adam+ref+teacher+grads" if b.get("teacher") else "params+Adam+ref+grads"
    lines.append(f"  {state_label:<28}{f['state_bytes']:>14,} {f['state_bytes'] / 2**30:>9.3f}")
    lines.append(f"  {'trainable (+Adam, grads)':<28}{f['trainable_state_bytes']:>14,} "
                 f"{f['trainable_state_bytes'] / 2**30:>9.3f}   ({count(m['trainable_params'])} params train)")
    if f["programs"]:
        lines += ["", "compiled programs (per device)   argument     output      alias       temp   "
                      "in use   compile"]
        for name, p in f["programs"].items():
            lines.append(f"  {name:<28}" + "".join(f"{gib(p[k]):>11}" for k in ("argument", "output", "alias",
                                                                                 "temp", "peak"))
                         + f"  {p['compile_s']:6.1f} s")
    lines += ["", "phase peaks (resident state + program in use)" if f["programs"] else
              "phase lower bounds (no program compiled)"]
    lines += [f"  {name:<28}{gib(v):>11}" for name, v in f["phases"].items()]
    lines += ["", "weights                   shape              count  training layout            | sampler layout"]
    for w in f["weights"]:
        lines.append(f"  {w['name']:<24}{w['shape']!s:<19}{w['count']:>5}  {w['train']:<27}| {w['decode']}")
    lines += engine_lines(f)
    p, limit, engine = f["peak"], f["memory_per_device"], f.get("vllm")
    verdict = "no limit given" if limit is None else (
        f"fits {gib(limit)}" if f["fits"] else f"EXCEEDS {gib(limit)}")
    if engine and engine["mode"] == "colocate" and limit is not None:
        verdict = (f"{'fits' if p['bytes'] <= f['budget'] else 'EXCEEDS'} the {gib(f['budget'])} JAX keeps of "
                   f"{gib(limit)} beside the vLLM engine; the engine's share "
                   f"{'holds' if engine['engine_fits'] else 'is TOO SMALL for'} its weights and one sequence")
    lines += ["", f"summary: {count(m['num_params'])} params on {f['devices']} devices ({mesh}): peak "
                  f"{gib(p['bytes'])} per device in the {p['phase']} phase; {verdict}"]
    return "\n".join(lines)


def engine_lines(f: dict) -> list[str]:
    """sampling.engine="vllm": where the engine runs, its share of each device and what it needs."""
    e = f.get("vllm")
    if not e:
        return []
    if e["mode"] == "server":
        return ["", f"rollout on vLLM: {e['where']}; it takes none of these devices' memory"]
    n, limit = e["needs"], f["memory_per_device"]
    lines = ["", f"rollout on vLLM, colocated ({e['where']}; no prefill/decode of ours compiled)"]
    if limit is None:
        lines.append(f"  {'engine share':<28}vllm_gpu_memory_utilization={e['utilization']} of the device "
                     "(no --memory-per-device: bytes unknown)")
    else:
        lines.append(_row("engine share", e["engine_bytes"], f"{e['utilization']} of {gib(limit)}"))
        lines.append(_row("left for JAX", e["jax_bytes"], f"XLA_PYTHON_CLIENT_MEM_FRACTION={e['jax_fraction']:.2f}"))
    lines.append(_row("engine needs at least", n["needs_bytes"],
                      f"{n['dtype']} weights {gib(n['weights_bytes'])} + KV of one {n['sequence_tokens']}-token "
                      f"sequence {gib(n['kv_cache_bytes'])}, tp={n['tensor_parallel_size']}"))
    if e["engine_fits"] is False:
        lines.append("  ENGINE SHARE TOO SMALL: raise sampling.vllm_gpu_memory_utilization")
    return lines


def _row(label: str, n: int, note: str) -> str:
    return f"  {label:<28}{n:>14,} {n / 2**30:>9.3f}   ({note})"
