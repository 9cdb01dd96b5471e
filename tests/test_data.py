"""Data stage: reading, normalisation, malformed counting, split, loss mask, regeneration, caching."""
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle3lib import chats as C
from eagle3lib import data as D
from eagle3lib import regenerate as D_regen
from eagle3lib.layout import RunLayout
from eagle3lib.params import load_params
from eagle3lib.regenerate import load_results, regen_key, regenerate_chats, write_chunk

END = "<|im_end|>"


def regen_dir(params, run_dir):
    return RunLayout(run_dir).regen(regen_key(params))


def results_by_id(out_dir):
    """The chunk results of one source, by conversation id (load_results keys them by prompt_key)."""
    return {r["id"]: r for r in load_results(out_dir).values()}


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from eagle3lib.target import load_tokenizer
    return load_tokenizer(smollm2_dir)


def sharegpt(*turns, **extra):
    return {"conversations": [{"from": f, "value": v} for f, v in turns], **extra}


def openai(*turns, **extra):
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


# ---- normalisation ------------------------------------------------------------------------
def test_normalize_sharegpt_form():
    rec = sharegpt(("system", "Be nice."), ("human", "Hi"), ("gpt", "Hello"), ("user", "Bye"),
                   ("assistant", "Ciao"))
    assert C.normalize_chat(rec) == [
        {"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"}]


def test_normalize_openai_form_with_text_parts():
    rec = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                     {"type": "text", "text": "b"}]},
                        {"role": "assistant", "content": "c"}]}
    assert C.normalize_chat(rec) == [{"role": "user", "content": "ab"},
                                     {"role": "assistant", "content": "c"}]


def test_repairs_are_counted():
    repairs = Counter()
    rec = sharegpt(("gpt", "answer to a question we lost"), ("human", "q"), ("gpt", "a"),
                   ("human", "unanswered"))
    assert C.normalize_chat(rec, repairs) == [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a"}]
    assert repairs == Counter({"dropped_leading_assistant": 1, "dropped_trailing_user": 1})


MALFORMED = [
    ("not_a_dict", ["just", "a", "list"]),
    ("missing_messages", {"id": "x", "text": "hello"}),
    ("empty", sharegpt()),
    ("wrong_type", {"conversations": "hi"}),
    ("wrong_type", {"conversations": ["hi"]}),
    ("wrong_type", openai(("user", 3), ("assistant", "b"))),
    ("wrong_type", {"messages": [{"role": 1, "content": "a"}]}),
    ("wrong_type", {"messages": [{"role": "user"}]}),
    ("missing_role", {"conversations": [{"value": "x"}]}),
    ("unknown_role", sharegpt(("human", "q"), ("bing", "a"))),
    ("unknown_role", openai(("user", "q"), ("function", "a"))),
    ("non_alternating", openai(("user", "q"), ("tool", "a"))),   # a tool result answers a call (test_tool_chats.py)
    ("empty_turn", sharegpt(("human", "  \n"), ("gpt", "a"))),
    ("non_alternating", sharegpt(("human", "q"), ("human", "q2"), ("gpt", "a"))),
    ("non_alternating", openai(("user", "q"), ("assistant", "a"), ("assistant", "b"))),
    ("non_alternating", openai(("user", "q"), ("system", "s"), ("assistant", "a"))),
    ("no_assistant_turn", sharegpt(("human", "q"))),
    ("no_assistant_turn", sharegpt(("gpt", "only an answer"))),
    ("no_assistant_turn", openai(("system", "s"), ("user", "q"))),
]


@pytest.mark.parametrize("reason,record", MALFORMED)
def test_malformed_reason(reason, record):
    with pytest.raises(C.MalformedRecord) as e:
        C.normalize_chat(record)
    assert e.value.reason == reason


def write_jsonl(path: Path, records) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_local_jsonl_openai_form_counts_every_record(tmp_path):
    good = [openai(("user", f"question {i}"), ("assistant", f"answer {i}"), id=f"c{i}") for i in range(4)]
    records = good + [
        openai(("user", "question 0"), ("assistant", "answer 0"), id="dup-content"),  # duplicate
        openai(("user", "other"), ("assistant", "text"), id="c1"),                    # id reused
        "{not json",
        openai(("user", "q")),                                                        # no answer
        openai(("user", "q"), ("bard", "a")),
        openai(("user", "x"), ("assistant", "y")),                                    # no id
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    chats, stats = C.load_chats(str(path))
    assert stats["records_read"] == 10
    assert stats["malformed"] == {"invalid_json": 1, "no_assistant_turn": 1, "unknown_role": 1}
    assert stats["duplicates"] == 1 and stats["renamed_ids"] == 1
    assert stats["valid"] == len(chats) == 6
    ids = [c["id"] for c in chats]
    assert ids == ["c0", "c1", "c2", "c3", "c1#1", "record-9"]
    assert chats[0]["messages"] == [{"role": "user", "content": "question 0"},
                                    {"role": "assistant", "content": "answer 0"}]
    # max_records counts raw records, malformed ones included
    chats, stats = C.load_chats(str(path), max_records=7)
    assert stats["records_read"] == 7 and stats["malformed"] == {"invalid_json": 1}


def test_json_array_truncated_and_invalid(tmp_path):
    recs = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}"), id=str(i)) for i in range(3)]
    text = json.dumps(recs, indent=1)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex('"a2"')])       # cut inside the last record
    items = list(C.iter_raw_records(str(cut)))
    assert [type(x).__name__ for x in items] == ["dict", "dict", "MalformedRecord"]
    assert items[-1].reason == "truncated"
    bad = tmp_path / "bad.json"
    bad.write_text(text[: text.rindex('"a2"')] + "oops]")
    assert list(C.iter_raw_records(str(bad)))[-1].reason == "invalid_json"
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    chats, stats = C.load_chats(str(whole))
    assert stats["valid"] == 3 and stats["malformed_total"] == 0


