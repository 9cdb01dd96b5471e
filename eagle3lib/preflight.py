"""Preflight: what would stop the full run on this machine, checked in seconds before 01 starts.

    checks = preflight_checks(p, plan)   # [Check(name, verdict, text, basis)]; plan.capacity_plan calls it

Four checks: the target's tokenizer loads under the installed transformers (its remote code's imports
read first, then the tokenizer loaded); its lm_head is a plain float tensor found by name (the
embedding stands in only where config.json ties them); /dev/shm holds what 04's DataLoader workers
put there; the disk reads the hidden-state cache as fast as 04 trains. On GPUs without NVLink (PCIe
only: gpus.pcie_only) a fifth: the installed NCCL has the PCIe peer-to-peer fix (2.31.2) or
NCCL_P2P_DISABLE=1 is set. A verdict is "ok", "refuse",
"warn" or "not checked"; a basis says "measured here (<host>)" or "assumed (...)". plan.full_run_problems
turns refusals into the refusals of `eagle3 plan` (exit 4) and `eagle3 run` (before any stage).
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from .checkpoint_keys import HEAD_SUFFIXES, TargetHeadError, head_key, read_config, weight_map
from .gpus import pcie_only
from .layout import RunLayout
from .params import Params, train_ranks
from .stage_times import BOX_CACHE_READ_BASIS, BOX_CACHE_READ_BYTES_PER_S, CACHE_READ_PART

VERDICT_LABELS = {"ok": "ok", "refuse": "REFUSED", "warn": "WARNING", "not checked": "not checked"}
SHM = "/dev/shm"
# The disk read probe: at most this many bytes or seconds of one shard; fewer bytes than
# READ_PROBE_MIN_BYTES (a tiny cache) measure latency, not the disk, and are not used.
READ_PROBE_BYTES = 256 * 2**20
READ_PROBE_SECONDS = 2.0
READ_PROBE_MIN_BYTES = 32 * 2**20
READ_CHUNK = 8 * 2**20
# Names that moved inside transformers: (old module, name) -> where the installed version has it.
MOVED_NAMES = {
    ("transformers.models.gpt2.tokenization_gpt2", "bytes_to_unicode"): "transformers.convert_slow_tokenizer",
}


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str          # "ok" | "refuse" | "warn" | "not checked"
    text: str
    basis: str            # "measured here (<host>) ..." | "assumed (...)" | "not measured" | "nothing to measure"

    def as_dict(self) -> dict:
        return asdict(self)


def preflight_checks(p: Params, plan: dict) -> list:
    """Every check of the profile's full run on this machine, in order (plan: its capacity plan, with the
    cache disk's read rate from cache_read_rate)."""
    checks = [tokenizer_check(p), head_check(p), shm_check(p, plan["hidden_size"]), disk_read_check(p, plan)]
    kind = plan.get("gpu_kind")
    return checks + ([nccl_check()] if kind and pcie_only(kind) else [])


def preflight_table(plan: dict) -> list:
    """(label, text) rows of plan["preflight"] for format_plan."""
    checks = plan.get("preflight") or []
    if not checks:
        return []
    rows = [("preflight", "what would stop the full run on this machine before 01 starts (verdict [basis])")]
    rows += [(f"  {c['name']}", f"{VERDICT_LABELS[c['verdict']]}: {c['text']}  [{c['basis']}]") for c in checks]
    return rows


def here() -> str:
    return f"measured here ({socket.gethostname()})"


def _bytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def checkpoint_folder(p: Params) -> tuple[Optional[Path], str]:
    """(the target's folder, "") when it is on this machine, else (None, why a check cannot run)."""
    if p.target.path.startswith("embedded:"):
        return None, f"{p.target.path} is built by this lab under the installed transformers (checked where it is read)"
    folder = Path(p.target.path)
    return (folder, "") if folder.is_dir() else (None, f"{folder} not found on this machine")


