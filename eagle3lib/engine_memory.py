"""Per-GPU memory of the vLLM engines on the planned GPUs, before anything runs: the weights each GPU
holds, the engine's other memory, the KV room that leaves, and what each engine needs of it.

    rows = engine_memory(p, kind, checkpoint_bytes, prompt_tokens)  # [EngineMemory]: regeneration, extraction, eval
    problems = engine_problems(p, rows)                # [(level, key, text)]: plan.full_run_problems adds them
    problem = online_problem(p, rows, trainer_peak)    # extract.mode online beside a trainer that has no room

Per GPU, in GB (1e9 bytes); every figure says measured or assumed:
- the engine's share: target.gpu_memory_utilization x the GPU's memory (train.gpu_memory_gb, else the
  kind's: gpus.py);
- weights: the checkpoint's bytes / target.tensor_parallel_size (experts and attention assumed split
  evenly over the ranks);
- other: ENGINE_FIXED_GB + ENGINE_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN x hidden x the engine's
  max_num_batched_tokens (CUDA context, graphs, NCCL buffers, the step's activations; assumed);
- KV room: the share less weights and other;
- needs: one sequence of the engine's max_model_len (vLLM refuses to start without it), and for
  regeneration its batch (stage_times.regen_batch) x (prompt + data.regen_max_new_tokens) tokens, at the
  KV bytes per token (stage_times.kv_cache; an MLA latent is held whole by every GPU).
A regeneration batch over the KV room would not stop vLLM (it preempts and recomputes sequences), but
the plan's regeneration rate would not hold: it is refused too, naming target.max_num_seqs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .gpus import GPU_KINDS
from .params import Params, gpu_memory_budget
from .stage_times import kv_cache, regen_backend, regen_batch

# assumed: memory an engine takes per GPU besides its weights and KV cache, whatever its batch (CUDA
# context, CUDA graphs, NCCL buffers, the sampler)
ENGINE_FIXED_GB = 2.0
# assumed: the step's activations per batched token, in bytes per unit of hidden size: a MoE layer's
# top-8 copies of the bf16 hidden (16 H), its experts' intermediates, attention and residual buffers
# (~0.26 MB per token at hidden 7168)
ENGINE_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 36
# vLLM 0.32's max_num_batched_tokens for its offline LLM class on GPUs of 70 GiB and more, when unset
VLLM_DEFAULT_BATCHED_TOKENS = 16384
HEADROOM = 0.20          # memory.HEADROOM: a trainer must leave this share of its room free


@dataclass
class EngineMemory:
    engine: str                  # regeneration | extraction | eval
    memory_gb: float             # one GPU's memory
    share_gb: float              # target.gpu_memory_utilization of it: the engine's
    weights_gb: float
    other_gb: float
    kv_bytes_per_token: float
    basis: str
    needs: list = field(default_factory=list)   # [(what, GB, the key that sets it)]

    @property
    def kv_room_gb(self) -> float:
        return self.share_gb - self.weights_gb - self.other_gb

    def as_dict(self) -> dict:
        return {"engine": self.engine, "memory_gb": self.memory_gb, "share_gb": self.share_gb,
                "weights_gb": self.weights_gb, "other_gb": self.other_gb, "kv_room_gb": self.kv_room_gb,
                "kv_bytes_per_token": self.kv_bytes_per_token, "basis": self.basis,
                "needs": [{"what": w, "gb": gb, "key": k} for w, gb, k in self.needs]}


def gpu_memory_gb(p: Params, kind: str) -> float:
    """One GPU's memory: train.gpu_memory_gb, else train.gpu_kind's, else the planned kind's (gpus.py)."""
    return gpu_memory_budget(p.train) or float(GPU_KINDS[kind][2])


def engines(p: Params) -> list:
    """(engine, max_num_batched_tokens or None, max_model_len) of each vLLM engine kind the run starts."""
    d, e, t = p.data, p.eval, p.target
    out = []
    if regen_backend(p) == "vllm":
        out.append(("regeneration", t.max_num_batched_tokens, d.max_length + d.regen_max_new_tokens))
    if p.extract.backend == "vllm":
        out.append(("extraction", p.extract.vllm_max_num_batched_tokens or t.max_num_batched_tokens,
                    d.max_length + 1))
    if e.use_vllm:
        out.append(("eval", e.vllm_max_num_batched_tokens or t.max_num_batched_tokens,
                    (e.max_prompt_tokens or d.max_length) + e.max_new_tokens))
    return out


