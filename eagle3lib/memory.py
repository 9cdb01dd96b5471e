"""Per-GPU memory of one training step, for any profile, before anything runs.

    est = estimate(params, seq_len=4096)     # MemoryEstimate: items (bytes, measured or assumed), peak
    print(format_estimate(est))
    check_fits(params)                       # ParamsError naming the parameter when it cannot fit
    python -m eagle3lib.memory --params params/b300.yaml --seq 2048 4096

Two kinds of figure, each marked:
- measured (meta): the REAL drafter and loss (TTTObjective over Eagle3Drafter.ttt_hidden, built from
  the profile's params, so whatever attention formulation / checkpointing the params select) run
  forward and backward on the meta device: no data, no memory, seconds at Kimi shapes. Saved
  activations are the unique storages handed to autograd's saved-tensor hooks; the step's live peak
  is tracked op by op (a storage counts from the op that creates it until nothing refers to it).
- assumed (formula): what the trainer holds outside one step, from parameter counts and the
  sharding it is meant to use on a GPU box (FSDP2 over train.nproc ranks): fp32 master weights,
  fp32 gradients and AdamW's two fp32 moments, all sharded; the frozen target embedding in bf16,
  sharded; bf16 copies of the gathered FSDP units as parallel.shard_objective lays them out (the
  decoder layer and the drafter's own unit, final norm + lm_head, stay gathered through all TTT
  steps; the embedding or fc is gathered on top while it computes); the unsharded bf16 gradient of
  the largest trainable unit before its reduce-scatter; the target head the loss uses
  (objective.TargetHead) on every rank.

How the meta run stands in for the GPU (meta has no autocast and runs every attention through the
math path, which materialises T x T scores in fp32):
- compute dtype: parameters are cast to train.dtype, as FSDP2's MixedPrecisionPolicy(param_dtype)
  does; no autocast. RMSNorm still computes in fp32, the loss's softmax too.
- F.scaled_dot_product_attention is routed (patched for the run) to the kernel the
  training device would pick: on CUDA flash attention (bf16/fp16, no mask) or memory-efficient
  attention (a mask, or fp32); on CPU the CPU flash kernel. Those kernels save q, k, v, out and a
  logsumexp [B, h, T], never the scores.
- label positions: every position but the last of each sequence gets a soft label (the upper bound;
  train.label_positions "assistant" labels fewer), and every TTT step keeps all of them (nonzero on
  the meta device returns all rows: at most B x ttt_steps rows too many of N).
- torch.compile (train.compile) is not applied: the eager graph is what is measured.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import model as model_lib
from .model import Eagle3Config, Eagle3Drafter
from .objective import TTTObjective
from .params import Params, ParamsError, gpu_memory_budget, load_params

GiB = 1024 ** 3
GB = 1e9
MEASURED = "measured (meta)"
ASSUMED = "assumed (formula)"
HEADROOM = 0.20          # a profile must leave this fraction of the GPU's memory (params.gpu_memory_budget) free
# The parameters that move the peak, in the order a user would try them (named in refusals).
REMEDIES = ("train.batch_tokens (fewer tokens per micro-batch; it holds at least one data.max_length sequence, "
            "so lower data.max_length with it)",
            "train.activation_checkpointing (recompute each TTT step in backward)",
            "train.attention (a formulation that never materialises T x T scores)",
            "train.nproc (more ranks share the parameters and optimizer state)")


@dataclass
class MemoryItem:
    name: str
    bytes: int
    basis: str            # MEASURED or ASSUMED
    note: str = ""


@dataclass
class MemoryEstimate:
    """Per-GPU memory of one micro-batch of `batch_tokens` tokens as `sequences` x `seq_len`."""
    seq_len: int
    batch_tokens: int
    sequences: int
    device: str                     # the device whose kernels were emulated: cuda | cpu
    ranks: int
    trainable_params: int
    items: list = field(default_factory=list)
    step_peak: int = 0              # measured: live bytes created by the step at its worst moment

    def item(self, name: str) -> MemoryItem:
        return next(i for i in self.items if i.name == name)

    @property
    def static_bytes(self) -> int:
        """Everything held across steps (formula items and the batch)."""
        return sum(i.bytes for i in self.items if i.name not in STEP_ITEMS)

    @property
    def peak_bytes(self) -> int:
        """Peak estimate: the static part plus the step's measured live peak (saved activations,
        the loss's buffers, activation gradients and transient workspaces at their worst moment)."""
        return self.static_bytes + self.step_peak

    def as_dict(self) -> dict:
        return {"seq_len": self.seq_len, "batch_tokens": self.batch_tokens, "sequences": self.sequences,
                "device": self.device, "ranks": self.ranks, "trainable_params": self.trainable_params,
                "items": [vars(i) for i in self.items], "step_peak": self.step_peak,
                "peak_bytes": self.peak_bytes}


