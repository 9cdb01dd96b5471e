"""Params profiles: one schema, YAML files in params/, validated before any heavy work.

A profile is a YAML mapping with the sections below. `inherit: other.yaml` (a path relative to
the profile's own folder) loads that profile first and overrides it key by key, so `local.yaml`
and `b300.yaml` only state what differs. Unknown keys, wrong types and impossible values raise
`ParamsError` starting with the dotted key name (e.g. `train.lr`) and ending with the profile's
file. An empty profile is refused (it would silently run the defaults, i.e. the full dataset).
Numbers in exponent form without a dot (`1e-3`, strings in YAML 1.1) are read as floats; float
fields must be finite; an int field takes a float only when it is integral (`max_steps: 1e3`).

This module is plain data: it imports nothing heavy, so `eagle3 params` answers at once (a profile
with dtype "auto" imports torch once, to ask whether a CUDA device is there).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .domains import DOMAINS
from .gpus import GPU_KINDS
from .layout import RunLayout

EMBEDDED_TARGET = "embedded:smollm2"
# Shape of the embedded target (SmolLM2-135M-Instruct), known without loading it.
EMBEDDED_SHAPE = {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
                  "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}


class ParamsError(ValueError):
    """A profile is invalid; the message names the offending key."""


# A run name is one folder under outputs/: letters, digits, '.', '-', '_', not starting with a dot
# (so never '.', '..' or a hidden folder), no separators, at most 100 characters.
RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def check_run_name(name: Any, key: str = "run_name") -> str:
    """Return `name` if it is a valid run name (see RUN_NAME), else raise ParamsError naming `key`."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise ParamsError(f"{key}: {name!r} is not a valid run name: use one folder name of letters, "
                          "digits, '.', '-' or '_' (at most 100, not starting with '.'), e.g. 'ci' or "
                          "'local-2'; runs always live in <output_dir>/<run_name>/")
    return name


@dataclass
class TargetParams:
    path: str = EMBEDDED_TARGET          # "embedded:smollm2" or a local HF checkpoint folder
    dtype: str = "bfloat16"              # dtype for bulk work (extraction, regeneration); "auto": see auto_dtype
    # Shape used for validation and the capacity plan when the checkpoint is not on this machine
    # (keys: num_hidden_layers, hidden_size, vocab_size, optionally intermediate_size, ...).
    shape: Optional[dict] = None
    trust_remote_code: bool = False
    # vLLM engine settings (engine.py) for every stage that runs the target in vLLM.
    tensor_parallel_size: int = 1        # GPUs one engine shards the weights over
    data_parallel_size: int = 1          # engine replicas (vllm.LLM takes 1 only: engine.build_kwargs)
    enable_expert_parallel: bool = False  # MoE experts sharded over the TP ranks
    gpu_memory_utilization: float = 0.5  # share of each GPU the engine may take
    max_num_batched_tokens: Optional[int] = None  # tokens per engine step (None: vLLM's default)
    enforce_eager: bool = True           # no CUDA graphs (faster start; the CPU build needs it)
    # Sequences one engine step decodes at most (vLLM's max_num_seqs; None: vLLM's default). The plan
    # takes it as regeneration's batch and refuses one whose KV cache exceeds the engine's KV room.
    max_num_seqs: Optional[int] = None
    # vLLM's attention backend by name (its engine argument attention_backend, one of
    # VLLM_ATTENTION_BACKENDS; e.g. TRITON_MLA for an MLA target on sm_120 GPUs). None: vLLM's choice
    # (on a CPU, engine.cpu_attention_backend's).
    attention_backend: Optional[str] = None


@dataclass
class DataParams:
    # One source or a list of them (data_sources): "sharegpt" (the embedded ShareGPT V3), a local
    # .json/.jsonl file (ShareGPT or OpenAI form) or a folder written by `datasets.save_to_disk`;
    # a list item may be {path: ..., max_records: n} (at most n raw records of that source).
    source: Any = "sharegpt"
    max_records: Optional[int] = None    # read at most this many raw records (None: all)
    num_train: Optional[int] = None      # training conversations after the split (None: all left)
    num_eval: int = 100                  # held-out conversations, never trained on
    max_length: int = 2048               # tokens per training sequence (truncated)
    draft_vocab_size: int = 32000
    regenerate: bool = False             # replace assistant turns by the target's own answers
    regen_backend: str = "auto"          # auto | vllm | hf
    regen_max_new_tokens: int = 512
    regen_temperature: float = 0.0
    regen_max_turns: int = 1             # assistant turns regenerated per chat; later turns dropped
    regen_batch_size: int = 32           # hf: chats per generate batch; vllm: finished chats per chunk
                                         # file (every request is in the engine at once)
    regen_num_train: Optional[int] = None  # regenerate only the first N training chats (None: all);
                                         # the rest keep the dataset's answers: off-policy text, but
                                         # its soft labels are still the target's (extraction-only cost)
    # Reasoning targets (chat_template.py): auto (the chat template's default) | on (thinking: the
    # target reasons, then answers) | off (instant mode). Used by regeneration, the data stage's
    # template and the eval prompts alike; on/off pass the template variables thinking and
    # enable_thinking. Thinking needs regen_max_new_tokens and max_length >= THINKING_MIN_NEW_TOKENS.
    thinking: str = "auto"


@dataclass
class ExtractParams:
    aux_layers: Optional[list] = None    # None: (2, N//2, N-3) as in vLLM
    dtype: str = "bfloat16"              # cache dtype
    batch_tokens: int = 8192             # token budget of one forward batch (padded)
    shard_tokens: int = 262144           # tokens per safetensors shard
    backend: str = "hf"                  # hf (default) | vllm (optional, big box)
    device: str = "auto"                 # auto | cpu | cuda
    nproc: int = 1                       # processes under torchrun (data parallel)
    vllm_max_num_batched_tokens: Optional[int] = None  # backend vllm: tokens per engine step
                                         # (None: target.max_num_batched_tokens)
    # 03's check that the cached final states give the target's own next tokens (extract.fidelity_plan):
    # hf (a fresh transformers forward: loads the whole target) | vllm (the vLLM engine's prompt
    # logprobs, asked for in the extraction's engine start; no transformers load) | never |
    # auto (hf when the checkpoint fits this machine's memory, else vllm with backend vllm, else
    # skipped). A skip is recorded with its reason in metrics.json.
    fidelity: str = "auto"
    # vLLM model runner of the extraction engine (backend vllm; engine.engine_env sets vLLM's
    # VLLM_USE_V2_MODEL_RUNNER): v1 (the runner whose extract_hidden_states code the CPU runner
    # shares, so what the CPU tests ran) | v2 (vLLM 0.32's default on CUDA with Triton; has its own
    # extract_hidden_states speculator and connector hooks, never run here) | auto (vLLM decides).
    model_runner: str = "v1"
    # Where training takes the train split's states from: offline (03 writes the cache, 04 reads it)
    # | online (03 caches the eval split only; 04 starts vLLM's OpenAI server with
    # extract_hidden_states and asks it for each sequence's states: online.py). Not part of the
    # cache's identity (cache.cache_params_hash): both modes read the same states.
    mode: str = "offline"
    # online: how often a server that dies during training is started again (the batch is sent again;
    # then the run stops naming the server log; a checkpoint resumes it).
    online_restarts: int = 2
    # online on GPUs: the GPUs the server gets (indices as torch sees them; its tensor parallelism must
    # fit them); the training ranks take the others. None: both share every visible GPU (the server
    # takes target.gpu_memory_utilization of each). `eagle3 plan` shows both layouts' memory, hours, disk.
    online_gpus: Optional[list] = None


