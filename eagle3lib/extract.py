"""Hidden-state cache: run the target once over the processed chats and keep, per token, what the
drafter trains on -- the three auxiliary hidden states and the final (post-norm) state.

One split lives in `<run>/hidden/<split>/`:

    manifest.json              identity (params hash, dataset fingerprint, dtype, aux layers, H)
                               and the finished shards (file, seq_index, tokens, bytes, sha256)
    shard-00000.safetensors    whole sequences; N tokens, nseq sequences:
        offsets    int64 [nseq + 1]  token offsets of the sequences inside the shard
        seq_index  int64 [nseq]      row of each sequence in the processed dataset
        aux        dtype [N, 3, H]   inputs of decoder layers aux_layers (low, mid, high)
        final      dtype [N, H]      output of the final norm = the lm_head input
        input_ids  int32 [N]
        loss_mask  uint8 [N]

Layer id k is the hidden state entering decoder layer k (`output_hidden_states[k]`, 0 = the
embedding output), captured with forward pre-hooks on the decoder layers; the final state is the
decoder's `last_hidden_state`. The lm_head never runs, so no [T, V] logits are built.

Resumable and atomic: the shard plan (which sequences go to which shard, and in which forward
batches) is a pure function of (params, dataset), fixed before any work. A shard is written to
`.shard-XXXXX.safetensors.tmp`, fsynced, hashed and renamed; only then is it recorded in the
manifest (atomic rewrite). A rerun skips recorded shards whose size and sha256 still match, so a
run killed at any moment and restarted gives the same bytes as an uninterrupted one.
Under torchrun, rank r writes shards r, r+W, r+2W, ... and records them in its own
`manifest.part-XXXXX.json`; rank 0 merges the parts after a barrier.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .files import atomic_write_json, read_json
from .params import Params, ParamsError

FORMAT = "eagle3lab-hidden-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# safetensors dtype codes and element sizes of what a shard holds.
ST_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
_HASH_CHUNK = 1 << 24


class CacheError(RuntimeError):
    """The hidden-state cache cannot be written or read as asked; the message says what to do."""


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


# ---- the processed dataset --------------------------------------------------------------------
@dataclass
class DatasetScan:
    num_rows: int
    lengths: list              # tokens per row (0 for an empty row)
    fingerprint: str           # sha256 over every row's input_ids and loss_mask
    max_token_id: int


def scan_dataset(ds) -> DatasetScan:
    """One pass over a `datasets.Dataset` with input_ids/loss_mask list columns: lengths, a
    content fingerprint, the largest token id; a row whose two lists differ in length is an error."""
    import numpy as np
    import pyarrow.compute as pc

    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ValueError(f"processed dataset lacks column(s) {sorted(missing)} (has {ds.column_names})")
    h = hashlib.sha256(f"rows={len(ds)}".encode())
    lengths, max_id, row = [], -1, 0
    for table in ds.with_format("arrow").iter(batch_size=4096):
        ids, mask = table.column("input_ids"), table.column("loss_mask")
        if ids.null_count or mask.null_count:
            raise ValueError(f"processed dataset: a null input_ids/loss_mask among rows {row}..{row + len(table) - 1}")
        n_ids = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
        n_mask = pc.list_value_length(mask).to_numpy(zero_copy_only=False).astype(np.int64)
        bad = np.nonzero(n_ids != n_mask)[0]
        if len(bad):
            r = row + int(bad[0])
            raise ValueError(f"processed dataset row {r}: {n_ids[bad[0]]} input_ids but {n_mask[bad[0]]} loss_mask values")
        flat_ids = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64)
        flat_mask = pc.list_flatten(mask).to_numpy(zero_copy_only=False).astype(np.int64)
        if flat_ids.size:
            max_id = max(max_id, int(flat_ids.max()))
            if int(flat_ids.min()) < 0:
                raise ValueError(f"processed dataset: negative token id among rows {row}..{row + len(table) - 1}")
        for arr in (n_ids, flat_ids, flat_mask):
            h.update(arr.tobytes())
        lengths.extend(n_ids.tolist())
        row += len(table)
    return DatasetScan(len(ds), lengths, h.hexdigest(), max_id)


def load_split(run_dir: Path, split: str):
    """The processed split written by the data stage (`data.load_processed`)."""
    from .data import load_processed
    return load_processed(run_dir, split)


def hidden_dir(run_dir, split: str) -> Path:
    return Path(run_dir) / "hidden" / split


# ---- capture: aux layer inputs + final state, real tokens only ---------------------------------
def find_decoder_layers(decoder, num_layers: int):
    """The decoder's list of transformer blocks (`layers` in Llama/Qwen/DeepSeek, `h` in GPT-2
    style models; otherwise the one ModuleList of length num_hidden_layers)."""
    from torch import nn
    for name in ("layers", "h", "blocks"):
        mods = getattr(decoder, name, None)
        if isinstance(mods, nn.ModuleList) and len(mods) >= num_layers:
            return mods
    lists = [m for _, m in decoder.named_modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if len(lists) != 1:
        raise CacheError(f"{type(decoder).__name__}: cannot tell which ModuleList holds the {num_layers} decoder "
                         f"layers ({len(lists)} candidates); aux-layer capture needs it")
    return lists[0]


class HiddenStateCapture:
    """Runs the target's decoder (no lm_head) on a right-padded batch and returns, for its real
    tokens in row-major order, the inputs of the aux decoder layers and the final normed state.

        cap = HiddenStateCapture(model, [2, 15, 27])
        aux, final = cap(input_ids, attention_mask, torch.bfloat16)   # [n, 3, H], [n, H]
    """

    def __init__(self, model, aux_layers: list):
        from .target import text_config
        cfg = text_config(model)
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        check_aux_layers(aux_layers, self.num_layers, getattr(model, "name_or_path", "the target"))
        self.aux_layers = list(aux_layers)
        self.decoder = model.get_decoder()
        if self.decoder is model:
            raise CacheError(f"{type(model).__name__}.get_decoder() returned the model itself; "
                             "extraction needs the base decoder to avoid computing logits")
        layers = find_decoder_layers(self.decoder, self.num_layers)
        self.input_device = model.get_input_embeddings().weight.device
        self._out = None        # [n, 3, H] buffer being filled during one forward
        self._rows = None       # [n] flat indices (b * T + t) of the real tokens
        self._handles = []
        for k in sorted(set(self.aux_layers)):
            slots = [j for j, layer in enumerate(self.aux_layers) if layer == k]
            hook = self._make_hook(slots)
            self._handles.append(layers[k].register_forward_pre_hook(hook, with_kwargs=True))

    def _make_hook(self, slots: list):
        def hook(module, args, kwargs):
            if self._out is None:
                return None
            h = args[0] if args else kwargs["hidden_states"]              # [B, T, H]
            rows = h.reshape(-1, h.shape[-1]).index_select(0, self._rows.to(h.device))  # [n, H]
            for j in slots:
                self._out[:, j].copy_(rows)   # casts to the cache dtype, moves across devices
            return None
        return hook

    def __call__(self, input_ids, attention_mask, dtype):
        import torch
        input_ids = input_ids.to(self.input_device)                       # [B, T]
        attention_mask = attention_mask.to(self.input_device)             # [B, T], 1 = real token
        rows = attention_mask.reshape(-1).nonzero().squeeze(1)            # [n]
        try:
            with torch.inference_mode():
                self._rows = rows
                self._out = torch.empty(rows.numel(), len(self.aux_layers), self.hidden_size,
                                        dtype=dtype, device=self.input_device)    # [n, 3, H]
                out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T, H]
                final = last.reshape(-1, self.hidden_size).index_select(0, rows.to(last.device))  # [n, H]
                final = final.to(device=self.input_device, dtype=dtype)
            aux = self._out
        finally:
            self._out, self._rows = None, None
        return aux, final

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []


def check_aux_layers(aux_layers, num_layers: int, where="the target"):
    if len(aux_layers) != 3 or not all(isinstance(k, int) and 0 <= k < num_layers for k in aux_layers):
        raise ParamsError(f"extract.aux_layers: {list(aux_layers)} out of range for {where}: it has "
                          f"{num_layers} decoder layers (valid ids 0..{num_layers - 1}; id k is the input of layer k)")


def pad_batch(rows: list, pad_id: int = 0):
    """Right-pad token lists: input_ids [B, T] long, attention_mask [B, T] long."""
    import torch
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, :len(r)] = 1
    return ids, mask


# ---- one shard file: safetensors layout, filled in place --------------------------------------
def shard_layout(nseq: int, ntok: int, hidden: int, dtype: str, num_aux: int = 3):
    """(header bytes, {name: (absolute byte offset, byte size)}) of a shard. The tensors lie in the
    order below, so every one is aligned to its element size (the header is padded to 8 bytes)."""
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


def _pwrite_all(fd: int, data, offset: int):
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _as_bytes(t):
    """A CPU tensor's raw little-endian bytes as a numpy view (bf16 has no numpy dtype)."""
    import torch
    t = t.contiguous()
    return t.view(torch.uint8).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ShardFile:
    """A shard being written to its temp name; `finish()` fsyncs, hashes and renames it."""

    def __init__(self, out_dir: Path, plan: ShardPlan, token_rows: list, mask_rows: list,
                 hidden: int, dtype: str):
        import numpy as np
        self.path = out_dir / plan.file
        self.tmp = out_dir / f".{plan.file}.tmp"
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

    def write_rows(self, row_start: int, aux, final):
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


