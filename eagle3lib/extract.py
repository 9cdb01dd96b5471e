"""Hidden-state extraction (stage 03): run the target once over the processed chats and keep, per
token, what the drafter trains on -- the inputs of three auxiliary decoder layers and the final
(post-norm) state -- in the cache that cache.py defines and reads.

    summary = extract_hidden_states(params, params.layout(), "train")  # writes layout.hidden("train")
    summaries = extract_splits(params, params.layout(), ("train", "eval"))  # one backend start for both

Layer id k is the hidden state entering decoder layer k (`output_hidden_states[k]`, 0 = the
embedding output). A backend turns one forward batch of token rows into aux [n, 3, H] and final
[n, H]; the HF backend (`HFBackend`) runs the model's own forward and captures them with forward
pre-hooks on the text decoder's layers and a hook on its final norm that stops the forward there,
so no [T, V] logits are built (see HiddenStateCapture).

The stage around the backend is the same for every backend: scan the processed split (lengths,
content fingerprint), plan the shards (cache.plan_shards, fixed before any work), skip the shards
that the manifest records, whose size still matches and that no verification found bad
(cache.record_is_valid: the writer hashed them; re-reading them is cache.verify_cache's job, once
per cache), compute and write the others
(cache.CacheWriter), merge the manifest, verify the cache (train.verify_cache; 04 then finds it
verified and reads nothing). A run killed at any moment and restarted gives the same
bytes as an uninterrupted one. Under torchrun, rank r writes shards r, r+W, r+2W, ... and records
them in its own `manifest.part-XXXXX.json`; rank 0 merges the parts after a barrier.

03's fidelity check (`check_fidelity`, extract.fidelity) compares the cached final states with the
target's own next tokens: a fresh transformers forward (hf), or the vLLM engine's prompt logprobs
asked for in the extraction's own engine start (vllm: no transformers load, the big box's way).
"""
from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset, load_from_disk
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

from .cache import (
    MANIFEST,
    ST_DTYPES,
    CacheError,
    CacheHeader,
    CacheWriter,
    HiddenCache,
    Manifest,
    identity,
    merge_manifests,
    plan_shards,
    read_manifest,
    read_records,
    record_is_valid,
    record_path,
    shard_file_bytes,
    shard_temp,
    verify_cache,
)
from .dist import Dist
from .extract_vllm import open_vllm_backend
from .files import atomic_write_bytes, check_run_links, update_metrics
from .layout import RunLayout
from .params import Params, ParamsError, host_memory_bytes
from .progress import tqdm
from .target import checkpoint_weight_bytes, load_target, load_target_tensors, target_path, text_config, torch_dtype


# ---- the processed dataset --------------------------------------------------------------------
@dataclass
class DatasetScan:
    num_rows: int
    lengths: list              # tokens per row (0 for an empty row)
    fingerprint: str           # sha256 over every row's input_ids and loss_mask
    max_token_id: int


def scan_dataset(ds: Dataset) -> DatasetScan:
    """One pass over a `datasets.Dataset` with input_ids/loss_mask list columns: lengths, a
    content fingerprint, the largest token id; a row whose two lists differ in length is an error."""
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
            raise ValueError(f"processed dataset row {r}: {n_ids[bad[0]]} input_ids but {n_mask[bad[0]]} "
                             "loss_mask values")
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


def load_split(layout: RunLayout, split: str) -> Dataset:
    """The processed split the data stage saved (columns conv_id, input_ids, loss_mask)."""
    path = layout.data_split(split)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no processed {split!r} split; run the data stage (02_data) first")
    return load_from_disk(str(path))


# ---- backends: how the target is run ----------------------------------------------------------
class Backend(Protocol):
    """How the stage runs the target. Everything else (plan, resume, shard files, manifest) belongs
    to the stage and cache.py, so every backend writes the same cache."""
    aux_layers: list           # the 3 decoder-layer ids; id k = the hidden state entering layer k
    hidden_size: int           # H
    num_layers: int            # decoder layers of the target
    vocab_size: int            # token ids must stay below it

    def states(self, rows: list, dtype: torch.dtype) -> tuple:
        """rows: B lists of token ids (one forward batch). For their tokens in row-major order
        (n = sum of the row lengths): aux [n, 3, H] and final [n, H] (after the final norm), CPU
        tensors in `dtype`."""

    def close(self) -> None:
        """Release what the backend holds (hooks, engines)."""


FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f")


class _StopAfterFinalNorm(Exception):
    """Raised by the final-norm hook: the states are captured, the lm_head ([T, V] logits) is skipped."""


@dataclass
class TextDecoder:
    """Where the text model's states live inside a (possibly wrapped) causal LM."""
    path: str                  # e.g. "model" (Llama, DeepSeek-V3) or "language_model.model" (Kimi-K2.5)
    layers: nn.ModuleList      # the decoder blocks; id k = the input of layers[k]
    norm: nn.Module            # the final norm; its output [B, T, H] is the lm_head input


def _final_norm(module, hidden_size: int):
    """module's final-norm child (a module named like FINAL_NORM_NAMES with a [hidden_size] weight)."""
    for name in FINAL_NORM_NAMES:
        norm = getattr(module, name, None)
        weight = getattr(norm, "weight", None)
        if isinstance(norm, nn.Module) and isinstance(weight, torch.Tensor) and tuple(weight.shape) == (hidden_size,):
            return norm
    return None


def find_text_decoder(model, num_layers: int, hidden_size: int) -> TextDecoder:
    """The one submodule of `model` that holds the text model's decoder blocks and final norm,
    found by structure at any depth: `model` in Llama/DeepSeek-V3, `language_model.model` in
    Kimi-K2.5's multimodal class. Not `get_decoder()`: on such a wrapper it returns the causal LM,
    whose output is the logits."""
    found = []
    for path, module in model.named_modules():
        layers = next((getattr(module, n) for n in ("layers", "h", "blocks")
                       if isinstance(getattr(module, n, None), nn.ModuleList)
                       and len(getattr(module, n)) == num_layers), None)
        norm = _final_norm(module, hidden_size) if layers is not None else None
        if norm is not None:
            found.append(TextDecoder(path, layers, norm))
    if len(found) != 1:
        where = ", ".join(repr(d.path) for d in found) or "none"
        raise CacheError(f"{type(model).__name__}: expected one text decoder (a module with {num_layers} decoder "
                         f"layers and a final norm of width {hidden_size}), found {len(found)} ({where}); "
                         "hidden-state capture cannot tell which states to keep")
    return found[0]


