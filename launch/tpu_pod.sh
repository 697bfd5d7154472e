#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice (e.g. v5e-16): copy the repo's HEAD to every worker, install,
# then run the same command on every worker at once; JAX's multi-controller runtime joins them
# (GRPO_DISTRIBUTED=auto -> jax.distributed.initialize() reads the TPU metadata).
#
#   launch/tpu_pod.sh --tpu my-v5e-16 --zone us-west4-a --config configs/tpu_pod.py \
#       --set model.hf_path=/mnt/models/Qwen2.5-7B-Instruct --set mesh.fsdp=16
#
# Options:
#   --tpu NAME          TPU VM name (required)          --zone ZONE     its zone (required)
#   --project ID        gcloud project (default: gcloud's configured one)
#   --config FILE       config file, relative to the repo root (required)
#   --set KEY=VALUE     config override, repeatable (passed through to `python -m grpo_jax train`)
#   --resume            continue from the latest checkpoint in train.run_dir
#   --remote-dir DIR    where the repo lives on the workers (default: grpo_jax, under $HOME)
#   --skip-install      do not copy and install (the workers already have this version)
#   --dry-run           print the commands instead of running them
# Paths in the config (model, data, run_dir) must be readable/writable from every worker
# (a GCS bucket or a disk mounted on all of them).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

tpu="" zone="" project="" config="" remote_dir="grpo_jax" dry_run=0 install=1 resume=0
overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) tpu="${2:?--tpu needs a value}"; shift 2 ;;
    --zone) zone="${2:?--zone needs a value}"; shift 2 ;;
    --project) project="${2:?--project needs a value}"; shift 2 ;;
    --config) config="${2:?--config needs a value}"; shift 2 ;;
    --set) overrides+=(--set "${2:?--set needs KEY=VALUE}"); shift 2 ;;
    --resume) resume=1; shift ;;
    --remote-dir) remote_dir="${2:?--remote-dir needs a value}"; shift 2 ;;
    --skip-install) install=0; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "tpu_pod.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for required in tpu zone config; do
  if [[ -z "${!required}" ]]; then echo "tpu_pod.sh: --$required is required (see --help)" >&2; exit 2; fi
done
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [[ ! -f "$repo/$config" ]]; then
  echo "tpu_pod.sh: --config $config: no such file under $repo" >&2; exit 2
fi

gcloud_args=(--zone "$zone")
[[ -n "$project" ]] && gcloud_args+=(--project "$project")
tarball="${TMPDIR:-/tmp}/grpo_jax_$(id -u).tar.gz"

# One shell-quoted string for `--command`, so overrides with spaces or quotes survive ssh.
train_cmd=(env GRPO_DISTRIBUTED=auto .venv/bin/python -m grpo_jax train --config "$config" "${overrides[@]}")
[[ $resume == 1 ]] && train_cmd+=(--resume)
remote_train="cd $(printf '%q' "$remote_dir") && $(printf '%q ' "${train_cmd[@]}")"
# jax[tpu] pinned to the jax that requirements.txt resolved, so libtpu matches it.
remote_install="mkdir -p $(printf '%q' "$remote_dir") && tar xzf ~/grpo_jax.tar.gz -C $(printf '%q' "$remote_dir") \
&& cd $(printf '%q' "$remote_dir") && python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt -e . \
&& .venv/bin/pip install -q \"jax[tpu]==\$(.venv/bin/python -c 'import jax; print(jax.__version__)')\""

run() {
  if [[ $dry_run == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

if [[ $install == 1 ]]; then
  run git -C "$repo" archive --format=tar.gz -o "$tarball" HEAD
  run gcloud compute tpus tpu-vm scp "${gcloud_args[@]}" --worker=all "$tarball" "$tpu:grpo_jax.tar.gz"
  run gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$remote_install"
fi
run gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$remote_train"
