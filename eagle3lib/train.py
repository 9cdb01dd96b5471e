"""Training the EAGLE-3 drafter with training-time test (TTT) on the cached hidden states.

    summary = train(params, run_dir)   # reads <run>/hidden/{train,eval}, <run>/data/vocab.safetensors

What is learned and how it is scored (soft labels, the TTT loss, held-out evaluation) is
objective.py; feeding the batches (bucketing, padding, aux scaling) is batches.py. This module is
the loop around them: setup (data, drafter, optimizers, resume) -> loop (one optimizer step per
global batch, checkpoints, held-out evaluation, the divergence guard) -> finish (final drafter and
summary).

Per optimizer step: length-bucketed micro-batches (padded, up to train.batch_tokens tokens) from
the memory-mapped HiddenCache, read and padded ahead of the step by a DataLoader (train.num_workers
worker processes, pinned memory on CUDA; batches.micro_batch_loader); the drafter unrolls
ttt_steps steps in parallel (Eagle3Drafter.ttt_hidden); lr: linear warmup, then cosine to min_lr_ratio.

Checkpoints (checkpoints.py: one safetensors file for one process, a sharded
torch.distributed.checkpoint folder under torchrun; metadata: step, schedule, data position, RNG,
world size, the training identity) are written atomically (temp folder, then rename);
`train.resume` continues from the newest one and reaches the same weights as an uninterrupted run
(the data order is a pure function of seed, epoch and step). A checkpoint is resumed only under
the same training identity: the params that change the math and the fingerprint of the
hidden-state cache (its manifests, which hold every shard's sha256), and with the same world
size. Under torchrun, `train.distributed` ddp / fsdp give every rank a disjoint slice of each
global batch; losses are normalised by global counts, so N ranks x 1 micro-batch compute the same
update as 1 rank x N micro-batches. The wrapping (DDP, FSDP2 unit by unit, mixed precision) is
parallel.py's.

Speed on CPU (bench/train.py): `train.dtype: bfloat16` (autocast, fp32 master weights) is faster
than float32 only where the CPU computes bf16 natively (AVX512-BF16 / AMX); on an AVX2-only CPU bf16
is emulated and 4.5-15x slower, so `dtype: auto` picks float32 there (NOTES.md, Decisions: Threads and dtype).
When other processes share the cores, run with OMP_WAIT_POLICY=PASSIVE (OpenMP's spin-waiting
slows shared cores down).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from .batches import Schedule, aux_scale, bucket_batches, fold_aux_scale, micro_batch_loader
from .cache import MANIFEST, HiddenCache, cache_params_hash, check_cache
from .checkpoints import (
    last_good_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
    save_final,
)
from .dist import Dist
from .drafters import check_drafter, drafter_state_dict
from .files import atomic_write_json, check_run_links, read_json, remove_tree, run_lock, update_metrics
from .fingerprint import target_fingerprint
from .layout import RunLayout
from .memory import check_fits
from .model import Eagle3Config, Eagle3Drafter
from .muon import Muon
from .objective import Scoring, add_feature_noise, build_scoring, heldout_scores, prepare_batch
from .online import HiddenStateServer, online_train_cache, serving
from .parallel import frozen_dtype, full_weights, mixed_precision, no_sync, reshard_units, wrap_model
from .params import (
    Params,
    TrainParams,
    checkpoint_interval,
    load_params,
    max_warmup_steps,
    planned_warmup,
    warmup_problem,
)
from .progress import tqdm
from .target import load_target_layer, load_target_tensors, target_path
from .tracking import open_tracker
from .vocab import load_vocab


# ==== schedule, optimizer =======================================================================
def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total` steps."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def make_optimizers_for(model: nn.Module, train_params: TrainParams) -> list:
    """AdamW on everything trainable; with train.optimizer == "muon", Muon (muon_optimizer) on the
    2-D weights of fc and the decoder layer (lm_head, norms stay on AdamW). t: TrainParams."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if train_params.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError("train.optimizer: muon needs torch.optim.Muon (torch >= 2.9)")
        is_muon = lambda n, p: p.dim() == 2 and ("midlayer." in n or "later_layers." in n or n.endswith("fc.weight"))
        muon = [p for n, p in named if is_muon(n, p)]
        rest = [p for n, p in named if not is_muon(n, p)]
        return [muon_optimizer(muon, train_params),
                torch.optim.AdamW(rest, lr=train_params.lr, weight_decay=train_params.weight_decay, betas=(0.9, 0.95))]
    return [torch.optim.AdamW([p for _, p in named], lr=train_params.lr, weight_decay=train_params.weight_decay,
                              betas=(0.9, 0.95))]


