"""One page per run, and one table across runs.

    write_index(run_dir)              # outputs/<run>/index.html (+ index.md), rewritten after every stage
    table, diff = compare_runs([run_a, run_b])   # headline metrics per run, params that differ
    plot_training_curves([run_a, run_b])          # held-out acceptance and loss against step

Both read only what the stages leave in the run folder: metrics.json (one section per stage, and
the runner's `runner` section with stage wall times, git commit and machine), params.yaml (the
resolved profile the runner wrote), train/history.json (per-step training records). A partial run
gets a partial page: what a stage has not written yet is shown as "-".
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import yaml

from .files import atomic_write_bytes, read_json, read_metrics
from .layout import RunLayout
from .params import cpu_flags, cpu_has_native_bf16

# Stage -> notebook stem, in pipeline order (the runner's STAGES, without the file suffix).
NOTEBOOKS = {"research": "00_research", "ngram": "01_ngram_baseline", "data": "02_data",
             "extract": "03_extract", "train": "04_train", "eval": "05_eval", "scaling": "06_scaling"}

OPTIONAL_NOTEBOOKS = ("scaling",)   # studies: run only when asked (runner.OPTIONAL_STAGES), listed only once run

# The headline numbers: (metrics section, key, label with unit). One name per quantity:
# "acceptance length" = tokens emitted per target forward (1 + accepted drafts), the number
# EAGLE papers call tau; "speedup" = decode tokens/s over plain decoding on the same prompts.
HEADLINES = [
    ("data", "train_conversations", "train chats"),
    ("data", "train_tokens", "train tokens"),
    ("data", "coverage_eval", "draft-vocab coverage of held-out tokens (fraction)"),
    ("extract", "tokens_per_s", "extraction (tokens/s)"),
    ("extract", "bytes_per_token", "cache (bytes/token)"),
    ("extract", "decisive_argmax_agreement", "cache fidelity: top-1 agreement (fraction)"),
    ("train", "steps", "training steps"),
    ("train", "train_tokens_per_s", "training (tokens/s)"),
    ("train", "final_loss", "final training loss"),
    ("train", "eval_acceptance_estimate", "held-out acceptance length, estimated"),
    ("train", "eval_acceptance_replayed", "held-out acceptance length, replayed"),
    ("ngram", "acceptance_length_vllm_ngram", "n-gram acceptance length (vLLM)"),
    ("ngram", "speedup_vllm_ngram", "n-gram speedup over plain (vLLM, x)"),
    ("eval", "acceptance_length_eagle3lib", "EAGLE-3 acceptance length (eagle3lib)"),
    ("eval", "acceptance_length_vllm", "EAGLE-3 acceptance length (vLLM)"),
    ("eval", "speedup_vllm_eagle3", "EAGLE-3 speedup over plain (vLLM, x)"),
    ("eval", "speedup_vllm_ngram", "n-gram speedup over plain (vLLM, x, same run as EAGLE-3)"),
    ("eval", "lossless_eagle3lib", "EAGLE-3 output = target greedy (eagle3lib)"),
]


# ---- what the runner records --------------------------------------------------------------
def git_commit(repo: Path) -> Optional[str]:
    """The checkout's commit (with "+dirty" when files differ), or None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine_info() -> dict:
    """CPU model, whether bf16 is native (what `dtype: auto` keys on), cores, and the GPUs torch sees."""
    import torch  # heavy; only the runner's record needs it
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {"cpu": model or platform.processor(), "cpu_native_bf16": cpu_has_native_bf16(flags),
            "cpu_isa": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")),
            "cores": _cores(), "gpus": gpus, "torch": torch.__version__}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ---- one run -------------------------------------------------------------------------------
def load_run(run_dir) -> dict:
    """{name, metrics, params, history} of a run folder; missing files read as empty."""
    layout = RunLayout(run_dir)
    metrics = read_metrics(layout.metrics)
    params = yaml.safe_load(layout.params.read_text()) if layout.params.is_file() else {}
    history = read_json(layout.history) if layout.history.is_file() else []
    return {"name": layout.root.name, "metrics": metrics, "params": params or {}, "history": history,
            "tensorboard": layout.tensorboard.is_dir(),
            "explorer": (layout.eval_work("explorer") / "explorer.html").is_file(),
            "executed": {f.name for stem in NOTEBOOKS.values()
                         for f in (layout.notebook(stem), layout.notebook(stem).with_suffix(".html")) if f.is_file()}}


