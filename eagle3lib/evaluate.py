"""Evaluation of plain, n-gram and EAGLE-3 decoding: eagle3lib's reference decoder and vLLM.

The notebooks (01_ngram_baseline, 05_eval) call these functions and only show the results:

    prompts = eval_prompts(params, run_dir, tokenizer)             # held-out, chat template applied
    per_prompt = run_decoder_eval(target, prompts, methods, ...)   # eagle3lib: one row per (method, prompt)
    summary = summarize(per_prompt)                                # one row per method, speedup vs plain
    vllm_summary, raw = run_vllm_eval(params, target_dir, prompts, modes, workdir)
    check_lossless(per_prompt, params)                             # fp32, T=0: assert, naming a failing prompt
    check_vllm_same_output(raw, prompts, params); check_acceptance_agrees(per_prompt, raw, prompts, params)
    section = eval_metrics(summary, vllm_summary, setup, ...)     # the metrics.json section

Public drafters (05_eval, eval.drafters): read and checked against the target before any engine,
the run's own drafter too, then one eagle3 engine each beside plain, n-gram and the trained drafter:

    infos = check_eval_drafters(params, final_dir)       # {name: DrafterInfo}; DrafterMismatch names the field
    modes = vllm_modes(ngram, export_dir, k, drafters=infos)            # + "drafter-<name>_k<k>" modes
    section = eval_metrics(..., drafters=drafters_metrics(vllm_summary, infos, eagle3, k))

Breadth (05_eval, vLLM only): more request groups, one per (domain, temperature), decoded by the
same engine of each mode after the main prompts (no extra engine start):

    groups = breadth_groups(params, setup)              # chat and eval.domains x eval.sample_temperatures ...
    vllm_summary, raw = run_vllm_eval(params, target_dir, prompts, modes, workdir, groups=groups)
    table = breadth_summary(raw, groups, params)        # one row per (domain, temperature, method)
    check_breadth_same_output(raw, groups, params)      # T=0 groups only, fp32

The verdict sentences and plots are in `verdict.py`.

Rates are pooled over prompts (sums of tokens, seconds, accepted drafts), not averaged per prompt.
`tokens_per_s` is the DECODE rate (prefill and its first token excluded; speculative decoding
only speeds up decoding) and `speedup` its ratio to plain's; `e2e_tokens_per_s` includes prefill.
Acceptance length follows vLLM: 1 + accepted draft tokens / drafting rounds; tau = emitted
tokens / target forwards (prefill included). The prompts are pre-rendered token ids, so the
reference decoder and vLLM read exactly the same inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
import torch

from .data import load_eval_prompts
from .decode import DecodeStats, Eagle3Proposer, NgramProposer, NoProposer, greedy_generate, speculative_generate
from .domains import domain_prompts, render_capped  # render_prompt: the chat template -> token ids
from .drafters import DrafterInfo, check_drafter, read_drafter
from .engine import engine_kwargs
from .files import check_run_links, read_metrics, update_metrics
from .layout import RunLayout
from .params import host_memory_bytes, load_params, resolve_path
from .progress import tqdm
from .target import checkpoint_weight_bytes, eos_ids, load_target, load_tokenizer, target_path
from .verdict import (
    PLAIN,
    best_method,
    breadth_verdict,
    compare_drafters,
    drafter_verdict,
    eagle3_verdict,
    export_check,
    ngram_verdict,
    row_of,
)
from .vllm_bench import BenchSpec, GroupSpec, ModeSpec, mode, run_vllm

# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def eval_prompts(params, run_dir, tokenizer, limit: Optional[int] = None) -> tuple:
    """Held-out prompts as ([{"id", "category", "input_ids"}], skipped): the first `limit`
    (default eval.num_prompts) of those with at most eval.max_prompt_tokens tokens, rendered in
    data.thinking's mode (as regeneration rendered the training prompts); `skipped` counts the
    longer ones passed over."""
    limit = limit if limit is not None else params.eval.num_prompts
    cap = params.eval.max_prompt_tokens
    records = ((r["id"], r.get("category") or "all", r["messages"]) for r in load_eval_prompts(params, run_dir))
    prompts, skipped = render_capped(records, tokenizer, limit, cap, params.data.thinking)
    if not prompts:
        raise ValueError(f"no held-out evaluation prompt left ({skipped} longer than eval.max_prompt_tokens="
                         f"{cap}): check the data stage / eval.prompts_path / eval.max_prompt_tokens")
    return prompts, skipped


@dataclass
class BenchRun:
    """What a bench needs to measure a finished run's drafter in vLLM (bench/k_sweep.py,
    bench/engine_spread.py)."""
    params: object
    layout: RunLayout
    export_dir: Path          # the vLLM export measured
    target_dir: Path
    prompts: list             # the first eval.vllm_prompts (else eval.num_prompts) held-out prompts
    skipped: int              # held-out prompts over eval.max_prompt_tokens


def bench_run(params_path: str, run: Optional[str] = None, export: Optional[str] = None,
              limit: Optional[int] = None) -> BenchRun:
    """The profile, the run (default: its run_name), the export (`export`, else the run's own export/)
    and the first `limit` held-out prompts. Raises FileNotFoundError naming the fix when the export
    has no config.json."""
    params = load_params(params_path)
    layout = params.layout(run)
    export_dir = Path(export).resolve() if export else layout.export      # the vLLM child runs elsewhere
    if not (export_dir / "config.json").is_file():
        raise FileNotFoundError(f"{export_dir}: no export; run 05_eval first "
                                f"(eagle3 run --params {params_path} --only eval)")
    target_dir = target_path(params)
    prompts, skipped = eval_prompts(params, layout.root, load_tokenizer(target_dir, params.target.trust_remote_code))
    return BenchRun(params, layout, export_dir, target_dir,
                    prompts[:limit or params.eval.vllm_prompts or params.eval.num_prompts], skipped)


@dataclass
class EvalSetup:
    """What every evaluation needs, loaded once."""
    target_dir: Path
    target: object            # transformers causal LM in eval.dtype; None when reference_skip is set
    tokenizer: object
    prompts: list             # [{"id", "category", "input_ids"}]; vLLM runs these
    decoder_prompts: list     # the first eval.decoder_prompts of them: eagle3lib's decoder runs these
    skipped_prompts: int      # held-out prompts over eval.max_prompt_tokens
    eos: list                 # EOS ids (what vLLM stops on)
    reference_skip: Optional[str] = None   # why eagle3lib's reference decoder does not run (None: it runs)


def load_eval_setup(params, run_dir, limit: Optional[int] = None) -> EvalSetup:
    """Target (eval.dtype), tokenizer and the held-out prompts (first eval.num_prompts). The target
    is loaded only when the reference decoder runs (reference_decoder_skip)."""
    check_run_links(run_dir)       # no write or delete may go through a link out of the run
    tdir = target_path(params)
    tok = load_tokenizer(tdir, params.target.trust_remote_code)
    skip = reference_decoder_skip(params, tdir)
    target = None if skip else load_target(tdir, params.eval.dtype, trust_remote_code=params.target.trust_remote_code)
    prompts, skipped = eval_prompts(params, run_dir, tok, limit)
    decoder_prompts = [] if skip else decoder_subset(params, prompts)
    return EvalSetup(tdir, target, tok, prompts, decoder_prompts, skipped, eos_ids(tdir), skip)


# ---------------------------------------------------------------------------------------------
# Whether eagle3lib's reference decoder can run: it loads the whole target in transformers on ONE
# device (target.load_target: the CPU), which a ~0.6 TB Kimi-class checkpoint cannot fit.
# ---------------------------------------------------------------------------------------------


def skip_reason(mode: str, weight_bytes: Optional[int], device_bytes: Optional[int],
                device: str = "this machine's memory") -> Optional[str]:
    """The decision of eval.reference_decoder: None (run it) or why not.
    always: run; never: skip; auto: skip when the weights exceed the device's memory (unknown sizes: run)."""
    if mode == "always":
        return None
    if mode == "never":
        return ("eval.reference_decoder is 'never' (the profile turns eagle3lib's reference decoder off; "
                "see its comment)")
    if mode != "auto":
        raise ValueError(f"eval.reference_decoder must be auto, always or never, got {mode!r}")
    if weight_bytes is None or device_bytes is None or weight_bytes <= device_bytes:
        return None
    return (f"the target's weights ({weight_bytes / 1e9:,.1f} GB of safetensors) exceed {device} "
            f"({device_bytes / 1e9:,.1f} GB): eagle3lib's reference decoder loads the whole target in "
            "transformers on one device. vLLM's rows are the evaluation; set eval.reference_decoder: "
            "always to try anyway")


def reference_decoder_skip(params, target_dir) -> Optional[str]:
    """Why eagle3lib's reference decoder does not run for profile `params` (None: it runs)."""
    if params.eval.reference_decoder != "auto":
        return skip_reason(params.eval.reference_decoder, None, None)
    return skip_reason("auto", checkpoint_weight_bytes(target_dir), host_memory_bytes())


def empty_summary() -> pd.DataFrame:
    """A summary table without rows (the reference decoder was skipped): verdict and plots take it."""
    return pd.DataFrame(columns=["method", "k", "prompts", "new_tokens", "seconds", "tokens_per_s",
                                 "e2e_tokens_per_s", "tau", "acceptance_length", "draft_tokens", "accepted",
                                 "per_position_acceptance", "draft_share", "lossless", "speedup"])


def decoder_subset(params, prompts: list) -> list:
    """The prompts eagle3lib's reference decoder runs: the first eval.decoder_prompts (None: all)."""
    return prompts[:params.eval.decoder_prompts]


def ngram_sweep(params) -> list:
    """(k, min_n, max_n) settings of the n-gram baseline: every k of eval.ngram_k with the profile's
    lookup lengths, plus a shorter maximum lookup (2) to show its effect."""
    lo, hi = params.eval.prompt_lookup_min, params.eval.prompt_lookup_max
    ranges = sorted({(min(lo, 2), 2), (lo, hi)}, key=lambda r: (r[1], r[0]))
    return [(k, a, b) for k in params.eval.ngram_k for a, b in ranges]


# ---------------------------------------------------------------------------------------------
# eagle3lib's reference decoder
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(n: Optional[int]):
    """Temporarily set torch's intra-op threads. Batch-1 decoding of a small model is a chain of
    tiny ops: one thread is about as fast as two on an idle 2-core CPU and many times faster on a
    busy one (spinning OpenMP workers), so the evaluation uses one by default."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ngram_method(k: int, min_n: int, max_n: int) -> tuple:
    """(name, k, proposer factory) for the n-gram proposer."""
    return (ngram_name(k, min_n, max_n), k, lambda: NgramProposer(min_n, max_n))


def ngram_name(k: int, min_n: int, max_n: int) -> str:
    return f"ngram_k{k}_n{min_n}-{max_n}"


def eagle3_method(drafter, k: int, name: Optional[str] = None) -> tuple:
    return (name or f"eagle3_k{k}", k, lambda: Eagle3Proposer(drafter))


def run_decoder_eval(target, prompts: list, methods: Sequence[tuple], max_new_tokens: int,
                     temperature: float = 0.0, eos_token_id=None, seed: int = 0,
                     num_threads: Optional[int] = 1, progress: bool = True):
    """Decode every prompt with plain greedy and every method (name, k, proposer factory).

    Returns (per_prompt DataFrame, outputs {method: [tokens per prompt]}). Plain decoding is always
    run first, as the baseline; `lossless` says whether a method's tokens equal plain's."""
    if target is None:
        raise ValueError("eagle3lib's reference decoder has no target: load_eval_setup skipped it "
                         "(EvalSetup.reference_skip says why); skip the eagle3lib rows, or set "
                         "eval.reference_decoder: always")
    rows, outputs = [], {PLAIN: []}
    jobs = [(PLAIN, 0, None)] + list(methods)
    names = [j[0] for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    for name, _, _ in jobs[1:]:
        outputs[name] = []
    bar = tqdm(total=len(jobs) * len(prompts), desc="decoding", disable=not progress)
    with torch_threads(num_threads):
        for name, k, make in jobs:
            for i, p in enumerate(prompts):
                gen = torch.Generator().manual_seed(seed + i)
                if make is None and temperature <= 0:
                    out, stats = greedy_generate(target, p["input_ids"], max_new_tokens, eos_token_id)
                elif make is None:        # plain sampling: the same loop without any draft
                    out, stats = speculative_generate(target, NoProposer(), p["input_ids"], max_new_tokens, 1,
                                                      temperature=temperature, generator=gen,
                                                      eos_token_id=eos_token_id)
                else:
                    out, stats = speculative_generate(target, make(), p["input_ids"], max_new_tokens, k,
                                                      temperature=temperature, generator=gen,
                                                      eos_token_id=eos_token_id)
                outputs[name].append(out)
                rows.append(_row(name, k, p, stats, out, outputs[PLAIN][i] if name != PLAIN else out))
                bar.update()
    bar.close()
    return pd.DataFrame(rows), outputs


def _row(method: str, k: int, prompt: dict, stats: DecodeStats, out: list, plain_out: list) -> dict:
    s = stats.summary()
    return {"method": method, "k": k, "prompt_id": prompt["id"], "category": prompt["category"],
            "new_tokens": s["new_tokens"], "seconds": s["total_s"], "prefill_s": s["prefill_s"],
            "target_forwards": s["target_forwards"],
            "num_drafts": s["num_drafts"], "num_draft_tokens": s["num_draft_tokens"],
            "num_accepted": s["num_accepted"], "accepted_per_position": stats.accepted_per_position(),
            "draft_s": s["draft_s"], "verify_s": s["verify_s"], "lossless": out == plain_out,
            "token_marks": stats.token_marks()}


def _pool(group) -> dict:
    tokens, seconds = group["new_tokens"].sum(), group["seconds"].sum()
    drafts, accepted = group["num_drafts"].sum(), group["num_accepted"].sum()
    k = int(group["k"].max())
    per_pos = [sum(v[i] for v in group["accepted_per_position"] if i < len(v)) for i in range(k)]
    decode_tokens = tokens - len(group)                       # the first token comes from the prefill
    decode_s = seconds - group["prefill_s"].sum()
    return {"k": k, "prompts": len(group), "new_tokens": int(tokens), "seconds": float(seconds),
            "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "e2e_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "tau": tokens / group["target_forwards"].sum(),
            "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "draft_tokens": int(group["num_draft_tokens"].sum()), "accepted": int(accepted),
            "per_position_acceptance": [c / drafts if drafts else 0.0 for c in per_pos],
            "draft_share": group["draft_s"].sum() / seconds if seconds > 0 else 0.0,
            "lossless": f"{int(group['lossless'].sum())}/{len(group)}"}


def summarize(per_prompt, by: Sequence[str] = ("method",)):
    """Pool the per-prompt rows by `by`; adds speedup = tokens/s over plain's (same grouping)."""
    rows = []
    for key, group in per_prompt.groupby(list(by), sort=False):
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key)), **_pool(group)})
    df = pd.DataFrame(rows)
    rest = [c for c in by if c != "method"]
    plain = {tuple(r[c] for c in rest): r["tokens_per_s"] for _, r in df.iterrows() if r["method"] == PLAIN}
    df["speedup"] = [r["tokens_per_s"] / plain[tuple(r[c] for c in rest)] if plain.get(tuple(r[c] for c in rest))
                     else float("nan") for _, r in df.iterrows()]
    return df


