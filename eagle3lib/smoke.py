"""The smoke slice of a profile (`eagle3 run --params PROFILE --smoke`): the same target, engines,
parallel layout and stages as the full run, on a tiny slice, in its own run folder.

    smoke = smoke_params(params)      # params with only SIZE_FIELDS changed, run_name "<run_name>-smoke"
    branches(smoke) == branches(params)   # every decision the pipeline takes from the profile is the same

A long run that dies at hour 3 costs hours; its smoke run meets the same failure in minutes. The
slice changes how much work each stage does (chats read, chats trained on, optimizer steps,
prompts, tokens generated), never which code runs: `changed_fields(params, smoke)` lists what differs and
the tests check that it lies inside SIZE_FIELDS, and that `branches` (the decisions derived from
the profile: regeneration and extraction backends, distributed mode, checkpoint format, eval
backends, reference decoder, scaling study, ...) is the same for both. Training runs in two legs
(runner.py): the first to the end, with a checkpoint half way; the second resumes from that one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from .params import (
    Params,
    check_run_name,
    data_sources,
    gpu_memory_budget,
    max_warmup_steps,
    regen_cap_problem,
    suffix_stage,
    train_ranks,
    validate,
)
from .regenerate import resolve_backend as resolve_regen_backend

SMOKE_SUFFIX = "-smoke"


@dataclass(frozen=True)
class Slice:
    """The smoke slice's sizes; a profile whose own size is smaller keeps its own."""
    chats: int = 32                 # training chats (data.num_train)
    eval_chats: int = 8             # held-out chats (data.num_eval)
    records_per_chat: int = 20      # raw records read per chat needed (ci reads 600 for 32)
    steps: int = 20                 # optimizer steps; a checkpoint half way, the second leg resumes it
    sequence_tokens: int = 256      # data.max_length, and the micro-batch (train.batch_tokens) holds one such
    eval_prompts: int = 8           # 05 (and 01): held-out prompts
    new_tokens: int = 32            # tokens per generated answer (regeneration, 01, 05)
    breadth_prompts: int = 2        # prompts per breadth group (05)


SLICE = Slice()

# The fields smoke_params may change: they set how much work a stage does, not which code runs.
SIZE_FIELDS = frozenset({
    "run_name", "description",
    "data.source", "data.max_records", "data.num_train", "data.num_eval", "data.regen_max_new_tokens",
    "data.regen_num_train", "data.max_length",
    "extract.shard_tokens",
    "train.batch_tokens", "train.max_steps", "train.checkpoint_every", "train.checkpoint_fraction",
    "train.warmup_steps",
    "train.eval_sequences",
    "train.max_sequences", "train.resume",
    "eval.num_prompts", "eval.vllm_prompts", "eval.decoder_prompts", "eval.max_new_tokens",
    "eval.breadth_prompts",
    "scaling.sizes",
})


def smoke_run_name(run_name: str) -> str:
    """"<run_name>-smoke", cut to a valid run name (at most 100 characters)."""
    return check_run_name(run_name[:100 - len(SMOKE_SUFFIX)] + SMOKE_SUFFIX)


def _cap(value: Optional[int], limit: int) -> int:
    """min(value, limit), where None (all) counts as unlimited."""
    return limit if value is None else min(value, limit)


def smoke_chats(p: Params, s: Slice, sequence_tokens: int, new_tokens: int) -> int:
    """Training chats of the slice: s.chats, or more where the ranks need them. An optimizer step
    takes one micro-batch per rank and grad_accum step; a micro-batch of sequence_tokens holds k
    sequences only when each is at most sequence_tokens / k long, and a slice sequence holds at least
    its answer (new_tokens), so per_step x ceil(sequence_tokens / new_tokens) chats give every step
    its micro-batches (8 ranks: 64 chats at 256 tokens and 32-token answers)."""
    per_step = train_ranks(p) * p.train.grad_accum
    return max(s.chats, per_step * math.ceil(sequence_tokens / max(1, new_tokens)))


