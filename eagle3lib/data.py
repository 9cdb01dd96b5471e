"""Chats -> tokenised training sequences with an assistant-only loss mask.

Pipeline (`prepare_data`):
1. read raw records (the embedded ShareGPT V3, local .json/.jsonl files or save_to_disk folders: one
   source or a list, each with its own cap), at most `data.max_records` in all;
2. normalise every record to `[{"role", "content"}, ...]` or count it as malformed, per reason;
3. drop exact duplicates (same normalised messages), make ids unique;
4. split deterministically: every chat gets the key sha256(seed, id); the `num_eval` smallest keys
   are the held-out eval set, the train set is taken from the rest in key order;
5. optionally regenerate the assistant turns with the target itself (`regenerate.py`): such a
   chat's sequence is token-exact, the prompt ids sent to the engine and the ids it generated
   (regenerate.token_sequence), loss mask = 1 on exactly the generated ids;
6. every other chat is rendered with the target's own chat template (in data.thinking's mode, with
   the chat's tools declaration when it has one) and tokenised; loss mask = 1 on assistant content
   tokens, an assistant turn's tool calls (the template's tool-call markers, names and arguments)
   and the end-of-turn token that closes them, 0 elsewhere (tool results included); every sequence
   is truncated to `data.max_length`;
7. count assistant-token frequencies on the train split -> draft vocabulary (`vocab.py`).

Steps 1-4 and the normalisation rules are in chats.py (`held_out_chats`); this module renders,
masks, tokenises, selects and writes. A chat the template refuses counts as "template_error"; chats
with tools or tool calls that the target's template does not render are counted ("tools_ignored")
and named in one warning line. A chat whose text holds the text of a special token of the target's
tokenizer (`<|im_end|>`, chat_template.control_token_text) is skipped before regeneration and
tokenisation, counted per split ("control_token_text") and named in one warning line: rendered,
that text would become the control token itself (a fake turn inside a user message).

Outputs under `<run>/data/` (paths from `RunLayout`, see layout.py); `stats.json` is written last
and is the completion marker. It carries the cache key (data params, the sha256 of every source,
the regeneration settings), so a rerun with the same params and the same file returns at once, and
an edited or switched source is rebuilt. `stats.load_stats` is its one reader (a `DataStats`).
"""
from __future__ import annotations

import functools
import html
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Optional

from . import vocab as vocab_lib
from .chat_template import (
    ControlTokenText,
    check_no_control_token_text,
    check_thinking_kwarg,
    control_token_text,
    ignored_tool_features,
    render_text,
    thinking_active,
)
from .chats import (
    TOOL_KEYS,
    MalformedRecord,
    describe_sources,
    first_user_prompt,
    held_out_chats,
    normalize_chat,
    source_sha256,
)
from .files import atomic_write_json, check_run_links, read_json, remove_tree, update_metrics
from .layout import RunLayout
from .params import ParamsError, regen_cap_problem, resolve_path
from .progress import tqdm
from .regenerate import regen_key, regenerate_chats
from .stats import DataStats, RegenStats, SplitStats, load_stats
from .target import load_tokenizer, target_path

SPLIT_NAMES = ("train", "eval")


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


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, thinking: str = "auto",
            tools: Optional[list[dict]] = None) -> str:
    return render_text(tokenizer, messages, add_generation_prompt, thinking, tools)


def template_message(m: dict) -> dict:
    """What the chat template gets of a message: role, content, and its tool calls or result id."""
    return {"role": m["role"], "content": m["content"], **{k: m[k] for k in TOOL_KEYS if k in m}}


# Stands in for an assistant turn's content to find where the content starts in the rendered turn.
CONTENT_PROBE = "\x00eagle3lab-content\x00"


