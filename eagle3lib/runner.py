"""The papermill runner: execute the notebooks in order with one params profile.

Executed copies go to outputs/<run>/<notebook>.ipynb with an HTML export beside each; the run
stops at the first failing notebook and names the failing cell. The profile and the run name
are validated before anything heavy starts, and the run holds outputs/<run>/.lock throughout
(files.run_lock): a second run on the same folder stops at once naming the pid that holds it.

While a notebook runs, the terminal shows papermill's cell counter and the library's own progress
bars as text lines (progress.py; the kernel's stderr is streamed here), after the stage's expected
duration (the capacity plan, or the same stage's wall time in this run folder's last run). After
every stage, finished or failed, the runner records its wall time in metrics.json (section
`runner`, with the git commit and the machine) and rewrites outputs/<run>/index.html (report.py).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .chats import check_sources
from .files import atomic_write_bytes, is_strictly_inside, read_json, run_lock, update_metrics
from .layout import RunLayout
from .params import Params, ParamsError, check_run_name, dump, load_params, repo_root, resolve_path
from .plan import capacity_plan, measured_stats
from .progress import INTERVAL_ENV, PROGRESS_ENV
from .regenerate import resolve_backend as resolve_regen_backend
from .report import OPTIONAL_NOTEBOOKS, git_commit, machine_info, write_index

# Stage name -> notebook file (execution order).
STAGES = {
    "research": "00_research.ipynb",
    "ngram": "01_ngram_baseline.ipynb",
    "data": "02_data.ipynb",
    "extract": "03_extract.ipynb",
    "train": "04_train.ipynb",
    "eval": "05_eval.ipynb",
    "scaling": "06_scaling.ipynb",
}
# Studies a full run (no --only) leaves out (`eagle3 run --only scaling` runs 06_scaling): report.py's list.
OPTIONAL_STAGES = OPTIONAL_NOTEBOOKS


class NotebookFailed(RuntimeError):
    """A notebook raised; the message names the notebook and the cell."""


@dataclass
class StageResult:
    stage: str
    notebook: Path
    html: Optional[Path]
    seconds: float


def select_stages(only: Optional[str]) -> list:
    """--only's stages in pipeline order; without --only every stage but OPTIONAL_STAGES."""
    if not only:
        return [s for s in STAGES if s not in OPTIONAL_STAGES]
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ParamsError(f"--only: unknown stage(s) {unknown}; known: {', '.join(STAGES)}")
    return [s for s in STAGES if s in wanted]  # always in pipeline order


def export_html(notebook: Path) -> Path:
    # jupyter packages: heavy, only needed once a notebook has run
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(str(notebook), as_version=4)
    body, _ = HTMLExporter().from_notebook_node(nb)
    out = notebook.with_suffix(".html")
    out.write_text(body)
    return out


def _failed_cell(exc) -> str:
    """Describe the failing cell of a papermill error (cell number and source head)."""
    idx = getattr(exc, "cell_index", None)
    src = (getattr(exc, "source", "") or "").strip().splitlines()
    head = src[0] if src else ""
    ename, evalue = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
    where = f"cell {idx}" if idx is not None else "a cell"
    return f"{where} ({head!r}): {ename}: {evalue}"


def run_pipeline(params_path: str, only: Optional[str] = None, run_name: Optional[str] = None,
                 notebooks_dir: Optional[Path] = None, html: bool = True, log=print) -> list:
    """Validate the profile, then execute the selected notebooks in order with papermill, holding
    the run folder's lock throughout."""
    p: Params = load_params(params_path)          # fails fast on a bad profile
    if run_name is not None:
        check_run_name(run_name, "--run-name")
    run_name = run_name or p.run_name
    stages = select_stages(only)
    params_file = str(resolve_path(params_path).resolve())
    notebooks_dir = Path(notebooks_dir or repo_root() / "notebooks")
    layout = p.layout(run_name)
    if not is_strictly_inside(layout.root, p.outputs_root()):     # guaranteed by check_run_name
        raise ParamsError(f"run_name: {layout.root} resolves outside {p.outputs_root()} (a symlink?); "
                          "use another run name or remove the link")
    check_sources(p.data.source)                  # a missing data source: refused before any stage
    with run_lock(layout.root, log=log):
        record_run(p, layout, params_file)
        expected = expected_seconds(p, layout)
        return [_run_stage(stage, layout, notebooks_dir,
                           {"params_path": params_file, "run_name": run_name}, html, log, expected.get(stage))
                for stage in stages]


