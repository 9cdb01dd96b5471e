"""`eagle3` console script: run the notebooks, print the capacity plan, print a resolved profile,
compare runs.

    eagle3 run --params params/local.yaml [--only data,extract] [--run-name NAME]
    eagle3 run --params params/b300.yaml --smoke       # the same stages on a tiny slice, first
    eagle3 plan --params params/b300.yaml
    eagle3 params --params params/ci.yaml
    eagle3 compare local local-wd [--plot outputs/local-vs-wd.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .files import MetricsError, RunLocked, UnsafeLink, describe_write_failure
from .fingerprint import TargetMismatch
from .layout import RunLayout
from .params import ParamsError, check_run_name, dump, load_params, repo_root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute the notebooks in order with papermill")
    run.add_argument("--params", required=True)
    run.add_argument("--only", default=None,
                     help="comma-separated stages: research,ngram,data,extract,train,eval (a full run), "
                          "scaling (06, a study a full run leaves out)")
    run.add_argument("--run-name", default=None,
                     help="folder under outputs/ (letters, digits, '.', '-', '_'; default: the profile's run_name)")
    run.add_argument("--no-html", action="store_true")
    run.add_argument("--smoke", action="store_true",
                     help="the same target, engines, parallel layout and stages on a tiny slice (eagle3lib/smoke.py) "
                          "in outputs/<run_name>-smoke/, training resumed once from a checkpoint; prints each "
                          "stage's time beside the plan's for the slice and the full run")
    plan = sub.add_parser("plan", help="print the capacity plan of a profile (runs nothing)")
    plan.add_argument("--params", required=True)
    show = sub.add_parser("params", help="print the fully resolved profile")
    show.add_argument("--params", required=True)
    comp = sub.add_parser("compare", help="headline metrics and differing params of runs, and their training curves")
    comp.add_argument("runs", nargs="+", help="run names under --outputs, or run folders")
    comp.add_argument("--outputs", default=None, help="the outputs folder (default: outputs/ of this checkout)")
    comp.add_argument("--plot", default=None, help="PNG of the training curves (default: none)")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "params":
            print(dump(load_params(args.params)), end="")
        elif args.cmd == "plan":
            from .plan import capacity_plan, format_plan, measured_stats
            p = load_params(args.params)
            plan = capacity_plan(p, measured_stats(p.layout()))
            print(format_plan(plan))
            if any(level == "refuse" for level, _, _ in plan["problems"]):
                return 4                    # `eagle3 run` would refuse this profile (the REFUSED rows)
        elif args.cmd == "compare":
            compare(args.runs, args.outputs, args.plot)
        elif args.cmd == "run":
            return run_command(args)
    except (ParamsError, FileNotFoundError, MetricsError, UnsafeLink, TargetMismatch) as e:
        print(f"eagle3: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"eagle3: permission denied on {e.filename}: the run folder must be writable "
              "(chmod u+w, chattr -i) or choose another --run-name", file=sys.stderr)
        return 2
    except OSError as e:                    # a read-only or full disk (the lock, params.yaml, metrics.json)
        print(f"eagle3: {describe_write_failure(e)}", file=sys.stderr)
        return 2
    except RunLocked as e:
        print(f"eagle3: {e}", file=sys.stderr)
        return 3
    return 0


def run_command(args) -> int:
    """`eagle3 run`: the notebooks in order (or the smoke run); 1 when a notebook fails."""
    from .runner import (  # papermill: only for `run`
        NotebookFailed,
        RunInterrupted,
        format_smoke,
        run_pipeline,
        run_smoke,
    )
    if args.run_name is not None:
        check_run_name(args.run_name, "--run-name")
    report = None
    try:
        if args.smoke:
            results, report = run_smoke(args.params, only=args.only, run_name=args.run_name, html=not args.no_html)
        else:
            results = run_pipeline(args.params, only=args.only, run_name=args.run_name, html=not args.no_html)
    except NotebookFailed as e:
        print(f"eagle3: {e}", file=sys.stderr)
        return 1
    except RunInterrupted as e:
        print(f"eagle3: {e}", file=sys.stderr)
        return 130
    for r in results:
        print(f"{r.stage:<13} {r.seconds:7.0f} s  {r.notebook}")
    if report is not None:
        print(format_smoke(report))
    return 0


def compare(runs: list, outputs=None, plot=None) -> None:
    """Print the markdown tables of report.compare_runs; save the training curves to `plot`."""
    from .report import compare_runs, markdown_table, plot_training_curves  # pandas/matplotlib: only here
    root = Path(outputs) if outputs else repo_root() / "outputs"
    folders = [root / r if (root / r).is_dir() else Path(r) for r in runs]
    missing = [str(f) for f in folders if not RunLayout(f).metrics.is_file()]
    if missing:
        raise FileNotFoundError(f"no metrics.json in {', '.join(missing)}: name runs under {root} "
                                "(or give run folders), each run by `eagle3 run` at least in part")
    metrics, param_diff = compare_runs(folders)
    print(markdown_table(metrics, "quantity"))
    print()
    print(markdown_table(param_diff, "param") if len(param_diff) else "(the runs' params are the same)")
    if plot:
        plot_training_curves(folders).savefig(plot, dpi=100, bbox_inches="tight")
        print(f"\ntraining curves: {plot}")


if __name__ == "__main__":
    sys.exit(main())