def _first_tensor(output):
    """A module's output as one tensor (a norm returns a tensor; a wrapped model a tuple/ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output
    return next(v for v in values if isinstance(v, torch.Tensor))


class HiddenStateCapture:
    """Runs the target's own forward on a right-padded batch and returns, for its real tokens in
    row-major order, the inputs of the aux decoder layers and the final normed state.

        cap = HiddenStateCapture(model, [2, 15, 27])
        aux, final = cap(input_ids, attention_mask, torch.bfloat16)   # [n, 3, H], [n, H]

    The top-level model's forward runs (so hooks on the root module apply, e.g. compressed-tensors
    decompressing INT4 weights on the first forward); forward pre-hooks on the aux layers copy their
    inputs, a forward hook on the final norm copies its output and stops the forward there, so the
    lm_head never builds [T, V] logits. A final state that is not [B, T, hidden_size] of the text
    model (e.g. logits) is a CacheError, before anything reaches the cache.
    """

    def __init__(self, model, aux_layers: list):
        cfg = text_config(model)
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        check_aux_layers(aux_layers, self.num_layers, getattr(model, "name_or_path", "the target"))
        self.aux_layers = list(aux_layers)
        self.model = model
        self.decoder = find_text_decoder(model, self.num_layers, self.hidden_size)
        self.input_device = model.get_input_embeddings().weight.device
        self._out = None        # [n, 3, H] buffer being filled during one forward
        self._final = None      # [n, H] buffer filled by the final-norm hook
        self._rows = None       # [n] flat indices (b * T + t) of the real tokens
        self._shape = None      # (B, T) of the batch being run
        self._handles = []
        for k in sorted(set(self.aux_layers)):
            slots = [j for j, layer in enumerate(self.aux_layers) if layer == k]
            hook = self._make_hook(slots)
            self._handles.append(self.decoder.layers[k].register_forward_pre_hook(hook, with_kwargs=True))
        self._handles.append(self.decoder.norm.register_forward_hook(self._final_hook))

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

    def _final_hook(self, module, args, output):
        if self._out is None:
            return None
        last = _first_tensor(output)                                      # [B, T, H]
        want = (*self._shape, self.hidden_size)
        if tuple(last.shape) != want:
            raise CacheError(f"the captured final state ({self.decoder.path!r}) has shape {tuple(last.shape)}, "
                             f"expected {want} = [batch, tokens, hidden_size of the text model]: it is not the "
                             "final normed hidden state (logits?); nothing was written to the cache")
        self._final = last.reshape(-1, self.hidden_size).index_select(0, self._rows.to(last.device))  # [n, H]
        raise _StopAfterFinalNorm

    def __call__(self, input_ids, attention_mask, dtype):
        input_ids = input_ids.to(self.input_device)                       # [B, T]
        attention_mask = attention_mask.to(self.input_device)             # [B, T], 1 = real token
        rows = attention_mask.reshape(-1).nonzero().squeeze(1)            # [n]
        try:
            with torch.inference_mode():
                self._rows, self._shape = rows, tuple(input_ids.shape)
                self._out = torch.empty(rows.numel(), len(self.aux_layers), self.hidden_size,
                                        dtype=dtype, device=self.input_device)    # [n, 3, H]
                try:
                    self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                except _StopAfterFinalNorm:
                    pass
                if self._final is None:
                    raise CacheError(f"{type(self.model).__name__}'s forward never ran its final norm "
                                     f"(in {self.decoder.path!r}): cannot capture the final state")
                final = self._final.to(device=self.input_device, dtype=dtype)  # [n, H]
            aux = self._out
        finally:
            self._out, self._final, self._rows, self._shape = None, None, None, None
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
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, :len(r)] = 1
    return ids, mask


class HFBackend:
    """The Backend of a loaded transformers causal LM: its own decoder, hooks on the aux layers."""

    def __init__(self, model, aux_layers: list):
        self.capture = HiddenStateCapture(model, aux_layers)
        self.aux_layers = self.capture.aux_layers
        self.hidden_size = self.capture.hidden_size
        self.num_layers = self.capture.num_layers
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])

    def states(self, rows: list, dtype: torch.dtype) -> tuple:
        input_ids, attention_mask = pad_batch(rows)                        # [B, T]
        aux, final = self.capture(input_ids, attention_mask, dtype)        # [n, 3, H], [n, H]
        return aux.cpu(), final.cpu()

    def close(self) -> None:
        self.capture.close()


def _check_causal_lm(path: Path, trust_remote_code: bool):
    """A clear error for a folder that holds no causal LM (before loading any weight)."""
    try:
        cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise CacheError(f"target {path}: config.json is not a transformers model config: {e}") from e
    remote = "AutoModelForCausalLM" in (getattr(cfg, "auto_map", None) or {})
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote:
        raise CacheError(f"target {path} is a {type(cfg).__name__} ({cfg.model_type}), not a causal language "
                         "model that AutoModelForCausalLM can load; set target.path to a decoder-only LM")
    return cfg


def _device(params: Params, dist: Dist) -> torch.device:
    if params.extract.device == "cuda" and not torch.cuda.is_available():
        raise CacheError("extract.device: cuda requested but torch sees no GPU; set extract.device to cpu or auto")
    return dist.device(params.extract.device)


def _device_map(path: Path, device: torch.device, world: int) -> Optional[str]:
    """device_map="auto" when one process must hold a checkpoint too big for one GPU."""
    if device.type != "cuda" or world > 1 or torch.cuda.device_count() < 2:
        return None
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    return "auto" if size > 0.8 * torch.cuda.get_device_properties(0).total_memory else None


def _target_identity(params: Params, model) -> tuple:
    """(target folder, dtype it runs in), known before any weight is loaded."""
    if model is not None:
        return Path(getattr(model, "name_or_path", "") or "<in-memory model>"), str(model.dtype).replace("torch.", "")
    path = target_path(params)
    if params.extract.backend == "hf":  # vLLM checks the architecture against its own registry
        _check_causal_lm(path, params.target.trust_remote_code)
    return path, params.target.dtype


def open_hf_backend(params: Params, path: Path, dist: Dist, model=None) -> HFBackend:
    """Load the target (unless `model` is given) on this rank's device and hook its aux layers."""
    if model is None:
        device = _device(params, dist)
        model = load_target(path, params.target.dtype, device=str(device),
                            trust_remote_code=params.target.trust_remote_code,
                            device_map=_device_map(path, device, dist.world))
    try:
        aux_layers = params.aux_layer_ids()
    except (KeyError, ParamsError) as e:
        raise CacheError(f"cannot determine extract.aux_layers for {path}: {e}; set them in the params") from e
    return HFBackend(model, aux_layers)


