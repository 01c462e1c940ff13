"""Versioned snapshots that a reader never sees torn: what the adaptation daemons publish and servers load.

Layout of a publish directory ``PUB``::

    PUB/current                 one line: the name of the newest complete version directory
    PUB/v000007/manifest.json   version, parent, what it was built from, metrics
    PUB/v000007/adjacency.safetensors        (graft) tensor ``adjacency`` (V, k) token ids, -1 = empty
    PUB/v000007/tenant-NAME.safetensors      (graft) a tenant's delta: ``rows`` (R,) and ``adjacency`` (R, k)
    PUB/v000007/config.json, model.safetensors   (bandit) a drafter's HF directory

What a version holds (``snapshot_kind``) is told by the file that marks it: ``adjacency.safetensors`` or
``config.json``.

A version is written into a temporary directory ``vNNNNNN.partial``, its files fsynced, then renamed to
``vNNNNNN`` (``trainer.io.write_dir_atomic``); only then is ``current`` replaced (``write_text_atomic``). A kill at any
moment leaves ``current`` naming a whole version; a failed publish (no space, no permission) removes its
temporary directory, leaves ``current`` as it was and raises :class:`PublishError` saying why. The newest
``keep`` versions stay on disk so that a reader holding an older path can finish loading it.

Try it on CPU::

    python -c "from pathlib import Path; from trainer.snapshots import publish, read_current; \\
        publish(Path('/tmp/pub'), lambda d: (d / 'x.txt').write_text('hi'), {}); print(read_current(Path('/tmp/pub')))"
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import shutil
from collections.abc import Callable, Iterator
from hashlib import sha256
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from trainer.errors import UserError
from trainer.io import write_dir_atomic, write_text_atomic

CURRENT = "current"
MANIFEST = "manifest.json"
ADJACENCY = "adjacency.safetensors"
DRAFTER_CONFIG = "config.json"
ADJACENCY_TENSOR = "adjacency"
DELTA_ROWS = "rows"
_VERSION_DIR = re.compile(r"v(\d{6,})")
# Characters a tenant name keeps in its file name; everything else is percent-encoded (injective: '%' itself
# is encoded), and a name whose encoding is long becomes a hash so that no file name exceeds the OS limit.
_SAFE = re.compile(r"[A-Za-z0-9_-]")
_MAX_NAME = 120


class PublishError(UserError):
    """A snapshot could not be published or read; the message says which file and why."""


def tenant_filename(tenant: str) -> str:
    """``tenant-NAME.safetensors`` with NAME safe for any filesystem; distinct tenants get distinct names."""
    encoded = "".join(c if _SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode()) for c in tenant)
    if len(encoded) > _MAX_NAME:
        # '~' is never produced by the encoding above, so a hashed name cannot equal an encoded one.
        encoded = "~" + sha256(tenant.encode()).hexdigest()
    return f"tenant-{encoded}.safetensors"


def version_path(root: Path, version: int) -> Path:
    """The directory of ``version`` under the publish directory ``root`` (whether or not it exists)."""
    return Path(root) / f"v{version:06d}"


def snapshot_kind(version_dir: Path) -> Literal["adjacency", "drafter"]:
    """What a published version holds: a graft adjacency matrix or a drafter (``load_adjacency`` or
    ``trainer.drafters.load_drafter`` reads it); :class:`PublishError` when it holds neither."""
    version_dir = Path(version_dir)
    if (version_dir / ADJACENCY).is_file():
        return "adjacency"
    if (version_dir / DRAFTER_CONFIG).is_file():
        return "drafter"
    raise PublishError(f"{version_dir} holds neither {ADJACENCY} nor a drafter's {DRAFTER_CONFIG}")


def _versions(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION_DIR.fullmatch(p.name)) and p.is_dir())


@contextlib.contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """One publisher at a time per directory: two daemons on one ``PUB`` would otherwise race on versions."""
    with open(root / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PublishError(f"another process is publishing into {root}; run one daemon per directory") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _reason(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}"


def publish(root: Path, payload: Callable[[Path], None], manifest: dict, keep: int = 5) -> int:
    """Publish a new version under ``root``; returns its number.

    ``payload(directory)`` writes the version's files into a fresh directory; ``manifest`` is stored as
    ``manifest.json`` with ``version`` and ``parent`` (the version that was current, or None) added. Versions
    older than the newest ``keep`` are removed afterwards.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root):
            return _publish_locked(root, payload, manifest, keep)
    except OSError as e:
        try:
            current = read_current(root) if root.is_dir() else None
        except PublishError:
            current = None
        still = f"{current[1].name} is still current" if current else "nothing is current"
        raise PublishError(f"could not publish a snapshot into {root}: {_reason(e)}; {still}") from e


