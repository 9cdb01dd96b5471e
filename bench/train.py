"""Trainer throughput: input tokens/s and peak RSS of the real training step.

SmolLM2-135M shapes (H=576, 9 heads x 64, 3 kv heads, I=1536, V=49152), draft vocab 8192,
sequences of 256 tokens, ttt_steps 7; random cache data (bf16 aux/final, 70% assistant tokens),
but the full step: labels from the target's lm_head (draft rows + full-vocab top-1), the parallel
TTT forward, the soft cross-entropy, backward, clipping, AdamW.

Each variant runs in its own process (so peak RSS is its own):

    python bench/train.py                       # the default comparison table
    python bench/train.py --variants fp32-manual bf16-manual --steps 6
    python bench/train.py --threads 2           # torch intra-op threads

Variant names: <dtype>-<attention>[-ckpt][-compile], dtype fp32 | bf16 (autocast), attention mask |
merge | manual | chunked | flex (see model.ttt_attention; flex has no backward on CPU, so it runs on
GPUs only), ckpt: activation checkpointing per TTT step; muon: the trainer's Muon choice (fc and
layer weights; Newton-Schulz in fp32 when training in fp32: train.muon_optimizer), muontorch:
torch.optim.Muon whatever the dtype (Newton-Schulz in bf16: emulated, and slow, on an AVX2-only
CPU). Results go to stdout and outputs/bench/train.json.

    python bench/train.py --variants fp32-manual-muon fp32-manual-muontorch --ttt-steps 4 --seq 512 --batch-tokens 1024
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle3lib.dist import Dist
from eagle3lib.model import Eagle3Config, Eagle3Drafter
from eagle3lib.objective import TargetHead, TTTObjective, autocast_for, prepare_batch
from eagle3lib.params import TrainParams
from eagle3lib.train import make_optimizers_for, muon_optimizer, optimizer_step

DEFAULT_VARIANTS = ["fp32-mask", "fp32-merge", "fp32-manual", "fp32-chunked", "fp32-manual-ckpt", "fp32-manual-muon",
                    "bf16-mask", "bf16-merge", "bf16-manual", "bf16-chunked",
                    "fp32-manual-compile", "bf16-manual-compile"]


def one_variant(name: str, steps: int, warmup: int, seq: int, batch_tokens: int, ttt_steps: int) -> dict:
    parts = name.split("-")
    dtype, impl, compiled = parts[0], parts[1], "compile" in parts
    H, V, Dv = 576, 49152, 8192
    cfg = Eagle3Config(hidden_size=H, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None,
                       max_position_embeddings=8192, vocab_size=V, draft_vocab_size=Dv, target_hidden_size=H,
                       aux_layer_ids=[2, 15, 27])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    ids = torch.randperm(V)[:Dv].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab(ids - torch.arange(Dv), t2d)
    drafter.attention_impl = impl
    drafter.activation_checkpointing = "ckpt" in parts
    head = TargetHead(torch.randn(V, H) * 0.05, drafter.d2t)
    objective = TTTObjective(drafter, ttt_steps, 0.8, compile=compiled)   # as train.compile does
    train_params = TrainParams(ttt_steps=ttt_steps, batch_tokens=batch_tokens,
                               dtype="bfloat16" if dtype == "bf16" else "float32",
                               optimizer="muon" if {"muon", "muontorch"} & set(parts) else "adamw")
    optimizers = make_optimizers_for(objective, train_params)
    if "muontorch" in parts:          # what the trainer builds for bf16 training: torch.optim.Muon (bf16 Newton-Schulz)
        optimizers[0] = muon_optimizer(optimizers[0].param_groups[0]["params"],
                                       dataclasses.replace(train_params, dtype="bfloat16"))
    amp = autocast_for(train_params.dtype, "cpu")                         # as the trainer's
    dist = Dist()                                                         # one process: rank 0 of 1

    B = max(1, batch_tokens // seq)
    def batch():
        mask = torch.ones(B, seq, dtype=torch.bool)
        mask[:, : int(0.3 * seq)] = False
        raw = {"input_ids": torch.randint(V, (B, seq)), "loss_mask": mask,
               "aux": torch.randn(B, seq, 3, H).to(torch.bfloat16),
               "final": torch.randn(B, seq, H).to(torch.bfloat16), "lengths": torch.full((B,), seq)}
        return prepare_batch(raw, head, ttt_steps, "cpu")

    times, label_times, first = [], [], None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        prepared = [batch()]
        t1 = time.perf_counter()
        loss, _, _, _ = optimizer_step(objective, optimizers, prepared, train_params, dist, amp)
        t2 = time.perf_counter()
        if i == 0:
            first = t2 - t0                     # includes torch.compile's compilation
        if i >= warmup:
            times.append(t2 - t0)
            label_times.append(t1 - t0)
    tokens = B * seq
    per_step = sorted(times)[len(times) // 2]
    return {"variant": name, "tokens_per_step": tokens, "median_step_s": per_step,
            "tokens_per_s": tokens / per_step, "best_tokens_per_s": tokens / min(times),
            "label_share": sorted(label_times)[len(label_times) // 2] / per_step,
            "first_step_s": first, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loss": loss,
            "threads": torch.get_num_threads()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--omp-active", action="store_true",
                    help="keep OpenMP's default spin-waiting (default here: OMP_WAIT_POLICY=PASSIVE, which "
                         "is much faster when other processes share the cores)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.one:
        if a.threads:
            torch.set_num_threads(a.threads)
        print("RESULT " + json.dumps(one_variant(a.one, a.steps, a.warmup, a.seq, a.batch_tokens, a.ttt_steps)))
        return
    results = []
    for v in a.variants:
        cmd = [sys.executable, __file__, "--one", v, "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--seq", str(a.seq), "--batch-tokens", str(a.batch_tokens), "--ttt-steps", str(a.ttt_steps)]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        env = dict(os.environ)
        if not a.omp_active:
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [l for l in res.stdout.splitlines() if l.startswith("RESULT ")]
        if res.returncode or not line:
            print(f"{v}: FAILED\n{res.stderr[-2000:]}")
            continue
        r = json.loads(line[0][len("RESULT "):])
        results.append(r)
        print(f"{v:24s} {r['tokens_per_s']:8.0f} tok/s (best {r['best_tokens_per_s']:.0f})  "
              f"step {r['median_step_s']:.2f}s  labels {100 * r['label_share']:.0f}%  "
              f"first step {r['first_step_s']:.0f}s  peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    load = os.getloadavg()
    out = Path(a.out) if a.out else Path(__file__).resolve().parents[1] / "outputs" / "bench" / "train.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "cpu_count": os.cpu_count(), "loadavg_end": load,
                               "omp_wait_policy": (None if a.omp_active
                                                   else os.environ.get("OMP_WAIT_POLICY", "PASSIVE")),
                               "results": results}, indent=2))
    print(f"load average at the end: {load} (the CPU is shared: numbers are noisy) -> {out}")


if __name__ == "__main__":
    main()