def _content_offset(tokenizer, clean: list[dict], i: int, prompt: str, segment: str, thinking: str,
                    tools: Optional[list[dict]]) -> int:
    """Where assistant turn i's content starts in its rendered `segment` (the turn after the
    generation prompt): rendered once more with a probe as its content. 0 (the whole turn) when the
    template renders the probe turn another way before the content."""
    probe = _render(tokenizer, clean[:i] + [{**clean[i], "content": CONTENT_PROBE}], thinking=thinking, tools=tools)
    j = probe.find(CONTENT_PROBE, len(prompt)) - len(prompt)
    return j if j >= 0 and probe.startswith(prompt) and segment.startswith(probe[len(prompt):len(prompt) + j]) else 0


def render_with_spans(tokenizer, messages: list[dict], max_chars: Optional[int] = None,
                      end_strings: Optional[list[str]] = None, thinking: str = "auto",
                      tools: Optional[list[dict]] = None) -> tuple[str, list[tuple[int, int]]]:
    """Render a chat with the tokenizer's chat template and find the assistant spans.

    Each assistant span [start, end) covers the assistant content plus the end-of-turn token that
    directly follows it (e.g. `<|im_end|>`), not the template's glue (`\\n`, next header); a turn
    with tool calls from its content to the end of the turn (the calls and the end token). The
    start is found by rendering the prefix with `add_generation_prompt=True`, which works for any
    template that renders a chat incrementally (checked: each prefix must be a prefix of the full
    text). An assistant message carrying `"capped": True` (a regenerated answer that hit the length
    cap) must be the last one: the text is cut after its content, so no end token is added.
    Spans whose prompt starts at or after `max_chars` are skipped (they are truncated away).
    `tools`: the chat's tools list (chats.normalize_record), declared by the template.
    Raises MalformedRecord("template_error") when the template is not incremental."""
    clean = [template_message(m) for m in messages]
    end_strings = end_of_turn_strings(tokenizer) if end_strings is None else end_strings
    text = _render(tokenizer, clean, thinking=thinking, tools=tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, clean[:i], add_generation_prompt=True, thinking=thinking, tools=tools)
        if not text.startswith(prompt):
            raise MalformedRecord("template_error", f"the prompt before assistant turn {i} is not a prefix")
        if max_chars is not None and len(prompt) >= max_chars:
            break
        upto = _render(tokenizer, clean[:i + 1], thinking=thinking, tools=tools)
        if not text.startswith(upto):
            raise MalformedRecord("template_error", f"the chat up to turn {i} is not a prefix")
        segment = upto[len(prompt):]
        content = m["content"]
        j = segment.find(content)
        if j < 0:
            content = content.strip()
            j = segment.find(content)
        if m.get("tool_calls"):  # content (maybe empty), then the calls: up to the end of the turn, minus glue
            start = len(prompt) + _content_offset(tokenizer, clean, i, prompt, segment, thinking, tools)
            end = len(prompt) + len(segment.rstrip())
        elif j < 0:  # the template rewrote the content: the whole rendered turn, minus trailing glue
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


