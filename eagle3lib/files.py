"""Small file helpers shared by every stage: atomic writes, guarded deletes, the run folder's
lock, the run's metrics.json, and what to say when a write fails (a full disk, a read-only one)."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .layout import RunLayout


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
            remove_tree(old, under=path.parent, ignore_errors=True)
    finally:
        if tmp.exists():
            remove_tree(tmp, under=path.parent, ignore_errors=True)


def remove_stale_temp_dirs(path: str | os.PathLike) -> list[Path]:
    """Delete the temp folders atomic_dir(path) leaves beside `path` when its process is killed
    (`.<name>-XXXX`, `.<name>.old-XXXX`); call it where nothing else builds `path` (the run lock).
    Returns what was deleted."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    stale = [p for pattern in (f".{path.name}-*", f".{path.name}.old-*") for p in path.parent.glob(pattern)
             if p.is_dir() and not p.is_symlink()]
    for p in stale:
        remove_tree(p, under=path.parent, ignore_errors=True)
    return stale


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


class MetricsError(ValueError):
    """metrics.json is not a JSON object of sections; the message names the file and the fix."""


def read_metrics(path: str | os.PathLike) -> dict:
    """The run's metrics.json as {section: {...}}; {} when there is none. A truncated, non-JSON or
    non-object file raises MetricsError naming it (every reader of metrics.json goes through here)."""
    path = Path(path)
    if not path.is_file():
        return {}
    fix = f"move it aside (mv {path} {path}.bad) and rerun the stages whose sections you need"
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:     # JSONDecodeError is a ValueError
        raise MetricsError(f"{path} is not valid JSON ({e}): {fix}") from None
    if not isinstance(metrics, dict) or not all(isinstance(v, dict) for v in metrics.values()):
        raise MetricsError(f"{path} must hold a JSON object of sections ({{\"data\": {{...}}, ...}}), "
                           f"got {type(metrics).__name__}: {fix}")
    return metrics


def update_metrics(run_dir: str | os.PathLike, section: str, values: dict) -> dict:
    """Merge `values` into outputs/<run>/metrics.json under `section` (atomic); returns the file's content."""
    path = RunLayout(run_dir).metrics
    metrics = read_metrics(path)
    metrics.setdefault(section, {}).update(values)
    atomic_write_json(path, metrics)
    return metrics


# ---- what to say when a write fails --------------------------------------------------------------
def write_failure_reason(e: OSError) -> str:
    """A short name of why a write failed, for the index page ("disk full", "read-only file system")."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk full"
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return e.strerror or type(e).__name__


def describe_write_failure(e: OSError, path: str | os.PathLike | None = None) -> str:
    """"cannot write PATH (the system's words): the fix", for one `eagle3:` line. `path`: the file being
    written where the error does not name it (a write() that hits a full disk names no file)."""
    path = e.filename if e.filename is not None else path
    folder = Path(path).parent if path is not None else Path(".")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = (f"the disk is full: free space on it (df -h {folder}) or set output_dir to a folder on another "
               "disk, then rerun the same command (finished stages and checkpoints are kept)")
    elif e.errno == errno.EROFS:
        fix = ("the file system is read-only: remount it read-write, or set output_dir (or --run-name) to a "
               "folder on a writable disk")
    elif e.errno in (errno.EACCES, errno.EPERM):
        fix = "the run folder must be writable (chmod u+w, chattr -i), or choose another --run-name"
    else:
        fix = f"check the folder (ls -ld {folder}) and the disk, then rerun the same command"
    return f"cannot write {path if path is not None else 'a file'} ({e.strerror or e}): {fix}"


# ---- links inside a run folder -----------------------------------------------------------------
class UnsafeLink(ValueError):
    """A symlink inside a run folder points outside it: a stage would write or delete there."""


def check_run_links(run_dir: str | os.PathLike, within: str | os.PathLike | None = None) -> None:
    """Refuse a run folder holding a symlink (at any depth) whose target lies outside `within`
    (default: the run folder itself).

    Stages write and delete below the run folder (data/, hidden/, train/, ...); a link there would
    carry those writes and deletes elsewhere. Links that stay inside are fine: a 06_scaling point
    (<run>/scaling/<point>) links data/ and hidden/ to its run's own and is checked with
    within=<run>. Links are not followed while walking."""
    root = Path(run_dir)
    if not root.is_dir():
        return
    real_root = Path(within if within is not None else run_dir).resolve()
    if not (root.resolve() == real_root or real_root in root.resolve().parents):
        raise ValueError(f"check_run_links: {root} is not inside {within}")
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            entry = Path(folder) / name
            if entry.is_symlink() and real_root not in entry.resolve().parents:
                raise UnsafeLink(f"{entry} is a link to {os.readlink(entry)} (resolves to {entry.resolve()}), "
                                 f"outside the run folder {real_root}: stages would write or delete there. "
                                 f"Remove the link (rm {entry}) or make it a real folder, then rerun")


# ---- guarded delete --------------------------------------------------------------------------
def is_strictly_inside(path: str | os.PathLike, root: str | os.PathLike, follow_links: bool = True) -> bool:
    """Whether `path` lies below `root` (symlinks and '..' resolved) and is not `root` itself.
    follow_links=False: also spelled below `root` (no '..'), with no symlink on the way from `root`
    down to `path`, `root` and `path` included (so a link cannot carry the allowed root along)."""
    if follow_links:
        return Path(root).resolve() in Path(path).resolve().parents
    path, root = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    if root not in path.parents or ".." in path.relative_to(root).parts:
        return False
    on_the_way = [root, *(root / Path(*path.relative_to(root).parts[:i + 1])
                          for i in range(len(path.relative_to(root).parts)))]
    return not any(p.is_symlink() for p in on_the_way)


def remove_tree(path: str | os.PathLike, under: str | os.PathLike, ignore_errors: bool = False) -> None:
    """shutil.rmtree(path), refused unless `path` is strictly inside `under` (e.g. the run folder):
    a wrong run name or a bug can then never delete anything outside outputs/. A missing `path` is
    not an error."""
    if not is_strictly_inside(path, under):
        raise ValueError(f"refusing to delete {path}: it is not inside {under} "
                         f"(resolves to {Path(path).resolve()}); nothing was deleted")
    if not is_strictly_inside(path, under, follow_links=False):
        raise ValueError(f"refusing to delete {path}: the way from {under} to it goes through a link "
                         f"(resolves to {Path(path).resolve()}); nothing was deleted")
    if Path(path).exists() or Path(path).is_symlink():
        shutil.rmtree(path, ignore_errors=ignore_errors)


# ---- run folder lock ---------------------------------------------------------------------------
LOCK_NAME = ".lock"
LOCK_TOKEN_ENV = "EAGLE3_RUN_LOCK"    # the holder's token, inherited by the processes it starts


class RunLocked(RuntimeError):
    """Another live process holds the run folder's lock; the message names its pid and host."""


