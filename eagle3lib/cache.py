"""The hidden-state cache on disk: its format, its writer and its reader, whatever produced the states
(extract.py's HF backend today; any backend that hands over aux [n, 3, H] and final [n, H] rows
writes the same bytes through this module).

One split lives in `<run>/hidden/<split>/` (`RunLayout.hidden(split)`):

    manifest.json              header (identity: params hash, dataset fingerprint, target dtype;
                               shape: dtype, aux layers, H) and the finished shards
                               (index, file, seq_index, num_tokens, bytes, sha256)
    shard-00000.safetensors    whole sequences; N tokens, nseq sequences:
        offsets    int64 [nseq + 1]  token offsets of the sequences inside the shard
        seq_index  int64 [nseq]      row of each sequence in the processed dataset
        aux        dtype [N, 3, H]   inputs of decoder layers aux_layers (low, mid, high)
        final      dtype [N, H]      output of the final norm = the lm_head input
        input_ids  int32 [N]
        loss_mask  uint8 [N]

The shard plan (which sequences go to which shard, longest first) is a pure function of the
sequence lengths and two token budgets, fixed before any work. A shard is written to
`.shard-XXXXX.safetensors.tmp`, fsynced, hashed and renamed; only then is it recorded in the
manifest (atomic rewrite), so a folder never holds a half shard under a real name. Several writers
(torchrun ranks) each record into their own `manifest.part-XXXXX.json`; `merge_manifests` joins them.

Verification (`verify_cache`, through `check_cache`): sizes, manifest and tensor shapes of every
shard always; sha256 of every shard (full), of a seeded fraction (sampled) or of none (sizes),
split across torchrun ranks. `verified.json` beside the manifest records each shard hashed (its
manifest sha256 and file size, mtime, ctime, inode), so a shard is hashed once while it stays as
it was, and the bad shards a verification found, which the extract stage then redoes.

    cache = check_cache(params, layout, "train")  # open, made from these params, verified (train.verify_cache)
    item = cache.get(0)                        # input_ids [T], loss_mask [T], aux [T, 3, H], final [T, H]
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import queue
import random
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from .files import atomic_write_json, read_json
from .layout import RunLayout
from .params import Params

if TYPE_CHECKING:
    from .dist import Dist

FORMAT = "eagle3lab-hidden-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VERIFIED = "verified.json"          # verify_cache's record, beside the manifest
VERIFY_MODES = ("full", "sampled", "sizes")
# safetensors dtype codes and element sizes of what a shard holds.
ST_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
RERUN = "rerun 03_extract: eagle3 run --params <profile> --only extract"   # the fix named in errors
_HASH_CHUNK = 1 << 24


class CacheError(RuntimeError):
    """The hidden-state cache cannot be written or read as asked; the message says what to do."""


# extract fields that say how states reach the trainer, not which states: both modes read the same ones
HOW_STATES_TRAVEL = ("extract.mode", "extract.online_restarts", "extract.online_gpus")


def cache_params_hash(params: Params) -> str:
    """The params a cache depends on: the data and extract sections (less HOW_STATES_TRAVEL), the seed
    and the target path."""
    return params.section_hash("data", "extract", leave_out=HOW_STATES_TRAVEL)


# ---- the plan: which sequences go to which shard and which forward batch ------------------------
@dataclass
class ShardPlan:
    index: int
    seq_index: list            # dataset rows in storage order (longest first)
    lengths: list              # tokens of each of those rows
    batches: list              # [(start, end)] into seq_index: one forward pass each

    @property
    def file(self) -> str:
        return f"shard-{self.index:05d}.safetensors"

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def padded_tokens(self) -> int:
        return sum((e - s) * self.lengths[s] for s, e in self.batches)


def plan_shards(lengths: list, shard_tokens: int, batch_tokens: int) -> list:
    """Sort the non-empty rows longest first (ties by row), cut into shards of about
    `shard_tokens` tokens (whole sequences, at least one each), then cut each shard into forward
    batches whose padded size (rows x longest row) stays within `batch_tokens` (a longer row
    runs alone). Deterministic: it depends only on the lengths and the two budgets."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    shards, current, tokens = [], [], 0
    for i in order:
        if current and tokens + lengths[i] > shard_tokens:
            shards.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        shards.append(current)

    plans = []
    for index, rows in enumerate(shards):
        lens = [lengths[i] for i in rows]
        batches, start = [], 0
        for j in range(1, len(rows) + 1):
            # rows are sorted longest first, so lens[start] is the padded length of the batch
            if j == len(rows) or (j - start + 1) * lens[start] > batch_tokens:
                batches.append((start, j))
                start = j
        plans.append(ShardPlan(index, rows, lens, batches))
    return plans


