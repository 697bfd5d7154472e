#!/usr/bin/env bash
# Train on every GPU of this host: one process drives all of them (jax.devices() lists every
# GPU; the mesh from the config's mesh section spans them). No jax.distributed is needed.
#
#   launch/gpu_local.sh --config configs/qwen25_05b_gpu.py --set mesh.fsdp=8
#
# Options:
#   --config FILE       config file (required)
#   --set KEY=VALUE     config override, repeatable
#   --gpus LIST         CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3 (default: every GPU)
#   --mem-fraction F    XLA_PYTHON_CLIENT_MEM_FRACTION, the share of GPU memory JAX reserves
#                       (default 0.90; JAX's own default is 0.75)
#   --python PATH       interpreter (default: .venv/bin/python in the repo)
#   --resume            continue from the latest checkpoint in train.run_dir
#   --dry-run           print the command instead of running it
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

repo="$(cd "$(dirname "$0")/.." && pwd)"
config="" gpus="" mem_fraction="0.90" python="$repo/.venv/bin/python" dry_run=0 resume=0
overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="${2:?--config needs a value}"; shift 2 ;;
    --set) overrides+=(--set "${2:?--set needs KEY=VALUE}"); shift 2 ;;
    --gpus) gpus="${2:?--gpus needs a list such as 0,1}"; shift 2 ;;
    --mem-fraction) mem_fraction="${2:?--mem-fraction needs a value}"; shift 2 ;;
    --python) python="${2:?--python needs a path}"; shift 2 ;;
    --resume) resume=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_local.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$config" ]]; then echo "gpu_local.sh: --config is required (see --help)" >&2; exit 2; fi
if [[ ! -f "$config" && ! -f "$repo/$config" ]]; then
  echo "gpu_local.sh: --config $config: no such file (relative paths are tried from $(pwd) and $repo)" >&2
  exit 2
fi
if [[ -n "$gpus" && ! "$gpus" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "gpu_local.sh: --gpus '$gpus' must be a comma-separated list of GPU indices, e.g. 0,1,2,3" >&2; exit 2
fi

cmd=(env XLA_PYTHON_CLIENT_MEM_FRACTION="$mem_fraction")
[[ -n "$gpus" ]] && cmd+=(CUDA_VISIBLE_DEVICES="$gpus")
cmd+=("$python" -m grpo_jax train --config "$config" "${overrides[@]}")
[[ $resume == 1 ]] && cmd+=(--resume)

cd "$repo"
if [[ $dry_run == 1 ]]; then printf '%q ' "${cmd[@]}"; echo; else exec "${cmd[@]}"; fi