def muon_optimizer(weights: list, train_params: TrainParams) -> torch.optim.Optimizer:
    """torch.optim.Muon (Newton-Schulz in bf16) where training runs in bf16; eagle3lib.muon.Muon
    with the iteration in fp32 where it runs in fp32 (train.dtype resolved): on a CPU without
    native bf16 torch's bf16 iteration took ~20 of a step's ~22 s (eagle3lib/muon.py)."""
    if train_params.dtype == "bfloat16":
        return torch.optim.Muon(weights, lr=train_params.lr, weight_decay=train_params.weight_decay,
                                adjust_lr_fn="match_rms_adamw")
    return Muon(weights, lr=train_params.lr, weight_decay=train_params.weight_decay, adjust_lr_fn="match_rms_adamw",
                ns_dtype=torch.float32)


# ==== what a resumption must match ==============================================================
# Train fields that may change between a run and its resumption (they do not change the math).
RESUMABLE_CHANGES = {"resume", "time_budget_minutes", "checkpoint_every", "checkpoint_fraction",
                     "checkpoint_minutes", "eval_sequences", "tracking", "unigram_check",
                     "compile", "max_steps", "epochs", "nproc", "distributed", "num_workers",
                     "diverge_steps", "diverge_uniform_rtol", "diverge_loss_rise", "diverge_grad_norm",
                     "attention", "activation_checkpointing",     # same function, other cost
                     "pg_timeout_minutes", "verify_cache", "verify_sample"}


def training_identity(params: Params, cache_fingerprint: Optional[str] = None) -> str:
    """Hash of what determines the weights (train fields except RESUMABLE_CHANGES, seed, data,
    extraction, and the fingerprint of the hidden-state cache trained on when given): a checkpoint
    made under another identity is not resumed."""
    train = {k: v for k, v in asdict(params.train).items() if k not in RESUMABLE_CHANGES}
    payload = {"train": train, "data": cache_params_hash(params)}
    if cache_fingerprint is not None:
        payload["cache"] = cache_fingerprint
    blob = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_fingerprint(train_cache: HiddenCache, eval_cache: Optional[HiddenCache]) -> str:
    """16 hex digits naming the content of the caches trained and evaluated on (HiddenCache.fingerprint
    covers every shard's sha256): a re-extracted, repaired or replaced cache gets another one."""
    blob = f"train:{train_cache.fingerprint}|eval:{eval_cache.fingerprint if eval_cache is not None else ''}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ==== divergence guard ==========================================================================
class TrainingDiverged(RuntimeError):
    """The loss or the gradients show a diverged run (see DivergenceGuard)."""


class DivergenceGuard:
    """Stops a run that has diverged instead of letting it finish "successfully". A step is bad when

    - uniform: every TTT step's mean soft CE is log(Dv) within diverge_uniform_rtol (relative): the
      drafter outputs the uniform distribution over the draft vocabulary (a collapsed model;
      a learning model passes this value at most in passing, not on all steps at once);
    - rise: the loss is above diverge_loss_rise x its running minimum (this process's steps);
    - vanished: the gradient norm (before clipping) is <= diverge_grad_norm.

    diverge_steps consecutive bad steps of one kind raise TrainingDiverged (0: guard off)."""

    def __init__(self, train_params: TrainParams, draft_vocab_size: int):
        self.train_params = train_params
        self.uniform_loss = math.log(draft_vocab_size)
        self.best = math.inf
        self.streaks = {"uniform": 0, "rise": 0, "vanished": 0}
        self.first_bad = {k: 0 for k in self.streaks}              # first step of each streak

    def reasons(self, record: dict) -> dict:
        """Which criteria record (step, loss, step_loss, grad_norm) meets -> {kind: description}."""
        train_params, loss = self.train_params, record["loss"]
        out = {}
        rtol = train_params.diverge_uniform_rtol
        if all(abs(l - self.uniform_loss) <= rtol * self.uniform_loss for l in record["step_loss"]):
            out["uniform"] = f"the loss stays at the uniform level log(Dv) = {self.uniform_loss:.4f} on every TTT step"
        if self.best < math.inf and loss > train_params.diverge_loss_rise * self.best:
            out["rise"] = (f"the loss ({loss:.4g}) stays above {train_params.diverge_loss_rise:g}x its running minimum "
                           f"({self.best:.4g})")
        if record["grad_norm"] <= train_params.diverge_grad_norm:
            out["vanished"] = (f"the gradient norm stays <= {train_params.diverge_grad_norm:g} "
                               f"({record['grad_norm']:.3g})")
        return out

    def check(self, record: dict) -> Optional[tuple[str, int]]:
        """Update with one step's record; (description, first bad step) once a streak reaches
        diverge_steps, else None."""
        found = self.reasons(record)
        self.best = min(self.best, record["loss"])
        for kind in self.streaks:
            if kind in found:
                self.first_bad[kind] = self.first_bad[kind] if self.streaks[kind] else record["step"]
                self.streaks[kind] += 1
                if self.train_params.diverge_steps and self.streaks[kind] >= self.train_params.diverge_steps:
                    return found[kind], self.first_bad[kind]
            else:
                self.streaks[kind] = 0
        return None