def test_sharegpt_reader_reads_every_whole_record():
    items = list(C.iter_raw_records("sharegpt"))
    whole = [x for x in items if isinstance(x, dict)]
    broken = [x for x in items if not isinstance(x, dict)]
    assert len(whole) == 17671
    assert len(broken) == 1 and broken[0].reason == "truncated" and items[-1] is broken[0]
    assert all("conversations" in r and "id" in r for r in whole[:100])
    first = list(C.iter_raw_records("sharegpt", max_records=50))
    assert len(first) == 50 and first == whole[:50]


# ---- split --------------------------------------------------------------------------------
def test_split_is_deterministic_and_disjoint():
    chats, _ = C.load_chats("sharegpt", max_records=400)
    ev, pool = C.split_chats(chats, 30, seed=0)
    shuffled = chats[:]
    random.Random(1).shuffle(shuffled)
    ev2, pool2 = C.split_chats(shuffled, 30, seed=0)
    assert [c["id"] for c in ev] == [c["id"] for c in ev2]
    assert [c["id"] for c in pool] == [c["id"] for c in pool2]
    assert len(ev) == 30 and len(ev) + len(pool) == len(chats)
    assert not {c["id"] for c in ev} & {c["id"] for c in pool}
    assert not ({C.chat_hash(c["messages"]) for c in ev} & {C.chat_hash(c["messages"]) for c in pool})
    ev3, _ = C.split_chats(chats, 30, seed=1)
    assert {c["id"] for c in ev3} != {c["id"] for c in ev}
    with pytest.raises(ValueError, match="num_eval"):
        C.split_chats(chats, len(chats), seed=0)


def test_duplicate_content_never_crosses_the_split(tmp_path):
    # Many copies of one chat under different ids: all but one are dropped before the split.
    recs = [openai(("user", "same"), ("assistant", "same answer"), id=f"copy{i}") for i in range(20)]
    recs += [openai(("user", f"q{i}"), ("assistant", f"a{i}"), id=f"u{i}") for i in range(20)]
    chats, stats = C.load_chats(str(write_jsonl(tmp_path / "d.jsonl", recs)))
    assert stats["duplicates"] == 19
    ev, pool = C.split_chats(chats, 5, seed=3)
    hashes_ev = {C.chat_hash(c["messages"]) for c in ev}
    assert not hashes_ev & {C.chat_hash(c["messages"]) for c in pool}


# ---- chat template and loss mask --------------------------------------------------------------
def masked_runs(tok, ids, mask):
    """Decoded text of every maximal run of mask == 1."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write 日本 and 🙂, then code:"},
        {"role": "assistant", "content": " ```python\nprint('x')\n```\n\n多谢 🙂 done."}]


def test_mask_covers_exactly_the_assistant_spans(tok):
    row = D.tokenize_chat(tok, CHAT, max_length=4096)
    ids, mask = row["input_ids"], row["loss_mask"]
    assert len(ids) == len(mask) and not row["truncated"]
    assert masked_runs(tok, ids, mask) == [CHAT[2]["content"] + END, CHAT[4]["content"] + END]
    # Everything unmasked is template and user/system text; the whole decodes to the render.
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "Hello" not in unmasked and "Hi there" in unmasked and "You answer briefly." in unmasked
    shown = D.loss_mask_text(tok, ids, mask)
    assert "[[" + CHAT[2]["content"] + END + "]]" in shown and shown.count("[[") == 2
    # The newline after <|im_end|> and the next header are not trained.
    first_end = ids.index(tok.convert_tokens_to_ids(END), ids.index(tok.convert_tokens_to_ids(END)) + 1)
    assert mask[first_end + 1] == 0


def test_mask_without_system_uses_the_default_system(tok):
    chat = CHAT[1:3]
    row = D.tokenize_chat(tok, chat, max_length=4096)
    assert masked_runs(tok, row["input_ids"], row["loss_mask"]) == [chat[1]["content"] + END]
    assert "SmolLM" in tok.decode(row["input_ids"])   # the template's default system prompt


def test_capped_answer_gets_no_end_token(tok):
    chat = CHAT[:2] + [{"role": "assistant", "content": "This answer was cut", "capped": True}]
    row = D.tokenize_chat(tok, chat, max_length=4096)
    assert masked_runs(tok, row["input_ids"], row["loss_mask"]) == ["This answer was cut"]
    assert tok.decode(row["input_ids"]).endswith("This answer was cut")
    assert row["loss_mask"][-1] == 1


def test_truncation_keeps_a_prefix(tok):
    full = D.tokenize_chat(tok, CHAT, max_length=4096)
    n = full["num_tokens"]
    cut = D.tokenize_chat(tok, CHAT, max_length=n - 5)
    assert cut["truncated"] and cut["num_tokens"] == n - 5 + 1      # counted up to max_length + 1
    assert cut["input_ids"] == full["input_ids"][: n - 5]
    assert cut["loss_mask"] == full["loss_mask"][: n - 5]
    # Truncated before the first answer: nothing to train, the chat is dropped and counted.
    prompt_len = len(tok(tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"])
    cols, stats = D.tokenize_chats(tok, [{"id": "a", "messages": CHAT}], max_length=prompt_len)
    assert stats["dropped_no_assistant_tokens"] == 1 and cols["conv_id"] == []
    assert not D.first_answer_fits(tok, CHAT, prompt_len)
    assert D.first_answer_fits(tok, CHAT, prompt_len + 1)
    cols, stats = D.tokenize_chats(tok, [{"id": "a", "messages": CHAT}], max_length=prompt_len + 1)
    assert stats["conversations"] == 1 and cols["loss_mask"][0][-1] == 1


# ---- regeneration (HF backend, tiny random target) ----------------------------------------
def tiny_params(tiny_target_dir, tmp_path, **data):
    overrides = {"target": {"path": str(tiny_target_dir), "dtype": "float32"},
                 "output_dir": str(tmp_path),
                 "data": {"regenerate": True, "regen_backend": "hf", "regen_max_new_tokens": 5,
                          "regen_batch_size": 2, "max_length": 96, "draft_vocab_size": 64, **data}}
    return load_params("params/ci.yaml", overrides)


REGEN_CHATS = [
    {"id": "a", "messages": [{"role": "user", "content": "Name a color."},
                             {"role": "assistant", "content": "Blue."},
                             {"role": "user", "content": "Another one?"},
                             {"role": "assistant", "content": "Red."}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be short."},
                             {"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4"}]},
    {"id": "c", "messages": [{"role": "user", "content": "Say hi."},
                             {"role": "assistant", "content": "Hi!"}]},
]


@pytest.fixture(scope="module")
def varied_tiny_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with a random final-norm scale: its greedy answers vary with the prompt
    (the plain random model just repeats "\n", which would make comparisons meaningless)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path_factory.mktemp("varied_tiny")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.model.norm.weight.copy_(3 * torch.randn(model.model.norm.weight.shape, generator=g))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tiny_target_dir)).save_pretrained(out)
    return out


def greedy_reference(model_dir, messages, max_new_tokens):
    """Unbatched greedy decoding of one prompt with plain transformers: (new ids, hit eos)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in new:
        return new[:new.index(tok.eos_token_id)], True
    return new, False