def per_category(per_prompt):
    """Acceptance length and speedup per (method, category)."""
    return summarize(per_prompt, by=("method", "category"))


def per_position_table(summary):
    """Rows: methods with drafts; columns: draft position 1..k; values: acceptance rate."""
    rows = {r["method"]: {i + 1: x for i, x in enumerate(r["per_position_acceptance"])}
            for _, r in summary.iterrows() if r["method"] != PLAIN}
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.columns.name = "draft position"
    return df


# ---------------------------------------------------------------------------------------------
# vLLM (in a subprocess, see vllm_bench)
# ---------------------------------------------------------------------------------------------


def vllm_modes(ngram: Sequence[tuple] = (), eagle3_dir=None, k: Optional[int] = None,
               suffix_k: Optional[int] = None, drafters: Optional[dict] = None) -> list[ModeSpec]:
    """vllm_bench modes: plain, each (k, min_n, max_n) n-gram setting, suffix decoding with up to
    suffix_k tokens if given, eagle3 if a folder is given, and each public drafter ({name: folder or
    DrafterInfo}, check_eval_drafters) as eagle3 with its folder, named drafter_mode_name(name, k)."""
    modes = [mode("plain")]
    for nk, lo, hi in ngram:
        modes.append(mode("ngram", nk, name=ngram_name(nk, lo, hi), prompt_lookup_min=lo, prompt_lookup_max=hi))
    if suffix_k is not None:
        modes.append(mode("suffix", suffix_k))
    if eagle3_dir is not None:
        modes.append(mode("eagle3", k, name=f"eagle3_k{k}", model=str(eagle3_dir)))
    for name, folder in (drafters or {}).items():
        path = folder.path if isinstance(folder, DrafterInfo) else folder
        modes.append(mode("eagle3", k, name=drafter_mode_name(name, k), model=str(path)))
    return modes


