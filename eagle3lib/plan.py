"""Capacity planner: how many tokens, how many bytes, how many hours, before anything runs.

Everything here is arithmetic on the params profile plus a few stated throughput assumptions
(measured on the 2-core CPU for the local profile; derived from FLOPs and an assumed model FLOP
utilisation for GPU boxes). It imports nothing heavy so `eagle3 plan` answers at once.

Every figure says where it comes from ("measured" or "assumed"):
- chats: counted from the sources themselves (`count_sources`: read and normalised, duplicates
  dropped across sources, no tokenizer; cached per source content under outputs/source-counts/);
  a source not on this machine is assumed to give its max_records;
- tokens per conversation: measured when the run's data stage ran with the same data params
  (`data/stats.json`, read by `stats.load_stats`), else assumed from the constants below;
- rates: measured by this run folder's last run of the same backend (the data stage's regeneration
  tokens/s, metrics.json's extract and train tokens/s), else assumed (the CPU constants below, or
  FLOPs at a stated MFU on GPUs).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from .chats import MalformedRecord, chat_hash, iter_raw_records, normalize_chat, path_sha256, sources_of, source_problem
from .files import atomic_write_json, read_json
from .layout import RunLayout
from .params import Params, cpu_has_native_bf16
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
# The same stages on an AVX2-only host (no native bf16, so `dtype: auto` computes in fp32), NOTES.md:
# regeneration and extraction from the ninth session's fresh-clone `make pipeline` on the local
# profile (75 and 237 tok/s, partly under load); training: the local profile's trainer at ttt 4 on
# that run's cache, idle, 392 tok/s (= 224 at the ttt-7 basis below; NOTES.md, tenth session), after
# Muon's Newton-Schulz iteration moved to fp32 on such hosts (eagle3lib/muon.py; 42 tok/s before).
AVX2_CPU_RATES = {"regen": 80, "extract": 240, "train": 224}

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


# ---- chats the sources give ------------------------------------------------------------------
# Part of every cached count's key: bump it when chats.py's normalisation rules change.
SOURCE_COUNT_VERSION = 1


def _count_one(path: str, cap: Optional[int]) -> dict:
    """Read and normalise one source: {records_read, malformed {reason: n}, hashes [chat_hash of
    each valid chat, in order]} (duplicates are dropped by the caller, across sources)."""
    read, malformed, hashes = 0, {}, []
    for record in iter_raw_records(path, cap):
        read += 1
        try:
            hashes.append(chat_hash(normalize_chat(record)))
        except MalformedRecord as e:
            malformed[e.reason] = malformed.get(e.reason, 0) + 1
    return {"records_read": read, "malformed": dict(sorted(malformed.items())), "hashes": hashes}


def _cached_count(cache_dir: Path, path: str, cap: Optional[int]) -> dict:
    """_count_one, cached under `cache_dir` by the source's content sha256 and the cap."""
    key = hashlib.sha256(json.dumps([SOURCE_COUNT_VERSION, path_sha256(path), cap]).encode()).hexdigest()[:24]
    cache = cache_dir / f"{key}.json"
    if cache.is_file():
        return read_json(cache)
    counted = _count_one(path, cap)
    atomic_write_json(cache, counted)
    return counted