def _process_start(pid: int) -> Optional[str]:
    """Start time of process `pid` (clock ticks since boot, /proc/<pid>/stat field 22), so that a
    reused pid is not mistaken for the lock's owner; None where /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]     # fields after the "(comm)" name start at field 3


def _is_alive(owner: dict) -> bool:
    """Whether the lock's owner still runs. An owner on another host counts as alive (we cannot
    tell), as does an unreadable lock: the message then says how to remove it by hand."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return True
    pid = owner["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                        # alive, run by another user
    start = owner.get("start")
    return start is None or _process_start(pid) in (None, start)


def _read_lock(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _create_lock(path: Path, owner: dict) -> bool:
    """Create `path` holding `owner` with O_CREAT | O_EXCL: False if it already exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _remove_stale_lock(folder: Path, path: Path, stale: dict) -> bool:
    """Delete the lock if it still holds `stale`. Takeovers are serialised by flock on the run
    folder (released by the kernel when a process dies), so two processes that both found the same
    stale lock cannot both take it: the second re-reads and finds the first's live lock."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _read_lock(path) != stale:
            return False
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)                                # also releases the flock


@contextmanager
def run_lock(folder: str | os.PathLike, log: Callable[[str], Any] = print) -> Iterator[Path]:
    """Hold `<folder>/.lock` (pid, host, process start, token) for the duration of the block.

        with run_lock(run_dir):
            ...                                     # no other process works on run_dir meanwhile

    A second holder stops at once with RunLocked naming the owner's pid and host (it does not
    wait). A lock left by a dead process (same host, pid gone or reused) is taken over and the
    takeover is logged. The lock is removed on exit, on exceptions too. Processes started inside
    the block inherit the token (env EAGLE3_RUN_LOCK) and enter without taking it again, so
    `eagle3 run` can hold the lock while its notebooks start `python -m eagle3lib.train`. A folder
    holding a link out of it is refused first (check_run_links).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    check_run_links(folder)
    path = folder / LOCK_NAME
    inherited = os.environ.get(LOCK_TOKEN_ENV)
    if inherited and _read_lock(path).get("token") == inherited:
        yield path                                  # our parent holds it; it also releases it
        return
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "token": secrets.token_hex(8)}
    while not _create_lock(path, me):
        owner = _read_lock(path)
        if _is_alive(owner):
            raise RunLocked(f"{folder} is in use by pid {owner.get('pid', '?')} on host "
                            f"{owner.get('host', '?')} (since {owner.get('since', '?')}): wait for that "
                            f"run to finish, or use another run name; if that process is gone, delete {path}")
        if _remove_stale_lock(folder, path, owner):
            log(f"[eagle3] took over the stale lock {path} of pid {owner.get('pid')} on "
                f"{owner.get('host')} (no longer running)")
    os.environ[LOCK_TOKEN_ENV] = me["token"]
    try:
        yield path
    finally:
        if inherited is None:
            os.environ.pop(LOCK_TOKEN_ENV, None)
        else:
            os.environ[LOCK_TOKEN_ENV] = inherited
        if _read_lock(path).get("token") == me["token"]:
            path.unlink(missing_ok=True)