def engine_memory(p: Params, kind: str, checkpoint_bytes: float, prompt_tokens: float) -> list:
    """One EngineMemory per vLLM engine kind of the run on GPUs of `kind` (see the module docstring);
    prompt_tokens: a regenerated chat's prompt and template (plan.REGEN_PROMPT_TOKENS)."""
    t, d = p.target, p.data
    memory = gpu_memory_gb(p, kind)
    hidden = (p.target_shape() or {}).get("hidden_size", 0)
    kv = kv_cache(p)
    rows = []
    for name, batched, max_model_len in engines(p):
        tokens = batched or VLLM_DEFAULT_BATCHED_TOKENS
        other = ENGINE_FIXED_GB + ENGINE_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN * hidden * tokens / 1e9
        basis = (f"assumed: weights {checkpoint_bytes / 1e9:,.0f} GB / tensor parallel {t.tensor_parallel_size}; "
                 f"other {ENGINE_FIXED_GB:g} GB + {ENGINE_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN} B x hidden {hidden} x "
                 f"{tokens:,} batched tokens{'' if batched else ' (vLLM default)'}; KV {kv.basis}")
        weights = checkpoint_bytes / 1e9 / t.tensor_parallel_size
        row = EngineMemory(name, memory, t.gpu_memory_utilization * memory, weights, other, kv.bytes_per_token, basis)
        row.needs.append((f"one {max_model_len:,}-token sequence", max_model_len * kv.bytes_per_token / 1e9,
                          "data.max_length"))
        if name == "regeneration":
            batch, batch_basis = regen_batch(p)
            per_seq = prompt_tokens + d.regen_max_new_tokens
            row.needs.append((f"{batch:,} sequences x {per_seq:,.0f} tokens ({batch_basis}; prompt + "
                              "data.regen_max_new_tokens)", batch * per_seq * kv.bytes_per_token / 1e9,
                              "target.max_num_seqs"))
        rows.append(row)
    return rows


def _share(row: EngineMemory, p: Params) -> str:
    return (f"{row.share_gb:,.1f} GB (target.gpu_memory_utilization {p.target.gpu_memory_utilization:g} x "
            f"{row.memory_gb:g} GB)")


def engine_problems(p: Params, rows: list) -> list:
    """[(level, key, text)]: an engine whose weights and other memory exceed its share of the GPU, or whose
    KV room holds less than one max_model_len sequence or regeneration's batch."""
    out = []
    for row in rows:
        if row.kv_room_gb <= 0:
            out.append(("refuse", "target.gpu_memory_utilization", (
                f"the {row.engine} engine's weights ({row.weights_gb:,.1f} GB per GPU) and other memory "
                f"({row.other_gb:,.1f} GB) exceed its {_share(row, p)}: raise target.gpu_memory_utilization, lower "
                "its max_num_batched_tokens, or spread the weights over more GPUs (target.tensor_parallel_size)")))
            continue
        for what, need_gb, key in row.needs:
            if need_gb <= row.kv_room_gb:
                continue
            out.append(("refuse", key, kv_room_text(p, row, what, need_gb, key)))
    return out


def kv_room_text(p: Params, row: EngineMemory, what: str, need_gb: float, key: str) -> str:
    room = (f"the {row.engine} engine's KV room is {row.kv_room_gb:,.1f} GB per GPU ({_share(row, p)} less weights "
            f"{row.weights_gb:,.1f} GB and other {row.other_gb:,.1f} GB), {what} need {need_gb:,.1f} GB "
            f"at {row.kv_bytes_per_token:,.0f} B per token")
    if key == "target.max_num_seqs":
        per_seq = need_gb / regen_batch(p)[0]
        fits = int(row.kv_room_gb // per_seq)
        return (f"{room}: set target.max_num_seqs <= {fits:,} (vLLM would preempt and recompute sequences, and the "
                "plan's regeneration rate would not hold), or lower data.regen_max_new_tokens, or raise "
                "target.gpu_memory_utilization")
    return (f"{room}: vLLM refuses to start; lower data.max_length (or eval.max_prompt_tokens / eval.max_new_tokens), "
            "raise target.gpu_memory_utilization or lower the engine's max_num_batched_tokens")


def online_problem(p: Params, rows: list, trainer_peak_gb: Optional[float]) -> Optional[tuple]:
    """(level, key, text) when extract.mode online cannot run on these GPUs: the server's weights leave a
    trainer beside it (every GPU shared) less room than the memory model's peak plus HEADROOM, or the
    server's own GPUs (extract.online_gpus) cannot hold its weights. None otherwise, or without GPU rows."""
    server = next((r for r in rows if r.engine == "extraction"), None)
    if p.extract.mode != "online" or server is None:
        return None
    least_gb = server.weights_gb + server.other_gb + server.needs[0][1]       # the server's minimum per GPU
    if p.extract.online_gpus:
        if least_gb <= server.share_gb:
            return None
        return ("refuse", "extract.mode", (
            f"online on extract.online_gpus: the server's weights ({server.weights_gb:,.1f} GB per GPU at tensor "
            f"parallel {p.target.tensor_parallel_size}), other memory and one sequence's KV need "
            f"{least_gb:,.1f} GB, over its {_share(server, p)}: use extract.mode: offline"))
    room = server.memory_gb - least_gb
    if room > 0 and (trainer_peak_gb is None or trainer_peak_gb <= (1 - HEADROOM) * room):
        return None                                 # room for a trainer (or no peak to compare: plan memory=False)
    peak = "" if trainer_peak_gb is None else (f", the trainer's peak is {trainer_peak_gb:,.0f} GB (memory model) "
                                               f"+ {HEADROOM:.0%} headroom")
    return ("refuse", "extract.mode", (
        f"online beside the trainer on every GPU: the server's weights ({server.weights_gb:,.1f} GB per GPU: the "
        f"checkpoint / tensor parallel {p.target.tensor_parallel_size}), other memory and one sequence's KV take "
        f"at least {least_gb:,.1f} of {server.memory_gb:g} GB, leaving {room:,.1f} GB for the trainer{peak}; "
        "no room for a trainer beside the server: use extract.mode: offline (03 writes the cache once)"))
