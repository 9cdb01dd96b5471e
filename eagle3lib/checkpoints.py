"""Training checkpoints and the final drafter.

    ckpt = save_checkpoint(layout.checkpoints, step, model, optimizers, meta, dist)   # every rank calls it
    ckpt = latest_checkpoint(layout.checkpoints)
    meta = read_checkpoint_meta(ckpt)             # check before loading: world size, identity, ...
    load_checkpoint(ckpt, model, optimizers, dist)
    save_final(layout.final, drafter_state, config, summary)                          # rank 0, once

Two formats of checkpoints/step-XXXXXX/ (the weights after XXXXXX optimizer steps):
- one process: checkpoint.safetensors = model.<name>, optim.<param name>.<state key> (exp_avg,
  step, ...), rng.torch; its metadata["eagle3lab"] is the JSON metadata (step, data position,
  history, optimizer param_groups, world_size);
- several processes (torchrun, ddp / fsdp): a torch.distributed.checkpoint (DCP) folder: each
  rank writes its own shards of the model and optimizer state (`__<rank>_0.distcp`, `.metadata`),
  its RNG state (rng-rank-NNNNN.safetensors), and checkpoint.json holds the metadata. Nothing is
  gathered: at Kimi shapes a full state dict is ~14 GB on rank 0's CPU. Such a checkpoint is
  resumed with the same world size only (the shards are laid out for it).
Both are written in a temp folder `.step-XXXXXX-*` and renamed when complete (under DCP: rank 0
renames after a barrier that follows every rank's write), so a killed run never leaves a
half-written step-XXXXXX. final/model.safetensors, the single-file drafter for export, is written
once at the end (save_final).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as td
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from .dist import Dist
from .files import atomic_dir, atomic_write_json, read_json, remove_tree
from .model import Eagle3Config

CHECKPOINT_FILE = "checkpoint.safetensors"      # one process
SHARDED_META = "checkpoint.json"                # several processes (DCP folder)
KEEP_CHECKPOINTS = 2


def _is_complete(path: Path) -> bool:
    return (path / CHECKPOINT_FILE).is_file() or (path / SHARDED_META).is_file()


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def latest_checkpoint(ckpt_root: Path) -> Optional[Path]:
    done = sorted(p for p in ckpt_root.glob("step-*") if _is_complete(p))
    return done[-1] if done else None


def last_good_checkpoint(ckpt_root: Path, first_bad_step: int) -> Optional[Path]:
    """The newest kept checkpoint older than the first bad step's weights. Checkpoint step-k holds
    the weights after k updates, which step k+1's loss is computed with: the first bad step s was
    computed with step-(s-1), so the good ones are step-k with k < s - 1."""
    good = [p for p in ckpt_root.glob("step-*") if _is_complete(p) and _step_of(p) < first_bad_step - 1]
    return max(good, default=None)


def read_checkpoint_meta(path: Path) -> dict:
    """The metadata of a checkpoint folder (either format) without loading its tensors;
    world_size is 1 for a single-file checkpoint that predates the field."""
    if (path / SHARDED_META).is_file():
        return read_json(path / SHARDED_META)
    with safe_open(str(path / CHECKPOINT_FILE), framework="pt") as f:
        meta = json.loads(f.metadata()["eagle3lab"])
    return {"world_size": 1, **meta}


def _prune(ckpt_root: Path) -> None:
    """Keep the newest KEEP_CHECKPOINTS; delete the temp folders of killed runs (atomic_dir)."""
    for old in sorted(ckpt_root.glob("step-*"))[:-KEEP_CHECKPOINTS]:
        remove_tree(old, under=ckpt_root, ignore_errors=True)
    for stale in ckpt_root.glob(".step-*"):
        remove_tree(stale, under=ckpt_root, ignore_errors=True)


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizers: list, meta: dict,
                    dist: Dist) -> Optional[Path]:
    """checkpoints/step-XXXXXX (see the module docstring); every rank calls it. Returns the folder
    (None on ranks > 0 of a single-file checkpoint)."""
    meta = {**meta, "step": step, "world_size": dist.world}
    if dist.world > 1:
        final = _save_sharded(ckpt_root / f"step-{step:06d}", model, optimizers, meta, dist)
    else:
        final = _save_single(ckpt_root / f"step-{step:06d}", model, optimizers, meta)
    if dist.rank == 0:
        _prune(ckpt_root)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizers: list, dist: Optional[Dist] = None) -> dict:
    """Restore model, optimizer and RNG from a checkpoint folder made with this world size;
    returns its metadata."""
    dist = dist or Dist()
    meta = read_checkpoint_meta(path)
    if meta["world_size"] != dist.world:
        raise RuntimeError(f"{path} was written by {meta['world_size']} process(es), this run has {dist.world}: "
                           "a checkpoint is resumed with the same world size only (train.nproc)")
    if dist.world > 1:
        _load_sharded(path, model, optimizers, dist)
    else:
        _load_single(path, model, optimizers)
    return meta


# ==== one process: one safetensors file ==========================================================
def _full_state(model: nn.Module, optimizers: list) -> tuple[dict, dict]:
    """(model state, optimizer state {"state": {fqn: {key: tensor}}, "param_groups": [...]}),
    full tensors on CPU, keyed by parameter names."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizers, options=opts)