# ==== one optimizer step, the drafter ==========================================================
def optimizer_step(model: nn.Module, optimizers: list, prepared: list, train_params: TrainParams, dist: Dist,
                   amp) -> tuple:
    """One optimizer step over this rank's prepared micro-batches (see prepare_batch).
    Losses are normalised by GLOBAL counts (all micro-batches of all ranks), so the update equals
    the one of a single process holding the whole global batch. Returns (loss, per-step stats
    [J, 3] summed over ranks, grad norm before clipping, global real tokens). A non-finite loss
    is returned without touching the weights."""
    J = train_params.ttt_steps
    counts = dist.all_sum(torch.stack([sum(b["counts"] for b in prepared),
                                       torch.full((J,), sum(b["tokens"] for b in prepared), dtype=torch.float64)]))
    denom = (counts[0] if train_params.loss_average == "masked" else counts[1]).clamp(min=1)
    device = prepared[0]["input_ids"].device
    stats = torch.zeros(J, 3, dtype=torch.float64)
    for i, batch in enumerate(prepared):
        with no_sync(model, last=i == len(prepared) - 1), amp():
            loss, s = model(batch, denom.to(device))
            # DDP / FSDP average gradients over ranks; the loss is already the global mean
            (loss * dist.world).backward()
        stats += s.cpu()
    reshard_units(model)                  # before the optimizer changes the sharded weights
    stats = dist.all_sum(stats)
    loss_value = float(sum((train_params.decay ** j) * stats[j, 0] / denom[j] for j in range(J)))
    if not math.isfinite(loss_value):
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        return loss_value, stats, float("nan"), float(counts[1, 0])
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, train_params.grad_clip))
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


def init_from_drafter(drafter: Eagle3Drafter, path: Path, target_dir: Path,
                      scale: Optional[torch.Tensor] = None) -> dict:
    """Start from a trained drafter (train.init_from_drafter): a public Llama-layout EAGLE-3 drafter
    or an earlier run's export, its weights mapped by name (drafters.drafter_state_dict: `midlayer.*`
    and `layers.0.*` alike). Checked first against the target and this run's aux layers
    (drafters.check_drafter: hidden size, vocabulary, aux ids as vLLM counts them), then shape by shape.

    - The run's own draft vocabulary (02's d2t / t2d) is kept and the lm_head rows are mapped: each
      draft token's row is the drafter's row of the same target token where the drafter's vocabulary
      holds it (a full-vocabulary drafter holds every one); the others keep their init.
    - fc is stored in raw-aux units; with fc_input_scaling the trainer's fc reads aux / s, so it
      starts at fc * s (the inverse of batches.fold_aux_scale).
    - The frozen input embedding stays the target's; optimizer and schedule start fresh.
    -> {"weights": names copied, "lm_head_rows": [copied, draft vocabulary size]}."""
    state, src_d2t, _, info = drafter_state_dict(path)
    check_drafter(info, target_dir, drafter.config.aux_layer_ids)
    ours = dict(drafter.named_parameters())
    copied = []
    with torch.no_grad():
        for name, w in state.items():
            if name in ("lm_head.weight", "embed_tokens.weight"):
                continue
            if name not in ours:
                raise ValueError(f"train.init_from_drafter: {path}: {name} has no place in this drafter "
                                 f"(train.draft_layers {drafter.config.num_hidden_layers}); use a drafter of the "
                                 "same depth or set train.draft_layers to it")
            if ours[name].shape != w.shape:
                raise ValueError(f"train.init_from_drafter: {path}: {name} is {tuple(w.shape)}, this drafter's is "
                                 f"{tuple(ours[name].shape)}: the shapes cannot map (another target or layout)")
            w = w.float()
            if name == "fc.weight" and scale is not None:
                w = w * scale.reshape(1, -1).to(w)                  # [H, 3H]: fc reads aux / s
            ours[name].copy_(w.to(ours[name].dtype))
            copied.append(name)
        missing = sorted(n for n in ours if n not in copied and n not in ("lm_head.weight", "embed_tokens.weight"))
        if missing:
            raise ValueError(f"train.init_from_drafter: {path} has no {', '.join(missing[:4])}: not an EAGLE-3 "
                             "drafter of this layout")
        rows = _map_lm_head_rows(drafter, state["lm_head.weight"], src_d2t)
    return {"weights": copied, "lm_head_rows": [rows, drafter.config.draft_vocab_size]}


