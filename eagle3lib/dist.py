"""torchrun plumbing shared by extraction and training: which process am I, how many are we, and
which device is mine. A single process (rank 0 of 1) when not launched by torchrun.

    dist = Dist()                       # joins torchrun's process group when launched by it
    device = dist.device("auto")        # cuda:<LOCAL_RANK> or cpu
    ... dist.barrier(); dist.all_sum(x); dist.broadcast_flag(flag); dist.all_gather_object(obj) ...
    dist.close()                        # only destroys the group it created
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as td

# The accelerator's collective backend. NCCL reduces CUDA tensors only: a CPU tensor handed to a
# group that has NCCL alone stops the job ("No backend type associated with device type cpu").
ACCELERATOR_BACKEND = "nccl"


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def process_group_backend(cuda: bool) -> str:
    """The backend of the process group Dist creates: on a CUDA machine gloo for CPU tensors and
    NCCL for CUDA ones, so that every collective has a backend for its tensors' device (the
    trainer's CPU statistics, flags and object collectives as well as FSDP's CUDA all-gathers; torch
    runs object collectives and barriers on the CPU one); gloo alone elsewhere."""
    return f"cpu:gloo,cuda:{ACCELERATOR_BACKEND}" if cuda else "gloo"


class Dist:
    """rank / world and the few collectives the stages need.

    backend: None picks process_group_backend (gloo for CPU tensors, plus NCCL for CUDA tensors on a
    CUDA machine); extraction passes "gloo" (it only needs barriers). timeout_minutes: how long a rank
    waits in a collective for the others before the job is stopped (train.pg_timeout_minutes;
    None: torch's default, 10 minutes for NCCL, 30 for gloo). A process group that already exists
    is joined as it is and left open by close()."""

    def __init__(self, backend: Optional[str] = None, timeout_minutes: Optional[float] = None):
        self.created = False
        if launched_by_torchrun() and td.is_available() and not td.is_initialized():
            timeout = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
            td.init_process_group(backend=backend or process_group_backend(torch.cuda.is_available()), **timeout)
            self.created = True
        joined = td.is_available() and td.is_initialized()
        self.rank = td.get_rank() if joined else 0
        self.world = td.get_world_size() if joined else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))

    def device(self, want: str = "auto", avoid: tuple = ()) -> torch.device:
        """auto: this rank's GPU when torch sees one, else the CPU. cuda: this rank's GPU (a clear
        error when there is none). avoid: GPU indices left to another job (online hidden states'
        server); the ranks take the others in order. The chosen GPU becomes the current one."""
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {want!r} requested but torch sees no GPU; use cpu or auto")
            mine = [i for i in range(torch.cuda.device_count()) if i not in set(avoid)]
            if not mine or (avoid and self.local_rank >= len(mine)):
                raise RuntimeError(f"rank {self.local_rank}: no GPU left for training ({torch.cuda.device_count()} "
                                   f"visible, {sorted(avoid)} serve the target: extract.online_gpus); train with "
                                   "fewer processes (train.nproc) or give the server fewer GPUs")
            device = torch.device(f"cuda:{mine[self.local_rank % len(mine)]}")
            torch.cuda.set_device(device)
            return device
        return torch.device(want)

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over ranks (a new tensor; x itself on one rank)."""
        if self.world > 1:
            x = x.clone()
            td.all_reduce(x)
        return x

    def broadcast_flag(self, flag: bool) -> bool:
        """Rank 0's flag on every rank (so that all ranks leave a loop at the same step)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        td.broadcast(t, src=0)
        return bool(t.item())

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order ([obj] on one rank)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        td.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            td.barrier()

    def close(self) -> None:
        if self.created:
            td.destroy_process_group()
            self.created = False