def count_sources(p: Params, cache_dir: Optional[Path] = None) -> list[dict]:
    """Per item of data.source, in order (as chats.load_chats reads them, data.max_records
    included): {item, source, basis, records_read, malformed, duplicates, chats}. `chats` are the
    valid chats it adds (duplicates of earlier chats dropped). basis "measured": counted here;
    "assumed": the source is not on this machine, its cap is taken as its chat count (None: no cap,
    counted as 0 and flagged)."""
    cache_dir = cache_dir or p.outputs_root() / "source-counts"
    seen, rows, budget = set(), [], p.data.max_records
    for src in sources_of(p.data.source):
        caps = [c for c in (src.max_records, budget) if c is not None]
        cap = min(caps) if caps else None
        row = {"item": src.item, "source": src.path, "cap": cap}
        if cap is not None and cap <= 0:
            rows.append({**row, "basis": "measured", "records_read": 0, "malformed": {}, "duplicates": 0, "chats": 0})
            continue
        problem = source_problem(src)
        if problem is not None:
            rows.append({**row, "basis": "assumed", "problem": problem, "records_read": cap, "malformed": {},
                         "duplicates": 0, "chats": cap or 0})
        else:
            counted = _cached_count(cache_dir, src.path, cap)
            fresh = [h for h in dict.fromkeys(counted["hashes"]) if h not in seen]
            seen.update(fresh)
            rows.append({**row, "basis": "measured", "records_read": counted["records_read"],
                         "malformed": counted["malformed"], "duplicates": len(counted["hashes"]) - len(fresh),
                         "chats": len(fresh)})
        if budget is not None:
            budget -= rows[-1]["records_read"] or 0
    return rows


def train_conversations(p: Params, sources: Optional[list] = None) -> int:
    """Training chats: the sources' chats minus the held-out ones, at most data.num_train (before
    the data stage drops prompts longer than data.max_length, which needs the tokenizer)."""
    sources = count_sources(p) if sources is None else sources
    available = sum(r["chats"] for r in sources) - p.data.num_eval
    return max(0, available if p.data.num_train is None else min(p.data.num_train, available))


def _basis(rows: list) -> str:
    kinds = {r["basis"] for r in rows}
    return "measured" if kinds == {"measured"} else "assumed" if kinds == {"assumed"} else "measured + assumed"


# ---- measured rates of this run folder ------------------------------------------------------
def measured_rates(p: Params, layout: RunLayout, stats: Optional[DataStats] = None) -> dict:
    """{"regen"|"extract"|"train": (tokens/s, where)} that this run folder's last run measured with
    the same backend and target (regeneration: stats of this profile's data params; training: the
    same ttt_steps); absent when not measured."""
    out = {}
    if uses_measured_tokens(p, stats) and stats.regen is not None and stats.regen.tokens_per_s_this_run \
            and p.data.regen_backend in ("auto", stats.regen.backend):   # stats of this profile's data
        out["regen"] = (stats.regen.tokens_per_s_this_run, f"data/stats.json ({stats.regen.backend})")
    ran = yaml.safe_load(layout.params.read_text()) if layout.params.is_file() else None
    metrics = read_json(layout.metrics) if layout.metrics.is_file() else {}
    if not isinstance(ran, dict) or ran.get("target", {}).get("path") != p.target.path:
        return out
    extract = metrics.get("extract", {}).get("tokens_per_s")
    if extract and ran.get("extract", {}).get("backend") == p.extract.backend:
        out["extract"] = (float(extract), f"metrics.json ({p.extract.backend} backend)")
    train = metrics.get("train", {}).get("train_tokens_per_s")
    if train and ran.get("train", {}).get("ttt_steps") == p.train.ttt_steps:
        out["train"] = (float(train), "metrics.json")
    return out


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


def tokens_per_conversation(p: Params, stats: Optional[DataStats] = None, n_conv: Optional[int] = None) -> float:
    """Mean tokens of one training sequence: measured (stats.json) when `stats` describe this
    profile's data, else estimated from the ShareGPT mean and the regeneration settings."""
    if uses_measured_tokens(p, stats):
        return stats.train.tokens / stats.train.conversations
    original = min(p.data.max_length, SHAREGPT_MEAN_TOKENS)
    if not p.data.regenerate:
        return original
    regenerated = min(p.data.max_length, REGEN_PROMPT_TOKENS + p.data.regen_max_new_tokens * p.data.regen_max_turns)
    n_conv = train_conversations(p) if n_conv is None else n_conv
    n_regen = regenerated_conversations(p, n_conv)
    return (n_regen * regenerated + (n_conv - n_regen) * original) / max(n_conv, 1)


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