def _map_lm_head_rows(drafter: Eagle3Drafter, src_head: torch.Tensor, src_d2t: Optional[torch.Tensor]) -> int:
    """Copy src_head's row of each target token into the drafter's row of the same token; -> rows copied.
    A draft index i names target token i + d2t[i]; without d2t the source head is indexed by target id."""
    ours = torch.arange(drafter.config.draft_vocab_size) + drafter.d2t.cpu()            # [Dv] target ids
    if src_d2t is None:
        src_row = {int(t): int(t) for t in ours if int(t) < src_head.shape[0]}
    else:
        src_row = {int(t): i for i, t in enumerate((torch.arange(len(src_d2t)) + src_d2t).tolist())}
    pairs = [(i, src_row[int(t)]) for i, t in enumerate(ours.tolist()) if int(t) in src_row]
    if pairs:
        dst, src = (torch.tensor(x) for x in zip(*pairs))
        drafter.lm_head.weight[dst.to(drafter.lm_head.weight.device)] = \
            src_head[src].to(drafter.lm_head.weight)
    return len(pairs)


def build_drafter(params: Params, target_dir: Path, hidden_size: int, aux_layers: list, d2t, t2d,
                  scale: Optional[torch.Tensor] = None) -> tuple[Eagle3Drafter, Optional[dict]]:
    """The drafter 04 trains, from noise, a target layer (train.init_from_layer) or a trained drafter
    (train.init_from_drafter). -> (drafter, the warm start's report or None)."""
    train_params = params.train
    hf = read_json(Path(target_dir) / "config.json")   # plain JSON: no transformers import needed
    config = Eagle3Config.from_target_config(
        hf, d2t.numel(), aux_layers, norm_before_residual=train_params.norm_before_residual,
        norm_before_fc=train_params.norm_before_fc, next_step_hidden=train_params.next_step_hidden,
        num_hidden_layers=train_params.draft_layers)
    if config.hidden_size != hidden_size:
        raise ValueError(f"hidden cache has H={hidden_size}, the target {target_dir} has H={config.hidden_size}")
    torch.manual_seed(params.seed)
    w = load_target_tensors(target_dir)
    lm_head = w["lm_head"] if train_params.init_lm_head else None
    drafter = Eagle3Drafter.from_target_weights(config, d2t, t2d, w["embed"], lm_head)
    if train_params.init_from_layer is not None:
        hf_layers = (hf.get("text_config") or hf)["num_hidden_layers"]
        layer = train_params.init_from_layer % hf_layers
        init_from_target_layer(drafter, target_dir, layer, scale)
    warm = None
    if train_params.init_from_drafter is not None:
        warm = init_from_drafter(drafter, Path(train_params.init_from_drafter), target_dir, scale)
    if train_params.freeze_lm_head:
        drafter.lm_head.weight.requires_grad_(False)
    return drafter, warm




# ==== the training run: setup -> loop -> finish =================================================
@dataclass
class TrainRun:
    """One training run's state, made by setup() and advanced by the loop."""
    params: Params
    layout: RunLayout
    dist: Dist
    device: torch.device
    cache: HiddenCache                    # hidden/train
    usable: list                          # cache indices of the sequences with >= 3 tokens
    lengths: list                         # their lengths
    scoring: Scoring                      # head, objective (the unwrapped model), autocast, aux scale
    noise_scale: Optional[torch.Tensor]   # [3, H] feature noise unit on raw aux (None: aux / s or off)
    model: nn.Module                      # scoring.objective, wrapped for DDP / FSDP
    optimizers: list
    steps_per_epoch: int
    per_step: int                         # micro-batches per optimizer step (ranks x grad_accum)
    total_steps: int
    identity: str                         # training_identity with the cache fingerprint
    fingerprint: str                      # cache_fingerprint
    step: int = 0                         # optimizer steps done
    history: list = field(default_factory=list)
    eval_batches: object = field(default_factory=list)   # objective.HeldOutBatches (empty: no eval cache)

    @property
    def config(self) -> Eagle3Config:
        return self.scoring.objective.drafter.config

    def set_lr(self, step: int) -> float:
        train_params = self.params.train
        warmup = planned_warmup(train_params, self.total_steps)
        lr = train_params.lr * lr_factor(step, warmup, self.total_steps, train_params.min_lr_ratio)
        for o in self.optimizers:
            for g in o.param_groups:
                g["lr"] = lr
        return lr

    def meta(self) -> dict:
        """The checkpoint metadata after self.step steps."""
        return {"total_steps": self.total_steps, "world_batch": self.per_step,
                "epoch": self.step // self.steps_per_epoch, "position_in_epoch": self.step % self.steps_per_epoch,
                "history": self.history, "identity": self.identity, "cache_fingerprint": self.fingerprint,
                "config": asdict(self.config)}


