#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice (e.g. v5e-16): copy the repo's working tree to every worker,
# install, then run the same command on every worker at once; JAX's multi-controller runtime joins
# them (GRPO_DISTRIBUTED=auto -> jax.distributed.initialize() reads the TPU metadata).
#
#   launch/tpu_pod.sh --tpu my-v5e-16 --zone us-west4-a --config configs/tpu_pod.py \
#       --set model.hf_path=/mnt/models/Qwen2.5-7B-Instruct --set mesh.fsdp=16
#
# Options:
#   --tpu NAME          TPU VM name (required)          --zone ZONE     its zone (required)
#   --project ID        gcloud project (default: gcloud's configured one)
#   --config FILE       config file inside the repo (required): a path from the current directory,
#                       else from the repo root
#   --set KEY=VALUE     config override, repeatable (passed through to `python -m grpo_jax train`)
#   --resume            continue from the latest checkpoint in train.run_dir
#   --remote-dir DIR    where the repo lives on the workers (default: grpo_jax, under $HOME)
#   --skip-install      keep the workers' .venv as it is (the code and config are still shipped)
#   --allow-cpu         a worker without libtpu only warns; pass --allow-cpu to train
#   --check             first run `python -m grpo_jax check --devices N` here, N = the slice's JAX
#                       devices (from --accelerator-type or --devices); stop if it fails
#   --accelerator-type TYPE   e.g. v5litepod-16, v6e-16, v4-32, v5p-128 (as `gcloud compute tpus tpu-vm
#                       describe NAME --zone ZONE --format='value(acceleratorType)'` prints it)
#   --devices N         the slice's JAX devices, instead of --accelerator-type
#   --memory-per-device SIZE   passed to check (e.g. 16GB)
#   --python PATH       the local interpreter for --check (default: .venv/bin/python in the repo)
#   --dry-run           print the commands instead of running them (with --check, run the check only)
# What ships is the working tree as it is on disk: tracked files with their uncommitted changes plus
# untracked files git does not ignore (the file list says which differ from HEAD). A config outside
# the repo or ignored by git would not reach the workers, so it is refused. Each worker makes .venv
# with Python >= 3.11 (uv fetches one where the image's python3 is older) and installs '.[tpu]'
# (launch/tpu_worker_setup.sh). Paths in the config (model, data, run_dir) must be readable/writable
# from every worker (a GCS bucket or a disk mounted on all of them); relative ones are from the repo.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "tpu_pod.sh: $*" >&2; exit 2; }
absolute() { if [[ "$1" == /* ]]; then echo "$1"; else echo "$(pwd)/$1"; fi; }
show() { local line; line="$(printf '%q ' "$@")"; echo "${line% }"; }

repo="$(cd "$(dirname "$0")/.." && pwd -P)"
tpu="" zone="" project="" config="" remote_dir="grpo_jax" dry_run=0 install=1 resume=0 allow_cpu=0
check=0 memory="" accelerator_type="" devices="" python="$repo/.venv/bin/python"
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
    --allow-cpu) allow_cpu=1; shift ;;
    --check) check=1; shift ;;
    --accelerator-type) accelerator_type="${2:?--accelerator-type needs a value such as v5litepod-16}"; shift 2 ;;
    --devices) devices="${2:?--devices needs a count}"; shift 2 ;;
    --memory-per-device) memory="${2:?--memory-per-device needs a size such as 16GB}"; shift 2 ;;
    --python) python="${2:?--python needs a path}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
for required in tpu zone config; do
  [[ -n "${!required}" ]] || die "--$required is required (see --help)"
done
[[ -z "$memory" || $check == 1 ]] || die "--memory-per-device is an option of --check"
[[ "$python" == */* ]] && python="$(absolute "$python")"
remote_dir="${remote_dir#\~/}"  # the ssh session starts in $HOME
[[ -n "$remote_dir" && "$remote_dir" != "." && "$remote_dir" != /* ]] \
  || die "--remote-dir '$remote_dir' must be a directory under \$HOME such as grpo_jax"

# The config: resolved from the current directory (else the repo root), and it must be a file the
# working-tree archive carries, because that copy is the one the workers read.
if [[ -f "$config" ]]; then config="$(absolute "$config")"
elif [[ "$config" != /* && -f "$repo/$config" ]]; then config="$repo/$config"
else die "--config $config: no such file (relative paths are tried from $(pwd) and $repo)"
fi
config="$(cd "$(dirname "$config")" && pwd -P)/$(basename "$config")"
git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
  || die "$repo is not a git checkout: this script ships the repo's git working tree to the workers"
[[ "$config" == "$repo"/* ]] \
  || die "--config $config is outside the repo $repo, so it would not reach the workers:" \
         "copy it under the repo (e.g. $repo/configs/$(basename "$config")) and pass that path"
config_rel="${config#"$repo"/}"
if git -C "$repo" check-ignore -q -- "$config_rel"; then
  die "--config $config_rel is ignored by git (.gitignore), so the working-tree archive leaves it out:" \
      "move it (e.g. to configs/) or stop ignoring it"
fi

# The slice's JAX devices: one per TensorCore on v2/v3, one per chip on v4/v5p (a megacore chip is
# two TensorCores; their accelerator types count cores) and on v5e/v6e (one TensorCore per chip).
slice_devices() {
  local type="$1" family cores
  [[ "$type" =~ ^(v[0-9]+[a-z]*)-([1-9][0-9]*)$ ]] \
    || die "--accelerator-type '$type' is not of the form v5litepod-16; pass --devices N instead"
  family="${BASH_REMATCH[1]}" cores="${BASH_REMATCH[2]}"
  case "$family" in
    v2|v3|v5litepod|v5e|v6e) echo "$cores" ;;
    v4|v5p) echo $((cores / 2)) ;;
    *) die "--accelerator-type '$type': JAX's device count for $family is not known here;" \
           "pass --devices N (jax.device_count() on the slice)" ;;
  esac
}
check_cmd=()
if [[ $check == 1 ]]; then
  if [[ -n "$devices" ]]; then
    [[ "$devices" =~ ^[1-9][0-9]*$ ]] || die "--devices '$devices' must be a positive integer"
  elif [[ -n "$accelerator_type" ]]; then devices="$(slice_devices "$accelerator_type")"
  else die "--check needs the slice size: --accelerator-type TYPE (gcloud compute tpus tpu-vm describe $tpu" \
           "--zone $zone --format='value(acceleratorType)') or --devices N"
  fi
  check_cmd=("$python" -m grpo_jax check --config "$config" "${overrides[@]}" --devices "$devices")
  [[ -n "$memory" ]] && check_cmd+=(--memory-per-device "$memory")
fi

gcloud_args=(--zone "$zone")
[[ -n "$project" ]] && gcloud_args+=(--project "$project")
tarball="${TMPDIR:-/tmp}/grpo_jax_$(id -u).tar.gz"
q_repo="$(printf '%q' "$repo")" q_tarball="$(printf '%q' "$tarball")" q_dir="$(printf '%q' "$remote_dir")"

# The working tree as on disk: tracked files (with uncommitted changes) and untracked, not ignored
# ones; tracked files deleted on disk are skipped. COPYFILE_DISABLE keeps macOS tar's ._ files out.
archive_sh="set -o pipefail; cd $q_repo && git ls-files -z --cached --others --exclude-standard \
| while IFS= read -r -d '' f; do if [ -e \"\$f\" ] || [ -L \"\$f\" ]; then printf '%s\\0' \"\$f\"; fi; done \
| COPYFILE_DISABLE=1 tar -czf $q_tarball --null -T -"

# One shell-quoted string for `--command`, so overrides with spaces or quotes survive ssh.
train_cmd=(env GRPO_DISTRIBUTED=auto .venv/bin/python -m grpo_jax train --config "$config_rel" "${overrides[@]}")
[[ $resume == 1 ]] && train_cmd+=(--resume)
[[ $allow_cpu == 1 ]] && train_cmd+=(--allow-cpu)
remote_train="cd $q_dir && $(show "${train_cmd[@]}")"
remote_unpack="mkdir -p $q_dir && tar xzf ~/grpo_jax.tar.gz -C $q_dir && cd $q_dir"
setup_args=""
[[ $allow_cpu == 1 ]] && setup_args=" --allow-cpu"
if [[ $install == 1 ]]; then
  remote_setup="$remote_unpack && bash launch/tpu_worker_setup.sh$setup_args"
elif [[ $allow_cpu == 1 ]]; then
  remote_setup="$remote_unpack"
else
  remote_setup="$remote_unpack && .venv/bin/python -m grpo_jax.distributed.platform_check tpu"
fi

run() { if [[ $dry_run == 1 ]]; then show "$@"; else "$@"; fi; }
run_sh() { if [[ $dry_run == 1 ]]; then echo "$1"; else bash -c "$1"; fi; }
run_check() {  # a dry run still runs check; its report goes to stderr so stdout stays the command list
  local status=0
  if [[ $dry_run == 1 ]]; then show "${check_cmd[@]}"; "${check_cmd[@]}" >&2 || status=$?
  else "${check_cmd[@]}" || status=$?; fi
  [[ $status == 0 ]] || { echo "tpu_pod.sh: python -m grpo_jax check failed (exit $status); not launching" >&2
                          exit "$status"; }
}
# Which shipped files are not HEAD's (a notice on stderr; --no-optional-locks: never touch the index).
shipped_changes() {
  local changed count
  changed="$(git -C "$repo" --no-optional-locks status --porcelain --untracked-files=all -- .)"
  [[ -n "$changed" ]] || return 0
  count="$(grep -c . <<<"$changed")"
  echo "tpu_pod.sh: shipping the working tree, with $count path(s) that differ from HEAD" \
       "(git status: ?? untracked, M modified, D deleted and not shipped):" >&2
  head -n 20 <<<"$changed" | sed 's/^/  /' >&2
  [[ $count -le 20 ]] || echo "  ... and $((count - 20)) more (git status)" >&2
}

[[ $dry_run == 1 ]] && show cd "$repo"
cd "$repo"
[[ $check == 1 ]] && run_check
shipped_changes
run_sh "$archive_sh"
run gcloud compute tpus tpu-vm scp "${gcloud_args[@]}" --worker=all "$tarball" "$tpu:grpo_jax.tar.gz"
run gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$remote_setup"
run gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$remote_train"
