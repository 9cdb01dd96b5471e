"""A smaller draft vocabulary in vLLM: tokens/s and acceptance of a trained drafter's head cut to the
most frequent N of its draft tokens (NOTES.md, Decisions: Draft vocabulary size).

The drafter's lm_head is its largest matrix (8,192 x 576 of its 10.4 M parameters on local) and runs
at every draft step, so a smaller draft vocabulary makes each step cheaper and can propose fewer
tokens. This measures both sides without retraining: vocab.shrink_draft_vocab keeps the N draft
tokens most frequent among the run's training answers (data/train, loss-masked tokens), and
Eagle3Drafter.with_draft_rows keeps those rows of the head. The cut head proposes exactly the full
head's token wherever that token is kept, so its acceptance is a lower bound for a drafter trained
with data.draft_vocab_size = N (which needs a new 02 and 03).

One vLLM subprocess decodes plain, then the full export and each cut one as eagle3 at k = eval.k,
T = eval.temperature, one request at a time, on the first --prompts held-out prompts (at T = 0 in
fp32 every output must equal plain's). Prints one row per mode with the held-out coverage of its
vocabulary, and appends the rows with the date, commit and machine to outputs/bench/draft_vocab.jsonl.

    python bench/draft_vocab.py --params params/local.yaml --export outputs/local/scaling/n002000/export \
        --sizes 4096 2048 [--prompts 10]

Timings need an otherwise idle machine: a second job on the 2 cores halves every rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eagle3lib import scaling as sc
from eagle3lib.export import export_layout, export_vllm, load_export
from eagle3lib.extract import load_split
from eagle3lib.params import load_params, repo_root
from eagle3lib.report import git_commit, machine_info
from eagle3lib.target import target_path
from eagle3lib.vocab import count_assistant_tokens, coverage, shrink_draft_vocab


def answer_counts(layout, split: str, vocab_size: int):
    """Target-token frequencies [V] over the loss-masked (assistant) tokens of data/<split>."""
    ds = load_split(layout, split)
    return count_assistant_tokens(zip(ds["input_ids"], ds["loss_mask"]), vocab_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--run", default=None, help="run name (default: the profile's run_name)")
    ap.add_argument("--export", default=None, help="a vLLM export of a drafter trained on this run's data "
                    "(default: the run's own export/)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 2048], help="cut draft vocabulary sizes")
    ap.add_argument("--prompts", type=int, default=None, help="vLLM prompts (default: eval.vllm_prompts)")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    layout = params.layout(args.run)
    export_dir = Path(args.export).resolve() if args.export else layout.export
    if not (export_dir / "config.json").is_file():
        raise SystemExit(f"{export_dir}: no export; run 05_eval first (eagle3 run --params {args.params} --only eval)")
    tdir = target_path(params)
    drafter = load_export(export_dir, tdir)
    Dv, V = drafter.config.draft_vocab_size, drafter.config.vocab_size
    bad = [n for n in args.sizes if not 1 <= n < Dv]
    if bad:
        raise SystemExit(f"--sizes {bad}: each must be in 1..{Dv - 1} (smaller than the export's draft vocabulary)")
    train_counts, eval_counts = answer_counts(layout, "train", V), answer_counts(layout, "eval", V)   # [V] each

    workdir = layout.root / "bench" / "draft_vocab"
    exports = {f"eagle3_dv{Dv}": export_dir}
    held_out = {f"eagle3_dv{Dv}": coverage(eval_counts, drafter.t2d)}
    for n in sorted(args.sizes, reverse=True):
        rows, d2t, t2d = shrink_draft_vocab(drafter.d2t, train_counts, n)
        small = drafter.with_draft_rows(rows, d2t, t2d)
        name = f"eagle3_dv{n}"
        exports[name] = export_vllm(small, workdir / name, tdir, layout=export_layout(export_dir), k=params.eval.k)
        held_out[name] = coverage(eval_counts, t2d)

    t0 = time.time()
    summary, raw, _ = sc.vllm_compare(params, layout, exports, workdir / "vllm", limit=args.prompts)
    summary["held_out_coverage"] = summary["method"].map(held_out)
    columns = ["method", "k", "prompts", "new_tokens", "tokens_per_s", "speedup", "acceptance_length",
               "held_out_coverage", "same_output_as_plain"]
    print(f"{layout.root.name}: {export_dir} (draft vocabulary {Dv}) cut to {sorted(args.sizes, reverse=True)}; "
          f"T={params.eval.temperature}, {params.eval.vllm_dtype}, vLLM {raw['vllm_version']}, "
          f"{time.time() - t0:.0f} s")
    print(summary[columns].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    stamp = {"date": time.strftime("%Y-%m-%d %H:%M"), "params": args.params, "run": layout.root.name,
             "export": str(export_dir), "commit": git_commit(repo_root()), "machine": machine_info()}
    out = params.outputs_root() / "bench" / "draft_vocab.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for row in summary[columns].to_dict("records"):
            f.write(json.dumps({**stamp, **row}, default=str) + "\n")
    print(f"appended {len(summary)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