# extract.backend -> opener(params, target path, dist, model or None) -> Backend, called only when some
# shard is left to compute.
BACKENDS = {"hf": open_hf_backend, "vllm": open_vllm_backend}


# ---- the stage ------------------------------------------------------------------------------
class SharedBackend:
    """One extraction backend for several extract_hidden_states calls (03's train and eval splits:
    one engine start, not one per split): opened by the first call with shards to compute, closed
    when the `with` block ends."""

    def __init__(self):
        self.backend = None

    def get(self, params: Params, path, dist, model):
        if self.backend is None:
            self.backend = BACKENDS[params.extract.backend](params, path, dist, model)
        return self.backend

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def __enter__(self) -> "SharedBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def extract_splits(params: Params, run, splits, model=None, progress: bool = True) -> dict:
    """extract_hidden_states for each split, all through one backend start -> {split: summary}."""
    with SharedBackend() as shared:
        return {split: extract_hidden_states(params, run, split, model=model, progress=progress, shared=shared)
                for split in splits}


def extract_hidden_states(params: Params, run, split: str = "train", model=None, progress: bool = True,
                          dataset: Optional[Dataset] = None, shared: Optional[SharedBackend] = None) -> dict:
    """Write the cache `layout.hidden(split)` (see cache.py); returns a summary dict.

    run: the run's RunLayout (or its folder, outputs/<run>).
    model: an already loaded AutoModelForCausalLM (default: load target_path(params) in params.target.dtype).
    dataset: a processed `datasets.Dataset` (default: the data stage's `layout.data_split(split)`).
    shared: a SharedBackend to take the backend from (and leave open); default: start one and close it.
    Under torchrun (WORLD_SIZE > 1) every rank calls this; rank r writes shards r, r+W, ...
    """
    if params.extract.backend not in BACKENDS:
        raise NotImplementedError(f"extract.backend={params.extract.backend!r} is not implemented; use one of "
                                  f"{', '.join(BACKENDS)}")
    layout = run if isinstance(run, RunLayout) else RunLayout(run)
    check_run_links(layout.root)   # no write or delete may go through a link out of the run
    out_dir = layout.hidden(split)
    ds = dataset if dataset is not None else load_split(layout, split)
    scan = scan_dataset(ds)
    if sum(scan.lengths) == 0:
        raise CacheError(f"the processed {split!r} split has no tokens ({scan.num_rows} rows): nothing to "
                         "extract. Run the data stage (02_data) first or check data.num_train / data.num_eval.")
    plans = plan_shards(scan.lengths, params.extract.shard_tokens, params.extract.batch_tokens)

    dist = Dist(backend="gloo", timeout_minutes=params.train.pg_timeout_minutes)  # only barriers; ranks wait
                                                                               # there for the slowest
    try:
        path, target_dtype = _target_identity(params, model)
        ident = identity(params, split, scan.fingerprint, target_dtype)
        mine, done, todo = _resume(out_dir, ident, plans, dist)
        header, elapsed = None, 0.0
        if todo:
            own = shared is None
            backend = BACKENDS[params.extract.backend](params, path, dist, model) if own else \
                shared.get(params, path, dist, model)
            try:
                header = _header(ident, backend, path, params.extract.dtype, scan, split)
                start = time.perf_counter()
                _compute_shards(backend, todo, ds, header, done, len(plans), out_dir, dist, progress)
                elapsed = time.perf_counter() - start     # forwards + writes, not the model load
                if (split == "eval" and dist.rank == 0 and fidelity_plan(params)[0] == "vllm"
                        and hasattr(backend, "top2")):
                    save_top2_reference(out_dir, backend, fidelity_rows(ds))     # same engine start
            finally:
                if own:
                    backend.close()
        manifest = _merge(out_dir, header, done, plans, dist)
        # The cache's one verification (train.verify_cache), split over the writers: it records
        # verified.json, so 04 and any rerun of this stage read no shard again while it holds.
        verify_cache(HiddenCache(out_dir), params.train.verify_cache, params.train.verify_sample, params.seed, dist)
    finally:
        dist.close()
    summary = _summary(split, out_dir, plans, mine, todo, scan, manifest, elapsed, dist)
    if dist.rank == 0:
        record_extract_metrics(layout, summary, params.extract.mode)
    return summary