def _capped_sources(source: Any, records: int) -> Any:
    """data.source with every listed source capped at its share of `records` raw records, so each
    source of a list is still read (a global cap would stop inside the first one)."""
    items = data_sources(source)
    if isinstance(source, str):
        return source
    share = max(1, records // len(items))
    return [{"path": path, "max_records": _cap(cap, share)} for path, cap, _ in items]


def smoke_params(p: Params, run_name: Optional[str] = None, s: Slice = SLICE) -> Params:
    """The smoke profile of `p`: every field outside SIZE_FIELDS unchanged; the sizes of `s` (or
    `p`'s own where smaller); run_name `run_name` or "<p.run_name>-smoke"; validated."""
    d, x, train_params, e, sc = p.data, p.extract, p.train, p.eval, p.scaling
    # A target that may think keeps its answer cap and sequence length: cut to a few tokens, thinking
    # answers would be refused (params.regen_cap_problem), and their length is what the smoke run
    # should time. Otherwise sequences are cut at s.sequence_tokens, and the micro-batch holds one of
    # them (train.batch_tokens >= data.max_length), so that the slice fills every rank's micro-batches.
    may_think = d.thinking != "off" and regen_cap_problem(d, thinking=True) is None
    new_tokens = d.regen_max_new_tokens if may_think else min(d.regen_max_new_tokens, s.new_tokens)
    max_length = d.max_length if may_think else min(d.max_length, s.sequence_tokens)
    num_train = _cap(d.num_train, smoke_chats(p, s, max_length, new_tokens))
    num_eval = min(d.num_eval, s.eval_chats)
    records = (num_train + num_eval) * s.records_per_chat
    # partial regeneration (regen_num_train < num_train) stays partial: half the smoke chats
    regen_num_train = None if d.regen_num_train is None else (
        min(d.regen_num_train, num_train) if d.num_train is not None and d.regen_num_train >= d.num_train
        else max(1, min(d.regen_num_train, num_train // 2)))
    steps = max(2, _cap(train_params.max_steps, s.steps))  # two legs: at least a checkpoint before the last step
    prompts = min(e.num_prompts, s.eval_prompts)
    data = dataclasses.replace(
        d, source=_capped_sources(d.source, records), max_records=_cap(d.max_records, records),
        num_train=num_train, num_eval=num_eval, regen_max_new_tokens=new_tokens, regen_num_train=regen_num_train,
        max_length=max_length)
    # several cache shards, as the full run has: about a few answers' worth of tokens per shard
    extract = dataclasses.replace(x, shard_tokens=min(x.shard_tokens, num_train * new_tokens))
    # a checkpoint half way (checkpoint_fraction replaces checkpoint_every where the profile sets it)
    cadence = {"checkpoint_fraction": 0.5} if train_params.checkpoint_fraction is not None else \
        {"checkpoint_every": max(1, steps // 2)}
    train = dataclasses.replace(
        train_params, max_steps=steps, **cadence, batch_tokens=min(train_params.batch_tokens, max_length),
        warmup_steps=min(train_params.warmup_steps, max_warmup_steps(steps)),
        eval_sequences=min(train_params.eval_sequences, num_eval), resume=True,
        max_sequences=None if train_params.max_sequences is None else min(train_params.max_sequences, num_train))
    evals = dataclasses.replace(
        e, num_prompts=prompts, vllm_prompts=None if e.vllm_prompts is None else min(e.vllm_prompts, prompts),
        decoder_prompts=None if e.decoder_prompts is None else min(e.decoder_prompts, prompts),
        max_new_tokens=min(e.max_new_tokens, s.new_tokens), breadth_prompts=min(e.breadth_prompts, s.breadth_prompts))
    # the study stays on (at most two nested points inside the smoke chats: the profile's own where
    # they fit) or off
    points = min(2, len(sc.sizes))
    fitting = [n for n in sc.sizes if n <= num_train][:points]
    sizes = fitting if len(fitting) == points else sorted({max(1, num_train // 2), num_train})[-points:]
    scaling = dataclasses.replace(sc, sizes=sizes)
    smoke = dataclasses.replace(
        p, run_name=run_name or smoke_run_name(p.run_name),
        description=f"smoke run of {p.run_name}: {p.description}".strip(": "),
        data=data, extract=extract, train=train, eval=evals, scaling=scaling)
    return validate(smoke)


def flat_fields(p: Params) -> dict:
    """{"section.field" or "field": value} of every field of the profile."""
    out = {}
    for key, value in p.to_dict().items():
        if isinstance(value, dict) and dataclasses.is_dataclass(getattr(p, key)):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def changed_fields(full: Params, smoke: Params) -> dict:
    """{field: (full value, smoke value)} of the fields that differ."""
    a, b = flat_fields(full), flat_fields(smoke)
    return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def checkpoint_format(p: Params) -> str:
    """What train.py writes: DCP shards under torchrun (04 launches it for ddp / fsdp with nproc > 1),
    else one safetensors file (checkpoints.py)."""
    return "dcp" if p.train.distributed != "none" and p.train.nproc > 1 else "safetensors"


def branches(p: Params) -> dict:
    """The decisions the pipeline takes from the profile, by name (JSON-able values). A smoke run
    exercises the full run's code paths when its branches equal the full profile's."""
    d, x, train_params, e, tg = p.data, p.extract, p.train, p.eval, p.target
    regen = resolve_regen_backend(p) if d.regenerate else "off"
    partial = d.regen_num_train is not None and (d.num_train is None or d.regen_num_train < d.num_train)
    return {
        "target": [tg.path, tg.dtype, tg.trust_remote_code],
        "engine layout": {"tensor_parallel": tg.tensor_parallel_size, "data_parallel": tg.data_parallel_size,
                          "expert_parallel": tg.enable_expert_parallel, "enforce_eager": tg.enforce_eager,
                          "attention_backend": tg.attention_backend},
        "data sources": [path for path, _, _ in data_sources(d.source)],
        "regeneration": regen,
        "regeneration scope": "off" if regen == "off" else "partial" if partial else "all chats",
        "regenerated turns": "one" if d.regen_max_turns == 1 else "several",
        "regeneration sampling": "greedy" if d.regen_temperature == 0 else "sampled",
        "thinking": d.thinking,
        "extraction": {"backend": x.backend, "device": x.device, "processes": x.nproc, "cache dtype": x.dtype,
                       "mode": x.mode, "node split": x.online_gpus is not None},
        "fidelity check": x.fidelity,
        "cache verification": train_params.verify_cache,
        "training": {"distributed": train_params.distributed, "processes": train_params.nproc,
                     "dtype": train_params.dtype, "attention": train_params.attention,
                     "activation_checkpointing": train_params.activation_checkpointing,
                     "compile": train_params.compile, "data loader workers": train_params.num_workers > 0},
        "checkpoint format": checkpoint_format(p),
        "checkpoint cadence": {"by": "fraction" if train_params.checkpoint_fraction is not None else "steps",
                               "also by minutes": train_params.checkpoint_minutes is not None},
        "warmup": "fraction" if train_params.warmup_fraction is not None else "steps",
        "resume": train_params.resume,
        "objective": {"optimizer": train_params.optimizer, "loss": train_params.loss,
                      "label_positions": train_params.label_positions,
                      "fc_input_scaling": train_params.fc_input_scaling,
                      "feature_noise": train_params.feature_noise > 0,
                      "init_from_layer": train_params.init_from_layer is not None,
                      "freeze_lm_head": train_params.freeze_lm_head},
        "memory check": gpu_memory_budget(train_params) is not None,
        "time budget": train_params.time_budget_minutes is not None,
        "tracking": train_params.tracking,
        "reference decoder": e.reference_decoder,
        "vLLM eval": e.use_vllm,
        "eval sampling": "greedy" if e.temperature == 0 else "sampled",
        "vLLM baseline in 01": e.baseline_vllm and e.use_vllm,
        "suffix baseline": suffix_stage(e),
        "breadth": {"domains": list(e.domains), "sample_temperatures": list(e.sample_temperatures)},
        "scaling study": {"on": bool(p.scaling.sizes), "vllm": p.scaling.vllm and e.use_vllm},
    }