def run_vllm_eval(params, target_dir, prompts: list, modes: list[ModeSpec], workdir,
                  max_new_tokens: Optional[int] = None, timeout: Optional[float] = None, groups: Sequence[dict] = ()):
    """Run the modes in ONE vLLM subprocess. Returns (summary DataFrame, raw result dict).
    Uses the first eval.vllm_prompts prompts (None: all), dtype eval.vllm_dtype, T = eval.temperature.
    `groups` (breadth_groups): decoded by each mode's engine after these prompts; the summary holds
    the main prompts only (breadth_summary reads the groups)."""
    n = params.eval.vllm_prompts or len(prompts)
    new_tokens = max_new_tokens or params.eval.max_new_tokens
    longest = max(len(p["input_ids"]) for p in prompts[:n]) + new_tokens     # each mode adds its drafts
    spec = BenchSpec(target=str(target_dir), dtype=params.eval.vllm_dtype,
                     prompts=[p["input_ids"] for p in prompts[:n]], max_new_tokens=new_tokens,
                     temperature=params.eval.temperature, seed=params.seed, modes=list(modes),
                     groups=[GroupSpec(name=g["name"], prompts=[p["input_ids"] for p in g["prompts"]],
                                       temperature=g["temperature"]) for g in groups],
                     # parallelism, memory, batch budget, trust_remote_code: the same settings as every vLLM pass
                     engine=engine_kwargs(params, "eval", target_dir, longest, dtype=params.eval.vllm_dtype))
    raw = run_vllm(spec, workdir=workdir, timeout=timeout)
    rows = []
    plain = next((m for m in raw["modes"] if m["method"] == PLAIN), None)
    for m in raw["modes"]:
        rows.append({"method": m["name"], "k": m["k"], "prompts": len(m["outputs"]),
                     "new_tokens": m["num_new_tokens"], "seconds": m["elapsed_s"],
                     "tokens_per_s": m["decode_tokens_per_s"], "e2e_tokens_per_s": m["tokens_per_s"],
                     "acceptance_length": m["acceptance_length"],
                     "draft_tokens": m["num_draft_tokens"], "accepted": m["num_accepted"],
                     "per_position_acceptance": m["per_position_acceptance"],
                     "speedup": m["decode_tokens_per_s"] / plain["decode_tokens_per_s"] if plain else float("nan"),
                     "same_output_as_plain": (f"{sum(a == b for a, b in zip(m['outputs'], plain['outputs']))}"
                                              f"/{len(m['outputs'])}") if plain else "n/a"})
    return pd.DataFrame(rows), raw