def check_against_reference(model_dir, convs, max_new_tokens):
    """HFGenerator's ids for the rendered prompts equal unbatched greedy decoding's, with the end
    token kept when it stopped."""
    from eagle3lib.chat_template import prompt_ids
    from eagle3lib.regenerate import HFGenerator
    gen = HFGenerator(model_dir, "float32", max_new_tokens=max_new_tokens, temperature=0.0)
    outputs = gen([prompt_ids(gen.tokenizer, c) for c in convs], list(range(len(convs))))
    for conv, (ids, capped) in zip(convs, outputs):
        ref_ids, hit_eos = greedy_reference(model_dir, conv, max_new_tokens)
        assert ids == ref_ids + ([gen.tokenizer.eos_token_id] if hit_eos else []) and capped == (not hit_eos)
    return outputs


def test_hf_generator_matches_unbatched_greedy(varied_tiny_dir):
    """Batched, left-padded generation gives what each prompt gives alone (fp32, greedy)."""
    convs = [c["messages"][:[m["role"] for m in c["messages"]].index("assistant")] for c in REGEN_CHATS]
    convs[2] = [{"role": "user", "content": "A much longer prompt, so that the others are padded " * 3}]
    outputs = check_against_reference(varied_tiny_dir, convs, 6)
    assert len({tuple(ids) for ids, _ in outputs}) == 3 and all(capped for _, capped in outputs)


def test_hf_generator_stops_at_end_of_turn(smollm2_dir):
    """On the real target a short answer ends with <|im_end|>: not capped, the end token is the
    last generated id and nowhere before it."""
    convs = [[{"role": "user", "content": "Reply with only the word: yes"}],
             [{"role": "user", "content": "What is the capital of France? One word."}]]
    from eagle3lib.target import load_tokenizer
    outputs = check_against_reference(smollm2_dir, convs, 12)
    end = load_tokenizer(smollm2_dir).eos_token_id
    stopped = [ids for ids, capped in outputs if not capped]
    assert stopped and all(ids[-1] == end and end not in ids[:-1] and len(ids) > 1 for ids in stopped)


def reply_ids(tok, text, capped):
    """What an engine returns for `text`: its ids, then the end-of-turn token unless capped."""
    return tok(text, add_special_tokens=False)["input_ids"] + ([] if capped else [tok.eos_token_id]), capped


def last_user(tok, prompt, replies):
    """The reply key that occurs last in the decoded prompt (the user turn being answered)."""
    text = tok.decode(prompt)
    return max(replies, key=text.rfind)


def scripted(tok, replies):
    """A fake backend: answers from a script keyed by the last user message of the prompt ids."""
    calls = []

    def generate(prompts, seeds):
        users = [last_user(tok, p, replies) for p in prompts]
        calls.append(users)
        return [reply_ids(tok, *replies[u]) for u in users]
    return generate, calls


TURN_RULE_CHATS = [
    {"id": "two", "messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "x"},
                               {"role": "user", "content": "u2"}, {"role": "assistant", "content": "y"},
                               {"role": "user", "content": "u3"}, {"role": "assistant", "content": "z"}]},
    {"id": "capped", "messages": [{"role": "user", "content": "c1"}, {"role": "assistant", "content": "x"},
                                  {"role": "user", "content": "c2"}, {"role": "assistant", "content": "y"}]},
    {"id": "empty1", "messages": [{"role": "user", "content": "e1"}, {"role": "assistant", "content": "x"}]},
    {"id": "empty2", "messages": [{"role": "user", "content": "f1"}, {"role": "assistant", "content": "x"},
                                  {"role": "user", "content": "f2"}, {"role": "assistant", "content": "y"}]},
    {"id": "long", "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "x"}]},
]
TURN_RULE_REPLIES = {"u1": ("A1", False), "u2": ("A2", False), "c1": ("cut off", True),
                     "e1": ("  \n", False), "f1": ("F1", False), "f2": ("", False)}