def _rates(p: Params, shape: Shape, draft_p: float, measured: dict) -> tuple[dict, str]:
    """{"regen"|"extract"|"train": (tokens/s, "measured (...)" or "assumed (...)")} and the
    assumptions' basis: this run's measured rates where it has them, else the stated constants."""
    steps = p.train.ttt_steps
    if shape.num_gpus == 0:  # this CPU: rates measured once on the 2-core CPU (NOTES.md), assumed here
        if cpu_has_native_bf16():
            assumed = {"regen": CPU_REGEN_TOKENS_PER_S, "extract": CPU_EXTRACT_TOKENS_PER_S,
                       "train": CPU_TRAIN_TOKENS_PER_S * 7 / steps}
            basis = "measured on the 2-core CPU with native bf16"
        else:
            assumed = {**AVX2_CPU_RATES, "train": AVX2_CPU_RATES["train"] * 7 / steps}
            basis = "measured on the 2-core AVX2-only CPU (fp32)"
    else:  # FLOP-based: 2 FLOPs/param/token forward, x3 for training, per TTT step
        flops = shape.num_gpus * GPU_BF16_FLOPS
        train_flops_per_token = steps * 6 * draft_p + 2 * p.data.draft_vocab_size * shape.hidden_size
        assumed = {"regen": flops * MFU_REGEN / (2 * shape.active_params),
                   "extract": flops * MFU_EXTRACT / (2 * shape.active_params),
                   "train": flops * MFU_TRAIN / train_flops_per_token}
        basis = f"{shape.num_gpus} GPUs x {GPU_BF16_FLOPS / 1e15:.2f} PFLOP/s bf16 at the stated MFU"
    out = {}
    for stage, value in assumed.items():
        if stage in measured:
            out[stage] = (measured[stage][0], f"measured ({measured[stage][1]})")
        else:
            out[stage] = (value, f"assumed ({basis})")
    return out, basis