# ---------------------------------------------------------------------------------------------
# Breadth: sampling temperatures and domains besides the held-out chats (vLLM, same engines)
# ---------------------------------------------------------------------------------------------

CHAT = "chat"   # the held-out chats' domain name (the data stage's ShareGPT split or eval.prompts_path)


def group_name(domain: str, temperature: float) -> str:
    return f"{domain}@T{temperature:g}"


def breadth_groups(params, setup: "EvalSetup") -> list:
    """The breadth request groups: every (domain, temperature) of [chat] + eval.domains x
    [eval.temperature] + eval.sample_temperatures except (chat, eval.temperature), which is the main
    run. Each: {"name", "domain", "temperature", "prompts" (the first eval.breadth_prompts of the
    domain, over-long ones skipped), "skipped"}. Empty when neither list is set."""
    e = params.eval
    if not e.sample_temperatures and not e.domains:
        return []
    sources = {CHAT: (setup.prompts[:e.breadth_prompts], setup.skipped_prompts)}
    for domain in e.domains:
        sources[domain] = domain_prompts(domain, setup.tokenizer, e.breadth_prompts, e.max_prompt_tokens,
                                         thinking=params.data.thinking)
    groups = []
    for domain, (prompts, skipped) in sources.items():
        for t in [e.temperature] + list(e.sample_temperatures):
            if (domain, t) != (CHAT, e.temperature):
                groups.append({"name": group_name(domain, t), "domain": domain, "temperature": float(t),
                               "prompts": prompts, "skipped": skipped})
    return groups


