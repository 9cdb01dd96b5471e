"""The data-scaling study: held-out acceptance against the number of regenerated training chats.

06_scaling trains one drafter per size N of `scaling.sizes` on N of this run's cached training
chats (train.max_sequences = N: the first N of a seeded permutation, so the 500-chat subset lies
inside the 1,000-chat one), each for `scaling.epochs` epochs with the profile's other train settings
(train.max_steps and the time budget off: matched epochs, so a point's step count grows with N and
its cosine schedule spans its own steps; its warmup is the same share of its own steps as the main
run's, so every point leaves warmup). Every point is scored on the same held-out cache
(`acceptance_replayed`: chain decoding at k = train.ttt_steps replayed on each held-out answer,
objective.evaluate) and, with scaling.vllm, in one vLLM subprocess (one engine per point, plus
plain decoding and n-gram at eval.k for the speed ratios) on the held-out prompts 05_eval uses.
minutes_curve puts each point's EAGLE-3 / n-gram tokens/s against the minutes it cost (its share of
02's and 03's stage times plus its own training).

A point is an ordinary training run folder, outputs/<run>/scaling/n<N>/ (layout.scaling_point):
data/ and hidden/ are relative links to the run's own, train/ and export/ are the point's. The
trainer's checkpoints make the study resumable: a rerun continues the unfinished point and
re-reads the finished ones.

The fit (fit_log_curve): tau(N) = a + b ln N by least squares, so b ln 2 is what one doubling of
the chats buys. It is an empirical local fit over the measured range: acceptance length is bounded
by k + 1 and must flatten eventually, so chats_for() extrapolations beyond the largest measured N
are optimistic and are labelled as extrapolations.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd

from . import evaluate as ev
from .cache import HiddenCache
from .export import export_vllm
from .files import read_metrics, update_metrics
from .layout import RunLayout
from .online import HiddenStateServer, OnlineCache, online_train_cache, serving
from .params import MAX_WARMUP_FRACTION, Params, ParamsError, TrainParams
from .progress import relay
from .target import load_tokenizer, target_path
from .train import schedule, train
from .vllm_bench import mode


def point_warmup_fraction(train_params: TrainParams, main_steps: Optional[int] = None) -> float:
    """A point's warmup as a share of its own planned steps: train.warmup_fraction, else the main
    run's share (warmup_steps over its planned steps: max_steps, else main_steps), at most
    MAX_WARMUP_FRACTION."""
    if train_params.warmup_fraction is not None:
        return train_params.warmup_fraction
    planned = train_params.max_steps or main_steps
    if planned is None:
        raise ValueError("a scaling point's warmup needs the main run's planned steps (train.max_steps, or "
                         "main_steps from the run's cache: main_run_steps), or set train.warmup_fraction")
    return min(MAX_WARMUP_FRACTION, train_params.warmup_steps / planned)


def study_cache(params: Params, layout: RunLayout) -> HiddenCache | OnlineCache:
    """The run's training split the study's points train on (check_study first): 03's cache, or
    online its lengths (each point's states then come from the study's one server)."""
    check_study(params)
    if params.extract.mode == "online":
        return online_train_cache(params, layout, None)
    return HiddenCache(layout.hidden("train"))


def check_study(params: Params) -> None:
    """A clear error when there is no study to run (scaling.sizes empty)."""
    if not params.scaling.sizes:
        raise ParamsError("scaling.sizes is empty, so there is no study to run; set e.g. "
                          "scaling: {sizes: [250, 500, 1000, 2000]} (at most data.num_train)")


def main_run_steps(params: Params, layout: RunLayout) -> int:
    """The main run's planned optimizer steps (train.schedule on the run's training cache, its ranks)."""
    world = params.train.nproc if params.train.distributed != "none" else 1
    return schedule(study_cache(params, layout), params.train, params.seed, world)[3]


def point_params(params: Params, n: int, main_steps: Optional[int] = None, **train_changes) -> Params:
    """The profile of the point with n training chats: train.max_sequences n, scaling.epochs
    epochs, no max_steps, no time budget (a point always finishes its epochs), the main run's warmup
    share (point_warmup_fraction; main_steps: main_run_steps, needed without max_steps and
    warmup_fraction); train_changes (e.g. loss="lk_hybrid") make a variant of the recipe."""
    train_params = dataclasses.replace(params.train, max_sequences=n, epochs=params.scaling.epochs, max_steps=None,
                                       time_budget_minutes=None,
                                       warmup_fraction=point_warmup_fraction(params.train, main_steps),
                                       **train_changes)
    return dataclasses.replace(params, train=train_params)


def point_layout(layout: RunLayout, n: int, variant: str = "") -> RunLayout:
    """The point's run folder with data/ and hidden/ linked (relative links) to the run's own."""
    root = layout.scaling_point(n, variant)
    root.mkdir(parents=True, exist_ok=True)
    for name, target in (("data", layout.data), ("hidden", layout.hidden_root)):
        link = root / name
        rel = os.path.relpath(target, root)
        if link.is_symlink() and os.readlink(link) == rel:
            continue
        if link.exists() or link.is_symlink():
            raise FileExistsError(f"{link}: expected a link to {rel}; remove it and rerun 06_scaling")
        link.symlink_to(rel, target_is_directory=True)
    return RunLayout(root)


def train_point(params: Params, layout: RunLayout, n: int, progress: bool = True, variant: str = "",
                server: Optional[HiddenStateServer] = None, **train_changes) -> dict:
    """Train (or resume, or re-read) the point with n chats; returns one row of the study table.
    variant + train_changes: the same point with a changed recipe, in its own folder. server:
    extract.mode online's server, shared by the study's points (one start for all)."""
    if bool(variant) != bool(train_changes):
        raise ValueError("a variant needs both a name and its train changes (and the study's points neither)")
    point = point_layout(layout, n, variant)
    main_steps = (None if params.train.max_steps or params.train.warmup_fraction is not None
                  else main_run_steps(params, layout))
    summary = train(point_params(params, n, main_steps, **train_changes), point.root, progress=progress,
                    links_within=layout.root, server=server)
    ev = summary["eval"] or {}
    return {"chats": n, "steps": summary["steps"], "epochs": round(summary["epochs_done"], 3),
            "train_sequences": summary["train_sequences"],
            "acc0": ev.get("acc", [float("nan")])[0], "acceptance_estimate": ev.get("acceptance_estimate"),
            "acceptance_replayed": ev.get("acceptance_replayed"), "replay_rounds": ev.get("replay_rounds"),
            "tokens_per_s": summary["tokens_per_s_this_run"],
            "train_s": summary.get("train_seconds_this_run"), "final_dir": summary["final_dir"]}


def run_study(params: Params, layout: RunLayout, progress: bool = True, log: Callable = relay) -> pd.DataFrame:
    """Every point of scaling.sizes, smallest first; one row per point (train_point). log: where the
    per-point lines go (progress.relay: the terminal under the headless runner)."""
    check_study(params)
    if params.data.num_train is not None and params.scaling.sizes[-1] > params.data.num_train:
        raise ValueError(f"scaling.sizes: the largest size {params.scaling.sizes[-1]} exceeds data.num_train="
                         f"{params.data.num_train}: the study trains on subsets of this run's training chats; "
                         "lower the sizes or grow data.num_train (and rerun 02 and 03)")
    rows = []
    with serving(params, layout) as server:              # extract.mode online: one server for every point
        for n in params.scaling.sizes:
            log(f"[scaling] point n={n}: {params.scaling.epochs} epochs on {n} chats")
            rows.append(train_point(params, layout, n, progress, server=server))
            log(f"[scaling] point n={n}: acceptance replayed {rows[-1]['acceptance_replayed']:.3f} "
                f"after {rows[-1]['steps']} steps")
    return pd.DataFrame(rows)


def export_points(params: Params, layout: RunLayout, table: pd.DataFrame, target_dir) -> dict:
    """{chats: export folder} for vLLM (speculators layout, k = eval.k), one per trained point."""
    return {int(row.chats): export_point(params, row.final_dir, target_dir) for row in table.itertuples()}


def export_point(params: Params, final_dir, target_dir):
    """A point's vLLM export beside its train/ folder (speculators layout, k = eval.k)."""
    point = RunLayout(Path(final_dir).parent.parent)         # <point>/train/final -> <point>
    return export_vllm(final_dir, point.export, target_dir, layout="speculators", k=params.eval.k)