def subset_of(usable: list, n: int, seed: int) -> list:
    """The first n of a seeded permutation of `usable`, in cache order (train.max_sequences): for
    one seed, the subset of a smaller n lies inside the subset of a larger one."""
    if n > len(usable):
        raise ValueError(f"train.max_sequences: {n} > the {len(usable)} usable sequences (>= 3 tokens) of the "
                         "training cache; lower it or set it to null (all), or grow data.num_train and re-run 02/03")
    order = torch.randperm(len(usable), generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(usable[k] for k in order[:n])


def schedule(cache: HiddenCache, train_params: TrainParams, seed: int, world: int) -> tuple[list, int, int, int]:
    """-> (usable sequence indices, micro-batches per step, steps per epoch, total steps)."""
    usable = [i for i, n in enumerate(cache.lengths) if n >= 3]
    if train_params.max_sequences is not None:
        usable = subset_of(usable, train_params.max_sequences, seed)
    per_step = world * train_params.grad_accum
    batches = bucket_batches([cache.lengths[i] for i in usable], train_params.batch_tokens, seed, 0)
    steps_per_epoch = len(batches) // per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(usable)} usable training sequences make fewer micro-batches than one "
                         f"optimizer step needs ({per_step} = ranks x grad_accum); lower train.batch_tokens")
    total = train_params.max_steps or max(1, math.ceil(train_params.epochs * steps_per_epoch))
    warmup = planned_warmup(train_params, total)
    if warmup > max_warmup_steps(total):
        raise ValueError(f"train.warmup_steps: {warmup_problem(warmup, total, 'train.epochs of this cache')}")
    return usable, per_step, steps_per_epoch, total


def setup(params: Params, layout: RunLayout, dist: Dist, device: torch.device,
          server: Optional[HiddenStateServer] = None) -> TrainRun:
    """Data, drafter, scoring, optimizers and schedule; resumes from the newest checkpoint when
    train.resume is on; the held-out batches of hidden/eval (none when that cache is missing).
    server: extract.mode online's vLLM server, which serves the train split's states."""
    train_params = params.train
    # the caches must be this run's (params hash) and intact (train.verify_cache, hashed once per
    # cache, the ranks sharing the hashing); online, the train split's states come from the server
    cache = online_train_cache(params, layout, server) if server is not None else check_cache(params, layout,
                                                                                              "train", dist)
    eval_cache = check_cache(params, layout, "eval", dist) \
        if (layout.hidden("eval") / MANIFEST).is_file() else None
    d2t, t2d = load_vocab(layout.vocab)
    scale = aux_scale(cache) if train_params.fc_input_scaling else None     # [3, H] or None
    # noise is in units of s: the batch already holds aux / s when fc_input_scaling is on
    feature_noise = train_params.feature_noise > 0 and not train_params.fc_input_scaling
    noise_scale = aux_scale(cache) if feature_noise else None
    drafter, warm = build_drafter(params, target_path(params), cache.hidden_size, cache.aux_layers, d2t, t2d, scale)
    drafter = drafter.to(device)
    if warm is not None and dist.rank == 0:
        print(f"[train] warm start from {params.train.init_from_drafter}: {len(warm['weights'])} weights, "
              f"lm_head rows {warm['lm_head_rows'][0]:,} of {warm['lm_head_rows'][1]:,} mapped by target token")
    drafter.embed_tokens.to(frozen_dtype(train_params, device))
    drafter.configure_training(train_params.attention, train_params.activation_checkpointing, device)
    scoring = build_scoring(params, layout, drafter, device, scale=scale, compile=train_params.compile)
    model = wrap_model(scoring.objective, train_params.distributed, dist, mixed_precision(train_params, device))
    optimizers = make_optimizers_for(model, train_params)
    usable, per_step, steps_per_epoch, total_steps = schedule(cache, train_params, params.seed, dist.world)
    fingerprint = cache_fingerprint(cache, eval_cache)
    run = TrainRun(params, layout, dist, device, cache, usable, [cache.lengths[i] for i in usable], scoring,
                   noise_scale, model, optimizers, steps_per_epoch, per_step, total_steps,
                   training_identity(params, fingerprint), fingerprint)
    resume(run)
    if eval_cache is not None:       # each rank prepares its share of the held-out set (heldout_batches)
        run.eval_batches = scoring.heldout(eval_cache, train_params.eval_sequences, train_params.batch_tokens, device,
                                           dist.rank, dist.world)
    return run


