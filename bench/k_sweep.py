"""Speculation length k for EAGLE-3 and n-gram in vLLM, on a finished run (NOTES.md, Decisions: Speculation length k).

For the run's exported drafter (outputs/<run>/export/, written by 05_eval) and the run's held-out
prompts, one vLLM subprocess decodes plain, then n-gram and EAGLE-3 at every --k, one request at a
time (the latency regime of 05), T = eval.temperature, eval.vllm_dtype. Prints one row per mode:
decode tokens/s, speedup over plain, acceptance length, and same output as plain; appends the rows
with the date, commit and machine to outputs/bench/k_sweep.jsonl.

    python bench/k_sweep.py --params params/local.yaml [--run local] [--k 2 3 4 5] [--prompts 20] [--export DIR]

Timings need an otherwise idle machine: a second job on the 2 cores halves every rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eagle3lib import evaluate as ev
from eagle3lib.params import repo_root
from eagle3lib.report import git_commit, machine_info
from eagle3lib.vllm_bench import mode


def sweep_modes(params, export_dir: Path, ks: list) -> list:
    """plain, then n-gram (eval.prompt_lookup_min/max) and EAGLE-3 at each k."""
    modes = [mode("plain")]
    for k in ks:
        modes.append(mode("ngram", k, prompt_lookup_min=params.eval.prompt_lookup_min,
                          prompt_lookup_max=params.eval.prompt_lookup_max))
        modes.append(mode("eagle3", k, model=str(export_dir)))
    return modes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--run", default=None, help="run name (default: the profile's run_name)")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--prompts", type=int, default=None, help="default: eval.vllm_prompts or eval.num_prompts")
    ap.add_argument("--export", default=None,
                    help="another vLLM export of this run's drafters, e.g. a 06_scaling point's "
                         "outputs/<run>/scaling/n002000/export (default: the run's own export/)")
    args = ap.parse_args(argv)
    try:
        run = ev.bench_run(args.params, args.run, args.export, args.prompts)
    except FileNotFoundError as err:
        raise SystemExit(str(err)) from None
    params, layout, export_dir, tdir, prompts = run.params, run.layout, run.export_dir, run.target_dir, run.prompts
    t0 = time.time()
    summary, raw = ev.run_vllm_eval(params, tdir, prompts, sweep_modes(params, export_dir, args.k),
                                    layout.root / "bench" / "k_sweep")
    columns = ["method", "k", "prompts", "new_tokens", "tokens_per_s", "speedup", "acceptance_length",
               "same_output_as_plain"]
    print(f"{params.run_name}: {len(prompts)} held-out prompts ({run.skipped} over eval.max_prompt_tokens), "
          f"{params.eval.max_new_tokens} new tokens, T={params.eval.temperature}, {params.eval.vllm_dtype}, "
          f"vLLM {raw['vllm_version']}, {time.time() - t0:.0f} s")
    print(summary[columns].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    stamp = {"date": time.strftime("%Y-%m-%d %H:%M"), "params": args.params, "run": layout.root.name,
             "export": str(export_dir),
             "commit": git_commit(repo_root()), "machine": machine_info(), "prompts": len(prompts)}
    out = params.outputs_root() / "bench" / "k_sweep.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for row in summary[columns].to_dict("records"):
            f.write(json.dumps({**stamp, **row}) + "\n")
    print(f"appended {len(summary)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