def test_regenerate_batch_turn_rules(tok):
    generate, calls = scripted(tok, TURN_RULE_REPLIES)
    results = {r["id"]: r for r in D_regen.regenerate_batch(TURN_RULE_CHATS, generate, tok, max_turns=2,
                                                            max_length=64)}
    assert calls == [["u1", "c1", "e1", "f1"], ["u2", "f2"]]   # one backend call per turn
    assert results["two"]["messages"] == [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "A1"},
                                          {"role": "user", "content": "u2"}, {"role": "assistant", "content": "A2"}]
    n_tokens = {k: len(tok(v[0], add_special_tokens=False)["input_ids"]) for k, v in TURN_RULE_REPLIES.items()}
    assert results["two"]["turns"] == 2 and not results["two"]["capped"]
    assert results["two"]["new_tokens"] == n_tokens["u1"] + n_tokens["u2"]   # end tokens not counted
    assert results["capped"]["messages"][-1] == {"role": "assistant", "content": "cut off", "capped": True}
    assert len(results["capped"]["messages"]) == 2 and results["capped"]["capped"]
    assert results["empty1"]["status"] == "empty" and results["empty1"]["messages"] == []
    assert results["empty2"]["status"] == "ok" and results["empty2"]["empty_outputs"] == 1
    assert results["empty2"]["messages"] == [{"role": "user", "content": "f1"}, {"role": "assistant", "content": "F1"}]
    assert results["long"]["status"] == "too_long" and results["long"]["new_tokens"] == 0