@dataclass
class TrainParams:
    ttt_steps: int = 4
    decay: float = 0.8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    # Warmup as a share of the run's planned optimizer steps (train.schedule: max_steps, else epochs
    # of the cache); when set it replaces warmup_steps, so the warmup follows the run's size (each
    # 06_scaling point too). Warmup may be at most MAX_WARMUP_FRACTION of the planned steps.
    warmup_fraction: Optional[float] = None
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    epochs: float = 1.0
    max_steps: Optional[int] = None      # stop after this many optimizer steps (None: epochs)
    # Train on this many cached training sequences only: the first N of a seeded permutation of the
    # usable ones, so a smaller N is a subset of a larger one (the data-scaling study, 06_scaling,
    # trains nested subsets of one cache). None: all of them.
    max_sequences: Optional[int] = None
    time_budget_minutes: Optional[float] = None  # stop cleanly when the budget is spent
    batch_tokens: int = 4096             # tokens per micro-batch (length-bucketed)
    grad_accum: int = 1
    dtype: str = "float32"               # float32 | bfloat16 (autocast) | auto (see auto_dtype)
    optimizer: str = "adamw"             # adamw | muon
    checkpoint_every: int = 200
    # Checkpoint (and held-out eval) cadence that follows the run: every checkpoint_fraction of the
    # planned steps (replaces checkpoint_every when set; 0.1: ten per run), and also whenever
    # checkpoint_minutes of training passed since the last one (bounds what a crash loses). None: off.
    checkpoint_fraction: Optional[float] = None
    checkpoint_minutes: Optional[float] = None
    resume: bool = True
    eval_sequences: int = 32             # held-out cached sequences for per-step accuracy
    # Design choices the public trainers differ on (see NOTES.md).
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    # Train fc on aux / s (s: robust per-dimension scale of the cached aux states) and fold 1/s
    # into fc.weight when the final drafter is written: the exported drafter computes fc(aux),
    # the layout is unchanged. Targets with massive activations (SmolLM2: |x| up to 25k in a few
    # dims of the mid/high layers, ~3 elsewhere) otherwise train fc badly (NOTES.md).
    fc_input_scaling: bool = True
    # Start the decoder layer (hidden half of q/k/v, o, mlp, norms) and the final norm from this
    # target layer (-1: the last one) and fc as a pass-through of the highest aux state; None:
    # random init. See train.init_from_target_layer.
    init_from_layer: Optional[int] = None
    # Warm start: begin from a trained EAGLE-3 drafter folder (a public Llama-layout or speculators
    # drafter, or an earlier run's train/final or export) instead of noise; see
    # train.init_from_drafter. A relative path is read from the profile's folder.
    init_from_drafter: Optional[str] = None
    next_step_hidden: str = "pre_norm"   # pre_norm | post_norm: what step j+1 gets as g
    # Decoder layers of the drafter: 1 (EAGLE-3's recipe) or more (vLLM's llama_eagle3 loads
    # num_hidden_layers > 1: layer 0 reads [embedding; hidden], later layers are plain Llama layers).
    draft_layers: int = 1
    init_lm_head: bool = True            # initialise lm_head rows from the target's head
    freeze_lm_head: bool = False
    loss_average: str = "masked"         # masked | all
    # Which training positions get a soft label: "assistant" (the loss mask, the EAGLE-3 recipe) or
    # "all" (every token, user turns and template included: the target's distribution is a valid
    # label after any prefix, so user turns are extra distillation data at no extraction cost).
    # Held-out evaluation always scores assistant positions.
    label_positions: str = "assistant"
    # What each counted (t, j) pair minimises (objective.ttt_loss): "kl" (soft cross-entropy against
    # the target's draft-vocab distribution p, the EAGLE-3 recipe) | "lk" (-log alpha, alpha =
    # sum_v min(p_v, q_v): the acceptance rate of speculative sampling, q the drafter's softmax) |
    # "lk_hybrid" (lam * KL(p||q) + (1 - lam) * (1 - alpha), lam = exp(-lk_eta * alpha), alpha not
    # differentiated in lam). LK losses: Samarin et al., arXiv 2602.23881; see LinearAcceptanceLoss.
    loss: str = "kl"
    lk_eta: float = 3.0                  # lk_hybrid's eta (vllm-project/speculators' default); >= 0
    # Gaussian noise added to the fc input (aux / s, s: see fc_input_scaling) during training only,
    # std in units of s: a regulariser against memorising the training sequences (EAGLE-1 added
    # noise to its features for the same reason). 0: off. Evaluation never adds noise.
    feature_noise: float = 0.0
    compile: bool = False
    # TTT attention formulation (model.ttt_attention; all compute the same function): auto ("manual"
    # on CPU, the fastest measured there; "flex" on GPUs, no T x T scores) | manual | merge | mask |
    # chunked | flex. activation_checkpointing: recompute each TTT step's layer in backward (saves
    # the step's activations for the price of a second forward of the layer).
    attention: str = "auto"
    activation_checkpointing: bool = False
    tracking: str = "none"               # none | tensorboard | wandb (offline); tracking.py
    # 04's sanity check against always proposing the most frequent answer token: on the held-out
    # positions (heldout) or, for a random-weight miniature whose answers follow no pattern across
    # prompts, on the training answers with the last step's training accuracy (train).
    unigram_check: str = "heldout"
    distributed: str = "none"            # none | ddp | fsdp
    nproc: int = 1
    # How long a torchrun rank waits in a collective (a barrier, a reduction) for the others before
    # the job is stopped; training's and extraction's process groups (torch's default: 10 min NCCL).
    pg_timeout_minutes: float = 60.0
    # Verification of the hidden-state caches before training (cache.verify_cache, once per cache:
    # hidden/<split>/verified.json): sizes, manifest and tensor shapes always, then the sha256 of
    # every shard (full), of a seeded verify_sample share of them (sampled) or of none (sizes);
    # under torchrun the ranks split the hashing.
    verify_cache: str = "full"
    verify_sample: float = 0.05
    # DataLoader worker processes that read and pad the micro-batches ahead of the step (0: in the
    # training process). On the 2-core CPU box workers compete with the step for the cores.
    num_workers: int = 0
    # Memory of one training GPU in GB (1e9 bytes); None: no check. When set, a profile whose
    # step would not fit with 20% headroom (memory.check_fits, the memory model) is refused.
    gpu_memory_gb: Optional[float] = None
    # The GPU kind of the box (a name of gpus.GPU_KINDS, e.g. B300, RTX-PRO-6000): the plan's FLOP/s,
    # memory bandwidth, interconnect and memory per GPU (the budget when gpu_memory_gb is not set).
    # None: the plan guesses it from gpu_memory_gb (stage_times.gpu_kind).
    gpu_kind: Optional[str] = None
    # Divergence guard (train.DivergenceGuard): stop with an error after diverge_steps consecutive
    # steps whose soft CE is log(draft vocab) within diverge_uniform_rtol on every TTT step (uniform
    # output), or whose loss is above diverge_loss_rise x its running minimum, or whose gradient norm
    # is <= diverge_grad_norm. 0 steps: off. A learning run meets none of them (it passes the uniform
    # level at most on single steps; ci and the tests' runs: NOTES.md).
    diverge_steps: int = 5
    diverge_uniform_rtol: float = 1e-3
    diverge_loss_rise: float = 4.0
    diverge_grad_norm: float = 1e-8


