"""Why the training-time acceptance estimate and decoding's acceptance length differ.

For a run's trained drafter (outputs/<run>/train/final/) on the held-out hidden-state cache:
  - the product estimate 1 + sum_j prod_{i<=j} acc_j over all assistant positions (what 04_train
    reports as "estimated acceptance length");
  - chain decoding replayed on each sequence's first answer (train.replay_chain), over the whole
    answer and over its first --max-answer-tokens tokens (05_eval decodes eval.max_new_tokens);
  - step-0 accuracy by position in the first answer (buckets of 32 tokens).

    python bench/heldout_acceptance.py --params params/local.yaml [--run local] [--k 4]

Appends one row to outputs/bench/heldout_acceptance.jsonl.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3lib.params import load_params  # noqa: E402


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

    from eagle3lib.export import load_drafter
    from eagle3lib.extract import HiddenCache
    from eagle3lib.target import load_target_tensors, target_path
    from eagle3lib.train import (TargetHead, TTTObjective, acceptance_estimate, heldout_batches,
                                 replay_chain)
    from eagle3lib.vocab import load_vocab

    P = load_params(args.params)
    run_dir = P.run_dir(args.run)
    k = args.k or P.eval.k
    max_answer = args.max_answer_tokens or P.eval.max_new_tokens
    final = run_dir / "train" / "final"
    tdir = target_path(P)
    drafter = load_drafter(final, tdir).eval()                       # fc folded: reads raw aux
    J = max(k, P.train.ttt_steps)                                    # steps to unroll (>= k)
    d2t, _ = load_vocab(run_dir / "data" / "vocab.safetensors")
    head = TargetHead(load_target_tensors(tdir, ("lm_head",))["lm_head"], d2t)
    cache = HiddenCache(run_dir / "hidden" / args.split)
    batches = heldout_batches(cache, args.sequences, head, J, P.train.batch_tokens, "cpu")
    objective = TTTObjective(drafter, J, P.train.decay)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if P.train.dtype == "bfloat16" \
        else contextlib.nullcontext

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
    row = {"run": str(run_dir), "split": args.split, "k": k, "ttt_steps": J, "sequences": sequences,
           "step_acc_all_positions": [round(a, 4) for a in acc],
           "product_estimate": round(acceptance_estimate(acc[:k]), 4),
           "replayed_whole_first_answer": round(1 + whole[1] / max(1, whole[0]), 4), "rounds_whole": whole[0],
           f"replayed_first_{max_answer}_tokens": round(1 + first[1] / max(1, first[0]), 4),
           "rounds_first": first[0],
           "step0_acc_by_answer_position": {f"{32 * b}-{32 * b + 31}" if b < 7 else f"{32 * b}+":
                                            round(h / max(1, m), 4) for b, (h, m) in sorted(by_pos.items())},
           "wall_s": round(time.time() - t0, 1)}
    out = P.outputs_root() / "bench" / "heldout_acceptance.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
