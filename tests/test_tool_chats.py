"""Chats with tools as the target renders them: records with tools normalise to OpenAI messages (tool
turns kept, calls numbered as Kimi-K2 numbers them), render with the template's `tools` argument
(chat_template.KIMI_LIKE_TEMPLATE on SmolLM2's tokenizer, the tool-call markers added as special
tokens like Kimi's own), regeneration sends the tools declaration, the tool calls are trained and the
tool results not, the draft vocabulary covers the markers; malformed tool records are counted skips,
and a chat without tools hashes and tokenises as before. Nothing downloaded."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from eagle3lib import chats as C
from eagle3lib import data as D
from eagle3lib import regenerate as R
from eagle3lib.chat_template import ignored_tool_features, prompt_ids, render_text, save_kimi_like_tokenizer
from eagle3lib.layout import RunLayout
from eagle3lib.params import load_params
from eagle3lib.target import load_tokenizer
from eagle3lib.vocab import load_vocab

MARKERS = ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
           "<|tool_call_end|>", "<|tool_calls_section_end|>"]
SCHEMA = {"name": "get_weather", "description": "Current weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": SCHEMA}]
DECLARE = ('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather","description":'
           '"Current weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},'
           '"required":["city"]}}}]<|im_end|>')
KIMI_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


def weather_record(i: int = 0, tools=None, **extra) -> dict:
    """An OpenAI-style record as TRL/APIGen-style sets store it: tools as a JSON string of bare schemas,
    the dataset's own call id, arguments as a dict, content null beside the calls."""
    return {"id": f"w{i}", "tools": json.dumps([SCHEMA]) if tools is None else tools, **extra,
            "messages": [{"role": "user", "content": f"What is the weather in Paris? ({i})"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_abc", "type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"},
                         {"role": "assistant", "content": "It is sunny in Paris."}]}


WEATHER = [{"role": "user", "content": "What is the weather in Paris? (0)"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "functions.get_weather:0", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"},
           {"role": "assistant", "content": "It is sunny in Paris."}]


@pytest.fixture(scope="module")
def tool_dir(smollm2_dir, tmp_path_factory):
    """A target folder: SmolLM2's config and weights, its tokenizer with the Kimi-like template and the
    tool-call markers as special tokens (one id each, as in Kimi's tokenizer)."""
    out = save_kimi_like_tokenizer(smollm2_dir, tmp_path_factory.mktemp("kimi_tools"))
    tok = load_tokenizer(out)
    tok.add_tokens(MARKERS, special_tokens=True)
    tok.save_pretrained(str(out))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (smollm2_dir / name).exists():
            (out / name).symlink_to(smollm2_dir / name)
    return out


@pytest.fixture(scope="module")
def ttok(tool_dir):
    return load_tokenizer(tool_dir)


def marker_ids(tok) -> list[int]:
    ids = [tok.convert_tokens_to_ids(m) for m in MARKERS]
    assert all(isinstance(i, int) and i >= 49152 for i in ids)     # added: one id each
    return ids


# ---- records -> chats ------------------------------------------------------------------------------
def test_openai_record_keeps_tools_tool_calls_and_the_tool_turn():
    repairs = {}
    messages, tools = C.normalize_record(weather_record(), repairs)
    assert messages == WEATHER and tools == TOOLS and not repairs
    # the OpenAI tools form is kept as it is; a list (not a JSON string) reads the same
    assert C.normalize_record(weather_record(tools=TOOLS)) == (WEATHER, TOOLS)
    assert C.normalize_chat(weather_record()) == WEATHER                      # a `tool` role is kept, not rejected


def test_sharegpt_tool_record_normalises_like_the_openai_one():
    record = {"tools": json.dumps([SCHEMA]), "conversations": [
        {"from": "human", "value": "What is the weather in Paris? (0)"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny, 21 C"},
        {"from": "gpt", "value": "It is sunny in Paris."}]}
    assert C.normalize_record(record) == (WEATHER, TOOLS)


def test_calls_are_numbered_over_the_chat_and_results_follow_their_call():
    """Two calls in one turn, results in the other order (matched by id), then a call without an id
    answered by position: ids functions.NAME:IDX with IDX counting the chat's calls."""
    def call(name, cid=None):
        return {**({"id": cid} if cid else {}), "type": "function", "function": {"name": name, "arguments": "{}"}}
    record = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "Two calls.",
                            "tool_calls": [call("a", "x"), call("b", "y")]},
                           {"role": "tool", "tool_call_id": "y", "content": "B"},
                           {"role": "tool", "tool_call_id": "x", "content": "A"},
                           {"role": "assistant", "content": "", "tool_calls": [call("a")]},
                           {"role": "tool", "content": {"value": 1}},
                           {"role": "assistant", "content": "done"}]}
    messages, tools = C.normalize_record(record)
    assert tools is None
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["functions.a:0", "functions.b:1"]
    assert [m.get("tool_call_id") for m in messages[2:4]] == ["functions.b:1", "functions.a:0"]
    assert messages[4]["tool_calls"][0]["id"] == "functions.a:2" and messages[5]["tool_call_id"] == "functions.a:2"
    assert messages[5]["content"] == '{"value": 1}'                         # a JSON result kept as JSON text


