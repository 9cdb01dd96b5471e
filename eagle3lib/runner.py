"""The papermill runner: execute the notebooks in order with one params profile.

Executed copies go to outputs/<run>/<notebook>.ipynb with an HTML export beside each; the run
stops at the first failing notebook and names the failing cell. The profile and the run name
are validated before anything heavy starts, and the run holds outputs/<run>/.lock throughout
(files.run_lock): a second run on the same folder stops at once naming the pid that holds it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .files import is_strictly_inside, run_lock
from .layout import RunLayout
from .params import Params, ParamsError, check_run_name, load_params, repo_root, resolve_path

# Stage name -> notebook file (execution order).
STAGES = {
    "research": "00_research.ipynb",
    "ngram": "01_ngram_baseline.ipynb",
    "data": "02_data.ipynb",
    "extract": "03_extract.ipynb",
    "train": "04_train.ipynb",
    "eval": "05_eval.ipynb",
}


class NotebookFailed(RuntimeError):
    """A notebook raised; the message names the notebook and the cell."""


@dataclass
class StageResult:
    stage: str
    notebook: Path
    html: Optional[Path]
    seconds: float


def select_stages(only: Optional[str]) -> list:
    if not only:
        return list(STAGES)
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
    with run_lock(layout.root, log=log):
        return [_run_stage(stage, layout, notebooks_dir,
                           {"params_path": params_file, "run_name": run_name}, html, log)
                for stage in stages]


def _run_stage(stage: str, layout: RunLayout, notebooks_dir: Path, parameters: dict, html: bool,
               log) -> StageResult:
    """Execute one notebook into the run folder (with an HTML export); NotebookFailed names the cell."""
    import papermill as pm                          # heavy (jupyter); `eagle3 params/plan` stay light
    from papermill.exceptions import PapermillExecutionError

    src = notebooks_dir / STAGES[stage]
    if not src.is_file():
        raise FileNotFoundError(f"notebook for stage {stage!r} not found: {src}")
    dst = layout.notebook(Path(STAGES[stage]).stem)
    log(f"[eagle3] {stage}: {src.name} -> {dst}")
    t0 = time.time()
    try:
        pm.execute_notebook(str(src), str(dst), cwd=str(notebooks_dir), kernel_name="python3",
                            parameters=parameters, progress_bar=False, log_output=False)
    except PapermillExecutionError as e:
        if html and dst.is_file():
            export_html(dst)
        raise NotebookFailed(f"notebook {src.name} failed at {_failed_cell(e)} "
                             f"(executed copy: {dst})") from None
    out_html = export_html(dst) if html else None
    result = StageResult(stage, dst, out_html, time.time() - t0)
    log(f"[eagle3] {stage}: done in {result.seconds:.0f} s")
    return result