@dataclass
class EvalParams:
    num_prompts: int = 20
    prompts_path: Optional[str] = None   # JSONL of prompts ({"prompt": ..., "category": ...})
    max_new_tokens: int = 128
    k: int = 4
    temperature: float = 0.0
    ngram_k: list = field(default_factory=lambda: [2, 4])
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_baseline: bool = True         # vLLM's suffix decoding (arctic-inference) at k = eval.k: see suffix_stage
    use_vllm: bool = True
    # 01 measures plain, n-gram and suffix decoding in vLLM too; false: 01 runs eagle3lib's n-gram
    # sweep only, and vLLM's n-gram figure is 05's, measured beside EAGLE-3 in the same run.
    baseline_vllm: bool = True
    vllm_dtype: str = "float32"
    vllm_prompts: Optional[int] = None   # None: same as num_prompts
    # Tokens per vLLM engine step in the benchmarks: small, so the CPU engine starts in ~2 s
    # instead of ~30 s (NOTES.md); None: target.max_num_batched_tokens.
    vllm_max_num_batched_tokens: Optional[int] = 512
    # eagle3lib's reference decoder runs the first n held-out prompts (None: all of them). It is
    # single-threaded and exact; on a 2-core CPU it costs minutes per method, vLLM seconds.
    decoder_prompts: Optional[int] = None
    # Whether eagle3lib's reference decoder runs at all (it loads the whole target in transformers
    # on one device): auto (skip when the safetensors weights exceed that device's memory) |
    # always | never. A skip is printed by 05_eval and recorded in metrics.json.
    reference_decoder: str = "auto"
    dtype: str = "float32"               # eagle3lib reference decoder dtype
    # Skip held-out prompts longer than this many tokens (chat template applied; counted and
    # reported). None: keep all. Long prompts make CPU evaluation slow (prefill) without
    # telling anything more about drafting.
    max_prompt_tokens: Optional[int] = None
    # Breadth (05_eval, vLLM only): besides the main run (held-out chats at eval.temperature), the
    # same vLLM engine of each mode decodes one request group per (domain, temperature) of
    # ["sharegpt"] + eval.domains x [eval.temperature] + eval.sample_temperatures, each the first
    # eval.breadth_prompts prompts of its domain, eval.max_new_tokens each. Empty lists: no breadth.
    sample_temperatures: list = field(default_factory=list)   # sampling temperatures > 0, e.g. [0.7, 1.0]
    domains: list = field(default_factory=list)               # prompt sets besides ShareGPT (domains.DOMAINS)
    breadth_prompts: int = 10
    # Public EAGLE-3 drafters measured in vLLM beside the trained one (05_eval, one engine each, mode
    # "drafter-<name>_k<eval.k>"): [{name: kimi-aq, path: /models/Kimi-K2-Instruct-eagle3}, ...]. A relative
    # path is read from the profile's folder (like target.path); each folder is read and checked against
    # the target (drafters.py) before any engine starts.
    drafters: list = field(default_factory=list)


@dataclass
class ScalingParams:
    # The data-scaling study (06_scaling, an optional stage that only `eagle3 run --only scaling`
    # runs): one drafter per size N trained on N of this run's cached training
    # chats (nested subsets, train.max_sequences) for `epochs` epochs with the profile's other train
    # settings (train.max_steps and the time budget off: matched epochs), all scored on the same
    # held-out cache (replayed acceptance) and, with vllm on, in one vLLM run (acceptance length, tokens/s).
    sizes: list = field(default_factory=list)   # training chats per point, ascending; empty: no study
    epochs: float = 2.0
    vllm: bool = True
    targets: list = field(default_factory=lambda: [2.5, 3.0])   # acceptance lengths to state the chats needed for