# ---- one shard file: safetensors layout, filled in place --------------------------------------
def shard_layout(nseq: int, ntok: int, hidden: int, dtype: str, num_aux: int = 3):
    """(header bytes, {name: (absolute byte offset, byte size)}, file size) of a shard. The tensors
    lie in the order below, so every one is aligned to its element size (the header is padded to 8
    bytes)."""
    code, esize = ST_DTYPES[dtype]
    tensors = [("offsets", "I64", [nseq + 1], 8), ("seq_index", "I64", [nseq], 8),
               ("aux", code, [ntok, num_aux, hidden], esize), ("final", code, [ntok, hidden], esize),
               ("input_ids", "I32", [ntok], 4), ("loss_mask", "U8", [ntok], 1)]
    header, spans, pos = {}, {}, 0
    for name, st_dtype, shape, size in tensors:
        nbytes = size
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        spans[name] = (pos, nbytes)
        pos += nbytes
    header["__metadata__"] = {"format": "pt", "eagle3lab": f"{FORMAT}/{FORMAT_VERSION}"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {k: (len(prefix) + p, n) for k, (p, n) in spans.items()}, len(prefix) + pos


def shard_file_bytes(plan: ShardPlan, hidden: int, dtype: str) -> int:
    return shard_layout(len(plan.seq_index), plan.num_tokens, hidden, dtype)[2]


def _pwrite_all(fd: int, data, offset: int):
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _as_bytes(t: torch.Tensor):
    """A CPU tensor's raw little-endian bytes as a numpy view (bf16 has no numpy dtype)."""
    t = t.contiguous()
    return t.view(torch.uint8).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path):
    with contextlib.suppress(OSError):          # best effort: not every filesystem syncs folders
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _preallocate(fd: int, size: int):
    try:
        os.posix_fallocate(fd, 0, size)
    except (AttributeError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def shard_temp(out_dir: Path, plan: ShardPlan) -> Path:
    return out_dir / f".{plan.file}.tmp"


class ShardFile:
    """A shard being written to its temp name; `finish()` fsyncs, hashes and renames it."""

    def __init__(self, out_dir: Path, plan: ShardPlan, token_rows: list, mask_rows: list,
                 hidden: int, dtype: str):
        self.path = out_dir / plan.file
        self.tmp = shard_temp(out_dir, plan)
        prefix, self.spans, self.size = shard_layout(len(plan.seq_index), plan.num_tokens, hidden, dtype)
        self.row_bytes = {"aux": self.spans["aux"][1] // max(plan.num_tokens, 1),
                          "final": self.spans["final"][1] // max(plan.num_tokens, 1)}
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _preallocate(self.fd, self.size)   # a full disk fails here, before any compute
            _pwrite_all(self.fd, prefix, 0)
            offsets = np.zeros(len(plan.lengths) + 1, dtype="<i8")
            offsets[1:] = np.cumsum(plan.lengths)
            self._write("offsets", offsets)
            self._write("seq_index", np.asarray(plan.seq_index, dtype="<i8"))
            self._write("input_ids", np.concatenate([np.asarray(r, dtype="<i4") for r in token_rows]))
            self._write("loss_mask", np.concatenate([np.asarray(r, dtype="u1") for r in mask_rows]))
        except BaseException:
            self.abort()
            raise

    def _write(self, name: str, array):
        assert array.nbytes == self.spans[name][1], (name, array.nbytes, self.spans[name])
        _pwrite_all(self.fd, array, self.spans[name][0])

    def write_rows(self, row_start: int, aux: torch.Tensor, final: torch.Tensor):
        """aux [n, 3, H] and final [n, H] (CPU tensors) for tokens row_start .. row_start + n."""
        for name, t in (("aux", aux), ("final", final)):
            _pwrite_all(self.fd, _as_bytes(t), self.spans[name][0] + row_start * self.row_bytes[name])

    def finish(self) -> dict:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        digest = file_sha256(self.tmp)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        return {"bytes": self.size, "sha256": digest}

    def abort(self):
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class BackgroundWriter:
    """Runs file work (writes, hashing, manifest updates) in order on one thread so the next
    forward overlaps it. `depth` bounds the batches held in memory. The first error stops the
    queue and is raised in the caller on its next call."""

    def __init__(self, depth: int = 2):
        self.jobs = queue.Queue(maxsize=depth)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="hidden-cache-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    job()
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                self.error = e
            finally:
                self.jobs.task_done()

    def submit(self, job: Callable):
        self.check()
        self.jobs.put(job)

    def drain(self):
        self.jobs.join()
        self.check()

    def check(self):
        if self.error is not None:
            raise self.error

    def close(self):
        self.jobs.put(None)
        self.thread.join()


# ---- manifest: one typed reader, one writer ----------------------------------------------------
@dataclass(frozen=True)
class ShardRecord:
    """One finished shard as the manifest lists it."""
    index: int
    file: str
    seq_index: list            # dataset rows of its sequences, in storage order
    num_tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class CacheHeader:
    """What every shard of one cache shares. The identity fields (see `identity`) decide whether a
    folder may be resumed; they are None only in manifests written by hand (tests)."""
    format: str
    format_version: int
    dtype: str                 # storage dtype of aux and final
    aux_layers: list           # the 3 decoder-layer ids whose inputs are stored
    hidden_size: int
    split: Optional[str] = None
    params_hash: Optional[str] = None           # cache_params_hash(params)
    target_dtype: Optional[str] = None          # the dtype the target ran in
    dataset_fingerprint: Optional[str] = None   # content of the processed split
    num_layers: Optional[int] = None
    target_path: Optional[str] = None
    num_sequences: Optional[int] = None
    num_tokens: Optional[int] = None
    dataset_rows: Optional[int] = None


# Stored in manifest.json beside the header; derived from the records, not read back.
_DERIVED = ("complete", "num_tokens_done")


@dataclass(frozen=True)
class Manifest:
    header: CacheHeader
    num_shards: int            # planned
    shards: list               # [ShardRecord], by index: the finished ones

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.num_shards

    @property
    def num_tokens_done(self) -> int:
        return sum(r.num_tokens for r in self.shards)

    def to_json(self) -> dict:
        header = {k: v for k, v in asdict(self.header).items() if v is not None}
        return {**header, "num_shards": self.num_shards, "complete": self.complete,
                "num_tokens_done": self.num_tokens_done, "shards": [asdict(r) for r in self.shards]}


def make_manifest(header: CacheHeader, records: dict, num_shards: int) -> Manifest:
    """records: {shard index: ShardRecord}."""
    return Manifest(header, num_shards, [records[i] for i in sorted(records)])


def write_manifest(path: Path, manifest: Manifest) -> None:
    atomic_write_json(path, manifest.to_json())


def read_manifest(path) -> Manifest:
    """manifest.json (or a rank's manifest.part-*.json) as a Manifest; a CacheError that names the
    file and the fix for a missing, unreadable or foreign one."""
    path = Path(path)
    if not path.is_file():
        raise CacheError(f"{path.parent}: no {path.name}, the extract stage has not finished there; {RERUN}")
    try:
        m = read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"{path}: unreadable manifest ({e}); delete {path.parent} and {RERUN}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"{path} is not a {FORMAT} version {FORMAT_VERSION} manifest; delete {path.parent} "
                         f"and {RERUN}")
    known = {f.name for f in fields(CacheHeader)} | {"num_shards", "shards", *_DERIVED}
    try:
        unknown = set(m) - known
        if unknown:
            raise TypeError(f"unknown field(s) {sorted(unknown)}")
        header = CacheHeader(**{k: v for k, v in m.items() if k not in ("num_shards", "shards", *_DERIVED)})
        shards = sorted((ShardRecord(**rec) for rec in m["shards"]), key=lambda r: r.index)
        return Manifest(header, int(m["num_shards"]), shards)
    except (TypeError, KeyError) as e:
        raise CacheError(f"{path}: malformed {FORMAT} manifest ({e}); delete {path.parent} and {RERUN}") from e


def identity(params: Params, split: str, dataset_fingerprint: str, target_dtype: str) -> dict:
    """What a cache must match to be reused: format, params hash (data + extract sections, seed,
    target path), dataset content, target dtype."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "split": split,
            "params_hash": cache_params_hash(params), "target_dtype": target_dtype,
            "dataset_fingerprint": dataset_fingerprint}


def record_path(out_dir: Path, rank: int, world: int) -> Path:
    """Where writer `rank` of `world` records its finished shards."""
    return out_dir / (MANIFEST if world == 1 else f"manifest.part-{rank:05d}.json")


def read_records(out_dir: Path, ident: dict) -> dict:
    """Shard records found in manifest.json and manifest.part-*.json, {shard index: ShardRecord}.
    Refuses a folder written under another identity."""
    records = {}
    paths = ([out_dir / MANIFEST] if (out_dir / MANIFEST).is_file() else []) + \
        sorted(out_dir.glob("manifest.part-*.json"))
    for path in paths:
        m = read_manifest(path)
        diff = {k: (getattr(m.header, k), v) for k, v in ident.items() if getattr(m.header, k) != v}
        if diff:
            lines = "; ".join(f"{k}: cache has {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise CacheError(
                f"{out_dir} holds a hidden-state cache made with other params or data ({lines}). "
                f"Refusing to mix caches: delete {out_dir} or use another run name (run_name=...).")
        for rec in m.shards:
            records[rec.index] = rec
    return records


def record_is_valid(out_dir: Path, rec: Optional[ShardRecord], plan: ShardPlan) -> bool:
    """A recorded shard counts as done if it holds the planned rows, its file still has the recorded
    size and sha256, and no verification found it bad. The sha256 is read again only for files no
    verification has hashed as they are now (verified.json): a shard recorded by a run killed
    mid-stage is checked, while 04's call on a verified 6 TB cache reads no bytes."""
    if rec is None or rec.seq_index != plan.seq_index or rec.file != plan.file:
        return False
    path = out_dir / plan.file
    if not path.is_file() or path.stat().st_size != rec.bytes or plan.file in found_bad(out_dir):
        return False
    verified = read_verified(out_dir)["hashed"].get(plan.file)
    return _still_holds(verified, rec, _stat(path)) or file_sha256(path) == rec.sha256


def merge_manifests(out_dir: Path, header: Optional[CacheHeader], own: dict, plans: list) -> Manifest:
    """Writer 0, after every writer finished: merge its own records with every writer's part and
    the previous manifest.json (first found wins: own, parts, old manifest), write manifest.json,
    drop the parts. Shard bytes are deterministic, so two records of one planned shard agree."""
    records = dict(own)
    headers = [header] if header else []
    sources = sorted(out_dir.glob("manifest.part-*.json")) + \
        ([out_dir / MANIFEST] if (out_dir / MANIFEST).is_file() else [])
    for path in sources:
        m = read_manifest(path)
        headers.append(m.header)
        for rec in m.shards:
            if rec.index < len(plans) and rec.seq_index == plans[rec.index].seq_index:
                records.setdefault(rec.index, rec)
    if not headers:
        raise CacheError(f"{out_dir}: nothing was extracted and no manifest exists")
    manifest = make_manifest(headers[0], records, len(plans))
    write_manifest(out_dir / MANIFEST, manifest)
    for part in sources:
        if part.name != MANIFEST:
            part.unlink()
    return manifest


class CacheWriter:
    """Writes planned shards into one cache folder, file work on a background thread, and records
    each finished shard in this writer's manifest (`record_path`).

        with CacheWriter(out_dir, header, done_records, num_shards, record_path(out_dir, r, W)) as w:
            for plan in todo:
                w.start_shard(plan, token_rows, mask_rows)
                for s, e in plan.batches:
                    w.write_rows(aux, final)          # [n, 3, H], [n, H] of rows s..e, in order
                w.finish_shard()

    A write error raises CacheError; on any exit, shards not finished are removed (never recorded).
    """

    def __init__(self, out_dir: Path, header: CacheHeader, records: dict, num_shards: int,
                 record_file: Path, depth: int = 2):
        self.out_dir, self.header, self.num_shards, self.record_file = out_dir, header, num_shards, record_file
        self.records = dict(records)
        self.writer = BackgroundWriter(depth)
        self.open_files: list = []
        self.plan: Optional[ShardPlan] = None
        self.shard: Optional[ShardFile] = None
        self.row = 0                # next token row of the current shard

    def start_shard(self, plan: ShardPlan, token_rows: list, mask_rows: list):
        self.plan, self.row = plan, 0
        self.shard = ShardFile(self.out_dir, plan, token_rows, mask_rows, self.header.hidden_size, self.header.dtype)
        self.open_files.append(self.shard)

    def write_rows(self, aux: torch.Tensor, final: torch.Tensor):
        """The next n token rows of the current shard: aux [n, 3, H], final [n, H], CPU, cache dtype."""
        shard, row, h = self.shard, self.row, self.header
        n = aux.shape[0]
        want_aux, want_final = (n, len(h.aux_layers), h.hidden_size), (n, h.hidden_size)
        if tuple(aux.shape) != want_aux or tuple(final.shape) != want_final or row + n > self.plan.num_tokens \
                or {str(aux.dtype), str(final.dtype)} != {f"torch.{h.dtype}"}:
            raise CacheError(f"{self.plan.file}: states for rows {row}..{row + n} of {self.plan.num_tokens} came as "
                             f"aux {tuple(aux.shape)} {aux.dtype}, final {tuple(final.shape)} {final.dtype}; "
                             f"expected {want_aux}, {want_final} in {h.dtype} (the extraction backend is wrong)")
        self.writer.submit(lambda: shard.write_rows(row, aux, final))
        self.row += n

    def finish_shard(self):
        plan, shard = self.plan, self.shard
        if self.row != plan.num_tokens:
            raise CacheError(f"{plan.file}: {self.row} token rows written, {plan.num_tokens} planned")

        def finish():
            info = shard.finish()
            self.records[plan.index] = ShardRecord(plan.index, plan.file, plan.seq_index, plan.num_tokens, **info)
            write_manifest(self.record_file, make_manifest(self.header, self.records, self.num_shards))
        self.writer.submit(finish)

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.writer.drain()
        except OSError as e:
            exc = e
        finally:
            try:
                self.writer.jobs.join()
            finally:
                self.writer.close()
                for shard in self.open_files:
                    if shard.fd is not None or shard.tmp.exists():
                        shard.abort()
        if isinstance(exc, OSError):
            raise CacheError(f"writing the hidden-state cache in {self.out_dir} failed: {exc}. Unfinished shards "
                             "were removed and are not recorded; fix the cause and rerun (finished shards are "
                             "kept).") from exc
        return False


# ---- reader ---------------------------------------------------------------------------------
class HiddenCache:
    """Read access to `<run>/hidden/<split>/`, one item per sequence, ordered by dataset row.

        cache = HiddenCache(layout.hidden("train"))
        item = cache.get(0)   # input_ids long [T], loss_mask bool [T], aux [T, 3, H], final [T, H]

    Shards are opened lazily with `safetensors.safe_open` (memory mapped) and kept open; `get`
    reads only that sequence's rows. Safe to hand to DataLoader workers (handles reopen per process).
    """

    def __init__(self, path, allow_partial: bool = False):
        self.path = Path(path)
        self.manifest = read_manifest(self.path / MANIFEST)
        if not self.manifest.complete and not allow_partial:
            raise CacheError(f"{self.path}: extraction is unfinished ({len(self.manifest.shards)}/"
                             f"{self.manifest.num_shards} shards); {RERUN} to finish it")
        header = self.manifest.header
        self.hidden_size = int(header.hidden_size)
        self.aux_layers = list(header.aux_layers)
        self.dtype = header.dtype
        # Per sequence: shard number, token start/end inside the shard, dataset row.
        shard_of, starts, ends, rows = [], [], [], []
        for s, rec in enumerate(self.manifest.shards):
            lengths = _read_offsets(self.path / rec.file)
            shard_of += [s] * (len(lengths) - 1)
            starts += lengths[:-1]
            ends += lengths[1:]
            rows += rec.seq_index
        order = np.argsort(np.asarray(rows, dtype=np.int64), kind="stable")
        self._shard = [shard_of[i] for i in order]
        self._start = [starts[i] for i in order]
        self._end = [ends[i] for i in order]
        self.seq_index = [rows[i] for i in order]       # dataset row of item i
        self.lengths = [self._end[i] - self._start[i] for i in range(len(order))]
        self._handles: dict = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def fingerprint(self) -> str:
        """A content id of the cache, from the manifest alone (no shard is read): sha256 over the
        header and every shard's file name, size and sha256. Two caches with the same bytes have the
        same fingerprint; any other params, data or repaired-to-different bytes give another."""
        m = self.manifest
        blob = {"header": {k: v for k, v in asdict(m.header).items() if v is not None},
                "num_shards": m.num_shards, "shards": [[r.file, r.bytes, r.sha256] for r in m.shards]}
        return hashlib.sha256(json.dumps(blob, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def _open(self, s: int):
        if self._pid != os.getpid():      # forked worker: the parent's handles are not ours
            self._handles, self._pid = {}, os.getpid()
        if s not in self._handles:
            self._handles[s] = safe_open(str(self.path / self.manifest.shards[s].file), framework="pt")
        return self._handles[s]

    def get(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} out of range (cache holds {len(self)} sequences)")
        f = self._open(self._shard[i])
        a, b = self._start[i], self._end[i]
        return {"input_ids": f.get_slice("input_ids")[a:b].long(),        # [T]
                "loss_mask": f.get_slice("loss_mask")[a:b].bool(),        # [T]
                "aux": f.get_slice("aux")[a:b],                           # [T, 3, H]
                "final": f.get_slice("final")[a:b]}                       # [T, H]

    __getitem__ = get

    def tokens(self, i: int) -> dict:
        """Item i's input_ids [T] and loss_mask [T] only (no states read)."""
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} out of range (cache holds {len(self)} sequences)")
        f = self._open(self._shard[i])
        a, b = self._start[i], self._end[i]
        return {"input_ids": f.get_slice("input_ids")[a:b].long(), "loss_mask": f.get_slice("loss_mask")[a:b].bool()}

    def verify(self, workers: Optional[int] = None) -> bool:
        """Every recorded shard has its recorded size and sha256 and the expected tensor shapes;
        raises CacheError naming the bad shards and the fix, returns True otherwise. Reads every
        byte (no record kept: see verify_cache); hashes on `workers` threads (see hash_problems)."""
        problems = {rec.file: self.shard_problem(rec) for rec in self.manifest.shards}
        problems.update(self.hash_problems([r for r in self.manifest.shards if not problems[r.file]], workers))
        self._raise_if_bad(problems)
        return True

    def shard_problem(self, rec: ShardRecord) -> Optional[str]:
        """What is wrong with one shard file short of its bytes (missing, size, tensor shapes: its
        header only), or None."""
        path = self.path / rec.file
        if not path.is_file():
            return "missing"
        size = path.stat().st_size
        if size != rec.bytes:
            return f"size {size} bytes, the manifest says {rec.bytes}"
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        except SafetensorError as e:
            return f"unreadable shard ({e})"
        n, H = rec.num_tokens, self.hidden_size
        want = {"aux": [n, len(self.aux_layers), H], "final": [n, H], "input_ids": [n], "loss_mask": [n],
                "offsets": [len(rec.seq_index) + 1], "seq_index": [len(rec.seq_index)]}
        return f"tensor shapes {shapes} != {want}" if shapes != want else None

    def hash_problems(self, records: list, workers: Optional[int] = None) -> dict:
        """{file: None or what is wrong} for the sha256 of `records` (ShardRecord list), hashed on
        `workers` threads (default: up to 8; hashlib releases the GIL)."""
        def problem(rec: ShardRecord) -> Optional[str]:
            if file_sha256(self.path / rec.file) != rec.sha256:
                return "sha256 differs from the manifest (the file was changed or corrupted)"
            return None
        workers = workers or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return dict(zip((r.file for r in records), pool.map(problem, records)))

    def _raise_if_bad(self, problems: dict) -> None:
        bad = [f"{rec.file}: {problems[rec.file]}" for rec in self.manifest.shards if problems.get(rec.file)]
        if bad:
            raise CacheError(f"{self.path}: {len(bad)} bad shard(s): " + "; ".join(bad) +
                             f". The extract stage redoes them: {RERUN}.")

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def _read_offsets(path: Path) -> list:
    if not path.is_file():
        raise CacheError(f"{path}: shard listed in the manifest is missing; {RERUN}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor("offsets").tolist()
    except SafetensorError as e:
        raise CacheError(f"{path}: unreadable shard ({e}); {RERUN}") from e


# ---- verification once per cache: verified.json ------------------------------------------------
def sample_shards(num_shards: int, fraction: float, seed: int) -> list:
    """The shard positions a sampled verification hashes: ceil(fraction x num_shards) of them (at
    least one), a seeded choice, sorted."""
    if num_shards == 0:
        return []
    k = min(num_shards, max(1, math.ceil(fraction * num_shards)))
    return sorted(random.Random(seed).sample(range(num_shards), k))


def _stat(path: Path) -> Optional[list]:
    """[size, mtime_ns, ctime_ns, inode] of a file (any write, copy or replacement changes it; ctime
    cannot be set back by hand), None when it is missing."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def read_verified(folder) -> dict:
    """verify_cache's record of `folder`: {"hashed": {file: entry}, "bad": {file: entry}, ...}, an
    entry being {"sha256" (the manifest's), "stat": _stat(file)}; empty when there is none or
    it is unreadable (then everything is verified again)."""
    path = Path(folder) / VERIFIED
    try:
        record = read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"hashed": {}, "bad": {}}
    if not isinstance(record, dict) or not isinstance(record.get("hashed"), dict) \
            or not isinstance(record.get("bad"), dict):
        return {"hashed": {}, "bad": {}}
    return record


def _still_holds(entry: Optional[dict], rec: ShardRecord, stat: Optional[list]) -> bool:
    """An entry of verified.json describes the file as it is now, recorded with this sha256."""
    return isinstance(entry, dict) and entry.get("sha256") == rec.sha256 and stat is not None \
        and entry.get("stat") == stat


def found_bad(folder) -> set:
    """Shard files the last verification found bad and that are still as they were then, missing
    ones included (the extract stage redoes these; verify_cache counts them bad without hashing)."""
    folder = Path(folder)
    return {file for file, entry in read_verified(folder)["bad"].items()
            if isinstance(entry, dict) and entry.get("stat") == _stat(folder / file)}


def verify_cache(cache: HiddenCache, mode: str = "full", sample: float = 0.05, seed: int = 0,
                 dist: Optional["Dist"] = None, workers: Optional[int] = None) -> dict:
    """Verify `cache` once: sizes, manifest and tensor shapes of every shard always (headers only);
    then sha256 of every shard (mode "full"), of sample_shards(n, sample, seed) ("sampled") or of
    none ("sizes"), skipping the shards verified.json lists as hashed while they keep their manifest
    sha256 and file stat (_stat). Under torchrun (dist) every rank calls this and hashes every
    world-th of the shards left, the results are gathered, rank 0 updates verified.json
    (atomically); every rank raises the same CacheError naming the bad shards.
    -> a summary dict: shards hashed, bytes hashed, seconds."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verification mode {mode!r}: use one of {', '.join(VERIFY_MODES)}")
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    start = time.perf_counter()
    shards = cache.manifest.shards
    stats = {rec.file: _stat(cache.path / rec.file) for rec in shards}          # before any hashing
    problems = {rec.file: p for rec in shards if (p := cache.shard_problem(rec))}
    record = read_verified(cache.path)
    for file in (found_bad(cache.path) & set(stats)) - set(problems):    # unchanged since found bad
        problems[file] = f"{record['bad'][file].get('problem')} (found by an earlier verification)"
    chosen = {"full": range(len(shards)), "sampled": sample_shards(len(shards), sample, seed),
              "sizes": []}[mode]
    todo = [shards[i] for i in chosen if shards[i].file not in problems
            and not _still_holds(record["hashed"].get(shards[i].file), shards[i], stats[shards[i].file])]
    found = cache.hash_problems(todo[rank::world], workers)
    if world > 1:
        found = {k: v for part in dist.all_gather_object(found) for k, v in part.items()}
    problems.update({file: p for file, p in found.items() if p})
    summary = {"mode": mode, "shards": len(shards), "shards_hashed": len(todo),
               "bytes_hashed": sum(r.bytes for r in todo), "bytes_total": sum(r.bytes for r in shards),
               "shards_already_verified": len(chosen) - len(todo), "bad": len(problems), "world": world,
               "seconds": time.perf_counter() - start}
    if rank == 0:
        _record_verification(cache, record, todo, problems, stats, summary)
    cache._raise_if_bad(problems)
    return summary


def _record_verification(cache: HiddenCache, record: dict, hashed: list, problems: dict, stats: dict,
                         summary: dict) -> None:
    """verified.json after a verification: entries of shards no longer in the manifest dropped, the
    shards just hashed added as good or bad, and this verification's summary ("last")."""
    shas = {rec.file: rec.sha256 for rec in cache.manifest.shards}
    good = {f: e for f, e in record["hashed"].items() if f in shas and f not in problems}
    for rec in hashed:
        if rec.file not in problems:
            good[rec.file] = {"sha256": rec.sha256, "stat": stats[rec.file]}
    bad = {f: {"sha256": shas[f], "stat": stats[f], "problem": p} for f, p in problems.items()}
    atomic_write_json(cache.path / VERIFIED, {"fingerprint": cache.fingerprint, "last": summary,
                                              "hashed": good, "bad": bad})


def check_cache(params: Params, layout: RunLayout, split: str, dist: Optional["Dist"] = None,
                mode: Optional[str] = None) -> HiddenCache:
    """The cache of `split` for training with profile `params`: complete, made from these params (the
    manifest's params_hash is cache_params_hash(params): same data and extract sections, seed and
    target), and verified by verify_cache in `mode` (default train.verify_cache, with
    train.verify_sample and the seed). Otherwise a CacheError naming the folder and the stage to
    rerun. Under torchrun every rank calls it with its `dist` (the ranks share the hashing)."""
    folder = layout.hidden(split)
    cache = HiddenCache(folder)
    have, want = cache.manifest.header.params_hash, cache_params_hash(params)
    if have != want:
        raise CacheError(
            f"{folder} was extracted with other params (params_hash {have!r}; these params give {want!r}: "
            "the data or extract section, the seed or the target changed since). Training on it would use "
            f"stale data. Delete {folder} and rerun 02_data and 03_extract for these params: "
            "eagle3 run --params <profile> --only data,extract.")
    if cache.manifest.header.split != split:
        raise CacheError(f"{folder} holds the {cache.manifest.header.split!r} split, not {split!r}; "
                         f"delete {folder} and {RERUN}")
    verify_cache(cache, mode or params.train.verify_cache, params.train.verify_sample, params.seed, dist)
    return cache