def cached_splits(params: Params) -> tuple:
    """The splits 03 caches: both offline; with extract.mode online only the held-out one (04 asks the
    vLLM server for the train split's states as it trains: online.py)."""
    return ("eval",) if params.extract.mode == "online" else ("train", "eval")


def record_extract_metrics(layout: RunLayout, summary: dict, mode: str = "offline") -> dict:
    """metrics.json's "extract" section after one split: its sequences, tokens and bytes; for the
    train split also bytes per token against the states alone (dtype x 4H), the cache dtype and aux
    layers and the extraction speed (when shards were computed); cache_bytes once both splits exist;
    mode: extract.mode (online runs cache the eval split only)."""
    split = summary["split"]
    values = {f"{split}_sequences": summary["num_sequences"], f"{split}_tokens": summary["num_tokens"],
              f"{split}_cache_bytes": summary["bytes_total"], "mode": mode}
    if split == "train":
        values.update(bytes_per_token=round(summary["bytes_per_token"], 2),
                      state_bytes_per_token=ST_DTYPES[summary["dtype"]][1] * 4 * summary["hidden_size"],
                      aux_layers=summary["aux_layers"], dtype=summary["dtype"])
        if summary["tokens_per_s"]:      # None when every shard was already cached
            values["tokens_per_s"] = round(summary["tokens_per_s"], 1)
    section = update_metrics(layout.root, "extract", values)["extract"]
    if "train_cache_bytes" in section and "eval_cache_bytes" in section:
        section = update_metrics(layout.root, "extract", {
            "cache_bytes": section["train_cache_bytes"] + section["eval_cache_bytes"]})["extract"]
    return section


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
    """Temp files a killed run left behind (only this writer's, so ranks never race)."""
    for plan in mine:
        shard_temp(out_dir, plan).unlink(missing_ok=True)
    pattern = ".manifest.json.*.tmp" if rank == 0 else f".manifest.part-{rank:05d}.json.*.tmp"
    for p in out_dir.glob(pattern):
        p.unlink(missing_ok=True)


def _check_free_space(out_dir: Path, need: int):
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise CacheError(f"not enough disk space for the hidden-state cache in {out_dir}: the remaining shards "
                         f"need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB are free. Free space or lower "
                         "data.num_train / data.max_length, then rerun (finished shards are kept).")


def _resume(out_dir: Path, ident: dict, plans: list, dist: Dist) -> tuple:
    """(this rank's plans, {index: record} of its finished and still valid shards, plans to do)."""
    _prepare_out_dir(out_dir, dist.rank)
    records = read_records(out_dir, ident)
    mine = [p for p in plans if p.index % dist.world == dist.rank]
    _remove_stale_temps(out_dir, mine, dist.rank)
    todo = [p for p in mine if not record_is_valid(out_dir, records.get(p.index), p)]
    todo_idx = {p.index for p in todo}
    done = {p.index: records[p.index] for p in mine if p.index not in todo_idx}
    return mine, done, todo


def _header(ident: dict, backend: Backend, path: Path, dtype: str, scan: DatasetScan, split: str) -> CacheHeader:
    if scan.max_token_id >= backend.vocab_size:
        raise CacheError(f"processed {split!r} data holds token id {scan.max_token_id}, beyond the "
                         f"target's vocabulary ({backend.vocab_size}): data and target do not match")
    return CacheHeader(**ident, dtype=dtype, aux_layers=backend.aux_layers, hidden_size=backend.hidden_size,
                       num_layers=backend.num_layers, target_path=str(path),
                       num_sequences=sum(1 for n in scan.lengths if n > 0), num_tokens=sum(scan.lengths),
                       dataset_rows=scan.num_rows)