def _publish_locked(root: Path, payload: Callable[[Path], None], manifest: dict, keep: int) -> int:
    for stale in root.glob("v*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    current = read_current(root)
    # A kill between the directory rename and the pointer swap leaves a complete but unnamed version; the next
    # one is numbered past it so that version numbers never repeat.
    version = max([0, *_versions(root)]) + 1
    name = version_path(root, version).name

    def save(tmp: Path) -> None:
        tmp.mkdir()
        payload(tmp)
        full = {**manifest, "version": version, "parent": current[0] if current else None}
        (tmp / MANIFEST).write_text(json.dumps(full, indent=1, sort_keys=True))

    try:
        write_dir_atomic(root / name, save)
    except BaseException:
        shutil.rmtree(root / f"{name}.partial", ignore_errors=True)
        raise
    write_text_atomic(root / CURRENT, f"{name}\n")
    for old in _versions(root)[:-keep]:
        shutil.rmtree(version_path(root, old), ignore_errors=True)
    return version


def read_current(root: Path) -> tuple[int, Path] | None:
    """``(version, directory)`` of the version ``root/current`` names; None when nothing was published."""
    pointer = Path(root) / CURRENT
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PublishError(f"cannot read {pointer}: {_reason(e)}") from e
    m = _VERSION_DIR.fullmatch(name)
    if m is None:
        raise PublishError(f"{pointer} holds {name[:40]!r}, not a version directory name like v000001")
    directory = Path(root) / name
    if not (directory / MANIFEST).is_file():
        raise PublishError(f"{pointer} names {name}, but {directory / MANIFEST} does not exist")
    return int(m.group(1)), directory


def read_manifest(version_dir: Path) -> dict:
    """The manifest of a published version."""
    path = Path(version_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PublishError(f"cannot read the snapshot manifest {path}: {e}") from e


def _load_int_tensors(path: Path, names: dict[str, int]) -> list[torch.Tensor]:
    """Integer tensors ``name`` of ``dim`` dimensions from a safetensors file, as int64."""
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise PublishError(f"cannot load {path}: {e}") from e
    out = []
    for name, dim in names.items():
        tensor = tensors.get(name)
        if tensor is None or tensor.dim() != dim or tensor.dtype not in (torch.int32, torch.int64):
            raise PublishError(f"{path} holds no integer {dim}-D tensor {name!r}")
        out.append(tensor.long())
    return out


def load_adjacency(version_dir: Path, tenant: str | None = None) -> torch.Tensor:
    """The published adjacency (V, k) int64 token ids, -1 = empty; with ``tenant``, the rows of that tenant's
    delta replace the shared ones (a tenant without a delta gets the shared matrix).

    A delta holds only the rows it overrides: ``rows`` (R,) token ids and ``adjacency`` (R, k).
    """
    version_dir = Path(version_dir)
    (adjacency,) = _load_int_tensors(version_dir / ADJACENCY, {ADJACENCY_TENSOR: 2})
    if tenant is None:
        return adjacency
    delta_path = version_dir / tenant_filename(tenant)
    if not delta_path.is_file():
        return adjacency
    rows, delta = _load_int_tensors(delta_path, {DELTA_ROWS: 1, ADJACENCY_TENSOR: 2})
    vocab, width = adjacency.shape
    if delta.shape != (rows.numel(), width) or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < vocab):
        raise PublishError(
            f"{delta_path}: {rows.numel()} rows and a {tuple(delta.shape)} adjacency do not fit the shared "
            f"({vocab}, {width}) matrix"
        )
    adjacency[rows] = delta
    return adjacency