def capacity_plan(p: Params, stats: Optional[DataStats] = None, memory: bool = True,
                  sources: Optional[list] = None, layout: Optional[RunLayout] = None) -> dict:
    """The plan as a flat dict of named quantities (bytes, tokens, seconds); `stats`: the run's
    measured data stats (measured_stats), used when they match the profile's data params.
    sources: count_sources(p) (counted here when None); layout: the run folder whose measured rates
    are used (default: the profile's run). memory: add "memory" (memory_plan: seconds of meta-device
    work, and a torch import). Keys ending in "_basis" say "measured ..." or "assumed ..."."""
    shape = target_shape(p)
    sources = count_sources(p) if sources is None else sources
    n_conv = train_conversations(p, sources)
    tok_per_conv = tokens_per_conversation(p, stats, n_conv)
    tokens = n_conv * tok_per_conv
    elem = 2 if p.extract.dtype in ("bfloat16", "float16") else 4
    bytes_per_token = elem * 4 * shape.hidden_size + 4 + 1  # aux (3H) + final (H), ids int32, mask u8
    cache_bytes = tokens * bytes_per_token
    draft_p = drafter_params(shape, p.data.draft_vocab_size)
    regen_tokens = regenerated_conversations(p, n_conv) * p.data.regen_max_new_tokens * p.data.regen_max_turns
    rates, basis = _rates(p, shape, draft_p, measured_rates(p, layout or p.layout(), stats))
    epochs = p.train.epochs
    tokens_basis = "measured (data/stats.json)" if uses_measured_tokens(p, stats) else "estimated"
    plan = {
        "target": shape.name,
        "layers": shape.num_hidden_layers,
        "hidden_size": shape.hidden_size,
        "vocab_size": shape.vocab_size,
        "aux_layers": p.aux_layer_ids(),
        "sources": sources,
        "available_chats": sum(r["chats"] for r in sources),
        "chats_basis": _basis(sources),
        "train_conversations": n_conv,
        "tokens_per_conversation": round(tok_per_conv, 1),
        "tokens_basis": tokens_basis,
        "tokens_to_extract": int(tokens),
        "cache_bytes_per_token": bytes_per_token,
        "cache_bytes": int(cache_bytes),
        "drafter_params": int(draft_p),
        "regen_backend": p.data.regen_backend if p.data.regenerate else None,
        "regen_tokens": int(regen_tokens),
        "regen_tokens_per_s": rates["regen"][0],
        "regen_rate_basis": rates["regen"][1],
        "regen_hours": regen_tokens / rates["regen"][0] / 3600,
        "extract_backend": p.extract.backend,
        "extract_tokens_per_s": rates["extract"][0],
        "extract_rate_basis": rates["extract"][1],
        "extract_hours": tokens / rates["extract"][0] / 3600,
        "train_tokens_per_s": rates["train"][0],
        "train_rate_basis": rates["train"][1],
        "train_hours": tokens * epochs / rates["train"][0] / 3600,
        "train_budget_hours": None if p.train.time_budget_minutes is None else p.train.time_budget_minutes / 60,
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


def source_rows(plan: dict) -> list:
    """(label, text) rows: one per source, with its basis."""
    rows = []
    for r in plan["sources"]:
        cap = "" if r["cap"] is None else f", max {r['cap']:,} records"
        if r["basis"] == "measured":
            bad = sum(r["malformed"].values())
            text = (f"{r['chats']:,} chats [measured: {r['records_read']:,} records read, {bad:,} malformed, "
                    f"{r['duplicates']:,} duplicates{cap}]")
        else:
            text = f"{r['chats']:,} chats [assumed: NOT ON THIS MACHINE ({r['problem']}){cap}]"
        rows.append((f"  {r['item']}: {r['source']}", text))
    return rows


def budget_note(plan: dict) -> str:
    """Where train.time_budget_minutes stops training before the planned tokens: how much of them it covers."""
    budget = plan.get("train_budget_hours")
    if budget is None or budget >= plan["train_hours"]:
        return ""
    return (f"; train.time_budget_minutes ({budget * 60:g} min) stops it after ~{budget / plan['train_hours']:.0%} "
            f"of the planned tokens at this rate")


def format_plan(plan: dict) -> str:
    rows = [
        ("target", plan["target"]),
        ("shape", f"{plan['layers']} layers, hidden {plan['hidden_size']}, vocab {plan['vocab_size']}"),
        ("aux layers", plan["aux_layers"]),
        ("chats from the sources", f"{plan['available_chats']:,} [{plan['chats_basis']}]"),
        *source_rows(plan),
        ("train conversations", f"{plan['train_conversations']:,} [{plan['chats_basis']}: the chats minus "
                                "data.num_eval, at most data.num_train]"),
        ("tokens to extract", f"{plan['tokens_to_extract']:,} ({plan['tokens_per_conversation']} / conversation, "
                              f"{plan['tokens_basis'].replace('estimated', 'assumed')})"),
        ("cache bytes / token", f"{plan['cache_bytes_per_token']:,}"),
        ("hidden-state cache", human_bytes(plan["cache_bytes"])),
        ("drafter parameters", f"{plan['drafter_params'] / 1e6:,.1f} M"),
        ("regeneration", f"{plan['regen_tokens']:,} tokens, {plan['regen_tokens_per_s']:,.0f} tok/s, "
                         f"{plan['regen_hours']:.2f} h  [backend {plan['regen_backend']}; {plan['regen_rate_basis']}]"),
        ("extraction", f"{plan['extract_tokens_per_s']:,.0f} tok/s, {plan['extract_hours']:.2f} h  "
                       f"[backend {plan['extract_backend']}; {plan['extract_rate_basis']}]"),
        ("training", f"{plan['train_tokens_per_s']:,.0f} tok/s, {plan['train_hours']:.2f} h  [{plan['train_rate_basis']}]"
                     + budget_note(plan)),
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

