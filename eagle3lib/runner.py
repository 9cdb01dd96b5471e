"""The papermill runner: execute the notebooks in order with one params profile.

Executed copies go to outputs/<run>/<notebook>.ipynb with an HTML export beside each; the run
stops at the first failing notebook and names the failing cell. The profile and the run name
are validated before anything heavy starts, and the run holds outputs/<run>/.lock throughout
(files.run_lock): a second run on the same folder stops at once naming the pid that holds it.

While a notebook runs, the terminal shows papermill's cell counter and the library's own progress
bars as text lines (progress.py; the kernel's stderr is streamed here), after the stage's expected
duration (the capacity plan, or the same stage's wall time in this run folder's last completed run).
After every stage, finished or failed, the runner records its wall time in metrics.json (section
`runner`, with the git commit and the machine) and rewrites outputs/<run>/index.html (report.py).

A stage that ends early (a failing cell, Ctrl-C, a kernel killed by the OOM killer, a full or
read-only disk) is recorded in `runner.incomplete` and marked so on the index page; the run ends in
one `eagle3:` line naming the stage, the path and the fix. papermill's saves of the executed copy
are atomic (temp name, fsync, rename), so a copy is never left truncated; a copy that stopped
part-way gets a first cell saying so, or is removed where it cannot be marked (a full disk), and
the previous run's .html of the stage is removed when the stage starts.

`run_smoke` (`eagle3 run --smoke`) runs the same stages on the profile's smoke slice (smoke.py) in
outputs/<run_name>-smoke/, training in two legs (the second resumes the first's checkpoint), and
writes metrics.json's `smoke` section: each stage's wall time beside the capacity plan's figure for
the slice and for the full run.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .chats import check_sources
from .files import (
    atomic_write_bytes,
    describe_write_failure,
    fsync_file,
    is_strictly_inside,
    read_metrics,
    remove_tree,
    run_lock,
    update_metrics,
    write_failure_reason,
)
from .layout import RunLayout
from .page_check import BrowserMissing, PageCheck, check_page
from .params import Params, ParamsError, check_run_name, dump, load_params, repo_root, resolve_path
from .plan import capacity_plan, measured_stats, refuse_full_run
from .progress import INTERVAL_ENV, PROGRESS_ENV
from .regenerate import resolve_backend as resolve_regen_backend
from .report import OPTIONAL_NOTEBOOKS, git_commit, machine_info, write_index
from .smoke import branches, changed_fields, smoke_params

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
    """A stage ended early: a cell raised, its kernel died, or its executed copy could not be written;
    the message names the stage (the notebook and the cell where one raised), the path and the fix."""


class RunInterrupted(RuntimeError):
    """Ctrl-C during a stage: its time, the index page and a mark in the executed copy are written."""


@dataclass
class StageResult:
    stage: str
    notebook: Path
    html: Optional[Path]
    seconds: float


def select_stages(only: Optional[str]) -> list:
    """--only's stages in pipeline order; without --only every stage but OPTIONAL_STAGES."""
    if only is None:
        return [s for s in STAGES if s not in OPTIONAL_STAGES]
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    if not wanted:
        raise ParamsError(f"--only {only!r} names no stage; give one or more of: {', '.join(STAGES)}")
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
    write_and_rename(out, lambda tmp: tmp.write_text(body, encoding="utf-8"))
    return out