class FakeStreamingEngine:
    """A continuously batching engine: requests finish one per poll, newest first (so chats finish
    out of order), answers scripted by the last user message; records the most requests in flight."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.inflight, self.most_inflight, self.seeds = tok, replies, [], 0, {}

    def submit(self, request_id, prompt, seed):
        user = last_user(self.tok, prompt, self.replies)
        self.inflight.append((request_id, user))
        self.most_inflight = max(self.most_inflight, len(self.inflight))
        self.seeds[user] = seed

    def busy(self):
        return bool(self.inflight)

    def poll(self):
        request_id, user = self.inflight.pop()
        return [(request_id, reply_ids(self.tok, *self.replies[user]))]


def test_streaming_regeneration_equals_the_batched_turn_loop(tok, tmp_path):
    """run_streaming (the vLLM path): every chat's first turn in flight at once, chunk files written as
    chats finish, and the same results and per-turn seeds as regenerate_batch."""
    generate, _ = scripted(tok, TURN_RULE_REPLIES)
    batched = {r["id"]: r for r in D_regen.regenerate_batch(TURN_RULE_CHATS, generate, tok, max_turns=2,
                                                            max_length=64, seed=3)}
    engine = FakeStreamingEngine(tok, TURN_RULE_REPLIES)
    run = D_regen.run_streaming(TURN_RULE_CHATS, engine, tok, tmp_path, chunk_size=2, max_turns=2,
                                max_length=64, seed=3, log=lambda line: None)
    assert engine.most_inflight == 4             # all first turns submitted at once ("long" is too long)
    assert results_by_id(tmp_path) == batched
    assert len(list(tmp_path.glob("chunk-*.jsonl"))) == 3   # 5 chats, 2 per chunk
    assert run["new_tokens"] == sum(r["new_tokens"] for r in batched.values())
    assert engine.seeds["u2"] == D_regen._seed(3, "two", 1) and engine.seeds["u1"] == D_regen._seed(3, "two", 0)


def test_regenerate_hf_resumes(tiny_target_dir, tmp_path):
    # Sampling: the random tiny model's greedy answer is whitespace (it repeats "\n").
    params = tiny_params(tiny_target_dir, tmp_path, regen_max_turns=2, regen_temperature=1.0)
    run_dir = tmp_path / "run"
    kept, stats = regenerate_chats(params, run_dir, REGEN_CHATS[:2], progress=False)
    assert stats["regenerated"] == 2 and stats["from_cache"] == 0
    assert stats["kept"] + stats["dropped_empty"] + stats["dropped_too_long"] == 2
    assert stats["kept"] >= 1
    assert stats["new_tokens_total"] == stats["new_tokens_this_run"] > 0
    by_id = {c["id"]: c["messages"] for c in kept}
    for conv_id, msgs in by_id.items():
        source = {c["id"]: c for c in REGEN_CHATS}[conv_id]["messages"]
        kept_prompts = [m for m in msgs if m["role"] != "assistant"]
        source_prompts = [m for m in source if m["role"] != "assistant"]
        assert kept_prompts == source_prompts[:len(kept_prompts)]   # user/system turns unchanged
        roles = [m["role"] for m in msgs if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) % 2 == 0
        assert msgs[-1]["role"] == "assistant" and sum(m["role"] == "assistant" for m in msgs) <= 2
        assert all(not m.get("capped") or i == len(msgs) - 1 for i, m in enumerate(msgs))

    # Resume: the finished chats come from the chunk files, only "c" is generated.
    out_dir = regen_dir(params, run_dir)
    chunk_files = {p: p.read_bytes() for p in out_dir.glob("chunk-*.jsonl")}
    kept2, stats2 = regenerate_chats(params, run_dir, REGEN_CHATS, progress=False)
    assert stats2["from_cache"] == 2 and stats2["regenerated"] == 1 and stats2["conversations"] == 3
    assert {c["id"]: c["messages"] for c in kept2 if c["id"] != "c"} == by_id
    assert all(p.read_bytes() == b for p, b in chunk_files.items())


def test_regenerate_keeps_results_from_an_interrupted_run(tiny_target_dir, tmp_path):
    """A killed run leaves finished chunk files: a rerun must keep them, not redo them."""
    params = tiny_params(tiny_target_dir, tmp_path, regen_temperature=1.0)
    run_dir = tmp_path / "run"
    out_dir = regen_dir(params, run_dir)
    out_dir.mkdir(parents=True)
    from eagle3lib.chat_template import prompt_ids
    from eagle3lib.target import load_tokenizer
    tok = load_tokenizer(tiny_target_dir)
    prompt = prompt_ids(tok, REGEN_CHATS[1]["messages"][:2])
    answer, _ = reply_ids(tok, "CACHED ANSWER", False)
    cached = {"id": "b", "key": D_regen.prompt_key(REGEN_CHATS[1], params.data.regen_max_turns),
              "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "CACHED ANSWER"}],
              "status": "ok", "turns": 1, "new_tokens": 3, "capped": False, "empty_outputs": 0,
              "inconsistent": False, "prompt_ids": [prompt], "output_ids": [answer]}
    write_chunk(out_dir, [cached])
    (out_dir / ".chunk-half.jsonl.tmp").write_text('{"id": "c", "mess')  # a write that was killed
    kept, stats = regenerate_chats(params, run_dir, REGEN_CHATS, progress=False)
    assert stats["from_cache"] == 1 and stats["regenerated"] == 2
    assert {c["id"]: c for c in kept}["b"]["messages"][1]["content"] == "CACHED ANSWER"
    assert {c["id"]: c for c in kept}["b"]["input_ids"] == prompt + answer   # the stored ids, not a re-render
    assert set(results_by_id(out_dir)) == {"a", "b", "c"}
    # Other settings -> another folder, nothing reused.
    params2 = tiny_params(tiny_target_dir, tmp_path, regen_max_new_tokens=3)
    assert regen_dir(params2, run_dir) != out_dir


# ---- the whole stage ----------------------------------------------------------------------
def test_prepare_data_local_jsonl(tiny_target_dir, tmp_path):
    recs = [openai(("user", f"Tell me fact number {i}."), ("assistant", f"Fact {i}: water is wet."),
                   id=f"f{i}") for i in range(14)]
    recs += [openai(("user", "q")), "{broken"]
    src = write_jsonl(tmp_path / "facts.jsonl", recs)
    params = tiny_params(tiny_target_dir, tmp_path, source=str(src), max_records=None, num_eval=3,
                         num_train=6, regenerate=False)
    run_dir = params.run_dir("t")
    before = D.load_eval_prompts(params, run_dir)   # no prepare_data yet: computed from the split
    stats = D.prepare_data(params, run_dir, progress=False)
    assert not stats.cached
    assert stats.records_read == 16 and stats.malformed == {"invalid_json": 1, "no_assistant_turn": 1}
    assert stats.train.conversations == 6 and stats.eval.conversations == 3
    train, ev = D.load_processed(run_dir, "train"), D.load_processed(run_dir, "eval")
    assert set(train.column_names) == {"conv_id", "input_ids", "loss_mask"}
    assert len(train) == 6 and len(ev) == 3
    assert not set(train["conv_id"]) & set(ev["conv_id"])
    assert sum(map(sum, train["loss_mask"])) == stats.train.assistant_tokens
    prompts = D.load_eval_prompts(params, run_dir)
    assert prompts == before and [p["id"] for p in prompts] == ev["conv_id"]
    assert prompts[0]["messages"][-1]["role"] == "user" and prompts[0]["category"] is None
    from eagle3lib.vocab import load_vocab
    d2t, t2d = load_vocab(RunLayout(run_dir).vocab)
    assert d2t.numel() == 64 and t2d.numel() == 49152
    assert stats.coverage_train == 1.0   # fewer than 64 distinct assistant tokens
    # Cached: same params -> no rebuild; other params -> rebuild.
    again = D.prepare_data(params, run_dir, progress=False)
    assert again.cached and again.cache_key == stats.cache_key
    params2 = tiny_params(tiny_target_dir, tmp_path, source=str(src), max_records=None, num_eval=3,
                          num_train=4, regenerate=False)
    assert D.load_eval_prompts(params2, run_dir) == before  # stale files are not trusted, same split
    rebuilt = D.prepare_data(params2, run_dir, progress=False)
    assert not rebuilt.cached and len(D.load_processed(run_dir, "train")) == 4
    assert not list(RunLayout(run_dir).data.glob(".build-*"))


def test_prepare_data_with_regeneration(tiny_target_dir, tmp_path):
    params = tiny_params(tiny_target_dir, tmp_path, max_records=60, num_eval=2, num_train=3,
                         regen_temperature=1.0)
    run_dir = params.run_dir("r")
    stats = D.prepare_data(params, run_dir, progress=False)
    regen = stats.regen
    assert regen.conversations == 5 and regen.regenerated == 5
    assert regen.kept == 5 - regen.dropped_empty - regen.dropped_too_long
    train = D.load_processed(run_dir, "train")
    results = results_by_id(regen_dir(params, run_dir))
    from eagle3lib.target import load_tokenizer
    tok = load_tokenizer(tiny_target_dir)
    assert len(train) == 3
    for conv_id, ids, mask in zip(train["conv_id"], train["input_ids"], train["loss_mask"]):
        answer = results[conv_id]["messages"][-1]
        assert answer["role"] == "assistant"
        expected = answer["content"] + ("" if answer.get("capped") else END)
        run = masked_runs(tok, ids, mask)[-1]
        if len(ids) < params.data.max_length:  # not truncated: the whole regenerated answer is trained
            assert run == expected
        else:
            assert expected.startswith(run)


def test_prepare_data_regenerates_only_the_first_regen_num_train(tiny_target_dir, tmp_path):
    """regen_num_train: the first N training chats get the target's answers, the rest keep the
    dataset's; the draft vocabulary counts only the target's answers."""
    from eagle3lib import vocab as V
    from eagle3lib.vocab import load_vocab
    params = tiny_params(tiny_target_dir, tmp_path, max_records=60, num_eval=2, num_train=5,
                         regen_num_train=2, regen_temperature=1.0, draft_vocab_size=8)
    run_dir = params.run_dir("r")
    stats = D.prepare_data(params, run_dir, progress=False)
    regen = stats.regen
    assert regen.conversations == 2 + 2                     # 2 training + 2 held-out chats
    assert regen.train_original_answers == 3
    results = results_by_id(regen_dir(params, run_dir))
    eval_chats, pool, _ = C.held_out_chats(params)
    from eagle3lib.target import load_tokenizer
    tok = load_tokenizer(tiny_target_dir)
    chosen, _ = D.select_train(tok, pool, 5, params.data.max_length, progress=False)
    assert set(results) == {c["id"] for c in chosen[:2] + eval_chats}
    train = D.load_processed(run_dir, "train")
    originals = {c["id"]: c for c in chosen[2:]}
    assert len(train) == regen.train_regenerated + 3
    regenerated_rows = []
    for conv_id, ids, mask in zip(train["conv_id"], train["input_ids"], train["loss_mask"]):
        first_answer = masked_runs(tok, ids, mask)[0]
        if conv_id in originals:   # the dataset's own first answer, not a regenerated one
            source = next(m["content"] for m in originals[conv_id]["messages"] if m["role"] == "assistant")
            assert (source + END).startswith(first_answer) and len(first_answer) > 0
        else:
            assert conv_id in results
            regenerated_rows.append((ids, mask))
    counts = V.count_assistant_tokens(regenerated_rows, stats.vocab_size)
    d2t, _ = load_vocab(RunLayout(run_dir).vocab)
    assert torch.equal(d2t, V.build_draft_vocab(counts, 8)[0])
    everything = V.count_assistant_tokens(zip(train["input_ids"], train["loss_mask"]), stats.vocab_size)
    assert not torch.equal(d2t, V.build_draft_vocab(everything, 8)[0])   # the test can tell them apart


def test_regen_num_train_is_validated():
    from eagle3lib.params import ParamsError
    for data, match in [({"regenerate": False, "regen_num_train": 2}, "needs data.regenerate"),
                        ({"regenerate": True, "num_train": 3, "regen_num_train": 4}, "<= data.num_train"),
                        ({"regenerate": True, "regen_num_train": 0}, ">= 1")]:
        with pytest.raises(ParamsError, match=f"data.regen_num_train: .*{match}"):
            load_params("params/ci.yaml", {"data": data})


def test_eval_prompts_file(tmp_path, ci_params):
    import dataclasses
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "category": "math"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "id": "m"},
        {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "u2"}]}])
    params = dataclasses.replace(ci_params, eval=dataclasses.replace(ci_params.eval, prompts_path=str(path)))
    prompts = D.load_eval_prompts(params, tmp_path)
    assert prompts[0] == {"id": "prompt-1", "messages": [{"role": "user", "content": "What is 2+2?"}],
                          "category": "math"}
    assert prompts[1]["id"] == "m" and [m["role"] for m in prompts[1]["messages"]] == ["system", "user"]
    assert prompts[2]["messages"] == [{"role": "user", "content": "u1"}]
    assert len(D.load_eval_prompts(params, tmp_path, limit=2)) == 2
    write_jsonl(path, [{"category": "x"}])
    with pytest.raises(ValueError, match="p.jsonl:1"):
        D.load_eval_prompts(params, tmp_path)


@pytest.mark.vllm
@pytest.mark.slow
def test_regenerate_vllm_subprocess(smollm2_dir, tmp_path, capsys, monkeypatch):
    """The vLLM backend (a `python -m eagle3lib.regenerate` subprocess) on the real target. Under
    the headless runner (text progress) its [regen] progress lines reach stderr, the stream the
    runner shows in the terminal."""
    from eagle3lib.progress import PROGRESS_ENV
    monkeypatch.setenv(PROGRESS_ENV, "text")
    overrides = {"target": {"path": str(smollm2_dir), "dtype": "bfloat16"}, "output_dir": str(tmp_path),
                 "data": {"regenerate": True, "regen_backend": "vllm", "regen_max_new_tokens": 12,
                          "regen_batch_size": 2, "max_length": 128, "regen_max_turns": 2}}
    params = load_params("params/ci.yaml", overrides)
    chats = [{"id": "yes", "messages": [{"role": "user", "content": "Reply with only the word: yes"},
                                        {"role": "assistant", "content": "yes"},
                                        {"role": "user", "content": "And now only the word: no"},
                                        {"role": "assistant", "content": "no"}]},
             {"id": "essay", "messages": [{"role": "user", "content": "Write a long essay about rivers."},
                                          {"role": "assistant", "content": "Rivers..."}]},
             {"id": "paris", "messages": [{"role": "user", "content": "What is the capital of France? One word."},
                                          {"role": "assistant", "content": "Paris"}]}]
    run_dir = tmp_path / "run"
    kept, stats = regenerate_chats(params, run_dir, chats, progress=False)
    assert stats["backend"] == "vllm" and stats["regenerated"] == 3 and stats["kept"] == 3
    relayed = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[regen]")]
    assert relayed[0].startswith("[regen] vLLM: 3 chats") and relayed[-1].startswith("[regen] 3/3 chats"), relayed
    results = results_by_id(regen_dir(params, run_dir))
    essay = results["essay"]
    assert essay["capped"] and essay["new_tokens"] == 12 and essay["messages"][-1]["capped"]
    assert essay["messages"][-1]["content"] != "Rivers..."
    for r in results.values():
        assert all(END not in m["content"] for m in r["messages"])
        if not r["capped"]:
            assert r["messages"][-1]["role"] == "assistant" and r["new_tokens"] < 12 * r["turns"]
    assert any(not r["capped"] for r in results.values())   # short answers stop at <|im_end|>
    kept2, stats2 = regenerate_chats(params, run_dir, chats, progress=False)  # all cached: no subprocess
    assert stats2["from_cache"] == 3 and stats2["regenerated"] == 0 and kept2 == kept


def test_jsonl_chunks_survive_unicode_line_separators(tmp_path):
    """Python's str.splitlines() also splits on U+2028/U+2029/U+0085, which json.dumps(ensure_ascii=False)
    leaves raw inside strings: a ShareGPT answer holding one broke the vLLM regeneration requests."""
    from eagle3lib.regenerate import write_chunk
    tricky = "line one\u2028line two\u2029para\x85next\x1cfs"
    write_chunk(tmp_path, [{"id": "a", "key": "ka", "text": tricky}, {"id": "b", "key": "kb", "text": "plain"}])
    results = results_by_id(tmp_path)
    assert results["a"]["text"] == tricky and results["b"]["text"] == "plain"


# ---- stale data and bad bytes ----------------------------------------------------
def test_non_utf8_records_are_counted_as_malformed(tmp_path):
    """One record with bytes that are not UTF-8 is counted ("not_utf8"); the others are read."""
    recs = [openai(("user", f"q{i}"), ("assistant", f"a{i}"), id=f"c{i}") for i in range(3)]
    lines = [json.dumps(r).encode() for r in recs]
    lines[1] = lines[1].replace(b'"q1"', b'"q\xff1"')
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    chats, stats = C.load_chats(str(jsonl))
    assert stats["malformed"] == {"not_utf8": 1} and [c["id"] for c in chats] == ["c0", "c2"]
    bad = [r for r in C.iter_raw_records(str(jsonl)) if isinstance(r, C.MalformedRecord)]
    assert "bad.jsonl line 2" in str(bad[0]) and "\\xff" in str(bad[0])
    array = tmp_path / "bad.json"
    array.write_bytes(json.dumps(recs).encode().replace(b'"a2"', b'"a\xc3\x282"'))  # invalid 2-byte seq
    chats, stats = C.load_chats(str(array))
    assert stats["malformed"] == {"not_utf8": 1} and [c["id"] for c in chats] == ["c0", "c1"]
    assert stats["records_read"] == 3


def _decoded_train(tok, run_dir) -> str:
    return "\n".join(tok.decode(ids) for ids in D.load_processed(run_dir, "train")["input_ids"])


def test_source_edited_in_place_is_rebuilt(tiny_target_dir, tmp_path, tok):
    """Same path, same size, same mtime, other content: the data stage rebuilds (content hash)."""
    import os
    recs = [openai(("user", f"Tell me fact number {i}."), ("assistant", f"Fact {i}: water is wet."),
                   id=f"f{i}") for i in range(10)]
    src = write_jsonl(tmp_path / "facts.jsonl", recs)
    params = tiny_params(tiny_target_dir, tmp_path, source=str(src), max_records=None, num_eval=2,
                         num_train=4, regenerate=False)
    run_dir = params.run_dir("t")
    first = D.prepare_data(params, run_dir, progress=False)
    assert "Fact" in _decoded_train(tok, run_dir)
    before = src.stat()
    src.write_text(src.read_text().replace("fact", "joke").replace("Fact", "Joke"))
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert src.stat().st_size == before.st_size and src.stat().st_mtime_ns == before.st_mtime_ns
    second = D.prepare_data(params, run_dir, progress=False)
    assert not second.cached and second.cache_key != first.cache_key
    text = _decoded_train(tok, run_dir)
    assert "Joke" in text and "Fact" not in text and "fact" not in text
    assert D.prepare_data(params, run_dir, progress=False).cached  # unchanged file: cached again


def test_switched_source_never_reuses_regenerated_answers(tiny_target_dir, tmp_path, tok):
    """Two files with the same conversation ids under one run name: the train set follows the
    second file (its prompts, freshly regenerated answers), not the first file's chunks."""
    def source(name, topic):
        recs = [openai(("user", f"Say something about {topic} number {i}."), ("assistant", "ok"),
                       id=f"c{i}") for i in range(6)]
        return str(write_jsonl(tmp_path / name, recs))
    common = dict(max_records=None, num_eval=2, num_train=3, regen_temperature=1.0)
    P1 = tiny_params(tiny_target_dir, tmp_path, source=source("apples.jsonl", "apples"), **common)
    params2 = tiny_params(tiny_target_dir, tmp_path, source=source("oceans.jsonl", "oceans"), **common)
    run_dir = P1.run_dir("same-run")
    D.prepare_data(P1, run_dir, progress=False)
    assert "apples" in _decoded_train(tok, run_dir)
    stats = D.prepare_data(params2, run_dir, progress=False)
    assert stats.regen.from_cache == 0 and stats.regen.regenerated == 5
    text = _decoded_train(tok, run_dir)
    assert len(D.load_processed(run_dir, "train")) >= 1
    assert "oceans" in text and "apples" not in text
    prompts = D.load_eval_prompts(params2, run_dir)
    assert all("oceans" in p["messages"][-1]["content"] for p in prompts)