def _compute_shards(backend: Backend, todo: list, ds: Dataset, header: CacheHeader, done: dict,
                    num_shards: int, out_dir: Path, dist: Dist, progress: bool):
    """Forward every planned batch of the shards in `todo`; file work runs on the writer's thread."""
    _check_free_space(out_dir, sum(shard_file_bytes(p, header.hidden_size, header.dtype) for p in todo))
    dtype = torch_dtype(header.dtype)
    bar = tqdm(total=sum(p.num_tokens for p in todo), unit="tok", unit_scale=True,
               desc=f"extract {header.split}", disable=not (progress and dist.rank == 0))
    try:
        with CacheWriter(out_dir, header, done, num_shards, record_path(out_dir, dist.rank, dist.world)) as writer:
            for plan in todo:
                rows = ds[plan.seq_index]            # dict of python lists, in storage order
                tokens = rows["input_ids"]
                writer.start_shard(plan, tokens, rows["loss_mask"])
                for s, e in plan.batches:
                    aux, final = backend.states(tokens[s:e], dtype)        # [n, 3, H], [n, H]
                    writer.write_rows(aux, final)
                    bar.update(aux.shape[0])
                writer.finish_shard()
    finally:
        bar.close()


def _merge(out_dir: Path, header: Optional[CacheHeader], done: dict, plans: list, dist: Dist) -> Manifest:
    """Every rank's records in manifest.json (merged by rank 0 once all ranks are done)."""
    dist.barrier()
    if dist.rank == 0:
        manifest = merge_manifests(out_dir, header, done, plans)
    dist.barrier()
    if dist.rank != 0:
        manifest = read_manifest(out_dir / MANIFEST)
    return manifest


def _summary(split: str, out_dir: Path, plans: list, mine: list, written: list, scan: DatasetScan,
             manifest: Manifest, elapsed: float, dist: Dist) -> dict:
    computed = sum(p.num_tokens for p in written)
    total_bytes = sum(r.bytes for r in manifest.shards)
    h = manifest.header
    return {
        "split": split, "path": str(out_dir), "complete": manifest.complete,
        "num_sequences": sum(len(p.seq_index) for p in plans), "num_tokens": sum(p.num_tokens for p in plans),
        "num_shards": len(plans), "shards_written": len(written), "shards_skipped": len(mine) - len(written),
        "empty_rows_skipped": sum(1 for n in scan.lengths if n == 0),
        "tokens_computed": computed, "seconds": elapsed, "tokens_per_s": computed / elapsed if computed else None,
        "padding_fraction": (sum(p.padded_tokens() for p in written) / computed - 1) if computed else None,
        "bytes_total": total_bytes, "bytes_per_token": total_bytes / max(1, h.num_tokens),
        "hidden_size": h.hidden_size, "aux_layers": h.aux_layers, "dtype": h.dtype,
        "rank": dist.rank, "world_size": dist.world,
    }


# ---- checks used by the notebook --------------------------------------------------------------
def fidelity_check(cache: HiddenCache, model, indices, decisive_margin: float = 0.5) -> dict:
    """Compare cached sequences with a fresh forward of `model` (load it in fp32 for a reference):
    argmax of the cached final states through the model's lm_head vs argmax of the fresh logits,
    overall and on "decisive" tokens (fresh top-1 leads top-2 by > decisive_margin logits), and
    the relative L2 error of each cached state. A bf16 cache flips a few near-ties only."""
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
            "decisive_tokens": decisive,                    # None: no token was decisive (nothing to judge)
            "decisive_agreement": decisive_agree / decisive if decisive else None,
            "relative_error": {name: sum(v) / len(v) for name, v in err.items()}}


# ---- 03's fidelity check, chosen by extract.fidelity ------------------------------------------
# hf:   a fresh transformers forward of the target (fp32 when it fits; loads the whole target).
# vllm: the cached final states through the target's lm_head (read by name from safetensors)
#       against the vLLM engine's own top-2 next tokens (prompt logprobs) at every position,
#       asked for in the extraction's engine start and kept beside the eval cache.
# never / auto: see fidelity_plan. Either way the result or the skip lands in metrics.json.
FIDELITY_SEQUENCES = 8                    # the first eval sequences checked
FIDELITY_REFERENCE = "fidelity-reference.safetensors"   # in hidden/eval/: vLLM's top-2 of those
DECISIVE_MARGIN = 0.5                     # logits (top-1 minus top-2) that make a token decisive
MIN_ARGMAX_AGREEMENT = 0.95               # near-ties flip between bf16 and fp32
MIN_DECISIVE_AGREEMENT = 0.99             # clear decisions must not


