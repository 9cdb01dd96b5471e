"""The b300 profile's drafter at Kimi-K2.5 shapes: the memory model's estimate on any machine and,
on a GPU, one rank's measured training-step tokens/s and peak memory.

    python bench/kimi_shapes.py                        # meta estimate at 2,048 and 4,096 (any machine)
    python bench/kimi_shapes.py --gpu --steps 4        # + the real step on cuda:0 (one rank)
    python bench/kimi_shapes.py --gpu --batch-tokens 16384 --attention flex chunked

The drafter is built from params/b300.yaml (H=7168, 64 heads, I=18432, target vocab 163,840,
draft vocab 32,000, ttt_steps 7) with random weights and random inputs (aux states, token ids,
soft labels): the step's cost and memory do not depend on the values. One rank, no FSDP: the
optimizer state and gradients are whole here (the estimate for 8 ranks shards them).
Results are printed and written to outputs/bench/kimi_shapes.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from eagle3lib.memory import drafter_config, estimate, format_estimate, meta_batch
from eagle3lib.model import Eagle3Drafter
from eagle3lib.objective import TTTObjective
from eagle3lib.params import load_params


def profile(attention: str, checkpointing: bool, nproc: int):
    params = load_params("params/b300.yaml")
    return dataclasses.replace(params, train=dataclasses.replace(
        params.train, attention=attention, activation_checkpointing=checkpointing, nproc=nproc))


def random_batch(params, config, sequences: int, seq_len: int, device) -> dict:
    """meta_batch's shapes with random values: aux bf16, ids in the vocab, soft labels summing to 1."""
    b = meta_batch(params, config, sequences, seq_len, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    b["aux"] = torch.randn(b["aux"].shape, generator=g, device=device).to(b["aux"].dtype)
    b["input_ids"] = torch.randint(config.vocab_size, b["input_ids"].shape, generator=g, device=device)
    b["target_p"] = torch.softmax(torch.randn(b["target_p"].shape, generator=g, device=device), -1)
    b["target_top"] = torch.randint(config.vocab_size, b["target_top"].shape, generator=g, device=device)
    return b


def gpu_step_rate(params, seq_len: int, batch_tokens: int, steps: int) -> dict:
    """Tokens/s and peak memory of forward + backward + AdamW on cuda:0 (bf16 autocast, fp32 weights)."""
    device = torch.device("cuda:0")
    config = drafter_config(params)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).to(device)
    drafter.configure_training(params.train.attention, params.train.activation_checkpointing, device)
    objective = TTTObjective(drafter, params.train.ttt_steps, params.train.decay)
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-4)
    batch = random_batch(params, config, batch_tokens // seq_len, seq_len, device)
    denominators = torch.full((params.train.ttt_steps,), float(batch["tgt_b"].numel()), dtype=torch.float64,
                              device=device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(steps + 1):                   # step 0: warm-up (compilation, allocator)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = objective(batch, denominators)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - t0)
    tokens = (batch_tokens // seq_len) * seq_len
    return {"seq_len": seq_len, "batch_tokens": tokens, "attention": drafter.attention_impl,
            "activation_checkpointing": params.train.activation_checkpointing, "steps": steps,
            "tokens_per_s": tokens / (sum(times) / len(times)), "step_s": sum(times) / len(times),
            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--attention", nargs="+", default=["flex"])
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the profile's train.batch_tokens")
    ap.add_argument("--gpu", action="store_true", help="also run the real step on cuda:0")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for attention in a.attention:
        for seq in a.seq:
            params = profile(attention, not a.no_checkpointing, nproc=1)
            batch_tokens = a.batch_tokens or params.train.batch_tokens
            est = estimate(params, seq, batch_tokens, "cuda")
            print(format_estimate(est, params.train.gpu_memory_gb), flush=True)
            row = {"attention": attention, "seq_len": seq, "batch_tokens": batch_tokens,
                   "estimate_one_rank_peak_gb": est.peak_bytes / 1e9}
            if a.gpu:
                row.update(gpu_step_rate(params, seq, batch_tokens, a.steps))
                print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path("outputs/bench/kimi_shapes.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