def heldout_eval(run: TrainRun) -> dict:
    """The held-out metrics of the current weights: every rank scores its share of the held-out
    set, the sums are reduced over ranks (the same numbers as one process scoring all of it)."""
    def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
        return run.dist.all_sum(x.to(run.device)).cpu()              # NCCL reduces on the GPU
    ttt_steps, decode_k = run.params.train.ttt_steps, run.params.eval.k
    return heldout_scores(run.model, run.eval_batches, ttt_steps, run.scoring.amp, reduce=sum_over_ranks,
                          decode_k=decode_k if decode_k <= ttt_steps else None)


def resume(run: TrainRun) -> None:
    """Continue from the newest checkpoint (train.resume) after checking that it was made with the
    same schedule, params and hidden-state cache; without train.resume, delete the checkpoints."""
    ckpt_root = run.layout.checkpoints
    ckpt = latest_checkpoint(ckpt_root) if run.params.train.resume else None
    if not run.params.train.resume and run.dist.rank == 0 and ckpt_root.exists():
        remove_tree(ckpt_root, under=run.layout.root)
    run.dist.barrier()
    if ckpt is None:
        return
    meta = read_checkpoint_meta(ckpt)
    start_over = "set train.resume: false to start over, or use another run name"
    if meta["world_size"] != run.dist.world:
        raise RuntimeError(f"{ckpt} was written by {meta['world_size']} process(es), this run has "
                           f"{run.dist.world}: its shards are laid out for that world size; resume with "
                           f"train.nproc: {meta['world_size']}, or {start_over}")
    if meta["total_steps"] != run.total_steps or meta["world_batch"] != run.per_step:
        raise RuntimeError(f"{ckpt} was made with another schedule ({meta['total_steps']} steps, "
                           f"{meta['world_batch']} micro-batches/step; now {run.total_steps}, {run.per_step}); "
                           "set train.resume: false to start over")
    if meta.get("cache_fingerprint") not in (None, run.fingerprint):
        raise RuntimeError(f"{ckpt} was trained on another hidden-state cache (fingerprint "
                           f"{meta['cache_fingerprint']}, now {run.fingerprint}: "
                           f"{run.layout.hidden('train').parent} was re-extracted, repaired or replaced); "
                           f"{start_over}")
    if meta["identity"] != run.identity:
        raise RuntimeError(f"{ckpt} was made with other train/data params (only "
                           f"{sorted(RESUMABLE_CHANGES)} may change between resumptions); {start_over}")
    load_checkpoint(ckpt, run.model, run.optimizers, run.dist)
    run.step, run.history = meta["step"], meta.get("history", [])


def train_step(run: TrainRun, batches: Iterator[dict]) -> tuple[dict, float]:
    """One optimizer step on global batch run.step -> (record, global real tokens). batches: this
    rank's collated micro-batches from run.step on (loader), grad_accum of them per step."""
    params, train_params, dist = run.params, run.params.train, run.dist
    mine = [next(batches) for _ in range(run.per_step // dist.world)]  # a disjoint slice per rank
    prepared = [prepare_batch(batch, run.scoring.head, train_params.ttt_steps, run.device, run.scoring.scale,
                              exact_top1=False, all_positions=train_params.label_positions == "all") for batch in mine]
    if train_params.feature_noise > 0:                             # after the labels: they stay exact
        prepared = [add_feature_noise(b, train_params.feature_noise, run.noise_scale,
                                      params.seed * 1009 + dist.rank * 101 + i, run.step)
                    for i, b in enumerate(prepared)]
    lr = run.set_lr(run.step)
    loss_value, stats, grad_norm, tokens = optimizer_step(run.model, run.optimizers, prepared, train_params, dist,
                                                          run.scoring.amp)
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"train step {run.step}: loss is {loss_value} (non-finite); lower "
                                 f"train.lr or use train.dtype float32 (last checkpoint: "
                                 f"{latest_checkpoint(run.layout.checkpoints)})")
    run.step += 1
    n = stats[:, 2].clamp(min=1)
    return {"step": run.step, "lr": lr, "loss": loss_value, "grad_norm": grad_norm,
            "step_loss": (stats[:, 0] / n).tolist(), "step_acc": (stats[:, 1] / n).tolist()}, tokens


def loader(run: TrainRun):
    """This rank's micro-batches from run.step to the end (batches.micro_batch_loader): the same
    order as an uninterrupted run; train.num_workers worker processes, pinned memory on CUDA."""
    train_params = run.params.train
    plan = Schedule(tuple(run.lengths), train_params.batch_tokens, run.params.seed, run.per_step, run.steps_per_epoch,
                    run.total_steps)
    return micro_batch_loader(run.cache, run.usable, plan, run.dist.rank, run.dist.world, run.step,
                              train_params.num_workers, pin_memory=run.device.type == "cuda")


def stop_if_diverged(run: TrainRun, guard: DivergenceGuard, record: dict) -> None:
    found = guard.check(record)
    if found is None:
        return
    what, first_bad = found
    good = last_good_checkpoint(run.layout.checkpoints, first_bad)
    raise TrainingDiverged(
        f"train step {record['step']} (lr {record['lr']:.3g}): the run diverged: {what} since step {first_bad} "
        f"({run.params.train.diverge_steps} steps, train.diverge_steps). Last good checkpoint: "
        f"{good or 'none kept'}. Lower train.lr (or raise train.warmup_steps) and restart with "
        "train.resume: false, or resume from that checkpoint after deleting the newer ones; "
        "the thresholds are train.diverge_* (diverge_steps: 0 turns the guard off)")


def report_step(run: TrainRun, record: dict, bar, tracker, callback: Optional[Callable]) -> None:
    """Rank 0: the progress bar, the tracker (train.tracking) and the caller's callback."""
    bar.update(1)
    bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['step_acc'][0]:.3f}")
    if tracker is not None:
        tracker.log(record, record["step"])
    if callback is not None:
        callback(record)