def fidelity_plan(params: Params) -> tuple:
    """(mode, None) with mode "hf" | "vllm", or (None, why the check is skipped).
    auto: hf when the target's safetensors fit this machine's memory, else vllm when the
    extraction runs in vLLM, else skipped."""
    mode = params.extract.fidelity
    if mode == "never":
        return None, "extract.fidelity is 'never' (the profile turns 03's fidelity check off; see its comment)"
    if mode in ("hf", "vllm"):
        return mode, None
    weights, memory = checkpoint_weight_bytes(target_path(params)), host_memory_bytes()
    if weights is None or memory is None or weights <= memory:
        return "hf", None
    if params.extract.backend == "vllm":
        return "vllm", None
    return None, (f"the target's weights ({weights / 1e9:,.1f} GB of safetensors) exceed this machine's memory "
                  f"({memory / 1e9:,.1f} GB): the hf check loads the whole target in transformers. Set "
                  "extract.backend: vllm (its check needs no transformers load) or extract.fidelity: hf")


def fidelity_rows(ds: Dataset) -> list:
    """Token rows of the first FIDELITY_SEQUENCES non-empty sequences in dataset order: the cache's
    items 0, 1, ... (HiddenCache orders by dataset row and skips empty rows)."""
    rows = []
    for i in range(len(ds)):
        ids = ds[i]["input_ids"]
        if ids:
            rows.append(list(ids))
        if len(rows) == FIDELITY_SEQUENCES:
            break
    return rows


def save_top2_reference(out_dir: Path, backend, rows: list) -> None:
    """The engine's top-2 next tokens for `rows`, beside the cache (atomic; rows included)."""
    tensors = {}
    for i, (row, (ids, logprobs)) in enumerate(zip(rows, backend.top2(rows))):
        tensors.update({f"input_ids.{i}": torch.tensor(row, dtype=torch.long),       # [T]
                        f"top2_ids.{i}": ids, f"top2_logprobs.{i}": logprobs})     # [T, 2]
    atomic_write_bytes(Path(out_dir) / FIDELITY_REFERENCE, save_safetensors(tensors))


def load_top2_reference(params: Params, cache: HiddenCache) -> list:
    """[(top2 ids [T, 2], top2 logprobs [T, 2])] for cache items 0.. of the eval cache: the file the
    extraction saved, or (cache extracted earlier without it, or from other tokens) a vLLM engine
    started here for it."""
    rows = [cache.get(i)["input_ids"].tolist() for i in range(min(FIDELITY_SEQUENCES, len(cache)))]
    path = cache.path / FIDELITY_REFERENCE
    if path.is_file():
        saved = load_safetensors(path.read_bytes())
        if [saved.get(f"input_ids.{i}", torch.empty(0)).tolist() for i in range(len(rows))] == rows:
            return [(saved[f"top2_ids.{i}"], saved[f"top2_logprobs.{i}"]) for i in range(len(rows))]
    dist = Dist(backend="gloo")
    backend = open_vllm_backend(params, target_path(params), dist)
    try:
        save_top2_reference(cache.path, backend, rows)
    finally:
        backend.close()
        dist.close()
    return load_top2_reference(params, cache)


def top2_fidelity(cache: HiddenCache, lm_head: torch.Tensor, reference: list,
                  decisive_margin: float = DECISIVE_MARGIN, chunk: int = 256) -> dict:
    """The cached final states through `lm_head` [V, H] against the engine's top-2 per position:
    argmax agreement overall and on decisive tokens (engine top-1 leads top-2 by > decisive_margin
    logits: a logprob difference is a logit difference), and the mean |log p| difference of the
    engine's top-1 token (cached head in fp32 vs the engine's own logprob)."""
    head = lm_head.float()
    agree = total = decisive = decisive_agree = 0
    logprob_error = 0.0
    for i, (ids, logprobs) in enumerate(reference):
        final = cache.get(i)["final"]                                              # [T, H]
        for s in range(0, len(final), chunk):
            logp = (final[s:s + chunk].float() @ head.T).log_softmax(-1)           # [t, V]
            top1, lp = ids[s:s + chunk, 0], logprobs[s:s + chunk]                  # [t], [t, 2]
            same = logp.argmax(-1) == top1                                         # [t]
            clear = (lp[:, 0] - lp[:, 1]) > decisive_margin                        # [t]
            agree += int(same.sum())
            total += len(same)
            decisive += int(clear.sum())
            decisive_agree += int((same & clear).sum())
            logprob_error += float((logp.gather(1, top1[:, None])[:, 0] - lp[:, 0]).abs().sum())
    return {"tokens": total, "argmax_agreement": agree / max(total, 1), "decisive_tokens": decisive,
            "decisive_agreement": decisive_agree / decisive if decisive else None,
            "top1_logprob_abs_error": logprob_error / max(total, 1)}