@dataclass
class Params:
    run_name: str = "default"
    seed: int = 0
    output_dir: str = "outputs"
    description: str = ""
    target: TargetParams = field(default_factory=TargetParams)
    data: DataParams = field(default_factory=DataParams)
    extract: ExtractParams = field(default_factory=ExtractParams)
    train: TrainParams = field(default_factory=TrainParams)
    eval: EvalParams = field(default_factory=EvalParams)
    scaling: ScalingParams = field(default_factory=ScalingParams)

    # ---- derived values -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def section_hash(self, *sections: str, leave_out: tuple = ()) -> str:
        """A short hash of the named sections (plus seed and target path): cache identity.
        leave_out: "section.key" entries that do not count."""
        d = self.to_dict()
        payload = {s: {k: v for k, v in d[s].items() if f"{s}.{k}" not in leave_out} for s in sections}
        payload["seed"] = self.seed
        payload["target_path"] = self.target.path
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def target_shape(self) -> Optional[dict]:
        """Target shape without loading weights: embedded constants, config.json, or target.shape."""
        if self.target.path == EMBEDDED_TARGET:
            return dict(EMBEDDED_SHAPE)
        cfg = Path(self.target.path) / "config.json"
        if cfg.is_file():
            try:
                c = json.loads(cfg.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError
                raise ParamsError(f"target.path: {cfg} is not valid JSON ({e}); fix the file or "
                                  "point target.path at another checkpoint") from None
            if not isinstance(c, dict):
                raise ParamsError(f"target.path: {cfg} must hold a JSON object, got {type(c).__name__}")
            c = c.get("text_config", c)  # multimodal wrappers keep the LM config inside
            keys = ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size",
                    "num_attention_heads", "num_key_value_heads")
            return {k: c[k] for k in keys if k in c}
        return dict(self.target.shape) if self.target.shape else None

    def aux_layer_ids(self) -> list:
        """The three auxiliary layer ids; default (2, N//2, N-3)."""
        if self.extract.aux_layers is not None:
            return list(self.extract.aux_layers)
        shape = self.target_shape()
        if shape is None:
            raise ParamsError("extract.aux_layers: not set and the target shape is unknown")
        n = shape["num_hidden_layers"]
        return [2, n // 2, n - 3]

    def run_dir(self, run_name: Optional[str] = None) -> Path:
        """outputs/<run>/ (a relative output_dir is taken from the repository root). The name is
        checked (check_run_name), so the folder is always directly inside outputs_root()."""
        return self.outputs_root() / check_run_name(run_name or self.run_name)

    def layout(self, run_name: Optional[str] = None) -> "RunLayout":
        """The paths of run `run_name` (default: this profile's run_name), see layout.py."""
        return RunLayout(self.run_dir(run_name))

    def outputs_root(self) -> Path:
        out = Path(self.output_dir)
        return out if out.is_absolute() else repo_root() / out


SECTIONS = {"target": TargetParams, "data": DataParams, "extract": ExtractParams,
            "train": TrainParams, "eval": EvalParams, "scaling": ScalingParams}

CHOICES = {
    "target.dtype": {"bfloat16", "float16", "float32", "auto"},
    "extract.dtype": {"bfloat16", "float16", "float32"},
    "extract.backend": {"hf", "vllm"},
    "extract.device": {"auto", "cpu", "cuda"},
    "extract.fidelity": {"auto", "hf", "vllm", "never"},
    "extract.model_runner": {"auto", "v1", "v2"},
    "extract.mode": {"offline", "online"},
    "data.regen_backend": {"auto", "vllm", "hf"},
    "data.thinking": {"auto", "on", "off"},                                  # chat_template.THINKING_CHOICES
    "train.dtype": {"float32", "bfloat16", "auto"},
    "train.optimizer": {"adamw", "muon"},
    "train.next_step_hidden": {"pre_norm", "post_norm"},
    "train.loss_average": {"masked", "all"},
    "train.label_positions": {"assistant", "all"},
    "train.loss": {"kl", "lk", "lk_hybrid"},                                  # objective.LOSS_CHOICES
    "train.tracking": {"none", "tensorboard", "wandb"},
    "train.unigram_check": {"heldout", "train"},
    "train.distributed": {"none", "ddp", "fsdp"},
    "train.verify_cache": {"full", "sampled", "sizes"},                       # cache.VERIFY_MODES
    "train.attention": {"auto", "manual", "merge", "mask", "chunked", "flex"},   # model.ATTENTION_CHOICES
    "eval.vllm_dtype": {"bfloat16", "float16", "float32"},
    "eval.reference_decoder": {"auto", "always", "never"},
    "eval.dtype": {"bfloat16", "float32"},
}


# ---- loading -------------------------------------------------------------------------------
class _ProfileLoader(yaml.SafeLoader):
    """yaml.SafeLoader that also reads exponent numbers without a dot (`1e-3`, `5E4`) as floats
    (YAML 1.1 reads them as strings, YAML 1.2 and Python as numbers), refuses a key given twice in
    one mapping, and refuses aliases (`*name`: a few nested ones expand to gigabytes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            raise ParamsError(f"line {line}: YAML aliases (*name) are not allowed in a profile (a few "
                              "nested ones expand without bound); write the value out, or share settings "
                              "with `inherit: other.yaml`")
        return super().compose_node(parent, index)


_ProfileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _construct_mapping(loader: _ProfileLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping whose keys are all distinct: YAML would keep the last of two `data:` blocks (or two
    `lr:` lines) and silently drop the first."""
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise ParamsError(f"{key}: given twice in one mapping (lines {seen[key]} and {line}); keep one")
        seen.setdefault(key, line)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_ProfileLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    if not path.is_file():
        raise ParamsError(f"params file not found: {path}")
    if path.resolve() in seen:
        raise ParamsError(f"inherit: cycle through {path}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_ProfileLoader)
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path}: not UTF-8 text (byte {e.start}); save the profile as UTF-8") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if raw is None or raw == {}:
        raise ParamsError(f"{path}: the profile is empty (it would run the defaults: the full dataset); "
                          "start from a shipped profile with a line `inherit: ci.yaml` (a path relative "
                          "to this file; or local.yaml, b300.yaml) and state only what differs")
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: a profile must be a mapping of keys, got {type(raw).__name__}")
    _anchor_target_path(raw, path.parent)
    _anchor_drafter_paths(raw, path.parent)
    parent = raw.pop("inherit", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ParamsError(f"inherit: expected a file name, got {parent!r}")
    base = _read_yaml(path.parent / parent, seen + (path.resolve(),))
    return _merge(base, raw)


def _anchor_target_path(raw: dict, folder: Path) -> None:
    """A relative target.path is taken from the profile's own folder (like `inherit`) and stored
    absolute: the CLI and the notebooks (whose kernels run in notebooks/) then read the same folder."""
    target = raw.get("target")
    path = target.get("path") if isinstance(target, dict) else None
    if isinstance(path, str) and path.strip() and not path.startswith("embedded:") and not Path(path).is_absolute():
        target["path"] = str((folder / path).resolve())


def _anchor_drafter_paths(raw: dict, folder: Path) -> None:
    """Relative drafter folders (eval.drafters[i].path, train.init_from_drafter) are taken from the
    profile's own folder, like target.path."""
    e, t = raw.get("eval"), raw.get("train")
    items = e.get("drafters") if isinstance(e, dict) else None
    for item in items if isinstance(items, list) else []:
        path = item.get("path") if isinstance(item, dict) else None
        if isinstance(path, str) and path.strip() and not Path(path).is_absolute():
            item["path"] = str((folder / path).resolve())
    path = t.get("init_from_drafter") if isinstance(t, dict) else None
    if isinstance(path, str) and path.strip() and not Path(path).is_absolute():
        t["init_from_drafter"] = str((folder / path).resolve())


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k in SECTIONS:
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Check one value against its dataclass annotation; ints are accepted where floats are."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _check_type(key, value, inner)
    expected = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    name = name.replace("Optional[", "").rstrip("]")
    typ = expected.get(name)
    if typ is None:
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, float) and not math.isfinite(value):
        raise ParamsError(f"{key}: must be a finite number, got {value!r}")
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)                           # `max_steps: 1e3`
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise ParamsError(f"{key}: expected {name}, got {type(value).__name__} ({value!r}){_hint(value, typ)}")
    return value