def loop(run: TrainRun, progress: bool, callback: Optional[Callable]) -> tuple[str, float, float]:
    """Optimizer steps until total_steps or the time budget; a checkpoint (and a held-out
    evaluation) every checkpoint_interval steps, after checkpoint_minutes, and at the end.
    -> (stopped_by, tokens, seconds)."""
    train_params, dist = run.params.train, run.dist
    rank0 = dist.rank == 0
    tracker = open_tracker(train_params.tracking, run.layout, dist.rank, asdict(train_params))
    guard = DivergenceGuard(train_params, run.config.draft_vocab_size)
    bar = tqdm(total=run.total_steps, initial=run.step, desc="train", disable=not (progress and rank0))
    t0, tokens_seen, stopped_by = time.time(), 0.0, "steps"
    every, last_saved = checkpoint_interval(train_params, run.total_steps), time.time()
    batches = iter(loader(run))
    run.model.train()
    while run.step < run.total_steps:
        record, tokens = train_step(run, batches)
        tokens_seen += tokens
        record["tokens_per_s"] = tokens_seen / max(1e-9, time.time() - t0)
        stop_if_diverged(run, guard, record)
        budget_minutes = train_params.time_budget_minutes
        out_of_time = budget_minutes is not None and time.time() - t0 > 60 * budget_minutes
        out_of_time = dist.broadcast_flag(out_of_time)
        by_clock = train_params.checkpoint_minutes is not None and \
            dist.broadcast_flag(time.time() - last_saved > 60 * train_params.checkpoint_minutes)
        due = run.step % every == 0 or run.step == run.total_steps or out_of_time or by_clock
        if run.eval_batches and due:
            record["eval"] = heldout_eval(run)
        run.history.append(record)
        if due:
            save_checkpoint(run.layout.checkpoints, run.step, run.model, run.optimizers, run.meta(), dist)
            last_saved = time.time()
        if rank0:
            report_step(run, record, bar, tracker, callback)
        if out_of_time and run.step < run.total_steps:
            stopped_by = "time_budget"
            break
    bar.close()
    if tracker is not None:
        tracker.close()
    return stopped_by, tokens_seen, time.time() - t0


def finish(run: TrainRun, stopped_by: str, tokens_seen: float, seconds: float) -> dict:
    """final/ (the drafter with the aux scale folded into fc), summary.json, history.json."""
    full = full_weights(run.model)
    drafter_state = {k[len("drafter."):]: v for k, v in full.items() if k.startswith("drafter.")}
    history, layout = run.history, run.layout
    evals = [r for r in history if "eval" in r]
    summary = {"steps": run.step, "total_steps": run.total_steps, "stopped_by": stopped_by,
               "steps_per_epoch": run.steps_per_epoch, "epochs_done": run.step / run.steps_per_epoch,
               "world_size": run.dist.world, "train_sequences": len(run.usable),
               "final_loss": history[-1]["loss"] if history else None,
               "train_step_acc": history[-1]["step_acc"] if history else None,
               "eval": evals[-1]["eval"] if evals else None,
               "tokens_per_s_this_run": tokens_seen / max(1e-9, seconds),
               "train_seconds_this_run": seconds,
               "checkpoint": str(latest_checkpoint(layout.checkpoints)), "final_dir": str(layout.final)}
    if run.dist.rank == 0:
        summary["target"] = target_fingerprint(target_path(run.params))  # checked by export and eval
        # final/ computes fc(aux) on raw aux (the full state exists on rank 0 only)
        save_final(layout.final, fold_aux_scale(drafter_state, run.scoring.scale), run.config, summary)
        atomic_write_json(layout.summary, summary)
        atomic_write_json(layout.history, history)
        update_metrics(layout.root, "train", train_metrics(summary, history, run.params.train))
    run.dist.barrier()
    return summary


