"""Decoding speed in vLLM on this CPU: EAGLE-3 / plain and n-gram / plain, in ONE vLLM subprocess
(Intel OpenMP in LD_PRELOAD, as vLLM advises for CPU).

    python bench/decode.py [--params params/local.yaml] [--prompts 4] [--max-new-tokens 128]
                           [--k 4] [--dtype bfloat16] [--export outputs/local/export] [--batched]

The drafter is the local run's export (`outputs/local/export`, written by 05_eval) when present;
otherwise a RANDOM drafter is exported to a temp folder and the table says so (nothing gets
accepted then: the EAGLE-3 row measures pure drafting overhead). Prompts: the profile's held-out
prompts (chat template applied), the same token ids for every mode. Results go to stdout and
outputs/bench/decode.json. vLLM's process layout is its default (the serving one) unless the
environment says otherwise: `VLLM_ENABLE_V1_MULTIPROCESSING=0 python bench/decode.py` runs each
engine in-process (a fork of the child per mode; NOTES.md, Decisions: vLLM's process layout).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eagle3lib.decode import random_drafter
from eagle3lib.evaluate import eval_prompts, vllm_modes
from eagle3lib.export import export_vllm
from eagle3lib.files import atomic_write_json
from eagle3lib.params import load_params
from eagle3lib.target import load_tokenizer, target_path
from eagle3lib.vllm_bench import BenchSpec, run_vllm


def random_export(target_dir: Path, out: Path, k: int, draft_vocab_size: int) -> Path:
    return export_vllm(random_drafter(target_dir, draft_vocab_size=draft_vocab_size), out, target_dir, k=k)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=None, help="speculative tokens (default eval.k)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--export", default=None, help="drafter export folder (default <run>/export)")
    ap.add_argument("--batched", action="store_true", help="all prompts in one generate call")
    args = ap.parse_args(argv)

    params = load_params(args.params)
    k = args.k or params.eval.k
    tdir = target_path(params)
    prompts, skipped = eval_prompts(params, params.run_dir(), load_tokenizer(tdir), limit=args.prompts)
    default_export = params.layout().export
    export = Path(args.export) if args.export else default_export
    tmp = tempfile.TemporaryDirectory(prefix="bench-decode-")
    if (export / "config.json").is_file():
        drafter_note = f"trained drafter {export}"
    else:
        export = random_export(tdir, Path(tmp.name) / "random_export", k, params.data.draft_vocab_size)
        drafter_note = (f"RANDOM drafter (no export at {default_export}; run the pipeline first): "
                        "acceptance ~0, the EAGLE-3 row is drafting overhead only")
    modes = vllm_modes([(k, params.eval.prompt_lookup_min, params.eval.prompt_lookup_max)], export, k)
    spec = BenchSpec(target=str(tdir), dtype=args.dtype, prompts=[p["input_ids"] for p in prompts],
                     max_new_tokens=args.max_new_tokens, batched=args.batched, seed=params.seed, modes=modes)
    t0 = time.time()
    result = run_vllm(spec, workdir=Path(tmp.name) / "vllm")
    wall = time.time() - t0

    rows = result["modes"]
    plain = next(m for m in rows if m["method"] == "plain")
    print(f"\nvLLM {result['vllm_version']} on CPU, {args.dtype}, Intel OpenMP preloaded: {result['iomp_preloaded']}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, "
          f"{'batched' if args.batched else 'one request at a time'}, T=0 ({wall:.0f} s)")
    print(f"drafter: {drafter_note}")
    if skipped:
        print(f"({skipped} held-out prompts skipped: longer than eval.max_prompt_tokens)")
    print(f"\n{'mode':<16}{'engine start s':>15}{'decode tok/s':>14}{'e2e tok/s':>11}{'speedup':>9}"
          f"{'accept len':>12}  per-position acceptance")
    for m in rows:
        speed = m["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        per_pos = " ".join(f"{x:.2f}" for x in m["per_position_acceptance"]) or "-"
        print(f"{m['name']:<16}{m['load_s']:>15.1f}{m['decode_tokens_per_s']:>14.1f}{m['tokens_per_s']:>11.1f}"
              f"{speed:>8.2f}x{m['acceptance_length']:>12.2f}  {per_pos}")
    out = params.outputs_root() / "bench" / "decode.json"
    atomic_write_json(out, {"drafter": drafter_note, "dtype": args.dtype, "prompts": len(prompts),
                            "max_new_tokens": args.max_new_tokens, "batched": args.batched,
                            "modes": [{k2: v for k2, v in m.items() if k2 != "outputs"} for m in rows]})
    print(f"\nwritten: {out}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