def openai(*messages, tools=None):
    return {"messages": list(messages), **({} if tools is None else {"tools": tools})}


USER = {"role": "user", "content": "q"}
CALLS = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "r"}
ANSWER = {"role": "assistant", "content": "a"}
MALFORMED = [
    ("bad_tools", "not JSON", openai(USER, ANSWER, tools="[{not json")),
    ("bad_tools", "not a list", openai(USER, ANSWER, tools={"name": "f"})),
    ("bad_tools", "without a function name", openai(USER, ANSWER, tools=[{"description": "no name"}])),
    ("bad_tools", "parameters are not a JSON object", openai(USER, ANSWER, tools=[{"name": "f", "parameters": "x"}])),
    ("bad_tool_call", "arguments are not JSON", openai(USER, {**CALLS, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]}, RESULT, ANSWER)),
    ("bad_tool_call", "without a function name", openai(USER, {**CALLS, "tool_calls": [{"function": {}}]}, ANSWER)),
    ("bad_tool_call", "answers no call", openai(USER, CALLS, {**RESULT, "tool_call_id": "c9"}, ANSWER)),
    ("bad_tool_call", "a tool result for no call", openai(USER, CALLS, RESULT, RESULT, ANSWER)),
    ("bad_tool_call", "has no result", openai(USER, CALLS, USER, ANSWER)),
    ("bad_tool_call", "not JSON", {"conversations": [{"from": "human", "value": "q"},
                                                     {"from": "function_call", "value": "f(city=Paris)"}]}),
    ("non_alternating", "tool result after user", openai(USER, RESULT, ANSWER)),
    ("unknown_role", "function", openai(USER, {"role": "function", "content": "r"}, ANSWER)),
]


@pytest.mark.parametrize("reason,detail,record", MALFORMED)
def test_malformed_tool_record_names_its_reason(reason, detail, record):
    with pytest.raises(C.MalformedRecord) as e:
        C.normalize_record(record)
    assert e.value.reason == reason and detail in str(e.value)


def test_malformed_tool_records_are_counted_skips(tmp_path):
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [weather_record()] + [r for _, _, r in MALFORMED]))
    chats, stats = C.load_chats(str(path))
    assert stats["malformed"] == {"bad_tool_call": 6, "bad_tools": 4, "non_alternating": 1, "unknown_role": 1}
    assert stats["valid"] == len(chats) == 1 and stats["tool_chats"] == 1
    assert chats[0] == {"id": "w0", "messages": WEATHER, "tools": TOOLS}


# ---- the template and the loss mask ----------------------------------------------------------------
def test_tool_chat_renders_the_declaration_and_the_markers(ttok, smollm2_dir):
    text = render_text(ttok, WEATHER, False, "off", TOOLS)
    assert text.startswith(DECLARE + KIMI_SYSTEM)                 # the declaration first, as Kimi-K2 writes it
    assert "<|im_middle|><think></think>" + CALL + "<|im_end|>" in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>" in text
    assert DECLARE not in render_text(ttok, WEATHER, False, "off")          # only with `tools=`
    assert ignored_tool_features(ttok) == []
    assert ignored_tool_features(load_tokenizer(smollm2_dir)) == ["tools", "tool_calls"]   # ChatML without tools


