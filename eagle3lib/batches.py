"""Feeding the trainer from the hidden-state cache: length-bucketed micro-batches, padding, the
DataLoader that reads and collates them ahead of the step, and the per-dimension scale of the aux
states (train.fc_input_scaling) with its folding into fc.

    for mb in bucket_batches(cache.lengths, batch_tokens, seed, epoch):   # lists of sequence indices
        batch = collate([cache.get(i) for i in mb], batch_tokens)         # padded tensors, see collate
    loader = micro_batch_loader(cache, usable, schedule, rank, world, start_step, workers, pin)
    batch = next(iter(loader))        # this rank's next micro-batch, collated (in a worker process)
    s = aux_scale(cache)                                                  # [3, H]; fc trains on aux / s
    final_state = fold_aux_scale(trained_state, s)                        # the same function on raw aux
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

# Micro-batches each DataLoader worker holds ahead of the step (DataLoader's prefetch_factor); the
# planners (mode_plan's staging bound, preflight's /dev/shm need) read it from here.
PREFETCH_FACTOR = 2


def bucket_batches(lengths: list, batch_tokens: int, seed: int, epoch: int) -> list:
    """Length-bucketed micro-batches of sequence indices, each with B * max_len <= batch_tokens.
    A pure function of (lengths, batch_tokens, seed, epoch): sequences are sorted by length
    (ties in a seeded random order), packed greedily, then the batch order is shuffled."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    tiebreak = torch.randperm(len(lengths), generator=g).tolist()
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], tiebreak[i]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = min(lengths[i], batch_tokens)
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[k] for k in perm]


def collate(items: list, max_len: int) -> dict:
    """Right-pad cache items: input_ids [B, T] long, loss_mask [B, T] bool, aux [B, T, 3, H],
    final [B, T, H] (cache dtype), lengths [B]. Sequences are cut at max_len."""
    lengths = [min(len(it["input_ids"]), max_len) for it in items]
    T, B = max(lengths), len(items)
    H = items[0]["final"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, *items[0]["aux"].shape[1:], dtype=items[0]["aux"].dtype)
    final = torch.zeros(B, T, H, dtype=items[0]["final"].dtype)
    for k, (it, n) in enumerate(zip(items, lengths)):
        ids[k, :n] = it["input_ids"][:n]
        mask[k, :n] = it["loss_mask"][:n].bool()
        aux[k, :n] = it["aux"][:n]
        final[k, :n] = it["final"][:n]
    return {"input_ids": ids, "loss_mask": mask, "aux": aux, "final": final, "lengths": torch.tensor(lengths)}


# ==== the input pipeline ========================================================================
@dataclass(frozen=True)
class Schedule:
    """What fixes the order of the micro-batches: the usable sequences' lengths, the token budget,
    the seed, micro-batches per optimizer step (ranks x grad_accum), steps per epoch and in total."""
    lengths: tuple
    batch_tokens: int
    seed: int
    per_step: int
    steps_per_epoch: int
    total_steps: int


class CacheSequences(Dataset):
    """Item k = the k-th usable sequence of a HiddenCache (cache.get(usable[k]))."""

    def __init__(self, cache, usable: list):
        self.cache, self.usable = cache, usable

    def __len__(self) -> int:
        return len(self.usable)

    def __getitem__(self, k: int) -> dict:
        return self.cache.get(self.usable[k])

    def __getitems__(self, ks: list) -> list:
        """A micro-batch's items at once (the DataLoader's batched fetch): an online cache sends
        their requests together."""
        if hasattr(self.cache, "get_many"):
            return self.cache.get_many([self.usable[k] for k in ks])
        return [self.cache.get(self.usable[k]) for k in ks]


class StepSampler(Sampler):
    """This rank's micro-batches (lists of CacheSequences indices) from optimizer step `start` to
    the end of the schedule, grad_accum per step: step s of epoch e = s // steps_per_epoch takes
    micro-batches [pos * per_step, (pos + 1) * per_step) of bucket_batches(lengths, batch_tokens,
    seed, e), and rank r of `world` the r-th, (r + world)-th, ... of them. A pure function of
    (seed, epoch, step), so a resumed run reads exactly what the interrupted one would have."""

    def __init__(self, schedule: Schedule, rank: int, world: int, start: int):
        self.s, self.rank, self.world, self.start = schedule, rank, world, start

    def __len__(self) -> int:
        return (self.s.total_steps - self.start) * (self.s.per_step // self.world)

    def __iter__(self) -> Iterator[list]:
        s, epoch, order = self.s, None, []
        for step in range(self.start, s.total_steps):
            if step // s.steps_per_epoch != epoch:
                epoch = step // s.steps_per_epoch
                order = bucket_batches(list(s.lengths), s.batch_tokens, s.seed, epoch)
            pos = step % s.steps_per_epoch
            yield from order[pos * s.per_step:(pos + 1) * s.per_step][self.rank::self.world]


def micro_batch_loader(cache, usable: list, schedule: Schedule, rank: int, world: int, start: int,
                       workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """A DataLoader of this rank's collated micro-batches (see collate) from step `start` on:
    `workers` processes read the memory-mapped cache and pad ahead of the step (PREFETCH_FACTOR
    batches each; online, mode_plan.staging_bound_bytes counts them); pin_memory (CUDA) lets the
    host-to-device copies run asynchronously."""
    return DataLoader(CacheSequences(cache, usable), batch_sampler=StepSampler(schedule, rank, world, start),
                      collate_fn=partial(collate, max_len=schedule.batch_tokens), num_workers=workers,
                      pin_memory=pin_memory, prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
                      persistent_workers=False)


def aux_scale(cache, max_tokens: int = 16384) -> torch.Tensor:
    """Robust per-dimension scale s [3, H] (fp32) of the cached aux states: median |x| / 0.6745
    (the std of a Gaussian) over the first `max_tokens` tokens of the cache (fewer for wide
    targets: at most 64M values, 2.9k tokens at H=7168), floored at 1e-3 of
    the layer's median scale. Deterministic: a function of the cache only, so a resumed run
    recomputes the same s. The median ignores the few attention-sink positions whose values are
    thousands of times the rest."""
    rows, n = [], 0
    for i in range(len(cache)):
        a = cache.get(i)["aux"]                                               # [n_i, 3, H]
        if not rows:
            max_tokens = max(1, min(max_tokens, (64 << 20) // a[0].numel()))  # a[0]: 3H values
        a = a[: max_tokens - n].float()
        rows.append(a)
        n += len(a)
        if n >= max_tokens:
            break
    if not rows:
        raise ValueError("aux_scale: the hidden-state cache is empty")
    a = torch.cat(rows)                                                       # [N, 3, H]
    s = a.abs().median(dim=0).values / 0.6745                                 # [3, H]
    floor = 1e-3 * s.median(dim=-1, keepdim=True).values.clamp(min=1e-6)      # [3, 1]
    return torch.maximum(s, floor).contiguous()


def fold_aux_scale(state: dict, scale: Optional[torch.Tensor]) -> dict:
    """Drafter state trained on aux / s -> the same function on raw aux: fc.weight[:, d] / s[d]."""
    if scale is None:
        return state
    w = state["fc.weight"]                                                    # [H, 3H]
    folded = (w.float() / scale.reshape(1, -1).to(w.device)).to(w.dtype)
    return {**state, "fc.weight": folded}