def write_and_rename(path: Path, write: Callable[[Path], None]) -> None:
    """`write(temp)` to a temp name beside `path`, fsync, rename over `path`: the file is whole or
    as it was, never truncated, and has the mode a plain write gives it (umask). The temp is removed
    on failure; an OSError naming no file (a write() on a full disk) or the temp names `path`."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, e.filename if e.filename not in (None, str(tmp)) else str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    layout = checked_layout(p, run_name)
    refuse_full_run(p, layout, log)               # disk, host memory, warmup, thinking cut, preflight: before any stage
    with run_lock(layout.root, log=log):
        record_run(p, layout, params_file)
        expected = expected_seconds(p, layout)
        results = [_run_stage(stage, layout, notebooks_dir,
                              {"params_path": params_file, "run_name": run_name}, html, log, expected.get(stage))
                   for stage in stages]
        check_report_page(layout, log)
        return results


def check_report_page(layout: RunLayout, log) -> Optional[PageCheck]:
    """Open the run's index page in headless Chromium and save its screenshot beside it; what is
    broken (headline, an image, a link) is logged. Without a browser, say how to get one."""
    try:
        check = check_page(layout.index_html, screenshot=layout.index_png)
    except BrowserMissing as e:
        log(f"[eagle3] index page not checked in a browser: {e}")
        return None
    except (RuntimeError, OSError) as e:
        log(f"[eagle3] index page check could not run: {e}")
        return None
    log(f"[eagle3] {check.summary()}")
    for problem in check.problems():
        log(f"[eagle3] WARNING: {problem}")
    return check


def checked_layout(p: Params, run_name: str) -> RunLayout:
    """The run's folder, refused when it resolves outside outputs/ or a data source is missing
    (before any stage starts)."""
    layout = p.layout(run_name)
    if not is_strictly_inside(layout.root, p.outputs_root()):     # guaranteed by check_run_name
        raise ParamsError(f"run_name: {layout.root} resolves outside {p.outputs_root()} (a symlink?); "
                          "use another run name or remove the link")
    check_sources(p.data.source)                  # a missing data source: refused before any stage
    return layout


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


# The capacity plan's figure (hours) of the stages whose time it plans.
PLAN_STAGE_HOURS = {"data": "regen_hours", "extract": "extract_hours", "train": "train_hours"}


def planned_seconds(p: Params, plan: dict) -> dict:
    """{stage: (seconds, basis)} of the capacity plan `plan` of profile `p`: its per-stage time model
    (plan["stages"]: every part, start-ups included) where it has one, else its hours of
    regeneration (data), extraction and training plus each stage's start-up."""
    if plan.get("stages"):
        out = {stage: (st["seconds"], "capacity plan: " + _parts_basis(st.get("parts", [])))
               for stage, st in plan["stages"].items()}
    else:
        out = _throughput_seconds(p, plan)
    if p.train.time_budget_minutes is not None and "train" in out:
        out["train"] = (min(out["train"][0], 60 * p.train.time_budget_minutes), "train.time_budget_minutes")
    return out


def _parts_basis(parts: list) -> str:
    """"measured", "assumed" or "measured + assumed" for a stage's parts (each basis starts with one)."""
    kinds = {part["basis"].split()[0] for part in parts if part.get("basis")}
    return " + ".join(k for k in ("measured", "assumed") if k in kinds) or "no parts"


def _throughput_seconds(p: Params, plan: dict) -> dict:
    """The plan's hours of the stages in PLAN_STAGE_HOURS plus each stage's start-up."""
    vllm_starts = {"data": p.data.regenerate and resolve_regen_backend(p) == "vllm",
                   "extract": p.extract.backend == "vllm", "train": False}
    out = {stage: (plan[key] * 3600 + startup_seconds(vllm_starts[stage]),
                   f"capacity plan, throughput {plan['throughput_basis']}, plus start-up")
           for stage, key in PLAN_STAGE_HOURS.items()}
    return out


def expected_seconds(p: Params, layout: RunLayout) -> dict:
    """{stage: (seconds, basis)}: this run folder's last wall time of the stage where it completed
    (completed_seconds), else the capacity plan's hours for regeneration (data), extraction and
    training; stages with neither are absent. A stage that ended early never sets the expectation."""
    plan = capacity_plan(p, measured_stats(layout), memory=False, layout=layout)   # hours only: no meta-device run
    out = planned_seconds(p, plan)
    out.update({stage: (s, "this run folder's last run") for stage, s in completed_seconds(layout).items()})
    return out


