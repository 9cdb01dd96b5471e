"""Evaluation of plain, n-gram and EAGLE-3 decoding: eagle3lib's reference decoder and vLLM.

The notebooks (01_ngram_baseline, 05_eval) call these functions and only show the results:

    prompts = eval_prompts(P, run_dir, tokenizer)                  # held-out, chat template applied
    per_prompt = run_decoder_eval(target, prompts, methods, ...)   # eagle3lib: one row per (method, prompt)
    summary = summarize(per_prompt)                                # one row per method, speedup vs plain
    vllm_summary, raw = run_vllm_eval(P, target_dir, prompts, modes, workdir)
    text = verdict(summary, vllm_summary)                          # a sentence computed from the numbers

Rates are pooled over prompts (sums of tokens, seconds, accepted drafts), not averaged per prompt.
`tokens_per_s` is the DECODE rate (prefill and its first token excluded; speculative decoding
only speeds up decoding) and `speedup` its ratio to plain's; `e2e_tokens_per_s` includes prefill.
Acceptance length follows vLLM: 1 + accepted draft tokens / drafting rounds; tau = emitted
tokens / target forwards (prefill included). The prompts are pre-rendered token ids, so the
reference decoder and vLLM read exactly the same inputs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from .decode import (DecodeStats, Eagle3Proposer, NgramProposer, NoProposer, greedy_generate,
                     speculative_generate)

PLAIN = "plain"


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def render_prompt(tokenizer, messages: list) -> list:
    """Chat template with the generation prompt -> token ids."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def eval_prompts(P, run_dir, tokenizer, limit: Optional[int] = None) -> tuple:
    """Held-out prompts as ([{"id", "category", "input_ids"}], skipped): the first `limit`
    (default eval.num_prompts) of those with at most eval.max_prompt_tokens tokens; `skipped`
    counts the longer ones passed over."""
    from .data import load_eval_prompts
    limit = limit if limit is not None else P.eval.num_prompts
    cap = P.eval.max_prompt_tokens
    prompts, skipped = [], 0
    for r in load_eval_prompts(P, run_dir):
        ids = render_prompt(tokenizer, r["messages"])
        if cap is not None and len(ids) > cap:
            skipped += 1
            continue
        prompts.append({"id": r["id"], "category": r.get("category") or "all", "input_ids": ids})
        if len(prompts) == limit:
            break
    if not prompts:
        raise ValueError(f"no held-out evaluation prompt left ({skipped} longer than eval.max_prompt_tokens="
                         f"{cap}): check the data stage / eval.prompts_path / eval.max_prompt_tokens")
    return prompts, skipped


@dataclass
class EvalSetup:
    """What every evaluation needs, loaded once."""
    target_dir: Path
    target: object            # transformers causal LM in eval.dtype
    tokenizer: object
    prompts: list             # [{"id", "category", "input_ids"}]; vLLM runs these
    decoder_prompts: list     # the first eval.decoder_prompts of them: eagle3lib's decoder runs these
    skipped_prompts: int      # held-out prompts over eval.max_prompt_tokens
    eos: list                 # EOS ids (what vLLM stops on)


def load_eval_setup(P, run_dir, limit: Optional[int] = None) -> EvalSetup:
    """Target (eval.dtype), tokenizer and the held-out prompts (first eval.num_prompts)."""
    from .target import load_target, load_tokenizer, target_path
    tdir = target_path(P)
    tok = load_tokenizer(tdir, P.target.trust_remote_code)
    target = load_target(tdir, P.eval.dtype, trust_remote_code=P.target.trust_remote_code)
    prompts, skipped = eval_prompts(P, run_dir, tok, limit)
    return EvalSetup(tdir, target, tok, prompts, decoder_subset(P, prompts), skipped, eos_ids(tdir))


def decoder_subset(P, prompts: list) -> list:
    """The prompts eagle3lib's reference decoder runs: the first eval.decoder_prompts (None: all)."""
    return prompts[:P.eval.decoder_prompts]


