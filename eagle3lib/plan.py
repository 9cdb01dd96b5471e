"""Capacity planner: how many tokens, how many bytes, how many hours per stage, before anything runs,
and what would stop the full run (full_run_problems: disk, host memory, schedule, thinking mode, and
preflight.py's checks on this machine: tokenizer, lm_head, /dev/shm, the cache disk's read rate).

Everything here is arithmetic on the params profile plus stated rates. It imports nothing heavy so
`eagle3 plan` answers at once. The per-stage time model (engine starts, I/O, verification, decode
bandwidth, the trainer measurement) lives in stage_times.py.

Every figure says where it comes from ("measured" or "assumed"):
- chats: counted from the sources themselves (`count_sources`: read and normalised, duplicates
  dropped across sources, no tokenizer; cached per source content under outputs/source-counts/);
  a source not on this machine is assumed to give its max_records;
- tokens per conversation: measured when the run's data stage ran with the same data params
  (`data/stats.json`, read by `stats.load_stats`), else assumed from the constants below;
- rates: measured by this run folder's last run of the same backend (the data stage's regeneration
  tokens/s, metrics.json's extract and train tokens/s), else stage_times.py's: this CPU's from the
  recorded runs of its host kind, GPUs' from the H200 trainer measurement and stated assumptions.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from .chats import MalformedRecord, chat_hash, iter_raw_records, normalize_chat, path_sha256, source_problem, sources_of
from .engine_memory import engine_memory, engine_problems, online_problem
from .files import atomic_write_json, read_json, read_metrics, update_metrics
from .gpus import kind_figures
from .layout import RunLayout
from .mode_plan import mode_plan
from .params import (
    Params,
    ParamsError,
    checkpoint_interval,
    gpu_memory_budget,
    host_memory_bytes,
    max_warmup_steps,
    planned_warmup,
    regen_cap_problem,
    train_ranks,
    warmup_problem,
)
from .preflight import cache_read_rate, preflight_checks, preflight_table
from .stage_times import (
    KNOWN_CHECKPOINT_BYTES,
    Workload,
    drafter_flops_per_token,
    drafter_layers_params,
    host_for,
    stage_seconds,
)
from .stats import DataStats
from .stats import load_stats as load_data_stats

# Mean tokens of one ShareGPT conversation after the chat template (measured on SmolLM2's
# tokenizer over the first 2,000 records, see NOTES.md); truncation caps it at max_length.
SHAREGPT_MEAN_TOKENS = 1100
# Regenerated chats (measured on the local run, SmolLM2, 2,000 chats at a 128-token cap: 388,564
# tokens = 194 per chat, mean answer 110 tokens): the prompt and template, and the share of the cap
# an answer fills (instant mode; a thinking-mode answer is assumed to fill its cap).
REGEN_PROMPT_TOKENS = 84
REGEN_ANSWER_FILL = 0.86
# Real tokens per micro-batch / train.batch_tokens after length bucketing (measured: local's
# 388,564 tokens made ~446 micro-batches of 1,024 per epoch; local-long 0.90).
BATCH_FILL = 0.85
# Held-out sequences' assistant share when the answers are the dataset's (assumed).
ASSISTANT_SHARE = 0.6
# Share of this host's memory the held-out set may take (the rest: DataLoader workers, the target
# head, the process itself; assumed).
HOST_MEMORY_SHARE = 0.5


@dataclass
class Shape:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    active_params: float              # parameters touched per token (MoE: active experts)
    total_params: float               # every parameter (MoE: all experts)
    num_gpus: int
    name: str


# SmolLM2-135M; Kimi-K2.5-class (32B active of 1.04T)
KNOWN_ACTIVE_PARAMS = {576: 135e6, 7168: 32e9}
KNOWN_TOTAL_PARAMS = {576: 135e6, 7168: 1.04e12}


def target_shape(p: Params) -> Shape:
    s = p.target_shape() or {}
    h = s["hidden_size"]
    active = KNOWN_ACTIVE_PARAMS.get(h) or 12 * s["num_hidden_layers"] * h * h + 2 * s["vocab_size"] * h
    # A profile that asks for CUDA plans for its GPUs (one vLLM engine over tensor x data parallel
    # GPUs, training on train.nproc ranks); "auto"/"cpu" plan for this CPU.
    t = p.target
    gpus = max(p.extract.nproc, p.train.nproc, t.tensor_parallel_size * t.data_parallel_size) \
        if p.extract.device == "cuda" else 0
    return Shape(s["num_hidden_layers"], h, s["vocab_size"], s.get("intermediate_size", 4 * h),
                 active, KNOWN_TOTAL_PARAMS.get(h) or active, gpus, p.target.path)


def drafter_params(shape: Shape, draft_vocab: int, layers: int = 1) -> float:
    """Trainable parameters of the drafter (fc, layer 0 with attention on 2H, later layers with
    attention on H, SwiGLU MLPs, lm_head)."""
    h = shape.hidden_size
    return 3 * h * h + drafter_layers_params(h, shape.intermediate_size, layers) + draft_vocab * h


def checkpoint_bytes(p: Params, shape: Shape) -> tuple[float, str]:
    """The target's weights on disk (what each engine start reads): its safetensors files when the
    checkpoint is on this machine, else a known figure, else its parameters in target.dtype."""
    folder = Path(p.target.path)
    files = list(folder.glob("*.safetensors")) if folder.is_dir() else []
    if files:
        return float(sum(f.stat().st_size for f in files)), f"measured: {len(files)} safetensors files"
    if shape.hidden_size in KNOWN_CHECKPOINT_BYTES:
        return KNOWN_CHECKPOINT_BYTES[shape.hidden_size], "assumed: Kimi-K2.5's published INT4 checkpoint"
    elem = 4 if p.target.dtype == "float32" else 2
    return shape.total_params * elem, f"assumed: {shape.total_params:.3g} parameters in {p.target.dtype}"


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
    metrics = read_metrics(layout.metrics)
    if not isinstance(ran, dict) or ran.get("target", {}).get("path") != p.target.path:
        return out
    extract = metrics.get("extract", {}).get("tokens_per_s")
    if extract and ran.get("extract", {}).get("backend") == p.extract.backend:
        out["extract"] = (float(extract), f"metrics.json ({p.extract.backend} backend)")
    train = metrics.get("train", {}).get("train_tokens_per_s")
    ran_train = ran.get("train", {})
    if train and ran_train.get("ttt_steps") == p.train.ttt_steps \
            and ran_train.get("draft_layers", 1) == p.train.draft_layers:
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
    regenerated = min(p.data.max_length, REGEN_PROMPT_TOKENS + regenerated_tokens_per_chat(p))
    n_conv = train_conversations(p) if n_conv is None else n_conv
    n_regen = regenerated_conversations(p, n_conv)
    return (n_regen * regenerated + (n_conv - n_regen) * original) / max(n_conv, 1)


def memory_plan(p: Params) -> dict:
    """Per-GPU training memory (eagle3lib/memory.py) at data.max_length and at 2,048 / 4,096-token
    sequences (each at most train.batch_tokens): {seq_len: MemoryEstimate.as_dict()
    plus "fits" (None without train.gpu_memory_gb) and "problem"}."""
    from . import memory  # imports torch and runs the drafter on the meta device: `import plan` stays light
    out = {}
    for seq in sorted({p.data.max_length, 2048, 4096}):
        if seq > p.train.batch_tokens:
            continue
        est = memory.estimate(p, seq)
        problem = memory.fit_problem(p, est)
        out[seq] = {**est.as_dict(), "fits": None if p.train.gpu_memory_gb is None else problem is None,
                    "problem": problem}
    return out


def answer_fill(p: Params) -> float:
    """Share of regen_max_new_tokens an answer fills: REGEN_ANSWER_FILL, 1 in thinking mode."""
    return 1.0 if getattr(p.data, "thinking", "off") == "on" else REGEN_ANSWER_FILL


def regenerated_tokens_per_chat(p: Params) -> float:
    """Generated tokens of one regenerated chat (every regenerated turn at answer_fill of the cap)."""
    return answer_fill(p) * p.data.regen_max_new_tokens * p.data.regen_max_turns


def planned_steps(p: Params, tokens: float, sequences: int) -> int:
    """Optimizer steps as train.schedule counts them, before the cache exists: train.max_steps, else
    epochs x (micro-batches // (ranks x grad_accum)), the micro-batches from `tokens` (one epoch of
    `sequences`) at BATCH_FILL of train.batch_tokens, at least one per sequence too long to share one."""
    train_params = p.train
    if train_params.max_steps:
        return train_params.max_steps
    mean = tokens / max(sequences, 1)
    per_batch = max(1, int(train_params.batch_tokens // max(mean, 1)))
    micro = max(math.ceil(tokens / (train_params.batch_tokens * BATCH_FILL)), math.ceil(sequences / per_batch))
    per_epoch = max(1, micro // (train_ranks(p) * train_params.grad_accum))
    return max(1, math.ceil(train_params.epochs * per_epoch))


def heldout_host_bytes(p: Params, shape: Shape, tok_per_conv: float) -> float:
    """Host memory of the prepared held-out set (objective.heldout_batches), built once: per token
    the aux states (fp32 when fc_input_scaling divides them, else the cache dtype) and ids, plus
    fp32 draft-vocabulary labels at the assistant positions it scores."""
    train_params, d = p.train, p.data
    tokens = min(train_params.eval_sequences, d.num_eval) * tok_per_conv
    elem = 4 if train_params.fc_input_scaling or p.extract.dtype not in ("bfloat16", "float16") else 2
    share = min(1.0, regenerated_tokens_per_chat(p) / tok_per_conv) if d.regenerate else ASSISTANT_SHARE
    return tokens * (3 * shape.hidden_size * elem + 8) + tokens * share * 4 * d.draft_vocab_size


def capacity_plan(p: Params, stats: Optional[DataStats] = None, memory: bool = True,
                  sources: Optional[list] = None, layout: Optional[RunLayout] = None,
                  host_kind: Optional[str] = None, recorded: Optional[list] = None, modes: bool = True,
                  preflight: bool = True) -> dict:
    """The plan as a flat dict of named quantities (bytes, tokens, seconds); `stats`: the run's
    measured data stats (measured_stats), used when they match the profile's data params.
    sources: count_sources(p) (counted here when None); layout: the run folder whose measured rates
    are used (default: the profile's run). memory: add "memory" (memory_plan: seconds of meta-device
    work, and a torch import). host_kind, recorded: plan a CPU run for that host kind ("native_bf16"
    | "avx2"; default this CPU's) from those recorded runs (default bench/recorded_stage_times.json).
    "stages": {stage: {"seconds", "optional", "parts": [{"name", "seconds", "basis"}]}}; keys ending
    in "_basis" say "measured ..." or "assumed ...". modes: add "modes" (mode_plan: offline against
    online, each layout's hours, disk and per-GPU memory; plans the other extract.mode too).
    preflight: add "preflight" (preflight.py's checks on this machine: tokenizer, lm_head, /dev/shm,
    disk read), whose refusals full_run_problems reports."""
    shape = target_shape(p)
    layout = layout or p.layout()
    sources = count_sources(p) if sources is None else sources
    n_conv = train_conversations(p, sources)
    tok_per_conv = tokens_per_conversation(p, stats, n_conv)
    online = p.extract.mode == "online"
    # the held-out cache, and the train split's unless it is served online during training
    tokens = ((0 if online else n_conv) + p.data.num_eval) * tok_per_conv
    elem = 2 if p.extract.dtype in ("bfloat16", "float16") else 4
    bytes_per_token = elem * 4 * shape.hidden_size + 4 + 1  # aux (3H) + final (H), ids int32, mask u8
    cache_bytes = tokens * bytes_per_token
    draft_p = drafter_params(shape, p.data.draft_vocab_size, p.train.draft_layers)
    per_chat = regenerated_tokens_per_chat(p) if p.data.regenerate else 0.0
    regen_train, regen_eval = regenerated_conversations(p, n_conv) * per_chat, p.data.num_eval * per_chat
    sequences = n_conv if p.train.max_sequences is None else min(n_conv, p.train.max_sequences)
    steps = planned_steps(p, sequences * tok_per_conv, sequences)
    if p.train.max_steps:
        train_tokens = steps * train_ranks(p) * p.train.grad_accum * p.train.batch_tokens * BATCH_FILL
    else:
        train_tokens = p.train.epochs * sequences * tok_per_conv
    ckpt_bytes, ckpt_basis = checkpoint_bytes(p, shape)
    engine_elem = 4 if p.target.dtype == "float32" else 2        # the connector writes the engine's dtype
    flops = drafter_flops_per_token({"hidden_size": shape.hidden_size, "draft_vocab_size": p.data.draft_vocab_size,
                                     "ttt_steps": p.train.ttt_steps, "draft_layers": p.train.draft_layers})
    work = Workload(chats=n_conv + p.data.num_eval, regen_tokens_train=regen_train, regen_tokens_eval=regen_eval,
                    extract_tokens=tokens, cache_bytes=cache_bytes, train_tokens=train_tokens,
                    tokens_per_chat=tok_per_conv, planned_steps=steps, active_params=shape.active_params,
                    total_params=shape.total_params, checkpoint_bytes=ckpt_bytes, checkpoint_basis=ckpt_basis,
                    drafter_flops_per_token=flops, cache_bytes_per_token=bytes_per_token,
                    served_tokens=train_tokens if online else 0.0,
                    served_bytes=train_tokens * (4 * shape.hidden_size * engine_elem + 8) if online else 0.0,
                    drafter_params=draft_p, frozen_params=shape.vocab_size * shape.hidden_size,
                    micro_batch_tokens=p.train.batch_tokens * BATCH_FILL)
    host = host_for(p, shape.num_gpus, host_kind, recorded)
    measured = measured_rates(p, layout, stats)
    read_rate, read_basis = cache_read_rate(layout)
    if read_basis.startswith("measured"):
        measured["cache_read"] = (read_rate, read_basis)
    stages = stage_seconds(p, work, host, measured)
    rates = {st.rate[0]: st.rate for st in stages.values() if st.rate is not None}
    none = (None, None, "not run by this profile", 0.0)
    regen, extract, train = (rates.get(k, none) for k in ("regen", "extract", "train"))
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
        "tokens_basis": "measured (data/stats.json)" if uses_measured_tokens(p, stats) else "estimated",
        "tokens_to_extract": int(tokens),
        "cache_bytes_per_token": bytes_per_token,
        "cache_bytes": int(cache_bytes),
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_basis": ckpt_basis,
        "heldout_host_bytes": heldout_host_bytes(p, shape, tok_per_conv),
        "drafter_params": int(draft_p),
        "planned_steps": steps,
        "warmup_steps": planned_warmup(p.train, steps),
        "checkpoint_interval": checkpoint_interval(p.train, steps),
        "regen_backend": p.data.regen_backend if p.data.regenerate else None,
        "regen_tokens": int(regen_train + regen_eval),
        "regen_tokens_per_s": regen[1],
        "regen_rate_basis": regen[2],
        "regen_hours": regen[3] / 3600,
        "extract_backend": p.extract.backend,
        "extract_mode": p.extract.mode,
        "extract_tokens_per_s": extract[1],
        "extract_rate_basis": extract[2],
        "extract_hours": extract[3] / 3600,
        "train_tokens": train_tokens,
        "train_tokens_per_s": train[1],
        "train_rate_basis": train[2],
        "train_hours": train[3] / 3600,
        "train_budget_hours": None if p.train.time_budget_minutes is None else p.train.time_budget_minutes / 60,
        "cache_read_bytes_per_s": read_rate,
        "cache_read_basis": read_basis,
        "throughput_basis": host_basis(host),
        "gpu_kind": host.gpu,
        "gpu_memory_gb": gpu_memory_budget(p.train),
        "engine_memory": [r.as_dict() for r in engine_rows(p, host, ckpt_bytes)],
        "stages": {name: st.as_dict() for name, st in stages.items()},
        "total_hours": sum(st.seconds for st in stages.values() if not st.optional) / 3600,
    }
    if preflight:
        plan["preflight"] = [c.as_dict() for c in preflight_checks(p, plan)]
    if memory:
        plan["memory"] = memory_plan(p)
    plan["problems"] = full_run_problems(p, plan, layout)     # after the memory: the trainer's step is one of them
    if modes:
        other = dataclasses.replace(p, extract=dataclasses.replace(
            p.extract, mode="offline" if online else "online", online_gpus=None))
        twin = capacity_plan(other, stats, False, sources, layout, host_kind, recorded, modes=False, preflight=False)
        plan["modes"] = mode_plan(p, {p.extract.mode: plan, other.extract.mode: twin}, host.gpus, memory)
    return plan


def engine_rows(p: Params, host, ckpt_bytes: float) -> list:
    """engine_memory.EngineMemory per vLLM engine kind on the planned GPUs ([] on this CPU)."""
    return engine_memory(p, host.gpu, ckpt_bytes, REGEN_PROMPT_TOKENS) if host.gpus else []


def host_basis(host) -> str:
    if host.gpus:
        return f"{host.gpus} x {host.gpu} GPUs ({host.gpu_basis}; {kind_figures(host.gpu)})"
    return f"this CPU, {host.kind.replace('_', ' ')} (rates measured by the recorded runs of this host kind)"


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
    rate = lambda v: "-" if v is None else f"{v:,.0f} tok/s"
    splits = ("held out only: extract.mode online serves the train split" if plan.get("extract_mode") == "online"
              else "train and held out")
    rows = [
        ("target", plan["target"]),
        ("shape", f"{plan['layers']} layers, hidden {plan['hidden_size']}, vocab {plan['vocab_size']}"),
        ("aux layers", plan["aux_layers"]),
        ("chats from the sources", f"{plan['available_chats']:,} [{plan['chats_basis']}]"),
        *source_rows(plan),
        ("train conversations", f"{plan['train_conversations']:,} [{plan['chats_basis']}: the chats minus "
                                "data.num_eval, at most data.num_train]"),
        ("tokens to extract", f"{plan['tokens_to_extract']:,} ({plan['tokens_per_conversation']} / conversation, "
                              f"{splits}, {plan['tokens_basis'].replace('estimated', 'assumed')})"),
        ("cache bytes / token", f"{plan['cache_bytes_per_token']:,}"),
        ("hidden-state cache", human_bytes(plan["cache_bytes"])),
        ("target checkpoint", f"{human_bytes(plan['checkpoint_bytes'])} [{plan['checkpoint_basis']}]"),
        ("held-out set on the host", f"{human_bytes(plan['heldout_host_bytes'])} [assumed: train.eval_sequences "
                                     "sequences' aux states and labels, built once]"),
        ("drafter parameters", f"{plan['drafter_params'] / 1e6:,.1f} M"),
        ("optimizer steps", f"{plan['planned_steps']:,}; warmup {plan['warmup_steps']:,} "
                            f"({plan['warmup_steps'] / plan['planned_steps']:.1%}); a checkpoint and held-out eval "
                            f"every {plan['checkpoint_interval']:,} steps [estimated from the tokens]"),
        ("regeneration", f"{plan['regen_tokens']:,} tokens, {rate(plan['regen_tokens_per_s'])}, "
                         f"{plan['regen_hours']:.2f} h  [backend {plan['regen_backend']}; {plan['regen_rate_basis']}]"),
        ("extraction", f"{rate(plan['extract_tokens_per_s'])}, {plan['extract_hours']:.2f} h  "
                       f"[backend {plan['extract_backend']}; {plan['extract_rate_basis']}]"),
        ("training", f"{rate(plan['train_tokens_per_s'])}, {plan['train_hours']:.2f} h  [{plan['train_rate_basis']}]"
                     + budget_note(plan)),
        ("throughput basis", plan["throughput_basis"]),
    ]
    rows += stage_rows(plan)
    rows += mode_rows(plan)
    rows += engine_memory_rows(plan)
    rows += memory_rows(plan)
    rows += preflight_table(plan)
    rows += problem_rows(plan)
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


NOTEBOOK_NUMBER = {"research": "00", "ngram": "01", "data": "02", "extract": "03", "train": "04", "eval": "05",
                   "scaling": "06"}


def _duration(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds < 5400 else f"{seconds / 3600:.2f} h"


def stage_rows(plan: dict) -> list:
    """(label, text) rows: each stage's planned time, then its parts with their basis."""
    rows = [("stage times", f"{plan['total_hours']:.2f} h for stages 00-05 (each part: measured or assumed, "
                            "and its basis)")]
    for name, st in plan["stages"].items():
        extra = " (optional: `eagle3 run --only scaling`)" if st["optional"] else ""
        rows.append((f"  {NOTEBOOK_NUMBER.get(name, '')} {name}", f"{_duration(st['seconds'])}{extra}"))
        rows += [(f"    {_duration(q['seconds'])}", f"{q['name']}  [{q['basis']}]") for q in st["parts"]]
    return rows


def problem_rows(plan: dict) -> list:
    """(label, text) rows of full_run_problems: what stops the full run (refused) or may (warning)."""
    return [("REFUSED" if level == "refuse" else "WARNING", f"{key}: {text}")
            for level, key, text in plan.get("problems", [])]


def engine_memory_rows(plan: dict) -> list:
    """(label, text) rows of each vLLM engine's memory per GPU (engine_memory.py), with its basis."""
    rows = []
    for m in plan.get("engine_memory", []):
        needs = "; ".join(f"{n['what']}: {n['gb']:,.1f} GB" + ("" if n["gb"] <= m["kv_room_gb"] else " DOES NOT FIT")
                          for n in m["needs"])
        rows.append((f"  {m['engine']}", f"{m['share_gb']:,.1f} of {m['memory_gb']:g} GB = weights "
                     f"{m['weights_gb']:,.1f} + other {m['other_gb']:,.1f} + KV room {m['kv_room_gb']:,.1f} GB; "
                     f"needs {needs}  [{m['basis']}]"))
    return [("engine memory per GPU", "each vLLM engine's share of a GPU (target.gpu_memory_utilization) and "
             "what its KV cache needs")] + rows if rows else []


def mode_rows(plan: dict) -> list:
    """(label, text) rows for format_plan."""
    rows = []
    for m in plan.get("modes", []):
        text = f"{m['hours']:.2f} h for 03 + 04, disk {human_bytes(m['disk_bytes'])}"
        if m["trainer_peak_gb"] is not None:
            text += f"; per GPU: trainer {m['trainer_peak_gb']:.0f} of {m['trainer_budget_gb']:.0f} GB"
            if m["server_gb_per_gpu"] is not None:
                text += f", server {m['server_gb_per_gpu']:.0f} GB (weights {m['weights_gb_per_gpu']:.0f})"
            text += "" if m["fits"] else "  DOES NOT FIT"
            if m.get("server_share_max") == 0.0:
                text += " (no target.gpu_memory_utilization holds the server's weights and leaves the trainer room)"
            elif m.get("server_share_max") is not None:
                text += f" (target.gpu_memory_utilization <= {m['server_share_max']:.2f} would leave the trainer room)"
        rows.append((f"  {m['layout']}", f"{text}  [{m['basis']}]"))
    return [("hidden states: offline or online", "each layout's hours, disk and per-GPU memory "
             "(extract.mode, extract.online_gpus)")] + rows if rows else []


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



# ---- what stops the full run -------------------------------------------------------------------
def _free_bytes(path: Path) -> tuple[float, Path]:
    """Free bytes of the file system holding `path` (its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return float(shutil.disk_usage(path).free), path


def _tree_bytes(folder: Path) -> float:
    return float(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())) if folder.is_dir() else 0.0


def template_thinks(p: Params) -> Optional[bool]:
    """Whether the target's chat template reasons by default ("<think>" in its text), None when the
    template is not on this machine. An assumption from the text; the data stage checks it exactly.
    The embedded targets (SmolLM2 and the miniature built on its tokenizer) have no reasoning mode."""
    if p.target.path.startswith("embedded:"):
        return False
    folder = Path(p.target.path)
    texts = [f.read_text(errors="replace") for f in (folder / "chat_template.jinja", folder / "tokenizer_config.json")
             if f.is_file()]
    return None if not texts else any("<think>" in t for t in texts)


def thinking_problem(p: Params) -> Optional[tuple[str, str, str]]:
    """(level, key, text) when regeneration in thinking mode would cut most answers
    (params.regen_cap_problem), or when data.thinking is auto and the template cannot be read here."""
    d = p.data
    mode = getattr(d, "thinking", None)
    if not d.regenerate or mode in (None, "off"):
        return None
    thinks = True if mode == "on" else template_thinks(p)
    if thinks is None:
        return ("warn", "data.thinking", "auto, and the target's chat template is not on this machine, so whether "
                "regeneration reasons (and how much of each answer data.regen_max_new_tokens keeps) is unknown; "
                "set data.thinking: on or off")
    cut = regen_cap_problem(d, thinks)
    return None if cut is None else ("refuse", "data.regen_max_new_tokens", cut)


def full_run_problems(p: Params, plan: dict, layout: Optional[RunLayout] = None) -> list:
    """[(level "refuse" | "warn", key, text)]: what would stop (or spoil) the full run although its
    smoke slice would pass: warmup longer than MAX_WARMUP_FRACTION of the planned steps, no
    intermediate checkpoint, a disk too small for the caches, host memory too small for the held-out
    set, thinking-mode answers cut by regen_max_new_tokens; and the plan's preflight refusals and
    warnings (tokenizer, lm_head, /dev/shm, disk read: preflight.py), keyed "preflight <check>"; on GPUs,
    a trainer step over the GPU's memory (the plan's memory model at data.max_length), a vLLM engine whose
    KV room holds less than one sequence or regeneration's batch, and online hidden states beside a
    trainer that has no room (engine_memory.py)."""
    layout = layout or p.layout()
    train_params, steps, out = p.train, plan["planned_steps"], []
    warmup = planned_warmup(train_params, steps)
    if warmup > max_warmup_steps(steps):
        out.append(("refuse", "train.warmup_steps", warmup_problem(warmup, steps, "estimated by the plan")))
    if plan["checkpoint_interval"] >= steps > 1 and train_params.checkpoint_minutes is None:
        out.append(("warn", "train.checkpoint_every",
                    f"{plan['checkpoint_interval']:,} >= the {steps:,} planned steps: "
                    "no intermediate checkpoint or held-out eval; set train.checkpoint_fraction (e.g. 0.1) or "
                    "train.checkpoint_minutes"))
    free, where = _free_bytes(layout.root)
    need = plan["cache_bytes"] - _tree_bytes(layout.hidden_root)
    if need > free:
        out.append(("refuse", "output_dir", f"the hidden-state caches need {human_bytes(need)} more, {where} has "
                    f"{human_bytes(free)} free: free space or point output_dir at a larger disk, or lower "
                    "data.num_train / data.max_length"))
    memory, held = host_memory_bytes(), plan["heldout_host_bytes"]
    if memory and held > HOST_MEMORY_SHARE * memory:
        out.append(("refuse", "train.eval_sequences", f"the held-out set takes ~{human_bytes(held)} of host memory, "
                    f"over {HOST_MEMORY_SHARE:.0%} of this machine's {human_bytes(memory)}: lower "
                    f"train.eval_sequences ({train_params.eval_sequences}) or run on a host with more memory"))
    thinking = thinking_problem(p)
    if thinking is not None:
        out.append(thinking)
    out += gpu_memory_problems(p, plan)
    out += [(c["verdict"], f"preflight {c['name']}", c["text"]) for c in plan.get("preflight", [])
            if c["verdict"] in ("refuse", "warn")]
    available = plan["available_chats"] - p.data.num_eval
    if p.data.num_train is not None and p.data.num_train > available:
        out.append(("warn", "data.num_train", f"{p.data.num_train:,} asked, the sources hold {max(available, 0):,} "
                    f"chats after the {p.data.num_eval:,} held out: training uses those; add sources or lower it"))
    return out


def trainer_peak_gb(p: Params, plan: dict) -> Optional[float]:
    """The memory model's per-GPU peak at data.max_length (GB), None where the plan has no memory section."""
    est = plan.get("memory", {}).get(p.data.max_length)
    return None if est is None else est["peak_bytes"] / 1e9


def gpu_memory_problems(p: Params, plan: dict) -> list:
    """[(level, key, text)]: the trainer's step over the GPU's memory (memory.fit_problem at data.max_length),
    and on planned GPUs the engines' memory (engine_memory.engine_problems) and online hidden states
    without room for the trainer (engine_memory.online_problem)."""
    out = []
    est = plan.get("memory", {}).get(p.data.max_length)
    if est is not None and est["problem"]:
        out.append(("refuse", "train.batch_tokens", f"{est['problem']} (data.max_length {p.data.max_length:,}: "
                    f"{est['sequences']} sequences per micro-batch)"))
    if not plan.get("gpu_kind"):
        return out
    rows = engine_memory(p, plan["gpu_kind"], plan["checkpoint_bytes"], REGEN_PROMPT_TOKENS)
    out += engine_problems(p, rows)
    online = online_problem(p, rows, trainer_peak_gb(p, plan))
    return out + ([online] if online else [])


def refuse_full_run(p: Params, layout: Optional[RunLayout] = None, log=print) -> list:
    """Before any stage of `eagle3 run`: raise ParamsError naming each refused figure and its fix;
    log and return the warnings. A profile planned on GPUs gets the memory model too (seconds of
    meta-device work) for the trainer's and the online server's memory checks."""
    layout = layout or p.layout()
    gpus = target_shape(p).num_gpus > 0
    plan = capacity_plan(p, measured_stats(layout), memory=gpus, layout=layout)
    problems = full_run_problems(p, plan, layout)
    refused = [f"{key}: {text}" for level, key, text in problems if level == "refuse"]
    if refused:
        raise ParamsError("the full run cannot finish (eagle3 plan shows the figures): " + "; ".join(refused))
    warnings = [f"{key}: {text}" for level, key, text in problems if level == "warn"]
    for w in warnings:
        log(f"[eagle3] warning: {w}")
    return warnings


def record_research(run_dir, plans: dict, versions: dict) -> dict:
    """metrics.json's "research" section from 00's plans {"this run", "local", "b300": capacity_plan}
    and the package versions it found; returns the section."""
    mine, big = plans["this run"], plans["b300"]
    section = {"tokens_to_extract_planned": mine["tokens_to_extract"], "cache_bytes_planned": mine["cache_bytes"],
               "cache_bytes_per_token": mine["cache_bytes_per_token"], "b300_cache_bytes": big["cache_bytes"],
               "b300_chats": {r["source"]: {"chats": r["chats"], "basis": r["basis"]} for r in big["sources"]},
               "b300_extract_hours": round(big["extract_hours"], 3), "b300_train_hours": round(big["train_hours"], 3),
               "torch": versions.get("torch"), "transformers": versions.get("transformers")}
    return update_metrics(run_dir, "research", section)["research"]
