"""Capacity planner: how many tokens, how many bytes, how many hours, before anything runs.

Everything here is arithmetic on the params profile plus a few stated throughput assumptions
(measured on the 2-core CPU for the local profile; derived from FLOPs and an assumed model FLOP
utilisation for GPU boxes). It imports nothing heavy so `eagle3 plan` answers at once.

Tokens per conversation are measured when the run's data stage has run with the same data params
(`data/stats.json`, read by `stats.load_stats`), else estimated from the constants below.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .layout import RunLayout
from .params import Params
from .stats import DataStats, load_stats as load_data_stats

# Mean tokens of one ShareGPT conversation after the chat template (measured on SmolLM2's
# tokenizer over the first 2,000 records, see NOTES.md); truncation caps it at max_length.
SHAREGPT_MEAN_TOKENS = 1100
# Regenerated chats: the prompt (system + first user turn) plus the capped answer.
REGEN_PROMPT_TOKENS = 120

# Throughputs measured on this 2-core CPU (DEVELOPERS.md, NOTES.md), tokens per second, on a host
# with native bf16 (AVX512-BF16/AMX). An AVX2-only host is far slower: NOTES.md, seventh session.
CPU_EXTRACT_TOKENS_PER_S = 3400      # bf16 forward with hidden states, SmolLM2, 8 x 256
CPU_TRAIN_TOKENS_PER_S = 800         # drafter training goal/measure at ttt_steps 7 (H=576)
CPU_REGEN_TOKENS_PER_S = 400         # vLLM CPU batched generation (SmolLM2), see NOTES.md

# GPU assumptions for a big box (stated, not measured here).
GPU_BF16_FLOPS = 2.25e15             # dense bf16 per B300-class GPU
MFU_EXTRACT = 0.30                   # forward-only, MoE, vLLM/TP or well-fed transformers
MFU_TRAIN = 0.30
MFU_REGEN = 0.10                     # decoding is memory-bound; a low utilisation is realistic


@dataclass
class Shape:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    active_params: float              # parameters touched per token (MoE: active experts)
    num_gpus: int
    name: str


KNOWN_ACTIVE_PARAMS = {576: 135e6, 7168: 32e9}  # SmolLM2-135M; Kimi-K2.5-class (32B active of 1T)


def target_shape(p: Params) -> Shape:
    s = p.target_shape() or {}
    h = s["hidden_size"]
    active = KNOWN_ACTIVE_PARAMS.get(h) or 12 * s["num_hidden_layers"] * h * h + 2 * s["vocab_size"] * h
    # A profile that asks for CUDA plans for its GPUs (extraction with device_map="auto" uses
    # the whole node, training uses train.nproc ranks); "auto"/"cpu" plan for this CPU.
    gpus = max(p.extract.nproc, p.train.nproc) if p.extract.device == "cuda" else 0
    return Shape(s["num_hidden_layers"], h, s["vocab_size"], s.get("intermediate_size", 4 * h),
                 active, gpus, p.target.path)


def drafter_params(shape: Shape, draft_vocab: int) -> float:
    """Trainable parameters of the one-layer drafter (fc, attention on 2H, SwiGLU MLP, lm_head)."""
    h, i = shape.hidden_size, shape.intermediate_size
    fc = 3 * h * h
    attn = 2 * h * h * 2 + 2 * h * h // 2 + h * h  # q and k/v (kv heads <= heads) on 2H, o_proj
    mlp = 3 * h * i
    return fc + attn + mlp + draft_vocab * h


def train_conversations(p: Params) -> int:
    return p.data.num_train or 17_671 - p.data.num_eval


def regenerated_conversations(p: Params, n_conv: int) -> int:
    """How many of the n_conv training chats get the target's answers (data.regen_num_train)."""
    if not p.data.regenerate:
        return 0
    return n_conv if p.data.regen_num_train is None else min(n_conv, p.data.regen_num_train)


def measured_stats(run: RunLayout | str | os.PathLike) -> Optional[DataStats]:
    """The run's data stats (`stats.load_stats`), or None before its data stage has run."""
    layout = run if isinstance(run, RunLayout) else RunLayout(run)
    return load_data_stats(layout.root) if layout.stats.is_file() else None


def uses_measured_tokens(p: Params, stats: Optional[DataStats]) -> bool:
    """Whether `stats` measured this profile's data: same data params, and a non-empty train set."""
    return (stats is not None and stats.cache_key.get("data_hash") == p.section_hash("data")
            and stats.train.conversations > 0)


def tokens_per_conversation(p: Params, stats: Optional[DataStats] = None) -> float:
    """Mean tokens of one training sequence: measured (stats.json) when `stats` describe this
    profile's data, else estimated from the ShareGPT mean and the regeneration settings."""
    if uses_measured_tokens(p, stats):
        return stats.train.tokens / stats.train.conversations
    original = min(p.data.max_length, SHAREGPT_MEAN_TOKENS)
    if not p.data.regenerate:
        return original
    regenerated = min(p.data.max_length, REGEN_PROMPT_TOKENS + p.data.regen_max_new_tokens * p.data.regen_max_turns)
    n_conv = train_conversations(p)
    n_regen = regenerated_conversations(p, n_conv)
    return (n_regen * regenerated + (n_conv - n_regen) * original) / n_conv


def memory_plan(p: Params) -> dict:
    """Per-GPU training memory (eagle3lib/memory.py) at data.max_length and at 2,048 / 4,096-token
    sequences (each at most train.batch_tokens): {seq_len: MemoryEstimate.as_dict()
    plus "fits" (None without train.gpu_memory_gb) and "problem"}."""
    from . import memory   # imports torch and runs the drafter on the meta device: `import plan` stays light
    out = {}
    for seq in sorted({p.data.max_length, 2048, 4096}):
        if seq > p.train.batch_tokens:
            continue
        est = memory.estimate(p, seq)
        problem = memory.fit_problem(p, est)
        out[seq] = {**est.as_dict(), "fits": None if p.train.gpu_memory_gb is None else problem is None,
                    "problem": problem}
    return out