def ngram_sweep(P) -> list:
    """(k, min_n, max_n) settings of the n-gram baseline: every k of eval.ngram_k with the profile's
    lookup lengths, plus a shorter maximum lookup (2) to show its effect."""
    lo, hi = P.eval.prompt_lookup_min, P.eval.prompt_lookup_max
    ranges = sorted({(min(lo, 2), 2), (lo, hi)}, key=lambda r: (r[1], r[0]))
    return [(k, a, b) for k in P.eval.ngram_k for a, b in ranges]


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
    import pandas as pd
    from tqdm.auto import tqdm
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
            "draft_s": s["draft_s"], "verify_s": s["verify_s"], "lossless": out == plain_out}


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
    import pandas as pd
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
    import pandas as pd
    rows = {r["method"]: {i + 1: x for i, x in enumerate(r["per_position_acceptance"])}
            for _, r in summary.iterrows() if r["method"] != PLAIN}
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.columns.name = "draft position"
    return df


# ---------------------------------------------------------------------------------------------
# vLLM (in a subprocess, see vllm_bench)
# ---------------------------------------------------------------------------------------------


def vllm_modes(ngram: Sequence[tuple] = (), eagle3_dir=None, k: Optional[int] = None) -> list:
    """vllm_bench modes: plain, each (k, min_n, max_n) n-gram setting, and eagle3 if a folder is given."""
    from .vllm_bench import mode
    modes = [mode("plain")]
    for nk, lo, hi in ngram:
        modes.append(mode("ngram", nk, name=ngram_name(nk, lo, hi), prompt_lookup_min=lo, prompt_lookup_max=hi))
    if eagle3_dir is not None:
        modes.append(mode("eagle3", k, name=f"eagle3_k{k}", model=str(eagle3_dir)))
    return modes


def run_vllm_eval(P, target_dir, prompts: list, modes: list, workdir, max_new_tokens: Optional[int] = None,
                  timeout: Optional[float] = None):
    """Run the modes in ONE vLLM subprocess. Returns (summary DataFrame, raw result dict).
    Uses the first eval.vllm_prompts prompts (None: all), dtype eval.vllm_dtype, T = eval.temperature."""
    import pandas as pd
    from .vllm_bench import run_vllm
    n = P.eval.vllm_prompts or len(prompts)
    spec = {"target": str(target_dir), "dtype": P.eval.vllm_dtype,
            "prompts": [p["input_ids"] for p in prompts[:n]],
            "max_new_tokens": max_new_tokens or P.eval.max_new_tokens,
            "temperature": P.eval.temperature, "seed": P.seed, "modes": modes}
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
# Verdicts: sentences computed from the numbers
# ---------------------------------------------------------------------------------------------

TIE = 0.05   # speedups within 5% of 1.0 count as "no measurable difference"


def speed_phrase(speedup: float) -> str:
    if speedup >= 1 + TIE:
        return f"{speedup:.2f}x faster than plain decoding"
    if speedup <= 1 - TIE:
        return f"SLOWER than plain decoding ({speedup:.2f}x, i.e. {1 / speedup:.2f}x the time)"
    return f"no measurable change versus plain decoding ({speedup:.2f}x)"


def _row_of(df, method: str):
    if df is None or df.empty:
        return None
    hit = df[df["method"] == method]
    return None if hit.empty else hit.iloc[0]


def method_sentences(summary, where: str) -> list:
    """One sentence per speculative method of a summary table."""
    out = []
    for _, r in summary.iterrows():
        if r["method"] == PLAIN:
            continue
        line = (f"{where}: {r['method']} is {speed_phrase(r['speedup'])}, "
                f"mean acceptance length {r['acceptance_length']:.2f} of at most {int(r['k']) + 1}")
        if r["accepted"] == 0 and r["speedup"] >= 1 + TIE:
            line += " (nothing was accepted, so the apparent gain is measurement noise)"
        out.append(line + f"; {int(r['new_tokens'])} tokens measured.")
    return out


def best_method(summary, prefix: str):
    """The row with the highest speedup among methods starting with `prefix` (None if none)."""
    rows = summary[summary["method"].str.startswith(prefix)]
    return None if rows.empty else rows.loc[rows["speedup"].idxmax()]