@functools.lru_cache(maxsize=8)
def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters one token decodes to: its longest vocabulary string
    (byte-level and SentencePiece vocabularies spell a character with at least one symbol)."""
    return max(1, max(len(str(t)) for t in tokenizer.get_vocab()))


def cut_long_messages(tokenizer, messages: list[dict], max_length: int) -> list[dict]:
    """Messages with content cut to (max_length + 1) x max_chars_per_token characters: those hold
    more than max_length tokens, so the truncated sequence is unchanged, and a 20 MB message costs
    no more than a long one to tokenise (or to skip)."""
    bound = (max_length + 1) * max_chars_per_token(tokenizer)
    return [m if len(m["content"]) <= bound else {**m, "content": m["content"][:bound]} for m in messages]


def tokenize_chat(tokenizer, messages: list[dict], max_length: int, end_strings: Optional[list[str]] = None,
                  thinking: str = "auto", tools: Optional[list[dict]] = None) -> dict:
    """Chat -> {"input_ids", "loss_mask", "num_tokens" (before truncation, counted up to
    max_length + 1), "truncated"}.

    The whole chat is tokenised once (as the model reads it); the loss mask comes from the
    assistant character spans via the token offsets. Truncated to `max_length` tokens.
    `tools`: the chat's tools list (its "tools", chats.normalize_record), declared by the template.
    Raises ControlTokenText when the chat's text holds a special token's text (chat_template.py)."""
    messages = cut_long_messages(tokenizer, messages, max_length)
    check_no_control_token_text(tokenizer, messages, tools)
    text = _render(tokenizer, [template_message(m) for m in messages], thinking=thinking, tools=tools)
    if getattr(tokenizer, "is_fast", False):
        # max_length + 1 tokens tell whether the chat was truncated; a 20 MB message then costs the
        # tokenizer's own pass, not Python lists of millions of ids and offsets
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                        truncation=True, max_length=max_length + 1)
        offsets = enc["offset_mapping"]
        # Assistant turns that start after the truncation point need no rendering.
        max_chars = offsets[max_length][0] if len(offsets) > max_length else None
        text2, spans = render_with_spans(tokenizer, messages, max_chars, end_strings, thinking, tools)
        if text2 != text:  # a capped last turn cut the text: tokenise what is left
            enc = tokenizer(text2, add_special_tokens=False, return_offsets_mapping=True,
                            truncation=True, max_length=max_length + 1)
            offsets = enc["offset_mapping"]
        input_ids = list(enc["input_ids"])
        loss_mask = _mask_from_offsets(offsets, spans)
    else:
        text2, spans = render_with_spans(tokenizer, messages, None, end_strings, thinking, tools)
        input_ids, loss_mask = _tokenize_pieces(tokenizer, text2, spans)
    return _truncated(input_ids, loss_mask, max_length)


def _truncated(input_ids: list, loss_mask: list, max_length: int) -> dict:
    num_tokens = len(input_ids)
    return {"input_ids": input_ids[:max_length], "loss_mask": loss_mask[:max_length],
            "num_tokens": num_tokens, "truncated": num_tokens > max_length}


def first_answer_fits(tokenizer, messages: list[dict], max_length: int, thinking: str = "auto",
                      tools: Optional[list[dict]] = None) -> bool:
    """Whether the first assistant turn starts before `max_length` tokens (else truncation
    would leave nothing to train on)."""
    clean = [template_message(m) for m in cut_long_messages(tokenizer, messages, max_length)]
    first = next(i for i, m in enumerate(clean) if m["role"] == "assistant")
    prompt = _render(tokenizer, clean[:first], add_generation_prompt=True, thinking=thinking, tools=tools)
    return len(tokenizer(prompt, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]) \
        < max_length


def select_train(tokenizer, pool: list[dict], num_train: Optional[int], max_length: int,
                 progress: bool = False, thinking: str = "auto") -> tuple[list[dict], Counter]:
    """Take chats from the front of the (key-ordered) pool whose text holds no control-token text
    (chat_template.control_token_text) and whose first answer fits in `max_length`, until `num_train`
    (None: all). Returns (chats, skipped: {"control_token_text": n, "prompt_too_long": n})."""
    chosen, skipped = [], Counter(control_token_text=0, prompt_too_long=0)
    bar = tqdm(total=num_train or len(pool), desc="select train", disable=not progress)
    for chat in pool:
        if num_train is not None and len(chosen) >= num_train:
            break
        if control_token_text(tokenizer, chat["messages"], chat.get("tools")) is not None:
            skipped["control_token_text"] += 1
        elif first_answer_fits(tokenizer, chat["messages"], max_length, thinking, chat.get("tools")):
            chosen.append(chat)
            bar.update(1)
        else:
            skipped["prompt_too_long"] += 1
    bar.close()
    return chosen, skipped


def without_control_token_text(tokenizer, chats: list[dict]) -> tuple[list[dict], Counter]:
    """(the chats whose text holds no special token's text, {token text: chats skipped for it})."""
    kept, found = [], Counter()
    for chat in chats:
        token = control_token_text(tokenizer, chat["messages"], chat.get("tools"))
        if token is None:
            kept.append(chat)
        else:
            found[token] += 1
    return kept, found


def tokenize_chats(tokenizer, chats: list[dict], max_length: int,
                   progress: bool = False, desc: str = "tokenize", thinking: str = "auto") -> tuple[dict, dict]:
    """Tokenise chats into columns {conv_id, input_ids, loss_mask}; drops (and counts) sequences
    with no assistant token left after truncation, chats the template cannot render and chats whose
    text holds a special token's text ("control_token_text"). A chat that carries "input_ids" and
    "loss_mask" (regenerated: the ids the target produced) keeps them as they are, only truncated;
    the others are rendered and tokenised (tokenize_chat)."""
    end_strings = end_of_turn_strings(tokenizer)
    columns = {"conv_id": [], "input_ids": [], "loss_mask": []}
    stats = Counter()
    for chat in tqdm(chats, desc=desc, disable=not progress):
        try:
            if "input_ids" in chat:
                row = _truncated(chat["input_ids"], chat["loss_mask"], max_length)
            else:
                row = tokenize_chat(tokenizer, chat["messages"], max_length, end_strings, thinking, chat.get("tools"))
        except MalformedRecord:
            stats["template_error"] += 1
            continue
        except ControlTokenText:
            stats["control_token_text"] += 1
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
                "dropped_no_assistant_tokens", "template_error", "control_token_text"):
        stats.setdefault(key, 0)
    return columns, dict(stats)


