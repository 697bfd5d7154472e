#!/usr/bin/env bash
# Train on every GPU of this host: one process drives all of them (jax.devices() lists every
# GPU; the mesh from the config's mesh section spans them). No jax.distributed is needed.
#
#   launch/gpu_local.sh --config configs/qwen25_05b_gpu.py --set mesh.fsdp=8
#
# Options:
#   --config FILE       config file (required): a path from the current directory, else from the repo root
#   --set KEY=VALUE     config override, repeatable
#   --gpus LIST         CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3 (default: every GPU)
#   --mem-fraction F    XLA_PYTHON_CLIENT_MEM_FRACTION, the share of GPU memory JAX reserves
#                       (default 0.90; JAX's own default is 0.75)
#   --python PATH       interpreter (default: .venv/bin/python in the repo)
#   --resume            continue from the latest checkpoint in train.run_dir
#   --allow-cpu         skip the CUDA jaxlib check and pass --allow-cpu to train (run on CPU if need be)
#   --check             first run `python -m grpo_jax check` for this config on the GPUs the launch uses
#                       (--gpus, else CUDA_VISIBLE_DEVICES, else nvidia-smi's count); stop if it fails
#   --memory-per-device SIZE   passed to check (e.g. 80GB)
#   --dry-run           print the commands instead of running them (with --check, run the check only)
# The run starts in the repo root: relative paths inside the config (data, run_dir) are from there.
# Before training, `python -m grpo_jax.distributed.platform_check cuda` stops a venv whose jaxlib is CPU-only and
# prints the fix (pip install -e '.[cuda12]').
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_local.sh: $*" >&2; exit 2; }
# An absolute path for a user path, taken from the current directory (resolved before the cd).
absolute() { if [[ "$1" == /* ]]; then echo "$1"; else echo "$(pwd)/$1"; fi; }

repo="$(cd "$(dirname "$0")/.." && pwd)"
config="" gpus="" mem_fraction="0.90" python="$repo/.venv/bin/python" dry_run=0 resume=0 allow_cpu=0
check=0 memory=""
overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="${2:?--config needs a value}"; shift 2 ;;
    --set) overrides+=(--set "${2:?--set needs KEY=VALUE}"); shift 2 ;;
    --gpus) gpus="${2:?--gpus needs a list such as 0,1}"; shift 2 ;;
    --mem-fraction) mem_fraction="${2:?--mem-fraction needs a value}"; shift 2 ;;
    --python) python="${2:?--python needs a path}"; shift 2 ;;
    --resume) resume=1; shift ;;
    --allow-cpu) allow_cpu=1; shift ;;
    --check) check=1; shift ;;
    --memory-per-device) memory="${2:?--memory-per-device needs a size such as 80GB}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n "$config" ]] || die "--config is required (see --help)"
if [[ -f "$config" ]]; then config="$(absolute "$config")"
elif [[ "$config" != /* && -f "$repo/$config" ]]; then config="$repo/$config"
else die "--config $config: no such file (relative paths are tried from $(pwd) and $repo)"
fi
[[ "$python" == */* ]] && python="$(absolute "$python")"  # a bare name (python3) is looked up on PATH
if [[ -n "$gpus" && ! "$gpus" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  die "--gpus '$gpus' must be a comma-separated list of GPU indices, e.g. 0,1,2,3"
fi
[[ -z "$memory" || $check == 1 ]] || die "--memory-per-device is an option of --check"

# The GPUs this launch uses, for check's --devices.
count_gpus() {
  local list="${gpus:-${CUDA_VISIBLE_DEVICES-unset}}"
  if [[ "$list" != unset ]]; then
    [[ -n "$list" ]] || die "CUDA_VISIBLE_DEVICES is empty (no GPU visible); pass --gpus 0,1,..."
    tr ',' '\n' <<<"$list" | grep -c .
  elif command -v nvidia-smi >/dev/null; then
    local n; n="$(nvidia-smi -L | grep -c '^GPU ' || true)"
    [[ "$n" -gt 0 ]] || die "nvidia-smi -L lists no GPU; pass --gpus 0,1,... to say which this launch uses"
    echo "$n"
  else
    die "--check needs the GPU count: pass --gpus 0,1,... (no CUDA_VISIBLE_DEVICES, no nvidia-smi here)"
  fi
}

show() { local line; line="$(printf '%q ' "$@")"; echo "${line% }"; }
run() { if [[ $dry_run == 1 ]]; then show "$@"; else "$@"; fi; }

accelerator_check=("$python" -m grpo_jax.distributed.platform_check cuda)
check_cmd=()
if [[ $check == 1 ]]; then
  devices="$(count_gpus)"
  check_cmd=("$python" -m grpo_jax check --config "$config" "${overrides[@]}" --devices "$devices")
  [[ -n "$memory" ]] && check_cmd+=(--memory-per-device "$memory")
fi
cmd=(env XLA_PYTHON_CLIENT_MEM_FRACTION="$mem_fraction")
[[ -n "$gpus" ]] && cmd+=(CUDA_VISIBLE_DEVICES="$gpus")
cmd+=("$python" -m grpo_jax train --config "$config" "${overrides[@]}")
[[ $resume == 1 ]] && cmd+=(--resume)
[[ $allow_cpu == 1 ]] && cmd+=(--allow-cpu)

# With --check, a dry run still runs check (that is what was asked); its report goes to stderr, so
# stdout stays the list of commands.
run_check() {
  local status=0
  if [[ $dry_run == 1 ]]; then show "${check_cmd[@]}"; "${check_cmd[@]}" >&2 || status=$?
  else "${check_cmd[@]}" || status=$?; fi
  [[ $status == 0 ]] || { echo "gpu_local.sh: python -m grpo_jax check failed (exit $status); not launching" >&2
                          exit "$status"; }
}

[[ $dry_run == 1 ]] && show cd "$repo"
cd "$repo"
[[ $allow_cpu == 1 ]] || run "${accelerator_check[@]}"
[[ $check == 1 ]] && run_check
if [[ $dry_run == 1 ]]; then show "${cmd[@]}"; else exec "${cmd[@]}"; fi
