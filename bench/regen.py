"""vLLM regeneration speed on this CPU by vLLM's process layout (02_data's engine, engine.engine_env).

    python bench/regen.py [--params params/local.yaml] [--chats 64] [--layouts default in-process in-process-all-cores]

Regenerates the profile's first `--chats` training chats (those 02_data takes first) into a
temporary folder under outputs/bench/ once per layout, each in a fresh vLLM child:
  default                vLLM's own layout: engine-core and worker processes, one core kept for the scheduler
  in-process             VLLM_ENABLE_V1_MULTIPROCESSING=0 (what 02 uses on a CPU with one worker)
  in-process-all-cores   the same and VLLM_CPU_NUM_OF_RESERVED_CPU=0: the worker's threads take every core
Reports seconds (engine start included), new tokens and tokens/s, and whether every layout produced
the same tokens (bf16: batch composition can move a greedy choice; fp32 should not). Results go to
stdout and outputs/bench/regen.json. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

from eagle3lib.chats import held_out_chats
from eagle3lib.data import select_train
from eagle3lib.files import atomic_write_json
from eagle3lib.layout import RunLayout
from eagle3lib.params import load_params
from eagle3lib.regenerate import load_results, regen_key, regenerate_chats
from eagle3lib.target import load_tokenizer, target_path

LAYOUTS = {"default": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
           "in-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
           "in-process-all-cores": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}


def first_chats(params, n: int) -> list[dict]:
    """The first n training chats 02_data would regenerate for the profile (same pool, same order)."""
    tokenizer = load_tokenizer(target_path(params), params.target.trust_remote_code)
    _, pool, _ = held_out_chats(params)
    chats, _ = select_train(tokenizer, pool, n, params.data.max_length, False, params.data.thinking)
    if len(chats) < n:
        raise SystemExit(f"bench/regen.py: the profile's sources hold {len(chats)} usable chats, "
                         f"fewer than --chats {n}")
    return chats


def regenerate_once(params, chats: list[dict], layout: str, folder: Path) -> dict:
    run_params = dataclasses.replace(params, output_dir=str(folder))
    with mock.patch.dict(os.environ, LAYOUTS[layout]):       # the vLLM child inherits the layout
        t0 = time.perf_counter()
        kept, _ = regenerate_chats(run_params, run_params.run_dir(), chats, progress=False)
        seconds = time.perf_counter() - t0
    results = load_results(RunLayout(run_params.run_dir()).regen(regen_key(run_params)))
    new_tokens = sum(r["new_tokens"] for r in results.values())
    return {"layout": layout, "seconds": round(seconds, 1), "new_tokens": new_tokens,
            "tokens_per_s": round(new_tokens / seconds, 1), "kept": len(kept),
            "answers": {r["id"]: r["messages"] for r in results.values()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--chats", type=int, default=64)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args(argv)
    params = load_params(args.params)
    params.data.regen_backend = "vllm"
    chats = first_chats(params, args.chats)
    rows = []
    bench_dir = params.outputs_root() / "bench"
    bench_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="regen-", dir=bench_dir) as tmp:   # inside outputs/, removed after
        for layout in args.layouts:
            rows.append(regenerate_once(params, chats, layout, Path(tmp) / layout))
            r = rows[-1]
            print(f"{layout:<22}{r['seconds']:>8.1f} s{r['new_tokens']:>9} new tokens{r['tokens_per_s']:>9.1f} tok/s",
                  flush=True)
    same = all(r["answers"] == rows[0]["answers"] for r in rows[1:])
    print(f"\n{len(chats)} chats, {params.data.regen_max_new_tokens} new tokens at most, dtype {params.target.dtype}; "
          f"same answers in every layout: {same}")
    out = bench_dir / "regen.json"
    atomic_write_json(out, {"chats": len(chats), "dtype": params.target.dtype, "same_answers": same,
                            "rows": [{k: v for k, v in r.items() if k != "answers"} for r in rows]})
    print(f"written: {out}")


if __name__ == "__main__":
    main()