def _hint(value: Any, typ: type) -> str:
    """How to write `value` so that it has type `typ`, where that is a quoting mistake."""
    if typ in (int, float) and isinstance(value, str):
        try:
            float(value)
            return "; write the number without quotes"
        except ValueError:
            return ""
    if typ is str and isinstance(value, (int, float, bool)):
        return "; put the value in quotes to make it text"
    return ""


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ParamsError(f"{prefix.rstrip('.')}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = prefix + str(key)
        if not isinstance(key, str):
            raise ParamsError(f"{dotted}: keys must be names, got the {type(key).__name__} {key!r} "
                              f"(known: {', '.join(sorted(fields))})")
        if key not in fields:
            raise ParamsError(f"{dotted}: unknown key (known: {', '.join(sorted(fields))})")
        if key in SECTIONS and cls is Params:
            kwargs[key] = _build(SECTIONS[key], value, dotted + ".")
        else:
            kwargs[key] = _check_type(dotted, value, hints[key])
    return cls(**kwargs)


# Thinking-mode answers (reasoning + answer) of Kimi-K2.5-class targets on chat prompts are assumed
# to have a median of a few thousand tokens (an assumption, NOTES.md "Token-exact training data"):
# below this many new tokens (or training tokens) most of them would be cut before the answer.
THINKING_MIN_NEW_TOKENS = 4096


def regen_cap_problem(d: DataParams, thinking: bool) -> Optional[str]:
    """Why regenerating in thinking mode with these data params would cut most answers (None: it
    would not, or no thinking / no regeneration). params.validate refuses data.thinking: on with it;
    data.prepare_data refuses it where "auto" resolves to thinking; plan.py may show it."""
    if not (d.regenerate and thinking):
        return None
    kept = min(d.regen_max_new_tokens, d.max_length)
    if kept >= THINKING_MIN_NEW_TOKENS:
        return None
    return (f"thinking mode: answers are reasoning then answer, assumed thousands of tokens; "
            f"regen_max_new_tokens={d.regen_max_new_tokens} with max_length={d.max_length} keeps at most "
            f"{kept} generated tokens per answer, so most would be cut before the answer "
            f"(< {THINKING_MIN_NEW_TOKENS}). Raise data.regen_max_new_tokens and data.max_length to "
            f">= {THINKING_MIN_NEW_TOKENS} (the cache grows with them), or set data.thinking: off (instant mode)")


# vLLM 0.32's attention backends by name (vllm.v1.attention.backends.registry.AttentionBackendEnum; a
# test compares the two where vLLM is installed), for target.attention_backend.
VLLM_ATTENTION_BACKENDS = (
    "AMX_MLA", "B12X", "CPU_ATTN", "CPU_MLA", "CUSTOM", "CUTLASS_MLA", "CUTLASS_MSA", "FLASHINFER", "FLASHINFER_MLA",
    "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV41",
    "FLASHINFER_MLA_SPARSE_SM120", "FLASHINFER_MLA_SPARSE_SM90", "FLASHMLA", "FLASHMLA_MEGA_ATTN_DSV41",
    "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE_DSV41", "FLASH_ATTN", "FLASH_ATTN_DIFFKV",
    "FLASH_ATTN_MLA", "FLASH_ATTN_MLA_SPARSE", "FLEX_ATTENTION", "HPC_ATTN", "MINIMAX_M3_SPARSE", "NO_ATTENTION",
    "ROCM_AITER_FA", "ROCM_AITER_MLA", "ROCM_AITER_MLA_SPARSE", "ROCM_AITER_TRITON_MLA", "ROCM_AITER_UNIFIED_ATTN",
    "ROCM_ATTN", "ROCM_FLASHMLA_SPARSE_DSV4", "ROCM_SEGMENTED_ATTN", "TOKENSPEED_MLA", "TORCH_SDPA", "TRITON_ATTN",
    "TRITON_ATTN_DIFFKV", "TRITON_FLASHINFER", "TRITON_FLASH_ATTN", "TRITON_MLA", "TRITON_MSA", "TURBOQUANT",
    "ULTRAQUANT", "XPU_MLA_SPARSE")


def _check_gpu_kind(train_params: TrainParams) -> None:
    """train.gpu_kind names a kind of gpus.GPU_KINDS, and train.gpu_memory_gb is at most its memory."""
    kind, budget = train_params.gpu_kind, train_params.gpu_memory_gb
    if kind is None:
        return
    if kind not in GPU_KINDS:
        raise ParamsError(f"train.gpu_kind: {kind!r} is not a GPU kind the plan knows ({', '.join(GPU_KINDS)}); "
                          "add its figures to eagle3lib/gpus.py or set null (guessed from train.gpu_memory_gb)")
    memory = GPU_KINDS[kind][2]
    if budget is not None and budget > memory:
        raise ParamsError(f"train.gpu_memory_gb: {budget:g} GB is more than one {kind} has ({memory:g} GB); "
                          f"lower it or set train.gpu_kind to the box's GPU")


def gpu_memory_budget(train_params: TrainParams) -> Optional[float]:
    """GB of one training GPU the memory model must fit: train.gpu_memory_gb, else the memory of
    train.gpu_kind, else None (no check)."""
    if train_params.gpu_memory_gb is not None:
        return train_params.gpu_memory_gb
    return None if train_params.gpu_kind is None else float(GPU_KINDS[train_params.gpu_kind][2])


def _check_breadth(e: EvalParams) -> None:
    """eval.sample_temperatures, eval.domains, eval.breadth_prompts (05_eval's breadth groups)."""
    temps = e.sample_temperatures
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 < t <= 2
               for t in temps):
        raise ParamsError(f"eval.sample_temperatures: must be a list of numbers in (0, 2], got {temps!r} "
                          "(T=0 is the main run at eval.temperature; [] for none)")
    if len(set(temps)) != len(temps) or e.temperature in temps:
        raise ParamsError(f"eval.sample_temperatures: {temps!r} repeats a temperature (or eval.temperature="
                          f"{e.temperature}, which the main run already decodes): list each once")
    unknown = [d for d in e.domains if d not in DOMAINS]
    if unknown or len(set(e.domains)) != len(e.domains):
        raise ParamsError(f"eval.domains: {e.domains!r} must list distinct domains among {', '.join(DOMAINS)} "
                          "(the held-out ShareGPT chats always run; [] for no other domain)")
    if e.breadth_prompts < 1:
        raise ParamsError(f"eval.breadth_prompts: must be >= 1, got {e.breadth_prompts}")


# A public drafter's name becomes part of a vLLM mode name ("drafter-<name>_k4"), a metrics key and a label.
DRAFTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DRAFTER_KEYS = ("name", "path")


def _check_drafters(e: EvalParams) -> None:
    """eval.drafters: a list of {name, path} with distinct names usable in method names. Whether each
    folder exists is checked where 05 runs (evaluate.check_eval_drafters), naming the same key."""
    example = "e.g. [{name: kimi-aq, path: /models/Kimi-K2-Instruct-eagle3}]"
    if e.drafters and not e.use_vllm:
        raise ParamsError("eval.drafters: public drafters are measured in vLLM only; set eval.use_vllm: true "
                          "or leave eval.drafters empty")
    names = []
    for i, item in enumerate(e.drafters):
        where = f"eval.drafters[{i}]"
        if not isinstance(item, dict):
            raise ParamsError(f"{where}: expected a mapping {{name, path}}, got {type(item).__name__} ({item!r}) "
                              f"({example})")
        if set(map(str, item)) != set(DRAFTER_KEYS):
            raise ParamsError(f"{where}: needs exactly the keys {', '.join(DRAFTER_KEYS)}, got {sorted(map(str, item))}"
                              f" ({example})")
        name, path = item["name"], item["path"]
        if not isinstance(name, str) or not DRAFTER_NAME.fullmatch(name):
            raise ParamsError(f"{where}.name: {name!r} must be 1-64 letters, digits, '.', '-' or '_' (not starting "
                              "with '.', '-' or '_'): it names the vLLM mode drafter-<name>_k<k>")
        if not isinstance(path, str) or not path.strip():
            raise ParamsError(f"{where}.path: expected the drafter's local folder, got {path!r}")
        names.append(name)
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ParamsError(f"eval.drafters: the name {dup!r} is given twice; each drafter needs its own name")


