"""Training ablations on an existing run's hidden-state cache (the numbers in NOTES.md).

Each variant trains a fresh drafter on the SAME cache (symlinked, never rewritten) for a fixed
budget of input tokens and reports the held-out per-step accuracy and the acceptance estimate.
Variants run one after another in this process: the trainer is the real `eagle3lib.train.train`.

    python bench/train_sweep.py --params params/local.yaml --tokens 250000 \
        --variant base: --variant b1k:batch_tokens=1024 --variant b1k-lr5e-3:batch_tokens=1024,lr=0.005

A variant is `name:key=value,key=value` over train.* fields (values parsed as YAML; a list in brackets
keeps its commas). max_steps is set from --tokens / batch_tokens unless the variant gives it.
One key is not a train field: `aux_layers=[2,15,29]` trains on the source run's chats extracted with
those three target layers instead; that cache is written once under <workdir>/cache-<run>-2-15-29/ (03's
extraction, resumable) and reused by later sweeps. Results are appended
to outputs/bench/train_sweep.jsonl; `curve` holds the held-out estimate at every checkpoint (give a
variant `checkpoint_every=200` to get one; the default evaluates only at the end).

--vllm: the recipe table's measurement. Each variant's drafter is exported for vLLM, then ONE vLLM
child decodes the run's held-out prompts (eval.vllm_prompts, T = eval.temperature, one request at a
time) with plain, n-gram and every variant's EAGLE-3 at eval.k (or --k), as 05 does; each row gains
vLLM's acceptance length, decode tokens/s and its ratio to n-gram's. Run it alone on the machine.
The variants' run folders live under outputs/bench/sweep/ (the cache is linked, never copied).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import replace
from pathlib import Path

import yaml

from eagle3lib import evaluate as ev
from eagle3lib.export import export_vllm
from eagle3lib.extract import SharedBackend, check_aux_layers, extract_hidden_states, load_split
from eagle3lib.files import remove_tree
from eagle3lib.layout import RunLayout
from eagle3lib.params import Params, load_params
from eagle3lib.target import load_tokenizer, target_path
from eagle3lib.train import train
from eagle3lib.vllm_bench import mode


def parse_variant(text: str) -> tuple:
    """"name:k=v,k=v" -> (name, {k: v}); a comma inside [...] belongs to its list."""
    name, _, body = text.partition(":")
    changes = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", body)):
        key, _, value = item.partition("=")
        changes[key.strip()] = yaml.safe_load(value)
    return name, changes


def aux_cache(params: Params, src: RunLayout, work: Path, aux_layers: list) -> tuple:
    """The source run's train and eval chats extracted with `aux_layers` (03's extraction; resumable,
    so a second sweep reads it back) -> (the RunLayout holding that hidden/ folder, the params whose
    cache identity it carries)."""
    check_aux_layers(aux_layers, params.target_shape()["num_hidden_layers"], params.target.path)
    aux_params = replace(params, extract=replace(params.extract, aux_layers=list(aux_layers)))
    cache = RunLayout((work / "-".join(["cache", src.root.name, *map(str, aux_layers)])).resolve())
    cache.root.mkdir(parents=True, exist_ok=True)
    with SharedBackend() as shared:                         # one engine start for both splits
        for split in ("train", "eval"):
            extract_hidden_states(aux_params, cache, split, dataset=load_split(src, split), shared=shared)
    return cache, aux_params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/local.yaml")
    ap.add_argument("--run", default=None, help="run whose cache is used (default: the profile's run_name)")
    ap.add_argument("--tokens", type=float, default=250_000, help="input tokens per variant")
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--workdir", default=None, help="default: outputs/bench/sweep")
    ap.add_argument("--vllm", action="store_true", help="export every variant and measure it in vLLM (see above)")
    ap.add_argument("--k", type=int, default=None, help="speculation length in vLLM (default: eval.k)")
    args = ap.parse_args(argv)

    params = load_params(args.params)
    src = params.layout(args.run)
    for need in (src.hidden("train") / "manifest.json", src.hidden("eval") / "manifest.json", src.vocab):
        if not need.is_file():
            raise SystemExit(f"{need} is missing: run the pipeline up to extract first")
    work = Path(args.workdir) if args.workdir else params.outputs_root() / "bench" / "sweep"
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    if not models.exists():
        models.symlink_to(params.outputs_root() / "models")
    out_path = params.outputs_root() / "bench" / "train_sweep.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows, finals = [], {}
    for text in args.variant:
        name, changes = parse_variant(text)
        aux_layers = changes.pop("aux_layers", None)
        t_extract = time.time()
        hidden_src, base = aux_cache(params, src, work, aux_layers) if aux_layers is not None else (src, params)
        t_extract = time.time() - t_extract
        train_params = replace(params.train, resume=False, time_budget_minutes=None, checkpoint_every=10**9)
        train_params = replace(train_params, **changes)
        if "max_steps" not in changes:
            train_params = replace(train_params, max_steps=max(1, math.ceil(args.tokens / train_params.batch_tokens)))
        Q = replace(base, output_dir=str(work), run_name=name, train=train_params)
        run = Q.layout()
        if run.root.exists():
            remove_tree(run.root, under=work)
        run.root.mkdir(parents=True)
        run.hidden_root.symlink_to(hidden_src.hidden_root.resolve())
        run.data.symlink_to(src.data)
        t0 = time.time()
        summary = train(Q, run.root, progress=True, links_within=params.outputs_root())   # links: into outputs/
        history = json.loads(run.history.read_text())
        curve = [[r["step"], round(r["eval"]["acceptance_estimate"], 4), round(r["eval"]["acceptance_replayed"], 4)]
                 for r in history if "eval" in r]   # [step, estimate, replayed]
        if aux_layers is not None:
            changes["aux_layers"] = aux_layers
        row = {"variant": name, "changes": changes, "tokens_budget": args.tokens, "steps": summary["steps"],
               "wall_s": round(time.time() - t0, 1), "tokens_per_s": round(summary["tokens_per_s_this_run"], 1),
               "eval_acc": [round(a, 4) for a in summary["eval"]["acc"]],
               "acceptance_estimate": round(summary["eval"]["acceptance_estimate"], 4),
               "acceptance_replayed": round(summary["eval"]["acceptance_replayed"], 4),
               "curve": curve,   # extract_s: this sweep's extraction for the variant (~0 when read back)
               **({"extract_s": round(t_extract, 1)} if aux_layers is not None else {}),
               "date": time.strftime("%Y-%m-%d %H:%M"), "params": args.params}
        print(json.dumps(row), flush=True)
        rows.append(row)
        finals[name] = (run.final, run.export)
    if args.vllm:
        measure_in_vllm(params, src, finals, rows, args.k or params.eval.k)
    with open(out_path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"appended {len(rows)} rows to {out_path}")
    return 0


def measure_in_vllm(params, src, finals: dict, rows: list, k: int) -> None:
    """Export each variant's drafter, decode plain, n-gram and every EAGLE-3 variant at k in one vLLM
    child on the source run's held-out prompts, and add vLLM's figures to each row."""
    tdir = target_path(params)
    exports = {name: export_vllm(final, export, tdir, layout="speculators", k=k)
               for name, (final, export) in finals.items()}
    prompts, _ = ev.eval_prompts(params, src.root, load_tokenizer(tdir, params.target.trust_remote_code))
    lookup = (k, params.eval.prompt_lookup_min, params.eval.prompt_lookup_max)
    modes = ev.vllm_modes([lookup])                           # plain and n-gram, named as 05 names them
    modes += [mode("eagle3", k, name=f"eagle3_{name}", model=str(path.resolve())) for name, path in exports.items()]
    summary, raw = ev.run_vllm_eval(params, tdir, prompts, modes, src.root / "bench" / "train_sweep_vllm")
    by_name = {r["method"]: r for r in summary.to_dict("records")}
    ngram = by_name[ev.ngram_name(*lookup)]
    print(summary[["method", "tokens_per_s", "speedup", "acceptance_length", "same_output_as_plain"]]
          .to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for row in rows:
        got = by_name[f"eagle3_{row['variant']}"]
        row["vllm"] = {"k": k, "prompts": int(got["prompts"]), "acceptance_length": round(got["acceptance_length"], 3),
                       "tokens_per_s": round(got["tokens_per_s"], 2), "speedup": round(got["speedup"], 3),
                       "vs_ngram": round(got["tokens_per_s"] / ngram["tokens_per_s"], 3),
                       "ngram_tokens_per_s": round(ngram["tokens_per_s"], 2),
                       "same_output_as_plain": bool(got["same_output_as_plain"]),
                       "vllm_version": raw["vllm_version"], "dtype": raw["dtype"]}


if __name__ == "__main__":
    raise SystemExit(main())