def test_chunks_without_content_keys_are_refused(tiny_target_dir, tmp_path):
    """A chunk keyed by conversation id only (the old format) is never reused as if it matched."""
    params = tiny_params(tiny_target_dir, tmp_path, regen_temperature=1.0)
    run_dir = tmp_path / "run"
    out_dir = regen_dir(params, run_dir)
    out_dir.mkdir(parents=True)
    old = {"id": "b", "messages": [{"role": "user", "content": "another chat's prompt"},
                                   {"role": "assistant", "content": "ANOTHER CHAT'S ANSWER"}],
           "status": "ok", "turns": 1, "new_tokens": 3, "capped": False, "empty_outputs": 0}
    (out_dir / "chunk-0123456789abcdef.jsonl").write_text(json.dumps(old) + "\n")
    with pytest.raises(ValueError, match=r"data stage .*chunk-0123456789abcdef\.jsonl.*delete"):
        regenerate_chats(params, run_dir, REGEN_CHATS, progress=False)


# ---- several sources ----------------------------------------------------------------------
def save_to_disk(folder: Path, records: list) -> Path:
    import datasets
    datasets.Dataset.from_list(records).save_to_disk(str(folder))
    return folder


def test_several_sources_prefix_ids_dedupe_across_and_count_per_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [openai(("user", f"qa{i}"), ("assistant", f"aa{i}"), id=f"c{i}")
                                           for i in range(5)] + ["{not json"])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([sharegpt(("human", "qa0"), ("gpt", "aa0"), id="c0"),   # same content as a.jsonl's c0
                             sharegpt(("human", "qb1"), ("gpt", "ab1"), id="c1"),   # same id, other content
                             sharegpt(("human", "q"), ("bing", "x"), id="c2")]))
    folder = save_to_disk(tmp_path / "saved", [openai(("user", f"qs{i}"), ("assistant", f"as{i}"), id=f"s{i}")
                                               for i in range(4)])
    source = [{"path": str(a), "max_records": 3}, str(b), {"path": str(folder), "max_records": None}]
    chats, stats = C.load_chats(source)
    ids = [c["id"] for c in chats]
    assert ids == ["a.jsonl:c0", "a.jsonl:c1", "a.jsonl:c2", "b.json:c1",
                   "saved:s0", "saved:s1", "saved:s2", "saved:s3"]
    per = {s["item"]: s for s in stats["sources"]}
    assert per["data.source[0]"]["records_read"] == 3 and per["data.source[0]"]["valid"] == 3
    assert per["data.source[1]"]["duplicates"] == 1 and per["data.source[1]"]["malformed"] == {"unknown_role": 1}
    assert per["data.source[2]"]["valid"] == 4 and per["data.source[2]"]["malformed"] == {}
    assert stats["valid"] == len(chats) == 8 and stats["duplicates"] == 1 and stats["records_read"] == 10
    # the uncapped a.jsonl: its bad line counted against it; the global cap stops inside the second source
    _, stats = C.load_chats([str(a), str(b)], max_records=7)
    assert [s["records_read"] for s in stats["sources"]] == [6, 1]
    assert stats["sources"][0]["malformed"] == {"invalid_json": 1}
    # a single source keeps its ids unprefixed (existing splits and regeneration results stay valid)
    assert [c["id"] for c in C.load_chats([str(a)])[0]][:2] == ["c0", "c1"]