SAVED_DRAFTER = "saved for backward: drafter (TTT unroll)"
SAVED_LOSS = "saved for backward: loss (rows + dz per step)"
STEP_ITEMS = (SAVED_DRAFTER, SAVED_LOSS)   # parts of step_peak, listed for information


# ==== the drafter the profile trains, on the meta device =======================================
def training_device(params: Params) -> str:
    """The device a profile trains on, as the capacity plan reads it: cuda when it asks for CUDA."""
    return "cuda" if params.extract.device == "cuda" else "cpu"


def drafter_config(params: Params) -> Eagle3Config:
    """The drafter's config from the profile's target shape (no checkpoint needed)."""
    shape = params.target_shape()
    if shape is None:
        raise ParamsError("target.shape: the memory model needs the target's shape; set target.shape")
    train_params = params.train
    return Eagle3Config.from_target_config(
        shape, params.data.draft_vocab_size, params.aux_layer_ids(),
        norm_before_residual=train_params.norm_before_residual, norm_before_fc=train_params.norm_before_fc,
        next_step_hidden=train_params.next_step_hidden)


def meta_objective(params: Params, dtype: torch.dtype) -> TTTObjective:
    """The profile's drafter + TTT loss on the meta device, parameters in the compute dtype (what
    FSDP2's MixedPrecisionPolicy(param_dtype) gathers); buffers keep their dtypes."""
    with torch.device("meta"):
        drafter = Eagle3Drafter(drafter_config(params))
    for p in drafter.parameters():
        p.data = p.data.to(dtype)
    if params.train.freeze_lm_head:
        drafter.lm_head.weight.requires_grad_(False)
    # what the trainer selects for that device: train.attention, train.activation_checkpointing
    drafter.configure_training(params.train.attention, params.train.activation_checkpointing, training_device(params))
    return TTTObjective(drafter, params.train.ttt_steps, params.train.decay)


def meta_batch(params: Params, config: Eagle3Config, sequences: int, seq_len: int, device="meta") -> dict:
    """A prepared batch (objective.prepare_batch's keys) of `sequences` x `seq_len` tokens where every
    position but the last of each sequence has a soft label. aux is fp32 when train.fc_input_scaling
    divides it on the way in (prepare_batch), else the cache dtype."""
    B, T, H, Dv = sequences, seq_len, config.hidden_size, config.draft_vocab_size
    aux_dtype = torch.float32 if params.train.fc_input_scaling else getattr(torch, params.extract.dtype)
    tgt_b = torch.arange(B, device=device).repeat_interleave(T - 1)                        # [N]
    tgt_u = torch.arange(T - 1, device=device).repeat(B)                                   # [N]
    N = B * (T - 1)
    return {"input_ids": torch.zeros(B, T, dtype=torch.long, device=device),
            "aux": torch.zeros(B, T, 3, H, dtype=aux_dtype, device=device),
            "tgt_b": tgt_b, "tgt_u": tgt_u,
            "target_p": torch.zeros(N, Dv, dtype=torch.float32, device=device),
            "target_top": torch.zeros(N, dtype=torch.long, device=device)}