def vllm_mode_name(n: int, k: int) -> str:
    return f"eagle3_n{n}_k{k}"


def vllm_compare(params: Params, layout: RunLayout, exports: dict, workdir, limit: Optional[int] = None) -> tuple:
    """Plain decoding, n-gram at eval.k (named evaluate.ngram_name, as 05 names it), then each export
    {mode name: folder} as eagle3 at k = eval.k, in ONE vLLM subprocess on the run's held-out
    prompts (the first `limit`, else eval.vllm_prompts) -> (summary DataFrame, raw result, the
    same-output report). At T = 0 in fp32 every output must equal plain's:
    evaluate.check_vllm_same_output raises naming the prompt."""
    tdir = target_path(params)
    prompts, _ = ev.eval_prompts(params, layout.root, load_tokenizer(tdir, params.target.trust_remote_code))
    prompts = prompts[:limit] if limit else prompts
    modes = ev.vllm_modes([ngram_setting(params)])
    modes += [mode("eagle3", params.eval.k, name=name, model=str(d)) for name, d in exports.items()]
    summary, raw = ev.run_vllm_eval(params, tdir, prompts, modes, workdir)
    return summary, raw, ev.check_vllm_same_output(raw, prompts, params)


def ngram_setting(params: Params) -> tuple:
    """(k, prompt_lookup_min, prompt_lookup_max) of the study's n-gram row: eval.k, as 05 runs it."""
    return params.eval.k, params.eval.prompt_lookup_min, params.eval.prompt_lookup_max