def ngram_verdict(summary, vllm_summary=None) -> str:
    """Per backend: the best n-gram setting and, honestly, whether it beats plain decoding."""
    lines = []
    for where, table in (("eagle3lib", summary), ("vLLM", vllm_summary)):
        if table is None or table.empty:
            continue
        best = best_method(table, "ngram")
        if best is None:
            continue
        if best["speedup"] <= 1 - TIE:
            head = f"{where}: n-gram is SLOWER than plain decoding in every setting tried"
        elif best["speedup"] < 1 + TIE:
            head = f"{where}: n-gram makes no measurable difference"
        else:
            head = f"{where}: n-gram speeds decoding up"
        lines.append(f"{head}; best {best['method']} at {best['speedup']:.2f}x plain "
                     f"({best['tokens_per_s']:.1f} vs {table.loc[table['method'] == PLAIN, 'tokens_per_s'].iloc[0]:.1f}"
                     f" decode tokens/s), acceptance length {best['acceptance_length']:.2f}.")
        lines += method_sentences(table, where)
    return "\n".join(lines)


def ngram_metrics(summary, vllm_summary, setup: "EvalSetup", max_new_tokens: int) -> dict:
    """The 01_ngram_baseline section of metrics.json."""
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
    return out


def eval_metrics(summary, vllm_summary, setup: "EvalSetup", export_dir, eagle3: str, ngram: str,
                 max_new_tokens: int) -> dict:
    """The 05_eval section of metrics.json."""
    def pick(table, method, key):
        r = _row_of(table, method)
        return None if r is None else (float(r[key]) if not isinstance(r[key], list) else [float(x) for x in r[key]])
    out = {"prompts": len(setup.prompts), "decoder_prompts": len(setup.decoder_prompts),
           "skipped_long_prompts": setup.skipped_prompts,
           "max_new_tokens": max_new_tokens, "export_dir": str(export_dir),
           "acceptance_length_eagle3lib": pick(summary, eagle3, "acceptance_length"),
           "tau_eagle3lib": pick(summary, eagle3, "tau"),
           "per_position_acceptance_eagle3lib": pick(summary, eagle3, "per_position_acceptance"),
           "speedup_eagle3lib_eagle3": pick(summary, eagle3, "speedup"),
           "speedup_eagle3lib_ngram": pick(summary, ngram, "speedup"),
           "acceptance_length_eagle3lib_ngram": pick(summary, ngram, "acceptance_length"),
           "lossless_eagle3lib": str(_row_of(summary, eagle3)["lossless"]) if _row_of(summary, eagle3) is not None else None,
           "eagle3lib": table_metrics(summary),
           "verdict": verdict(summary, vllm_summary, eagle3=eagle3, ngram=ngram)}
    if vllm_summary is not None and not vllm_summary.empty:
        out.update(acceptance_length_vllm=pick(vllm_summary, eagle3, "acceptance_length"),
                   per_position_acceptance_vllm=pick(vllm_summary, eagle3, "per_position_acceptance"),
                   speedup_vllm_eagle3=pick(vllm_summary, eagle3, "speedup"),
                   speedup_vllm_ngram=pick(vllm_summary, ngram, "speedup"),
                   acceptance_length_vllm_ngram=pick(vllm_summary, ngram, "acceptance_length"),
                   vllm=table_metrics(vllm_summary))
    else:
        out.update(acceptance_length_vllm=None, speedup_vllm_eagle3=None, speedup_vllm_ngram=None)
    return out


def trained_drafter_dir(run_dir) -> Path:
    """<run>/train/final/, or a clear error telling the user to train first."""
    final = Path(run_dir) / "train" / "final"
    if not (final / "config.json").is_file() or not (final / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{final}: no trained drafter (config.json + model.safetensors). Run notebooks/04_train.ipynb "
            "for this run first (or `eagle3 run` with the same params); 05_eval evaluates the run's own drafter.")
    return final


