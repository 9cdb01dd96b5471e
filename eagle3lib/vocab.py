"""The draft vocabulary: the target tokens the drafter's lm_head can propose.

Count target-token frequencies over the assistant (loss-masked) tokens of the training set and
keep the `draft_vocab_size` most frequent, ties broken by the smaller token id, sorted by target id:
- `d2t[i] = target_id(i) - i` (int64, [Dv]): target id = i + d2t[i];
- `t2d[v]` (bool, [V]): whether target token v is in the draft vocabulary.

If fewer distinct tokens than `draft_vocab_size` were seen, the remaining slots go to unseen ids in
increasing id order (they all have count 0, so the tie rule picks the smallest ids); sizes are
therefore always exact. A draft vocabulary as large as the target's gives d2t = 0, t2d = True.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors.torch import load_file, save

from .files import atomic_write_bytes


def count_assistant_tokens(sequences: Iterable[tuple[Sequence[int], Sequence[int]]],
                           vocab_size: int) -> torch.Tensor:
    """Frequencies of target tokens where the loss mask is 1.

    sequences: iterable of (input_ids [T], loss_mask [T]). Returns int64 counts [V].
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in sequences:
        ids = torch.as_tensor(input_ids, dtype=torch.int64)       # [T]
        mask = torch.as_tensor(loss_mask, dtype=torch.bool)       # [T]
        picked = ids[mask]
        if picked.numel() and int(picked.max()) >= vocab_size:
            raise ValueError(f"token id {int(picked.max())} >= target vocab size {vocab_size}")
        counts += torch.bincount(picked, minlength=vocab_size)
    return counts


def ranked_token_ids(counts: torch.Tensor) -> torch.Tensor:
    """All token ids [V], most frequent first, ties broken by the smaller id."""
    ids = torch.arange(counts.numel(), dtype=torch.int64)
    # A stable sort on -count keeps the id order inside every tie.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    return ids[order]


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Dv], t2d bool [V]) from token counts [V]."""
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size}")
    kept = torch.sort(ranked_token_ids(counts)[:draft_vocab_size]).values  # [Dv] target ids, ascending
    return vocab_of(kept, vocab_size)


def vocab_of(kept: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Dv], t2d bool [V]) of the draft vocabulary made of target ids `kept` [Dv] (ascending)."""
    d2t = kept - torch.arange(kept.numel(), dtype=torch.int64)            # [Dv]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)                       # [V]
    t2d[kept] = True
    return d2t, t2d


def shrink_draft_vocab(d2t: torch.Tensor, counts: torch.Tensor,
                       size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A smaller draft vocabulary inside an existing one, for a trained drafter's head.

    Keeps the `size` most frequent (counts [V]) of the draft vocabulary's target tokens, ties broken
    by the smaller id, like build_draft_vocab. Returns (rows int64 [size]: the kept draft ids,
    ascending, i.e. the lm_head rows to keep; d2t int64 [size]; t2d bool [V]). A head cut to these
    rows proposes the same token as the full head wherever the full head's argmax is kept."""
    if not 1 <= size <= d2t.numel():
        raise ValueError(f"draft vocabulary size {size} must be in 1..{d2t.numel()} (the drafter's draft vocabulary)")
    target_ids = draft_to_target_ids(d2t)                                  # [Dv], ascending
    # Draft ids ranked by their tokens' counts; ties go to the smaller draft id, i.e. the smaller target id.
    rows = torch.sort(ranked_token_ids(counts[target_ids])[:size]).values  # [size] draft ids, ascending
    return (rows, *vocab_of(target_ids[rows], counts.numel()))


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: i + d2t[i] ([Dv] int64)."""
    return torch.arange(d2t.numel(), dtype=torch.int64) + d2t


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted (assistant) tokens whose id is in the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def coverage_curve(counts: torch.Tensor, sizes: Iterable[int]) -> dict[int, float]:
    """Coverage of the top-k vocabulary for every k in `sizes` (k capped at V)."""
    total = int(counts.sum())
    sorted_counts = torch.sort(counts.to(torch.int64), descending=True).values
    cumulative = torch.cumsum(sorted_counts, 0)  # [V]
    out = {}
    for k in sizes:
        k = int(min(k, counts.numel()))
        out[k] = float(cumulative[k - 1]) / total if total and k >= 1 else 0.0
    return out


def save_vocab(path: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write d2t (int64) and t2d (bool) to a safetensors file (atomic)."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"d2t must be a 1-D int64 tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be a 1-D bool tensor, got {t2d.dtype} {tuple(t2d.shape)}")
    atomic_write_bytes(path, save({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}))


def load_vocab(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Dv], t2d bool [V]) from a file written by save_vocab, checked for consistency."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no draft vocabulary (run data.prepare_data first)")
    tensors = load_file(str(path))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    target_ids = draft_to_target_ids(d2t)
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all()):
        raise ValueError(f"{path}: d2t and t2d disagree")
    return d2t, t2d