# ---- the stage ----------------------------------------------------------------------------
def cache_key(params) -> dict[str, str]:
    """What the data outputs depend on (stats.json carries it): the data params (with the seed and
    the target path), the content of `data.source` (source_sha256) and, with regeneration, the
    regeneration settings (regenerate.regen_key)."""
    key = {"data_hash": params.section_hash("data"), "source_sha256": source_sha256(params.data.source)}
    if params.data.regenerate:
        key["regen_key"] = regen_key(params)
    return key


def _outputs(layout: RunLayout) -> tuple[Path, ...]:
    """The stage's outputs besides stats.json, all directly under `layout.data`."""
    return layout.data_split("train"), layout.data_split("eval"), layout.eval_prompts, layout.vocab


def _cached_stats(layout: RunLayout, key: dict) -> Optional[DataStats]:
    """The stored stats when every output exists and was built with the same cache key."""
    if not layout.stats.is_file() or not all(path.exists() for path in _outputs(layout)):
        return None
    stored = read_json(layout.stats)
    if stored.get("cache_key") != key:
        return None
    if "control_token_text" not in stored.get("train", {}):   # built before control-token text was skipped
        return None
    try:
        return load_stats(layout.root)
    except ValueError:  # a stats.json of an older layout: rebuild
        return None


def eval_prompt_records(eval_chats: list[dict]) -> list[dict]:
    return [{"id": c["id"], "messages": first_user_prompt(c["messages"]), "category": None}
            for c in eval_chats]