def test_missing_source_in_a_list_names_the_item_and_the_fix(tmp_path, ci_params):
    from eagle3lib.params import ParamsError
    a = write_jsonl(tmp_path / "a.jsonl", [openai(("user", "q"), ("assistant", "a"))])
    source = ["sharegpt", {"path": str(a), "max_records": 5}, {"path": str(tmp_path / "gone.jsonl")}]
    with pytest.raises(ParamsError, match=r"data.source\[2\]: .*gone.jsonl.*no such file or folder on this "
                                          r"machine; fix the path.*remove the item"):
        C.load_chats(source)
    params = load_params("params/ci.yaml", {"data": {"source": source}})  # validation does not look at the disk
    with pytest.raises(ParamsError, match=r"data.source\[2\]"):
        D.cache_key(params)                                             # the data stage refuses it
    with pytest.raises(ParamsError, match=r"data.source\[2\]"):
        C.held_out_chats(params)


@pytest.mark.parametrize("source, match", [
    ([], "non-empty list"),
    ([{"path": "a.jsonl", "cap": 3}], r"data.source\[0\]: unknown key 'cap'"),
    ([{"path": "a.jsonl", "max_records": 0}], r"data.source\[0\].max_records: expected an int >= 1"),
    (["sharegpt", "sharegpt"], "listed twice"),
    ([3], r"data.source\[0\]: expected a path or a mapping"),
    (["chats.csv"], r"data.source\[0\]: 'chats.csv' must be 'sharegpt', a .json/.jsonl file or a folder"),
])
def test_source_list_validation(source, match):
    from eagle3lib.params import ParamsError
    with pytest.raises(ParamsError, match=match):
        load_params("params/ci.yaml", {"data": {"source": source}})