def completed_seconds(layout: RunLayout) -> dict:
    """{stage: wall seconds of its last completed run} from metrics.json's runner section (a file
    written before completed_seconds existed: its stage_seconds of stages not marked incomplete)."""
    runner = read_metrics(layout.metrics).get("runner", {})
    incomplete = runner.get("incomplete", {})
    out = {stage: s for stage, s in runner.get("stage_seconds", {}).items() if stage not in incomplete}
    out.update(runner.get("completed_seconds", {}))
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
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


# Why a stage ended early, as runner.incomplete and the index page say it.
INTERRUPTED = "interrupted (Ctrl-C)"
KERNEL_DIED = "the kernel died (killed: out of memory, or kill -9)"


def mark_incomplete(notebook: Path, seconds: float, why: str = INTERRUPTED, log=print) -> None:
    """Put a first cell into an executed copy saying it stopped part-way (`why`), so it does not read
    as a finished run. A copy that cannot be read or marked (truncated, a full disk) is removed."""
    import nbformat
    if not notebook.exists():
        return
    try:
        nb = nbformat.read(str(notebook), as_version=4)
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(
            f"**{why[0].upper() + why[1:]} after {_duration(seconds)}: this executed copy is incomplete.**"))
        write_and_rename(notebook, lambda tmp: tmp.write_text(nbformat.writes(nb), encoding="utf-8"))
    except (OSError, ValueError) as e:            # NotJSONError is a ValueError
        try:
            notebook.unlink(missing_ok=True)
            log(f"[eagle3] removed {notebook}: it stopped part-way and could not be marked so ({e})")
        except OSError as gone:                   # a read-only disk
            log(f"[eagle3] WARNING: {notebook} stopped part-way and could neither be marked nor removed ({gone})")


def _finish_stage(layout: RunLayout, stage: str, seconds: float, log, incomplete: Optional[str] = None,
                  extra: Optional[dict] = None) -> None:
    """Record the stage's wall time (and, for a completed one, completed_seconds; for one that ended
    early, why in `incomplete`) and rewrite the run's index page (also after a failure)."""
    runner = read_metrics(layout.metrics).get("runner", {})
    times = {**runner.get("stage_seconds", {}), stage: round(seconds, 1)}
    pending = {k: v for k, v in runner.get("incomplete", {}).items() if k != stage}
    completed = dict(runner.get("completed_seconds", {}))
    if incomplete is None:
        completed[stage] = round(seconds, 1)
    else:
        pending[stage] = incomplete
    update_metrics(layout.root, "runner", {"stage_seconds": times, "incomplete": pending,
                                           "completed_seconds": completed, **(extra or {})})
    log(f"[eagle3] report: {write_index(layout.root)}")


def _ended_early(layout: RunLayout, stage: str, notebook: Path, seconds: float, why: str, html: bool, log,
                 mark: bool = True, extra: Optional[dict] = None) -> None:
    """A stage that ended early: its executed copy marked incomplete (mark; papermill marks a failed
    cell itself) and exported again, its time and `why` recorded, the index rewritten, each as far
    as the disk allows (a full disk may refuse them: said in a log line, the run's error line follows)."""
    if mark:
        mark_incomplete(notebook, seconds, why, log)
    try:
        if html and notebook.is_file():
            export_html(notebook)
        _finish_stage(layout, stage, seconds, log, incomplete=why, extra=extra)
    except OSError as e:
        log(f"[eagle3] {stage}: the stage's time and the index page could not be written "
            f"({describe_write_failure(e)})")


def _clear_previous_copy(notebook: Path) -> None:
    """Before a stage runs: the previous run's .html of it (it would pass for this run's) and the
    temp files of saves (write_and_rename) a killed runner left."""
    html = notebook.with_suffix(".html")
    html.unlink(missing_ok=True)
    for path in (notebook, html):
        for tmp in path.parent.glob(f".{path.name}.*.tmp"):
            tmp.unlink(missing_ok=True)


