"""The EAGLE-3 drafter: Llama decoder layer(s) fed by fused auxiliary target states.

Follows ../shared/docs/eagle3.md and mirrors vLLM 0.32's `llama_eagle3.py` so that a drafter
trained here computes the same function inside vLLM. What vLLM computes (read from
vllm/model_executor/models/llama_eagle3.py and vllm/v1/spec_decode/llm_base_proposer.py):

  combine_hidden_states:  g = fc(input_norm(a) if norm_before_fc else a),  a = [a_low; a_mid; a_high]
  layer 0 (`midlayer`; vLLM's layers.0):
      e = input_layernorm(embed(x))
      norm_before_residual: n = hidden_norm(g); residual = n        (speculators layout default)
      else:                 residual = g;  n = hidden_norm(g)        (original EAGLE-3 layout default)
      x2 = cat([e, n], -1)                  # NOTE the order: EMBEDDING FIRST, then the hidden state
      residual = self_attn(x2) + residual;  h = residual + mlp(post_attention_layernorm(residual))
  layers 1..L-1 (`later_layers`, num_hidden_layers > 1; vLLM's layers.i): plain pre-norm Llama
      layers over H inputs, no embedding:  residual = h;  residual = self_attn(input_layernorm(h))
      + residual;  h = residual + mlp(post_attention_layernorm(residual))
  final:  h ("hidden_prenorm");  logits = lm_head(norm(h))
  next drafting step receives h (pre-norm) unless config.norm_output, then norm(h).
  The first drafting step at position t gets (g_t, x_{t+1}) at rope position t (input ids are
  shifted left by one, positions unchanged); step j gets (h from step j-1, its own sampled
  token) at position t+j. Later steps do NOT go through fc again. Each layer keeps its own
  keys/values of every drafting step.

This module takes tensors only: no trainer, cache files or file formats.
Shapes: B batch, T new positions, S cached positions, H hidden, V target vocab,
Dv draft vocab, h/kv query/key-value heads, d head_dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from .vocab import draft_to_target_ids

# TTT attention formulations (see ttt_attention); all compute the same function.
ATTENTION_IMPLS = ("mask", "merge", "manual", "chunked", "flex")
ATTENTION_CHOICES = ("auto",) + ATTENTION_IMPLS     # train.attention
QUERY_BLOCK = 512                                   # queries per block of the "chunked" formulation


@dataclass
class Eagle3Config:
    """Everything needed to rebuild the drafter; JSON-serialisable (dataclasses.asdict)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]          # None or transformers' rope_parameters (rope_type != default)
    max_position_embeddings: int
    vocab_size: int                       # TARGET vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list = field(default_factory=list)
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    next_step_hidden: str = "pre_norm"    # pre_norm (vLLM default) | post_norm (vLLM norm_output)
    hidden_act: str = "silu"
    num_hidden_layers: int = 1            # decoder layers of the drafter (vLLM llama_eagle3 loads >= 1)

    def __post_init__(self):
        if self.next_step_hidden not in ("pre_norm", "post_norm"):
            raise ValueError(f"next_step_hidden must be pre_norm or post_norm, got {self.next_step_hidden!r}")
        if int(self.num_hidden_layers) < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only silu (Llama SwiGLU) is implemented")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must hold 3 layer ids, got {self.aux_layer_ids!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size != self.target_hidden_size:
            # vLLM asserts hidden_states.shape[-1] == embeds.shape[-1]: the embedding is the target's.
            raise ValueError(f"hidden_size {self.hidden_size} must equal target_hidden_size "
                             f"{self.target_hidden_size} (the drafter shares the target's embedding)")

    @classmethod
    def from_target_config(cls, hf_config, draft_vocab_size: int, aux_layer_ids, **choices) -> "Eagle3Config":
        """Drafter config from the target's HF config (a multimodal wrapper's text_config is used).
        `choices` overrides any field (norm_before_residual, norm_before_fc, next_step_hidden, ...)."""
        if isinstance(hf_config, dict):   # a parsed config.json
            c = hf_config.get("text_config") or hf_config
        else:
            c = getattr(hf_config, "text_config", None) or hf_config
        get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        heads = get("num_attention_heads")
        rope = dict(get("rope_parameters") or {})          # transformers 5.x
        legacy = get("rope_scaling")                         # transformers 4.x
        if not rope and isinstance(legacy, dict):
            rope = dict(legacy)
        theta = rope.pop("rope_theta", None) or get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        kw = dict(
            hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=get("max_position_embeddings", 4096),
            vocab_size=get("vocab_size"), draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=get("hidden_size"), aux_layer_ids=[int(i) for i in aux_layer_ids],
            hidden_act=get("hidden_act", "silu"))
        kw.update(choices)
        return cls(**kw)