def _measured_row(domain: str, temperature: float, mode: dict, measured: dict) -> dict:
    """One breadth row: a mode's measurement of one group (or of the main prompts)."""
    return {"domain": domain, "temperature": temperature, "method": mode["name"], "k": mode["k"],
            "prompts": len(measured["outputs"]), "new_tokens": measured["num_new_tokens"],
            "tokens_per_s": measured["decode_tokens_per_s"], "acceptance_length": measured["acceptance_length"],
            "drafts": measured["num_drafts"], "accepted": measured["num_accepted"],
            "per_position_acceptance": measured["per_position_acceptance"],
            # whether a repeat of the group's first (seeded) request gave the same tokens (None: not tried)
            "seeded_repeat_equal": measured.get("seeded_repeat_equal")}


def breadth_summary(vllm_raw: dict, groups: Sequence[dict], params) -> pd.DataFrame:
    """One row per (domain, temperature, method): the main run (chat at eval.temperature) and every
    breadth group; speedup = decode tokens/s over plain's in the SAME group."""
    rows = []
    for m in vllm_raw["modes"]:
        rows.append(_measured_row(CHAT, float(params.eval.temperature), m, m))
        by_name = {g["name"]: g for g in m.get("groups", [])}
        for g in groups:
            if g["name"] not in by_name:
                raise ValueError(f"the vLLM result of mode {m['name']!r} has no group {g['name']!r}: pass "
                                 "run_vllm_eval the same groups as breadth_summary")
            rows.append(_measured_row(g["domain"], g["temperature"], m, by_name[g["name"]]))
    df = pd.DataFrame(rows)
    plain = {(r["domain"], r["temperature"]): r["tokens_per_s"] for _, r in df.iterrows() if r["method"] == PLAIN}
    df["speedup"] = [r["tokens_per_s"] / plain[(r["domain"], r["temperature"])]
                     if plain.get((r["domain"], r["temperature"])) else float("nan") for _, r in df.iterrows()]
    return df.sort_values(["domain", "temperature"], kind="stable").reset_index(drop=True)


BREADTH_COLUMNS = {"domain": "domain", "temperature": "temperature T", "method": "method", "k": "k",
                   "prompts": "prompts", "new_tokens": "new tokens", "tokens_per_s": "decode tokens/s",
                   "speedup": "speedup (x plain)", "acceptance_length": "acceptance length (tokens/round)",
                   "seeded_repeat_equal": "seeded repeat reproduced"}