class AtomicNotebookWrites:
    """papermill's I/O handler for the executed copies in one folder: each save (after every cell)
    goes through write_and_rename, so a full disk or a kill mid-save leaves the copy of the last
    finished save, never a truncated file. Reads go to papermill's local handler."""

    def __init__(self, local):
        self.local = local

    def read(self, path):
        return self.local.read(path)

    def listdir(self, path):
        return self.local.listdir(path)

    def pretty_path(self, path):
        return path

    def write(self, buf, path):
        write_and_rename(Path(path), lambda tmp: self.local.write(buf, str(tmp)))


_ATOMIC_FOLDERS: set = set()


def atomic_notebook_writes(folder: Path) -> None:
    """Register AtomicNotebookWrites for the paths under `folder` with papermill (once per folder)."""
    from papermill.iorw import LocalHandler, papermill_io  # heavy (jupyter): only where notebooks run
    prefix = os.path.join(str(folder), "")
    if prefix not in _ATOMIC_FOLDERS:
        papermill_io.register(prefix, AtomicNotebookWrites(LocalHandler()))   # matched before "local"
        _ATOMIC_FOLDERS.add(prefix)


def _run_stage(stage: str, layout: RunLayout, notebooks_dir: Path, parameters: dict, html: bool,
               log, expected: Optional[tuple] = None, label: Optional[str] = None) -> StageResult:
    """Execute one notebook into the run folder (with an HTML export); NotebookFailed names the cell.
    label: the name of this execution (its executed copy and its wall time; default: the stage)."""
    import papermill as pm  # heavy (jupyter); `eagle3 params/plan` stay light
    from nbclient.exceptions import DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    label = label or stage
    src = notebooks_dir / STAGES[stage]
    if not src.is_file():
        raise FileNotFoundError(f"notebook for stage {stage!r} not found: {src}")
    stem = Path(STAGES[stage]).stem
    dst = layout.notebook(stem if label == stage else f"{stem}-{label}")
    eta = f" (expected ~{_duration(expected[0])}: {expected[1]})" if expected else ""
    log(f"[eagle3] {label}: {src.name} -> {dst}{eta}")
    t0 = time.time()
    try:
        _clear_previous_copy(dst)
        atomic_notebook_writes(dst.parent)
        with _streaming_kernel_progress():
            pm.execute_notebook(str(src), str(dst), cwd=str(notebooks_dir), kernel_name="python3",
                                parameters=parameters, progress_bar=True, log_output=False,
                                stderr_file=sys.stderr)
        out_html = export_html(dst) if html else None
    except PapermillExecutionError as e:
        why = f"failed at cell {getattr(e, 'cell_index', '?')}"
        _ended_early(layout, label, dst, time.time() - t0, why, html, log, mark=False)
        raise NotebookFailed(f"notebook {src.name} failed at {_failed_cell(e)} "
                             f"(executed copy: {dst})") from None
    except KeyboardInterrupt:                       # Ctrl-C: leave the same trace as a failed cell
        seconds = time.time() - t0
        _ended_early(layout, label, dst, seconds, INTERRUPTED, html, log,
                     extra={"interrupted": {"stage": label, "after_seconds": round(seconds, 1),
                                            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}})
        raise RunInterrupted(f"interrupted (Ctrl-C) in stage {label} after {_duration(seconds)}; the executed copy "
                             f"{dst} is incomplete. Rerun the same command to go on: finished stages and "
                             f"checkpoints are kept") from None
    except DeadKernelError:                         # kill -9 of the kernel: the OOM killer, most often
        seconds = time.time() - t0
        _ended_early(layout, label, dst, seconds, KERNEL_DIED, html, log)
        raise NotebookFailed(f"stage {label}: the notebook's kernel died after {_duration(seconds)} (killed: the "
                             f"out-of-memory killer, or kill -9; `dmesg | grep -i -e oom -e killed` tells which); "
                             f"the executed copy {dst} is incomplete. Give the stage more memory (stop other "
                             f"processes, or lower the profile's batch sizes), then rerun the same command: "
                             f"finished stages and checkpoints are kept") from None
    except OSError as e:                            # a full or read-only disk, while papermill saved the copy
        _ended_early(layout, label, dst, time.time() - t0, write_failure_reason(e), html, log)
        raise NotebookFailed(f"stage {label}: {describe_write_failure(e, dst)}") from None
    result = StageResult(label, dst, out_html, time.time() - t0)
    log(f"[eagle3] {label}: done in {result.seconds:.0f} s")
    try:
        _finish_stage(layout, label, result.seconds, log)
    except OSError as e:
        raise NotebookFailed(f"stage {label} finished, but its time and the index page could not be written: "
                             f"{describe_write_failure(e)}") from None
    return result


