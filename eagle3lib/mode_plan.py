"""Offline or online hidden states, by the numbers: the per-GPU memory, the hours and the disk of
each layout, from the capacity plan's own figures (plan.capacity_plan adds them as plan["modes"]).

    offline          03 prefills the whole train split once, writes, hashes and verifies the cache; 04 reads it
    online, shared   a vLLM server on every GPU (target.gpu_memory_utilization of each) beside the trainer;
                     the prefill is paid every epoch, on the same GPUs as training (times add up)
    online, split    extract.online_gpus serve (tensor parallel over them), the other GPUs train; the
                     two run side by side, so an epoch takes the slower of the two

The hours come from two capacity plans of the profile, one per extract.mode: offline's 03 + 04, and
online's 03 (the held-out cache only) + 04, whose parts include the server's start, its prefill of
every trained token and the connector's writes (stage_times.served_part). The split rescales those
parts by the GPUs each side gets. Nothing here is measured that the plans did not measure.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .params import Params, gpu_memory_budget, train_ranks

HEADROOM = 0.20          # memory.HEADROOM: a trainer must leave this share of its budget free


def staging_bound_bytes(hidden_size: int, batch_tokens: int, num_workers: int, world: int = 1) -> int:
    """The most bytes of connector files on disk at once during online training: each rank has at
    most its in-flight micro-batches' files there (1 without DataLoader workers, else workers x the
    prefetch factor), each micro-batch at most batch_tokens tokens x (3 aux + 1 final states of H
    fp32 values + an int64 token id) plus one file header (< 512 bytes) per token at most."""
    from .batches import PREFETCH_FACTOR  # the loader's (torch): planners sit above what they model
    in_flight = max(1, num_workers * PREFETCH_FACTOR)
    return world * in_flight * batch_tokens * (4 * hidden_size * 4 + 8 + 512)


def stage_seconds(plan: dict, stage: str) -> float:
    return plan["stages"][stage]["seconds"] if stage in plan["stages"] else 0.0


def served_seconds(plan: dict, prefill_scale: float = 1.0) -> float:
    """The online plan's train-stage parts that the server does: its start, its prefill (times
    prefill_scale: the split gives it fewer GPUs) and the connector's writes (one writer however many
    GPUs serve)."""
    from .stage_times import SERVED_PART
    parts = plan["stages"]["train"]["parts"]
    return sum(q["seconds"] * (prefill_scale if q["name"].startswith(SERVED_PART) else 1.0) for q in parts
               if q["name"].startswith((SERVED_PART, "connector saves")) or "online hidden-states server" in q["name"])


def trainer_peak(p: Params, ranks: int, planned: Optional[dict] = None) -> Optional[float]:
    """The memory model's per-GPU peak at data.max_length with `ranks` training ranks (None on a CPU
    profile); planned: the plan's "memory" section, reused when ranks are the profile's own."""
    if not gpu_memory_budget(p.train):
        return None
    if planned and ranks == p.train.nproc and p.data.max_length in planned:
        return float(planned[p.data.max_length]["peak_bytes"])
    from . import memory  # torch and the meta-device drafter: only when GPUs are planned
    train_params = dataclasses.replace(p.train, nproc=ranks)
    return float(memory.estimate(dataclasses.replace(p, train=train_params)).peak_bytes)


def layouts(p: Params, gpus: int) -> list:
    """(name, serving GPUs, training ranks) of the layouts worth comparing on `gpus` GPUs."""
    ranks = train_ranks(p)
    out = [("offline", 0, ranks), ("online, shared", gpus, ranks)]
    if gpus >= 2:
        serve = len(p.extract.online_gpus) if p.extract.online_gpus else gpus // 2
        out.append((f"online, split {serve} serve / {gpus - serve} train", serve, min(ranks, gpus - serve)))
    return out


def mode_plan(p: Params, plans: dict, gpus: int, memory: bool = True) -> list:
    """One dict per layout: hours, disk, and per GPU the server's and the trainer's memory with a
    verdict (memory: False leaves the memory model out, no torch import). plans: {"offline": plan,
    "online": plan} of this profile in either extract.mode (plan.capacity_plan); on a CPU profile
    (gpus 0) offline and online on the CPU."""
    off, on = plans["offline"], plans["online"]
    ranks_planned = train_ranks(p)
    gpu_gb, util = gpu_memory_budget(p.train), p.target.gpu_memory_utilization
    out = []
    for name, serve, ranks in layouts(p, gpus):
        row = {"layout": name, "serving_gpus": serve, "training_ranks": ranks, "server_gb_per_gpu": None,
               "weights_gb_per_gpu": None}
        if name == "offline":
            seconds = stage_seconds(off, "extract") + stage_seconds(off, "train")
            row["basis"] = "03 (prefill, cache writes, hashes, verification) + 04 reading the cache"
            row["disk_bytes"] = off["cache_bytes"]
        else:
            served = served_seconds(on)
            trainer = stage_seconds(on, "train") - served
            if name == "online, shared":                    # the same GPUs serve and train in turn
                seconds = stage_seconds(on, "extract") + trainer + served
                row["basis"] = "03 caches the held-out split; 04's training + the server's prefill every epoch"
            else:                                           # side by side: the slower side bounds
                seconds = stage_seconds(on, "extract") + max(trainer * ranks_planned / ranks,
                                                             served_seconds(on, prefill_scale=gpus / serve))
                row["basis"] = (f"the slower of training on {ranks} rank(s) and the server on {serve} GPU(s), "
                                "scaled from the all-GPU rates (its connector writes do not scale)")
            row["disk_bytes"] = on["cache_bytes"] + staging_bound_bytes(on["hidden_size"], p.train.batch_tokens,
                                                                       p.train.num_workers, ranks)
            if gpus:
                row["server_gb_per_gpu"] = util * gpu_gb
                row["weights_gb_per_gpu"] = on["checkpoint_bytes"] / 1e9 / min(serve, p.target.tensor_parallel_size)
        row["hours"] = seconds / 3600
        peak = trainer_peak(p, ranks, plans[p.extract.mode].get("memory")) if gpus and memory else None
        row["trainer_peak_gb"] = None if peak is None else peak / 1e9
        row["trainer_budget_gb"] = None if not gpus else gpu_gb * (1 - util) if name == "online, shared" else gpu_gb
        # shared: the largest target.gpu_memory_utilization that leaves the trainer its peak and headroom
        row["server_share_max"] = (None if peak is None or name != "online, shared"
                                   else max(0.0, 1 - peak / (gpu_gb * 1e9 * (1 - HEADROOM))))
        if row["server_share_max"] is not None and row["server_share_max"] * gpu_gb < row["weights_gb_per_gpu"]:
            row["server_share_max"] = 0.0           # no share holds the weights and leaves the trainer room
        row["fits"] = None if peak is None else bool(peak <= row["trainer_budget_gb"] * 1e9 * (1 - HEADROOM) and (
            row["weights_gb_per_gpu"] is None or row["weights_gb_per_gpu"] <= row["server_gb_per_gpu"]))
        out.append(row)
    return out
