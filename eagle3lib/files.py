"""Small file helpers shared by every stage: atomic writes and the run's metrics.json."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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
