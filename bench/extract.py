"""Extraction throughput on the embedded SmolLM2 target versus a bare HF forward of the same batches.

    python bench/extract.py [--batches 3] [--batch 8] [--seq 256] [--rounds 2] [--dtype bfloat16] [--threads N]
    python bench/extract.py --backends [--batches 3] [--batch 8] [--seq 256] [--dtype float32]

--backends compares the whole stage with extract.backend hf against vllm (extract_vllm.py) on the same
random batches: tokens/s of the forwards + writes (engine start and model load excluded, reported
apart) and bytes/token of the cache. Use float32 on an AVX2-only CPU (bf16 is emulated there).

Each method runs over the same batches of random token ids, once per round, in one process:
  bare forward           model.model(ids, mask): the decoder alone, no capture (the baseline)
  extract_hidden_states  the whole stage: capture + safetensors shards + sha256 + manifest
  capture only (hooks)   HiddenStateCapture: pre-hooks on the 3 aux layers + final state, to CPU
  output_hidden_states   the alternative: model.model(..., output_hidden_states=True), pick 3 + final
The stage must run at >= 0.9x the bare forward. The order rotates every round so that load
drift hits every method; wall and process CPU time are both reported (this CPU is shared).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from eagle3lib.extract import HiddenStateCapture, extract_hidden_states
from eagle3lib.params import load_params
from eagle3lib.target import load_target, target_path, torch_dtype


def timed(fn) -> tuple:
    """(wall seconds, CPU seconds of this process, all threads)."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def bare_forward(model, ids, mask):
    with torch.inference_mode():
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)


def output_hidden_states_capture(model, ids, mask, aux_layers, dtype):
    """What the hooks replace: keep all N+1 states, then pick the aux ones and the final one."""
    with torch.inference_mode():
        hs = model.model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states
        rows = mask.reshape(-1).nonzero().squeeze(1)
        H = hs[-1].shape[-1]
        aux = torch.stack([hs[k].reshape(-1, H)[rows] for k in aux_layers], dim=1).to(dtype).cpu()  # [n, 3, H]
        final = hs[-1].reshape(-1, H)[rows].to(dtype).cpu()                                         # [n, H]
    return aux, final


def random_dataset(batches: int, batch: int, seq: int, vocab: int):
    from datasets import Dataset
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (seq,), generator=gen).tolist() for _ in range(batches * batch)]
    return Dataset.from_dict({"conv_id": [str(i) for i in range(len(rows))], "input_ids": rows,
                              "loss_mask": [[1] * seq for _ in rows]})