# ==== the smoke run ===========================================================================
RESUME_LEG = "train-resume"       # the second training leg's label (executed copy, stage time)
# online, the resumed leg's states come from a second server start (vLLM batches the ranks'
# requests as they arrive): its drafter matches leg 1's within the online-vs-offline tolerance
ONLINE_RESUME_RTOL = 1e-4


def run_smoke(params_path: str, only: Optional[str] = None, run_name: Optional[str] = None,
              notebooks_dir: Optional[Path] = None, html: bool = True, log=print) -> tuple[list, dict]:
    """Run the selected stages on the smoke slice of the profile (smoke.smoke_params) in
    outputs/<run_name>-smoke/ (or `run_name`), training in two legs (resume_leg).
    -> (StageResults, metrics.json's `smoke` section, which is written also when a stage fails)."""
    full: Params = load_params(params_path)
    if run_name is not None:
        check_run_name(run_name, "--run-name")
    p = smoke_params(full, run_name)
    stages = select_stages(only)
    notebooks_dir = Path(notebooks_dir or repo_root() / "notebooks")
    layout = checked_layout(p, p.run_name)
    # a smoke run that passes says nothing when the full run cannot finish: refused the same way
    warnings = refuse_full_run(full, full.layout(), log)
    results, resumed, finished = [], None, False
    with run_lock(layout.root, log=log):
        record_run(p, layout, str(layout.params))   # the notebooks read the smoke profile from params.yaml
        plan_smoke = capacity_plan(p, measured_stats(layout), memory=False, layout=layout)
        plan_full = capacity_plan(full, measured_stats(full.layout()), memory=False, layout=full.layout())
        update_metrics(layout.root, "smoke", {**smoke_header(full, p, str(resolve_path(params_path).resolve())),
                                              "full_run_warnings": warnings})
        expected = expected_seconds(p, layout)
        parameters = {"params_path": str(layout.params), "run_name": p.run_name}
        try:
            for stage in stages:
                if stage == "train":           # leg 1 trains from step 0, also when the smoke run is rerun
                    remove_tree(layout.checkpoints, under=layout.root)
                # 04 is told it runs a slice: a few steps are not asked to beat the unigram baseline
                stage_parameters = {**parameters, "smoke": True} if stage == "train" else parameters
                results.append(_run_stage(stage, layout, notebooks_dir, stage_parameters, html, log,
                                          expected.get(stage)))
                if stage == "train":
                    leg2, resumed = resume_leg(p, layout, notebooks_dir, stage_parameters, html, log)
                    results.append(leg2)
                if stage == "eval":
                    check_export(layout)
            finished = True
        finally:
            update_metrics(layout.root, "smoke", smoke_report(p, full, layout, results, resumed, finished,
                                                              plan_smoke, plan_full))
    return results, read_metrics(layout.metrics)["smoke"]