def _save_dataset(columns: dict, path: Path) -> None:
    import datasets  # heavy (~1.5 s), only for the splits: evaluate.py imports this module for its prompts
    features = datasets.Features({"conv_id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(path))


def _target_answers(params, run_dir, train_chats: list[dict], eval_chats: list[dict], progress: bool
                    ) -> tuple[list[dict], list[dict], list[dict], Optional[RegenStats]]:
    """(train chats answered by the target, train chats keeping the dataset's answers, eval chats,
    regeneration stats). Without data.regenerate every chat keeps its answers and counts as the
    target's for the draft vocabulary, as before regeneration existed."""
    d = params.data
    if not d.regenerate:
        return train_chats, [], eval_chats, None
    # regen_num_train: only the first N training chats are regenerated; the rest keep the
    # dataset's answers (appended after the regenerated ones).
    to_regen = train_chats if d.regen_num_train is None else train_chats[:d.regen_num_train]
    original = train_chats[len(to_regen):]
    regenerated, regen = regenerate_chats(params, run_dir, to_regen + eval_chats, progress)
    by_id = {c["id"]: c for c in regenerated}
    train_in = [by_id[c["id"]] for c in to_regen if c["id"] in by_id]
    eval_in = [by_id[c["id"]] for c in eval_chats if c["id"] in by_id]
    stats = RegenStats(**regen, train_regenerated=len(train_in), train_original_answers=len(original))
    return train_in, original, eval_in, stats


def _draft_vocab(train_cols: dict, eval_cols: dict, target_answer_ids: set, vocab_size: int,
                 draft_vocab_size: int):
    """(d2t [Dv], t2d [V], coverage stats) counted over the train answers the target wrote."""
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
    layout.data.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=layout.data))
    try:
        staged = {final: tmp / final.relative_to(layout.data) for final in _outputs(layout)}
        train_path, eval_path, prompts_path, vocab_path = staged.values()
        _save_dataset(train_cols, train_path)
        _save_dataset(eval_cols, eval_path)
        lines = [json.dumps(r, ensure_ascii=False) for r in eval_prompt_records(eval_chats)]
        prompts_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        vocab_lib.save_vocab(vocab_path, d2t, t2d)
        layout.stats.unlink(missing_ok=True)  # the marker goes first, comes back last
        for final, built in staged.items():
            if final.is_dir():
                remove_tree(final, under=layout.data)
            elif final.exists():
                final.unlink()
            os.replace(built, final)
    finally:
        remove_tree(tmp, under=layout.data, ignore_errors=True)


def warn_control_token_text(train_skipped: int, eval_found: Counter) -> None:
    """One line naming how many chats were skipped for control-token text (train and held-out)."""
    total = train_skipped + sum(eval_found.values())
    if total:
        example = f" (held-out: {', '.join(map(repr, sorted(eval_found)))})" if eval_found else ""
        print(f"[data] warning: {total:,} chats skipped ({train_skipped:,} train, {sum(eval_found.values()):,} "
              f"held-out){example}: their text holds the text of a control token of the target's tokenizer, "
              "which the chat template would read as turn structure; counted as control_token_text in "
              "data/stats.json")


def check_thinking(tokenizer, d) -> None:
    """data.thinking against the target's template, before anything is generated: on/off must
    change the template's output (chat_template.check_thinking_kwarg), and where the mode the
    template runs in is thinking ("auto" on a template that thinks by default, like Kimi-K2.5's),
    regeneration must not cut most answers (params.regen_cap_problem)."""
    try:
        check_thinking_kwarg(tokenizer, d.thinking)
    except ValueError as e:
        raise ParamsError(str(e)) from None
    cut = regen_cap_problem(d, thinking_active(tokenizer, d.thinking))
    if cut is not None:
        raise ParamsError(f"data.regen_max_new_tokens: data.thinking is {d.thinking!r} and the target's chat "
                          f"template opens a reasoning block in the generation prompt; {cut}")


def count_tools_ignored(tokenizer, chats: list[dict]) -> int:
    """How many of `chats` have tools or tool calls that the target's chat template does not render
    (chat_template.ignored_tool_features); says so in one line when there are any. Such a chat is
    still trained, as the template renders it: without its tools declaration or calls."""
    def uses(chat: dict, feature: str) -> bool:
        return bool(chat.get("tools")) if feature == "tools" else any("tool_calls" in m for m in chat["messages"])

    with_tools = [c for c in chats if uses(c, "tools") or uses(c, "tool_calls")]
    if not with_tools:
        return 0
    ignored = ignored_tool_features(tokenizer)
    hit = [c for c in with_tools if any(uses(c, feature) for feature in ignored)]
    if hit:
        print(f"[data] warning: the target's chat template does not render {' or '.join(ignored)}: {len(hit):,} "
              "chats with tools are rendered without them (the target never sees their tools declaration or "
              "calls); give the target a template with tools support, or drop the tool-use sources")
    return len(hit)