# ---- 1. the tokenizer loads under the installed transformers ------------------------------------------
def tokenizer_check(p: Params) -> Check:
    """The checkpoint's *.py read for imports the installed packages lack (nothing of it executed), then
    the tokenizer loaded as the stages load it (AutoTokenizer, target.trust_remote_code, no hub)."""
    folder, why = checkpoint_folder(p)
    if folder is None:
        return Check("tokenizer", "not checked", why, "not measured")
    static = remote_import_problems(folder)
    failure = tokenizer_load_failure(folder, p.target.trust_remote_code)
    version = _transformers_version()
    found = (f"its code imports what transformers {version} lacks: {'; '.join(static[:4])}"
             + (f" (+{len(static) - 4} more)" if len(static) > 4 else "")) if static else ""
    if failure:
        fix = tokenizer_fix(failure, static, p.target.trust_remote_code)
        text = f"AutoTokenizer fails on {folder}: {failure}" + (f"; {found}" if found else "") + f". Fix: {fix}"
        return Check("tokenizer", "refuse", text, f"{here()}: imports read, tokenizer loaded")
    if static:
        fix = moved_name_fix(" ".join(static)) or "update those files to the model's current revision"
        return Check("tokenizer", "warn", f"loads, but {found} (a stage that loads them fails). Fix: {fix}",
                     f"{here()}: imports read, tokenizer loaded")
    return Check("tokenizer", "ok", f"loads under transformers {version} (remote code: "
                 f"{'allowed' if p.target.trust_remote_code else 'off'}); its code's imports resolve",
                 f"{here()}: imports read, tokenizer loaded")


def tokenizer_fix(failure: str, static: list, trust_remote_code: bool) -> str:
    """The fix for a tokenizer that does not load: allow its code, the exact import fix, or new files."""
    if "custom code" in failure and not trust_remote_code:
        return "set target.trust_remote_code: true (the checkpoint ships its tokenizer as code)"
    return moved_name_fix(failure + " " + " ".join(static)) or (
        "update the checkpoint's tokenizer files (tokenizer_config.json and its *.py) to the model's current "
        "revision, or edit the failing import")


def _transformers_version() -> str:
    try:
        from importlib.metadata import version
        return version("transformers")
    except Exception:
        return "(not installed)"


def moved_name_fix(text: str) -> str:
    """The exact import fix when `text` names a name transformers moved (MOVED_NAMES), else ""."""
    for (old, name), new in MOVED_NAMES.items():
        if name in text and old in text:
            return (f"update the checkpoint's tokenizer files to the current revision, or replace "
                    f"`from {old} import {name}` by `from {new} import {name}`")
    return ""


def _stamp(folder: Path) -> tuple:
    """What the checks' caches key on: the folder's small files (not the weights) and their mtimes."""
    return tuple(sorted((f.name, f.stat().st_mtime_ns) for f in folder.iterdir()
                        if f.is_file() and f.suffix != ".safetensors"))


def remote_import_problems(folder: Path) -> list:
    """One phrase per import of the folder's *.py that would fail here: a transformers module or name
    the installed transformers lacks, a package not installed, a missing sibling file. The checkpoint's
    code is only parsed; the transformers modules it names are imported. Imports under try or an
    availability test are skipped (they are guarded)."""
    return list(_remote_import_problems(str(folder), _stamp(folder)))


@lru_cache(maxsize=16)
def _remote_import_problems(folder: str, stamp: tuple) -> tuple:
    out = []
    for path in sorted(Path(folder).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError as e:
            out.append(f"{path.name} line {e.lineno}: does not parse ({e.msg})")
            continue
        for node in _unguarded_imports(tree):
            problem = _import_problem(Path(folder), node)
            if problem:
                out.append(f"{path.name} line {node.lineno}: `{ast.unparse(node)}`: {problem}")
    return tuple(out)


def _unguarded_imports(tree: ast.AST) -> list:
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Try):
                continue
            if isinstance(child, ast.If) and any(w in ast.unparse(child.test) for w in ("available", "TYPE_CHECKING")):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            visit(child)
    visit(tree)
    return out