def validate(p: Params) -> Params:
    """Value checks that need more than one field; raises ParamsError naming the key."""
    def need(cond: bool, key: str, msg: str):
        if not cond:
            raise ParamsError(f"{key}: {msg}")

    for key, allowed in CHOICES.items():
        sec, name = key.split(".")
        value = getattr(getattr(p, sec), name)
        need(value in allowed, key, f"must be one of {sorted(allowed)}, got {value!r}")
    check_run_name(p.run_name, "run_name")
    _check_output_dir(p)
    _check_finite(p)
    d, x, train_params, e = p.data, p.extract, p.train, p.eval
    need(d.num_eval >= 1, "data.num_eval", "must be >= 1")
    need(d.max_records is None or d.max_records > d.num_eval, "data.max_records", "must exceed data.num_eval")
    need(d.num_train is None or d.num_train >= 1, "data.num_train", "must be >= 1")
    need(d.max_length >= 16, "data.max_length", "must be >= 16")
    need(d.draft_vocab_size >= 2, "data.draft_vocab_size", "must be >= 2")
    need(d.regen_max_new_tokens >= 1, "data.regen_max_new_tokens", "must be >= 1")
    need(d.regen_temperature >= 0, "data.regen_temperature", "must be >= 0")
    need(d.regen_max_turns >= 1, "data.regen_max_turns", "must be >= 1")
    need(d.regen_batch_size >= 1, "data.regen_batch_size", "must be >= 1")
    need(d.regen_num_train is None or d.regen_num_train >= 1, "data.regen_num_train", "must be >= 1")
    need(d.regen_num_train is None or d.regenerate, "data.regen_num_train", "needs data.regenerate: true")
    need(d.regen_num_train is None or d.num_train is None or d.regen_num_train <= d.num_train,
         "data.regen_num_train", "must be <= data.num_train")
    cut = regen_cap_problem(d, thinking=d.thinking == "on")   # "auto": the data stage checks the template
    need(cut is None, "data.regen_max_new_tokens", cut or "")
    data_sources(d.source)   # structure only: whether the files exist is chats.check_sources' job
    need(x.batch_tokens >= d.max_length, "extract.batch_tokens", "must be >= data.max_length")
    need(x.shard_tokens >= 1, "extract.shard_tokens", "must be >= 1")
    need(x.nproc >= 1, "extract.nproc", "must be >= 1")
    tg = p.target
    need(tg.tensor_parallel_size >= 1, "target.tensor_parallel_size", "must be >= 1")
    need(tg.data_parallel_size >= 1, "target.data_parallel_size", "must be >= 1")
    need(0 < tg.gpu_memory_utilization <= 1, "target.gpu_memory_utilization", "must be in (0, 1]")
    need(tg.max_num_batched_tokens is None or tg.max_num_batched_tokens >= 16, "target.max_num_batched_tokens",
         "must be >= 16 (or null: vLLM's default)")
    need(x.vllm_max_num_batched_tokens is None or x.vllm_max_num_batched_tokens >= 16,
         "extract.vllm_max_num_batched_tokens", "must be >= 16 (or null: target.max_num_batched_tokens)")
    need(e.vllm_max_num_batched_tokens is None or e.vllm_max_num_batched_tokens >= 16,
         "eval.vllm_max_num_batched_tokens", "must be >= 16 (or null: target.max_num_batched_tokens)")
    need(1 <= train_params.ttt_steps <= 16, "train.ttt_steps", "must be in 1..16")
    need(isinstance(train_params.draft_layers, int) and 1 <= train_params.draft_layers <= 8, "train.draft_layers",
         "must be an integer in 1..8 (decoder layers of the drafter)")
    need(0 < train_params.decay <= 1, "train.decay", "must be in (0, 1]")
    need(train_params.lr > 0, "train.lr", "must be > 0")
    need(0 <= train_params.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
    need(train_params.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    need(train_params.warmup_fraction is None or 0 <= train_params.warmup_fraction <= MAX_WARMUP_FRACTION,
         "train.warmup_fraction",
         f"must be in [0, {MAX_WARMUP_FRACTION}] (a share of the planned steps), got {train_params.warmup_fraction}")
    if train_params.max_steps is not None and train_params.warmup_fraction is None:
        need(train_params.warmup_steps <= max_warmup_steps(train_params.max_steps), "train.warmup_steps",
             warmup_problem(train_params.warmup_steps, train_params.max_steps, "train.max_steps"))
    need(train_params.checkpoint_fraction is None or 0 < train_params.checkpoint_fraction <= 1,
         "train.checkpoint_fraction", "must be in (0, 1] (a share of the planned steps; null: train.checkpoint_every)")
    need(train_params.checkpoint_minutes is None or train_params.checkpoint_minutes > 0, "train.checkpoint_minutes",
         "must be > 0 (or null: off)")
    need(train_params.grad_clip > 0, "train.grad_clip", "must be > 0")
    need(train_params.tracking != "wandb" or importlib.util.find_spec("wandb") is not None, "train.tracking",
         "wandb is not installed in this environment: pip install wandb (it logs offline to "
         "outputs/<run>/train/wandb/), or set train.tracking: tensorboard or none")
    need(train_params.epochs > 0, "train.epochs", "must be > 0")
    need(train_params.max_steps is None or train_params.max_steps >= 1, "train.max_steps", "must be >= 1")
    need(train_params.time_budget_minutes is None or train_params.time_budget_minutes > 0, "train.time_budget_minutes",
         "must be > 0")
    need(train_params.batch_tokens >= d.max_length, "train.batch_tokens", "must be >= data.max_length")
    need(train_params.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    need(train_params.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1")
    need(train_params.nproc >= 1, "train.nproc", "must be >= 1")
    need(p.extract.online_restarts >= 0, "extract.online_restarts", "must be >= 0 (0: stop at the first server death)")
    gpus = p.extract.online_gpus
    need(gpus is None or (isinstance(gpus, list) and gpus and all(isinstance(g, int) and g >= 0 for g in gpus)
                          and len(set(gpus)) == len(gpus)), "extract.online_gpus",
         "must be null (server and trainer share every GPU) or a list of distinct GPU indices, e.g. [4, 5, 6, 7]")
    need(gpus is None or p.extract.mode == "online", "extract.online_gpus", "is for extract.mode: online only")
    need(gpus is None or p.target.tensor_parallel_size <= len(gpus), "extract.online_gpus",
         f"gives the server {len(gpus or [])} GPU(s), fewer than target.tensor_parallel_size "
         f"({p.target.tensor_parallel_size}); give it more, or lower target.tensor_parallel_size")
    need(train_params.pg_timeout_minutes >= 1, "train.pg_timeout_minutes",
         "must be >= 1 (minutes a rank waits for the others; a short one stops long runs at a barrier)")
    need(0 < train_params.verify_sample <= 1, "train.verify_sample", "must be in (0, 1] (the share of shards hashed "
         "when train.verify_cache is sampled)")
    need(train_params.num_workers >= 0, "train.num_workers", "must be >= 0 (0: read batches in the training process)")
    need(train_params.gpu_memory_gb is None or train_params.gpu_memory_gb > 0, "train.gpu_memory_gb",
         "must be > 0 (or null: no check)")
    _check_gpu_kind(train_params)
    need(tg.max_num_seqs is None or tg.max_num_seqs >= 1, "target.max_num_seqs",
         "must be >= 1 (or null: vLLM's default)")
    need(tg.attention_backend is None or tg.attention_backend in VLLM_ATTENTION_BACKENDS, "target.attention_backend",
         f"{tg.attention_backend!r} is not one of vLLM 0.32's backends ({', '.join(VLLM_ATTENTION_BACKENDS)}); "
         "null lets vLLM choose")
    need(train_params.eval_sequences >= 1, "train.eval_sequences", "must be >= 1")
    need(train_params.max_sequences is None or train_params.max_sequences >= 1, "train.max_sequences",
         "must be >= 1 or null (all)")
    sc = p.scaling
    need(all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sc.sizes)
         and list(sc.sizes) == sorted(set(sc.sizes)),
         "scaling.sizes", "must be distinct positive chat counts in ascending order, got " + _short(sc.sizes))
    need(sc.epochs > 0, "scaling.epochs", "must be > 0")
    need(all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 1 for x in sc.targets),
         "scaling.targets", "acceptance lengths must be > 1, got " + _short(sc.targets))
    need(train_params.diverge_steps >= 0, "train.diverge_steps", "must be >= 0 (0: no divergence guard)")
    need(0 < train_params.diverge_uniform_rtol < 1, "train.diverge_uniform_rtol", "must be in (0, 1)")
    need(train_params.diverge_loss_rise > 1, "train.diverge_loss_rise", "must be > 1")
    need(train_params.diverge_grad_norm >= 0, "train.diverge_grad_norm", "must be >= 0")
    need(0 <= train_params.lk_eta <= 100, "train.lk_eta", "must be in [0, 100] (0: lk_hybrid is plain KL)")
    need(0 <= train_params.feature_noise <= 10, "train.feature_noise",
         "must be in [0, 10] (std in units of the aux scale)")
    need(not (train_params.fc_input_scaling and train_params.norm_before_fc), "train.fc_input_scaling",
         "cannot be folded into fc behind an RMSNorm: set it false when train.norm_before_fc is true")
    need(not (train_params.freeze_lm_head and not train_params.init_lm_head), "train.freeze_lm_head",
         "a frozen lm_head must be initialised from the target (train.init_lm_head: true)")
    need(e.num_prompts >= 1, "eval.num_prompts", "must be >= 1")
    need(e.decoder_prompts is None or e.decoder_prompts >= 1, "eval.decoder_prompts",
         "must be >= 1 (or null: all eval.num_prompts prompts)")
    need(e.vllm_prompts is None or e.vllm_prompts >= 1, "eval.vllm_prompts",
         "must be >= 1 (or null: all eval.num_prompts prompts)")
    need(e.max_new_tokens >= 1, "eval.max_new_tokens", "must be >= 1")
    need(1 <= e.k <= 16, "eval.k", "must be in 1..16")
    need(e.temperature >= 0, "eval.temperature", "must be >= 0")
    need(len(e.ngram_k) >= 1 and all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16
                                     for k in e.ngram_k), "eval.ngram_k",
         "must be a non-empty list of ints in 1..16 (like eval.k)")
    need(1 <= e.prompt_lookup_min <= e.prompt_lookup_max, "eval.prompt_lookup_min",
         "must satisfy 1 <= prompt_lookup_min <= prompt_lookup_max")
    need(isinstance(e.suffix_baseline, bool), "eval.suffix_baseline", "must be true or false")
    need(isinstance(e.baseline_vllm, bool), "eval.baseline_vllm", "must be true or false")
    need(e.max_prompt_tokens is None or e.max_prompt_tokens >= 1, "eval.max_prompt_tokens",
         "must be >= 1 (or null: no limit)")
    _check_breadth(e)
    _check_drafters(e)

    if p.target.shape is not None:
        need({"num_hidden_layers", "hidden_size", "vocab_size"} <= set(p.target.shape), "target.shape",
             "needs num_hidden_layers, hidden_size and vocab_size")
        _check_shape_values(p.target.shape, "target.shape")
    shape = p.target_shape()
    if p.target.path != EMBEDDED_TARGET and shape is None:
        raise ParamsError(f"target.path: {p.target.path!r} has no config.json and target.shape is not set")
    if shape is not None:
        missing = {"num_hidden_layers", "vocab_size"} - set(shape)
        need(not missing, "target.path", f"{p.target.path!r}: config.json lacks {sorted(missing)} "
             "(not a decoder-only causal LM config?); set target.shape to override")
        bad = {k: shape[k] for k in ("num_hidden_layers", "vocab_size")
               if not isinstance(shape[k], int) or isinstance(shape[k], bool) or shape[k] < 1}
        need(not bad, "target.path", f"{p.target.path!r}: config.json has {bad}, expected positive "
             "ints; set target.shape to override")
        v, n = shape["vocab_size"], shape["num_hidden_layers"]
        need(d.draft_vocab_size <= v, "data.draft_vocab_size",
             f"{d.draft_vocab_size} is larger than the target vocabulary ({v})")
        if x.aux_layers is not None:
            need(len(x.aux_layers) == 3 and all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in x.aux_layers),
                 "extract.aux_layers", "must be 3 layer ids (ints), got " + _short(x.aux_layers))
            need(len(set(x.aux_layers)) == 3, "extract.aux_layers",
                 f"{x.aux_layers} repeats a layer: the drafter needs 3 different layers (low, middle, "
                 "high; default (2, N//2, N-3))")
            need(all(0 <= i < n for i in x.aux_layers), "extract.aux_layers",
                 f"{x.aux_layers} out of range: the target has {n} layers (valid ids 0..{n - 1})")
        else:
            need(n >= 4, "extract.aux_layers", f"default (2, N//2, N-3) needs N >= 4 layers, got {n}")
        need(train_params.init_from_drafter is None or train_params.init_from_layer is None, "train.init_from_drafter",
             "and train.init_from_layer both set: start from one of them (set the other to null)")
        need(train_params.init_from_layer is None or -n <= train_params.init_from_layer < n, "train.init_from_layer",
             f"{train_params.init_from_layer} out of range: the target has {n} layers (valid -{n}..{n - 1})")
    return p