class EmptyDataset(ParamsError):
    """No training (or held-out) sequence is left: the stage is not marked done."""


def check_not_empty(d, train_stats: dict, eval_stats: dict, skipped_long: int, selected: int) -> None:
    """Raise EmptyDataset naming why a split has no sequence (stats.json, the completion marker,
    is then not written and 03/04 never see an empty dataset). An empty stats dict: not checked."""
    for split, st in (("train", train_stats), ("eval", eval_stats)):
        if not st or st["conversations"] > 0:
            continue
        why = (f"{skipped_long:,} chats skipped because the prompt before the first answer is longer than "
               f"data.max_length ({d.max_length}), {selected:,} selected; " if split == "train" else "")
        raise EmptyDataset(f"data: no {split} sequence left ({why}{st.get('dropped_no_assistant_tokens', 0):,} "
                           f"dropped with no answer token inside max_length, {st.get('template_error', 0):,} "
                           f"template errors, {st.get('control_token_text', 0):,} with control-token text): "
                           "raise data.max_length, or use a source with shorter prompts")


def prepare_data(params, run_dir, progress: bool = True, force: bool = False) -> DataStats:
    """Build `<run>/data/` (train/eval datasets, eval prompts, draft vocabulary, stats).

    Idempotent: returns the stored stats (with `cached=True`) when the outputs exist for the same
    cache key: data params, source file content, regeneration settings. Outputs are built in a temp
    folder and moved into place; stats.json is written last, so an interrupted build is rebuilt.
    Regeneration results are kept across rebuilds (keyed by each chat's id and prompt turns)."""
    layout = RunLayout(run_dir)
    check_run_links(layout.root)   # no write or delete may go through a link out of the run
    key = cache_key(params)  # before reading: a source edited during the build is rebuilt next time
    if not force and (cached := _cached_stats(layout, key)) is not None:
        update_metrics(layout.root, "data", data_metrics(cached))
        return replace(cached, cached=True)
    t0 = time.time()
    tokenizer = load_tokenizer(target_path(params), params.target.trust_remote_code)
    d = params.data
    check_thinking(tokenizer, d)
    eval_chats, pool, read_stats = held_out_chats(params)
    train_chats, skipped = select_train(tokenizer, pool, d.num_train, d.max_length, progress, d.thinking)
    skipped_long = skipped["prompt_too_long"]
    if not train_chats:                # before any regeneration: nothing would come of it
        check_not_empty(d, {"conversations": 0}, {}, skipped_long, 0)
    eval_usable, eval_control = without_control_token_text(tokenizer, eval_chats)
    warn_control_token_text(skipped["control_token_text"], eval_control)
    tools_ignored = count_tools_ignored(tokenizer, train_chats + eval_usable)
    train_in, original, eval_in, regen = _target_answers(params, run_dir, train_chats, eval_usable, progress)

    train_cols, train_stats = tokenize_chats(tokenizer, train_in + original, d.max_length, progress,
                                             "tokenize train", d.thinking)
    eval_cols, eval_stats = tokenize_chats(tokenizer, eval_in, d.max_length, progress, "tokenize eval",
                                           d.thinking)
    train_stats["control_token_text"] += skipped["control_token_text"]
    eval_stats["control_token_text"] += sum(eval_control.values())
    check_not_empty(d, train_stats, eval_stats, skipped_long, len(train_chats))
    if d.num_train is not None and len(train_chats) < d.num_train:
        print(f"[data] warning: data.num_train is {d.num_train:,}, the sources hold {len(train_chats):,} usable "
              f"training chats ({skipped_long:,} skipped: prompt longer than data.max_length); training uses those")
    vocab_size = max(int((params.target_shape() or {}).get("vocab_size", 0)), len(tokenizer))
    d2t, t2d, vocab_stats = _draft_vocab(train_cols, eval_cols, {c["id"] for c in train_in},
                                         vocab_size, d.draft_vocab_size)
    _write_outputs(layout, train_cols, eval_cols, eval_chats, d2t, t2d)
    stats = DataStats(cache_key=key, source=describe_sources(d.source), **read_stats, eval_prompts=len(eval_chats),
                      train_skipped_prompt_too_long=skipped_long,
                      train=SplitStats(**train_stats), eval=SplitStats(**eval_stats), regen=regen,
                      vocab_size=vocab_size, draft_vocab_size=d.draft_vocab_size, **vocab_stats,
                      tools_ignored=tools_ignored, seconds=round(time.time() - t0, 2))
    atomic_write_json(layout.stats, stats.to_json())
    update_metrics(layout.root, "data", data_metrics(stats))
    return stats