def record_run(p: Params, layout: RunLayout, params_file: str) -> None:
    """params.yaml (the resolved profile) and metrics.json's `runner` section: what ran, where."""
    atomic_write_bytes(layout.params, dump(p).encode())
    update_metrics(layout.root, "runner", {"params_path": params_file, "git_commit": git_commit(repo_root()),
                                           "machine": machine_info()})


# Fixed costs the capacity plan (pure throughput) leaves out, measured on the 2-core CPU (NOTES.md):
# a notebook kernel with the library imported (the research stage, which computes nothing, takes
# 15-20 s) and one vLLM engine start (bench/extract.py: 42.9 s).
KERNEL_START_S, VLLM_START_S = 15.0, 45.0


def startup_seconds(starts_vllm: bool) -> float:
    return KERNEL_START_S + (VLLM_START_S if starts_vllm else 0.0)


def expected_seconds(p: Params, layout: RunLayout) -> dict:
    """{stage: (seconds, basis)}: this run folder's last wall time of the stage, else the capacity
    plan's hours for regeneration (data), extraction and training; stages with neither are absent."""
    plan = capacity_plan(p, measured_stats(layout), memory=False, layout=layout)   # hours only: no meta-device run
    vllm_starts = {"data": p.data.regenerate and resolve_regen_backend(p) == "vllm",
                   "extract": p.extract.backend == "vllm", "train": False}
    out = {stage: (plan[key] * 3600 + startup_seconds(vllm_starts[stage]),
                   f"capacity plan, throughput {plan['throughput_basis']}, plus start-up")
           for stage, key in (("data", "regen_hours"), ("extract", "extract_hours"), ("train", "train_hours"))}
    if p.train.time_budget_minutes is not None:
        out["train"] = (min(out["train"][0], 60 * p.train.time_budget_minutes), "train.time_budget_minutes")
    last = read_json(layout.metrics).get("runner", {}).get("stage_seconds", {}) if layout.metrics.is_file() else {}
    out.update({stage: (s, "this run folder's last run") for stage, s in last.items()})
    return out


@contextlib.contextmanager
def _streaming_kernel_progress():
    """The kernels started inside draw the library's progress bars as text lines (progress.py)."""
    old = {k: os.environ.get(k) for k in (PROGRESS_ENV, INTERVAL_ENV)}
    os.environ[PROGRESS_ENV] = "text"
    os.environ.setdefault(INTERVAL_ENV, "30")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _finish_stage(layout: RunLayout, stage: str, seconds: float, log) -> None:
    """Record the stage's wall time and rewrite the run's index page (also after a failure)."""
    metrics = read_json(layout.metrics) if layout.metrics.is_file() else {}
    times = {**metrics.get("runner", {}).get("stage_seconds", {}), stage: round(seconds, 1)}
    update_metrics(layout.root, "runner", {"stage_seconds": times})
    log(f"[eagle3] report: {write_index(layout.root)}")


def _run_stage(stage: str, layout: RunLayout, notebooks_dir: Path, parameters: dict, html: bool,
               log, expected: Optional[tuple] = None) -> StageResult:
    """Execute one notebook into the run folder (with an HTML export); NotebookFailed names the cell."""
    import papermill as pm                          # heavy (jupyter); `eagle3 params/plan` stay light
    from papermill.exceptions import PapermillExecutionError

    src = notebooks_dir / STAGES[stage]
    if not src.is_file():
        raise FileNotFoundError(f"notebook for stage {stage!r} not found: {src}")
    dst = layout.notebook(Path(STAGES[stage]).stem)
    eta = f" (expected ~{_duration(expected[0])}: {expected[1]})" if expected else ""
    log(f"[eagle3] {stage}: {src.name} -> {dst}{eta}")
    t0 = time.time()
    try:
        with _streaming_kernel_progress():
            pm.execute_notebook(str(src), str(dst), cwd=str(notebooks_dir), kernel_name="python3",
                                parameters=parameters, progress_bar=True, log_output=False,
                                stderr_file=sys.stderr)
    except PapermillExecutionError as e:
        if html and dst.is_file():
            export_html(dst)
        _finish_stage(layout, stage, time.time() - t0, log)
        raise NotebookFailed(f"notebook {src.name} failed at {_failed_cell(e)} "
                             f"(executed copy: {dst})") from None
    out_html = export_html(dst) if html else None
    result = StageResult(stage, dst, out_html, time.time() - t0)
    log(f"[eagle3] {stage}: done in {result.seconds:.0f} s")
    _finish_stage(layout, stage, result.seconds, log)
    return result
