"""What the drafter learns and how it is scored: the target's soft labels, the fused soft
cross-entropy (or an LK loss, train.loss), the training-time-test (TTT) loss, held-out evaluation and the
acceptance numbers.

    scoring = build_scoring(params, layout, drafter, device)   # head, objective, autocast, aux scale
    batch = prepare_batch(collate(items, max_len), scoring.head, ttt_steps, device, scoring.scale)
    loss, stats = scoring.objective(batch, denominators)       # stats [J, 3]: loss sum, correct, count
    heldout_scores(scoring.objective, scoring.heldout(cache, 32, batch_tokens, device), ttt_steps, scoring.amp)

Indices: step j at position t predicts token x_{t+2+j}; its soft label is the target's
distribution at u = t+1+j (the target at u predicts x_{u+1}), restricted to the draft vocabulary
and renormalised, computed on the fly from the cached final state and the target's lm_head rows.
A (t, j) pair counts when the predicted token x_{t+2+j} exists and is an assistant token
(loss_mask[t+2+j]); padding has loss_mask 0. Step j's loss is weighted decay**j. Accuracy: argmax q
mapped to target ids == argmax of the full target logits at u.

Shapes: B batch, T padded length, H hidden size, V target vocab, Dv draft vocab, J ttt_steps,
N label positions in a batch.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batches import bucket_batches, collate
from .layout import RunLayout
from .model import Eagle3Drafter
from .params import Params, auto_dtype
from .target import load_target_tensors, target_path
from .vocab import draft_to_target_ids, load_vocab


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
        # 6x slower than fp32 on an AVX2-only CPU (NOTES.md, Decisions: Threads and dtype). The fp32 re-check
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

        The top-1 scans the full head in bf16 where that is native (fast; else fp32), then re-scores
        the best TOPK_RECHECK candidates of every row exactly in fp32, so bf16 rounding of near-ties cannot flip it.
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


class LinearAcceptanceLoss(torch.autograd.Function):
    """lm_head + an LK loss (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
    Speculative Decoding", arXiv 2602.23881) in one autograd node, chunked like LinearSoftCrossEntropy.

    forward(rows [N, H], weight [Dv, H], p [M, Dv], p_index [N], kind, eta) -> (loss_sum, ce_sum, argmax [N]).
    Per row n, with p = p[p_index[n]] (the target's distribution restricted to the draft vocabulary and
    renormalised), q = softmax(z_n), z_n = rows[n] @ weight.T, and the acceptance rate (the chance that
    speculative sampling accepts a token drafted from q when the target samples from p)
        alpha = sum_v min(p_v, q_v) = 1 - TV(p, q):
      kind "lk":        l = -log(max(alpha, LOG_EPS))
      kind "lk_hybrid": l = lam * KL(p || q) + (1 - lam) * (1 - alpha),  lam = exp(-eta * sg[alpha])
                        (sg: no gradient through the weight; KL(p||q) = soft CE - sum_v p log p)
    These are vllm-project/speculators' `neg_log_acceptance_loss` (same eps) and `lk_hybrid_loss`
    (per-position blend, eta = 3.0 there, "the paper's best hybrid setting"). SpecForge's
    lk_loss_type "alpha" is the same -log(alpha) per position; its "lambda" blends batch means
    (lam = kl_scale * exp(-kl_decay * mean alpha), kl_decay = 1), which is not what is done here.
    loss_sum = sum_n l. ce_sum = sum_n (logsumexp(z_n) - sum_v p z_n,v), the soft cross-entropy
    of LinearSoftCrossEntropy computed with the same operations (the per-step stats keep reporting
    it, so logs, the divergence guard and held-out losses stay comparable across loss choices);
    it carries no gradient. Sums run in fp32 (bf16 logits under autocast; fp64 inputs stay fp64).

    Gradient w.r.t. z_n (m_v = [q_v < p_v], the subgradient of min that picks p at ties;
    S = sum_v m_v q_v):  d alpha / dz_k = q_k (m_k - S), so
      lk:        dz = -(q * (m - S)) / alpha   (0 where alpha < LOG_EPS: the clamp's gradient)
      lk_hybrid: dz = lam * (q - p) - (1 - lam) * q * (m - S)
    As in LinearSoftCrossEntropy only dz [N, Dv] (the logits' dtype) is kept for backward; the
    extra per-chunk work is a few elementwise passes over [C, Dv].
    """

    CHUNK = 256
    LOG_EPS = 1e-5
    KINDS = ("lk", "lk_hybrid")

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, p_index: torch.Tensor,
                kind: str, eta: float):
        if kind not in LinearAcceptanceLoss.KINDS:
            raise ValueError(f"LinearAcceptanceLoss: unknown kind {kind!r} (known: {LinearAcceptanceLoss.KINDS})")
        C = LinearAcceptanceLoss.CHUNK
        logits = rows @ weight.T                                                  # [N, Dv] (bf16 under autocast)
        dtype = torch.promote_types(logits.dtype, torch.float32)                  # fp32 (fp64 for gradcheck)
        dz = torch.empty_like(logits)
        loss = logits.new_zeros((), dtype=dtype)
        ce = logits.new_zeros((), dtype=dtype)
        preds = []
        for a in range(0, logits.shape[0], C):
            z = logits[a:a + C].to(dtype)                                         # [C, Dv]
            pc = p[p_index[a:a + C]]                                              # [C, Dv]
            m, best = z.max(-1, keepdim=True)                                     # [C, 1]
            preds.append(best.squeeze(-1))
            dot = torch.linalg.vecdot(pc, z)                                      # [C] sum_v p z
            z.sub_(m).exp_()
            total = z.sum(-1, keepdim=True)
            ce_rows = (m + total.log()).squeeze(-1) - dot                         # [C] soft CE
            ce = ce + ce_rows.sum()
            q = z.div_(total)                                                     # [C, Dv] softmax
            below = q < pc                                                        # [C, Dv] m_v
            alpha = torch.where(below, q, pc).sum(-1, keepdim=True)               # [C, 1] sum min(p, q)
            s = (q * below).sum(-1, keepdim=True)                                 # [C, 1] S
            dalpha = q * (below.to(q.dtype) - s)                                  # [C, Dv] d alpha / dz
            if kind == "lk":
                safe = alpha >= LinearAcceptanceLoss.LOG_EPS                      # [C, 1]
                loss = loss - alpha.clamp(min=LinearAcceptanceLoss.LOG_EPS).log().sum()
                dz[a:a + C] = torch.where(safe, -dalpha / alpha, torch.zeros_like(dalpha))
            else:
                lam = torch.exp(-eta * alpha)                                     # [C, 1]
                kl = ce_rows[:, None] + torch.special.xlogy(pc, pc).sum(-1, keepdim=True)   # [C, 1]
                loss = loss + (lam * kl + (1 - lam) * (1 - alpha)).sum()
                dz[a:a + C] = lam * (q - pc) - (1 - lam) * dalpha
        ctx.save_for_backward(rows, weight, dz)
        pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=rows.device)
        ctx.mark_non_differentiable(ce, pred)
        return loss, ce, pred

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_ce, _grad_pred):
        grad_rows, grad_w, _, _ = LinearSoftCrossEntropy.backward(ctx, grad_loss, _grad_pred)
        return grad_rows, grad_w, None, None, None, None


LOSS_CHOICES = ("kl",) + LinearAcceptanceLoss.KINDS     # TrainParams.loss


def linear_loss(rows: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, p_index: torch.Tensor,
                loss: str = "kl", lk_eta: float = 3.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step's summed loss -> (loss_sum (differentiable), soft-CE sum (detached), argmax [N]).
    loss "kl" is LinearSoftCrossEntropy (today's soft cross-entropy, unchanged), else LinearAcceptanceLoss."""
    if loss == "kl":
        loss_sum, pred = LinearSoftCrossEntropy.apply(rows, weight, p, p_index)
        return loss_sum, loss_sum.detach(), pred
    return LinearAcceptanceLoss.apply(rows, weight, p, p_index, loss, lk_eta)


def target_positions(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [B, T] bool (False on padding) -> (b, u) [N] indices of the positions u whose
    target distribution is a label: the token u+1 exists and is an assistant token."""
    has_label = F.pad(loss_mask[:, 1:], (0, 1), value=False)                   # [B, T]: mask[u+1]
    return has_label.nonzero(as_tuple=True)


def step_counts(tgt_u: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """Number of counted (t, j) pairs per step: label position u needs t = u-1-j >= 0. [J] float."""
    return torch.stack([(tgt_u >= 1 + j).sum() for j in range(ttt_steps)]).double()


def ttt_loss(states: list, lm_head: nn.Module, d2t: torch.Tensor, batch: dict, denominators: torch.Tensor,
             decay: float, flags: bool = False, loss: str = "kl", lk_eta: float = 3.0) -> tuple:
    """Weighted TTT loss over the counted (t, j) pairs only.

    states: per step j, the drafter's final-normed states [B, T, H] (Eagle3Drafter.ttt_hidden).
    batch: tgt_b, tgt_u [N] (label positions), target_p [N, Dv], target_top [N].
    denominators [J]: what step j's summed loss is divided by (global over micro-batches/ranks).
    Returns (loss = sum_j decay**j * sum_loss_j / denominators[j], stats [J, 3] = per step
    (summed loss, correct top-1, count), detached). Uncounted positions are never gathered, so
    they add exactly zero to the loss and get exactly zero gradient.
    flags=True adds a third output, correct [N, J] bool: step j drafted from anchor t = u-1-j
    predicted label u's top-1 (False where that anchor does not exist); see replay_chain.
    loss: what is minimised per position, "kl" (soft cross-entropy) | "lk" | "lk_hybrid" (see
    LinearAcceptanceLoss; lk_eta is the hybrid's eta). The stats' summed loss is the soft
    cross-entropy for every choice (for "kl" it is the minimised loss itself).
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
        loss_sum, ce_sum, pred = linear_loss(rows, weight, batch["target_p"], keep, loss, lk_eta)
        total = total + (decay ** j) * loss_sum / denominators[j].to(loss_sum.dtype)
        hit = (pred + d2t[pred]) == batch["target_top"][keep]                   # [N_j]
        correct_flags[keep, j] = hit
        correct = hit.sum()
        stats.append(torch.stack([ce_sum.double(), correct.double(),
                                  torch.tensor(float(len(keep)), dtype=torch.float64, device=correct.device)]))
    if flags:
        return total, torch.stack(stats), correct_flags
    return total, torch.stack(stats)


def unigram_share(cache, n: int) -> tuple[float, int]:
    """(share of the most frequent answer token, positions) over the first n sequences of `cache`
    from position 2 on (what step 0 scores): the accuracy of always proposing that one token. 04
    checks that the drafter beats it (a drafter that learned nothing usable does not)."""
    counts = Counter()
    for i in range(min(n, len(cache))):
        item = cache.tokens(i)                     # ids and mask only (an online split asks no server)
        counts.update(item["input_ids"][2:][item["loss_mask"][2:].bool()].tolist())
    total = sum(counts.values())
    return (max(counts.values()) / total if total else 0.0), total


def acceptance_estimate(acc: list) -> float:
    """Expected accepted length from per-step accuracies: 1 + sum_j prod_{i<=j} acc_i."""
    out, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        out += prod
    return out


class TTTObjective(nn.Module):
    """The drafter plus the loss, so that DDP / FSDP wrap one module whose forward runs it all."""

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, decay: float, compile: bool = False,
                 loss: str = "kl", lk_eta: float = 3.0):
        super().__init__()
        if loss not in LOSS_CHOICES:
            raise ValueError(f"TTTObjective: loss {loss!r} is not one of {LOSS_CHOICES} (train.loss)")
        self.drafter, self.ttt_steps, self.decay = drafter, ttt_steps, decay
        self.loss, self.lk_eta = loss, lk_eta              # see ttt_loss / TrainParams.loss
        # torch.compile of the unrolled TTT forward (dynamic shapes: one compilation serves every
        # batch shape). Only the training pass uses it; evaluation (no_grad) stays eager, which
        # spares a second compilation.
        self.compiled_ttt = torch.compile(drafter.ttt_hidden, dynamic=True) if compile else None

    def forward(self, batch: dict, denominators: torch.Tensor, flags: bool = False):
        ttt = self.compiled_ttt if self.compiled_ttt is not None and torch.is_grad_enabled() \
            else self.drafter.ttt_hidden
        states = ttt(batch["aux"], batch["input_ids"], self.ttt_steps)
        return ttt_loss(states, self.drafter.lm_head, self.drafter.d2t, batch, denominators, self.decay, flags,
                        self.loss, self.lk_eta)


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



# ==== batches: labels, noise, held-out set ===================================================
def prepare_batch(batch: dict, head: TargetHead, ttt_steps: int, device,
                  scale: Optional[torch.Tensor] = None, exact_top1: bool = True,
                  all_positions: bool = False) -> dict:
    """Add the labels (target_p, target_top at the label positions, on the head's device) and the
    per-step counts; input_ids and aux go to `device` (asynchronously from pinned memory).
    scale [3, H] (see aux_scale): aux is divided by it (fp32) on `device`, see
    TrainParams.fc_input_scaling.
    exact_top1: see TargetHead.labels.
    all_positions: label every real token, not only assistant ones (TrainParams.label_positions)."""
    mask = batch["loss_mask"]                                                  # [B, T]
    if all_positions:
        mask = torch.arange(mask.shape[1])[None, :] < batch["lengths"][:, None]
    b, u = target_positions(mask)
    p, top = head.labels(batch["final"][b, u], exact_top1=exact_top1)
    aux = batch["aux"].to(device, non_blocking=True)                           # [B, T, 3, H] cache dtype
    if scale is not None:
        aux = aux.float() / scale.to(aux.device)
    out = {"input_ids": batch["input_ids"].to(device, non_blocking=True), "aux": aux,
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



# ==== held-out evaluation ======================================================================
@torch.no_grad()
def heldout_scores(model: nn.Module, batches: list, ttt_steps: int, amp, max_answer_tokens: Optional[int] = None,
                   reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   decode_k: Optional[int] = None) -> dict:
    """Per-step soft-CE loss, top-1 accuracy and the acceptance estimate on prepared batches, and
    `acceptance_replayed`: chain decoding with k = ttt_steps replayed on each sequence's first
    answer (replay_chain), which counts acceptance where decoding measures it; with decode_k (the
    k that 05 decodes with, at most ttt_steps) also `acceptance_replayed_decode_k`, replayed at that
    k: the figure 05's vLLM acceptance is compared with.
    reduce: sums a CPU tensor over torchrun ranks, when each rank holds a share of the held-out
    set (heldout_batches with rank / world); batches marked "filler" run the model (every rank
    runs as many forwards) and are not counted."""
    was_training = model.training
    model.eval()
    stats = torch.zeros(ttt_steps, 3, dtype=torch.float64)
    replay_k = ttt_steps if decode_k is None else decode_k
    rounds = accepted = rounds_k = accepted_k = 0
    for batch in batches:
        with amp():
            _, s, correct = model(batch, torch.ones(ttt_steps, dtype=torch.float64), flags=True)
        if batch.get("filler"):
            continue
        stats += s.cpu()
        b, u, correct = batch["tgt_b"].cpu(), batch["tgt_u"].cpu(), correct.cpu()
        for row in b.unique().tolist():
            sel = b == row
            r, a = replay_chain(u[sel], correct[sel], ttt_steps, max_answer_tokens)
            rounds, accepted = rounds + r, accepted + a
            if replay_k != ttt_steps:                      # else the replay above is the one at 05's k
                r, a = replay_chain(u[sel], correct[sel], replay_k, max_answer_tokens)
            rounds_k, accepted_k = rounds_k + r, accepted_k + a
    model.train(was_training)
    if reduce is not None:
        stats = reduce(stats)
        counts = reduce(torch.tensor([rounds, accepted, rounds_k, accepted_k], dtype=torch.int64))
        rounds, accepted, rounds_k, accepted_k = (int(x) for x in counts)
    n = stats[:, 2].clamp(min=1)
    acc = (stats[:, 1] / n).tolist()
    return {"loss": (stats[:, 0] / n).tolist(), "acc": acc, "acceptance_estimate": acceptance_estimate(acc),
            "acceptance_replayed": 1.0 + accepted / max(1, rounds), "replay_rounds": rounds,
            "positions": stats[:, 2].tolist(),
            **({} if decode_k is None else {"decode_k": decode_k,
                                            "acceptance_replayed_decode_k": 1.0 + accepted_k / max(1, rounds_k)})}


class HeldOutBatches:
    """Prepared held-out batches kept on the CPU; iterating moves one batch at a time to `device`
    (at Kimi shapes the whole set in fp32 is ~100 GB: it must not sit on every GPU). Under torchrun
    each rank holds its share and also yields `filler` batches (marked "filler": not counted) so
    that every rank runs `forwards` forwards: DDP and FSDP forwards are collectives."""

    def __init__(self, batches: list, device, forwards: Optional[int] = None, filler: Optional[dict] = None):
        self.batches, self.device, self.filler = batches, torch.device(device), filler
        self.forwards = len(batches) if forwards is None else forwards

    def __len__(self) -> int:
        return self.forwards

    def __iter__(self):
        missing = self.forwards - len(self.batches)
        fillers = [{**self.filler, "filler": True}] * missing if missing > 0 else []
        for batch in self.batches + fillers:
            yield {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}


def heldout_batches(eval_cache, sequences: int, head: TargetHead, ttt_steps: int, batch_tokens: int, device,
                    scale: Optional[torch.Tensor] = None, rank: int = 0, world: int = 1) -> HeldOutBatches:
    """The first `sequences` held-out cache items (of >= 3 tokens) as prepared batches with exact
    full-vocabulary top-1 labels, in a fixed order; held on the CPU, moved to `device` one at a time
    (labels are computed with the head on its device, then brought back).
    rank / world: this rank prepares only batches rank, rank + world, ... (1/world of the set); a
    rank with fewer than the most also gets a filler (one of its batches, or batch 0 when it has
    none) so that all ranks run the same number of forwards. heldout_scores(..., reduce=sum over ranks)
    then gives the numbers of one process holding every batch."""
    idx = [i for i in range(min(sequences, len(eval_cache))) if eval_cache.lengths[i] >= 3]
    chunks = bucket_batches([eval_cache.lengths[i] for i in idx], batch_tokens, 0, 0)

    def prepare(chunk) -> dict:
        items = [eval_cache.get(idx[k]) for k in sorted(chunk)]
        prepared = prepare_batch(collate(items, batch_tokens), head, ttt_steps, device, scale)
        return {k: v.to("cpu") if torch.is_tensor(v) else v for k, v in prepared.items()}

    batches = [prepare(chunk) for chunk in chunks[rank::world]]
    forwards = math.ceil(len(chunks) / world)
    filler = None
    if len(batches) < forwards:
        filler = batches[0] if batches else prepare(chunks[0])
    return HeldOutBatches(batches, device, forwards, filler)


# ==== one run's scoring: what train() and the bench scripts share ============================
def autocast_for(dtype: str, device) -> Callable[[], contextlib.AbstractContextManager]:
    """train.dtype -> a factory of the context every forward runs in: bf16 autocast (fp32 master
    weights) for "bfloat16", nothing for "float32"."""
    device_type = torch.device(device).type
    if dtype == "bfloat16":
        return lambda: torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@dataclass
class Scoring:
    """What a run learns against and how it is scored: the target head (labels), the objective
    (drafter + TTT loss, the module that DDP / FSDP wrap), the autocast context, and the aux scale s
    [3, H] the batches are divided by (None: raw aux)."""
    head: TargetHead
    objective: TTTObjective
    amp: Callable
    scale: Optional[torch.Tensor]

    def heldout(self, cache, sequences: int, batch_tokens: int, device, rank: int = 0,
                world: int = 1) -> HeldOutBatches:
        """The first `sequences` items of a cache as prepared batches (exact labels) on the CPU,
        moved to `device` one at a time; rank / world: this rank's share; see heldout_batches."""
        return heldout_batches(cache, sequences, self.head, self.objective.ttt_steps, batch_tokens, device,
                               self.scale, rank, world)


def build_scoring(params: Params, layout: RunLayout, drafter: Eagle3Drafter, device, ttt_steps: Optional[int] = None,
                  scale: Optional[torch.Tensor] = None, compile: bool = False) -> Scoring:
    """The scoring of run `layout` for `drafter` (already on `device`): the target's lm_head with the
    run's draft vocabulary, TTTObjective(drafter, ttt_steps (default train.ttt_steps), train.decay,
    train.loss, train.lk_eta) and train.dtype's autocast. scale: see batches.aux_scale (None for a
    drafter with s folded in)."""
    d2t, _ = load_vocab(layout.vocab)
    head = TargetHead(load_target_tensors(target_path(params), ("lm_head",))["lm_head"], d2t).to(device)
    objective = TTTObjective(drafter, ttt_steps or params.train.ttt_steps, params.train.decay, compile=compile,
                             loss=params.train.loss, lk_eta=params.train.lk_eta)
    return Scoring(head, objective, autocast_for(params.train.dtype, device), scale)