# ==== counting ===================================================================================
def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it); valid on the meta device, where data_ptr is 0."""
    return t.untyped_storage()._cdata


class SavedBytes:
    """saved_tensors_hooks that sum the bytes of the unique storages autograd keeps for backward,
    per phase (self.phase is set by the caller), skipping storages in `exclude` (parameters and
    the batch, counted elsewhere)."""

    def __init__(self, exclude: set):
        self.exclude, self.seen, self.by_phase, self.phase = set(exclude), set(), {}, "drafter"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.by_phase[self.phase] = self.by_phase.get(self.phase, 0) + t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created by the ops run under it, and their peak. On the meta
    device, aten.nonzero (a data-dependent shape) returns every row: see the module docstring."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}             # storage key -> (StorageWeakRef, nbytes)
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.nonzero.default and args[0].device.type == "meta":
            x = args[0]
            return torch.empty(x.numel(), x.dim(), dtype=torch.long, device="meta")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_key(t) not in self.live:
                storage = t.untyped_storage()
                self.live[storage_key(t)] = (StorageWeakRef(storage), storage.nbytes())
                self.now += storage.nbytes()
        if self.now > self.peak:      # a new peak only counts once freed storages are taken off
            for key, (ref, nbytes) in list(self.live.items()):
                if ref.expired():
                    del self.live[key]
                    self.now -= nbytes
            self.peak = max(self.peak, self.now)
        return out


class DeviceAttention:
    """Route F.scaled_dot_product_attention to the fused kernel `device` would run, so the meta
    device saves what that kernel saves (q, k, v, out, logsumexp), not the math path's scores.
    device "math": no routing (the meta device's own math path, which keeps fp32 scores).
    A patch of the function itself, not a TorchFunctionMode: modes are per thread, and activation
    checkpointing recomputes the step inside backward, where a mode would no longer route it."""

    def __init__(self, device: str):
        self.device = device
        self.real = F.scaled_dot_product_attention

    def __enter__(self):
        if self.device != "math":
            F.scaled_dot_product_attention = self.attention
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.real

    def attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if attn_mask is not None and attn_mask.dtype == torch.bool:   # as sdpa converts it
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~attn_mask, float("-inf"))
        aten = torch.ops.aten
        if self.device == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if attn_mask is None and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        bias = None if attn_mask is None else attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def flex_as_fused_kernel():
    """flex_attention refuses the meta device. During the meta run the causal part of the "flex"
    TTT attention (model._flex_causal) is served by the fused memory-efficient kernel, which saves
    what compiled flex saves (q, k, v, out, logsumexp; no T x T scores) and returns the same shapes."""
    real = model_lib._flex_causal

    def fused(q, k0, v0, mask_cache):
        if q.device.type != "meta":
            return real(q, k0, v0, mask_cache)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k0, v0, None, True, 0.0, True)[:2]
        return out, lse[..., :q.shape[2]].unsqueeze(-1).float()                # [B, h, T, d], [B, h, T, 1]

    model_lib._flex_causal = fused
    try:
        yield
    finally:
        model_lib._flex_causal = real


@contextlib.contextmanager
def meta_has_no_autocast():
    """torch.is_autocast_enabled("meta") raises (no autocast backend for meta); model.fuse and
    objective.ttt_loss ask it of their tensors' device. Answer False for meta during the meta run."""
    asked = torch.is_autocast_enabled

    def is_autocast_enabled(device_type=None):
        if device_type == "meta":
            return False
        return asked() if device_type is None else asked(device_type)

    torch.is_autocast_enabled = is_autocast_enabled
    try:
        yield
    finally:
        torch.is_autocast_enabled = asked


def run_step(objective: TTTObjective, batch: dict, device: str) -> tuple[dict, int]:
    """Forward + backward of the real objective on `batch`; -> (saved bytes per phase
    {"drafter", "loss"}, live peak of the bytes the step created). Parameter gradients are
    dropped as soon as they are accumulated (FSDP2 reduce-scatters and frees them per unit)."""
    drafter = objective.drafter
    weights = [p for p in objective.parameters()]
    exclude = {storage_key(t) for t in weights + [t for t in batch.values() if torch.is_tensor(t)]}
    saved = SavedBytes(exclude)
    handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
               for p in weights if p.requires_grad]
    unroll = drafter.ttt_hidden

    def ttt_hidden_then_loss(*args, **kwargs):      # everything after the unroll is the loss's
        saved.phase = "drafter"
        out = unroll(*args, **kwargs)
        saved.phase = "loss"
        return out

    drafter.ttt_hidden = ttt_hidden_then_loss      # instance attribute: TTTObjective calls it
    denominators = torch.ones(objective.ttt_steps, dtype=torch.float64, device=batch["aux"].device)
    live = LiveBytes()
    try:
        with meta_has_no_autocast(), flex_as_fused_kernel(), DeviceAttention(device), live, saved.hooks():
            loss, _ = objective(batch, denominators)
            loss.backward()
    finally:
        del drafter.ttt_hidden
        for h in handles:
            h.remove()
    return saved.by_phase, live.peak


