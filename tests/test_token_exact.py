"""Token-exact training data on a Kimi-K2.5-like chat template (built here: SmolLM2's tokenizer with
chat_template.KIMI_LIKE_TEMPLATE, nothing downloaded): the cached sequence is the prompt ids sent to
the engine plus the ids the engine generated, the loss mask covers exactly the generated ids,
multi-turn chats stay prefix-consistent or are cut and counted, and data.thinking reaches
regeneration, the data stage's template and the eval prompts alike."""
from __future__ import annotations

import json

import pytest

from eagle3lib import data as D
from eagle3lib import regenerate as R
from eagle3lib.chat_template import (
    KIMI_LIKE_TEMPLATE,
    check_thinking_kwarg,
    prompt_ids,
    render_text,
    save_kimi_like_tokenizer,
    thinking_active,
)
from eagle3lib.layout import RunLayout
from eagle3lib.params import ParamsError, load_params
from eagle3lib.target import load_tokenizer

TWO_TURNS = {"id": "two", "messages": [{"role": "user", "content": "What is 2+2?"},
                                       {"role": "assistant", "content": "four"},
                                       {"role": "user", "content": "And 3+3?"},
                                       {"role": "assistant", "content": "six"}]}
ONE_TURN = {"id": "one", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a color."},
                                      {"role": "assistant", "content": "Blue."}]}


@pytest.fixture(scope="module")
def kimi_dir(smollm2_dir, tmp_path_factory):
    """A target folder: SmolLM2's config, weights and generation config, and its tokenizer with the
    Kimi-like template (no token added, so SmolLM2's weights read every id)."""
    out = save_kimi_like_tokenizer(smollm2_dir, tmp_path_factory.mktemp("kimi_like"))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (smollm2_dir / name).exists():
            (out / name).symlink_to(smollm2_dir / name)
    return out


@pytest.fixture(scope="module")
def ktok(kimi_dir):
    return load_tokenizer(kimi_dir)