class DraftKVCache:
    """Keys/values of each drafter layer: k[layer], v[layer] [B, kv, S, d] (keys after rotary)."""

    def __init__(self):
        self.k: dict = {}
        self.v: dict = {}

    @property
    def length(self) -> int:
        return 0 if not self.k else self.k[0].shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Add layer `layer`'s k, v [B, kv, T, d]; return everything it cached [B, kv, S+T, d]."""
        self.k[layer] = k if layer not in self.k else torch.cat([self.k[layer], k], dim=2)
        self.v[layer] = v if layer not in self.v else torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    def crop(self, n: int) -> None:
        """Keep the first n positions of every layer (drop rejected draft steps)."""
        for layer in self.k:
            self.k[layer], self.v[layer] = self.k[layer][:, :, :n], self.v[layer][:, :, :n]


# ---- building blocks ----------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Llama RMSNorm (computed in fp32, as transformers and vLLM do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with the target's settings (neox / rotate-half style, as Llama)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        d = config.head_dim
        if config.rope_scaling is None:
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            scale = 1.0
        else:  # linear / llama3 / yarn / ...: transformers' own init functions
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            rope = {**config.rope_scaling, "rope_theta": config.rope_theta}
            rope_type = rope.get("rope_type", rope.get("type"))
            if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
                raise ValueError(f"rope type {rope_type!r} is not supported by the drafter")
            hf = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                             head_dim=d, max_position_embeddings=config.max_position_embeddings,
                             rope_parameters=rope)
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [d/2]
        self.scale = float(scale)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, sin [B, 1, T, d] (fp32)."""
        freqs = position_ids.float()[..., None] * self.inv_freq          # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)                           # [B, T, d]
        return (emb.cos() * self.scale)[:, None], (emb.sin() * self.scale)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, 1, T, d]."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read 2H inputs ([embedding; hidden]) in layer 0, H in later layers."""

    def __init__(self, config: Eagle3Config, input_size: Optional[int] = None):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        qkv_in = 2 * H if input_size is None else input_size
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(qkv_in, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(qkv_in, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(qkv_in, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, H, bias=False)

    def qkv(self, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x2 [B, T, 2H] (layer 0) or [B, T, H] -> q [B, h, T, d], k/v [B, kv, T, d] (q and k rotated)."""
        B, T, _ = x2.shape
        q = self.q_proj(x2).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x2).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x2).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, kv, S, d] -> [B, h, S, d] (grouped-query attention)."""
        rep = self.n_heads // self.n_kv
        return x if rep == 1 else x.repeat_interleave(rep, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, h, T, d] -> [B, T, H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """vLLM's `midlayer` (layers.0). The attention itself is done by the caller (cache or TTT)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(config)

    def attention_input(self, hidden: torch.Tensor, embeds: torch.Tensor):
        """hidden, embeds [B, T, H] -> x2 [B, T, 2H] = [input_layernorm(e); hidden_norm(g)], residual [B, T, H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_out (after o_proj), residual [B, T, H] -> h [B, T, H] (pre final norm)."""
        residual = attn_out + residual
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3LaterLayer(nn.Module):
    """vLLM's layers.i for i >= 1: a plain pre-norm Llama layer over H inputs (no embedding, no
    hidden_norm). Same interface as Eagle3DecoderLayer, so the caller runs every layer alike."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(config, input_size=H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(config)

    def attention_input(self, hidden: torch.Tensor, embeds: Optional[torch.Tensor] = None):
        """hidden [B, T, H] (the previous layer's pre-norm output) -> x [B, T, H], residual [B, T, H]."""
        return self.input_layernorm(hidden), hidden

    finish = Eagle3DecoderLayer.finish


# ---- attention over the TTT layout --------------------------------------------------------
def resolve_attention(choice: str, device) -> str:
    """train.attention -> the formulation used on `device`. "auto": "manual" on CPU (the fastest
    measured on the 2-core machine at the local profile's shapes, bench/train.py, NOTES.md);
    "flex" elsewhere, chosen by memory (never materialises T x T scores), not by a measurement."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention {choice!r}: expected one of {ATTENTION_CHOICES}")
    if choice != "auto":
        return choice
    return "manual" if torch.device(device).type == "cpu" else "flex"


def _manual_block(q, k0, v0, kd_s, vd_s, offset: int, scale: float):
    """One explicit softmax over [causal step-0 scores | j diagonal scores] for queries at
    positions offset..offset+C-1. q [B, h, C, d]; k0, v0 [B, h, S, d] with S = offset + C (the keys
    those queries can see); kd_s, vd_s [B, h, C, j, d]. Returns [B, h, C, d]."""
    C, S = q.shape[2], k0.shape[2]
    blocked = torch.ones(C, S, dtype=torch.bool, device=q.device).triu(offset + 1)    # key > query
    s_c = (q @ k0.transpose(-1, -2) * scale).masked_fill(blocked, float("-inf"))      # [B, h, C, S]
    s_diag = (q.unsqueeze(3) * kd_s).sum(-1) * scale                                   # [B, h, C, j]
    p = torch.softmax(torch.cat([s_c, s_diag], dim=-1).float(), dim=-1).to(q.dtype)   # [B, h, C, S+j]
    return p[..., :S] @ v0 + (p[..., S:].unsqueeze(-1) * vd_s).sum(3)


def _chunked(q, k0, v0, kd_s, vd_s, scale: float, block: int):
    """_manual_block over query blocks of `block` rows; with grad enabled each block runs under
    torch.utils.checkpoint, so its [B, h, block, <=T] scores are freed after the forward and
    recomputed in the backward (only views of q/k0/v0/kd/vd are kept)."""
    T = q.shape[2]
    outs = []
    for start in range(0, T, block):
        end = min(T, start + block)
        args = (q[:, :, start:end], k0[:, :, :end], v0[:, :, :end], kd_s[:, :, start:end], vd_s[:, :, start:end],
                start, scale)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_manual_block, *args, use_reentrant=False))
        else:
            outs.append(_manual_block(*args))
    return torch.cat(outs, dim=2)


def _merge_diagonal(o_c, lse_c, q, kd_s, vd_s, scale: float):
    """Merge the causal step-0 attention (output o_c [B, h, T, d], log-sum-exp of its scores
    lse_c [B, h, T, 1] fp32) with the j diagonal terms (kd_s, vd_s [B, h, T, j, d]) by log-sum-exp."""
    s_diag = (q.unsqueeze(3) * kd_s).sum(-1) * scale                                  # [B, h, T, j]
    lse_all = torch.logsumexp(torch.cat([lse_c, s_diag.float()], dim=-1), dim=-1, keepdim=True)
    w_c = torch.exp(lse_c - lse_all).to(q.dtype)                                      # [B, h, T, 1]
    w_d = torch.exp(s_diag.float() - lse_all).to(q.dtype)                             # [B, h, T, j]
    return w_c * o_c + (w_d.unsqueeze(-1) * vd_s).sum(3)


# flex_attention of the "flex" formulation. Training batches vary in B and T (batches.bucket_batches),
# so flex is compiled once per process with dynamic shapes: B and T are symbols from the first call,
# and the only recompilations left are those the guards ask for (B = 1, a single 128-block, grad
# mode, inductor's short-query kernel choice). Its own recompile limit (isolate_recompiles: no other
# compilation of flex_attention counts against it) with fullgraph=True turns a runaway into an error
# (FailOnRecompileLimitHit) instead of a silent fall-back to eager flex, which materialises the
# T x T scores. Backend per device type: inductor's fused kernel on GPUs; on CPU inductor's flex
# cannot return the log-sum-exp, so the "eager" backend (the same tracing and guards, PyTorch's
# materialising reference math, no backward).
FLEX_BLOCK = 128                      # flex_attention's default sparse block (query and key)
FLEX_RECOMPILE_LIMIT = 16
FLEX_BACKENDS = {"cpu": "eager"}      # device type -> torch.compile backend; any other: "inductor"
_compiled_flex: dict = {}             # backend -> the compiled flex_attention


def compiled_flex(device):
    """flex_attention compiled for `device`'s type (see FLEX_BACKENDS), once per process and backend."""
    backend = FLEX_BACKENDS.get(torch.device(device).type, "inductor")
    if backend not in _compiled_flex:
        _compiled_flex[backend] = torch.compile(flex_attention, backend=backend, dynamic=True, fullgraph=True,
                                                recompile_limit=FLEX_RECOMPILE_LIMIT, isolate_recompiles=True)
    return _compiled_flex[backend]


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def causal_block_mask(T, device, block: int = FLEX_BLOCK) -> BlockMask:
    """The causal BlockMask of T queries over T keys, built from its block structure; the same
    blocks as create_block_mask(_causal, None, None, T, T): query block i sees key blocks 0..i-1
    whole ("full": no mask_mod) and block i through the mask_mod; a last query block with fewer than
    `block` rows sees all its key blocks through the mask_mod. Costs O((T / block)^2) integers, never
    the [T, T] boolean mask create_block_mask evaluates, and has no Python branch on T, so a compiled
    TTT forward (train.compile) traces it with a symbolic T instead of specialising on it."""
    n = (T + block - 1) // block                                                 # blocks per axis
    i = torch.arange(n, device=device, dtype=torch.int32)                        # [n]
    whole = (i + 1) * block <= T                                                 # [n]: query block i has `block` rows
    full_num = torch.where(whole, i, 0)                                          # [n]
    partial_num = torch.where(whole, 1, i + 1)                                   # [n]
    diagonal_first = (i[None, :] + i[:, None]) % n                               # [n, n]: row i starts with block i
    partial = torch.where(whole[:, None], diagonal_first, i[None, :])            # [n, n]
    full = i[None, :].expand(n, n)                                               # [n, n]: row i uses 0..i-1
    return BlockMask.from_kv_blocks(partial_num[None, None], partial[None, None].contiguous(),
                                    full_num[None, None], full[None, None].contiguous(), BLOCK_SIZE=block,
                                    mask_mod=_causal, seq_lengths=(T, T))


def _flex_causal(q, k0, v0, mask_cache: Optional[dict]):
    """Causal attention of q over k0/v0 [B, h, T, d] with flex_attention -> (o_c [B, h, T, d],
    lse_c [B, h, T, 1] fp32). Outside torch.compile: compiled_flex with the block mask cached per
    (T, device); inside a compiled TTT forward flex is traced into the caller's graph and the mask
    is built there (a cache lookup keyed by T would specialise that graph on T)."""
    T = q.shape[2]
    if torch.compiler.is_compiling():
        o_c, aux = flex_attention(q, k0, v0, block_mask=causal_block_mask(T, q.device),
                                  return_aux=AuxRequest(lse=True))
        return o_c, aux.lse.unsqueeze(-1).float()
    key = ("flex", T, q.device)
    block_mask = None if mask_cache is None else mask_cache.get(key)
    if block_mask is None:
        block_mask = causal_block_mask(T, q.device)
        if mask_cache is not None:
            if len(mask_cache) > 64:          # many distinct lengths: keep the cache bounded
                mask_cache.clear()
            mask_cache[key] = block_mask
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k0.requires_grad):
        raise NotImplementedError("flex attention has no backward on CPU (PyTorch's FlexAttention): train with "
                                  "train.attention auto, manual or chunked on CPU, flex on GPUs")
    o_c, aux = compiled_flex(q.device)(q, k0, v0, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    return o_c, aux.lse.unsqueeze(-1).float()


def ttt_attention(q, k0, v0, kd, vd, impl: str = "manual", mask_cache: Optional[dict] = None,
                  block: int = QUERY_BLOCK):
    """Attention of one TTT step j >= 0.

    q [B, h, T, d]: queries of step j at positions 0..T-1.
    k0, v0 [B, h, T, d]: step-0 keys/values (each query t sees positions <= t).
    kd, vd: lists of j tensors [B, h, T, d], keys/values of steps 1..j (query t sees only t's).
    Returns [B, h, T, d]. All formulations compute the same function; what they cost (per step,
    beyond the q/k/v every one keeps; j diagonal terms cost O(T j d) in all of them):
      manual   one softmax over [T x T causal scores | T x j diagonal]: the fp32 scores and
               probabilities [B, h, T, T] are saved for backward (fastest on the 2-core CPU).
      merge    sdpa for the causal output, its log-sum-exp recomputed from explicit T x T scores,
               merged with the diagonal terms: saves T x T scores too.
      mask     sdpa over all (j+1)T keys with a boolean [T, (j+1)T] mask: sdpa's math path on CPU
               materialises [B, h, T, (j+1)T]; the keys are concatenated (a copy per step).
      chunked  manual over query blocks of `block` rows, each under activation checkpointing:
               saves no scores; peak [B, h, block, T] per block; costs a recompute of the block's
               scores in backward (about +1 attention forward) and skips key blocks above the diagonal.
      flex     flex_attention (compiled_flex: dynamic shapes, one graph for every (B, T) but a few)
               for the causal part with its log-sum-exp, merged with the diagonal terms: saves only
               o_c and lse_c [B, h, T] (flash-style kernel, no T x T anywhere on CUDA); on CPU it
               runs PyTorch's materialising reference, no backward.
    """
    B, h, T, d = q.shape
    scale = 1.0 / math.sqrt(d)
    j = len(kd)
    if j == 0:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    if impl == "mask":
        # keys of all steps concatenated along the sequence axis; prebuilt boolean block mask
        # [T, (j+1)T]: causal over the step-0 block, the diagonal of every later block.
        key = (T, j, q.device)
        mask = None if mask_cache is None else mask_cache.get(key)
        if mask is None:
            eye = torch.eye(T, dtype=torch.bool, device=q.device)
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            mask = torch.cat([causal] + [eye] * j, dim=1)
            if mask_cache is not None:
                if len(mask_cache) > 64:      # many distinct lengths: keep the cache bounded
                    mask_cache.clear()
                mask_cache[key] = mask
        k = torch.cat([k0, *kd], dim=2)
        v = torch.cat([v0, *vd], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    kd_s = torch.stack(kd, dim=3)                                  # [B, h, T, j, d]
    vd_s = torch.stack(vd, dim=3)                                  # [B, h, T, j, d]
    if impl == "merge":
        # step-0 part with the fused causal kernel, merged with the diagonal terms via its logsumexp
        o_c = F.scaled_dot_product_attention(q, k0, v0, is_causal=True)                # [B, h, T, d]
        causal_blocked = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        s_c = (q @ k0.transpose(-1, -2) * scale).masked_fill(causal_blocked, float("-inf"))
        lse_c = torch.logsumexp(s_c.float(), dim=-1, keepdim=True)                      # [B, h, T, 1]
        return _merge_diagonal(o_c, lse_c, q, kd_s, vd_s, scale)
    if impl == "manual":
        return _manual_block(q, k0, v0, kd_s, vd_s, 0, scale)
    if impl == "chunked":
        return _chunked(q, k0, v0, kd_s, vd_s, scale, block)
    if impl == "flex":
        o_c, lse_c = _flex_causal(q, k0, v0, mask_cache)
        return _merge_diagonal(o_c, lse_c, q, kd_s, vd_s, scale)
    raise ValueError(f"attention impl {impl!r}: expected one of {ATTENTION_IMPLS}")


# ---- the drafter ----------------------------------------------------------------------------
class Eagle3Drafter(nn.Module):
    """Parameter names follow vLLM's EAGLE-3 Llama drafter (see vllm-format.md)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        H, V, Dv = config.hidden_size, config.vocab_size, config.draft_vocab_size
        fc_in = 3 * config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = RMSNorm(fc_in, config.rms_norm_eps)     # vLLM: model.input_norm
        self.fc = nn.Linear(fc_in, H, bias=False)
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)                 # the target's, frozen
        self.midlayer = Eagle3DecoderLayer(config)                      # vLLM's layers.0
        self.later_layers = nn.ModuleList(Eagle3LaterLayer(config)      # vLLM's layers.1 ..
                                          for _ in range(int(config.num_hidden_layers) - 1))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Dv, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(Dv, dtype=torch.int64))          # target = i + d2t[i]
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        # Training-only settings (train.attention / train.activation_checkpointing); none changes the function.
        self.attention_impl = "manual"       # TTT attention formulation (ttt_attention, resolve_attention)
        self.attention_block = QUERY_BLOCK   # query block of the "chunked" formulation
        self.activation_checkpointing = False  # recompute each TTT step's layer in backward
        self._mask_cache: dict = {}
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
                             f"the config ({tuple(self.d2t.shape)}, {tuple(self.t2d.shape)})")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    # -- pieces shared by inference and TTT --
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, 3H] (or [B, T, 3, H]) -> g [B, T, H]."""
        if aux.dim() == 4:
            aux = aux.flatten(-2)
        if not torch.is_autocast_enabled(aux.device.type):   # under autocast fc casts the bf16 cache itself
            aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T, H] (pre-norm layer output) -> (logits [B, T, Dv], next_hidden [B, T, H])."""
        normed = self.norm(h)
        nxt = h if self.config.next_step_hidden == "pre_norm" else normed
        return self.lm_head(normed), nxt

    @property
    def layers(self) -> list:
        """The decoder layers in order: [midlayer, *later_layers] (vLLM's layers.0 ..)."""
        return [self.midlayer, *self.later_layers]

    # -- inference --
    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: Optional[DraftKVCache] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, H] (g, or the previous step's next_hidden), input_ids/position_ids [B, T].
        Each layer attends to everything it cached plus the T new positions causally and appends
        them to `cache`. Returns (logits [B, T, Dv] over the draft vocabulary, next_hidden [B, T, H])."""
        embeds = self.embed_tokens(input_ids)                          # [B, T, H]
        cos, sin = self.rotary(position_ids)
        h = hidden
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x, residual = layer.attention_input(h, embeds)             # x [B, T, 2H] (layer 0) or [B, T, H]
            q, k, v = attn.qkv(x, cos, sin)
            if cache is not None:
                k, v = cache.append(k, v, i)                           # [B, kv, S+T, d]
            T, S_all = q.shape[2], k.shape[2]
            k, v = attn.expand_kv(k), attn.expand_kv(v)                # [B, h, S+T, d]
            if T == 1:
                o = F.scaled_dot_product_attention(q, k, v)
            else:  # query i (absolute S+i) sees all cached keys and new keys <= i
                mask = torch.ones(T, S_all, dtype=torch.bool, device=q.device).tril(S_all - T)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = layer.finish(attn.out(o), residual)                    # [B, T, H] pre-norm
        return self.head(h)

    # -- training-time test --
    def ttt_hidden(self, aux: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
        """The parallel TTT unroll. aux [B, T, 3H] (or [B, T, 3, H]), input_ids [B, T] = x_0..x_{T-1}.
        Returns per step j the final-normed states [B, T, H] (feed to lm_head): step j at position t
        reads (h_{j-1,t} or g_t, x_{t+1+j}) at rope position t+j and predicts x_{t+2+j}.
        Positions whose input token lies beyond T read token id 0: their outputs are garbage but
        finite and the loss must mask them (t + 2 + j >= length).
        With activation_checkpointing (and grad enabled) each step's layers run under
        torch.utils.checkpoint: backward keeps only the step inputs and recomputes the rest."""
        B, T = input_ids.shape
        base_pos = torch.arange(T, device=input_ids.device).expand(B, T)
        hidden = self.fuse(aux)                                          # g [B, T, H]
        padded_ids = F.pad(input_ids, (0, ttt_steps))                    # [B, T + J], 0 past the end
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        past = [None] * len(self.layers)         # per layer: (k0, v0, [k_1..], [v_1..]) [B, h, T, d] each
        outs = []
        for j in range(ttt_steps):
            ids = padded_ids[:, j + 1: j + 1 + T]                        # x_{t+1+j}  [B, T]
            args = (hidden, ids, base_pos + j, past)
            if recompute:
                h, normed, new_kv = checkpoint(self._ttt_step, *args, use_reentrant=False)
            else:
                h, normed, new_kv = self._ttt_step(*args)
            past = [(k, v, [], []) if p is None else (p[0], p[1], p[2] + [k], p[3] + [v])
                    for p, (k, v) in zip(past, new_kv)]
            outs.append(normed)
            hidden = h if self.config.next_step_hidden == "pre_norm" else normed
        return outs

    def _ttt_step(self, hidden, ids, position_ids, past: list):
        """One TTT step through every layer. hidden [B, T, H], ids/position_ids [B, T]; past per layer
        None (step 0) or (k0, v0 [B, h, T, d] of step 0, kd, vd: the keys/values of steps 1..j-1).
        -> h [B, T, H] (pre-norm), normed [B, T, H], per layer this step's (k, v) [B, h, T, d]."""
        embeds = self.embed_tokens(ids)                                  # [B, T, H]
        cos, sin = self.rotary(position_ids)
        h, new_kv = hidden, []
        for layer, layer_past in zip(self.layers, past):
            attn = layer.self_attn
            x, residual = layer.attention_input(h, embeds)
            q, k, v = attn.qkv(x, cos, sin)
            k, v = attn.expand_kv(k), attn.expand_kv(v)                  # [B, h, T, d]
            if layer_past is None:
                o = ttt_attention(q, k, v, [], [], self.attention_impl, self._mask_cache, self.attention_block)
            else:
                k0, v0, kd, vd = layer_past
                o = ttt_attention(q, k0, v0, kd + [k], vd + [v], self.attention_impl, self._mask_cache,
                                  self.attention_block)
            h = layer.finish(attn.out(o), residual)                      # [B, T, H]
            new_kv.append((k, v))
        return h, self.norm(h), new_kv

    def ttt_forward(self, aux: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int,
                    attention_mask: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Logits per TTT step, each [B, T, Dv]. attention_mask [B, T] (1 = real token) must be
        right padding: causal attention then never lets a real position see padding."""
        if attention_mask is not None:
            m = attention_mask.bool()
            if (m[:, 1:] & ~m[:, :-1]).any():
                raise ValueError("ttt_forward: attention_mask must be right padding (ones, then zeros)")
        return [self.lm_head(s) for s in self.ttt_hidden(aux, input_ids, ttt_steps)]

    # -- training choices (same function, different cost) --
    def configure_training(self, attention: str, activation_checkpointing: bool, device) -> None:
        """train.attention (resolved for `device`, see resolve_attention) and
        train.activation_checkpointing; the trainer and the memory model both call this."""
        self.attention_impl = resolve_attention(attention, device)
        self.activation_checkpointing = activation_checkpointing

    # -- vocabulary and weights --
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids (any shape) -> target ids."""
        return draft_ids + self.d2t[draft_ids]

    def with_draft_rows(self, rows: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> "Eagle3Drafter":
        """A copy whose head keeps only draft ids `rows` [Dv'] (vocab.shrink_draft_vocab gives rows,
        d2t [Dv'] and t2d [V]); every other weight is copied unchanged. Its logits are this
        drafter's logits[..., rows]."""
        small = type(self)(replace(self.config, draft_vocab_size=int(rows.numel()))).to(self.fc.weight.dtype)
        state = {**self.state_dict(), "lm_head.weight": self.lm_head.weight.detach()[rows],   # [Dv', H]
                 "d2t": d2t.to(torch.int64), "t2d": t2d.to(torch.bool)}
        small.load_state_dict(state)
        return small.train(self.training)

    @classmethod
    def from_target_weights(cls, config: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor,
                            embed: torch.Tensor, lm_head: Optional[torch.Tensor] = None) -> "Eagle3Drafter":
        """A fresh drafter with the target's frozen embedding embed [V, H] and, when lm_head [V, H]
        is given, the target's head rows of the draft tokens as its own head (target.py loads both
        from a checkpoint: `load_target_tensors(path)`)."""
        if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"target embedding {tuple(embed.shape)} does not match the config "
                             f"({config.vocab_size}, {config.hidden_size})")
        model = cls(config)
        model.set_vocab(d2t, t2d)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed.float())
            if lm_head is not None:
                model.lm_head.weight.copy_(lm_head[draft_to_target_ids(model.d2t)].float())
        return model