def data_metrics(stats: DataStats) -> dict:
    """metrics.json's "data" section: chats read, kept and split, tokens, draft-vocabulary coverage
    and, when the target's answers were regenerated, how many were kept or capped and at what speed."""
    metrics = {
        "records_read": stats.records_read, "valid": stats.valid, "malformed": stats.malformed_total,
        "duplicates": stats.duplicates, "train_conversations": stats.train.conversations,
        "eval_conversations": stats.eval.conversations, "eval_prompts": stats.eval_prompts,
        "train_tokens": stats.train.tokens, "train_assistant_tokens": stats.train.assistant_tokens,
        "draft_vocab_size": stats.draft_vocab_size, "coverage_train": round(stats.coverage_train, 4),
        "coverage_eval": round(stats.coverage_eval, 4),
        "regenerated": bool(stats.regen),
        "skipped_control_token_text": stats.train.control_token_text + stats.eval.control_token_text,
    }
    if stats.regen:
        metrics.update(regen_backend=stats.regen.backend, regen_kept=stats.regen.kept,
                       regen_capped=stats.regen.capped, regen_tokens_per_s=stats.regen.tokens_per_s_this_run)
    return metrics


def load_processed(run_dir, split: str):
    """The tokenised split ("train" or "eval") as a `datasets.Dataset`
    (columns conv_id str, input_ids list[int], loss_mask list[int])."""
    import datasets  # heavy (~1.5 s), only for the splits: evaluate.py imports this module for its prompts
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


def load_eval_prompts(params, run_dir=None, limit: Optional[int] = None) -> list[dict]:
    """Held-out decoding prompts `[{"id", "messages": [system?, user], "category"}]`.

    From `eval.prompts_path` when set; else `<run>/data/eval_prompts.jsonl` when prepare_data ran
    with the current data params; else computed directly from the split (cheap, no tokenizer), so
    stages that run before the data stage get the same prompts. Order: the split order.
    `limit` keeps the first n (callers usually pass params.eval.num_prompts)."""
    if params.eval.prompts_path:
        path = resolve_path(params.eval.prompts_path)
        if not path.is_file():
            raise FileNotFoundError(f"eval.prompts_path {params.eval.prompts_path!r}: no such file")
        records = _read_prompts_file(path)
    else:
        layout = RunLayout(run_dir) if run_dir is not None else None
        stored = layout.eval_prompts if layout is not None else None
        if stored is not None and stored.is_file() and _cached_stats(layout, cache_key(params)) is not None:
            records = [json.loads(l) for l in stored.read_text(encoding="utf-8").split("\n") if l.strip()]
        else:
            records = eval_prompt_records(held_out_chats(params)[0])
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