def compare_backends(args) -> dict:
    """extract.backend hf vs vllm: the whole stage on the same rows, fresh cache each."""
    base_params = load_params(args.params)
    path = target_path(base_params)
    ds = random_dataset(args.batches, args.batch, args.seq, base_params.target_shape()["vocab_size"])
    results = {}
    for backend in ("hf", "vllm"):
        with tempfile.TemporaryDirectory(prefix=f"bench-extract-{backend}-") as tmp:
            params = load_params(args.params, overrides={
                "output_dir": tmp, "target": {"path": str(path), "dtype": args.dtype},
                "data": {"max_length": args.seq},
                "extract": {"backend": backend, "batch_tokens": args.batch * args.seq,
                            "shard_tokens": 2 * args.batch * args.seq}})
            t0 = time.perf_counter()
            s = extract_hidden_states(params, params.layout(), "train", dataset=ds, progress=False)
            total = time.perf_counter() - t0
        results[backend] = {"tokens": s["tokens_computed"], "seconds": s["seconds"], "tokens_per_s": s["tokens_per_s"],
                            "start_s": total - s["seconds"], "bytes_per_token": s["bytes_per_token"]}
    print(f"target {path.name} ({args.dtype}), cache {base_params.extract.dtype}; {args.batches} batches of "
          f"{args.batch} x {args.seq} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'backend':<8}{'tokens':>8}{'stage s':>9}{'tok/s':>8}{'start s':>9}{'bytes/token':>13}")
    for name, r in results.items():
        print(f"{name:<8}{r['tokens']:>8}{r['seconds']:9.2f}{r['tokens_per_s']:8.0f}{r['start_s']:9.1f}"
              f"{r['bytes_per_token']:13.1f}")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--backends", action="store_true", help="compare extract.backend hf vs vllm")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.backends:
        return compare_backends(args)

    params = load_params(args.params)
    path = target_path(params)
    model = load_target(path, args.dtype)
    aux_layers = params.aux_layer_ids()
    cache_dtype = torch_dtype(params.extract.dtype)
    H = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen)
               for _ in range(args.batches)]
    mask = torch.ones(args.batch, args.seq, dtype=torch.long)
    tokens = args.batches * args.batch * args.seq
    print(f"target {path.name} ({args.dtype}), aux layers {aux_layers}, H={H}; {args.batches} batches of "
          f"{args.batch} x {args.seq} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads")

    bare_forward(model, batches[0][:2, :64], mask[:2, :64])     # warm-up
    from datasets import Dataset
    ds = Dataset.from_dict({"conv_id": [str(i) for i in range(args.batches * args.batch)],
                            "input_ids": [row.tolist() for ids in batches for row in ids],
                            "loss_mask": [[1] * args.seq for _ in range(args.batches * args.batch)]})
    cap = HiddenStateCapture(model, aux_layers)
    summaries = []

    def run_stage(tmp):
        stage_params = load_params(args.params, overrides={
            "output_dir": tmp, "extract": {"batch_tokens": args.batch * args.seq,
                                           "shard_tokens": 2 * args.batch * args.seq}})
        summaries.append(extract_hidden_states(stage_params, stage_params.layout(), "train", model=model, dataset=ds,
                                               progress=False))

    methods = {
        "bare forward": lambda tmp: [bare_forward(model, ids, mask) for ids in batches],
        "extract_hidden_states": run_stage,
        "capture only (hooks)": lambda tmp: [[t.cpu() for t in cap(ids, mask, cache_dtype)] for ids in batches],
        "output_hidden_states": lambda tmp: [output_hidden_states_capture(model, ids, mask, aux_layers, cache_dtype)
                                             for ids in batches],
    }
    times = {name: [] for name in methods}       # per round: (wall, cpu)
    names = list(methods)
    try:
        for r in range(args.rounds):               # rotate the order so drift hits every method
            for name in names[r % len(names):] + names[:r % len(names)]:
                with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
                    times[name].append(timed(lambda: methods[name](tmp)))
    finally:
        cap.close()

    print(f"\n{'method':<24}{'wall s':>8}{'tok/s':>8}{'vs bare':>9}{'cpu s':>8}{'vs bare':>9}"
          f"{'median of rounds':>18}")
    bare_w = sum(w for w, _ in times["bare forward"])
    bare_c = sum(c for _, c in times["bare forward"])
    n_tok = tokens * args.rounds
    for name, ts in times.items():
        w, c = sum(t[0] for t in ts), sum(t[1] for t in ts)
        # bare / method within each round (the two ran minutes apart at most): robust to slow drift
        per_round = statistics.median(b[0] / t[0] for b, t in zip(times["bare forward"], ts))
        print(f"{name:<24}{w:8.2f}{n_tok / w:8.0f}{bare_w / w:9.3f}{c:8.2f}{bare_c / c:9.3f}{per_round:18.3f}")
    summary = summaries[-1]
    ideal = 2 * 4 * H if params.extract.dtype != "float32" else 4 * 4 * H
    bpt = summary["bytes_per_token"]
    print(f"\ncache: {summary['bytes_total']} bytes, {bpt:.1f} bytes/token = {ideal} ({params.extract.dtype} x 4H) "
          f"+ {bpt - ideal:.1f} ({100 * (bpt - ideal) / ideal:.2f}% ids/mask/offsets/header)")
    print("per round wall s: " + "; ".join(f"{k} " + ", ".join(f"{t[0]:.2f}" for t in v) for k, v in times.items()))
    ratio = bare_w / sum(t[0] for t in times["extract_hidden_states"])
    return {"ratio_wall": ratio, "bytes_per_token": bpt}


if __name__ == "__main__":
    main()