@pytest.mark.parametrize("thinking", ["on", "off"])
def test_tool_calls_are_trained_and_tool_results_are_not(ttok, thinking):
    row = D.tokenize_chat(ttok, WEATHER, 4096, thinking=thinking, tools=TOOLS)
    ids, mask = row["input_ids"], row["loss_mask"]
    for marker in marker_ids(ttok):                               # each marker is one id, in the mask
        assert [mask[k] for k, i in enumerate(ids) if i == marker] == [1]
    assert D.loss_mask_text(ttok, ids, mask) == (
        DECLARE + KIMI_SYSTEM + "<|im_user|>user<|im_middle|>What is the weather in Paris? (0)<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>[[" + CALL + "<|im_end|>]]"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>[[It is sunny in Paris.<|im_end|>]]")


# ---- regeneration ------------------------------------------------------------------------------------
class RecordingGenerator:
    """A fake engine: records every prompt, answers every call with the same ids."""

    def __init__(self, answer):
        self.answer, self.prompts = answer, []

    def __call__(self, prompts, seeds):
        self.prompts += [list(p) for p in prompts]
        return [(self.answer, False) for _ in prompts]


class StreamingEngine(RecordingGenerator):
    """The same as a continuously batching engine (run_streaming, the vLLM path)."""

    def __init__(self, answer):
        super().__init__(answer)
        self.waiting = []

    def submit(self, request_id, prompt, seed):
        self.prompts.append(list(prompt))
        self.waiting.append(request_id)

    def busy(self):
        return bool(self.waiting)

    def poll(self):
        return [(self.waiting.pop(), (self.answer, False))]


def target_call(tok) -> list[int]:
    """What Kimi emits for a call: its markers (one id each) around the call id and the arguments."""
    return tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_regeneration_sends_the_tools_declaration_and_keeps_the_targets_markers(ttok, tmp_path):
    chat = {"id": "w0", "messages": WEATHER, "tools": TOOLS}
    generated = target_call(ttok)
    assert set(marker_ids(ttok)) <= set(generated)
    gen = RecordingGenerator(generated)
    [result] = R.regenerate_batch([chat], gen, ttok, max_turns=2, max_length=4096, thinking="off")
    prompt = prompt_ids(ttok, WEATHER[:1], "off", TOOLS)
    assert gen.prompts == [prompt]                    # one turn: the dataset's result answers its own call
    assert ttok.decode(prompt).startswith(DECLARE + KIMI_SYSTEM)
    assert result["cut_at_tool"] and result["turns"] == 1
    input_ids, loss_mask = R.token_sequence(result)
    assert input_ids == prompt + generated and loss_mask == [0] * len(prompt) + [1] * len(generated)
    # the vLLM path reads the chats back from a JSONL file of requests: the same prompt
    engine = StreamingEngine(generated)
    R.run_streaming([json.loads(json.dumps(chat))], engine, ttok, tmp_path, chunk_size=1, max_turns=2,
                    max_length=4096, thinking="off", log=lambda line: None)
    assert engine.prompts == [prompt]


def test_prompt_key_holds_the_tools_and_stops_at_the_first_tool_result():
    chat = {"id": "w0", "messages": WEATHER, "tools": TOOLS}
    bare = {"id": "w0", "messages": WEATHER}
    assert R.prompt_key(chat, 2) != R.prompt_key(bare, 2)
    later = {**chat, "messages": WEATHER[:2] + [{**WEATHER[2], "content": "rain"}] + WEATHER[3:]}
    assert R.prompt_key(later, 2) == R.prompt_key(chat, 2)      # never sent to the target: not in the key


# ---- the data stage: draft vocabulary and templates without tools -----------------------------------
def tool_params(target_dir, tmp_path, **data):
    source = tmp_path / "tools.jsonl"
    records = [weather_record(i) for i in range(8)]
    records += [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say {i}."},
                                             {"role": "assistant", "content": f"{i}."}]} for i in range(4)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    return load_params("params/ci.yaml", {
        "target": {"path": str(target_dir), "dtype": "float32"}, "output_dir": str(tmp_path),
        "data": {"source": str(source), "max_records": None, "num_eval": 3, "num_train": 9, "regenerate": False,
                 "max_length": 1024, "draft_vocab_size": 64, "thinking": "off", **data},
        "extract": {"batch_tokens": 8192}, "train": {"batch_tokens": 8192}})