def check_export(layout: RunLayout) -> None:
    """Stop the smoke run where 05's vLLM acceptance falls below 04's replayed acceptance at the same
    k by more than the tolerance (verdict.export_check): in bf16 on the box the exactness checks are
    waived, and a wrong export would otherwise show only as a low acceptance in the full run."""
    check = read_metrics(layout.metrics).get("eval", {}).get("export_check") or {}
    if check.get("ok") is False:
        raise RuntimeError(f"smoke: {check['note']}")


def smoke_header(full: Params, smoke: Params, full_params_path: str) -> dict:
    """What the smoke run is: the full profile, the fields the slice changed, the branches taken."""
    return {"full_params_path": full_params_path, "full_run_name": full.run_name,
            "slice": {k: {"full": a, "smoke": b} for k, (a, b) in changed_fields(full, smoke).items()},
            "branches": branches(smoke), "branches_equal_full_run": branches(smoke) == branches(full),
            "complete": False}


def resume_leg(p: Params, layout: RunLayout, notebooks_dir: Path, parameters: dict, html: bool,
               log) -> tuple[StageResult, dict]:
    """Training's second leg: delete leg 1's last checkpoint and run 04 again, which must resume
    from the half-way checkpoint and end at the same step. -> (its StageResult, {resumed_from_step,
    steps, checkpoint_format, final_weights_equal: leg 2's final drafter bit-equal to leg 1's,
    final_weights_max_rel_diff, final_weights_match: bit-equal offline; online, where the two legs'
    states come from two server starts, within ONLINE_RESUME_RTOL})."""
    from safetensors.torch import load_file  # torch: only for this leg

    from .checkpoints import latest_checkpoint, read_checkpoint_meta

    last = latest_checkpoint(layout.checkpoints)
    if last is None:
        raise RuntimeError(f"smoke: training left no checkpoint in {layout.checkpoints}")
    steps = read_checkpoint_meta(last)["step"]
    leg1 = tensor_digests(layout.final / "model.safetensors")
    leg1_weights = load_file(str(layout.final / "model.safetensors"))
    remove_tree(last, under=layout.root)
    start = latest_checkpoint(layout.checkpoints)
    if start is None:
        raise RuntimeError(f"smoke: no checkpoint before step {steps} to resume from "
                           f"(train.checkpoint_every: {p.train.checkpoint_every})")
    log(f"[eagle3] {RESUME_LEG}: removed {last.name}; 04 resumes from {start.name}")
    result = _run_stage("train", layout, notebooks_dir, parameters, html, log, label=RESUME_LEG)
    end = latest_checkpoint(layout.checkpoints)
    end_meta = read_checkpoint_meta(end) if end is not None else {}
    if end_meta.get("step") != steps:
        raise RuntimeError(f"smoke: the resumed leg ended at {end} (step {end_meta.get('step')}), "
                           f"expected step {steps}")
    equal = tensor_digests(layout.final / "model.safetensors") == leg1
    diff = max_rel_diff(leg1_weights, load_file(str(layout.final / "model.safetensors")))
    return result, {"resumed_from_step": read_checkpoint_meta(start)["step"], "steps": steps,
                    "checkpoint_format": "dcp" if end_meta["world_size"] > 1 else "safetensors",
                    "final_weights_equal": equal, "final_weights_max_rel_diff": diff,
                    "final_weights_match": legs_match(equal, diff, p.extract.mode)}


def legs_match(equal: bool, max_rel_diff: float, mode: str) -> bool:
    """The resumed leg reached leg 1's drafter: bit-equal offline; online (two server starts)
    within ONLINE_RESUME_RTOL."""
    return equal or (mode == "online" and max_rel_diff <= ONLINE_RESUME_RTOL)


def max_rel_diff(a: dict, b: dict) -> float:
    """The largest |b - a| / |a| (Frobenius) over the tensors of two state dicts (inf when their names differ)."""
    if a.keys() != b.keys():
        return float("inf")
    return max((float((b[k].float() - a[k].float()).norm() / a[k].float().norm().clamp(min=1e-12)) for k in a),
               default=0.0)