# ==== what each point cost ======================================================================
def minutes_curve(params: Params, layout: RunLayout, table: pd.DataFrame, vllm_table: pd.DataFrame,
                  vllm_summary: pd.DataFrame, cached_chats: int) -> pd.DataFrame:
    """One row per point: the minutes it cost and its EAGLE-3 / n-gram vLLM tokens/s.

    minutes = (02's + 03's stage seconds) x chats / cached_chats (its share of regenerating and
    extracting the run's chats) + its own training seconds (train_s: this process's share when a
    point was resumed). 02's and 03's seconds: the run's metrics.json (runner.stage_seconds; absent
    when the notebooks ran outside `eagle3 run`: `minutes` then counts training only, `data_minutes`
    shows 0).
    vllm_table: the study's eagle3 rows with their chats; vllm_summary: the run's whole summary,
    which holds the n-gram row."""
    ngram_method = ev.ngram_name(*ngram_setting(params))
    ngram = vllm_summary.loc[vllm_summary["method"] == ngram_method]
    if len(ngram) != 1:
        raise ValueError(f"the vLLM summary has no single {ngram_method} row "
                         "(vllm_compare runs n-gram beside the points)")
    ngram_tps = float(ngram["tokens_per_s"].iloc[0])
    stage_seconds = read_metrics(layout.metrics).get("runner", {}).get("stage_seconds", {})
    upstream_s = sum(float(stage_seconds.get(stage, 0.0)) for stage in ("data", "extract"))
    by_chats = vllm_table.set_index("chats")
    rows = []
    for row in table.itertuples():
        share, train_s = upstream_s * row.chats / cached_chats, row.train_s or 0.0
        eagle = by_chats.loc[row.chats]
        rows.append({"chats": int(row.chats), "data_minutes": share / 60, "train_minutes": train_s / 60,
                     "minutes": (share + train_s) / 60,
                     "eagle3_tokens_per_s": float(eagle["tokens_per_s"]), "ngram_tokens_per_s": ngram_tps,
                     "vs_ngram": float(eagle["tokens_per_s"]) / ngram_tps,
                     "acceptance_length": float(eagle["acceptance_length"])})
    return pd.DataFrame(rows)


