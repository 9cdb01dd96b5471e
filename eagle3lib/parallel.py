"""How the drafter is spread over torchrun ranks: DDP or FSDP2 wrapping, FSDP2's unit layout and
mixed precision, and gradient-sync control across micro-batches. The one home for the torch
distributed training APIs (dist.py holds the process-group plumbing; train.py imports from here).

    model = wrap_model(objective, "fsdp", dist, mixed_precision(t, device))
    with no_sync(model, last=False): loss.backward()     # accumulate without reducing
    reshard_units(model)                                 # free gathered weights before the optimizer
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from .dist import Dist
from .objective import TTTObjective
from .params import TrainParams


def frozen_dtype(train_params: TrainParams, device: torch.device) -> torch.dtype:
    """The dtype the frozen embedding is held in: bf16 on GPU under train.dtype bfloat16 (the target's
    own values, so exact; halves 4.7 GB at Kimi shapes), else fp32 (on CPU bf16 is emulated on
    AVX2-only machines, and a bf16 lookup would change the fp32 path's numbers)."""
    return torch.bfloat16 if device.type == "cuda" and train_params.dtype == "bfloat16" else torch.float32


def mixed_precision(train_params: TrainParams, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's policy: on GPU with train.dtype bfloat16 the gathered parameters are bf16 and the
    gradients are reduce-scattered in fp32 (fp32 master weights and optimizer state stay sharded).
    On CPU / gloo everything stays fp32: emulated bf16 is slow there, gloo reduces fp32 exactly, and
    the 2-process gloo tests compare against single-process fp32 training."""
    if device.type == "cuda" and train_params.dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_objective(objective: TTTObjective, mp: MixedPrecisionPolicy) -> nn.Module:
    """FSDP2 units for a drafter with a big embedding and head, each all-gathered only
    while it computes: the frozen embedding, fc, each decoder layer, the drafter's remaining
    parameters (final norm + lm_head, and input_norm when present), then the root (the objective).

    TTTObjective does not call these modules' forward everywhere, so FSDP2's pre-forward hooks get
    explicit entry points (register_fsdp_forward_method, a documented FSDP2 API):
    - each decoder layer is entered through `attention_input` (then self_attn.qkv / out / finish
      run on the same gathered weights: reshard_after_forward=False keeps them gathered through
      all TTT steps). Its backward hooks fire once per TTT step, at attention_input's inputs,
      while the earlier steps' qkv / out / finish still need the weights, so it does not reshard
      after backward either: optimizer_step reshards every unit explicitly (reshard_units) once
      the step's backward passes are done;
    - the drafter unit is entered through `ttt_hidden`; ttt_loss then reads lm_head.weight
      directly, so this unit too stays gathered until its backward.
    The embedding and fc are called as modules and reshard after each call."""
    drafter = objective.drafter
    fully_shard(drafter.embed_tokens, mp_policy=mp)
    fully_shard(drafter.fc, mp_policy=mp)
    for layer in drafter.layers:                         # midlayer, then any later layers
        fully_shard(layer, mp_policy=mp, reshard_after_forward=False)
        register_fsdp_forward_method(layer, "attention_input")
        layer.set_reshard_after_backward(False, recurse=False)
    fully_shard(drafter, mp_policy=mp, reshard_after_forward=False)
    register_fsdp_forward_method(drafter, "ttt_hidden")
    return fully_shard(objective, mp_policy=mp)


def reshard_units(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit (see shard_objective); no-op without FSDP."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def wrap_model(objective: TTTObjective, mode: str, dist: Dist,
               mp: Optional[MixedPrecisionPolicy] = None) -> nn.Module:
    """The objective as trained on `dist.world` ranks: itself (one process), DDP or FSDP2."""
    if dist.world == 1:
        return objective
    if mode == "ddp":
        return DistributedDataParallel(objective)
    if mode == "fsdp":
        return shard_objective(objective, mp or MixedPrecisionPolicy())
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


def full_weights(model: nn.Module) -> dict:
    """{name: full tensor on CPU} of a wrapped (or plain) model, gathered from every rank's shard."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