def capacity_plan(p: Params, stats: Optional[DataStats] = None, memory: bool = True) -> dict:
    """The plan as a flat dict of named quantities (bytes, tokens, seconds); `stats`: the run's
    measured data stats (measured_stats), used when they match the profile's data params.
    memory: add "memory" (memory_plan: seconds of meta-device work, and a torch import)."""
    shape = target_shape(p)
    n_conv = train_conversations(p)
    tok_per_conv = tokens_per_conversation(p, stats)
    tokens = n_conv * tok_per_conv
    elem = 2 if p.extract.dtype in ("bfloat16", "float16") else 4
    bytes_per_token = elem * 4 * shape.hidden_size + 4 + 1  # aux (3H) + final (H), ids int32, mask u8
    cache_bytes = tokens * bytes_per_token
    draft_p = drafter_params(shape, p.data.draft_vocab_size)
    steps = p.train.ttt_steps
    regen_tokens = regenerated_conversations(p, n_conv) * p.data.regen_max_new_tokens * p.data.regen_max_turns
    if shape.num_gpus == 0:  # this CPU: measured throughputs
        extract_tps = CPU_EXTRACT_TOKENS_PER_S
        train_tps = CPU_TRAIN_TOKENS_PER_S * 7 / steps
        regen_tps = CPU_REGEN_TOKENS_PER_S
        basis = "measured on the 2-core CPU"
    else:  # FLOP-based: 2 FLOPs/param/token forward, x3 for training, per TTT step
        flops = shape.num_gpus * GPU_BF16_FLOPS
        extract_tps = flops * MFU_EXTRACT / (2 * shape.active_params)
        train_flops_per_token = steps * 6 * draft_p + 2 * p.data.draft_vocab_size * shape.hidden_size
        train_tps = flops * MFU_TRAIN / train_flops_per_token
        regen_tps = flops * MFU_REGEN / (2 * shape.active_params)
        basis = f"{shape.num_gpus} GPUs x {GPU_BF16_FLOPS / 1e15:.2f} PFLOP/s bf16 at the stated MFU"
    epochs = p.train.epochs
    plan = {
        "target": shape.name,
        "layers": shape.num_hidden_layers,
        "hidden_size": shape.hidden_size,
        "vocab_size": shape.vocab_size,
        "aux_layers": p.aux_layer_ids(),
        "train_conversations": n_conv,
        "tokens_per_conversation": round(tok_per_conv, 1),
        "tokens_basis": "measured (data/stats.json)" if uses_measured_tokens(p, stats) else "estimated",
        "tokens_to_extract": int(tokens),
        "cache_bytes_per_token": bytes_per_token,
        "cache_bytes": int(cache_bytes),
        "drafter_params": int(draft_p),
        "regen_tokens": int(regen_tokens),
        "regen_hours": regen_tokens / regen_tps / 3600,
        "extract_tokens_per_s": extract_tps,
        "extract_hours": tokens / extract_tps / 3600,
        "train_tokens_per_s": train_tps,
        "train_hours": tokens * epochs / train_tps / 3600,
        "throughput_basis": basis,
        "gpu_memory_gb": p.train.gpu_memory_gb,
    }
    if memory:
        plan["memory"] = memory_plan(p)
    return plan


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} EB"


def format_plan(plan: dict) -> str:
    rows = [
        ("target", plan["target"]),
        ("shape", f"{plan['layers']} layers, hidden {plan['hidden_size']}, vocab {plan['vocab_size']}"),
        ("aux layers", plan["aux_layers"]),
        ("train conversations", f"{plan['train_conversations']:,}"),
        ("tokens to extract", f"{plan['tokens_to_extract']:,} ({plan['tokens_per_conversation']} / conversation, "
                              f"{plan['tokens_basis']})"),
        ("cache bytes / token", f"{plan['cache_bytes_per_token']:,}"),
        ("hidden-state cache", human_bytes(plan["cache_bytes"])),
        ("drafter parameters", f"{plan['drafter_params'] / 1e6:,.1f} M"),
        ("regeneration", f"{plan['regen_tokens']:,} tokens, {plan['regen_hours']:.2f} h"),
        ("extraction", f"{plan['extract_tokens_per_s']:,.0f} tok/s, {plan['extract_hours']:.2f} h"),
        ("training", f"{plan['train_tokens_per_s']:,.0f} tok/s, {plan['train_hours']:.2f} h"),
        ("throughput basis", plan["throughput_basis"]),
    ]
    rows += memory_rows(plan)
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def memory_rows(plan: dict) -> list:
    """(label, text) rows of the per-GPU memory: each item with its basis, the peak, the verdict."""
    rows = []
    budget = plan.get("gpu_memory_gb")
    for seq, m in plan.get("memory", {}).items():
        label = f"memory @ {m['sequences']} x {seq}"
        rows.append((label, f"peak {human_bytes(m['peak_bytes'])} per GPU ({m['ranks']} ranks, {m['device']} kernels)"
                     + ("" if budget is None else f", {m['peak_bytes'] / (budget * 1e9):.0%} of {budget:g} GB")))
        for item in m["items"]:
            rows.append((f"  {item['name']}", f"{human_bytes(item['bytes'])}  [{item['basis']}]"))
        rows.append(("  step peak", f"{human_bytes(m['step_peak'])}  [measured (meta)]"))
        if m["problem"]:
            rows.append(("  DOES NOT FIT", m["problem"]))
    return rows