def breadth_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The breadth summary for display: the headline columns, units in their names."""
    return summary[list(BREADTH_COLUMNS)].rename(columns=BREADTH_COLUMNS)


def check_breadth_same_output(vllm_raw: dict, groups: Sequence[dict], params) -> str:
    """check_vllm_same_output on every T=0 breadth group (asserted in float32 like the main rows;
    sampled groups are not compared: their tokens need not equal plain's)."""
    greedy = dataclasses.replace(params, eval=dataclasses.replace(params.eval, temperature=0.0))
    report = []
    for g in groups:
        if g["temperature"] > 0:
            continue
        view = {"log": vllm_raw.get("log", ""),
                "modes": [{**m, "outputs": _group_of(m, g["name"])["outputs"]} for m in vllm_raw["modes"]]}
        report.append(f"{g['name']}: " + check_vllm_same_output(view, g["prompts"], greedy))
    sampled = [g["name"] for g in groups if g["temperature"] > 0]
    if sampled:
        report.append(f"not compared (sampled, T > 0): {', '.join(sampled)}")
    return "\n".join(report) if report else "no breadth groups"


def _group_of(mode: dict, name: str) -> dict:
    hit = [g for g in mode.get("groups", []) if g["name"] == name]
    if not hit:
        raise ValueError(f"the vLLM result of mode {mode['name']!r} has no group {name!r}")
    return hit[0]


def breadth_metrics(summary: pd.DataFrame, groups: Sequence[dict], max_new_tokens: int) -> dict:
    """The breadth key of the 05_eval metrics.json section: per group, per method, the headline numbers."""
    skipped = {g["domain"]: g["skipped"] for g in groups}
    out = {"max_new_tokens": max_new_tokens, "groups": {}, "verdict": breadth_verdict(summary)}
    for (domain, t), rows in summary.groupby(["domain", "temperature"], sort=False):
        out["groups"][group_name(domain, t)] = {
            "domain": domain, "temperature": float(t), "prompts": int(rows["prompts"].iloc[0]),
            "skipped_long_prompts": skipped.get(domain, 0),
            "methods": {r["method"]: {"k": int(r["k"]), "new_tokens": int(r["new_tokens"]),
                                      "tokens_per_s": float(r["tokens_per_s"]), "speedup": float(r["speedup"]),
                                      "acceptance_length": float(r["acceptance_length"]),
                                      "seeded_repeat_equal": None if r["seeded_repeat_equal"] is None
                                      else bool(r["seeded_repeat_equal"])}
                        for _, r in rows.iterrows()}}
    return out


# ---------------------------------------------------------------------------------------------
# Correctness checks: asserted by notebooks 01 and 05 (fp32 at T=0)
# ---------------------------------------------------------------------------------------------

# Both backends run the same weights on the same prompt token ids. In float32 at T=0 a correct
# speculative decoder emits exactly plain greedy decoding's tokens, and eagle3lib's decoder and
# vLLM make the same drafts and accept the same ones, so these checks demand exact equality; in
# bf16 (rounding can flip near-tie tokens) or at T > 0 (sampling) they are not asserted and say why.


def exactness_waiver(params, backend: str) -> Optional[str]:
    """None when `backend` ("eagle3lib" or "vLLM") must reproduce plain greedy decoding exactly
    (its dtype is float32 and eval.temperature is 0); else the reason it need not."""
    key = "eval.dtype" if backend == "eagle3lib" else "eval.vllm_dtype"
    dtype = params.eval.dtype if backend == "eagle3lib" else params.eval.vllm_dtype
    if params.eval.temperature > 0:
        return f"eval.temperature={params.eval.temperature} > 0 (sampled tokens need not equal greedy ones)"
    if dtype != "float32":
        return f"{key}={dtype} (rounding can flip near-tie tokens; exact only in float32)"
    return None


def check_lossless(per_prompt, params) -> str:
    """eagle3lib: every speculative method's tokens equal plain greedy decoding's on every prompt.
    Raises AssertionError naming each failing (method, prompt); returns a one-line report."""
    spec = per_prompt[per_prompt["method"] != PLAIN]
    counts = ", ".join(f"{m} {int(g['lossless'].sum())}/{len(g)}" for m, g in spec.groupby("method", sort=False))
    waiver = exactness_waiver(params, "eagle3lib")
    if waiver:
        return f"eagle3lib lossless (not asserted: {waiver}): {counts}"
    bad = spec[~spec["lossless"].astype(bool)]
    if not bad.empty:
        where = "; ".join(f"{r['method']} on prompt {r['prompt_id']!r}" for _, r in bad.iterrows())
        raise AssertionError(
            f"eagle3lib is NOT lossless in float32 at T=0 ({counts}): the output differs from plain greedy "
            f"decoding for {where}. That is a bug in decode.py (verifier, proposer or KV-cache cropping).")
    return f"eagle3lib lossless, every prompt equals plain greedy decoding: {counts}"


def check_vllm_same_output(vllm_raw: dict, prompts: list, params) -> str:
    """vLLM: every speculative mode's output equals vLLM plain's on every prompt (`prompts`: the
    list given to run_vllm_eval). Raises AssertionError naming the mode, prompt and first differing
    token; returns a one-line report."""
    plain = _vllm_mode(vllm_raw, PLAIN)
    spec = [m for m in vllm_raw["modes"] if m["method"] != PLAIN]
    bad, counts = [], []
    for m in spec:
        same = 0
        for prompt, out, ref in zip(prompts, m["outputs"], plain["outputs"]):
            if out == ref:
                same += 1
            else:
                first = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
                bad.append(f"{m['name']} on prompt {prompt['id']!r} (first difference at new token {first})")
        counts.append(f"{m['name']} {same}/{len(m['outputs'])}")
    waiver = exactness_waiver(params, "vLLM")
    if waiver:
        return f"vLLM same output as plain (not asserted: {waiver}): {', '.join(counts)}"
    if bad:
        raise AssertionError(f"vLLM speculative output differs from vLLM plain in float32 at T=0 "
                             f"({', '.join(counts)}): {'; '.join(bad)}. Check the export (export.py) and "
                             f"the vLLM log {vllm_raw.get('log', '')}.")
    return f"vLLM same output as plain on every prompt: {', '.join(counts)}"


def check_acceptance_agrees(per_prompt, vllm_raw: dict, prompts: list, params) -> str:
    """For each method run by both backends: drafts, accepted tokens and accepted-per-position
    counts of eagle3lib equal vLLM's, prompt by prompt, on the prompts both ran (both run a prefix
    of `prompts`, the list given to run_vllm_eval). Tolerance: none. Same weights, same token ids,
    float32, T=0 and identical outputs give identical drafts (the ci vLLM test and the local
    evals in NOTES.md measured identical counts, e.g. 27 accepted / 36 rounds in both). Raises
    AssertionError naming the method and prompt; returns a one-line report."""
    waiver = exactness_waiver(params, "eagle3lib") or exactness_waiver(params, "vLLM")
    if waiver:
        return f"eagle3lib/vLLM acceptance comparison not asserted: {waiver}"
    report = []
    for m in vllm_raw["modes"]:
        mine = per_prompt[per_prompt["method"] == m["name"]]
        if m["method"] == PLAIN or mine.empty:
            continue
        if m.get("per_prompt") is None:
            return "eagle3lib/vLLM acceptance comparison not asserted: vLLM ran batched (no per-prompt counts)"
        n = min(len(mine), len(m["per_prompt"]))
        totals = [0, 0, 0, 0]     # eagle3lib accepted, drafts; vLLM accepted, drafts
        for (_, row), theirs, prompt in zip(mine.iloc[:n].iterrows(), m["per_prompt"][:n], prompts[:n]):
            if row["prompt_id"] != prompt["id"]:
                raise ValueError(f"{m['name']}: eagle3lib's prompt {row['prompt_id']!r} is not vLLM's "
                                 f"{prompt['id']!r}: pass the prompts given to run_vllm_eval")
            _check_counts(m["name"], prompt["id"], _decoder_counts(row, m["k"]), _vllm_counts(theirs, m["k"]))
            totals = [a + b for a, b in zip(totals, (row["num_accepted"], row["num_drafts"],
                                                     theirs["num_accepted"], theirs["num_drafts"]))]
        report.append(f"{m['name']} {totals[0]} accepted / {totals[1]} drafts in both")
    if not report:
        return "eagle3lib/vLLM acceptance comparison: no speculative method ran in both backends"
    return f"eagle3lib and vLLM acceptance agree exactly, prompt by prompt: {'; '.join(report)}"


def _vllm_mode(vllm_raw: dict, method: str) -> dict:
    hit = [m for m in vllm_raw["modes"] if m["method"] == method]
    if not hit:
        raise ValueError(f"the vLLM result has no {method!r} mode (modes: "
                         f"{[m['name'] for m in vllm_raw['modes']]}): add mode('{method}') to the run")
    return hit[0]


def _decoder_counts(row, k: int) -> tuple:
    per_pos = list(row["accepted_per_position"]) + [0] * k
    return int(row["num_drafts"]), int(row["num_accepted"]), [int(x) for x in per_pos[:k]]


def _vllm_counts(counts: dict, k: int) -> tuple:
    per_pos = list(counts["accepted_per_position"]) + [0] * k     # empty when nothing was drafted
    return int(counts["num_drafts"]), int(counts["num_accepted"]), [int(x) for x in per_pos[:k]]


def _check_counts(method: str, prompt_id, ours: tuple, theirs: tuple) -> None:
    if ours != theirs:
        raise AssertionError(
            f"{method} on prompt {prompt_id!r}: eagle3lib made {ours[0]} drafts with {ours[1]} accepted "
            f"(per position {ours[2]}), vLLM {theirs[0]} with {theirs[1]} (per position {theirs[2]}); in "
            "float32 at T=0 they must be equal: the drafter math (model.py, decode.py) or the export "
            "(export.py) differs from vLLM's.")

# ---------------------------------------------------------------------------------------------
# metrics.json sections
# ---------------------------------------------------------------------------------------------


def ngram_metrics(summary, vllm_summary, setup: "EvalSetup", max_new_tokens: int, run_dir=None) -> dict:
    """The 01_ngram_baseline section of metrics.json (written there when run_dir is given)."""
    out = {"prompts": len(setup.prompts), "decoder_prompts": len(setup.decoder_prompts),
           "skipped_long_prompts": setup.skipped_prompts,
           "max_new_tokens": max_new_tokens, "eagle3lib": table_metrics(summary),
           "verdict": ngram_verdict(summary, vllm_summary)}
    best = best_method(summary, "ngram")
    if best is not None:
        out.update(best_ngram_eagle3lib=best["method"], speedup_eagle3lib_ngram=float(best["speedup"]),
                   acceptance_length_eagle3lib_ngram=float(best["acceptance_length"]))
    if vllm_summary is not None and not vllm_summary.empty:
        out["vllm"] = table_metrics(vllm_summary)
        best = best_method(vllm_summary, "ngram")
        if best is not None:
            out.update(best_ngram_vllm=best["method"], speedup_vllm_ngram=float(best["speedup"]),
                       acceptance_length_vllm_ngram=float(best["acceptance_length"]))
        suffix = best_method(vllm_summary, "suffix")
        if suffix is not None:
            out.update(speedup_vllm_suffix=float(suffix["speedup"]),
                       acceptance_length_vllm_suffix=float(suffix["acceptance_length"]))
    if run_dir is not None:
        update_metrics(run_dir, "ngram", out)
    return out


def eval_metrics(summary, vllm_summary, setup: "EvalSetup", export_dir, eagle3: str, ngram: str,
                 max_new_tokens: int, breadth: Optional[dict] = None, run_dir=None, k: Optional[int] = None,
                 drafters: Optional[dict] = None) -> dict:
    """The 05_eval section of metrics.json (written there when run_dir is given); `breadth`
    (breadth_metrics) is stored under "breadth" when the breadth groups ran, `drafters`
    (drafters_metrics) under "drafters" when eval.drafters named public drafters; with run_dir and k
    (the drafts per round decoded), "export_check" compares vLLM's acceptance with 04's replayed one."""
    def pick(table, method, key):
        r = row_of(table, method)
        return None if r is None else (float(r[key]) if not isinstance(r[key], list) else [float(x) for x in r[key]])
    out = {"prompts": len(setup.prompts), "decoder_prompts": len(setup.decoder_prompts),
           "skipped_long_prompts": setup.skipped_prompts,
           "reference_decoder": {"ran": setup.reference_skip is None, "skip_reason": setup.reference_skip},
           "max_new_tokens": max_new_tokens, "export_dir": str(export_dir),
           "acceptance_length_eagle3lib": pick(summary, eagle3, "acceptance_length"),
           "tau_eagle3lib": pick(summary, eagle3, "tau"),
           "per_position_acceptance_eagle3lib": pick(summary, eagle3, "per_position_acceptance"),
           "speedup_eagle3lib_eagle3": pick(summary, eagle3, "speedup"),
           "speedup_eagle3lib_ngram": pick(summary, ngram, "speedup"),
           "acceptance_length_eagle3lib_ngram": pick(summary, ngram, "acceptance_length"),
           "lossless_eagle3lib": (str(row_of(summary, eagle3)["lossless"])
                                  if row_of(summary, eagle3) is not None else None),
           "eagle3lib": table_metrics(summary),
           "verdict": eagle3_verdict(summary, vllm_summary, eagle3=eagle3, ngram=ngram,
                                     drafters={n: d["mode"] for n, d in (drafters or {}).items()})}
    if vllm_summary is not None and not vllm_summary.empty:
        out.update(acceptance_length_vllm=pick(vllm_summary, eagle3, "acceptance_length"),
                   per_position_acceptance_vllm=pick(vllm_summary, eagle3, "per_position_acceptance"),
                   speedup_vllm_eagle3=pick(vllm_summary, eagle3, "speedup"),
                   speedup_vllm_ngram=pick(vllm_summary, ngram, "speedup"),
                   acceptance_length_vllm_ngram=pick(vllm_summary, ngram, "acceptance_length"),
                   vllm=table_metrics(vllm_summary))
    else:
        out.update(acceptance_length_vllm=None, speedup_vllm_eagle3=None, speedup_vllm_ngram=None)
    if breadth is not None:
        out["breadth"] = breadth
    if drafters is not None:
        out["drafters"] = drafters
    if run_dir is not None and k is not None:
        trained = read_metrics(Path(run_dir) / "metrics.json").get("train", {})
        out["export_check"] = export_check(out["acceptance_length_vllm"],
                                           trained.get("eval_acceptance_replayed_decode_k"),
                                           trained.get("eval_decode_k"), k)
    if run_dir is not None:
        update_metrics(run_dir, "eval", out)
    return out


def table_metrics(summary) -> dict:
    """{method: headline numbers} of a summary table, for metrics.json."""
    out = {}
    for _, r in summary.iterrows():
        out[r["method"]] = {"k": int(r["k"]), "tokens_per_s": float(r["tokens_per_s"]),
                            "speedup": float(r["speedup"]), "acceptance_length": float(r["acceptance_length"]),
                            "per_position_acceptance": [float(x) for x in r["per_position_acceptance"]]}
    return out


def trained_drafter_dir(layout: RunLayout) -> Path:
    """The run's trained drafter (layout.final), or a clear error telling the user to train first."""
    final = layout.final
    if not (final / "config.json").is_file() or not (final / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{final}: no trained drafter (config.json + model.safetensors). Run notebooks/04_train.ipynb "
            "for this run first (or `eagle3 run` with the same params); 05_eval evaluates the run's own drafter.")
    return final


# ---------------------------------------------------------------------------------------------
# Public drafters beside the trained one (eval.drafters): read and checked before any engine starts
# ---------------------------------------------------------------------------------------------


def drafter_mode_name(name: str, k: int) -> str:
    """The vLLM mode of public drafter `name` at k drafts a round (stage_times.eval_modes counts it)."""
    return f"drafter-{name}_k{k}"


def drafter_modes(drafters: dict, k: int) -> dict:
    """{public drafter name: its vLLM mode name} (verdict.eagle3_verdict's `drafters`)."""
    return {name: drafter_mode_name(name, k) for name in drafters}


def public_drafter_dirs(params) -> dict:
    """{name: folder} of eval.drafters, in profile order (a relative path, possible only through
    load_params overrides, is read like a profile path). Raises FileNotFoundError naming
    eval.drafters[i].path where a folder or its config.json is missing."""
    out = {}
    for i, item in enumerate(params.eval.drafters):
        folder = resolve_path(item["path"])
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"eval.drafters[{i}].path: {folder} holds no config.json (drafter "
                                    f"{item['name']!r}); put the drafter's folder there or fix the path in the profile")
        out[item["name"]] = folder
    return out


