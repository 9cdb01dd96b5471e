"""Why the training-time acceptance estimate and decoding's acceptance length differ.

For a run's trained drafter (outputs/<run>/train/final/) on the held-out hidden-state cache:
  - the product estimate 1 + sum_j prod_{i<=j} acc_j over all assistant positions (what 04_train
    reports as "estimated acceptance length");
  - chain decoding replayed on each sequence's first answer (objective.replay_chain), over the whole
    answer and over its first --max-answer-tokens tokens (05_eval decodes eval.max_new_tokens);
  - step-0 accuracy by position in the first answer (buckets of 32 tokens).

    python bench/heldout_acceptance.py --params params/local.yaml [--run local] [--k 4]

Appends one row to outputs/bench/heldout_acceptance.jsonl.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from eagle3lib.cache import HiddenCache
from eagle3lib.export import load_drafter
from eagle3lib.objective import acceptance_estimate, build_scoring, replay_chain
from eagle3lib.params import load_params
from eagle3lib.target import target_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--run", default=None, help="run name (default: the profile's run_name)")
    ap.add_argument("--k", type=int, default=None, help="drafts per round (default: eval.k)")
    ap.add_argument("--max-answer-tokens", type=int, default=None, help="default: eval.max_new_tokens")
    ap.add_argument("--sequences", type=int, default=10**9, help="held-out sequences (default: all)")
    ap.add_argument("--split", choices=("eval", "train"), default="eval",
                    help="cache split; 'train' measures the generalisation gap on seen sequences")
    args = ap.parse_args(argv)

    params = load_params(args.params)
    layout = params.layout(args.run)
    k = args.k or params.eval.k
    max_answer = args.max_answer_tokens or params.eval.max_new_tokens
    drafter = load_drafter(layout.final, target_path(params)).eval()   # fc folded: reads raw aux
    J = max(k, params.train.ttt_steps)                               # steps to unroll (>= k)
    scoring = build_scoring(params, layout, drafter, "cpu", ttt_steps=J)  # the trainer's head, objective, autocast
    batches = scoring.heldout(HiddenCache(layout.hidden(args.split)), args.sequences, params.train.batch_tokens, "cpu")
    objective, amp = scoring.objective, scoring.amp

    t0 = time.time()
    stats = torch.zeros(J, 3, dtype=torch.float64)
    whole, first = [0, 0], [0, 0]                                    # [rounds, accepted]
    by_pos: dict = {}                                                # answer-position bucket -> [hits, n]
    sequences = 0
    with torch.no_grad():
        for batch in batches:
            with amp():
                _, s, correct = objective(batch, torch.ones(J, dtype=torch.float64), flags=True)
            stats += s
            b, u = batch["tgt_b"], batch["tgt_u"]
            for row in b.unique().tolist():
                sel = b == row
                uu, cc = u[sel], correct[sel]
                sequences += 1
                for acc, limit in ((whole, None), (first, max_answer)):
                    r, a = replay_chain(uu, cc, k, limit)
                    acc[0] += r
                    acc[1] += a
                end = 0                                              # first answer = first contiguous run
                while end + 1 < len(uu) and uu[end + 1] == uu[end] + 1:
                    end += 1
                for i in range(1, end + 1):                          # step 0 at label uu[i], anchor uu[i]-1
                    bucket = min((i - 1) // 32, 7)
                    hits = by_pos.setdefault(bucket, [0, 0])
                    hits[0] += int(cc[i, 0])
                    hits[1] += 1
    n = stats[:, 2].clamp(min=1)
    acc = (stats[:, 1] / n).tolist()
    row = {"run": str(layout.root), "split": args.split, "k": k, "ttt_steps": J, "sequences": sequences,
           "step_acc_all_positions": [round(a, 4) for a in acc],
           "product_estimate": round(acceptance_estimate(acc[:k]), 4),
           "replayed_whole_first_answer": round(1 + whole[1] / max(1, whole[0]), 4), "rounds_whole": whole[0],
           f"replayed_first_{max_answer}_tokens": round(1 + first[1] / max(1, first[0]), 4),
           "rounds_first": first[0],
           "step0_acc_by_answer_position": {f"{32 * b}-{32 * b + 31}" if b < 7 else f"{32 * b}+":
                                            round(h / max(1, m), 4) for b, (h, m) in sorted(by_pos.items())},
           "wall_s": round(time.time() - t0, 1)}
    out = params.outputs_root() / "bench" / "heldout_acceptance.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