def pieces(tok, *texts):
    """Ids of each text tokenised on its own, concatenated: a split the tokenizer would not make
    for the joined text (what an engine may generate; a decode and re-render would lose it)."""
    return [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"]]


class RecordingGenerator:
    """A fake engine: records every prompt it gets; answers with scripted ids per call, in order."""

    def __init__(self, tok, answers):
        self.tok, self.answers, self.prompts = tok, list(answers), []

    def __call__(self, prompts, seeds):
        self.prompts += [list(p) for p in prompts]
        return [self.answers.pop(0) for _ in prompts]


# ---- the template ---------------------------------------------------------------------------------
def test_kimi_like_template_renders_like_kimi(ktok, smollm2_dir):
    history = TWO_TURNS["messages"][:3]
    on, off, auto = (render_text(ktok, history, True, t) for t in ("on", "off", "auto"))
    assert auto == on and on.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert off.endswith("<|im_middle|><think></think>")
    assert "<|im_middle|><think></think>four<|im_end|>" in on           # a past answer: empty think block
    last = render_text(ktok, [*TWO_TURNS["messages"][:1],
                              {"role": "assistant", "content": "4", "reasoning_content": "add"}], False)
    assert last.endswith("<think>add</think>4<|im_end|>")                # after the last user turn: kept
    tools = render_text(ktok, [{"role": "user", "content": "weather?"},
                               {"role": "assistant", "content": "", "tool_calls": [
                                   {"id": "functions.get_weather:0", "type": "function",
                                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
                               {"role": "user", "content": "thanks"}], True)
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>") in tools
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in tools
    assert thinking_active(ktok) and thinking_active(ktok, "on") and not thinking_active(ktok, "off")
    assert ktok.chat_template == KIMI_LIKE_TEMPLATE
    check_thinking_kwarg(ktok, "on")                                      # reads `thinking`: accepted
    smol = load_tokenizer(smollm2_dir)
    assert not thinking_active(smol)
    with pytest.raises(ValueError, match="data.thinking: 'on'.*renders the same prompt.*set data.thinking: auto"):
        check_thinking_kwarg(smol, "on")


# ---- one chat, fake engine --------------------------------------------------------------------------
def test_sequence_is_the_prompt_ids_plus_the_generated_ids(ktok):
    """Thinking mode: the engine gets the rendered prompt (ending in <think>); the cached sequence
    is those ids plus the generated ids exactly (a split the tokenizer would not make, tool-call
    markers, the end token), mask 1 on exactly the generated ids. The old decode-and-re-render
    path gives another sequence."""
    end = ktok.eos_token_id
    generated = pieces(ktok, "Blu", "e is calm", ".</think>", "Blue.", "<|tool_calls_section_begin|>") + [end]
    gen = RecordingGenerator(ktok, [(generated, False)])
    [result] = R.regenerate_batch([ONE_TURN], gen, ktok, max_turns=1, max_length=512, thinking="on")
    prompt = prompt_ids(ktok, ONE_TURN["messages"][:2], "on")
    assert gen.prompts == [prompt] and ktok.decode(prompt).endswith("<|im_middle|><think>")
    input_ids, loss_mask = R.token_sequence(result)
    assert input_ids == prompt + generated
    assert loss_mask == [0] * len(prompt) + [1] * len(generated)
    assert result["messages"][-1] == {"role": "assistant", "content": "Blue.<|tool_calls_section_begin|>",
                                      "reasoning_content": "Blue is calm."}
    assert result["new_tokens"] == len(generated) - 1 and not result["capped"]
    rerendered = D.tokenize_chat(ktok, result["messages"], 4096, thinking="on")["input_ids"]
    assert rerendered != input_ids        # what training read before: `<think></think>` + text, re-tokenised


def test_capped_answer_trains_every_generated_id_and_no_end_token(ktok):
    generated = pieces(ktok, "Let me think about colors and")      # the length cap hit mid-reasoning
    [result] = R.regenerate_batch([ONE_TURN], RecordingGenerator(ktok, [(generated, True)]), ktok,
                                  max_turns=1, max_length=512, thinking="on")
    input_ids, loss_mask = R.token_sequence(result)
    assert result["capped"] and input_ids[-len(generated):] == generated
    assert sum(loss_mask) == len(generated) and ktok.eos_token_id not in input_ids[-len(generated):]


# ---- several turns ------------------------------------------------------------------------------------
def test_thinking_multi_turn_is_cut_at_the_first_inconsistent_turn(ktok):
    """Thinking mode: turn 2's prompt renders the past answer as `<think></think>` + answer, which is
    not what the target wrote: the chat ends after turn 1 (counted), turn 2 is never generated."""
    end = ktok.eos_token_id
    first = pieces(ktok, "Two plus two.</think>four") + [end]
    gen = RecordingGenerator(ktok, [(first, False), (pieces(ktok, "never") + [end], False)])
    [result] = R.regenerate_batch([TWO_TURNS], gen, ktok, max_turns=2, max_length=512, thinking="on")
    assert len(gen.prompts) == 1 and result["inconsistent"] and result["turns"] == 1
    assert [m["role"] for m in result["messages"]] == ["user", "assistant"]   # the unanswered user turn dropped
    assert R.token_sequence(result)[0] == gen.prompts[0] + first
    # the reason: the re-rendered history does not extend the sequence the target produced
    history = result["messages"] + [TWO_TURNS["messages"][2]]
    assert prompt_ids(ktok, history, "on")[:len(gen.prompts[0] + first)] != gen.prompts[0] + first


def test_instant_multi_turn_is_one_prefix_consistent_sequence(ktok):
    """Instant mode (`<think></think>` in the generation prompt and in history alike): turn 2's
    prompt extends turn 1's sequence, the chat is one sequence, every generated id trained."""
    end = ktok.eos_token_id
    first, second = pieces(ktok, "four") + [end], pieces(ktok, "six") + [end]
    gen = RecordingGenerator(ktok, [(first, False), (second, False)])
    [result] = R.regenerate_batch([TWO_TURNS], gen, ktok, max_turns=2, max_length=512, thinking="off")
    assert not result["inconsistent"] and result["turns"] == 2 and len(gen.prompts) == 2
    p1, p2 = gen.prompts
    assert p2[:len(p1) + len(first)] == p1 + first                       # prefix-consistent
    input_ids, loss_mask = R.token_sequence(result)
    assert input_ids == p2 + second
    trained = [i for i, m in zip(input_ids, loss_mask) if m]
    assert trained == first + second and loss_mask[len(p1):len(p1) + len(first)] == [1] * len(first)


# ---- chunk files and params -------------------------------------------------------------------------
def test_chunks_without_token_ids_are_refused(tmp_path):
    text_only = {"id": "b", "key": "k" * 32, "messages": [{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": "a"}],
                 "status": "ok", "turns": 1, "new_tokens": 1, "capped": False, "empty_outputs": 0}
    (tmp_path / "chunk-00000000000000aa.jsonl").write_text(json.dumps(text_only) + "\n")
    with pytest.raises(ValueError, match=r"chunk-00000000000000aa\.jsonl holds answers as text only.*delete"):
        R.load_results(tmp_path)


def test_thinking_param_is_validated_and_keys_the_caches():
    base = {"regenerate": True, "regen_max_new_tokens": 64, "max_length": 256}
    params_off = load_params("params/ci.yaml", {"data": {**base, "thinking": "off"}})
    params_auto = load_params("params/ci.yaml", {"data": base})
    assert R.regen_key(params_off) != R.regen_key(params_auto)
    assert D.cache_key(params_off)["data_hash"] != D.cache_key(params_auto)["data_hash"]
    with pytest.raises(ParamsError, match="data.thinking: must be one of"):
        load_params("params/ci.yaml", {"data": {"thinking": "yes"}})
    big = {"extract": {"batch_tokens": 8192}, "train": {"batch_tokens": 8192}}
    with pytest.raises(ParamsError, match=r"data.regen_max_new_tokens: thinking mode.*regen_max_new_tokens=2048"
                                          r".*most would be cut.*data.thinking: off"):
        load_params("params/ci.yaml", {"data": {**base, "thinking": "on", "regen_max_new_tokens": 2048,
                                                "max_length": 8192}, **big})
    with pytest.raises(ParamsError, match=r"max_length=2048 keeps at most 2048"):
        load_params("params/ci.yaml", {"data": {**base, "thinking": "on", "regen_max_new_tokens": 8192,
                                                "max_length": 2048}, **big})
    load_params("params/ci.yaml", {"data": {**base, "thinking": "on", "regen_max_new_tokens": 8192,
                                            "max_length": 8192}, **big})      # long enough: accepted


def test_auto_on_a_thinking_template_is_checked_at_the_data_stage(ktok, smollm2_dir):
    """data.thinking: auto on a template that thinks by default (Kimi's) is held to the same rule."""
    d = load_params("params/ci.yaml", {"data": {"regenerate": True, "regen_max_new_tokens": 2048}}).data
    with pytest.raises(ParamsError, match=r"data.regen_max_new_tokens: data.thinking is 'auto'.*most would be cut"):
        D.check_thinking(ktok, d)
    D.check_thinking(load_tokenizer(smollm2_dir), d)                        # SmolLM2 never thinks
    off = load_params("params/ci.yaml", {"data": {"regenerate": True, "regen_max_new_tokens": 2048,
                                                  "thinking": "off"}}).data
    D.check_thinking(ktok, off)                                             # instant mode: no cap rule


# ---- the data stage and the eval prompts --------------------------------------------------------------
def kimi_params(kimi_dir, tmp_path, **data):
    source = tmp_path / "chats.jsonl"
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"},
                                          {"role": "assistant", "content": "x"},
                                          {"role": "user", "content": f"And {i}*{i}?"},
                                          {"role": "assistant", "content": "y"}]} for i in range(7)]
    source.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return load_params("params/ci.yaml", {
        "target": {"path": str(kimi_dir), "dtype": "float32"}, "output_dir": str(tmp_path),
        "data": {"source": str(source), "max_records": None, "num_eval": 2, "num_train": 5, "regenerate": True,
                 "regen_backend": "hf", "regen_max_turns": 2, "max_length": 4096, "regen_max_new_tokens": 4096,
                 "draft_vocab_size": 64, **data},
        "extract": {"batch_tokens": 8192}, "train": {"batch_tokens": 8192}})


@pytest.mark.parametrize("thinking", ["on", "off"])
def test_prepare_data_caches_the_generated_ids(kimi_dir, ktok, tmp_path, monkeypatch, thinking):
    """The whole data stage with a fake HF backend: every cached sequence equals the prompt ids
    the backend got plus the ids it returned, the mask covers exactly the returned ids; thinking
    mode cuts every two-turn chat after its first turn (counted), instant mode keeps both turns."""
    class FakeHF:
        prompts, outputs = [], []

        def __init__(self, model_path, dtype, max_new_tokens, temperature, trust_remote_code=False):
            self.tokenizer = load_tokenizer(model_path)

        def __call__(self, prompts, seeds):
            end = self.tokenizer.eos_token_id
            reasoning = ("Hm", "m, let me see", ".</think>") if thinking == "on" else ()
            out = [(pieces(self.tokenizer, *reasoning, f"Answer {len(p) % 97}.") + [end], False) for p in prompts]
            FakeHF.prompts += prompts
            FakeHF.outputs += [ids for ids, _ in out]
            return out

    monkeypatch.setattr(R, "HFGenerator", FakeHF)
    params = kimi_params(kimi_dir, tmp_path, thinking=thinking)
    run_dir = params.run_dir("r")
    stats = D.prepare_data(params, run_dir, progress=False)
    regen = stats.regen
    assert regen.conversations == 7 and regen.kept == 7
    assert regen.cut_inconsistent == (7 if thinking == "on" else 0)
    assert regen.assistant_turns == (7 if thinking == "on" else 14)
    sent = {tuple(p): o for p, o in zip(FakeHF.prompts, FakeHF.outputs)}    # prompt ids -> generated ids
    suffix = "<think>" if thinking == "on" else "<think></think>"
    rows = 0
    for split in ("train", "eval"):
        table = D.load_processed(run_dir, split)
        for ids, mask in zip(table["input_ids"], table["loss_mask"]):
            ids, mask = list(ids), list(mask)
            turns = sorted((list(p), o) for p, o in sent.items() if list(p) == ids[:len(p)])   # turn 1, 2, ...
            expected_mask = [0] * len(ids)
            for prompt, generated in turns:   # each prompt is followed by exactly its generated ids
                assert ids[len(prompt):len(prompt) + len(generated)] == generated
                assert ktok.decode(prompt).endswith(suffix)
                expected_mask[len(prompt):len(prompt) + len(generated)] = [1] * len(generated)
            prompt, generated = turns[-1]
            assert ids == prompt + generated and mask == expected_mask
            assert len(turns) == (1 if thinking == "on" else 2)
            rows += 1
    assert rows == 7


def test_eval_prompts_follow_data_thinking(kimi_dir, tmp_path, ktok):
    from eagle3lib.evaluate import eval_prompts
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n")
    for thinking, suffix in (("on", "<think>"), ("off", "<think></think>")):
        params = load_params("params/ci.yaml", {"target": {"path": str(kimi_dir)},
                                                "data": {"thinking": thinking, "regenerate": False},
                                                "eval": {"prompts_path": str(prompts_file)}})
        [prompt], skipped = eval_prompts(params, tmp_path, ktok)
        messages = [{"role": "user", "content": "What is 2+2?"}]
        assert prompt["input_ids"] == prompt_ids(ktok, messages, thinking) and skipped == 0
        assert ktok.decode(prompt["input_ids"]).endswith("<|im_middle|>" + suffix)


# ---- vLLM ----------------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_regeneration_stores_the_ids_vllm_generated(smollm2_dir, tmp_path):
    """The vLLM backend on the embedded SmolLM2 (its own template: on the Kimi-like one it ends every
    instant answer at once), up to two turns: every turn's prompt is the rendered history and extends
    the sequence before it, and a second vLLM run (vllm_bench, plain greedy, one request at a time,
    fp32) from the stored first prompts generates exactly the stored ids."""
    from eagle3lib.vllm_bench import BenchSpec, mode, run_vllm
    max_new = 12
    tok = load_tokenizer(smollm2_dir)
    params = load_params("params/ci.yaml", {
        "target": {"path": str(smollm2_dir), "dtype": "float32"}, "output_dir": str(tmp_path),
        "data": {"regenerate": True, "regen_backend": "vllm", "regen_max_new_tokens": max_new, "regen_batch_size": 2,
                 "max_length": 256, "regen_max_turns": 2}})
    short = {"id": "short", "messages": [{"role": "user", "content": "Reply with only the word: yes"},
                                         {"role": "assistant", "content": "yes"},
                                         {"role": "user", "content": "And now only the word: no"},
                                         {"role": "assistant", "content": "no"}]}
    essay = {"id": "essay", "messages": [{"role": "user", "content": "Write a long essay about rivers."},
                                         {"role": "assistant", "content": "Rivers..."}]}
    chats = [short, TWO_TURNS, ONE_TURN, essay]
    kept, stats = R.regenerate_chats(params, tmp_path / "run", chats, progress=False)
    assert stats["backend"] == "vllm" and stats["kept"] == 4
    results = {r["id"]: r for r in R.load_results(RunLayout(tmp_path / "run").regen(R.regen_key(params))).values()}
    for r in results.values():
        answers = [i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"]
        sequence = []
        for turn, (added, generated) in enumerate(zip(r["prompt_ids"], r["output_ids"])):
            prompt = sequence + added
            assert prompt == prompt_ids(tok, r["messages"][:answers[turn]])
            capped = turn == r["turns"] - 1 and r["capped"]
            assert 0 < len(generated) <= max_new and (generated[-1] == tok.eos_token_id) == (not capped)
            sequence = prompt + generated
        assert R.token_sequence(r)[0] == sequence == {c["id"]: c for c in kept}[r["id"]]["input_ids"]
        assert r["turns"] == len(answers)
        assert r["turns"] == 2 or r["capped"] or r["inconsistent"] or r["id"] not in ("short", "two")
    assert results["essay"]["capped"] and any(r["turns"] == 2 for r in results.values())   # one stayed consistent
    first_prompts = [results[c["id"]]["prompt_ids"][0] for c in chats]
    raw = run_vllm(BenchSpec(target=str(smollm2_dir), dtype="float32", prompts=first_prompts,
                             max_new_tokens=max_new, temperature=0.0, modes=[mode("plain")]),
                   workdir=tmp_path / "bench")
    assert raw["modes"][0]["outputs"] == [results[c["id"]]["output_ids"][0] for c in chats]