# ==== the estimate ===============================================================================
def unit_sizes(drafter: Eagle3Drafter) -> dict:
    """Parameters per FSDP unit (the drafter's top-level modules, each later layer its own unit):
    name -> (count, trainable count)."""
    out = {}
    children = [(f"later_layers.{i}", m) for i, m in enumerate(drafter.later_layers)]
    children += [(name, m) for name, m in drafter.named_children() if name != "later_layers"]
    for name, module in children:
        ps = list(module.parameters())
        if ps:
            out[name] = (sum(p.numel() for p in ps), sum(p.numel() for p in ps if p.requires_grad))
    return out


# The FSDP2 units parallel.shard_objective gathers only while they compute (they reshard after each
# call); every other parameter (decoder layer, final norm, lm_head) stays gathered through the step.
TRANSIENT_UNITS = ("embed_tokens", "fc")


def gathered_parameters(units: dict) -> int:
    """Parameters gathered at the step's worst moment: the units held through all TTT steps plus
    the largest transient unit (units: unit_sizes())."""
    held = sum(total for name, (total, _) in units.items() if name not in TRANSIENT_UNITS)
    return held + max(units[name][0] for name in TRANSIENT_UNITS if name in units)


def state_items(params: Params, drafter: Eagle3Drafter, compute_bytes: int) -> list:
    """The formula items: sharded master weights, gradients, AdamW moments, the frozen embedding,
    gathered units, one unit's unsharded gradient, the target head."""
    n = params.train.nproc
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
    units = unit_sizes(drafter)
    gathered = gathered_parameters(units)
    largest_trainable = max(tr for _, tr in units.values())
    V, H, Dv = drafter.config.vocab_size, drafter.config.hidden_size, drafter.config.draft_vocab_size
    head_bytes = 2 if params.target.dtype in ("bfloat16", "float16", "auto") else 4
    shard = lambda x: math.ceil(x / n)
    return [
        MemoryItem("master weights (fp32, sharded)", 4 * shard(trainable), ASSUMED, f"{trainable:,} / {n} ranks"),
        MemoryItem("gradients (fp32, sharded)", 4 * shard(trainable), ASSUMED, "reduce dtype fp32"),
        MemoryItem("AdamW moments (2 x fp32, sharded)", 8 * shard(trainable), ASSUMED, ""),
        MemoryItem("frozen embedding (sharded)", compute_bytes * shard(frozen), ASSUMED,
                   f"{frozen:,} in the compute dtype"),
        MemoryItem("gathered units", compute_bytes * gathered, ASSUMED,
                   "decoder layer + norm/lm_head held through the TTT steps, + embedding or fc while it computes"),
        MemoryItem("unsharded gradient (largest unit)", compute_bytes * largest_trainable, ASSUMED,
                   "before its reduce-scatter"),
        MemoryItem("target head (TargetHead)", head_bytes * V * H + 4 * Dv * H, ASSUMED,
                   "full [V, H] in target.dtype + draft rows [Dv, H] fp32, every rank"),
    ]


def estimate(params: Params, seq_len: Optional[int] = None, batch_tokens: Optional[int] = None,
             device: Optional[str] = None) -> MemoryEstimate:
    """Per-GPU memory of one micro-batch (train.batch_tokens tokens as batch_tokens // seq_len
    sequences of seq_len, default data.max_length) for profile `params`; see the module docstring."""
    seq_len = seq_len or params.data.max_length
    batch_tokens = batch_tokens or params.train.batch_tokens
    device = device or training_device(params)
    if seq_len < 3 or batch_tokens < seq_len:
        raise ParamsError(f"train.batch_tokens: {batch_tokens} tokens hold no sequence of {seq_len} "
                          "(the memory model needs batch_tokens >= seq_len >= 3)")
    compute = torch.bfloat16 if params.train.dtype == "bfloat16" else torch.float32
    objective = meta_objective(params, compute)
    drafter = objective.drafter
    B = batch_tokens // seq_len
    batch = meta_batch(params, drafter.config, B, seq_len)
    saved, step_peak = run_step(objective, batch, device)
    est = MemoryEstimate(seq_len, batch_tokens, B, device, params.train.nproc,
                         sum(p.numel() for p in drafter.parameters() if p.requires_grad))
    est.items = state_items(params, drafter, compute.itemsize)
    est.items.append(MemoryItem("batch on the device", sum(t.untyped_storage().nbytes() for t in batch.values()),
                                MEASURED, "aux, ids, label indices, soft labels [N, Dv] fp32"))
    est.items.append(MemoryItem(SAVED_DRAFTER, saved.get("drafter", 0), MEASURED, "part of the step peak"))
    est.items.append(MemoryItem(SAVED_LOSS, saved.get("loss", 0), MEASURED, "part of the step peak"))
    est.step_peak = step_peak
    return est


