"""Training the EAGLE-3 drafter with training-time test (TTT) on the cached hidden states.

    summary = train(P, run_dir)        # reads <run>/hidden/{train,eval}, <run>/data/vocab.safetensors

Per optimizer step: length-bucketed micro-batches (padded, up to train.batch_tokens tokens) from
the memory-mapped HiddenCache; the drafter unrolls ttt_steps steps in parallel
(Eagle3Drafter.ttt_hidden); the loss is the soft cross-entropy against the target's own
next-token distribution restricted to the draft vocabulary, computed on the fly from the cached
final state and the target's lm_head rows. Step j's loss is weighted decay**j.

Indices: step j at position t predicts token x_{t+2+j}; its soft label is the target's
distribution at u = t+1+j (the target at u predicts x_{u+1}). A (t, j) pair counts when the
predicted token x_{t+2+j} exists and is an assistant token (loss_mask[t+2+j]); padding has
loss_mask 0. Accuracy: argmax q mapped to target ids == argmax of the full target logits at u.

Checkpoints (safetensors: model + flattened optimizer state; JSON metadata: step, schedule, data
position, RNG) are written atomically (temp folder, then rename); `train.resume` continues from
the newest one and reaches the same weights as an uninterrupted run (the data order is a pure
function of seed, epoch and step). Under torchrun, `train.distributed` ddp / fsdp give every rank a
disjoint slice of each global batch; losses are normalised by global counts, so N ranks x 1
micro-batch compute the same update as 1 rank x N micro-batches.

Speed on the 2-core CPU (bench/train.py, SmolLM2 shapes, 256-token sequences, 7 TTT steps):
fp32 GEMM goes through MKL's slow path on this AMD CPU (~33 GFLOP/s per core vs ~140-230 for
bf16 through oneDNN), so `train.dtype: bfloat16` (autocast, fp32 master weights) is 2.5-4x faster
than float32; the "manual" TTT attention is the fastest formulation. When other processes share
the cores, run with OMP_WAIT_POLICY=PASSIVE (or 1 thread): OpenMP's spin-waiting made 2 threads
2.5x slower than 1.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .files import atomic_dir, atomic_write_json, read_json
from .model import Eagle3Config, Eagle3Drafter
from .params import Params, auto_dtype
from .target import load_target_tensors, target_path
from .vocab import draft_to_target_ids

CHECKPOINT_FILE = "checkpoint.safetensors"
KEEP_CHECKPOINTS = 2


# ==== target distribution and loss ===========================================================
@contextlib.contextmanager
def _bf16_inputs_fp32_matmul(enabled: bool):
    """Let oneDNN run fp32 matmuls on bf16 inputs with fp32 accumulation and output. Exact (up
    to summation order) when both operands hold bf16 values, and ~2x faster than MKL's fp32
    GEMM on this CPU. No-op when disabled or unavailable."""
    mk = getattr(torch.backends.mkldnn, "matmul", None)
    if not enabled or mk is None or not hasattr(mk, "fp32_precision"):
        yield
        return
    old = mk.fp32_precision
    mk.fp32_precision = "bf16"
    try:
        yield
    finally:
        mk.fp32_precision = old


class TargetHead:
    """The target's lm_head as the loss needs it: draft-vocab rows (soft labels) and the full
    head (top-1 for accuracy). lm_head [V, H] in the checkpoint's dtype, d2t [Dv]."""

    TOPK_RECHECK = 8

    def __init__(self, lm_head: torch.Tensor, d2t: torch.Tensor, chunk: int = 512,
                 scan_dtype: Optional[torch.dtype] = None):
        # The top-1 scan runs in bf16 where bf16 is native, else in fp32: emulated bf16 made the scan
        # 6x slower than fp32 on an AVX2-only CPU (NOTES.md, seventh session). The fp32 re-check
        # below makes the result exact either way.
        scan_dtype = scan_dtype or getattr(torch, auto_dtype())
        self.full = lm_head.contiguous()                                      # [V, H] checkpoint dtype
        self.full_scan = self.full.to(scan_dtype)                             # [V, H] for the top-1 scan
        self.draft_ids = draft_to_target_ids(d2t)                              # [Dv] target ids
        self.draft = self.full[self.draft_ids].float().contiguous()           # [Dv, H]
        self.head_is_bf16 = bool(torch.equal(self.draft, self.draft.bfloat16().float()))
        self.chunk = chunk

    def to(self, device) -> "TargetHead":
        for name in ("full", "full_scan", "draft", "draft_ids"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @torch.no_grad()
    def labels(self, final: torch.Tensor, exact_top1: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """final [N, H] (after the target's final norm) -> (p [N, Dv] fp32 = softmax over the
        draft rows, i.e. the full distribution restricted to the draft vocabulary and renormalised;
        top [N] = argmax target id over the FULL vocabulary).

        The top-1 scans the full head in bf16 where that is native (fast; else fp32), then re-scores the best TOPK_RECHECK
        candidates of every row exactly in fp32, so bf16 rounding of near-ties cannot flip it.
        exact_top1=False skips that scan (the most expensive part of a training step) and returns
        the argmax within the draft vocabulary instead: it differs only where the target's top-1
        lies outside the draft vocabulary (0.4% of train tokens on the local profile). Training
        steps use it for their logged accuracy; held-out evaluation always uses the exact top-1."""
        final = final.to(self.full.device)
        exact_inputs = self.head_is_bf16 and final.dtype == torch.bfloat16
        x = final.float()                                                     # [N, H]
        with _bf16_inputs_fp32_matmul(exact_inputs and x.device.type == "cpu"):
            p = torch.softmax(x @ self.draft.T, dim=-1)                       # [N, Dv]
        if not exact_top1:
            return p, self.draft_ids[p.argmax(-1)]
        tops = []
        for c in range(0, len(x), self.chunk):
            xc = x[c:c + self.chunk]                                          # [C, H]
            approx = xc.to(self.full_scan.dtype) @ self.full_scan.T           # [C, V] scan dtype
            cand = approx.topk(self.TOPK_RECHECK, dim=-1).indices             # [C, K]
            exact = (self.full[cand].float() * xc[:, None, :]).sum(-1)        # [C, K] fp32
            tops.append(cand.gather(1, exact.argmax(-1, keepdim=True)).squeeze(1))
        top = torch.cat(tops) if tops else torch.zeros(0, dtype=torch.long, device=x.device)
        return p, top


class LinearSoftCrossEntropy(torch.autograd.Function):
    """lm_head + soft cross-entropy in one autograd node.

    forward(rows [N, H], weight [Dv, H], p [M, Dv], p_index [N]) -> (loss_sum, argmax [N]):
        z = rows @ weight.T;  loss_sum = sum_n (logsumexp(z_n) - sum_v p[p_index[n], v] z_n,v)
    (= -sum_v p log softmax(z), as sum_v p = 1). The softmax runs in fp32 over row chunks that
    stay in cache; only dz = softmax(z) - p is kept for backward (in the logits' dtype: bf16
    under autocast), not z, log q and the gathered p.
    """

    CHUNK = 256

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, p_index: torch.Tensor):
        logits = rows @ weight.T                                                  # [N, Dv] (bf16 under autocast)
        dz = torch.empty_like(logits)
        loss = logits.new_zeros((), dtype=torch.float32)
        preds = []
        for a in range(0, logits.shape[0], LinearSoftCrossEntropy.CHUNK):
            z = logits[a:a + LinearSoftCrossEntropy.CHUNK].float()               # [C, Dv]
            pc = p[p_index[a:a + LinearSoftCrossEntropy.CHUNK]]                   # [C, Dv]
            m, best = z.max(-1, keepdim=True)                                     # [C, 1]
            preds.append(best.squeeze(-1))
            dot = torch.linalg.vecdot(pc, z)                                      # [C] sum_v p z
            z.sub_(m).exp_()
            total = z.sum(-1, keepdim=True)
            loss = loss + ((m + total.log()).squeeze(-1) - dot).sum()             # lse - sum p z
            dz[a:a + LinearSoftCrossEntropy.CHUNK] = z.div_(total).sub_(pc)      # softmax - p
        ctx.save_for_backward(rows, weight, dz)
        pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=rows.device)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_pred):
        rows, weight, dz = ctx.saved_tensors
        g = dz * grad_loss.to(dz.dtype)                                           # [N, Dv]
        grad_rows = (g @ weight.to(g.dtype)).to(rows.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (g.T @ rows.to(g.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_rows, grad_w, None, None


def target_positions(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [B, T] bool (False on padding) -> (b, u) [N] indices of the positions u whose
    target distribution is a label: the token u+1 exists and is an assistant token."""
    has_label = F.pad(loss_mask[:, 1:], (0, 1), value=False)                   # [B, T]: mask[u+1]
    return has_label.nonzero(as_tuple=True)


def step_counts(tgt_u: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """Number of counted (t, j) pairs per step: label position u needs t = u-1-j >= 0. [J] float."""
    return torch.stack([(tgt_u >= 1 + j).sum() for j in range(ttt_steps)]).double()


def ttt_loss(states: list, lm_head: nn.Module, d2t: torch.Tensor, batch: dict, denominators: torch.Tensor,
             decay: float, flags: bool = False) -> tuple:
    """Weighted TTT loss over the counted (t, j) pairs only.

    states: per step j, the drafter's final-normed states [B, T, H] (Eagle3Drafter.ttt_hidden).
    batch: tgt_b, tgt_u [N] (label positions), target_p [N, Dv], target_top [N].
    denominators [J]: what step j's summed loss is divided by (global over micro-batches/ranks).
    Returns (loss = sum_j decay**j * sum_loss_j / denominators[j], stats [J, 3] = per step
    (summed loss, correct top-1, count), detached). Uncounted positions are never gathered, so
    they add exactly zero to the loss and get exactly zero gradient.
    flags=True adds a third output, correct [N, J] bool: step j drafted from anchor t = u-1-j
    predicted label u's top-1 (False where that anchor does not exist); see replay_chain.
    """
    b, u = batch["tgt_b"], batch["tgt_u"]
    weight = lm_head.weight                                                    # [Dv, H]
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):   # cast once for all steps (and once back in backward)
        weight = weight.to(torch.get_autocast_dtype(device_type))
    total = states[0].new_zeros((), dtype=torch.float32)
    stats = []
    correct_flags = torch.zeros(len(u), len(states), dtype=torch.bool, device=u.device)    # [N, J]
    for j, s in enumerate(states):
        keep = (u >= 1 + j).nonzero().squeeze(-1)                              # t = u-1-j exists
        rows = s[b[keep], u[keep] - 1 - j]                                     # [N_j, H]
        loss_sum, pred = LinearSoftCrossEntropy.apply(rows, weight, batch["target_p"], keep)
        total = total + (decay ** j) * loss_sum / denominators[j].to(loss_sum.dtype)
        hit = (pred + d2t[pred]) == batch["target_top"][keep]                   # [N_j]
        correct_flags[keep, j] = hit
        correct = hit.sum()
        stats.append(torch.stack([loss_sum.detach().double(), correct.double(),
                                  torch.tensor(float(len(keep)), dtype=torch.float64, device=correct.device)]))
    if flags:
        return total, torch.stack(stats), correct_flags
    return total, torch.stack(stats)


def acceptance_estimate(acc: list) -> float:
    """Expected accepted length from per-step accuracies: 1 + sum_j prod_{i<=j} acc_i."""
    out, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        out += prod
    return out


class TTTObjective(nn.Module):
    """The drafter plus the loss, so that DDP / FSDP wrap one module whose forward runs it all."""

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, decay: float, compile: bool = False):
        super().__init__()
        self.drafter, self.ttt_steps, self.decay = drafter, ttt_steps, decay
        # torch.compile of the unrolled TTT forward (dynamic shapes: one compilation serves every
        # batch shape). Only the training pass uses it; evaluation (no_grad) stays eager, which
        # spares a second compilation.
        self.compiled_ttt = torch.compile(drafter.ttt_hidden, dynamic=True) if compile else None

    def forward(self, batch: dict, denominators: torch.Tensor, flags: bool = False):
        ttt = self.compiled_ttt if self.compiled_ttt is not None and torch.is_grad_enabled() \
            else self.drafter.ttt_hidden
        states = ttt(batch["aux"], batch["input_ids"], self.ttt_steps)
        return ttt_loss(states, self.drafter.lm_head, self.drafter.d2t, batch, denominators, self.decay, flags)


def replay_chain(u: torch.Tensor, correct: torch.Tensor, k: int,
                 max_answer_tokens: Optional[int] = None) -> tuple[int, int]:
    """Replay chain speculative decoding (k drafts per round, T=0) on one sequence's first answer,
    from teacher-forced flags; returns (rounds, accepted drafts).

    u [N]: the sequence's label positions, ascending; correct [N, J] bool from ttt_loss(flags=True).
    The first answer is the first contiguous run of labels u0, u0+1, ... (token u0+1 is its first
    token, which the prefill emits). A round anchored at t (target states up to t, token t+1 known)
    drafts labels t+1 .. t+k and accepts while step j's flag at label t+1+j holds; it then emits
    accepted + 1 tokens, so the next round is anchored at t + accepted + 1. The first round is
    anchored at u0. With the answer's tokens equal to the target's greedy tokens (regenerated data)
    this is what decoding does, except that decoding stops at max_new_tokens
    (max_answer_tokens here) and k <= J (ttt_steps) is required.
    """
    J = correct.shape[1]
    if not 1 <= k <= J:
        raise ValueError(f"k={k}: replay needs 1 <= k <= ttt_steps ({J})")
    u = u.tolist()
    if not u:
        return 0, 0
    end = 0
    while end + 1 < len(u) and u[end + 1] == u[end] + 1:                     # first contiguous run
        end += 1
    u0, last = u[0], u[end]
    limit = last if max_answer_tokens is None else min(last, u0 + max_answer_tokens - 1)
    flag = correct[:end + 1].tolist()                                        # flag[label - u0][j]
    rounds = accepted = 0
    t = u0
    while t + 1 <= limit:
        n = 0
        while n < k and t + 1 + n <= limit and flag[t + 1 + n - u0][n]:
            n += 1
        rounds, accepted = rounds + 1, accepted + n
        t += n + 1
    return rounds, accepted


# ==== data =====================================================================================
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


def prepare_batch(batch: dict, head: TargetHead, ttt_steps: int, device,
                  scale: Optional[torch.Tensor] = None, exact_top1: bool = True,
                  all_positions: bool = False) -> dict:
    """Add the labels (target_p, target_top at the label positions) and the per-step counts.
    scale [3, H] (see aux_scale): the batch's aux is divided by it (fp32), see
    TrainParams.fc_input_scaling.
    exact_top1: see TargetHead.labels.
    all_positions: label every real token, not only assistant ones (TrainParams.label_positions)."""
    mask = batch["loss_mask"]                                                  # [B, T]
    if all_positions:
        mask = torch.arange(mask.shape[1])[None, :] < batch["lengths"][:, None]
    b, u = target_positions(mask)
    p, top = head.labels(batch["final"][b, u], exact_top1=exact_top1)
    aux = batch["aux"] if scale is None else batch["aux"].float() / scale
    out = {"input_ids": batch["input_ids"].to(device), "aux": aux.to(device),
           "tgt_b": b.to(device), "tgt_u": u.to(device), "target_p": p, "target_top": top}
    out["counts"] = step_counts(u, ttt_steps)                                 # [J] (cpu)
    out["tokens"] = float(batch["lengths"].sum())
    return out


def add_feature_noise(prepared: dict, std: float, scale: Optional[torch.Tensor], seed: int, step: int) -> dict:
    """Training-only regulariser (TrainParams.feature_noise): aux += std * s * N(0, 1), where s [3, H]
    is the aux scale (1 when the batch is already aux / s). The noise is a function of (seed, step)
    only, so a resumed run draws the same noise. Returns a new dict; `prepared` is not modified."""
    if std <= 0:
        return prepared
    aux = prepared["aux"]                                                      # [B, T, 3, H] fp32
    gen = torch.Generator(device=aux.device).manual_seed(seed * 1_000_003 + step)
    noise = torch.randn(aux.shape, generator=gen, dtype=torch.float32, device=aux.device) * std  # [B, T, 3, H]
    if scale is not None:
        noise = noise * scale.to(noise.device, noise.dtype)
    return {**prepared, "aux": (aux.float() + noise).to(aux.dtype)}


# ==== schedule, optimizer =======================================================================
def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total` steps."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def make_optimizers_for(model: nn.Module, t) -> list:
    """AdamW on everything trainable; with train.optimizer == "muon", torch.optim.Muon on the
    2-D weights of fc and the decoder layer (lm_head, norms stay on AdamW). t: TrainParams."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if t.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError("train.optimizer: muon needs torch.optim.Muon (torch >= 2.9)")
        is_muon = lambda n, p: p.dim() == 2 and ("midlayer." in n or n.endswith("fc.weight"))
        muon = [p for n, p in named if is_muon(n, p)]
        rest = [p for n, p in named if not is_muon(n, p)]
        return [torch.optim.Muon(muon, lr=t.lr, weight_decay=t.weight_decay, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))]
    return [torch.optim.AdamW([p for _, p in named], lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))]


# ==== distributed ==============================================================================
class Dist:
    """rank / world / helpers; a single process when not launched by torchrun."""

    def __init__(self, mode: str):
        import torch.distributed as dist
        self.dist = dist
        self.mode = mode
        self.launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        self.created = False
        if self.launched and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
            self.created = True
        self.rank = dist.get_rank() if self.launched else 0
        self.world = dist.get_world_size() if self.launched else 1
        if self.world > 1 and mode == "none":
            raise RuntimeError("launched under torchrun with several processes but train.distributed is none; "
                               "set train.distributed to ddp or fsdp")

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            x = x.clone()
            self.dist.all_reduce(x)
        return x

    def broadcast_flag(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        self.dist.broadcast(t, src=0)
        return bool(t.item())

    def barrier(self):
        if self.world > 1:
            self.dist.barrier()

    def close(self):
        if self.created:
            self.dist.destroy_process_group()


def wrap_model(objective: TTTObjective, mode: str, dist: Dist) -> nn.Module:
    if dist.world == 1:
        return objective
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(objective)
    if mode == "fsdp":  # one FSDP unit: the drafter is one layer; params and optimizer state are sharded
        from torch.distributed.fsdp import fully_shard
        return fully_shard(objective)
    raise ValueError(mode)


def no_sync(model: nn.Module, last: bool):
    """Skip gradient synchronisation on all but the last micro-batch of a step."""
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):                        # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):     # FSDP2
        @contextlib.contextmanager
        def ctx():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return ctx()
    return contextlib.nullcontext()


# ==== checkpoints ==============================================================================
def _full_state(model: nn.Module, optimizers: list) -> tuple[dict, dict]:
    """(model state, optimizer state {"state": {fqn: {key: tensor}}, "param_groups": [...]}),
    full tensors on CPU (gathered under FSDP), keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizers, options=opts)


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizers: list, meta: dict, dist: Dist) -> Optional[Path]:
    """checkpoints/step-XXXXXX/checkpoint.safetensors, written in a temp folder and renamed.
    Tensors: model.<name>, optim.<param name>.<state key> (e.g. exp_avg, step), rng.torch;
    metadata["eagle3lab"]: JSON with the step, data position, history and optimizer param_groups."""
    from safetensors.torch import save_file
    model_sd, optim_sd = _full_state(model, optimizers)
    if dist.rank != 0:
        return None
    tensors = {f"model.{k}": v.contiguous() for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            tensors[f"optim.{name}.{key}"] = torch.as_tensor(value).contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    meta = {**meta, "step": step, "param_groups": optim_sd["param_groups"]}
    final = ckpt_root / f"step-{step:06d}"
    with atomic_dir(final) as tmp:
        save_file(tensors, str(tmp / CHECKPOINT_FILE), metadata={"eagle3lab": json.dumps(meta, default=str)})
    for old in sorted(ckpt_root.glob("step-*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_root.glob(".step-*"):             # temp folders of killed runs (atomic_dir)
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Optional[Path]:
    done = sorted(p for p in ckpt_root.glob("step-*") if (p / CHECKPOINT_FILE).is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, model: nn.Module, optimizers: list) -> dict:
    """Restore model, optimizer and RNG from a checkpoint folder; returns its metadata."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
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
    return meta


def save_final(out_dir: Path, drafter_state: dict, config: Eagle3Config, extra: dict) -> None:
    """final/: model.safetensors (vLLM parameter names, without the frozen embed_tokens) and
    config.json = asdict(Eagle3Config); written in a temp folder, then renamed."""
    from safetensors.torch import save_file
    state = {k: v.detach().cpu().contiguous() for k, v in drafter_state.items() if not k.startswith("embed_tokens")}
    with atomic_dir(out_dir) as tmp:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
        (tmp / "training.json").write_text(json.dumps(extra, indent=2, default=str) + "\n")


# ==== evaluation ===============================================================================
@torch.no_grad()
def evaluate(model: nn.Module, batches: list, ttt_steps: int, amp, max_answer_tokens: Optional[int] = None) -> dict:
    """Per-step soft-CE loss, top-1 accuracy and the acceptance estimate on prepared batches, and
    `acceptance_replayed`: chain decoding with k = ttt_steps replayed on each sequence's first
    answer (replay_chain), which counts acceptance where decoding measures it."""
    was_training = model.training
    model.eval()
    stats = torch.zeros(ttt_steps, 3, dtype=torch.float64)
    rounds = accepted = 0
    for batch in batches:
        with amp():
            _, s, correct = model(batch, torch.ones(ttt_steps, dtype=torch.float64), flags=True)
        stats += s.cpu()
        b, u, correct = batch["tgt_b"].cpu(), batch["tgt_u"].cpu(), correct.cpu()
        for row in b.unique().tolist():
            sel = b == row
            r, a = replay_chain(u[sel], correct[sel], ttt_steps, max_answer_tokens)
            rounds, accepted = rounds + r, accepted + a
    model.train(was_training)
    n = stats[:, 2].clamp(min=1)
    acc = (stats[:, 1] / n).tolist()
    return {"loss": (stats[:, 0] / n).tolist(), "acc": acc, "acceptance_estimate": acceptance_estimate(acc),
            "acceptance_replayed": 1.0 + accepted / max(1, rounds), "replay_rounds": rounds,
            "positions": stats[:, 2].tolist()}


def heldout_batches(eval_cache, sequences: int, head: TargetHead, ttt_steps: int, batch_tokens: int, device,
                    scale: Optional[torch.Tensor] = None) -> list:
    """The first `sequences` held-out cache items (of >= 3 tokens) as prepared batches with exact
    full-vocabulary top-1 labels, in a fixed order."""
    idx = [i for i in range(min(sequences, len(eval_cache))) if eval_cache.lengths[i] >= 3]
    batches = []
    for chunk in bucket_batches([eval_cache.lengths[i] for i in idx], batch_tokens, 0, 0):
        items = [eval_cache.get(idx[k]) for k in sorted(chunk)]
        batches.append(prepare_batch(collate(items, batch_tokens), head, ttt_steps, device, scale))
    return batches


# ==== the training loop ========================================================================
# Train fields that may change between a run and its resumption (they do not change the math).
RESUMABLE_CHANGES = {"resume", "time_budget_minutes", "checkpoint_every", "eval_sequences", "tracking",
                     "compile", "max_steps", "epochs", "nproc", "distributed"}


def training_identity(P: Params) -> str:
    """Hash of what determines the weights (train fields except RESUMABLE_CHANGES, seed, data,
    extraction): a checkpoint made under another identity is not resumed."""
    import hashlib
    train = {k: v for k, v in asdict(P.train).items() if k not in RESUMABLE_CHANGES}
    blob = json.dumps({"train": train, "data": P.section_hash("data", "extract")}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def optimizer_step(model: nn.Module, optimizers: list, prepared: list, t, dist: Dist, amp) -> tuple:
    """One optimizer step over this rank's prepared micro-batches (see prepare_batch).
    Losses are normalised by GLOBAL counts (all micro-batches of all ranks), so the update equals
    the one of a single process holding the whole global batch. Returns (loss, per-step stats
    [J, 3] summed over ranks, grad norm before clipping, global real tokens). A non-finite loss
    is returned without touching the weights."""
    J = t.ttt_steps
    counts = dist.all_sum(torch.stack([sum(b["counts"] for b in prepared),
                                       torch.full((J,), sum(b["tokens"] for b in prepared), dtype=torch.float64)]))
    denom = (counts[0] if t.loss_average == "masked" else counts[1]).clamp(min=1)
    device = prepared[0]["input_ids"].device
    stats = torch.zeros(J, 3, dtype=torch.float64)
    for i, batch in enumerate(prepared):
        with no_sync(model, last=i == len(prepared) - 1), amp():
            loss, s = model(batch, denom.to(device))
            # DDP / FSDP average gradients over ranks; the loss is already the global mean
            (loss * dist.world).backward()
        stats += s.cpu()
    stats = dist.all_sum(stats)
    loss_value = float(sum((t.decay ** j) * stats[j, 0] / denom[j] for j in range(J)))
    if not math.isfinite(loss_value):
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        return loss_value, stats, float("nan"), float(counts[1, 0])
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
    for o in optimizers:
        o.step()
        o.zero_grad(set_to_none=True)
    return loss_value, stats, grad_norm, float(counts[1, 0])


def init_from_target_layer(drafter: Eagle3Drafter, target_dir: Path, layer: int,
                           scale: Optional[torch.Tensor] = None) -> None:
    """Start the drafter from a pretrained target layer instead of noise (TrainParams.init_from_layer):

    - q/k/v: the HIDDEN half of the 2H input ([embedding; hidden]) gets the target layer's
      q/k/v; the embedding half keeps its random init;
    - o_proj, mlp, hidden_norm (= the layer's input_layernorm), post_attention_layernorm and the
      final norm are the target's;
    - fc passes the highest aux state through: g = a_high (with fc_input_scaling, fc sees
      a / s, so the diagonal is s_high).
    At step 0 the drafter then starts as "target layer `layer` applied to a_high" and only has
    to learn the shift by one token and the use of the embedding."""
    from .target import load_target_layer
    w = load_target_layer(target_dir, layer)
    H = drafter.config.hidden_size
    m = drafter.midlayer
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(m.self_attn, name).weight                         # [out, 2H]
            if proj[:, H:].shape != w[name].shape:
                raise ValueError(f"init_from_layer: target {name} {tuple(w[name].shape)} does not fit the "
                                 f"drafter's {tuple(proj[:, H:].shape)}")
            proj[:, H:] = w[name].float()
        m.self_attn.o_proj.weight.copy_(w["o_proj"].float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m.mlp, name).weight.copy_(w[name].float())
        m.hidden_norm.weight.copy_(w["input_layernorm"].float())
        m.post_attention_layernorm.weight.copy_(w["post_attention_layernorm"].float())
        drafter.norm.weight.copy_(w["final_norm"].float())
        if not drafter.config.norm_before_fc:
            diag = torch.ones(H) if scale is None else scale[-1].float()         # [H]
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, 2 * H:] = torch.diag(diag)


def build_drafter(P: Params, target_dir: Path, hidden_size: int, aux_layers: list, d2t, t2d,
                  scale: Optional[torch.Tensor] = None) -> Eagle3Drafter:
    t = P.train
    hf = read_json(Path(target_dir) / "config.json")   # plain JSON: no transformers import needed
    config = Eagle3Config.from_target_config(
        hf, d2t.numel(), aux_layers, norm_before_residual=t.norm_before_residual,
        norm_before_fc=t.norm_before_fc, next_step_hidden=t.next_step_hidden)
    if config.hidden_size != hidden_size:
        raise ValueError(f"hidden cache has H={hidden_size}, the target {target_dir} has H={config.hidden_size}")
    torch.manual_seed(P.seed)
    w = load_target_tensors(target_dir)
    drafter = Eagle3Drafter.from_target_weights(config, d2t, t2d, w["embed"], w["lm_head"] if t.init_lm_head else None)
    if t.init_from_layer is not None:
        hf_layers = (hf.get("text_config") or hf)["num_hidden_layers"]
        layer = t.init_from_layer % hf_layers
        init_from_target_layer(drafter, target_dir, layer, scale)
    if t.freeze_lm_head:
        drafter.lm_head.weight.requires_grad_(False)
    return drafter


def train(P: Params, run_dir, progress: bool = True, callback: Optional[Callable] = None) -> dict:
    """Train (or resume) the drafter of run `run_dir`; returns a summary dict.

    callback(record) is called on rank 0 after every optimizer step with the step's record
    (step, lr, loss, per-step loss/acc, tokens/s, and `eval` when an eval ran at that step)."""
    from .extract import HiddenCache
    from .vocab import load_vocab

    t = P.train
    run_dir = Path(run_dir)
    out_root = run_dir / "train"
    dist = Dist(t.distributed)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        # ---- data, target head, model
        cache = HiddenCache(run_dir / "hidden" / "train")
        eval_path = run_dir / "hidden" / "eval"
        eval_cache = HiddenCache(eval_path) if (eval_path / "manifest.json").is_file() else None
        d2t, t2d = load_vocab(run_dir / "data" / "vocab.safetensors")
        tdir = target_path(P)
        scale = aux_scale(cache) if t.fc_input_scaling else None                # [3, H] or None
        # noise is in units of s: the batch already holds aux / s when fc_input_scaling is on
        noise_scale = aux_scale(cache) if t.feature_noise > 0 and not t.fc_input_scaling else None
        drafter = build_drafter(P, tdir, cache.hidden_size, cache.aux_layers, d2t, t2d, scale).to(device)
        head = TargetHead(load_target_tensors(tdir, ("lm_head",))["lm_head"], d2t).to(device)
        objective = TTTObjective(drafter, t.ttt_steps, t.decay, compile=t.compile)
        model = wrap_model(objective, t.distributed, dist)
        optimizers = make_optimizers_for(model, t)
        amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if t.dtype == "bfloat16" \
            else contextlib.nullcontext

        # ---- schedule over global batches
        usable = [i for i, n in enumerate(cache.lengths) if n >= 3]
        per_step = dist.world * t.grad_accum                           # micro-batches per optimizer step
        lengths = [cache.lengths[i] for i in usable]
        steps_per_epoch = len(bucket_batches(lengths, t.batch_tokens, P.seed, 0)) // per_step
        if steps_per_epoch == 0:
            raise ValueError(f"{len(usable)} usable training sequences make fewer micro-batches than one "
                             f"optimizer step needs ({per_step} = ranks x grad_accum); lower train.batch_tokens")
        total_steps = t.max_steps or max(1, math.ceil(t.epochs * steps_per_epoch))

        def set_lr(step_now: int) -> float:
            lr = t.lr * lr_factor(step_now, t.warmup_steps, total_steps, t.min_lr_ratio)
            for o in optimizers:
                for g in o.param_groups:
                    g["lr"] = lr
            return lr

        # ---- resume
        ckpt_root = out_root / "checkpoints"
        step, history = 0, []
        ckpt = latest_checkpoint(ckpt_root) if t.resume else None
        if not t.resume and dist.rank == 0 and ckpt_root.exists():
            shutil.rmtree(ckpt_root)
        dist.barrier()
        if ckpt is not None:
            meta = load_checkpoint(ckpt, model, optimizers)
            if meta["total_steps"] != total_steps or meta["world_batch"] != per_step:
                raise RuntimeError(f"{ckpt} was made with another schedule ({meta['total_steps']} steps, "
                                   f"{meta['world_batch']} micro-batches/step; now {total_steps}, {per_step}); "
                                   "set train.resume: false to start over")
            if meta["identity"] != training_identity(P):
                raise RuntimeError(f"{ckpt} was made with other train/data params (only "
                                   f"{sorted(RESUMABLE_CHANGES)} may change between resumptions); "
                                   "set train.resume: false to start over, or use another run name")
            step, history = meta["step"], meta.get("history", [])
        if progress and dist.rank == 0 and ckpt is not None:
            print(f"resumed from {ckpt} (step {step}/{total_steps})")

        eval_batches = [] if eval_cache is None else \
            heldout_batches(eval_cache, t.eval_sequences, head, t.ttt_steps, t.batch_tokens, device, scale)

        tracker = None
        if t.tracking == "tensorboard" and dist.rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("train.tracking: tensorboard needs `pip install tensorboard`") from e
            tracker = SummaryWriter(str(out_root / "tensorboard"))

        def meta_for(step_done):
            return {"total_steps": total_steps, "world_batch": per_step, "epoch": step_done // steps_per_epoch,
                    "position_in_epoch": step_done % steps_per_epoch, "history": history,
                    "identity": training_identity(P), "config": asdict(drafter.config)}

        # ---- loop
        from tqdm.auto import tqdm
        bar = tqdm(total=total_steps, initial=step, desc="train", disable=not (progress and dist.rank == 0))
        t0, tokens_seen, stopped_by = time.time(), 0.0, "steps"
        epoch_batches: dict = {}
        model.train()
        while step < total_steps:
            epoch, pos = divmod(step, steps_per_epoch)
            if epoch not in epoch_batches:
                epoch_batches = {epoch: bucket_batches(lengths, t.batch_tokens, P.seed, epoch)}
            global_mbs = epoch_batches[epoch][pos * per_step:(pos + 1) * per_step]
            mine = global_mbs[dist.rank::dist.world]                   # disjoint slice per rank
            prepared = [prepare_batch(collate([cache.get(usable[k]) for k in mb], t.batch_tokens), head,
                                      t.ttt_steps, device, scale, exact_top1=False,
                                      all_positions=t.label_positions == "all") for mb in mine]
            if t.feature_noise > 0:                                    # after the labels: they stay exact
                prepared = [add_feature_noise(b, t.feature_noise, noise_scale,
                                              P.seed * 1009 + dist.rank * 101 + i, step)
                            for i, b in enumerate(prepared)]
            lr = set_lr(step)
            loss_value, stats, grad_norm, tokens = optimizer_step(model, optimizers, prepared, t, dist, amp)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"train step {step}: loss is {loss_value} (non-finite); lower "
                                         f"train.lr or use train.dtype float32 (last checkpoint: {latest_checkpoint(ckpt_root)})")
            step += 1
            tokens_seen += tokens
            n = stats[:, 2].clamp(min=1)
            record = {"step": step, "lr": lr, "loss": loss_value, "grad_norm": grad_norm,
                      "step_loss": (stats[:, 0] / n).tolist(), "step_acc": (stats[:, 1] / n).tolist(),
                      "tokens_per_s": tokens_seen / max(1e-9, time.time() - t0)}
            out_of_time = t.time_budget_minutes is not None and time.time() - t0 > 60 * t.time_budget_minutes
            out_of_time = dist.broadcast_flag(out_of_time)
            last = step == total_steps or out_of_time
            if eval_batches and (step % t.checkpoint_every == 0 or last):
                record["eval"] = evaluate(model, eval_batches, t.ttt_steps, amp)
            history.append(record)
            if step % t.checkpoint_every == 0 or last:
                save_checkpoint(ckpt_root, step, model, optimizers, meta_for(step), dist)
            if dist.rank == 0:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", acc0=f"{record['step_acc'][0]:.3f}")
                if tracker is not None:
                    tracker.add_scalar("train/loss", loss_value, step)
                    tracker.add_scalar("train/lr", lr, step)
                    for j in range(t.ttt_steps):
                        tracker.add_scalar(f"train/acc_step{j}", record["step_acc"][j], step)
                        if "eval" in record:
                            tracker.add_scalar(f"eval/acc_step{j}", record["eval"]["acc"][j], step)
                if callback is not None:
                    callback(record)
            if out_of_time and step < total_steps:
                stopped_by = "time_budget"
                break
        bar.close()
        if tracker is not None:
            tracker.close()

        # ---- final drafter and summary
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        drafter_state = {k[len("drafter."):]: v for k, v in full.items() if k.startswith("drafter.")}
        evals = [r for r in history if "eval" in r]
        summary = {"steps": step, "total_steps": total_steps, "stopped_by": stopped_by,
                   "steps_per_epoch": steps_per_epoch, "epochs_done": step / steps_per_epoch,
                   "world_size": dist.world, "train_sequences": len(usable),
                   "final_loss": history[-1]["loss"] if history else None,
                   "train_step_acc": history[-1]["step_acc"] if history else None,
                   "eval": evals[-1]["eval"] if evals else None,
                   "tokens_per_s_this_run": tokens_seen / max(1e-9, time.time() - t0),
                   "checkpoint": str(latest_checkpoint(ckpt_root)), "final_dir": str(out_root / "final")}
        if dist.rank == 0:
            # final/ computes fc(aux) on raw aux (the full state exists on rank 0 only)
            save_final(out_root / "final", fold_aux_scale(drafter_state, scale), drafter.config, summary)
            atomic_write_json(out_root / "summary.json", summary)
            atomic_write_json(out_root / "history.json", history)
        dist.barrier()
        return summary
    finally:
        dist.close()


# ==== command line (the entry point for torchrun) ==============================================
def torchrun_command(params_path, run_name: Optional[str], nproc: int) -> list:
    """The command that trains run `run_name` with `nproc` processes on this machine:
    torchrun --standalone --nproc-per-node N -m eagle3lib.train --params P [--run-name R]."""
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "eagle3lib.train", "--params", str(params_path)]
    return cmd + (["--run-name", run_name] if run_name else [])


def main(argv=None) -> int:
    import argparse
    from .params import load_params
    ap = argparse.ArgumentParser(prog="python -m eagle3lib.train", description="train the EAGLE-3 drafter "
                                 "(under torchrun for train.distributed ddp / fsdp)")
    ap.add_argument("--params", required=True)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    P = load_params(a.params)
    summary = train(P, P.run_dir(a.run_name), progress=not a.no_progress)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
