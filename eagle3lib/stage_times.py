"""How long each stage of a run takes: the planner's per-stage time model (plan.py prints it).

    work = Workload(...)                           # plan.py: chats, tokens, bytes, steps of the profile
    stages = stage_seconds(p, work, host)          # {stage: Stage(parts=[Part(name, seconds, basis)])}

A stage's time is the sum of its parts: the notebook kernel, each engine start (vLLM engines in
01, 02, 03 and 05 counted from the profile, each loading the checkpoint), the work itself at a
rate, and I/O (the hidden-state cache written, copied, hashed and verified; on GPUs 04's reads of it,
which overlap its compute: 04 takes the larger). Every part carries its basis, starting with
"measured" or "assumed".

- This CPU (no cuda device in the profile): the rates are those of the newest recorded run on
  this host kind (bench/recorded_stage_times.json: native bf16 or AVX2-only), scaled to the
  profile's model sizes and settings; fixed costs not in a record are assumed constants below.
- GPUs (the kind's figures: gpus.py, train.gpu_kind): training from the one-rank H200 measurement at
  Kimi shapes (NOTES.md), scaled per GPU kind by dense bf16 FLOP/s, each step at least the time its
  FSDP collectives take over the kind's interconnect (NVLink or PCIe; a model, assumed);
  extraction bounded by compute (FLOPs at an assumed MFU) plus the cache's I/O (the connector's
  synchronous save in one worker, the parent's re-read and re-write, the writer's sha256);
  regeneration and eval decoding from HBM bandwidth (bytes read per decode step / bandwidth, times
  the batch; an MLA target's KV cache is read whole by every GPU), never an MFU.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .gpus import GPU_KINDS, INTERCONNECT
from .params import Params, cpu_has_native_bf16, repo_root, suffix_stage

# The stages a full run executes, in order (runner.STAGES without the optional study).
STAGES = ("research", "ngram", "data", "extract", "train", "eval")
OPTIONAL_STAGES = ("scaling",)

# ---- this CPU: calibrated from recorded runs ---------------------------------------------------
RECORDED_STAGE_TIMES = "bench/recorded_stage_times.json"
HOST_KINDS = ("native_bf16", "avx2")
# Fixed costs no record separates out (assumed unless stated):
KERNEL_START_S = 15.0            # assumed: a notebook kernel on a GPU box
# measured: a notebook's start on the CPU (kernel, papermill, the library import): 00's wall time
# 11 s less its cells' 8.2 s (ci, 2026-12-05, native-bf16 CPU; the records' kernel_s is 00's whole
# wall time, cells included, so it is not used for this)
CPU_NOTEBOOK_START_S = 3.0
CPU_ENGINE_START_S = 45.0        # measured: one vLLM CPU engine at the default batch budget (bench/extract.py, 42.9 s)
# measured: an eval engine at 512 batched tokens, SmolLM2-135M: load_s 24.3-26.2 s over 6 engines
# (ci, 2026-12-05, native-bf16 CPU, outputs/ci/eval/*/result.json)
CPU_EVAL_ENGINE_START_S = 25.0
# measured: the eval's vLLM child before its first engine (python, the vllm import, the spec): the
# vLLM cells of 01 / 05 less their engines and decoding, 26 s / 35 s (same ci run)
CPU_VLLM_CHILD_START_S = 30.0
# measured: 00's capacity plans (this run, local, b300 with its memory model): 5.6 s (same ci run)
RESEARCH_PLANS_S = 5.6
# measured (ci, 2026-12-05): 03's fidelity cell, a SmolLM2-135M load + 4 forwards, 1.4 s; 02's cell,
# 12.9 s for 660 tokens regenerated in HF batches
CPU_TARGET_LOAD_S = 1.5
CPU_REGEN_HF_TOKENS_PER_S = 60.0
# measured: 02 took 25 s for 3,036 chats with every answer already regenerated (NOTES.md, 2026-12-03)
DATA_PREP_S_PER_CHAT = 25.0 / 3036
TRAIN_SETUP_S = 15.0             # assumed on GPUs: torch import, cache and vocab load, drafter and target head build
CPU_TRAIN_SETUP_S = 3.0          # measured: 04's wall 13 s less kernel and 12 steps (ci, 2026-12-05)
# measured: torchrun and its gloo group on the CPU, the residual of mini-kimi's 04 (35 s wall less
# kernel, setup and 48 steps at the run's 1,739 tok/s; 2026-12-05, native-bf16 CPU); assumed on GPUs
TORCHRUN_START_S = 5.0
# measured: a tiny drafter trains 2.8x the recorded rate, not its FLOP ratio (mini-kimi, same run:
# 1,739 tok/s on 2 processes against local's 625), so the FLOP scaling is capped there
CPU_TINY_DRAFTER_CAP = 2.8
CPU_SPEC_SPEEDUP = 1.4           # measured: vLLM CPU n-gram / EAGLE-3 1.38-1.58x plain (NOTES.md)
CPU_BF16_TRAIN_SPEEDUP = 3.0     # measured: bf16 autocast 2.5-4x fp32 on a native-bf16 CPU (bench/train.py, NOTES)

# ---- GPUs: datasheet figures per kind (assumed; gpus.GPU_KINDS, INTERCONNECT) and the trainer measurement ----
# measured: one H200 rank at Kimi-K2.5 shapes (H 7168, draft vocab 32k), ttt 7, 32,768-token
# micro-batches, flex attention + activation checkpointing, bf16 autocast, AdamW (NOTES.md,
# bench/gpu_check.sh): 8,573 tok/s at 16 x 2,048, 8,312 at 8 x 4,096.
H200_TRAIN_TOKENS_PER_S = 8573.0
H200_TRAIN_BASIS = {"ttt_steps": 7, "hidden_size": 7168, "draft_vocab_size": 32000}
FSDP_SCALING = 0.9               # assumed: per-rank throughput kept under FSDP across the node's ranks
# Bytes each rank moves per micro-batch in the trainer's collectives (a model, assumed; times (n-1)/n of a ring):
# FSDP all-gathers the bf16 trainable weights in forward and again in backward and reduce-scatters their
# gradients (3 x 2 bytes per trainable parameter), and all-gathers the frozen bf16 embedding in forward;
# DDP all-reduces fp32 gradients (reduce-scatter + all-gather: 2 x 4 bytes per trainable parameter).
FSDP_BYTES_PER_TRAINABLE = 3 * 2
FSDP_BYTES_PER_FROZEN = 2
DDP_BYTES_PER_TRAINABLE = 2 * 4
MFU_EXTRACT = 0.30               # assumed: prefill of a MoE target in vLLM (compute-bound)
HBM_EFFICIENCY = 0.5             # assumed: share of peak HBM bandwidth a decode step achieves
DECODE_STEP_FLOOR_S = 0.015      # assumed: one decode step of a 61-layer TP-8 engine (launches, all-reduces) at least
REGEN_DECODE_BATCH = 256         # assumed: sequences vLLM decodes at once in regeneration without target.max_num_seqs
GPU_SPEC_SPEEDUP = 1.5           # assumed: speculative modes vs plain decoding in eval
# The cache's I/O (vLLM backend): the connector saves each batch's states synchronously in one
# worker, the parent process reads them back and writes the shard, and the writer hashes it.
CONNECTOR_WRITE_BYTES_PER_S = 1.5e9   # assumed: one synchronous safetensors save stream
PARENT_COPY_BYTES_PER_S = 1.0e9       # assumed: one process reading and re-writing the states
# One sha256 stream over shards in the page cache: measured on the 2-core avx512_bf16 CPU
# (bench/verify.py --synthetic-gb 4, 2026-12-07: 1.28 GB/s on 1 thread, 2.69 GB/s on 2; NOTES.md).
HASH_BYTES_PER_S = 1.28e9
HASH_BASIS = (f"measured ({HASH_BYTES_PER_S / 1e9:g} GB/s per sha256 thread, bench/verify.py on the 2-core CPU, "
              "2026-12-07)")
# Verification of the caches at the end of 03 (cache.verify_cache): sha256 on up to VERIFY_THREADS
# threads per process (cache.hash_problems; hashlib releases the GIL). On this CPU the cache was just
# written and is read from the page cache; on a GPU box it is not, and the threads share the disk.
VERIFY_THREADS = 8
BOX_CACHE_READ_BYTES_PER_S = 5e9      # assumed: the cache disk's read rate on a GPU node (NVMe)
BOX_CACHE_READ_BASIS = (f"assumed ({BOX_CACHE_READ_BYTES_PER_S / 1e9:g} GB/s: the cache disk's read rate on a GPU "
                        "node, NVMe; stage_times.BOX_CACHE_READ_BYTES_PER_S)")
# 04 reads the cache while it trains (train_stage; preflight.py measures the rate where the cache is)
CACHE_READ_PART = "cache read"
# A vLLM engine start on GPUs: fixed (processes, TP/EP groups, profiling run, CUDA graphs unless
# enforce_eager) plus the checkpoint read.
ENGINE_FIXED_S = 120.0           # assumed
ENGINE_LOAD_S_PER_GB = 0.5       # assumed: 2 GB/s from local NVMe or the page cache into the 8 GPUs
# Checkpoint bytes of known targets not on this machine (by hidden size): Kimi-K2.5 ships INT4
# experts, ~595 GB of safetensors as published (the figure used before, 554 GB, was ~7 % low).
KNOWN_CHECKPOINT_BYTES = {7168: 595e9}


@dataclass
class Part:
    name: str
    seconds: float
    basis: str                   # "measured ..." or "assumed ..."


@dataclass
class Stage:
    parts: list = field(default_factory=list)
    optional: bool = False
    # the stage's main work: (what, tokens/s, basis, seconds), e.g. ("regen", 315.0, "measured ...", 699.0)
    rate: Optional[tuple] = None

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    def add(self, name: str, seconds: float, basis: str) -> None:
        self.parts.append(Part(name, float(seconds), basis))

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "optional": self.optional,
                "parts": [{"name": p.name, "seconds": p.seconds, "basis": p.basis} for p in self.parts]}


@dataclass
class Workload:
    """What a profile asks each stage to do (plan.py computes it)."""
    chats: int                   # training + held-out chats the data stage prepares
    regen_tokens_train: float    # tokens generated for training chats
    regen_tokens_eval: float     # and for held-out chats
    extract_tokens: float        # train + eval tokens through the target
    cache_bytes: float           # train + eval hidden-state cache
    train_tokens: float          # tokens the trainer processes (epochs or steps)
    tokens_per_chat: float       # mean tokens of one training sequence
    planned_steps: int
    active_params: float         # target parameters touched per token
    total_params: float          # all target parameters (MoE: every expert)
    checkpoint_bytes: float      # the target's weights on disk (engine loads)
    checkpoint_basis: str
    drafter_flops_per_token: float
    cache_bytes_per_token: float = 0.0   # one cached token on disk (aux + final states, id, mask)
    served_tokens: float = 0.0   # extract.mode online: tokens the server prefills during training
    served_bytes: float = 0.0    # and the connector files it writes for them (staging, deleted once read)
    drafter_params: float = 0.0  # trainable drafter parameters (the trainer's collectives move them)
    frozen_params: float = 0.0   # frozen ones FSDP gathers too (the target's embedding)
    micro_batch_tokens: float = 0.0   # real tokens of one micro-batch (train.batch_tokens less padding)


@dataclass
class Host:
    """Where the run executes: this CPU (kind native_bf16 | avx2) or `gpus` GPUs of `gpu`."""
    kind: str
    gpus: int = 0
    gpu: Optional[str] = None
    gpu_basis: str = ""
    rates: dict = field(default_factory=dict)    # CPU: name -> (value, basis), from the records
    train_basis: dict = field(default_factory=dict)
    # CPU: every recorded training rate of this kind, [(tokens/s, basis text, train_basis)]; the
    # plan scales the one whose drafter is nearest in FLOPs per token (train_rate)
    train_points: list = field(default_factory=list)


# ---- hosts -------------------------------------------------------------------------------------
def host_kind() -> str:
    return "native_bf16" if cpu_has_native_bf16() else "avx2"


def recorded_runs(path: Optional[Path] = None) -> list:
    """The recorded runs (bench/recorded_stage_times.json), [] when the file is not there."""
    path = path or repo_root() / RECORDED_STAGE_TIMES
    return json.loads(path.read_text())["runs"] if path.is_file() else []


def cpu_host(kind: Optional[str] = None, runs: Optional[list] = None) -> Host:
    """This CPU with the rates of the recorded runs of its kind (newest last wins, by date); a run
    recorded only as a check (no "rates", e.g. ci) calibrates nothing."""
    kind = kind or host_kind()
    mine = sorted((r for r in (recorded_runs() if runs is None else runs) if r["host_kind"] == kind),
                  key=lambda r: r["date"])
    if not mine:
        raise ValueError(f"no recorded run on a {kind} host in {RECORDED_STAGE_TIMES}: record one "
                         "(`eagle3 run --params params/local.yaml` prints each stage's seconds)")
    rates, basis, points = {}, {}, []
    for r in mine:
        where = f"{r['profile']}, {r['date']}"
        rates.update({k: (v, f"measured ({where}: {why})") for k, (v, why) in r.get("rates", {}).items()})
        basis = r.get("train_basis", basis)
        if "train_tokens_per_s" in r.get("rates", {}) and "train_basis" in r:
            value, why = r["rates"]["train_tokens_per_s"]
            points.append((value, f"measured ({where}: {why})", r["train_basis"]))
    return Host(kind, rates=rates, train_basis=basis, train_points=points)


def gpu_kind(p: Params) -> tuple[str, str]:
    """(kind, basis): train.gpu_kind, else the GPU whose memory is nearest train.gpu_memory_gb (B300
    without either)."""
    if p.train.gpu_kind is not None:
        return p.train.gpu_kind, "train.gpu_kind"
    gb = p.train.gpu_memory_gb
    if gb is None:
        return "B300", "assumed (train.gpu_memory_gb not set)"
    kind = min(GPU_KINDS, key=lambda k: abs(GPU_KINDS[k][2] - gb))
    return kind, f"assumed from train.gpu_memory_gb = {gb:g} GB"


def host_for(p: Params, gpus: int, kind: Optional[str] = None, runs: Optional[list] = None) -> Host:
    """The host a profile plans for: `gpus` GPUs when it asks for CUDA, else this CPU."""
    if gpus:
        g, basis = gpu_kind(p)
        return Host("gpu", gpus=gpus, gpu=g, gpu_basis=basis)
    return cpu_host(kind, runs)


# ---- engine starts -----------------------------------------------------------------------------
def regen_backend(p: Params) -> Optional[str]:
    """The regeneration backend (regenerate.resolve_backend's rule; not imported: it loads torch)."""
    if not p.data.regenerate:
        return None
    b = p.data.regen_backend
    return ("vllm" if importlib.util.find_spec("vllm") is not None else "hf") if b == "auto" else b


def eval_modes(p: Params, stage: str) -> list:
    """vLLM modes of 01 (plain, each n-gram k; none when eval.baseline_vllm is false) or 05 (plain,
    n-gram, eagle3), and suffix decoding in the stage params.suffix_stage names: one engine each."""
    if not p.eval.use_vllm or (stage == "ngram" and not p.eval.baseline_vllm):
        return []
    suffix = ["suffix"] if suffix_stage(p.eval) == stage else []
    if stage == "ngram":
        return ["plain"] + [f"ngram_k{k}" for k in p.eval.ngram_k] + suffix
    return (["plain", f"ngram_k{p.eval.k}"] + suffix + [f"eagle3_k{p.eval.k}"]
            + [f"drafter-{d['name']}_k{p.eval.k}" for d in p.eval.drafters])     # eval.drafters: evaluate.vllm_modes


def engine_start(host: Host, work: Workload, eval_engine: bool = False) -> tuple[float, str]:
    if host.gpus:
        gb = work.checkpoint_bytes / 1e9
        return (ENGINE_FIXED_S + ENGINE_LOAD_S_PER_GB * gb,
                f"assumed ({ENGINE_FIXED_S:.0f} s + {ENGINE_LOAD_S_PER_GB} s/GB x {gb:,.0f} GB checkpoint, "
                f"{work.checkpoint_basis})")
    if eval_engine:
        return CPU_EVAL_ENGINE_START_S, f"measured ({CPU_EVAL_ENGINE_START_S:.0f} s: a CPU eval engine, ci 2026-12-05)"
    return CPU_ENGINE_START_S, "measured (bench/extract.py: one CPU engine, NOTES.md)"


def add_engines(stage: Stage, n: int, host: Host, work: Workload, what: str, eval_engine: bool = False) -> None:
    if n:
        s, basis = engine_start(host, work, eval_engine)
        stage.add(f"{n} vLLM engine start{'s' if n > 1 else ''} ({what})", n * s, basis)


# ---- rates -------------------------------------------------------------------------------------
def kernel_start(host: Host) -> tuple[float, str]:
    """A notebook's start: kernel, papermill, the library imported."""
    if host.gpus:
        return KERNEL_START_S, f"assumed ({KERNEL_START_S:.0f} s)"
    return CPU_NOTEBOOK_START_S, f"measured ({CPU_NOTEBOOK_START_S:.0f} s, ci 2026-12-05)"


def cpu_rate(host: Host, name: str, default: Optional[tuple] = None) -> tuple[float, str]:
    return host.rates.get(name) or default


def target_speed_ratio(host: Host, work: Workload) -> float:
    """CPU target rates were recorded on SmolLM2-135M; a bigger target is slower in proportion,
    a smaller one no faster (small models are overhead-bound on the CPU; assumed)."""
    return min(1.0, 135e6 / work.active_params)


def decode_step_s(host: Host, work: Workload, batch: int, context: float, kv: "KvCache") -> float:
    """One decode step on GPUs: the weights it touches (a MoE step at a large batch touches every
    expert: the whole checkpoint; at batch 1 the active weights), split over the engine's GPUs, plus
    the KV cache each GPU reads (an MLA latent is held and read whole by every tensor-parallel rank;
    K and V of other targets are split over them), at HBM_EFFICIENCY of one GPU's memory bandwidth;
    at least DECODE_STEP_FLOOR_S."""
    _, bw, _ = GPU_KINDS[host.gpu]
    weights = work.checkpoint_bytes * (1.0 if batch > 1 else min(1.0, work.active_params / work.total_params))
    kv_per_gpu = batch * context * kv.bytes_per_token / (1 if kv.replicated else host.gpus)
    return max(DECODE_STEP_FLOOR_S, (weights / host.gpus + kv_per_gpu) / (bw * HBM_EFFICIENCY))


@dataclass
class KvCache:
    bytes_per_token: float       # one token's KV cache, all layers
    replicated: bool             # every tensor-parallel rank holds all of it (MLA's latent)
    basis: str


# Kimi-K2.5 / DeepSeek-V3's MLA (hidden 7168): kv_lora_rank and qk_rope_head_dim, used where the
# target's config.json is not on this machine (assumed: the published config).
KNOWN_MLA = {7168: (512, 64)}


def target_config(p: Params) -> dict:
    """The target's config.json (its text_config for multimodal wrappers), {} when not on this machine."""
    path = Path(p.target.path) / "config.json"
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return c.get("text_config", c) if isinstance(c, dict) else {}


def kv_cache(p: Params) -> KvCache:
    """The engine's KV cache per token in target.dtype: MLA's latent (kv_lora_rank + qk_rope_head_dim per
    layer) from config.json, else Kimi-K2.5's known figures by hidden size (assumed), else K and V of every
    layer from the shape (assumed)."""
    s, c = p.target_shape() or {}, target_config(p)
    layers, h = s.get("num_hidden_layers", 1), s.get("hidden_size", 1)
    elem = 4 if p.target.dtype == "float32" else 2
    if c.get("kv_lora_rank"):
        latent = c["kv_lora_rank"] + c.get("qk_rope_head_dim", 0)
        return KvCache(elem * layers * latent, True, f"measured: config.json, MLA ({c['kv_lora_rank']} + "
                       f"{c.get('qk_rope_head_dim', 0)}) x {layers} layers x {elem} bytes, on every GPU")
    if h in KNOWN_MLA:
        rank, rope = KNOWN_MLA[h]
        return KvCache(elem * layers * (rank + rope), True, f"assumed: Kimi-K2.5's MLA ({rank} + {rope}) x {layers} "
                       f"layers x {elem} bytes (config.json not on this machine), on every GPU")
    heads, kv_heads = s.get("num_attention_heads", 1), s.get("num_key_value_heads", 1)
    return KvCache(elem * layers * 2 * h * kv_heads / heads, False,
                   f"assumed from the shape: K and V of {layers} layers, split over the GPUs")


def regen_batch(p: Params) -> tuple[int, str]:
    """(sequences, basis) regeneration decodes at once: target.max_num_seqs, else REGEN_DECODE_BATCH (assumed)."""
    if p.target.max_num_seqs is not None:
        return p.target.max_num_seqs, "target.max_num_seqs"
    return REGEN_DECODE_BATCH, "assumed; target.max_num_seqs not set"


def collective_seconds(p: Params, host: Host, work: Workload, ranks: int) -> tuple[float, str]:
    """(seconds, basis) of one micro-batch's collectives per rank over the kind's interconnect: FSDP's
    all-gathers and reduce-scatter, or DDP's all-reduce (FSDP_BYTES_PER_*, DDP_BYTES_PER_TRAINABLE; a
    ring moves (n-1)/n of them per rank). A model, assumed."""
    link_bytes, link = INTERCONNECT[host.gpu]
    fsdp = p.train.distributed == "fsdp"
    moved = (FSDP_BYTES_PER_TRAINABLE * work.drafter_params + FSDP_BYTES_PER_FROZEN * work.frozen_params if fsdp
             else DDP_BYTES_PER_TRAINABLE * work.drafter_params) * (ranks - 1) / ranks
    what = ("FSDP all-gathers (forward, backward) and reduce-scatter of the bf16 trainable weights, all-gather of "
            "the frozen embedding" if fsdp else "DDP all-reduce of the fp32 gradients")
    return moved / link_bytes, (f"assumed: {moved / 1e9:,.1f} GB per micro-batch per rank ({what}) over {link} "
                                f"at {link_bytes / 1e9:g} GB/s per direction")


def gpu_train_rate(p: Params, host: Host, work: Workload) -> tuple[float, str]:
    """Trainer tokens/s on GPUs: the H200 measurement scaled by the kind's bf16 FLOP/s and the drafter's
    FLOPs per token, times the ranks at FSDP_SCALING; on several ranks each micro-batch takes at least its
    collectives' time over the interconnect (collective_seconds: the larger of the two bounds the step)."""
    flops, _, _ = GPU_KINDS[host.gpu]
    ranks = p.train.nproc if p.train.distributed != "none" else 1
    basis_flops = drafter_flops_per_token(H200_TRAIN_BASIS)
    per_rank = H200_TRAIN_TOKENS_PER_S * flops / GPU_KINDS["H200"][0] * basis_flops / work.drafter_flops_per_token
    basis = (f"measured on one H200 rank at Kimi shapes ({H200_TRAIN_TOKENS_PER_S:,.0f} tok/s, ttt 7), "
             f"assumed to scale with bf16 FLOP/s to {host.gpu} ({host.gpu_basis}), with the drafter's "
             f"FLOPs per token, and x {ranks} ranks x {FSDP_SCALING if ranks > 1 else 1.0} (FSDP)")
    if ranks == 1:
        return per_rank, basis
    tokens = work.micro_batch_tokens or p.train.batch_tokens
    compute_s = tokens / (per_rank * FSDP_SCALING)
    comm_s, comm_basis = collective_seconds(p, host, work, ranks)
    bound = "they bound the step" if comm_s > compute_s else "hidden under it"
    basis += (f"; the collectives take {comm_s:.2f} s per micro-batch against the compute's {compute_s:.2f} s "
              f"({bound}; {comm_basis})")
    return ranks * tokens / max(compute_s, comm_s), basis


def train_rate(p: Params, host: Host, work: Workload) -> tuple[float, str]:
    """Trainer tokens/s: the GPU measurement scaled per GPU kind, ranks and interconnect (gpu_train_rate),
    or this CPU's record scaled by the drafter's FLOPs per token and the dtype."""
    train_params = p.train
    if host.gpus:
        return gpu_train_rate(p, host, work)
    value, basis = cpu_rate(host, "train_tokens_per_s")
    b = host.train_basis
    if host.train_points:                # the record whose drafter is nearest in FLOPs per token
        value, basis, b = min(host.train_points, key=lambda q: abs(math.log(
            drafter_flops_per_token(q[2]) / work.drafter_flops_per_token)))
    rate = value * drafter_flops_per_token(b) / work.drafter_flops_per_token if b else value
    rate = min(rate, CPU_TINY_DRAFTER_CAP * value)      # tiny drafters are overhead-bound
    native = host.kind == "native_bf16"
    if native and b.get("dtype") == "bfloat16" and train_params.dtype != "bfloat16":
        rate /= CPU_BF16_TRAIN_SPEEDUP
    elif native and b.get("dtype") != "bfloat16" and train_params.dtype == "bfloat16":
        rate *= CPU_BF16_TRAIN_SPEEDUP
    return rate, f"{basis}; scaled by the drafter's FLOPs per token and train.dtype ({train_params.dtype})"


def drafter_layers_params(h: int, intermediate: int, layers: int = 1) -> int:
    """Weights of the drafter's decoder layers: layer 0 with q and k/v (kv heads <= heads) on 2H
    and o_proj, later layers the same on H, each with a SwiGLU MLP of `intermediate`."""
    first = 2 * h * h * 2 + 2 * h * h // 2 + h * h
    later = h * h + h * h // 2 + h * h
    mlp = 3 * h * intermediate
    return first + mlp + (layers - 1) * (later + mlp)


def drafter_flops_per_token(shape: dict, ttt_steps: Optional[int] = None) -> float:
    """Training FLOPs per token of the drafter (6 x parameters per TTT step, plus the target head's
    labels over the draft vocabulary); shape: hidden_size, draft_vocab_size, ttt_steps and
    optionally draft_layers (1)."""
    h, dv = shape["hidden_size"], shape["draft_vocab_size"]
    steps = ttt_steps or shape["ttt_steps"]
    weights = 3 * h * h + drafter_layers_params(h, 8 * h // 3, shape.get("draft_layers", 1)) + dv * h
    return steps * 6 * weights + 2 * dv * h


# ---- the stages --------------------------------------------------------------------------------
def stage_seconds(p: Params, work: Workload, host: Host, measured: Optional[dict] = None) -> dict:
    """{stage: Stage} of a full run (and the optional scaling study). measured: this run folder's
    measured rates {"regen"|"extract"|"train": (tokens/s, where)}, used before any other basis."""
    measured = measured or {}
    kernel = kernel_start(host)
    stages = {name: Stage() for name in STAGES}
    for name in STAGES:
        stages[name].add("notebook kernel start", kernel[0], kernel[1])
    stages["research"].add("capacity plans (this run, local, b300 with its memory model)", RESEARCH_PLANS_S,
                           f"measured ({RESEARCH_PLANS_S} s, ci 2026-12-05)")
    decode_stage(p, work, host, stages["ngram"], "ngram")
    data_stage(p, work, host, stages["data"], measured)
    extract_stage(p, work, host, stages["extract"], measured)
    train_stage(p, work, host, stages["train"], measured)
    decode_stage(p, work, host, stages["eval"], "eval")
    if p.scaling.sizes:
        stages["scaling"] = scaling_stage(p, work, host)
    return stages


def data_stage(p: Params, work: Workload, host: Host, stage: Stage, measured: dict) -> None:
    stage.add("read, template and tokenise chats", work.chats * DATA_PREP_S_PER_CHAT,
              "measured (02 with every answer already regenerated: 25 s for 3,036 chats, NOTES.md)")
    backend = regen_backend(p)
    if backend is None:
        return
    tokens = work.regen_tokens_train + work.regen_tokens_eval
    rate, basis = regen_rate(p, work, host, backend, measured)
    add_engines(stage, 1 if backend == "vllm" else 0, host, work, "regeneration")
    if backend == "hf":
        stage.add("load the target in transformers", CPU_TARGET_LOAD_S,
                  f"measured ({CPU_TARGET_LOAD_S} s, ci 2026-12-05)")
    stage.add(f"regenerate {tokens:,.0f} tokens at {rate:,.0f} tok/s", tokens / rate, basis)
    stage.rate = ("regen", rate, basis, tokens / rate)


def regen_rate(p: Params, work: Workload, host: Host, backend: str, measured: dict) -> tuple[float, str]:
    if "regen" in measured:
        return measured["regen"][0], f"measured ({measured['regen'][1]})"
    if host.gpus:
        context = p.data.max_length / 2
        batch, batch_basis = regen_batch(p)
        kv = kv_cache(p)
        step = decode_step_s(host, work, batch, context, kv)
        return batch / step, (
            f"assumed decode-bandwidth model: {batch} sequences per step ({batch_basis}), each step reads the "
            f"checkpoint's {work.checkpoint_bytes / 1e9:,.0f} GB (every expert at this batch) over {host.gpus} x "
            f"{GPU_KINDS[host.gpu][1] / 1e12:g} TB/s and their KV cache "
            f"({'whole on every GPU' if kv.replicated else 'split'}) at {HBM_EFFICIENCY:.0%} "
            f"({host.gpu}, {host.gpu_basis})")
    ratio = target_speed_ratio(host, work)
    if backend == "vllm":
        value, basis = cpu_rate(host, "regen_vllm_tokens_per_s")
    else:
        value, basis = CPU_REGEN_HF_TOKENS_PER_S, "measured (batched HF generate on the CPU, ci 2026-12-05)"
    return value * ratio, basis + ("" if ratio == 1 else f"; x {ratio:.3f} for the target's size")


def extract_stage(p: Params, work: Workload, host: Host, stage: Stage, measured: dict) -> None:
    extract_compute(p, work, host, stage, measured)
    verify_part(p, work, host, stage)


def verify_seconds(gb: float, procs: int, host: Host) -> tuple[float, str]:
    """Seconds to hash `gb` GB over `procs` processes of up to VERIFY_THREADS threads each: the
    measured per-thread rate, capped on a GPU box by the disk's read rate (assumed)."""
    threads = procs * (VERIFY_THREADS if host.gpus else min(VERIFY_THREADS, os.cpu_count() or 1))
    hash_rate = threads * HASH_BYTES_PER_S
    basis = f"{HASH_BASIS}; {threads} threads"
    if host.gpus and BOX_CACHE_READ_BYTES_PER_S < hash_rate:
        return gb * 1e9 / BOX_CACHE_READ_BYTES_PER_S, \
            f"{basis}, bound by the disk: assumed {BOX_CACHE_READ_BYTES_PER_S / 1e9:g} GB/s read"
    return gb * 1e9 / hash_rate, basis + (", page cache (the cache was just written)" if not host.gpus else "")


def verify_part(p: Params, work: Workload, host: Host, stage: Stage) -> None:
    """03 ends with the cache's one verification (train.verify_cache), split over its writers
    (extract.nproc); 04 then finds it verified and reads no shard."""
    share, how = verify_share(p)
    if share:
        gb, procs = work.cache_bytes / 1e9 * share, p.extract.nproc
        stage.add(f"verify the cache ({how}, {gb:,.1f} GB over {procs} process{'es' if procs > 1 else ''})",
                  *verify_seconds(gb, procs, host))


def extract_compute(p: Params, work: Workload, host: Host, stage: Stage, measured: dict) -> None:
    """Engine start, target loads and the extraction itself (the stage's rate)."""
    vllm = p.extract.backend == "vllm"
    add_engines(stage, 1 if vllm else 0, host, work, "extraction; 03's vLLM fidelity check uses the same engine")
    loads = (0 if vllm else 1) + (1 if fidelity_loads_target(p, work) else 0)   # transformers loads of the target
    if loads:
        if host.gpus:
            seconds, basis = (work.checkpoint_bytes / 1e9 * ENGINE_LOAD_S_PER_GB,
                              f"assumed ({ENGINE_LOAD_S_PER_GB} s/GB)")
        else:
            seconds, basis = CPU_TARGET_LOAD_S, f"measured ({CPU_TARGET_LOAD_S} s, ci 2026-12-05)"
        stage.add(f"{loads} transformers load{'s' if loads > 1 else ''} of the target (extraction, fidelity check)",
                  loads * seconds, basis)
    if "extract" in measured:
        rate, basis = measured["extract"][0], f"measured ({measured['extract'][1]})"
        stage.add(f"extract {work.extract_tokens:,.0f} tokens at {rate:,.0f} tok/s", work.extract_tokens / rate, basis)
        stage.rate = ("extract", rate, basis, work.extract_tokens / rate)
        return
    if host.gpus:
        rate, basis = prefill_rate(p, work, host, measured)
        stage.add(f"prefill {work.extract_tokens:,.0f} tokens at {rate:,.0f} tok/s", work.extract_tokens / rate, basis)
        gb = work.cache_bytes / 1e9
        if vllm:
            stage.add(f"connector saves {gb:,.0f} GB (one worker, synchronous)",
                      work.cache_bytes / CONNECTOR_WRITE_BYTES_PER_S,
                      f"assumed ({CONNECTOR_WRITE_BYTES_PER_S / 1e9:g} GB/s)")
            stage.add(f"parent re-reads and re-writes {gb:,.0f} GB", work.cache_bytes / PARENT_COPY_BYTES_PER_S,
                      f"assumed ({PARENT_COPY_BYTES_PER_S / 1e9:g} GB/s, one process)")
        stage.add(f"writer's sha256 of {gb:,.0f} GB", work.cache_bytes / HASH_BYTES_PER_S, HASH_BASIS + ", one stream")
        seconds = sum(q.seconds for q in stage.parts[-4 if vllm else -2:])
        stage.rate = ("extract", work.extract_tokens / seconds,
                      "; ".join(q.basis for q in stage.parts[-4 if vllm else -2:]), seconds)
        return
    rate, basis = prefill_rate(p, work, host, measured)
    stage.add(f"extract {work.extract_tokens:,.0f} tokens at {rate:,.0f} tok/s", work.extract_tokens / rate, basis)
    stage.rate = ("extract", rate, basis, work.extract_tokens / rate)


def prefill_rate(p: Params, work: Workload, host: Host, measured: dict) -> tuple[float, str]:
    """Tokens/s of the target's prefill with hidden states out (03's extraction, online's server),
    without the cache's I/O: this run's measured extraction rate, else the GPUs' FLOPs at
    MFU_EXTRACT, else this CPU kind's recorded rate scaled to the target's size."""
    if "extract" in measured:
        return measured["extract"][0], f"measured ({measured['extract'][1]})"
    if host.gpus:
        flops, _, _ = GPU_KINDS[host.gpu]
        return (host.gpus * flops * MFU_EXTRACT / (2 * work.active_params),
                f"assumed ({host.gpus} x {flops / 1e15:.2f} PFLOP/s bf16 at MFU {MFU_EXTRACT}, {host.gpu})")
    value, basis = cpu_rate(host, "extract_tokens_per_s")
    ratio = target_speed_ratio(host, work)
    return value * ratio, basis + ("" if ratio == 1 else f"; x {ratio:.3f} for the target's size")


def fidelity_loads_target(p: Params, work: Workload) -> bool:
    """Whether 03's fidelity check loads the target in transformers (extract.fidelity hf, or auto
    with a checkpoint that fits this machine's memory: extract.fidelity_plan's rule)."""
    mode = getattr(p.extract, "fidelity", "hf")
    if mode == "auto":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return work.checkpoint_bytes <= memory
    return mode == "hf"


def verify_share(p: Params) -> tuple[float, str]:
    """Share of the cache bytes hashed before training (train.verify_cache: full | sampled | sizes)."""
    mode = getattr(p.train, "verify_cache", "full")
    if mode == "sizes":
        return 0.0, "sizes only"
    if mode == "sampled":
        return getattr(p.train, "verify_sample", 1.0), f"sampled ({getattr(p.train, 'verify_sample', 1.0):.0%})"
    return 1.0, "full sha256"


def train_stage(p: Params, work: Workload, host: Host, stage: Stage, measured: dict) -> None:
    train_params = p.train
    ranks = train_params.nproc if train_params.distributed != "none" else 1
    setup = (TRAIN_SETUP_S, f"assumed ({TRAIN_SETUP_S:.0f} s)") if host.gpus else \
        (CPU_TRAIN_SETUP_S, f"measured ({CPU_TRAIN_SETUP_S:.0f} s, ci 2026-12-05)")
    stage.add("setup (imports, cache, drafter, target head)", *setup)
    if ranks > 1 and not host.gpus:
        stage.add(f"torchrun start ({ranks} ranks)", TORCHRUN_START_S,
                  f"measured ({TORCHRUN_START_S:.0f} s, mini-kimi 2026-12-05)")
    if "train" in measured:
        rate, basis = measured["train"][0], f"measured ({measured['train'][1]})"
    else:
        rate, basis = train_rate(p, host, work)
    seconds = work.train_tokens / rate
    stage.rate = ("train", rate, basis, seconds)
    if work.served_tokens:                               # extract.mode online: the prefill, every epoch
        served_part(p, work, host, stage, measured)
    if train_params.time_budget_minutes is not None and 60 * train_params.time_budget_minutes < seconds:
        stage.add(f"train (train.time_budget_minutes stops it at {train_params.time_budget_minutes:g} min)",
                  60 * train_params.time_budget_minutes, f"train.time_budget_minutes; the rate: {basis}")
    else:
        stage.add(f"train {work.planned_steps:,} steps, {work.train_tokens:,.0f} tokens at {rate:,.0f} tok/s",
                  seconds, basis)
        if host.gpus and not work.served_tokens:
            cache_read_part(work, stage, measured, seconds)


def cache_read_part(work: Workload, stage: Stage, measured: dict, compute_s: float) -> None:
    """Offline on GPUs, 04's DataLoader workers read the cache while the ranks compute, so 04 takes the
    larger of the two: the part is what the read (train tokens x bytes per cached token at the disk's
    rate: measured["cache_read"], else BOX_CACHE_READ_BYTES_PER_S) takes beyond the compute, 0 when the
    compute hides it. On this CPU the recorded training rates already include their reads."""
    rate, basis = measured.get("cache_read") or (BOX_CACHE_READ_BYTES_PER_S, BOX_CACHE_READ_BASIS)
    read_bytes = work.train_tokens * work.cache_bytes_per_token
    read_s = read_bytes / rate
    how = (f"{read_bytes / 1e9:,.0f} GB at {rate / 1e9:,.1f} GB/s take {read_s:,.0f} s against the compute's "
           f"{compute_s:,.0f} s")
    if read_s > compute_s:
        stage.add(f"{CACHE_READ_PART} beyond the compute ({how}: the disk bounds 04)", read_s - compute_s, basis)
    else:
        stage.add(f"{CACHE_READ_PART} ({how}: hidden under it by the DataLoader workers)", 0.0, basis)


SERVED_PART = "server prefill"      # mode_plan.py finds the online part of the train stage by this name


def served_part(p: Params, work: Workload, host: Host, stage: Stage, measured: dict) -> None:
    """extract.mode online: the server's start, its prefill of every trained token (each epoch
    again) and, on GPUs, the connector's synchronous writes of their states; the trainer waits for
    them (the prefetch queue is one micro-batch deep per worker)."""
    add_engines(stage, 1, host, work, "the online hidden-states server")
    rate, basis = prefill_rate(p, work, host, measured)
    stage.add(f"{SERVED_PART} of {work.served_tokens:,.0f} tokens at {rate:,.0f} tok/s", work.served_tokens / rate,
              basis)
    if host.gpus:
        stage.add(f"connector saves {work.served_bytes / 1e9:,.0f} GB (one worker, synchronous; deleted once read)",
                  work.served_bytes / CONNECTOR_WRITE_BYTES_PER_S,
                  f"assumed ({CONNECTOR_WRITE_BYTES_PER_S / 1e9:g} GB/s)")


def decode_stage(p: Params, work: Workload, host: Host, stage: Stage, which: str) -> None:
    """01 (which="ngram") or 05 ("eval"): eagle3lib's reference decoder (plain + methods) on
    eval.decoder_prompts, and one vLLM engine per mode on eval.vllm_prompts (+ breadth groups in 05)."""
    e = p.eval
    n_prompts = min(e.num_prompts, p.data.num_eval)
    new = e.max_new_tokens
    runs_decoder = e.reference_decoder == "always" or (e.reference_decoder == "auto" and not host.gpus)
    if runs_decoder:
        methods = 1 + (2 * len(e.ngram_k) if which == "ngram" else 2)    # plain + the sweep / n-gram and EAGLE-3
        prompts = min(e.decoder_prompts or n_prompts, n_prompts)
        tokens = prompts * new * methods
        rate, basis = cpu_rate(host, "decoder_tokens_per_s", (17.4, "assumed")) if not host.gpus else \
            (1 / DECODE_STEP_FLOOR_S, "assumed (batch-1 decode-step floor)")
        rate *= target_speed_ratio(host, work) if not host.gpus else 1.0
        load = (CPU_TARGET_LOAD_S, f"measured ({CPU_TARGET_LOAD_S} s, ci 2026-12-05)") if not host.gpus else \
            (work.checkpoint_bytes / 1e9 * ENGINE_LOAD_S_PER_GB, f"assumed ({ENGINE_LOAD_S_PER_GB} s/GB)")
        stage.add("load the target for eagle3lib's decoder", *load)
        stage.add(f"eagle3lib decoder: {methods} methods x {prompts} prompts x {new} tokens at {rate:,.1f} tok/s",
                  tokens / rate, basis)
    modes = eval_modes(p, which)
    if not modes:
        return
    if not host.gpus:
        stage.add("the vLLM child process (python, vllm import)", CPU_VLLM_CHILD_START_S,
                  f"measured ({CPU_VLLM_CHILD_START_S:.0f} s, ci 2026-12-05)")
    add_engines(stage, len(modes), host, work, ", ".join(modes), eval_engine=True)
    prompts = min(e.vllm_prompts or n_prompts, n_prompts)
    if which == "eval":
        temps = 1 + len(e.sample_temperatures)
        groups = (1 + len(e.domains)) * temps - 1 if (e.domains or e.sample_temperatures) else 0
        prompts += groups * e.breadth_prompts
    if host.gpus:
        plain = 1 / decode_step_s(host, work, 1, new, kv_cache(p))
        basis = (f"assumed decode-bandwidth model at batch 1: active weights over {host.gpus} x "
                 f"{GPU_KINDS[host.gpu][1] / 1e12:g} TB/s, at least {DECODE_STEP_FLOOR_S * 1e3:.0f} ms per step; "
                 f"speculative modes x {GPU_SPEC_SPEEDUP}")
        speedup = GPU_SPEC_SPEEDUP
    else:
        plain, basis = cpu_rate(host, "vllm_decode_tokens_per_s")
        plain *= target_speed_ratio(host, work)
        basis += f"; speculative modes x {CPU_SPEC_SPEEDUP} (measured 1.38-1.58x, NOTES.md)"
        speedup = CPU_SPEC_SPEEDUP
    seconds = sum(prompts * new / (plain * (1 if m == "plain" else speedup)) for m in modes)
    stage.add(f"vLLM: {len(modes)} modes x {prompts} prompts x {new} tokens (plain {plain:,.1f} tok/s)", seconds, basis)


def scaling_stage(p: Params, work: Workload, host: Host) -> Stage:
    """06: one training run per point on its chats for scaling.epochs, then one vLLM engine per point
    (and plain) on the held-out prompts (optional: `eagle3 run --only scaling`)."""
    stage = Stage(optional=True)
    stage.add("notebook kernel start", *kernel_start(host))
    rate, basis = train_rate(p, host, work)
    tokens = sum(p.scaling.sizes) * work.tokens_per_chat * p.scaling.epochs
    stage.add(f"train {len(p.scaling.sizes)} points ({sum(p.scaling.sizes):,} chats x {p.scaling.epochs:g} epochs)",
              tokens / rate + (TRAIN_SETUP_S if host.gpus else CPU_TRAIN_SETUP_S) * len(p.scaling.sizes), basis)
    if p.scaling.vllm and p.eval.use_vllm:
        add_engines(stage, 1 + len(p.scaling.sizes), host, work, "plain and each point", eval_engine=True)
    return stage