# ==== the budget =================================================================================
def budget_source(params: Params) -> str:
    """Which key sets the trainer's GPU memory budget (params.gpu_memory_budget)."""
    if params.train.gpu_memory_gb is not None:
        return "train.gpu_memory_gb"
    return f"train.gpu_memory_gb (unset: the memory of train.gpu_kind {params.train.gpu_kind})"


def fit_problem(params: Params, est: MemoryEstimate) -> Optional[str]:
    """Why `est` does not fit the GPU's memory (train.gpu_memory_gb, else train.gpu_kind's) with HEADROOM
    to spare, or None when it does (or no budget is known)."""
    budget = gpu_memory_budget(params.train)
    if budget is None:
        return None
    limit = (1 - HEADROOM) * budget * GB
    if est.peak_bytes <= limit:
        return None
    return (f"{budget_source(params)}: the memory model puts the peak per GPU at {est.peak_bytes / GB:,.0f} GB "
            f"(saved for backward {(est.item(SAVED_DRAFTER).bytes + est.item(SAVED_LOSS).bytes) / GB:,.0f} GB) for "
            f"{est.sequences} x {est.seq_len} tokens (train.batch_tokens {est.batch_tokens:,}), over "
            f"{limit / GB:,.0f} GB = {budget:g} GB less {HEADROOM:.0%} headroom. Change "
            + "; or ".join(REMEDIES) + ".")


def check_fits(params: Params, est: Optional[MemoryEstimate] = None) -> Optional[MemoryEstimate]:
    """Refuse, before any work, a profile whose step at data.max_length would not fit the GPU's memory
    (params.gpu_memory_budget) with 20% headroom (ParamsError naming the parameters to change and the
    figure). Returns the estimate (None when the profile states no budget)."""
    if gpu_memory_budget(params.train) is None:
        return None
    est = est or estimate(params)
    problem = fit_problem(params, est)
    if problem:
        raise ParamsError(problem)
    return est


def format_estimate(est: MemoryEstimate, budget_gb: Optional[float] = None) -> str:
    rows = [(i.name, f"{i.bytes / GB:9.2f} GB", i.basis, i.note) for i in est.items]
    rows.append(("peak estimate", f"{est.peak_bytes / GB:9.2f} GB", MEASURED + " + " + ASSUMED,
                 f"static {est.static_bytes / GB:.1f} GB + step peak {est.step_peak / GB:.1f} GB"))
    width = max(len(r[0]) for r in rows)
    head = (f"per-GPU memory: {est.sequences} x {est.seq_len} tokens, {est.ranks} rank(s), "
            f"{est.device} kernels, {est.trainable_params / 1e6:,.1f} M trainable")
    if budget_gb is not None:
        head += f", budget {budget_gb:g} GB ({est.peak_bytes / (budget_gb * GB):.0%} used)"
    basis_width = len(MEASURED + " + " + ASSUMED)
    return "\n".join([head] + [f"  {a:<{width}}  {b}  {c:<{basis_width}}  {d}" for a, b, c, d in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Per-GPU training memory of a profile (meta device; any machine)")
    ap.add_argument("--params", required=True)
    ap.add_argument("--seq", type=int, nargs="*", help="sequence lengths (default: data.max_length)")
    ap.add_argument("--batch-tokens", type=int, help="tokens per micro-batch (default: train.batch_tokens)")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    for seq in args.seq or [params.data.max_length]:
        est = estimate(params, seq, args.batch_tokens)
        budget = gpu_memory_budget(params.train)
        print(format_estimate(est, budget))
        problem = fit_problem(params, est)
        print(f"  DOES NOT FIT: {problem}" if problem else "  fits" if budget else "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
