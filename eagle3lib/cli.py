"""`eagle3` console script: run the notebooks, print the capacity plan, print a resolved profile.

    eagle3 run --params params/local.yaml [--only data,extract] [--run-name NAME]
    eagle3 plan --params params/b300.yaml
    eagle3 params --params params/ci.yaml
"""
from __future__ import annotations

import argparse
import sys

from .files import RunLocked
from .params import ParamsError, check_run_name, dump, load_params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute the notebooks in order with papermill")
    run.add_argument("--params", required=True)
    run.add_argument("--only", default=None, help="comma-separated stages: research,ngram,data,extract,train,eval")
    run.add_argument("--run-name", default=None,
                     help="folder under outputs/ (letters, digits, '.', '-', '_'; default: the profile's run_name)")
    run.add_argument("--no-html", action="store_true")
    plan = sub.add_parser("plan", help="print the capacity plan of a profile (runs nothing)")
    plan.add_argument("--params", required=True)
    show = sub.add_parser("params", help="print the fully resolved profile")
    show.add_argument("--params", required=True)
    args = ap.parse_args(argv)

    try:
        if args.cmd == "params":
            print(dump(load_params(args.params)), end="")
        elif args.cmd == "plan":
            from .plan import capacity_plan, format_plan, load_stats
            p = load_params(args.params)
            print(format_plan(capacity_plan(p, load_stats(p.run_dir()))))
        elif args.cmd == "run":
            from .runner import NotebookFailed, run_pipeline   # papermill on the way: only for `run`
            if args.run_name is not None:
                check_run_name(args.run_name, "--run-name")
            try:
                results = run_pipeline(args.params, only=args.only, run_name=args.run_name,
                                       html=not args.no_html)
            except NotebookFailed as e:
                print(f"eagle3: {e}", file=sys.stderr)
                return 1
            for r in results:
                print(f"{r.stage:<9} {r.seconds:7.0f} s  {r.notebook}")
    except (ParamsError, FileNotFoundError) as e:
        print(f"eagle3: {e}", file=sys.stderr)
        return 2
    except RunLocked as e:
        print(f"eagle3: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