def _import_problem(folder: Path, node) -> str:
    if isinstance(node, ast.ImportFrom) and node.level:             # a sibling file of the checkpoint
        base = (node.module or "").split(".")[0]
        if base and not ((folder / f"{base}.py").is_file() or (folder / base).is_dir()):
            return f"no {base}.py beside it"
        return ""
    modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    for module in modules:
        top = module.split(".")[0]
        if top == "transformers":
            problem = _transformers_problem(module, [a.name for a in node.names]
                                            if isinstance(node, ast.ImportFrom) else [])
            if problem:
                return problem
        elif importlib.util.find_spec(top) is None:
            return f"package {top} is not installed"
    return ""


def _transformers_problem(module: str, names: list) -> str:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return f"module {module} is not in transformers {_transformers_version()} ({e})"
    except Exception as e:                                           # a transformers module that fails to import
        return f"importing {module} fails: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    missing = []
    for name in names:
        if name == "*" or hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except Exception:
            missing.append(name)
    return f"{module} has no {', '.join(missing)} in transformers {_transformers_version()}" if missing else ""


def tokenizer_load_failure(folder: Path, trust_remote_code: bool) -> str:
    """"" when AutoTokenizer loads the folder's tokenizer (offline), else why not: the exception, and
    the checkpoint file and line it came from when it came from the checkpoint's own code."""
    return _tokenizer_load_failure(str(folder), trust_remote_code, _stamp(folder))


@lru_cache(maxsize=16)
def _tokenizer_load_failure(folder: str, trust_remote_code: bool, stamp: tuple) -> str:
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except Exception as e:
        return f"transformers does not import: {type(e).__name__}: {e}"
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)
        return ""
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        where = _checkpoint_frame(e, {f.name for f in Path(folder).glob("*.py")})
        return f"{where}{type(e).__name__}: {message[:400]}"
    finally:
        hf_logging.set_verbosity(level)


def _checkpoint_frame(e: BaseException, files: set) -> str:
    """"<file> line N (`code`): " of the deepest traceback frame in one of the checkpoint's own
    files (transformers runs them from its modules cache, under the same name), else ""."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).name in files]
    if not frames:
        return ""
    f = frames[-1]
    return f"{Path(f.filename).name} line {f.lineno} (`{(f.line or '').strip()}`): "


# ---- 2. the lm_head is a plain float tensor, found by name -------------------------------------------
def head_check(p: Params) -> Check:
    """head_key on the target's folder: ok naming the tensor (and "tied" for the embedding), refuse with its error."""
    folder, why = checkpoint_folder(p)
    if folder is None:
        return Check("lm_head", "not checked", why, "not measured")
    basis = f"{here()}: safetensors index and header read"
    try:
        weights = weight_map(folder)
        if not weights:
            return Check("lm_head", "refuse", f"{folder} has no model.safetensors(.index.json): the head is read "
                         "from safetensors only; convert the weights", basis)
        key = head_key(folder, weights, read_config(folder))
    except TargetHeadError as e:
        return Check("lm_head", "refuse", str(e), basis)
    except (OSError, ValueError, KeyError) as e:
        return Check("lm_head", "refuse", f"{folder}: the weight index cannot be read ({type(e).__name__}: {e})", basis)
    tied = "" if key.endswith(HEAD_SUFFIXES) else " (the embedding: config.json ties the head to it)"
    return Check("lm_head", "ok", f"{key}{tied}, a plain float tensor", basis)


# ---- 3. /dev/shm holds 04's collated micro-batches ---------------------------------------------------
def collated_bytes_per_token(p: Params, hidden_size: int) -> int:
    """One token of a collated micro-batch (batches.collate): aux (3 states) and final in the cache
    dtype, an int64 id and a bool mask."""
    elem = 2 if p.extract.dtype in ("bfloat16", "float16") else 4
    return 4 * hidden_size * elem + 8 + 1


def shm_need_bytes(p: Params, hidden_size: int) -> float:
    """Bytes 04's DataLoader workers hold in shared memory at once: ranks x workers x the prefetch
    factor x one micro-batch (train.batch_tokens collated tokens); 0 without workers."""
    from .batches import PREFETCH_FACTOR  # the loader's (torch): planners sit above what they model
    t = p.train
    return float(train_ranks(p) * t.num_workers * PREFETCH_FACTOR * t.batch_tokens
                 * collated_bytes_per_token(p, hidden_size))