def _save_single(final: Path, model: nn.Module, optimizers: list, meta: dict) -> Path:
    model_sd, optim_sd = _full_state(model, optimizers)
    tensors = {f"model.{k}": v.contiguous() for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            tensors[f"optim.{name}.{key}"] = torch.as_tensor(value).contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    meta = {**meta, "param_groups": optim_sd["param_groups"]}
    with atomic_dir(final) as tmp:
        save_file(tensors, str(tmp / CHECKPOINT_FILE), metadata={"eagle3lab": json.dumps(meta, default=str)})
    return final


def _load_single(path: Path, model: nn.Module, optimizers: list) -> None:
    with safe_open(str(path / CHECKPOINT_FILE), framework="pt") as f:
        meta = json.loads(f.metadata()["eagle3lab"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            name, key = k[len("optim."):].rsplit(".", 1)
            state.setdefault(name, {})[key] = v
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizers, {"state": state, "param_groups": groups}, options=opts)
    torch.set_rng_state(tensors["rng.torch"])


# ==== several processes: torch.distributed.checkpoint ============================================
# The frozen embedding is the target's (rebuilt from it at setup): neither saved nor loaded.
SHARDED_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _rng_file(rank: int) -> str:
    return f"rng-rank-{rank:05d}.safetensors"


def _save_sharded(final: Path, model: nn.Module, optimizers: list, meta: dict, dist: Dist) -> Path:
    """Every rank writes its shards into rank 0's temp folder; rank 0 renames it after a barrier
    (the folder must be on a file system every rank sees)."""
    with atomic_dir(final) if dist.rank == 0 else contextlib.nullcontext() as tmp:
        name = [str(tmp)]
        td.broadcast_object_list(name, src=0)                    # the temp folder's random name
        tmp = Path(name[0])
        model_sd, optim_sd = get_state_dict(model, optimizers, options=SHARDED_OPTIONS)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        save_file({"rng.torch": torch.get_rng_state()}, str(tmp / _rng_file(dist.rank)))
        if dist.rank == 0:
            atomic_write_json(tmp / SHARDED_META, meta)
        dist.barrier()                                           # every rank's files are written
    return final


def _load_sharded(path: Path, model: nn.Module, optimizers: list, dist: Dist) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizers, options=SHARDED_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)                          # in place, this rank's shards
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=SHARDED_OPTIONS)
    torch.set_rng_state(load_file(str(path / _rng_file(dist.rank)))["rng.torch"])


# ==== the final drafter ==========================================================================
def save_final(out_dir: Path, drafter_state: dict, config: Eagle3Config, extra: dict) -> None:
    """final/: model.safetensors (vLLM parameter names, without the frozen embed_tokens) and
    config.json = asdict(Eagle3Config); written in a temp folder, then renamed."""
    state = {k: v.detach().cpu().contiguous() for k, v in drafter_state.items() if not k.startswith("embed_tokens")}
    with atomic_dir(out_dir) as tmp:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
        (tmp / "training.json").write_text(json.dumps(extra, indent=2, default=str) + "\n")