def test_source_sha256_covers_every_source_and_a_saved_folders_data(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [openai(("user", "q"), ("assistant", "a"), id="x")])
    folder = save_to_disk(tmp_path / "saved", [openai(("user", "q1"), ("assistant", "a1"), id="s")])
    source = [str(a), {"path": str(folder), "max_records": 10}]
    before = C.source_sha256(source)
    assert C.source_sha256(source) == before
    assert C.source_sha256(str(a)) == C.path_sha256(str(a))          # one source: its file hash, as before
    assert C.source_sha256([str(a), {"path": str(folder), "max_records": 9}]) != before   # the cap is part of it
    save_to_disk(tmp_path / "saved2", [openai(("user", "q1"), ("assistant", "a1 edited"), id="s")])
    for f in (tmp_path / "saved2").glob("*.arrow"):
        next(folder.glob("*.arrow")).write_bytes(f.read_bytes())
    assert C.source_sha256(source) != before                         # the folder's rows changed


def test_unreadable_folder_is_named(tmp_path):
    folder = tmp_path / "not-a-dataset"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"not-a-dataset.*cannot read it as a folder written by datasets.save_to_disk"):
        C.load_chats(str(folder))
    with pytest.raises(ValueError, match=r"not-a-dataset.*without \*.arrow"):
        C.source_sha256(str(folder))