def shm_free_bytes(path: str = SHM) -> Optional[float]:
    """Free bytes of the shared-memory file system (None where there is none)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return float(st.f_bavail * st.f_frsize)


def shm_check(p: Params, hidden_size: int, free: Optional[float] = None, path: str = SHM) -> Check:
    """shm_need_bytes against the free size of /dev/shm (measured here unless `free` is given)."""
    t = p.train
    need = shm_need_bytes(p, hidden_size)
    if need == 0:
        return Check(path, "ok", "train.num_workers is 0: micro-batches are collated in the training process, "
                     "nothing goes through shared memory", "nothing to measure")
    free = shm_free_bytes(path) if free is None else free
    from .batches import PREFETCH_FACTOR
    how = (f"04's DataLoader holds ~{_bytes(need)} there ({train_ranks(p)} ranks x {t.num_workers} workers x "
           f"prefetch {PREFETCH_FACTOR} x {_bytes(need / (train_ranks(p) * t.num_workers * PREFETCH_FACTOR))} "
           f"micro-batches: {t.batch_tokens:,} tokens x (3 aux + 1 final) x hidden {hidden_size} in "
           f"{p.extract.dtype}, + ids and masks)")
    basis = f"{here()}: os.statvfs('{path}'); planned elsewhere than the box, this is the planning machine's"
    if free is None:
        return Check(path, "not checked", f"{how}; this machine has no {path}", "not measured")
    if need > free:
        fit = int(free // (need / t.num_workers))
        fewer = f"at most {fit} fit" if fit else "0 collates in the training processes, slower"
        return Check(path, "refuse", f"{how}, {path} has {_bytes(free)} free. Fix: give the container more shared "
                     f"memory (docker run --shm-size={int(need * 1.25 / 1e9) + 1}g) or lower "
                     f"train.num_workers ({t.num_workers} now; {fewer})", basis)
    return Check(path, "ok", f"{how}, {path} has {_bytes(free)} free ({need / free:.0%} of it)", basis)


# ---- 4. the disk reads the cache as fast as 04 trains -------------------------------------------------
def probe_shard(layout: RunLayout) -> Optional[Path]:
    """The largest shard of this run's hidden-state cache (train split, else held-out), or None."""
    for split in ("train", "eval"):
        folder = layout.hidden(split)
        shards = sorted(folder.glob("*.safetensors"), key=lambda f: f.stat().st_size) if folder.is_dir() else []
        if shards:
            return shards[-1]
    return None


def cache_read_rate(layout: RunLayout) -> tuple[float, str]:
    """(bytes/s, basis) of the cache disk: measured by a short timed read of this run's largest shard
    (its pages dropped from the page cache first) when the cache exists here, else
    stage_times.BOX_CACHE_READ_BYTES_PER_S, assumed."""
    shard = probe_shard(layout)
    if shard is not None:
        st = shard.stat()
        measured = _timed_read(str(shard), st.st_size, st.st_mtime_ns)
        if measured is not None:
            rate, n, seconds = measured
            return rate, (f"{here()}: {_bytes(n)} of {shard.name} read in {seconds:.2f} s, page cache dropped, "
                          "one stream; 04's workers read in parallel")
    return BOX_CACHE_READ_BYTES_PER_S, BOX_CACHE_READ_BASIS


@lru_cache(maxsize=8)
def _timed_read(path: str, size: int, mtime_ns: int) -> Optional[tuple]:
    """(bytes/s, bytes, seconds) of one sequential read of at most READ_PROBE_BYTES and READ_PROBE_SECONDS
    (once per file version per process); None when fewer than READ_PROBE_MIN_BYTES could be read."""
    buf = memoryview(bytearray(READ_CHUNK))
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        n, t0 = 0, time.perf_counter()
        while n < READ_PROBE_BYTES and time.perf_counter() - t0 < READ_PROBE_SECONDS:
            got = f.readinto(buf)
            if not got:
                break
            n += got
        seconds = time.perf_counter() - t0
    return (n / seconds, n, seconds) if n >= READ_PROBE_MIN_BYTES and seconds > 0 else None