def plot_minutes(curve: pd.DataFrame):
    """EAGLE-3 / n-gram vLLM tokens/s against the minutes each point cost (1.0: a tie with n-gram)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(curve["minutes"], curve["vs_ngram"], "o-", color="C2")
    for row in curve.itertuples():
        ax.annotate(f"{row.chats} chats", (row.minutes, row.vs_ngram), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("minutes spent (regeneration + extraction share + training)")
    ax.set_ylabel("EAGLE-3 / n-gram tokens/s (vLLM)")
    ax.set_title("What the minutes buy: EAGLE-3 against the free baseline")
    fig.tight_layout()
    return fig


# ==== the fitted curve ==========================================================================
def fit_log_curve(chats, acceptance) -> dict:
    """Least squares tau = a + b ln N over the points -> {a, b, r2, per_doubling (b ln 2), n_min, n_max}."""
    x = np.log(np.asarray(chats, dtype=float))
    y = np.asarray(acceptance, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError(f"a fit needs at least two distinct sizes, got {list(chats)}")
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    ss_res, ss_tot = float(((y - pred) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {"a": float(a), "b": float(b), "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
            "per_doubling": float(b * math.log(2)), "n_min": float(np.exp(x.min())), "n_max": float(np.exp(x.max()))}


def predict(fit: dict, chats) -> np.ndarray:
    return fit["a"] + fit["b"] * np.log(np.asarray(chats, dtype=float))


MAX_CHATS = 1e12   # beyond this a fitted curve is "not reached": flat for any practical purpose


def chats_for(fit: dict, acceptance: float, k: int) -> Optional[float]:
    """The chats at which the fitted curve reaches `acceptance` (None: never, i.e. a flat or falling
    curve, one that needs more than MAX_CHATS, or a target at or above k + 1, which no drafter reaches)."""
    if fit["b"] <= 0 or acceptance >= k + 1:
        return None
    log_n = (acceptance - fit["a"]) / fit["b"]
    return None if log_n > math.log(MAX_CHATS) else float(math.exp(log_n))


def targets_table(fit: dict, targets, k: int) -> pd.DataFrame:
    """For each target acceptance length: the chats the curve needs and whether that is inside the
    measured range (interpolation) or beyond it (an optimistic extrapolation, see the module doc)."""
    rows = []
    for tau in targets:
        n = chats_for(fit, tau, k)
        where = ("not reached by the fitted curve" if n is None else "inside the measured range"
                 if fit["n_min"] <= n <= fit["n_max"] else "below the measured range" if n < fit["n_min"]
                 else f"extrapolated {n / fit['n_max']:.1f}x beyond the largest point")
        rows.append({"acceptance length": tau, "chats (fitted)": None if n is None else round(n), "status": where})
    return pd.DataFrame(rows)


def plot_curve(table: pd.DataFrame, fit: dict, targets=(), vllm: Optional[pd.DataFrame] = None,
               vllm_fit: Optional[dict] = None, k: Optional[int] = None):
    """Acceptance length against training chats (log axis): the measured points, the fitted curve
    over the measured range (solid) and up to the largest target's chats (dashed)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(table["chats"], table["acceptance_replayed"], "o", color="C0", label="replayed (held-out cache)")
    span = [fit["n_min"], fit["n_max"]]
    ends = [chats_for(fit, t, k or 10**9) for t in targets]
    far = max([fit["n_max"]] + [n for n in ends if n is not None and n < 1e9])
    xs = np.geomspace(span[0], span[1], 50)
    ax.plot(xs, predict(fit, xs), "-", color="C0", label=f"fit a + b ln N (b ln 2 = {fit['per_doubling']:+.3f})")
    if far > span[1]:
        xe = np.geomspace(span[1], far, 50)
        ax.plot(xe, predict(fit, xe), "--", color="C0", alpha=0.6, label="extrapolation (optimistic)")
    if vllm is not None and len(vllm):
        ax.plot(vllm["chats"], vllm["acceptance_length"], "s", color="C1", label="vLLM (held-out prompts)")
        if vllm_fit is not None:
            ax.plot(xs, predict(vllm_fit, xs), "-", color="C1", alpha=0.8,
                    label=f"vLLM fit (b ln 2 = {vllm_fit['per_doubling']:+.3f})")
    for t in targets:
        ax.axhline(t, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("regenerated training chats N (log scale)")
    ax.set_ylabel("acceptance length")
    ax.set_title("Held-out acceptance against training data (matched epochs)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def record_study(params: Params, layout: RunLayout, table: pd.DataFrame, fit: dict,
                 vllm_table: Optional[pd.DataFrame] = None, vllm_fit: Optional[dict] = None,
                 curve: Optional[pd.DataFrame] = None) -> str:
    """metrics.json's "scaling" section (the points' acceptance, both fits, the chats each target
    needs by the vLLM fit when there is one, else the replayed one, the minutes curve) and its
    verdict line, returned."""
    main_fit = vllm_fit or fit
    k = params.eval.k if vllm_fit else params.train.ttt_steps
    needed = {str(t): chats_for(main_fit, t, k) for t in params.scaling.targets}
    basis = "vLLM" if vllm_fit else "replayed"
    beyond = any(n and n > main_fit["n_max"] for n in needed.values())
    verdict = (f"Verdict ({basis}): from {round(main_fit['n_min'])} to {round(main_fit['n_max'])} chats, each "
               f"doubling added {main_fit['per_doubling']:+.3f} to the acceptance length; "
               + "; ".join(f"{t}: {'not reached' if n is None else f'~{n:,.0f} chats'}" for t, n in needed.items())
               + (" (beyond the largest point: an optimistic extrapolation)" if beyond else ""))
    update_metrics(layout.root, "scaling", {
        "sizes": list(params.scaling.sizes), "epochs": params.scaling.epochs,
        "acceptance_replayed": [float(x) for x in table["acceptance_replayed"]],
        "fit_replayed": fit,
        "acceptance_vllm": None if vllm_table is None else [float(x) for x in vllm_table["acceptance_length"]],
        "speedup_vllm": None if vllm_table is None else [float(x) for x in vllm_table["speedup"]],
        "fit_vllm": vllm_fit, "chats_for_targets": needed,
        "minutes": None if curve is None else [round(float(x), 2) for x in curve["minutes"]],
        "vs_ngram_vllm": None if curve is None else [round(float(x), 3) for x in curve["vs_ngram"]],
        "verdict": verdict})
    return verdict
