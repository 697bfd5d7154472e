"""Whether a checkpoint step holds what was saved: its metadata files parse, its leaves have the
requested shapes and dtypes, and its arrays match the fingerprints the save recorded in the meta
item (``FINGERPRINTS_KEY``), for a whole-state restore and for a reader of part of a step (eval).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax

from grpo_jax.io import fingerprint as fingerprint_lib
from grpo_jax.io.orbax_output import one_line

# The checkpoint module's logger: its records are the checkpoint's, filtered there by users and tests.
log = logging.getLogger("grpo_jax.io.checkpoint")

# JSON files without which a step cannot load (the tree structure, our meta item); checked first
# so that a broken one is named. Not _CHECKPOINT_METADATA: Orbax restores a step whose copy of
# that file is broken (it logs an error), and so must we.
JSON_FILES = ("state/_METADATA", "meta/metadata")
FINGERPRINTS_KEY = "array_fingerprints"  # in the meta item; ``restore`` returns meta without it
# Written beside the fingerprints. A meta with it and without fingerprints lost them (corrupt); one
# with neither was saved before checkpoints were verified, and restores with a warning: refusing
# it would strand every run started before the upgrade (nothing would restore).
FORMAT_KEY = "verified_format"


def verified_meta(meta: dict, state: Any, meta_file: Path, required_meta: tuple[str, ...]) -> tuple[dict, bool]:
    """(meta without the fingerprint fields, whether the arrays were verified) for a restored step.

    ValueError when the meta lost its fingerprints or a field in `required_meta` (damaged), or when
    `state`'s arrays differ from their saved fingerprints. A step saved before fingerprints existed
    (neither field) is not verified: (meta, False).
    """
    meta = dict(meta)
    saved = meta.pop(FINGERPRINTS_KEY, None)
    verified = meta.pop(FORMAT_KEY, None) is not None
    lost = [] if isinstance(saved, dict) or not verified else [FINGERPRINTS_KEY]
    missing = lost + [k for k in required_meta if k not in meta]
    if missing:
        raise ValueError(f"{meta_file} lacks the field(s) {missing} (damaged)")
    if verified:
        _check_fingerprints(saved, fingerprint_lib.tree_fingerprints(state))
    return meta, verified


def _check_fingerprints(saved: dict, read: dict) -> None:
    """ValueError naming the first array whose fingerprint read back differs from the saved one."""
    bad = fingerprint_lib.mismatches(saved, read)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"array data changed on disk since the save: {bad[0]}{more}")


def verify_partial_restore(step_dir: Path, tree: Any) -> None:
    """For a reader that restores part of a step (eval's params only): ValueError unless the
    step's meta has fingerprints and every leaf of ``tree`` (keyed from the state's root, e.g.
    ``{"params": ...}``) matches its saved one."""
    file = Path(os.fspath(step_dir)) / "meta" / "metadata"
    try:
        meta = json.loads(file.read_bytes())
        saved, verified = meta.get(FINGERPRINTS_KEY), FORMAT_KEY in meta
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{file}: cannot read the step's meta ({one_line(e)})") from None
    if not verified and saved is None:
        log.warning("%s: saved before grpo_jax fingerprinted its arrays; read without verifying them", file)
        return
    if not isinstance(saved, dict):
        raise ValueError(f"{file} lacks the field(s) ['{FINGERPRINTS_KEY}'] (damaged)")
    read = fingerprint_lib.tree_fingerprints(tree)
    _check_fingerprints({k: saved[k] for k in read if k in saved}, read)


def check_restored_matches(abstract_state: Any, restored: Any, step: int) -> None:
    """Raises ValueError when a restored leaf's shape or dtype differs from the requested one."""
    paths_abstract, _ = jax.tree_util.tree_flatten_with_path(abstract_state)
    leaves_restored = jax.tree_util.tree_leaves(restored)
    if len(paths_abstract) != len(leaves_restored):
        raise ValueError(
            f"step {step}: restored {len(leaves_restored)} leaves, abstract_state has {len(paths_abstract)}"
        )
    for (path, want), got in zip(paths_abstract, leaves_restored):
        if not hasattr(want, "shape"):
            continue
        if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
            raise ValueError(
                f"step {step}: leaf {jax.tree_util.keystr(path)} restored as {got.dtype}{list(got.shape)}, "
                f"abstract_state asks for {want.dtype}{list(want.shape)}"
            )


def check_json_files(step_dir: Path) -> None:
    """A step's metadata files that exist must parse: otherwise Orbax's error is a bare
    "Expecting value: line 1 column 1 (char 0)" that names no file."""
    for name in JSON_FILES:
        file = step_dir / name
        if not file.is_file():
            continue  # Orbax says what is missing, naming the file
        try:
            json.loads(file.read_bytes())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        except ValueError as e:  # UnicodeDecodeError: binary garbage
            raise ValueError(f"{file}: not valid JSON ({e})") from None