def headline(run: dict) -> str:
    """The page's first line: the drafter in vLLM at the profile's k (acceptance length, speedup over
    plain and over n-gram in the same engines' run), the run's wall time, the verdict's first line."""
    m, k = run["metrics"], (run["params"].get("eval") or {}).get("k", "?")
    ev, wall = m.get("eval", {}), sum((m.get("runner", {}).get("stage_seconds") or {}).values())
    time = f" Stages' wall time so far: {wall / 60:.1f} min." if wall else ""
    eagle3, ngram = ev.get("speedup_vllm_eagle3"), ev.get("speedup_vllm_ngram")
    if eagle3 is None:
        return f"**EAGLE-3 not measured in vLLM yet** (05_eval has not run, or without vLLM).{time}"
    versus = f", {eagle3 / ngram:.2f}x n-gram's ({ngram:.2f}x plain)" if ngram else ""
    lines = (ev.get("verdict") or "").splitlines()
    verdict = next((v for v in lines if v.startswith("vLLM: EAGLE-3")), None) or \
        next((v for v in lines if v.startswith("vLLM:")), None) or (lines[0] if lines else "")
    return (f"**EAGLE-3 in vLLM at k = {k}: acceptance length {fmt(ev.get('acceptance_length_vllm'))}, "
            f"{eagle3:.2f}x plain decoding{versus}.**{time}" + (f" Verdict: {verdict}" if verdict else ""))


def headline_rows(metrics: dict) -> list:
    """[(stage, label, value)] for the HEADLINES that a run has (value None when missing)."""
    return [(section, label, metrics.get(section, {}).get(key)) for section, key, label in HEADLINES]


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value and abs(value) < 1e-3:
            return f"{value:.3g}"                 # e.g. a threshold of 1e-08, not "0.000"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _img(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _plots(run: dict) -> list:
    """The key plots as <img> tags: training curve, acceptance per position, speed bars."""
    import matplotlib  # heavy; only the page's plots need it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = []
    if run["history"]:
        fig = plot_training_curves([run], title="training")
        out.append(_img(fig))
        plt.close(fig)
    ev = run["metrics"].get("eval", {})
    per_pos = {k: ev.get(f"per_position_acceptance_{k}") for k in ("eagle3lib", "vllm")}
    per_pos = {k: v for k, v in per_pos.items() if v}
    if per_pos:
        fig, ax = plt.subplots(figsize=(5, 3))
        for name, rates in per_pos.items():
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
        ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="EAGLE-3 acceptance per position")
        ax.legend()
        out.append(_img(fig))
        plt.close(fig)
    speeds = {f"{backend}: {method}": row.get("tokens_per_s")
              for section in ("ngram", "eval") for backend in ("eagle3lib", "vllm")
              for method, row in run["metrics"].get(section, {}).get(backend, {}).items()
              if section == "eval" or method != "plain"}
    speeds = {k: v for k, v in speeds.items() if v}
    if speeds:
        fig, ax = plt.subplots(figsize=(6, 0.35 * len(speeds) + 1))
        ax.barh(list(speeds), list(speeds.values()))
        ax.set(xlabel="decode tokens/s", title="speed by method")
        out.append(_img(fig))
        plt.close(fig)
    return out


def index_markdown(run: dict) -> str:
    """The page's text part (also written as index.md): headline table, stage times, verdicts."""
    m = run["metrics"]
    runner = m.get("runner", {})
    lines = [f"# Run `{run['name']}`", "", headline(run), ""]
    if runner:
        mach = runner.get("machine", {})
        lines += [f"- commit: `{runner.get('git_commit') or 'unknown'}`",
                  f"- machine: {mach.get('cpu', '?')} ({mach.get('cores', '?')} cores, native bf16: "
                  f"{fmt(mach.get('cpu_native_bf16'))}); GPUs: {', '.join(mach.get('gpus') or []) or 'none'}",
                  f"- params: `{runner.get('params_path', '?')}`", ""]
    lines += ["| stage | quantity | value |", "|---|---|---|"]
    lines += [f"| {s} | {label} | {fmt(v)} |" for s, label, v in headline_rows(m)]
    times, incomplete = runner.get("stage_seconds", {}), runner.get("incomplete", {})
    lines += ["", "| stage | notebook | wall time (s) |", "|---|---|---|"]
    for stage, stem in NOTEBOOKS.items():
        if stage in OPTIONAL_NOTEBOOKS and stage not in times:       # a study this run did not run
            continue
        why = f" (incomplete: {incomplete[stage]})".replace("|", "/") if stage in incomplete else ""
        lines.append(f"| {stage} | {_notebook_links(stem, run.get('executed', set()))} | "
                     f"{fmt(times.get(stage))}{why} |")
    if run.get("explorer"):
        lines += ["", "Where the drafter fails, token by token: "
                  "[the acceptance explorer](eval/explorer/explorer.html)."]
    if run.get("tensorboard"):
        lines += ["", "Training curves, live during a run: `tensorboard --logdir train/tensorboard` in this "
                  "folder ([event files](train/tensorboard/))."]
    for section in ("ngram", "eval", "scaling"):
        if m.get(section, {}).get("verdict"):
            lines += ["", f"## Verdict ({section})", "", "```", m[section]["verdict"], "```"]
    return "\n".join(lines) + "\n"


def _notebook_links(stem: str, executed: set) -> str:
    """A stage's executed notebook as links (html, ipynb) where the files exist, else its name."""
    html_link = f"[{stem}]({stem}.html)" if f"{stem}.html" in executed else stem
    return html_link + (f" ([ipynb]({stem}.ipynb))" if f"{stem}.ipynb" in executed else " (not run)")


