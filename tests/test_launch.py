"""launch/*: the scripts as users call them, through --dry-run (it prints exactly what would run).

From another directory (paths become absolute before the scripts `cd` to the repo), with an
uncommitted or untracked config for the pod (the working tree is what ships), with the accelerator
jaxlib check, and with --check (which runs `python -m grpo_jax check --devices N` first). A fake
python (a shell script logging its arguments) stands in for the repo's interpreter wherever a
script would run it, so nothing here needs a GPU, a TPU, gcloud or the check command itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
# printf %q of a ',' inside CUDA_VISIBLE_DEVICES
GPUS_0123 = "CUDA_VISIBLE_DEVICES=0\\,1\\,2\\,3"


def _launch(script: str | Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    path = script if isinstance(script, Path) else LAUNCH / script
    return subprocess.run(["bash", str(path), *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, **(env or {})}, check=False)


@pytest.fixture
def fake_python(tmp_path):
    """A python that logs each call's arguments to FAKE_LOG and exits FAKE_RC (default 0)."""
    path = tmp_path / "fakebin" / "python"
    path.parent.mkdir()
    path.write_text('#!/usr/bin/env bash\nprintf \'%s\\n\' "$*" >> "$FAKE_LOG"\necho "fake report: $*"\n'
                    'exit "${FAKE_RC:-0}"\n')
    path.chmod(0o755)
    log = tmp_path / "fake.log"
    return path, log, {"FAKE_LOG": str(log)}


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def elsewhere(tmp_path):
    """A directory outside the repo holding the user's own config, myconf.py."""
    home = tmp_path / "work"
    home.mkdir()
    shutil.copy(REPO / "configs" / "arith_cpu.py", home / "myconf.py")
    return home


# ----------------------------------------------------------------------------------------------
# gpu_local.sh

def test_gpu_local_from_another_directory_prints_the_cd_and_absolute_paths(elsewhere):
    proc = _launch("gpu_local.sh", "--dry-run", "--config", "myconf.py", "--python", "venv/bin/python",
                   "--gpus", "0,1,2,3", "--set", "mesh.fsdp=4", "--resume", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    py = f"{elsewhere}/venv/bin/python"
    assert proc.stdout.splitlines() == [
        f"cd {REPO}",
        f"{py} -m grpo_jax.distributed.platform_check cuda",  # the venv must hold the CUDA jaxlib
        (f"env XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 {GPUS_0123} {py} -m grpo_jax train "
         f"--config {elsewhere}/myconf.py --set mesh.fsdp=4 --resume"),
    ]
    # A repo-relative config still resolves from anywhere (the README's commands use them).
    proc = _launch("gpu_local.sh", "--dry-run", "--config", "configs/qwen25_05b_gpu.py", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].endswith(f"--config {REPO}/configs/qwen25_05b_gpu.py")


def test_gpu_local_refuses_bad_arguments_naming_them(elsewhere):
    bad = _launch("gpu_local.sh", "--dry-run", "--config", "myconf.py", "--gpus", "all", cwd=elsewhere)
    assert bad.returncode == 2 and "--gpus 'all' must be a comma-separated list" in bad.stderr
    missing = _launch("gpu_local.sh", "--dry-run", "--config", "nope.py", cwd=elsewhere)
    assert missing.returncode == 2
    assert f"--config nope.py: no such file (relative paths are tried from {elsewhere} and {REPO})" in missing.stderr


def test_gpu_local_stops_before_training_when_the_venv_lacks_the_cuda_jaxlib(elsewhere, fake_python):
    python, log, env = fake_python
    ran = _launch("gpu_local.sh", "--config", "myconf.py", "--python", str(python), cwd=elsewhere, env=env)
    assert ran.returncode == 0, ran.stderr
    assert _calls(log) == ["-m grpo_jax.distributed.platform_check cuda", f"-m grpo_jax train --config {elsewhere}/myconf.py"]
    log.unlink()
    stopped = _launch("gpu_local.sh", "--config", "myconf.py", "--python", str(python), cwd=elsewhere,
                      env={**env, "FAKE_RC": "1"})
    assert stopped.returncode == 1 and _calls(log) == ["-m grpo_jax.distributed.platform_check cuda"]  # train never started
    # --allow-cpu skips the check and asks train to accept a CPU backend.
    allowed = _launch("gpu_local.sh", "--dry-run", "--config", "myconf.py", "--allow-cpu", cwd=elsewhere)
    assert "platform_check" not in allowed.stdout and allowed.stdout.rstrip().endswith("--allow-cpu")


def test_gpu_local_check_runs_grpo_jax_check_on_the_gpus_the_launch_uses(elsewhere, fake_python, tmp_path):
    python, log, env = fake_python
    args = ("--dry-run", "--config", "myconf.py", "--python", str(python), "--set", "mesh.fsdp=3", "--check")
    proc = _launch("gpu_local.sh", *args, "--gpus", "0,1,2", "--memory-per-device", "80GB", cwd=elsewhere, env=env)
    assert proc.returncode == 0, proc.stderr
    want = f"-m grpo_jax check --config {elsewhere}/myconf.py --set mesh.fsdp=3 --devices 3 --memory-per-device 80GB"
    assert _calls(log) == [want]  # the dry run runs check, nothing else
    assert f"{python} {want}" in proc.stdout.splitlines() and "fake report" in proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("env XLA_PYTHON_CLIENT_MEM_FRACTION")

    # Without --gpus: CUDA_VISIBLE_DEVICES, else nvidia-smi's list.
    _launch("gpu_local.sh", *args, cwd=elsewhere, env={**env, "CUDA_VISIBLE_DEVICES": "4,5"})
    assert _calls(log)[-1].endswith("--devices 2")
    smi = tmp_path / "smi" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/usr/bin/env bash\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 (UUID: x)\"; done\n")
    smi.chmod(0o755)
    no_cvd = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    subprocess.run(["bash", str(LAUNCH / "gpu_local.sh"), *args], cwd=elsewhere, capture_output=True, timeout=60,
                   env={**no_cvd, **env, "PATH": f"{smi.parent}:{os.environ['PATH']}"}, check=False)
    assert _calls(log)[-1].endswith("--devices 8")

    failed = _launch("gpu_local.sh", *args, "--gpus", "0", cwd=elsewhere, env={**env, "FAKE_RC": "3"})
    assert failed.returncode == 3 and "check failed (exit 3); not launching" in failed.stderr
    assert "grpo_jax train" not in failed.stdout