def _preallocate(fd: int, size: int):
    try:
        os.posix_fallocate(fd, 0, size)
    except (AttributeError, OSError) as e:
        import errno
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


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


# ---- manifest -------------------------------------------------------------------------------
def identity(P: Params, split: str, scan: DatasetScan, target_dtype: str) -> dict:
    """What a cache must match to be reused: params hash (data + extract sections, seed, target
    path), dataset content, target dtype."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "split": split,
            "params_hash": P.section_hash("data", "extract"), "target_dtype": target_dtype,
            "dataset_fingerprint": scan.fingerprint}


def _manifest_files(out_dir: Path) -> list:
    return ([out_dir / MANIFEST] if (out_dir / MANIFEST).is_file() else []) + \
        sorted(out_dir.glob("manifest.part-*.json"))


def read_records(out_dir: Path, ident: dict) -> dict:
    """Shard records found in manifest.json and manifest.part-*.json, {shard index: record}.
    Refuses a folder written under another identity."""
    records = {}
    for path in _manifest_files(out_dir):
        try:
            m = read_json(path)
        except (OSError, json.JSONDecodeError) as e:
            raise CacheError(f"{path}: unreadable manifest ({e}); delete {out_dir} to start over") from e
        diff = {k: (m.get(k), v) for k, v in ident.items() if m.get(k) != v}
        if diff:
            lines = "; ".join(f"{k}: cache has {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise CacheError(
                f"{out_dir} holds a hidden-state cache made with other params or data ({lines}). "
                f"Refusing to mix caches: delete {out_dir} or use another run name (run_name=...).")
        for rec in m.get("shards", []):
            records[rec["index"]] = rec
    return records


def record_is_valid(out_dir: Path, rec: Optional[dict], plan: ShardPlan) -> bool:
    """A recorded shard counts as done if it holds the planned rows and its file still has the
    recorded size and sha256."""
    if rec is None or rec.get("seq_index") != plan.seq_index or rec.get("file") != plan.file:
        return False
    path = out_dir / plan.file
    return path.is_file() and path.stat().st_size == rec["bytes"] and file_sha256(path) == rec["sha256"]


def _manifest(header: dict, records: dict, num_shards: int) -> dict:
    shards = [records[i] for i in sorted(records)]
    return {**header, "num_shards": num_shards, "complete": len(shards) == num_shards,
            "num_tokens_done": sum(r["num_tokens"] for r in shards), "shards": shards}


# ---- distributed (torchrun) -----------------------------------------------------------------
def _dist_setup():
    """(rank, world, created): joins torchrun's process group (gloo: only barriers are needed)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        return dist.get_rank(), world, True
    return 0, 1, False


