"""Time one batched decode step of the target in transformers (the HF regeneration backend's inner loop).

    python bench/hf_decode_step.py --model outputs/models/smollm2-135m-instruct --batch 1 64

For each dtype and batch size: prefill random prompts of --context tokens, then time --steps
greedy decode steps with the KV cache and print ms/step and generated tokens/s. This is the
ceiling for `data.regen_backend: hf` (generate adds its own overhead on top); compare with
vLLM's regeneration rate in 02_data (NOTES.md).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eagle3lib.target import load_target


def decode_step_seconds(model, batch: int, context: int, steps: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, context))    # [B, context]
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)  # nxt: [B, 1]
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="outputs/models/smollm2-135m-instruct")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    for dtype in args.dtype:
        model = load_target(Path(args.model), dtype)
        for batch in args.batch:
            dt = decode_step_seconds(model, batch, args.context, args.steps)
            print(f"{dtype} batch {batch}: {dt * 1000:.0f} ms/step, {batch / dt:.0f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
