"""Muon whose Newton-Schulz iteration runs in a chosen dtype (fp32 where bf16 is not native).

torch.optim.Muon (torch >= 2.9, the optimizer train.optimizer: muon uses) orthogonalises each
update with 5 Newton-Schulz iterations in bf16. Where bf16 matmuls are emulated (an AVX2-only CPU)
that iteration dominates the step: on the local profile (SmolLM2-135M shapes, 1,024-token batches,
fp32 training) it took ~20 of a step's ~22 s, so training ran at ~40 tok/s instead of ~400
(cProfile of `python -m eagle3lib.train`, docs/log.md, 2026-12-04, evening).

`Muon` below is torch.optim.Muon's documented algorithm (see its docstring) with one knob added,
ns_dtype. With ns_dtype=torch.bfloat16 it reproduces torch.optim.Muon step for step
(tests/test_train.py checks it); the trainer uses torch.optim.Muon itself wherever it trains in
bf16 and this class with fp32 only where it trains in fp32 (train.make_optimizers_for).

Per 2-D parameter theta with gradient g, momentum mu, lr gamma, weight decay lambda:
    B <- mu B + (1 - mu) g                    (momentum buffer; torch's lerp form)
    U <- (1 - mu) g + mu B  if nesterov else B
    O <- NS_5(U / ||U||)                      (in ns_dtype; on U^T when U is taller than wide)
    theta <- theta (1 - gamma lambda) - adjust(gamma, shape) O
adjust: "original" gamma sqrt(max(1, A/B)); "match_rms_adamw" 0.2 gamma sqrt(max(A, B)).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # torch.optim.Muon's defaults (Keller Jordan's quintic)
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(update: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = EPS,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The approximate orthogonalisation U S' V^T of update [A, B] (S' ~ U(0.5, 1.5)), in `dtype`."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T                                                   # [B, A]: the Gram matrix is the small side
    x = x / x.norm().clamp(min=eps)                               # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T                                            # [min, min]
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)     # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)                       # a X + (b G + c G^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape) -> float:
    A, B = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    return lr


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update with the Newton-Schulz iteration in `ns_dtype` (see the module
    docstring). Same arguments and defaults as torch.optim.Muon, plus ns_dtype; the state is
    torch's too ("momentum_buffer" per parameter), so checkpoints load in either class."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = EPS, ns_steps: int = NS_STEPS,
                 adjust_lr_fn: Optional[str] = None, ns_dtype: torch.dtype = torch.float32):
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn: {adjust_lr_fn!r} is not one of None, 'original', 'match_rms_adamw'")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon optimises 2-D parameters only; got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
