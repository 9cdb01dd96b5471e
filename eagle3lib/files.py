"""Small file helpers shared by every stage: atomic writes and the run's metrics.json."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a folder under a temp name, then rename it to `path`.

        with atomic_dir(out) as tmp:
            save_file(state, str(tmp / "model.safetensors"))

    The temp folder `.<name>-XXXX` sits beside `path`, so the rename is atomic. On success every
    file in it is fsynced, an existing `path` is moved aside (`.<name>.old-XXXX`) and removed after
    the rename. On error the temp folder is deleted and `path` is left as it was. A killed run
    leaves only a dot-named temp folder, never a half-written `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old)       # replaces the empty placeholder folder
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def update_metrics(run_dir: str | os.PathLike, section: str, values: dict) -> dict:
    """Merge `values` into outputs/<run>/metrics.json under `section` (atomic); returns the file's content."""
    path = Path(run_dir) / "metrics.json"
    metrics = read_json(path) if path.is_file() else {}
    metrics.setdefault(section, {}).update(values)
    atomic_write_json(path, metrics)
    return metrics