# The most warmup a run may have: this share of its planned optimizer steps (rounded up), and at least
# MIN_WARMUP_ALLOWED steps (tiny plumbing runs such as ci's 12 steps keep their 2 warmup steps).
MAX_WARMUP_FRACTION = 0.1
MIN_WARMUP_ALLOWED = 2


def train_ranks(p: "Params") -> int:
    """The trainer's processes: train.nproc under ddp / fsdp, else one."""
    return p.train.nproc if p.train.distributed != "none" else 1


def suffix_stage(e: EvalParams) -> Optional[str]:
    """The stage that measures vLLM's suffix decoding (eval.suffix_baseline): "ngram" (01, beside its
    vLLM plain and n-gram rows), or "eval" (05, beside EAGLE-3) where 01 runs no vLLM
    (eval.baseline_vllm false: 05 measures plain and n-gram already); None where it is off or vLLM
    is not used."""
    if not (e.suffix_baseline and e.use_vllm):
        return None
    return "ngram" if e.baseline_vllm else "eval"


def max_warmup_steps(planned_steps: int) -> int:
    return max(MIN_WARMUP_ALLOWED, math.ceil(MAX_WARMUP_FRACTION * planned_steps))


def planned_warmup(train_params: TrainParams, planned_steps: int) -> int:
    """Warmup steps of a run of planned_steps: train.warmup_fraction of them when set, else warmup_steps."""
    if train_params.warmup_fraction is None:
        return train_params.warmup_steps
    return round(train_params.warmup_fraction * planned_steps)


def checkpoint_interval(train_params: TrainParams, planned_steps: int) -> int:
    """Steps between checkpoints: train.checkpoint_fraction of planned_steps when set, else checkpoint_every."""
    if train_params.checkpoint_fraction is None:
        return train_params.checkpoint_every
    return max(1, round(train_params.checkpoint_fraction * planned_steps))