# ----------------------------------------------------------------------------------------------
# slurm.sbatch

SLURM_ENV = {"GPUS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "3", "GRPO_PYTHON": "/opt/venv/bin/python"}


def test_slurm_from_another_directory_starts_one_process_per_gpu_with_absolute_paths(elsewhere):
    proc = _launch("slurm.sbatch", "--dry-run", "--config", "myconf.py", "--set", "mesh.fsdp=12", cwd=elsewhere,
                   env=SLURM_ENV)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"cd {REPO}",
        "/opt/venv/bin/python -m grpo_jax.distributed.platform_check cuda",
        ("srun --nodes=3 --ntasks-per-node=4 --kill-on-bad-exit=1 env GRPO_DISTRIBUTED=auto "
         f"/opt/venv/bin/python -m grpo_jax train --config {elsewhere}/myconf.py --set mesh.fsdp=12"),
    ]


def test_slurm_finds_the_repo_when_sbatch_runs_a_copy_of_the_script(tmp_path, elsewhere):
    spool = tmp_path / "spool" / "job1"
    spool.mkdir(parents=True)
    shutil.copy(LAUNCH / "slurm.sbatch", spool / "slurm_script")  # what sbatch executes
    proc = _launch(spool / "slurm_script", "--dry-run", "--config", "configs/qwen25_05b_gpu.py", cwd=REPO,
                   env={"SLURM_SUBMIT_DIR": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"cd {REPO}" and f"{REPO}/.venv/bin/python -m grpo_jax train" in proc.stdout
    lost = _launch(spool / "slurm_script", "--dry-run", "--config", "myconf.py", cwd=elsewhere,
                   env={"SLURM_SUBMIT_DIR": str(elsewhere)})
    assert lost.returncode == 2 and "set GRPO_REPO=/path/to/grpo_jax" in lost.stderr


def test_slurm_check_uses_nodes_times_gpus_per_node(elsewhere, fake_python):
    python, log, env = fake_python
    proc = _launch("slurm.sbatch", "--dry-run", "--check", "--config", "myconf.py", "--python", str(python),
                   cwd=elsewhere, env={**SLURM_ENV, **env})
    assert proc.returncode == 0, proc.stderr
    assert _calls(log) == [f"-m grpo_jax check --config {elsewhere}/myconf.py --devices 12"]
    failed = _launch("slurm.sbatch", "--dry-run", "--check", "--config", "myconf.py", "--python", str(python),
                     cwd=elsewhere, env={**SLURM_ENV, **env, "FAKE_RC": "4"})
    assert failed.returncode == 4 and "srun" not in failed.stdout


# ----------------------------------------------------------------------------------------------
# tpu_pod.sh

POD = ("--tpu", "pod-16", "--zone", "us-west4-a")


def test_tpu_pod_dry_run_ships_the_working_tree_installs_then_runs_on_every_worker(elsewhere):
    proc = _launch("tpu_pod.sh", "--dry-run", *POD, "--config", "configs/tpu_pod.py", "--set", "mesh.fsdp=16",
                   "--set", "train.run_dir=gs://b/run 1", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    cd, archive, scp, setup, train = proc.stdout.splitlines()
    assert cd == f"cd {REPO}"
    assert "git ls-files -z --cached --others --exclude-standard" in archive and "tar -czf" in archive
    assert scp.startswith("gcloud compute tpus tpu-vm scp --zone us-west4-a --worker=all ")
    assert scp.endswith(" pod-16:grpo_jax.tar.gz")
    # Each worker makes a Python >= 3.11 venv and installs '.[tpu]' (launch/tpu_worker_setup.sh).
    assert setup.startswith("gcloud compute tpus tpu-vm ssh pod-16 --zone us-west4-a --worker=all --command ")
    assert "tar\\ xzf\\ ~/grpo_jax.tar.gz" in setup and "bash\\ launch/tpu_worker_setup.sh" in setup
    assert train.startswith("gcloud compute tpus tpu-vm ssh pod-16 --zone us-west4-a --worker=all --command ")
    for piece in ("GRPO_DISTRIBUTED=auto", "-m\\ grpo_jax\\ train", "--config\\ configs/tpu_pod.py", "mesh.fsdp=16"):
        assert piece in train, piece
    # The space inside an override survives two levels of shell quoting (local, then ssh).
    assert "run\\\\\\ 1" in train


def test_tpu_pod_requires_tpu_zone_and_an_existing_config():
    proc = _launch("tpu_pod.sh", "--dry-run", "--zone", "z", "--config", "configs/tpu_pod.py", cwd=REPO)
    assert proc.returncode == 2 and "--tpu is required" in proc.stderr
    proc = _launch("tpu_pod.sh", "--dry-run", "--tpu", "t", "--zone", "z", "--config", "configs/nope.py", cwd=REPO)
    assert proc.returncode == 2 and "--config configs/nope.py: no such file" in proc.stderr


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main",
                    *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def scratch_repo(tmp_path):
    """A committed git repo with the launch scripts, then edited: one config modified, one untracked,
    one ignored, and a tracked file deleted."""
    repo = tmp_path / "proj"
    (repo / "launch").mkdir(parents=True)
    for name in ("tpu_pod.sh", "tpu_worker_setup.sh"):
        shutil.copy(LAUNCH / name, repo / "launch" / name)
    (repo / "configs").mkdir()
    (repo / "configs" / "a.py").write_text("A = 1\n")
    (repo / "gone.txt").write_text("deleted after the commit\n")
    (repo / ".gitignore").write_text("private/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    (repo / "configs" / "a.py").write_text("A = 2  # not committed\n")
    (repo / "configs" / "new.py").write_text("NEW = 1\n")
    (repo / "gone.txt").unlink()
    (repo / "private").mkdir()
    (repo / "private" / "p.py").write_text("P = 1\n")
    return repo


def test_tpu_pod_ships_modified_and_untracked_configs_as_they_are_on_disk(scratch_repo, tmp_path):
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    proc = _launch(scratch_repo / "launch" / "tpu_pod.sh", "--dry-run", *POD, "--config", "proj/configs/new.py",
                   cwd=tmp_path, env={"TMPDIR": str(tmpdir)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "--config\\ configs/new.py" in lines[-1]  # the repo-relative path the workers unpack
    assert "?? configs/new.py" in proc.stderr and " M configs/a.py" in proc.stderr  # said, not silent
    # Run the printed archive command: the tarball holds the working tree, not HEAD.
    subprocess.run(["bash", "-c", lines[1]], check=True, timeout=60)
    with tarfile.open(tmpdir / f"grpo_jax_{os.getuid()}.tar.gz") as tar:
        names = set(tar.getnames())
        assert tar.extractfile("configs/a.py").read() == b"A = 2  # not committed\n"
        assert tar.extractfile("configs/new.py").read() == b"NEW = 1\n"
    assert {"launch/tpu_pod.sh", "launch/tpu_worker_setup.sh", ".gitignore"} <= names
    assert not {"gone.txt", "private/p.py"} & names and not any(n.startswith(".git/") for n in names)


def test_tpu_pod_refuses_a_config_the_archive_would_not_carry(scratch_repo, tmp_path):
    script = scratch_repo / "launch" / "tpu_pod.sh"
    ignored = _launch(script, "--dry-run", *POD, "--config", "private/p.py", cwd=scratch_repo)
    assert ignored.returncode == 2 and "private/p.py is ignored by git" in ignored.stderr
    (tmp_path / "outside.py").write_text("X = 1\n")
    outside = _launch(script, "--dry-run", *POD, "--config", "outside.py", cwd=tmp_path)
    assert outside.returncode == 2 and "is outside the repo" in outside.stderr
    assert "copy it under the repo" in outside.stderr
    plain = tmp_path / "plain"
    shutil.copytree(scratch_repo, plain, ignore=shutil.ignore_patterns(".git"))
    not_git = _launch(plain / "launch" / "tpu_pod.sh", "--dry-run", *POD, "--config", "configs/a.py", cwd=plain)
    assert not_git.returncode == 2 and "is not a git checkout" in not_git.stderr


@pytest.mark.parametrize("accelerator_type, devices", [
    ("v5litepod-16", 16), ("v6e-8", 8),  # one TensorCore per chip, one JAX device per chip
    ("v4-32", 16), ("v5p-128", 64),      # the type counts TensorCores; a megacore chip is one device
    ("v3-8", 8),                         # one JAX device per TensorCore
])
def test_tpu_pod_check_runs_grpo_jax_check_on_the_slice_devices(accelerator_type, devices, fake_python):
    python, log, env = fake_python
    proc = _launch("tpu_pod.sh", "--dry-run", *POD, "--config", "configs/tpu_pod.py", "--check", "--accelerator-type",
                   accelerator_type, "--python", str(python), "--memory-per-device", "16GB", cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    want = f"-m grpo_jax check --config {REPO}/configs/tpu_pod.py --devices {devices} --memory-per-device 16GB"
    assert _calls(log) == [want]


def test_tpu_pod_check_needs_the_slice_size_and_stops_the_launch_when_it_fails(fake_python):
    python, log, env = fake_python
    base = ("--dry-run", *POD, "--config", "configs/tpu_pod.py", "--check", "--python", str(python))
    proc = _launch("tpu_pod.sh", *base, "--devices", "12", "--accelerator-type", "v5litepod-16", cwd=REPO, env=env)
    assert proc.returncode == 0 and _calls(log)[-1].endswith("--devices 12")  # --devices wins
    unknown = _launch("tpu_pod.sh", *base, "--accelerator-type", "v9x-8", cwd=REPO, env=env)
    assert unknown.returncode == 2 and "pass --devices N" in unknown.stderr
    neither = _launch("tpu_pod.sh", *base, cwd=REPO, env=env)
    assert neither.returncode == 2 and "--check needs the slice size" in neither.stderr
    failed = _launch("tpu_pod.sh", *base, "--devices", "16", cwd=REPO, env={**env, "FAKE_RC": "5"})
    assert failed.returncode == 5 and "not launching" in failed.stderr and "gcloud" not in failed.stdout


def test_tpu_pod_skip_install_still_ships_and_checks_libtpu_and_allow_cpu_relaxes_it():
    proc = _launch("tpu_pod.sh", "--dry-run", *POD, "--config", "configs/tpu_pod.py", "--skip-install", cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    setup = proc.stdout.splitlines()[3]
    assert "tar\\ xzf" in setup and "platform_check\\ tpu" in setup and "tpu_worker_setup" not in setup
    proc = _launch("tpu_pod.sh", "--dry-run", *POD, "--config", "configs/tpu_pod.py", "--allow-cpu", cwd=REPO)
    setup, train = proc.stdout.splitlines()[3:]
    assert "tpu_worker_setup.sh\\ --allow-cpu" in setup and train.endswith("--allow-cpu")


# ----------------------------------------------------------------------------------------------
# tpu_worker_setup.sh, on a worker whose image ships Python 3.10

def _worker(tmp_path, *, python3_ok: bool, with_uv: bool, args=()) -> tuple[subprocess.CompletedProcess, list]:
    """Runs the setup script with PATH holding only fakes and the few tools it needs."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("bash", "env", "hostname", "rm", "mkdir", "cp", "chmod", "cat"):
        (bin_ / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "worker.log"
    venv_python = tmp_path / "venv_python"
    venv_python.write_text('#!/usr/bin/env bash\necho "venv-python $*" >> "$LOG"\n'
                           'case "$1" in --version) echo "Python 3.12.9";; -c) [[ "$2" == *version_info* ]] || '
                           'echo 0.10.2;; esac\n')
    make_venv = 'mkdir -p .venv/bin && cp "$VENV_PYTHON" .venv/bin/python && chmod +x .venv/bin/python'
    (bin_ / "python3").write_text(
        '#!/usr/bin/env bash\necho "python3 $*" >> "$LOG"\n'
        f'if [[ "$1" == --version ]]; then echo "Python {"3.12.3" if python3_ok else "3.10.12"}"; exit 0; fi\n'
        f'if [[ "$1" == -c ]]; then exit {0 if python3_ok else 1}; fi\n'
        f'if [[ "$1 $2" == "-m venv" ]]; then {make_venv}; exit 0; fi\n'
        'exit 1  # pip: no uv for this image\n')
    if with_uv:
        (bin_ / "uv").write_text(f'#!/usr/bin/env bash\necho "uv $*" >> "$LOG"\n{make_venv}\n')
    for fake in bin_.iterdir():
        if not fake.is_symlink():
            fake.chmod(0o755)
    worker = tmp_path / "worker"
    worker.mkdir()
    env = {"PATH": str(bin_), "HOME": str(tmp_path / "home"), "LOG": str(log), "VENV_PYTHON": str(venv_python)}
    proc = subprocess.run([shutil.which("bash"), str(LAUNCH / "tpu_worker_setup.sh"), *args], cwd=worker, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    return proc, (log.read_text().splitlines() if log.exists() else [])


def test_worker_setup_gets_python_312_from_uv_when_the_image_has_310(tmp_path):
    proc, calls = _worker(tmp_path, python3_ok=False, with_uv=True)
    assert proc.returncode == 0, proc.stderr
    assert "uv venv --seed --python 3.12 .venv" in calls
    assert "venv-python -m pip install --quiet -e .[tpu]" in calls
    assert "venv-python -m grpo_jax.distributed.platform_check tpu" in calls
    assert "Python 3.12.9, jax 0.10.2" in proc.stdout


def test_worker_setup_uses_python3_when_it_is_new_enough(tmp_path):
    proc, calls = _worker(tmp_path, python3_ok=True, with_uv=False)
    assert proc.returncode == 0, proc.stderr
    assert "python3 -m venv .venv" in calls and not any(c.startswith("uv ") for c in calls)


def test_worker_setup_without_a_way_to_python_311_says_what_to_run(tmp_path):
    proc, _ = _worker(tmp_path, python3_ok=False, with_uv=False)
    assert proc.returncode == 1
    assert "curl -LsSf https://astral.sh/uv/install.sh | sh" in proc.stderr and "--worker=all" in proc.stderr