def train_metrics(summary: dict, history: list, train_params: TrainParams) -> dict:
    """metrics.json's "train" section: steps, why it stopped, the last loss, the held-out per-step
    accuracy and acceptance (estimated and replayed), the last training speed."""
    ev = summary.get("eval") or {}
    speed = [r["tokens_per_s"] for r in history if "tokens_per_s" in r]

    def rounded(x, digits=4):
        return None if x is None else round(x, digits)
    return {"steps": summary["steps"], "stopped_by": summary["stopped_by"], "epochs": round(summary["epochs_done"], 3),
            "final_loss": rounded(summary["final_loss"]),
            "eval_step_acc": [round(a, 4) for a in ev.get("acc", [])],
            "eval_acceptance_estimate": rounded(ev.get("acceptance_estimate")),
            "eval_acceptance_replayed": rounded(ev.get("acceptance_replayed")),
            "eval_decode_k": ev.get("decode_k"),                       # 05's k, where 04 could replay it
            "eval_acceptance_replayed_decode_k": rounded(ev.get("acceptance_replayed_decode_k")),
            "train_tokens_per_s": rounded(speed[-1] if speed else None, 1),
            "ttt_steps": train_params.ttt_steps, "draft_layers": train_params.draft_layers,
            "dtype": train_params.dtype, "world_size": summary["world_size"],
            "final_dir": summary["final_dir"]}


def train(params: Params, run_dir, progress: bool = True, callback: Optional[Callable] = None,
          links_within=None, server: Optional[HiddenStateServer] = None) -> dict:
    """Train (or resume) the drafter of run `run_dir`; returns a summary dict.

    callback(record) is called on rank 0 after every optimizer step with the step's record
    (step, lr, loss, grad norm, per-step loss/acc, tokens/s, and `eval` when an eval ran at that
    step). Raises FloatingPointError on a non-finite loss and TrainingDiverged when the
    divergence guard trips (DivergenceGuard); ParamsError before any work when the profile states
    train.gpu_memory_gb and the memory model says a step does not fit (memory.check_fits).
    links_within: the folder links in `run_dir` may point into (default `run_dir`; a 06_scaling
    point passes its enclosing run, whose data/ and hidden/ it links to). server: extract.mode
    online's running server to use (06's points share one); None starts one for this run."""
    check_fits(params)
    check_run_links(run_dir, links_within)   # no write or delete may go through a link out of the run
    dist = Dist(timeout_minutes=params.train.pg_timeout_minutes)
    try:
        if dist.world > 1 and params.train.distributed == "none":
            raise RuntimeError("launched under torchrun with several processes but train.distributed is none; "
                               "set train.distributed to ddp or fsdp")
        layout = RunLayout(run_dir)
        given = contextlib.nullcontext(server) if server is not None else None
        with given or serving(params, layout, dist.rank) as server:   # extract.mode online: vLLM serves the states
            device = dist.device("auto", avoid=tuple(params.extract.online_gpus or ()) if server else ())
            run = setup(params, layout, dist, device, server)
            if progress and dist.rank == 0:
                d = run.scoring.objective.drafter
                print(f"TTT attention: {d.attention_impl} (train.attention: {params.train.attention}, device "
                      f"{run.device.type}) | activation checkpointing: {d.activation_checkpointing}")
            if progress and dist.rank == 0 and run.step:
                print(f"resumed from {latest_checkpoint(run.layout.checkpoints)} (step {run.step}/{run.total_steps})")
            return finish(run, *loop(run, progress, callback))
    finally:
        dist.close()


# ==== command line (the entry point for torchrun) ==============================================
def torchrun_command(params_path, run_name: Optional[str], nproc: int) -> list:
    """The command that trains run `run_name` with `nproc` processes on this machine:
    torchrun --standalone --nproc-per-node N -m eagle3lib.train --params PROFILE [--run-name R]."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "eagle3lib.train", "--params", str(params_path)]
    return cmd + (["--run-name", run_name] if run_name else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3lib.train", description="train the EAGLE-3 drafter "
                                 "(under torchrun for train.distributed ddp / fsdp)")
    ap.add_argument("--params", required=True)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    params = load_params(a.params)
    run_dir = params.run_dir(a.run_name)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    # one lock per run folder, held by rank 0 (a child of `eagle3 run` enters the runner's lock)
    with run_lock(run_dir) if rank0 else contextlib.nullcontext():
        summary = train(params, run_dir, progress=not a.no_progress)
    if rank0:
        from .report import write_index  # the index page the notebook route leaves too
        write_index(run_dir)
        print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