def warmup_problem(warmup: int, planned_steps: int, basis: str) -> str:
    """The refusal of a warmup longer than max_warmup_steps(planned_steps), naming the fix."""
    return (f"{warmup} warmup steps are {warmup / max(planned_steps, 1):.0%} of the {planned_steps:,} planned "
            f"optimizer steps ({basis}); at most {MAX_WARMUP_FRACTION:.0%} ({max_warmup_steps(planned_steps)} steps) "
            "is allowed, else most of the run never leaves warmup: lower train.warmup_steps or set "
            "train.warmup_fraction (e.g. 0.02), which follows the run's size")


SOURCE_KEYS = ("path", "max_records")


def data_sources(source: Any, key: str = "data.source") -> list[tuple[str, Optional[int], str]]:
    """`data.source` as [(path, max_records or None, item)], item naming it in the profile
    ("data.source" or "data.source[i]"). A plain string is one source without its own cap (the
    global data.max_records applies); a list holds strings or {path, max_records} mappings.
    Raises ParamsError naming the item and the fix. Does not look at the disk (chats.check_sources)."""
    example = "e.g. [sharegpt, {path: /data/chats.jsonl, max_records: 20000}]"
    if isinstance(source, str):
        items, single = [source], True
    elif isinstance(source, list) and source:
        items, single = source, False
    else:
        raise ParamsError(f"{key}: expected 'sharegpt', a path, or a non-empty list of sources ({example}), "
                          f"got {type(source).__name__} ({source!r})")
    out = []
    for i, item in enumerate(items):
        where = key if single else f"{key}[{i}]"
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, dict):
            raise ParamsError(f"{where}: expected a path or a mapping {{path, max_records}}, got "
                              f"{type(item).__name__} ({item!r}) ({example})")
        unknown = sorted(set(map(str, item)) - set(SOURCE_KEYS))
        if unknown:
            raise ParamsError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(SOURCE_KEYS)})")
        path, cap = item.get("path"), item.get("max_records")
        if not isinstance(path, str) or not path.strip():
            raise ParamsError(f"{where}.path: expected 'sharegpt' or a file/folder path, got {path!r}")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ParamsError(f"{where}.max_records: expected an int >= 1 or null (all records), got {cap!r}")
        if Path(path).suffix.lower() not in ("", ".json", ".jsonl") and not resolve_path(path).is_dir():
            raise ParamsError(f"{where}: {path!r} must be 'sharegpt', a .json/.jsonl file or a folder "
                              "written by datasets.save_to_disk")
        out.append((path, cap, where))
    paths = [p for p, _, _ in out]
    dup = next((p for p in paths if paths.count(p) > 1), None)
    if dup is not None:
        raise ParamsError(f"{key}: {dup!r} is listed twice; list each source once (its max_records caps it)")
    return out


def _short(value: Any, limit: int = 200) -> str:
    """repr(value) cut to `limit` characters, for error messages about user-given lists."""
    text = repr(value) if not isinstance(value, list) or len(value) <= 64 else f"a list of {len(value)} items"
    return text if len(text) <= limit else text[:limit] + "..."


# Folders of the checkout that a run folder must never land in (output_dir: . would make them runs).
REPO_FOLDERS = (".git", ".venv", ".ci", "eagle3lib", "params", "notebooks", "tests", "bench")


def _check_output_dir(p: Params) -> None:
    """output_dir is a folder of its own: not the checkout (or a folder above it), nor inside one of
    the checkout's own folders (eagle3lib, params, ...), where run names would meet the repo's files."""
    out, repo = p.outputs_root().resolve(), repo_root().resolve()
    if out == repo or out in repo.parents or any(out == repo / f or repo / f in out.parents for f in REPO_FOLDERS):
        raise ParamsError(f"output_dir: {p.output_dir!r} resolves to {out}, which is the checkout {repo}, a folder "
                          f"above it or one of its own folders: run folders would mix with the repository's "
                          f"files; use 'outputs' (the default) or a folder of its own, e.g. /data/eagle3-outputs")


def _check_finite(p: Params) -> None:
    """Every float field is a finite number (`epochs: .inf` would pass `> 0` and overflow later)."""
    for sec_name, cls in SECTIONS.items():
        section = getattr(p, sec_name)
        for f in dataclasses.fields(cls):
            value = getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ParamsError(f"{sec_name}.{f.name}: must be a finite number, got {value!r}")


def _check_shape_values(shape: dict, key: str) -> None:
    """Target shape entries are positive integers (a string would fail later inside arithmetic)."""
    for name, value in shape.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParamsError(f"{key}.{name}: expected a positive int, got {type(value).__name__} ({value!r})")


# ---- dtype "auto" ---------------------------------------------------------------------------
# bf16 is 3-4x faster than fp32 on a CPU that computes it natively (AVX512-BF16 / AMX: prefill
# 3,400 vs 890 tok/s for SmolLM2) and 4.5-15x SLOWER on one that emulates it (AVX2 only: vLLM
# regeneration ~18 vs 82 tok/s, NOTES.md, Decisions: Threads and dtype). The same profile has to run on both.
NATIVE_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}   # x86 AVX512-BF16 and AMX; Arm BF16


def host_memory_bytes() -> Optional[int]:
    """This machine's physical memory (Linux sysconf), None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set:
    """The feature flags of this CPU (Linux); empty when they cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def cpu_has_native_bf16(flags: Optional[set] = None) -> bool:
    """Whether this CPU computes bf16 natively (a flag in NATIVE_BF16_CPU_FLAGS)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_CPU_FLAGS)


def auto_dtype(flags: Optional[set] = None, cuda: Optional[bool] = None) -> str:
    """"bfloat16" where bf16 math is native (a CUDA device, or a CPU with a flag in
    NATIVE_BF16_CPU_FLAGS), else "float32"."""
    if cuda is None:
        import torch  # only when a profile asks for "auto"
        cuda = torch.cuda.is_available()
    return "bfloat16" if cuda or cpu_has_native_bf16(flags) else "float32"


def resolve_auto_dtypes(p: Params, flags: Optional[set] = None, cuda: Optional[bool] = None) -> Params:
    """Replace dtype "auto" (target.dtype, train.dtype) by the concrete dtype for this machine, so
    that cache keys, subprocess arguments and reports all see what really runs."""
    sections = [name for name in ("target", "train") if getattr(p, name).dtype == "auto"]
    if sections:
        dtype = auto_dtype(flags, cuda)
        for name in sections:
            setattr(p, name, dataclasses.replace(getattr(p, name), dtype=dtype))
    return p


def load_params(path: str | os.PathLike, overrides: Optional[dict] = None) -> Params:
    """Load, merge (inherit), type-check and validate a profile, then resolve dtype "auto".
    Relative paths resolve from the current folder first, then from the repository root."""
    path = resolve_path(path)
    try:
        raw = _read_yaml(path)
        if overrides:
            raw = _merge(raw, overrides)
        return resolve_auto_dtypes(validate(_build(Params, raw, "")))
    except ParamsError as e:
        if str(path) in str(e):
            raise
        raise ParamsError(f"{e} [profile {path}]") from None


def repo_root() -> Path:
    """The folder holding pyproject.toml above this package (the repository checkout)."""
    here = Path(__file__).resolve().parent
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file() and (d / "params").is_dir():
            return d
    return Path.cwd()


def resolve_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    q = repo_root() / p
    return q if q.exists() else p


def dump(p: Params) -> str:
    return yaml.safe_dump(p.to_dict(), sort_keys=False)