def disk_read_check(p: Params, plan: dict) -> Check:
    """What 04 reads per second (its planned tokens/s x bytes per cached token) against the cache
    disk's read rate (plan["cache_read_bytes_per_s"], measured or assumed)."""
    rate, basis = plan["cache_read_bytes_per_s"], plan["cache_read_basis"]
    if p.extract.mode == "online":
        return Check("disk read", "ok", "extract.mode online: 04 reads the train split's states from the server, "
                     "not from the cache disk", "nothing to measure")
    tokens_per_s = plan.get("train_tokens_per_s")
    if not tokens_per_s:
        return Check("disk read", "not checked", "the plan has no training rate", "not measured")
    need = tokens_per_s * plan["cache_bytes_per_token"]
    how = (f"04 reads ~{_bytes(need)}/s ({tokens_per_s:,.0f} tok/s x {plan['cache_bytes_per_token']:,} B per cached "
           f"token), the disk gives {_bytes(rate)}/s")
    if need > rate:
        planned = any(q["name"].startswith(CACHE_READ_PART) for q in plan["stages"]["train"]["parts"])
        return Check("disk read", "warn", f"{how}: 04 waits on the disk ({need / rate:.1f}x its rate"
                     + ("; the plan's 04 takes the read time" if planned else "") + "). Fix: the cache on faster "
                     "storage (NVMe RAID 0) or a page cache that holds it", basis)
    return Check("disk read", "ok", f"{how} ({need / rate:.0%} of it)", basis)


# ---- 5. NCCL over PCIe ---------------------------------------------------------------------------------
# Peer-to-peer over PCIe between these GPUs is reported to hang or corrupt collectives with NCCL before
# 2.31.2 (fixed there); the reported workaround is NCCL_P2P_DISABLE=1 (through host memory, slower).
NCCL_P2P_FIXED = (2, 31, 2)
NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")     # the NCCL that torch's and vLLM's CUDA wheels load


def nccl_version() -> Optional[tuple]:
    """The installed NCCL wheel's version as a tuple of ints, None where none is installed."""
    for name in NCCL_PACKAGES:
        try:
            return tuple(int(x) for x in importlib.metadata.version(name).split(".")[:3] if x.isdigit())
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def nccl_check(version: Optional[tuple] = None, env: Optional[dict] = None) -> Check:
    """PCIe-only GPUs: warn unless the installed NCCL is >= NCCL_P2P_FIXED or NCCL_P2P_DISABLE=1 is set here
    (every stage's processes inherit the environment of `eagle3 run`)."""
    env = os.environ if env is None else env
    version = nccl_version() if version is None else version
    fixed = ".".join(map(str, NCCL_P2P_FIXED))
    disabled = env.get("NCCL_P2P_DISABLE") == "1"
    basis = f"{here()}: {' / '.join(NCCL_PACKAGES)} and NCCL_P2P_DISABLE read"
    if disabled:
        return Check("nccl p2p", "ok", "NCCL_P2P_DISABLE=1: collectives go through host memory", basis)
    if version is None:
        return Check("nccl p2p", "not checked", f"no NCCL installed on this machine; on the box NCCL >= {fixed} "
                     "or `export NCCL_P2P_DISABLE=1` before `eagle3 run`", basis)
    found = ".".join(map(str, version))
    if version >= NCCL_P2P_FIXED:
        return Check("nccl p2p", "ok", f"NCCL {found} has the PCIe peer-to-peer fix ({fixed})", basis)
    return Check("nccl p2p", "warn", f"NCCL {found} predates the PCIe peer-to-peer fix ({fixed}): collectives "
                 f"between these GPUs may hang or corrupt. Fix: `export NCCL_P2P_DISABLE=1` before `eagle3 run`, or "
                 f"an NCCL >= {fixed}", basis)