def test_draft_vocab_covers_the_tool_call_markers(tool_dir, ttok, tmp_path):
    """Original tool-call answers rendered by the template: the markers are trained, so the draft
    vocabulary (counted over the trained tokens) holds them."""
    params = tool_params(tool_dir, tmp_path)
    run_dir = params.run_dir("tools")
    stats = D.prepare_data(params, run_dir, progress=False)
    assert stats.tool_chats == 8 and stats.tools_ignored == 0 and stats.malformed_total == 0
    train = D.load_processed(run_dir, "train")
    rows = [ttok.decode(ids) for cid, ids in zip(train["conv_id"], train["input_ids"]) if cid.startswith("w")]
    assert rows and all(row.startswith(DECLARE) for row in rows)    # trained as the target reads them
    trained = {i for ids, mask in zip(train["input_ids"], train["loss_mask"]) for i, m in zip(ids, mask) if m}
    assert set(marker_ids(ttok)) <= trained
    _, t2d = load_vocab(RunLayout(run_dir).vocab)
    assert t2d.numel() == len(ttok) and bool(t2d[torch.tensor(marker_ids(ttok))].all())
    assert D.load_stats(run_dir).tool_chats == 8                 # stats.json carries the counts


def test_a_template_without_tools_support_is_counted_and_said_once(smollm2_dir, tmp_path, capsys):
    params = tool_params(smollm2_dir, tmp_path, thinking="auto")
    stats = D.prepare_data(params, params.run_dir("smol"), progress=False)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "does not render" in line]
    assert len(warnings) == 1 and "tools or tool_calls" in warnings[0]
    tool_ids = {f"w{i}" for i in range(8)}
    used = set(D.load_processed(params.run_dir("smol"), "train")["conv_id"]) | \
        set(D.load_processed(params.run_dir("smol"), "eval")["conv_id"])
    assert stats.tools_ignored == len(used & tool_ids) > 0


# ---- chats without tools: as before ------------------------------------------------------------------
PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
         {"role": "assistant", "content": "Blue."}]


def test_a_chat_without_tools_hashes_as_before():
    old = hashlib.sha256(json.dumps([[m["role"], m["content"]] for m in PLAIN]).encode()).hexdigest()[:20]
    assert C.chat_hash(PLAIN) == old == "7163ea1890e6a378c8d1"             # the digest before tools existed
    for empty in (None, "", "[]", []):                          # no tools: the record reads as without the key
        messages, tools = C.normalize_record({"messages": PLAIN, "tools": empty})
        assert messages == PLAIN and tools is None and C.chat_hash(messages, tools) == old
    assert C.chat_hash(PLAIN, TOOLS) != old                      # tools are part of a chat's content
    prompts = [[m["role"], m["content"]] for m in PLAIN[:2]]
    old_key = hashlib.sha256(json.dumps(["c", prompts]).encode()).hexdigest()[:32]
    assert R.prompt_key({"id": "c", "messages": PLAIN}, 1) == old_key == "2c19e9d1b08ca756931b7313905efbee"


@pytest.mark.parametrize("thinking", ["on", "off"])
def test_a_chat_without_tools_tokenizes_as_before(ttok, thinking):
    row = D.tokenize_chat(ttok, PLAIN, 4096, thinking=thinking)
    for no_tools in (None, []):
        assert D.tokenize_chat(ttok, PLAIN, 4096, thinking=thinking, tools=no_tools) == row
    kwargs = {"thinking": thinking == "on", "enable_thinking": thinking == "on"}
    text = ttok.apply_chat_template(PLAIN, tokenize=False, **kwargs)       # no `tools` passed at all
    assert row["input_ids"] == ttok(text, add_special_tokens=False)["input_ids"]
    assert D.loss_mask_text(ttok, row["input_ids"], row["loss_mask"]) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Name a color.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>[[Blue.<|im_end|>]]")