def verdict(summary, vllm_summary=None, eagle3: Optional[str] = None, ngram: Optional[str] = None) -> str:
    """A verdict computed from the numbers: per-backend speed of every method versus plain, and,
    when both are given, EAGLE-3 versus n-gram and the eagle3lib/vLLM acceptance agreement."""
    lines = method_sentences(summary, "eagle3lib")
    if vllm_summary is not None and not vllm_summary.empty:
        lines += method_sentences(vllm_summary, "vLLM")
    for name, table in (("vLLM", vllm_summary), ("eagle3lib", summary)):
        e, n = _row_of(table, eagle3) if eagle3 else None, _row_of(table, ngram) if ngram else None
        if e is not None and n is not None:
            rel = e["tokens_per_s"] / n["tokens_per_s"] if n["tokens_per_s"] > 0 else float("nan")
            word = "beats" if rel >= 1 + TIE else ("loses to" if rel <= 1 - TIE else "ties with")
            note = (" Neither had a draft accepted: the difference is drafting overhead and noise."
                    if e["accepted"] == 0 and n["accepted"] == 0 else "")
            lines.append(f"{name}: EAGLE-3 {word} n-gram ({rel:.2f}x its tokens/s; acceptance length "
                         f"{e['acceptance_length']:.2f} vs {n['acceptance_length']:.2f}).{note}")
            break
    if eagle3 and vllm_summary is not None:
        a, b = _row_of(summary, eagle3), _row_of(vllm_summary, eagle3)
        if a is not None and b is not None:
            rel = abs(a["acceptance_length"] - b["acceptance_length"]) / a["acceptance_length"]
            agree = "agree" if rel <= 0.15 else "DISAGREE"
            lines.append(f"Acceptance length eagle3lib {a['acceptance_length']:.2f} vs vLLM "
                         f"{b['acceptance_length']:.2f}: they {agree} ({rel:.0%} apart; the prompt sets may differ"
                         f" in size).")
    lossy = [r["method"] for _, r in summary.iterrows() if r["method"] != PLAIN and
             r["lossless"].split("/")[0] != r["lossless"].split("/")[1]]
    if lossy:
        lines.append(f"Outputs differ from plain greedy for {', '.join(lossy)} on some prompts "
                     "(expected only in bf16 or at T > 0; in fp32 at T=0 this would be a bug).")
    return "\n".join(lines)


def table_metrics(summary) -> dict:
    """{method: headline numbers} of a summary table, for metrics.json."""
    out = {}
    for _, r in summary.iterrows():
        out[r["method"]] = {"k": int(r["k"]), "tokens_per_s": float(r["tokens_per_s"]),
                            "speedup": float(r["speedup"]), "acceptance_length": float(r["acceptance_length"]),
                            "per_position_acceptance": [float(x) for x in r["per_position_acceptance"]]}
    return out


def plot_speed_and_acceptance(summary, vllm_summary=None, title: str = ""):
    """Bar charts: speedup versus plain (eagle3lib and vLLM) and mean acceptance length."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    tables = [("eagle3lib", summary)] + ([("vLLM", vllm_summary)] if vllm_summary is not None else [])
    width = 0.8 / len(tables)
    methods = list(dict.fromkeys(m for _, t in tables for m in t["method"]))
    for j, (name, t) in enumerate(tables):
        t = t.set_index("method")
        xs = [i + j * width for i, m in enumerate(methods) if m in t.index]
        ms = [m for m in methods if m in t.index]
        axes[0].bar(xs, [t.loc[m, "speedup"] for m in ms], width, label=name)
        axes[1].bar(xs, [t.loc[m, "acceptance_length"] for m in ms], width, label=name)
    for ax, label in zip(axes, ("speedup vs plain (tokens/s ratio)", "mean acceptance length")):
        ax.set_xticks([i + width * (len(tables) - 1) / 2 for i in range(len(methods))])
        ax.set_xticklabels(methods, rotation=20)
        ax.set_ylabel(label)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_per_position(tables: dict, title: str = "per-position acceptance"):
    """tables: {label: per_position_table DataFrame}; one line per (label, method)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, t in tables.items():
        for method, row in t.iterrows():
            ax.plot(list(row.index), list(row.values), marker="o", label=f"{label}: {method}")
    ax.set_xlabel("draft position")
    ax.set_xticks(sorted({int(c) for t in tables.values() for c in t.columns}))
    ax.set_ylabel("acceptance rate (accepted there / rounds)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def eos_ids(target_dir) -> list:
    """EOS token ids of a checkpoint (generation_config, else config): what vLLM stops on."""
    import json
    target_dir = Path(target_dir)
    for name in ("generation_config.json", "config.json"):
        f = target_dir / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
