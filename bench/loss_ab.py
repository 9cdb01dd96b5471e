"""Training loss A/B at a study point's horizon: forward KL (the EAGLE-3 recipe) against an LK loss.

LK losses (Samarin et al., arXiv 2602.23881) optimise the acceptance rate alpha = sum_v min(p_v, q_v)
directly (train.loss: lk = -log alpha, lk_hybrid = a KL / (1 - alpha) blend). On a finished
06_scaling run this trains the point with --chats chats again with --loss (in its own folder,
outputs/<run>/scaling/n<N>-<loss>/, the same chats, epochs and every other setting as the study's
point), re-reads the study's KL point (training it if it is missing), and scores both:
  - replayed held-out acceptance (the hidden-state cache, k = train.ttt_steps);
  - in vLLM: one subprocess, plain then both exports as eagle3 at k = eval.k, T = eval.temperature,
    on the first --prompts held-out prompts (outputs must equal plain's at T = 0 in fp32).
Prints a table and appends it with the date, commit and machine to outputs/bench/loss_ab.jsonl.

    python bench/loss_ab.py --params params/local.yaml --chats 2000 --loss lk_hybrid [--prompts 20]

Resumable: both points resume from their checkpoints.
"""
from __future__ import annotations

import argparse
import json
import time

from eagle3lib import scaling as sc
from eagle3lib.objective import LOSS_CHOICES
from eagle3lib.params import load_params, repo_root
from eagle3lib.report import git_commit, machine_info
from eagle3lib.target import target_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--run", default=None, help="run name (default: the profile's run_name)")
    ap.add_argument("--chats", type=int, required=True, help="the study point (one of scaling.sizes or any N)")
    ap.add_argument("--loss", choices=[c for c in LOSS_CHOICES if c != "kl"], default="lk_hybrid")
    ap.add_argument("--prompts", type=int, default=None, help="vLLM prompts (default: eval.vllm_prompts)")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    if params.train.loss != "kl":
        raise SystemExit(f"{args.params}: train.loss is {params.train.loss!r}; the A/B's baseline is the profile's "
                         "recipe with train.loss kl")
    layout = params.layout(args.run)
    t0 = time.time()
    rows = [sc.train_point(params, layout, args.chats),
            sc.train_point(params, layout, args.chats, variant=args.loss, loss=args.loss)]
    for row, loss in zip(rows, ("kl", args.loss)):
        row["loss"] = loss
    if not args.no_vllm:
        K = params.eval.k
        exports = {f"eagle3_{row['loss']}_k{K}": sc.export_point(params, row["final_dir"], target_path(params))
                   for row in rows}
        summary, raw, same = sc.vllm_compare(params, layout, exports, layout.eval_work("loss_ab"), limit=args.prompts)
        print(same)
        for row in rows:
            m = summary[summary["method"] == f"eagle3_{row['loss']}_k{K}"].iloc[0]
            row.update(vllm_acceptance_length=float(m["acceptance_length"]), vllm_speedup=float(m["speedup"]),
                       vllm_tokens_per_s=float(m["tokens_per_s"]), vllm_prompts=int(m["prompts"]), k=K)
    print(f"{'loss':10s} {'steps':>6s} {'acc0':>6s} {'replayed':>9s} {'vLLM acc len':>13s} {'speedup':>8s}")
    for r in rows:
        print(f"{r['loss']:10s} {r['steps']:6d} {r['acc0']:6.3f} {r['acceptance_replayed']:9.3f} "
              f"{r.get('vllm_acceptance_length', float('nan')):13.3f} {r.get('vllm_speedup', float('nan')):8.3f}")
    out = repo_root() / "outputs" / "bench" / "loss_ab.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": git_commit(repo_root()),
                            "machine": machine_info(), "params": args.params, "chats": args.chats,
                            "epochs": params.scaling.epochs, "seconds": round(time.time() - t0),
                            "rows": [{k: v for k, v in r.items() if k != "final_dir"} for r in rows]}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