def check_eval_drafters(params, final_dir, target_dir=None, device: Optional[str] = None) -> dict:
    """05's drafter checks, run before any export, target load or engine: the run's own drafter
    (`final_dir`, train/final/) must name the layers its hidden states were extracted at
    (params.aux_layer_ids()) inside the target's, and every public drafter of eval.drafters must fit
    the target (drafters.check_drafter: sizes, vocabulary, aux layer ids, MLA on a CPU). Returns
    {name: DrafterInfo} of the public drafters; raises drafters.DrafterMismatch (or
    DrafterFormatError / FileNotFoundError) naming the folder, the field and the fix."""
    target_dir = target_dir if target_dir is not None else target_path(params)
    check_drafter(read_drafter(final_dir), target_dir, params.aux_layer_ids(), device=device)
    infos = {name: read_drafter(folder) for name, folder in public_drafter_dirs(params).items()}
    for info in infos.values():
        check_drafter(info, target_dir, device=device)
    return infos


DRAFTER_COLUMNS = ("format", "architecture", "hidden_size", "draft_vocab_size", "num_layers", "aux_layer_ids",
                   "aux_convention", "has_embed_tokens", "has_d2t", "norm_before_residual", "rope_type", "path")


def drafters_table(infos: dict) -> pd.DataFrame:
    """One row per public drafter: what its folder says (DrafterInfo), for the notebook."""
    rows = [(name, info.summary()) for name, info in infos.items()]
    return pd.DataFrame([{"name": name, **{c: about[c] for c in DRAFTER_COLUMNS}} for name, about in rows])


def drafters_metrics(vllm_summary, infos: dict, eagle3: str, k: int) -> dict:
    """The "drafters" key of the 05_eval section: per public drafter, what its folder says, its vLLM
    numbers (None where it has no row) and the trained drafter against it (verdict.compare_drafters)."""
    trained = row_of(vllm_summary, eagle3)
    out = {}
    for name, info in infos.items():
        mode_name = drafter_mode_name(name, k)
        r = row_of(vllm_summary, mode_name)
        about = info.summary()
        entry = {"mode": mode_name, **{c: about[c] for c in DRAFTER_COLUMNS}, "notes": about["notes"],
                 "measured": r is not None}
        if r is not None:
            entry.update(k=int(r["k"]), tokens_per_s=float(r["tokens_per_s"]), speedup=float(r["speedup"]),
                         acceptance_length=float(r["acceptance_length"]),
                         per_position_acceptance=[float(x) for x in r["per_position_acceptance"]],
                         same_output_as_plain=str(r.get("same_output_as_plain", "n/a")))
            entry["trained_vs_public"] = compare_drafters(trained, r) if trained is not None else None
        entry["verdict"] = " ".join(drafter_verdict(vllm_summary, eagle3, {name: mode_name}))
        out[name] = entry
    return out
