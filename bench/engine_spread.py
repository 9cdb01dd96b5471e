"""How much of 05's EAGLE-3 / n-gram ratio is the drafter and how much the engine start (NOTES.md,
Profiles and the hour).

05 measures each method once, on one engine start each. This bench repeats that measurement: for
`--rounds` rounds, one vLLM subprocess starts plain, n-gram and EAGLE-3 engines in turn (at k =
eval.k, the run's held-out prompts, one request at a time, T = eval.temperature), a fresh engine per
mode and round, with the order rotated each round so that no method always runs first. Per round
it prints tokens/s, acceptance, the ratio EAGLE-3 / n-gram and each method's cost per round in
plain decode steps (acceptance x plain tokens/s / method tokens/s); then the mean, the spread
(min-max) and the standard deviation across rounds. Acceptance and outputs are deterministic at
T = 0, so every difference between rounds is timing. Rows go to outputs/bench/engine_spread.jsonl.

    python bench/engine_spread.py --params params/local.yaml [--run local] [--rounds 3] [--prompts 20]

Timings need an otherwise idle machine: a second job on the 2 cores halves every rate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from eagle3lib import evaluate as ev
from eagle3lib.params import repo_root
from eagle3lib.report import git_commit, machine_info

METHODS = ("plain", "ngram", "eagle3")


def round_modes(params, export_dir: Path, k: int, rounds: int) -> list:
    """05's modes (evaluate.vllm_modes: plain, n-gram and EAGLE-3 at k), `rounds` times, named
    <method>_r<round>; round r starts r - 1 places further along METHODS."""
    base = ev.vllm_modes([(k, params.eval.prompt_lookup_min, params.eval.prompt_lookup_max)], export_dir, k)
    assert tuple(m.method for m in base) == METHODS
    modes = []
    for r in range(rounds):
        start = r % len(base)
        modes += [replace(m, name=f"{m.method}_r{r + 1}") for m in base[start:] + base[:start]]
    return modes


def round_rows(summary, rounds: int) -> list:
    """One dict per round: each method's tokens/s and acceptance, EAGLE-3 / n-gram, costs per round."""
    by_name = {row["method"]: row for row in summary.to_dict("records")}
    rows = []
    for r in range(1, rounds + 1):
        plain, ngram, eagle = (by_name[f"{m}_r{r}"] for m in METHODS)
        all_same = f"{plain['prompts']}/{plain['prompts']}"                 # every output equals plain's
        rows.append({
            "round": r, "order": [m for m in by_name if m.endswith(f"_r{r}")],
            "plain_tps": plain["tokens_per_s"], "ngram_tps": ngram["tokens_per_s"],
            "eagle3_tps": eagle["tokens_per_s"],
            "ngram_acceptance": ngram["acceptance_length"], "eagle3_acceptance": eagle["acceptance_length"],
            "eagle3_vs_ngram": eagle["tokens_per_s"] / ngram["tokens_per_s"],
            # seconds per speculative round, in plain decode steps
            "ngram_round_cost": ngram["acceptance_length"] * plain["tokens_per_s"] / ngram["tokens_per_s"],
            "eagle3_round_cost": eagle["acceptance_length"] * plain["tokens_per_s"] / eagle["tokens_per_s"],
            "lossless": ngram["same_output_as_plain"] == all_same and eagle["same_output_as_plain"] == all_same,
        })
    return rows


def spread(values: list) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"mean {statistics.fmean(values):.3f}, min {min(values):.3f}, max {max(values):.3f}, sd {sd:.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--run", default=None, help="run name (default: the profile's run_name)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=None, help="default: eval.vllm_prompts or eval.num_prompts")
    ap.add_argument("--export", default=None, help="another vLLM export (default: the run's export/)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    try:
        run = ev.bench_run(args.params, args.run, args.export, args.prompts)
    except FileNotFoundError as err:
        raise SystemExit(str(err)) from None
    params, layout, export_dir, tdir, prompts = run.params, run.layout, run.export_dir, run.target_dir, run.prompts
    k = params.eval.k
    t0 = time.time()
    summary, raw = ev.run_vllm_eval(params, tdir, prompts, round_modes(params, export_dir, k, args.rounds),
                                    layout.root / "bench" / "engine_spread")
    rows = round_rows(summary, args.rounds)
    print(f"{params.run_name}: {len(prompts)} held-out prompts, k = {k}, {params.eval.max_new_tokens} new tokens, "
          f"T={params.eval.temperature}, {params.eval.vllm_dtype}, vLLM {raw['vllm_version']}, "
          f"{args.rounds} rounds, {time.time() - t0:.0f} s")
    for row in rows:
        print(f"round {row['round']} ({' -> '.join(row['order'])}): plain {row['plain_tps']:.2f}, "
              f"n-gram {row['ngram_tps']:.2f} (acc {row['ngram_acceptance']:.3f}, cost {row['ngram_round_cost']:.3f}), "
              f"EAGLE-3 {row['eagle3_tps']:.2f} (acc {row['eagle3_acceptance']:.3f}, "
              f"cost {row['eagle3_round_cost']:.3f}) tok/s: EAGLE-3 / n-gram {row['eagle3_vs_ngram']:.3f}, "
              f"lossless {row['lossless']}")
    for key in ("eagle3_vs_ngram", "eagle3_round_cost", "ngram_round_cost", "plain_tps"):
        print(f"{key}: {spread([row[key] for row in rows])}")
    stamp = {"date": time.strftime("%Y-%m-%d %H:%M"), "params": args.params, "run": layout.root.name,
             "export": str(export_dir), "k": k, "commit": git_commit(repo_root()), "machine": machine_info(),
             "prompts": len(prompts)}
    out = params.outputs_root() / "bench" / "engine_spread.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for row in rows:
            f.write(json.dumps({**stamp, **row}) + "\n")
    print(f"appended {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