def _markdown_to_html(md: str) -> str:
    """Just enough markdown for index_markdown's output: headings, bullets, tables, code, links."""
    out, in_code, in_table = [], False, False
    for line in md.splitlines():
        if line.startswith("```"):
            out.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            out.append(html.escape(line))
            continue
        if in_table and not line.startswith("|"):
            out.append("</table>")
            in_table = False
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            tag = "th" if not in_table else "td"
            if not in_table:
                out.append("<table>")
                in_table = True
            out.append("<tr>" + "".join(f"<{tag}>{_inline(c)}</{tag}>" for c in cells) + "</tr>")
        elif line.startswith("# "):
            out.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line.startswith("## "):
            out.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("- "):
            out.append(f"<div>&bull; {_inline(line[2:])}</div>")
        elif line:
            out.append(f"<p>{_inline(line)}</p>")
    if in_table:
        out.append("</table>")
    return "\n".join(out)


def _inline(text: str) -> str:
    text = html.escape(text)
    text = re.sub(r"`([^`]*)`", r"<code>\1</code>", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)
    return re.sub(r"\[([^\]]*)\]\(([^)]*)\)", r'<a href="\2">\1</a>', text)


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222;line-height:1.45}"
         "h1{border-bottom:2px solid #2e7d32}table{border-collapse:collapse;margin:.5em 0}"
         "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}th{background:#f0f4f0}"
         "pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}img{margin:8px;max-width:100%}"
         "summary{cursor:pointer;font-weight:bold}")


def write_index(run_dir) -> Path:
    """outputs/<run>/index.html (self-contained: plots inline) and index.md; returns the html path."""
    layout = RunLayout(run_dir)
    run = load_run(layout.root)
    md = index_markdown(run)
    params = yaml.safe_dump(run["params"], sort_keys=False) if run["params"] else "(params.yaml not written)"
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>eagle3lab run {html.escape(run['name'])}"
            f"</title><style>{STYLE}</style></head><body>{_markdown_to_html(md)}"
            f"<h2>Plots</h2>{''.join(_plots(run)) or '<p>none yet</p>'}"
            f"<details><summary>Params in use</summary><pre>{html.escape(params)}</pre></details>"
            f"</body></html>\n")
    atomic_write_bytes(layout.index_md, md.encode())
    atomic_write_bytes(layout.index_html, page.encode())
    return layout.index_html


# ---- several runs ----------------------------------------------------------------------------
def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare_runs(run_dirs: Sequence) -> tuple:
    """(metrics, params) DataFrames with one column per run: the headline numbers, and the
    resolved params that differ between the runs (run_name and description left out)."""
    import pandas as pd  # heavy; only comparisons need it
    runs = [load_run(d) for d in run_dirs]
    names = _unique_names(runs)
    metrics = pd.DataFrame({n: {f"{s}: {label}": fmt(v) for s, label, v in headline_rows(r["metrics"])}
                            for n, r in zip(names, runs)})
    flat = [_flatten(r["params"]) for r in runs]
    keys = sorted({k for f in flat for k in f} - {"run_name", "description"})
    differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    params = pd.DataFrame({n: {k: fmt(f.get(k)) for k in differ} for n, f in zip(names, flat)},
                          index=differ, columns=names)
    return metrics, params


def _unique_names(runs: list) -> list:
    names = [r["name"] for r in runs]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def markdown_table(df, index_label: str = "") -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join([index_label] + cols) + " |", "|" + "---|" * (len(cols) + 1)]
    lines += ["| " + " | ".join([str(i)] + [str(v) for v in row]) + " |" for i, row in zip(df.index, df.values)]
    return "\n".join(lines)


def plot_training_curves(runs: Sequence, title: str = "training curves", smooth: int = 20):
    """Training loss (smoothed, raw faint) and held-out acceptance estimate (points) against step.
    runs: run folders or load_run() dicts."""
    import matplotlib.pyplot as plt  # heavy; only plots need it
    runs = [r if isinstance(r, dict) else load_run(r) for r in runs]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, run in zip(_unique_names(runs), runs):
        steps = [h["step"] for h in run["history"]]
        loss = [h["loss"] for h in run["history"]]
        line, = ax_loss.plot(steps, moving_average(loss, smooth), label=name)
        ax_loss.plot(steps, loss, color=line.get_color(), alpha=0.2, linewidth=0.8)
        evals = [(h["step"], h["eval"]["acceptance_estimate"]) for h in run["history"] if "eval" in h]
        if evals:
            ax_acc.plot(*zip(*evals), marker="o", color=line.get_color(), label=name)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title=f"{title}: loss (smoothed; raw faint)")
    ax_acc.set(xlabel="optimizer step", ylabel="acceptance length (est.)", title="held-out acceptance estimate")
    ax_loss.legend()
    fig.tight_layout()
    return fig


def moving_average(values: list, window: int) -> list:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
