"""Seconds per GB of hidden-state cache verification on this machine (cache.verify_cache's parts):

  sizes    every shard's size and tensor shapes (a stat and the safetensors header), no bytes read
  sampled  sha256 of a seeded --sample share of the shards (cache.sample_shards)
  full     sha256 of every shard, on --workers threads (HiddenCache.hash_problems)

    python bench/verify.py --params params/ci.yaml [--run ci] [--split train] [--workers 1 2]
    python bench/verify.py --synthetic-gb 4 [--shard-mb 256] [--workers 1 2]

--synthetic-gb writes a cache of random states under outputs/bench/verify-cache/ (kept for reruns;
made through cache.CacheWriter, so its shards are real ones) instead of reading a run's cache.
Nothing here writes verified.json. Reads that hit the page cache are faster than the disk: for the
disk's rate use a cache larger than the free memory, or drop the page cache first (root:
`sync; echo 3 > /proc/sys/vm/drop_caches`); the row records which it was (--cold).

Projection (plan): full verification of B bytes on W ranks takes about
B / (W x rate_per_rank) seconds, rate_per_rank the `full` GB/s here (capped by the disk's total
read rate shared by the ranks); sampled takes sample x that; sizes is per shard, not per byte.
Appends one row to outputs/bench/verify.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle3lib import cache as hc
from eagle3lib.params import load_params

HIDDEN = 1024          # synthetic states: bf16 aux [n, 3, H] + final [n, H] = 8 KB per token


def synthetic_cache(folder: Path, gb: float, shard_mb: int) -> Path:
    """A cache of random bf16 states, about `gb` GB in shards of about `shard_mb` MB (reused when a
    complete one of that size is there already)."""
    tokens_per_shard = max(1, shard_mb * 2**20 // (8 * HIDDEN))
    num_shards = max(1, round(gb * 1e9 / (tokens_per_shard * 8 * HIDDEN)))
    manifest = folder / hc.MANIFEST
    if manifest.is_file():
        m = hc.read_manifest(manifest)
        if m.complete and m.num_shards == num_shards and m.shards[0].num_tokens == tokens_per_shard:
            return folder
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("shard-*.safetensors"):
        old.unlink()
    plans = hc.plan_shards([tokens_per_shard] * num_shards, tokens_per_shard, tokens_per_shard)
    header = hc.CacheHeader(format=hc.FORMAT, format_version=hc.FORMAT_VERSION, dtype="bfloat16",
                            aux_layers=[1, 2, 3], hidden_size=HIDDEN, split="bench")
    g = torch.Generator().manual_seed(0)
    with hc.CacheWriter(folder, header, {}, len(plans), manifest) as w:
        for plan in plans:
            n = plan.num_tokens
            w.start_shard(plan, [[1] * n], [[1] * n])
            w.write_rows(torch.randn(n, 3, HIDDEN, generator=g).bfloat16(),       # aux [n, 3, H]
                         torch.randn(n, HIDDEN, generator=g).bfloat16())          # final [n, H]
            w.finish_shard()
    return folder


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/ci.yaml")
    ap.add_argument("--run", default=None, help="run name (default: the profile's run_name)")
    ap.add_argument("--split", default="train")
    ap.add_argument("--synthetic-gb", type=float, default=None, help="verify a synthetic cache of this size")
    ap.add_argument("--shard-mb", type=int, default=256, help="synthetic shard size")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, min(8, os.cpu_count() or 1)],
                    help="hashing threads to measure (one process = one rank)")
    ap.add_argument("--sample", type=float, default=0.05, help="share of shards hashed by `sampled`")
    ap.add_argument("--cold", action="store_true", help="say that the page cache was dropped before")
    args = ap.parse_args(argv)

    params = load_params(args.params)
    if args.synthetic_gb is not None:
        folder = synthetic_cache(params.outputs_root() / "bench" / "verify-cache", args.synthetic_gb, args.shard_mb)
    else:
        folder = params.layout(args.run).hidden(args.split)
    cache = hc.HiddenCache(folder)
    shards = cache.manifest.shards
    total = sum(r.bytes for r in shards)
    sampled = [shards[i] for i in hc.sample_shards(len(shards), args.sample, params.seed)]

    row = {"cache": str(folder), "shards": len(shards), "gb": total / 1e9, "cold": args.cold,
           "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    sizes_s = timed(lambda: [cache.shard_problem(r) for r in shards])
    row["sizes"] = {"seconds": sizes_s, "ms_per_shard": 1e3 * sizes_s / max(1, len(shards))}
    for workers in args.workers:
        full_s = timed(lambda: cache.hash_problems(shards, workers))
        sample_s = timed(lambda: cache.hash_problems(sampled, workers))
        sample_gb = sum(r.bytes for r in sampled) / 1e9
        row[f"full_workers_{workers}"] = {"seconds": full_s, "gb_per_s": total / 1e9 / full_s,
                                          "s_per_gb": full_s / (total / 1e9)}
        row[f"sampled_workers_{workers}"] = {"seconds": sample_s, "shards": len(sampled), "gb": sample_gb,
                                             "s_per_gb_of_cache": sample_s / (total / 1e9)}
    out = params.outputs_root() / "bench" / "verify.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