def tensor_digests(path: Path) -> dict:
    """{tensor name: sha256 of its bytes} of a safetensors file (its metadata left out)."""
    import torch  # heavy: only for the smoke run's resume check
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: hashlib.sha256(f.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for k in f.keys()}


def plan_hours(plan: Optional[dict]) -> Optional[dict]:
    """Every hours figure of a capacity plan ({key: hours}: its keys ending in "_hours")."""
    if plan is None:
        return None
    return {k: v for k, v in plan.items() if k.endswith("_hours") and isinstance(v, (int, float))}


def smoke_report(p: Params, full: Params, layout: RunLayout, results: list, resumed: Optional[dict],
                 finished: bool, plan_smoke: dict, plan_full: dict) -> dict:
    """metrics.json's `smoke` section: per stage run, its measured seconds beside the plan's seconds
    for the smoke slice and for the full run, and the full run's plan at the rates this smoke run
    measured (plan.measured_rates reads them from the smoke folder: small batches, so a pessimistic
    figure on a GPU box)."""
    metrics = read_metrics(layout.metrics)
    measured = metrics.get("runner", {}).get("stage_seconds", {})
    plan_rates = capacity_plan(full, None, memory=False, layout=layout) if finished else None
    planned = {"smoke": planned_seconds(p, plan_smoke), "full": planned_seconds(full, plan_full),
               "rates": planned_seconds(full, plan_rates) if plan_rates else {}}
    ran = [r.stage for r in results]
    failed = [s for s in measured if s not in ran]          # a stage that raised still has its time
    rows = []
    for label in ran + failed:
        row = {"stage": label, "seconds": measured.get(label), "planned_smoke_s": None, "planned_full_s": None,
               "planned_full_at_smoke_rates_s": None, "basis": None}
        if label in planned["smoke"] and label in planned["full"]:
            row.update(planned_smoke_s=round(planned["smoke"][label][0], 1),
                       planned_full_s=round(planned["full"][label][0], 1), basis=planned["full"][label][1])
            if label in planned["rates"]:
                row["planned_full_at_smoke_rates_s"] = round(planned["rates"][label][0], 1)
        rows.append(row)
    return {"stages": rows, "complete": finished, "failed_stage": None if finished else (failed or [None])[0],
            "resume": resumed, "export_check": metrics.get("eval", {}).get("export_check"),
            "plan_smoke_hours": plan_hours(plan_smoke), "plan_full_hours": plan_hours(plan_full),
            "plan_full_at_smoke_rates_hours": plan_hours(plan_rates)}


def format_smoke(report: dict) -> str:
    """The smoke report as text for the terminal: the stage table, the resume check, the branches."""
    def cell(seconds):
        return "-" if seconds is None else _duration(seconds)
    lines = [f"{'stage':<13} {'measured':>9} {'plan (smoke)':>13} {'plan (full run)':>16} {'full at smoke rates':>20}"]
    for r in report["stages"]:
        lines.append(f"{r['stage']:<13} {cell(r['seconds']):>9} {cell(r['planned_smoke_s']):>13} "
                     f"{cell(r['planned_full_s']):>16} {cell(r['planned_full_at_smoke_rates_s']):>20}")
    res = report.get("resume")
    if res:
        lines.append(f"resume: {res['checkpoint_format']} checkpoint of step {res['resumed_from_step']} -> step "
                     f"{res['steps']}; final drafter bit-equal to the uninterrupted leg's: "
                     f"{res['final_weights_equal']} (largest relative difference "
                     f"{res['final_weights_max_rel_diff']:.1e}; matches: {res['final_weights_match']})")
    if report.get("export_check"):
        lines.append(f"export check: {report['export_check']['note']}")
    lines.append(f"branches equal to the full run's (smoke.branches): {report.get('branches_equal_full_run')}")
    return "\n".join(lines)