def check_fidelity(params: Params, run, cache: HiddenCache) -> dict:
    """03's fidelity check of the eval `cache` as extract.fidelity chooses (fidelity_plan); the
    result, or the skip and its reason, is merged into metrics.json's "extract" section and
    returned. Raises CacheError when the cached states do not give the target's own choices."""
    layout = run if isinstance(run, RunLayout) else RunLayout(run)
    mode, skip = fidelity_plan(params)
    metrics = {"fidelity": mode or "skipped", "fidelity_skip_reason": skip}
    if mode == "hf":
        model, dtype = load_reference(params)
        result = fidelity_check(cache, model, range(min(FIDELITY_SEQUENCES, len(cache))), DECISIVE_MARGIN)
        del model
        metrics.update(fidelity_reference=f"a fresh transformers {dtype} forward",
                       final_relative_error=round(result["relative_error"]["final (normed)"], 5))
    elif mode == "vllm":
        lm_head = load_target_tensors(target_path(params), ("lm_head",))["lm_head"]  # [V, H]
        result = top2_fidelity(cache, lm_head, load_top2_reference(params, cache))
        metrics.update(fidelity_reference=f"the vLLM engine's prompt logprobs ({params.target.dtype})",
                       top1_logprob_abs_error=round(result["top1_logprob_abs_error"], 5))
    if mode is not None:
        metrics.update(checked_tokens=result["tokens"], decisive_tokens=result["decisive_tokens"],
                       argmax_agreement=round(result["argmax_agreement"], 4),
                       decisive_argmax_agreement=None if result["decisive_agreement"] is None
                       else round(result["decisive_agreement"], 4))
    update_metrics(layout.root, "extract", metrics)
    if mode is not None:
        _require_fidelity(result, metrics)
    return metrics


def _require_fidelity(result: dict, metrics: dict) -> None:
    if not result["decisive_tokens"]:
        raise CacheError(f"fidelity: none of the {result['tokens']} checked tokens is decisive (top-1 leads by "
                         f"> {DECISIVE_MARGIN} logits): nothing to judge; check a less random target")
    if result["argmax_agreement"] < MIN_ARGMAX_AGREEMENT or result["decisive_agreement"] < MIN_DECISIVE_AGREEMENT:
        raise CacheError(f"fidelity: the cached final states do not give the target's own next tokens "
                         f"(argmax agreement {result['argmax_agreement']:.2%} < {MIN_ARGMAX_AGREEMENT:.0%} or "
                         f"decisive {result['decisive_agreement']:.2%} < {MIN_DECISIVE_AGREEMENT:.0%}; "
                         f"{metrics}): the cache does not match the target; delete hidden/ and rerun 03")


def load_reference(params: Params, max_fp32_bytes: float = 8e9):
    """(model, dtype name) for `fidelity_check`: the target in fp32 when its fp32 weights stay under
    `max_fp32_bytes`, else in target.dtype (a big target: device_map="auto" over the GPUs)."""
    path = target_path(params)
    stored = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    bytes_per_value = {"float32": 4}.get(params.target.dtype, 2)
    if stored * 4 / bytes_per_value <= max_fp32_bytes:
        return load_target(path, "float32", trust_remote_code=params.target.trust_remote_code), "float32"
    cuda = torch.cuda.is_available()
    return load_target(path, params.target.dtype, trust_remote_code=params.target.trust_remote_code,
                       device_map="auto" if cuda else None), params.target.dtype


def state_names(aux_layers) -> list:
    return [f"aux {tag} (layer {k})" for tag, k in zip(("low", "mid", "high"), aux_layers)] + ["final (normed)"]


def hidden_state_norms(cache: HiddenCache, indices) -> dict:
    """Per-token L2 norms of the cached states: {state name: float tensor [tokens]}."""
    names = state_names(cache.aux_layers)
    norms = {name: [] for name in names}
    for i in indices:
        item = cache.get(i)
        states = list(item["aux"].float().unbind(1)) + [item["final"].float()]
        for name, s in zip(names, states):
            norms[name].append(s.norm(dim=-1))
    return {name: torch.cat(v) for name, v in norms.items()}