def _barrier(world: int):
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def _device(P: Params, rank: int, world: int) -> str:
    import torch
    want = P.extract.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise CacheError("extract.device: cuda requested but torch sees no GPU")
        if world > 1:
            return f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % torch.cuda.device_count()}"
    return want


def _device_map(path: Path, device: str, world: int) -> Optional[str]:
    """device_map="auto" when one process must hold a checkpoint too big for one GPU."""
    import torch
    if not device.startswith("cuda") or world > 1 or torch.cuda.device_count() < 2:
        return None
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    return "auto" if size > 0.8 * torch.cuda.get_device_properties(0).total_memory else None


def _check_causal_lm(path: Path, trust_remote_code: bool):
    """A clear error for a folder that holds no causal LM (before loading any weight)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise CacheError(f"target {path}: config.json is not a transformers model config: {e}") from e
    remote = "AutoModelForCausalLM" in (getattr(cfg, "auto_map", None) or {})
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote:
        raise CacheError(f"target {path} is a {type(cfg).__name__} ({cfg.model_type}), not a causal language "
                         "model that AutoModelForCausalLM can load; set target.path to a decoder-only LM")
    return cfg


# ---- the stage ------------------------------------------------------------------------------
def _prepare_out_dir(out_dir: Path, rank: int):
    """Create the folder and prove it is writable (clear error for read-only / not a folder)."""
    probe = out_dir / f".write-probe-{rank}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        probe.unlink()
    except OSError as e:
        raise CacheError(f"cannot write the hidden-state cache to {out_dir}: {e.strerror or e}. "
                         "Make the outputs folder writable or point params output_dir elsewhere.") from e


def _remove_stale_temps(out_dir: Path, mine: list, rank: int):
    """Temp files a killed run left behind (only this rank's, so ranks never race)."""
    for plan in mine:
        (out_dir / f".{plan.file}.tmp").unlink(missing_ok=True)
    pattern = ".manifest.json.*.tmp" if rank == 0 else f".manifest.part-{rank:05d}.json.*.tmp"
    for p in out_dir.glob(pattern):
        p.unlink(missing_ok=True)


def _check_free_space(out_dir: Path, need: int):
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise CacheError(f"not enough disk space for the hidden-state cache in {out_dir}: the remaining shards "
                         f"need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB are free. Free space or lower "
                         "data.num_train / data.max_length, then rerun (finished shards are kept).")


def extract_hidden_states(P: Params, run_dir, split: str = "train", model=None, progress: bool = True,
                          dataset=None) -> dict:
    """Write `<run_dir>/hidden/<split>/` (see the module docstring); returns a summary dict.

    model: an already loaded AutoModelForCausalLM (default: load target_path(P) in P.target.dtype).
    dataset: a processed `datasets.Dataset` (default: data.load_processed(run_dir, split)).
    Under torchrun (WORLD_SIZE > 1) every rank calls this; rank r writes shards r, r+W, ...
    """
    from .target import load_target, target_path

    if P.extract.backend != "hf":
        raise NotImplementedError(f"extract.backend={P.extract.backend!r} is not implemented; use 'hf'")
    run_dir = Path(run_dir)
    out_dir = hidden_dir(run_dir, split)
    ds = dataset if dataset is not None else load_split(run_dir, split)
    scan = scan_dataset(ds)
    if sum(scan.lengths) == 0:
        raise CacheError(f"the processed {split!r} split has no tokens ({scan.num_rows} rows): nothing to "
                         "extract. Run the data stage (02_data) first or check data.num_train / data.num_eval.")
    plans = plan_shards(scan.lengths, P.extract.shard_tokens, P.extract.batch_tokens)

    rank, world, created_group = _dist_setup()
    try:
        if model is None:
            path = target_path(P)
            _check_causal_lm(path, P.target.trust_remote_code)
            target_dtype = P.target.dtype
        else:
            path = Path(getattr(model, "name_or_path", "") or "<in-memory model>")
            target_dtype = str(model.dtype).replace("torch.", "")
        ident = identity(P, split, scan, target_dtype)
        _prepare_out_dir(out_dir, rank)
        records = read_records(out_dir, ident)
        mine = [p for p in plans if p.index % world == rank]
        _remove_stale_temps(out_dir, mine, rank)
        todo = [p for p in mine if not record_is_valid(out_dir, records.get(p.index), p)]
        todo_idx = {p.index for p in todo}
        records = {p.index: records[p.index] for p in mine if p.index not in todo_idx}  # verified, mine

        header, written, elapsed = None, [], 0.0
        if todo:
            if model is None:
                device = _device(P, rank, world)
                model = load_target(path, P.target.dtype, device=device,
                                    trust_remote_code=P.target.trust_remote_code,
                                    device_map=_device_map(path, device, world))
            try:
                aux_layers = P.aux_layer_ids()
            except (KeyError, ParamsError) as e:
                raise CacheError(f"cannot determine extract.aux_layers for {path}: {e}; set them in the params") from e
            capture = HiddenStateCapture(model, aux_layers)
            try:
                if scan.max_token_id >= model.get_input_embeddings().weight.shape[0]:
                    raise CacheError(f"processed {split!r} data holds token id {scan.max_token_id}, beyond the "
                                     f"target's vocabulary ({model.get_input_embeddings().weight.shape[0]}): "
                                     "data and target do not match")
                header = _header(ident, capture, path, P.extract.dtype, scan)
                bytes_per_shard = {p.index: shard_layout(len(p.seq_index), p.num_tokens, capture.hidden_size,
                                                         P.extract.dtype)[2] for p in plans}
                _check_free_space(out_dir, sum(bytes_per_shard[p.index] for p in todo))
                start = time.perf_counter()
                written = _run_shards(todo, ds, capture, out_dir, header, records, len(plans),
                                      P.extract.dtype, rank, world, progress and rank == 0, split)
                elapsed = time.perf_counter() - start     # forwards + writes, not the model load
            finally:
                capture.close()

        _barrier(world)
        if rank == 0:
            manifest = _finalize_manifest(out_dir, header, records, plans)
        _barrier(world)
        if rank != 0:
            manifest = read_json(out_dir / MANIFEST)
    finally:
        if created_group:
            import torch.distributed as dist
            dist.destroy_process_group()

    computed = sum(p.num_tokens for p in written)
    total_bytes = sum(r["bytes"] for r in manifest["shards"])
    return {
        "split": split, "path": str(out_dir), "complete": manifest["complete"],
        "num_sequences": sum(len(p.seq_index) for p in plans), "num_tokens": sum(p.num_tokens for p in plans),
        "num_shards": len(plans), "shards_written": len(written), "shards_skipped": len(mine) - len(written),
        "empty_rows_skipped": sum(1 for n in scan.lengths if n == 0),
        "tokens_computed": computed, "seconds": elapsed, "tokens_per_s": computed / elapsed if computed else None,
        "padding_fraction": (sum(p.padded_tokens() for p in written) / computed - 1) if computed else None,
        "bytes_total": total_bytes, "bytes_per_token": total_bytes / max(1, manifest["num_tokens"]),
        "hidden_size": manifest["hidden_size"], "aux_layers": manifest["aux_layers"], "dtype": manifest["dtype"],
        "rank": rank, "world_size": world,
    }


def _header(ident: dict, capture: HiddenStateCapture, path: Path, dtype: str, scan: DatasetScan) -> dict:
    return {**ident, "dtype": dtype, "aux_layers": capture.aux_layers, "hidden_size": capture.hidden_size,
            "num_layers": capture.num_layers, "target_path": str(path),
            "num_sequences": sum(1 for n in scan.lengths if n > 0), "num_tokens": sum(scan.lengths),
            "dataset_rows": scan.num_rows}


def _record_path(out_dir: Path, rank: int, world: int) -> Path:
    return out_dir / (MANIFEST if world == 1 else f"manifest.part-{rank:05d}.json")


def _run_shards(todo, ds, capture, out_dir, header, records, num_shards, dtype_name, rank, world,
                progress, split) -> list:
    """Forward every planned batch of the shards in `todo`; file work runs on a writer thread."""
    from tqdm.auto import tqdm

    from .target import torch_dtype
    dtype = torch_dtype(dtype_name)
    records = dict(records)
    record_path = _record_path(out_dir, rank, world)
    writer = BackgroundWriter(depth=2)
    open_files: list = []
    written = []
    bar = tqdm(total=sum(p.num_tokens for p in todo), unit="tok", unit_scale=True,
               desc=f"extract {split}", disable=not progress)
    try:
        for plan in todo:
            rows = ds[plan.seq_index]            # dict of python lists, in storage order
            tokens, masks = rows["input_ids"], rows["loss_mask"]
            shard = ShardFile(out_dir, plan, tokens, masks, capture.hidden_size, dtype_name)
            open_files.append(shard)
            row_start = 0
            for s, e in plan.batches:
                input_ids, attention_mask = pad_batch(tokens[s:e])             # [B, T]
                aux, final = capture(input_ids, attention_mask, dtype)         # [n, 3, H], [n, H]
                aux, final = aux.cpu(), final.cpu()
                writer.submit(lambda r=row_start, a=aux, f=final, sh=shard: sh.write_rows(r, a, f))
                row_start += aux.shape[0]
                bar.update(aux.shape[0])
            assert row_start == plan.num_tokens

            def finish(plan=plan, shard=shard):
                info = shard.finish()
                records[plan.index] = {"index": plan.index, "file": plan.file, "seq_index": plan.seq_index,
                                       "num_tokens": plan.num_tokens, **info}
                atomic_write_json(record_path, _manifest(header, records, num_shards))
            writer.submit(finish)
            written.append(plan)
        writer.drain()
    except OSError as e:
        raise CacheError(f"writing the hidden-state cache in {out_dir} failed: {e}. Unfinished shards were "
                         "removed and are not recorded; fix the cause and rerun (finished shards are kept).") from e
    finally:
        try:
            writer.jobs.join()
        finally:
            writer.close()
            for shard in open_files:
                if shard.fd is not None or shard.tmp.exists():
                    shard.abort()
            bar.close()
    return written


def _finalize_manifest(out_dir: Path, header: Optional[dict], own: dict, plans: list) -> dict:
    """Rank 0: merge its own records with every rank's part and the previous manifest.json
    (first found wins: own, parts, old manifest), write manifest.json, drop the parts.
    Shard bytes are deterministic, so two records of one planned shard agree."""
    records = dict(own)
    headers = [header] if header else []
    sources = sorted(out_dir.glob("manifest.part-*.json")) + \
        ([out_dir / MANIFEST] if (out_dir / MANIFEST).is_file() else [])
    for path in sources:
        m = read_json(path)
        headers.append({k: v for k, v in m.items() if k not in ("shards", "num_shards", "complete", "num_tokens_done")})
        for rec in m.get("shards", []):
            i = rec["index"]
            if i < len(plans) and rec.get("seq_index") == plans[i].seq_index:
                records.setdefault(i, rec)
    if not headers:
        raise CacheError(f"{out_dir}: nothing was extracted and no manifest exists")
    manifest = _manifest(headers[0], records, len(plans))
    atomic_write_json(out_dir / MANIFEST, manifest)
    for part in sources:
        if part.name != MANIFEST:
            part.unlink()
    return manifest


# ---- reader ---------------------------------------------------------------------------------
class HiddenCache:
    """Read access to `<run>/hidden/<split>/`, one item per sequence, ordered by dataset row.

        cache = HiddenCache(run_dir / "hidden" / "train")
        item = cache.get(0)   # input_ids long [T], loss_mask bool [T], aux [T, 3, H], final [T, H]

    Shards are opened lazily with `safetensors.safe_open` (memory mapped) and kept open; `get`
    reads only that sequence's rows. Safe to hand to DataLoader workers (handles reopen per process).
    """

    def __init__(self, path, allow_partial: bool = False):
        import numpy as np
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise CacheError(f"{self.path}: no {MANIFEST}; run the extract stage (03_extract) first")
        self.manifest = read_json(mpath)
        if self.manifest.get("format") != FORMAT:
            raise CacheError(f"{mpath} is not a {FORMAT} manifest")
        if not self.manifest["complete"] and not allow_partial:
            raise CacheError(f"{self.path}: extraction is unfinished ({len(self.manifest['shards'])}/"
                             f"{self.manifest['num_shards']} shards); rerun the extract stage to finish it")
        self.hidden_size = int(self.manifest["hidden_size"])
        self.aux_layers = list(self.manifest["aux_layers"])
        self.dtype = self.manifest["dtype"]
        # Per sequence: shard number, token start/end inside the shard, dataset row.
        shard_of, starts, ends, rows = [], [], [], []
        for s, rec in enumerate(self.manifest["shards"]):
            lengths = _read_offsets(self.path / rec["file"])
            shard_of += [s] * (len(lengths) - 1)
            starts += lengths[:-1]
            ends += lengths[1:]
            rows += rec["seq_index"]
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

    def _open(self, s: int):
        from safetensors import safe_open
        if self._pid != os.getpid():      # forked worker: the parent's handles are not ours
            self._handles, self._pid = {}, os.getpid()
        if s not in self._handles:
            self._handles[s] = safe_open(str(self.path / self.manifest["shards"][s]["file"]), framework="pt")
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

    def verify(self) -> bool:
        """Every recorded shard has its recorded size and sha256 and the expected tensor shapes;
        raises CacheError naming the bad shards, returns True otherwise."""
        from safetensors import safe_open
        bad = []
        for rec in self.manifest["shards"]:
            path = self.path / rec["file"]
            if not path.is_file():
                bad.append(f"{rec['file']}: missing")
                continue
            if path.stat().st_size != rec["bytes"] or file_sha256(path) != rec["sha256"]:
                bad.append(f"{rec['file']}: size or sha256 differs from the manifest")
                continue
            with safe_open(str(path), framework="pt") as f:
                n, H = rec["num_tokens"], self.hidden_size
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
                want = {"aux": [n, len(self.aux_layers), H], "final": [n, H], "input_ids": [n], "loss_mask": [n],
                        "offsets": [len(rec["seq_index"]) + 1], "seq_index": [len(rec["seq_index"])]}
                if shapes != want:
                    bad.append(f"{rec['file']}: tensor shapes {shapes} != {want}")
        if bad:
            raise CacheError(f"{self.path}: {len(bad)} bad shard(s): " + "; ".join(bad) +
                             ". Delete them (or the folder) and rerun the extract stage.")
        return True

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def _read_offsets(path: Path) -> list:
    from safetensors import safe_open
    if not path.is_file():
        raise CacheError(f"{path}: shard listed in the manifest is missing; rerun the extract stage")
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("offsets").tolist()


# ---- checks used by the notebook --------------------------------------------------------------
def fidelity_check(cache: HiddenCache, model, indices, decisive_margin: float = 0.5) -> dict:
    """Compare cached sequences with a fresh forward of `model` (load it in fp32 for a reference):
    argmax of the cached final states through the model's lm_head vs argmax of the fresh logits,
    overall and on "decisive" tokens (fresh top-1 leads top-2 by > decisive_margin logits), and
    the relative L2 error of each cached state. A bf16 cache flips a few near-ties only."""
    import torch
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    agree = total = decisive = decisive_agree = 0
    err = {name: [] for name in state_names(cache.aux_layers)}
    with torch.inference_mode():
        for i in indices:
            item = cache.get(i)
            out = model(item["input_ids"][None].to(device), output_hidden_states=True, use_cache=False)
            top2 = out.logits[0].float().topk(2, dim=-1)                                # [T, 2]
            cached_logits = lm_head(item["final"].to(device, lm_head.weight.dtype))     # [T, V]
            same = cached_logits.argmax(-1) == top2.indices[:, 0]                       # [T]
            clear = (top2.values[:, 0] - top2.values[:, 1]) > decisive_margin          # [T]
            agree += int(same.sum())
            total += len(same)
            decisive += int(clear.sum())
            decisive_agree += int((same & clear).sum())
            fresh = [out.hidden_states[k][0] for k in cache.aux_layers] + [out.hidden_states[-1][0]]  # 4 x [T, H]
            cached = list(item["aux"].unbind(1)) + [item["final"]]
            for name, c, f in zip(err, cached, fresh):
                err[name].append(float((c.to(f) - f).norm() / f.norm()))
    return {"tokens": total, "argmax_agreement": agree / max(total, 1),
            "decisive_tokens": decisive, "decisive_agreement": decisive_agree / max(decisive, 1),
            "relative_error": {name: sum(v) / len(v) for name, v in err.items()}}


def load_reference(P: Params, max_fp32_bytes: float = 8e9):
    """(model, dtype name) for `fidelity_check`: the target in fp32 when its fp32 weights stay under
    `max_fp32_bytes`, else in target.dtype (a big target: device_map="auto" over the GPUs)."""
    import torch
    from .target import load_target, target_path
    path = target_path(P)
    stored = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    bytes_per_value = {"float32": 4}.get(P.target.dtype, 2)
    if stored * 4 / bytes_per_value <= max_fp32_bytes:
        return load_target(path, "float32", trust_remote_code=P.target.trust_remote_code), "float32"
    cuda = torch.cuda.is_available()
    return load_target(path, P.target.dtype, trust_remote_code=P.target.trust_remote_code,
                       device_map="auto" if cuda else None), P.target.dtype


def state_names(aux_layers) -> list:
    return [f"aux {tag} (layer {k})" for tag, k in zip(("low", "mid", "high"), aux_layers)] + ["final (normed)"]


def hidden_state_norms(cache: HiddenCache, indices) -> dict:
    """Per-token L2 norms of the cached states: {state name: float tensor [tokens]}."""
    import torch
    names = state_names(cache.aux_layers)
    norms = {name: [] for name in names}
    for i in indices:
        item = cache.get(i)
        states = list(item["aux"].float().unbind(1)) + [item["final"].float()]
        for name, s in zip(names, states):
            norms[name].append(s.norm(dim=-1))
    return {name: torch.cat(v) for name, v in norms.items()}
