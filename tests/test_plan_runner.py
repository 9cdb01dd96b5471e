"""Capacity plan arithmetic and the papermill runner (stage selection, failure reporting)."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from tiny_notebooks import tiny_notebook

from eagle3lib.data import prepare_data
from eagle3lib.layout import RunLayout
from eagle3lib.params import ParamsError, load_params
from eagle3lib.plan import REGEN_ANSWER_FILL, capacity_plan, format_plan, measured_stats
from eagle3lib.runner import NotebookFailed, run_pipeline, select_stages
from eagle3lib.stats import DataStats, SplitStats


def test_cache_bytes_per_token_is_four_hidden_states_in_bf16():
    p = load_params("params/local.yaml")
    plan = capacity_plan(p)
    h = 576
    assert plan["cache_bytes_per_token"] == 2 * 4 * h + 4 + 1
    assert plan["cache_bytes"] == pytest.approx(plan["tokens_to_extract"] * plan["cache_bytes_per_token"], rel=1e-6)
    assert "measured" in plan["throughput_basis"]


def test_b300_plan_uses_kimi_shape_and_gpus():
    plan = capacity_plan(load_params("params/b300.yaml"))
    assert (plan["layers"], plan["hidden_size"], plan["vocab_size"]) == (61, 7168, 163840)
    assert plan["cache_bytes_per_token"] == 2 * 4 * 7168 + 5
    assert plan["extract_hours"] > 0 and plan["train_hours"] > 0
    assert "8 x B300 GPUs" in plan["throughput_basis"]
    text = format_plan(plan)
    assert "TB" in text and " h" in text


def measured(p, tokens: int, conversations: int) -> DataStats:
    """Stats as the data stage of profile `p` would write them, with only the train counts set."""
    split = SplitStats(conversations=conversations, tokens=tokens, assistant_tokens=0, truncated=0,
                       dropped_no_assistant_tokens=0, template_error=0)
    return DataStats(cache_key={"data_hash": p.section_hash("data")}, source=p.data.source,
                     records_read=0, valid=0, malformed={}, malformed_total=0, repairs={},
                     duplicates=0, renamed_ids=0, eval_prompts=0, train_skipped_prompt_too_long=0,
                     train=split, eval=split, regen=None, vocab_size=0, draft_vocab_size=0,
                     distinct_assistant_tokens=0, coverage_train=0.0, coverage_eval=0.0,
                     coverage_curve={}, seconds=0.0)


def test_measured_stats_override_the_estimate():
    p = load_params("params/ci.yaml")
    plan = capacity_plan(p, measured(p, 2400, 24))
    assert plan["tokens_per_conversation"] == 100
    assert plan["tokens_to_extract"] == (24 + p.data.num_eval) * 100      # the train and held-out caches


def test_plan_reads_the_stats_json_of_a_real_data_stage(tiny_target_dir, tmp_path):
    """The ci profile's data stage (tiny target, temp output dir) writes stats.json; the planner
    reads it through the one stats reader and uses the measured tokens per conversation."""
    ci = {"target": {"path": str(tiny_target_dir), "dtype": "float32"}, "output_dir": str(tmp_path),
          "data": {"regen_temperature": 1.0}}  # the random tiny target's greedy answers are blank
    p = load_params("params/ci.yaml", ci)
    prepare_data(p, p.run_dir(), progress=False)
    raw = json.loads(p.layout().stats.read_text())
    tokens_per_conv = raw["train"]["tokens"] / raw["train"]["conversations"]
    estimated = capacity_plan(p)
    assert estimated["tokens_per_conversation"] != round(tokens_per_conv, 1)   # the test can tell
    plan = capacity_plan(p, measured_stats(p.run_dir()))
    assert plan["tokens_per_conversation"] == round(tokens_per_conv, 1)
    assert plan["tokens_to_extract"] == int((plan["train_conversations"] + p.data.num_eval) * tokens_per_conv)
    assert plan["tokens_basis"].startswith("measured") and estimated["tokens_basis"] == "estimated"
    # Stats measured with other data params are not this profile's: the estimate is kept.
    other = load_params("params/ci.yaml", {**ci, "data": {"regen_temperature": 1.0, "max_length": 256}})
    assert capacity_plan(other, measured_stats(p.run_dir())) == capacity_plan(other)
    assert measured_stats(tmp_path / "no-such-run") is None


def test_plan_counts_only_regenerated_chats_as_regeneration():
    full = load_params("params/local.yaml", {"data": {"regen_num_train": None}})
    mixed = load_params("params/local.yaml", {"data": {"num_train": 3000, "regen_num_train": 1000}})
    n = REGEN_ANSWER_FILL * full.data.regen_max_new_tokens * full.data.regen_max_turns   # held-out chats too
    assert capacity_plan(full)["regen_tokens"] == int((full.data.num_train + full.data.num_eval) * n)
    plan = capacity_plan(mixed)
    assert plan["regen_tokens"] == int((1000 + mixed.data.num_eval) * n)
    per_regen = capacity_plan(full)["tokens_per_conversation"]
    original = load_params("params/local.yaml", {"data": {"regenerate": False}})
    per_original = capacity_plan(original)["tokens_per_conversation"]
    assert per_regen != per_original
    assert plan["tokens_per_conversation"] == pytest.approx((1000 * per_regen + 2000 * per_original) / 3000, abs=0.1)


def test_cli_plan_prints_bytes_and_hours():
    r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "plan", "--params", "params/b300.yaml"],
                       capture_output=True, text=True)
    # exit 4 exactly when a row is REFUSED (here: this small host's memory for b300's held-out set)
    assert r.returncode == (4 if "REFUSED" in r.stdout else 0), r.stdout[-2000:] + r.stderr
    assert "hidden-state cache" in r.stdout and "TB" in r.stdout and "Kimi" in r.stdout


def test_cli_plan_exits_nonzero_when_the_run_would_be_refused(tmp_path):
    """A REFUSED row (here: warmup far beyond 10 % of the planned steps) makes `eagle3 plan` exit 4,
    so a script can gate `eagle3 run` on it."""
    prof = tmp_path / "p.yaml"
    prof.write_text(f"inherit: {Path('params/b300.yaml').resolve()}\n"
                    "train: {warmup_fraction: null, warmup_steps: 100000}\n")
    r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "plan", "--params", str(prof)],
                       capture_output=True, text=True)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr
    assert "REFUSED" in r.stdout and "train.warmup_steps" in r.stdout


def test_select_stages_keeps_pipeline_order_and_rejects_unknown():
    assert select_stages("extract,data") == ["data", "extract"]
    assert select_stages(None)[0] == "research" and select_stages(None)[-1] == "eval"
    with pytest.raises(ParamsError, match="unknown stage"):
        select_stages("data,trian")


def test_bad_profile_stops_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"output_dir: {tmp_path / 'out'}\ndata: {{regenerate: maybe}}\n")
    with pytest.raises(ParamsError, match="data.regenerate"):
        run_pipeline(str(bad))
    assert not (tmp_path / "out").exists()


def test_runner_executes_writes_html_and_names_the_failing_cell(tmp_path):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    prof = tmp_path / "p.yaml"
    prof.write_text(f"inherit: {load_params.__globals__['repo_root']() / 'params/ci.yaml'}\n"
                    f"output_dir: {tmp_path / 'out'}\nrun_name: t\n")
    ok = tiny_notebook(["import json, pathlib\n"
                    "from eagle3lib.params import load_params\n"
                    "params = load_params(params_path)\n"
                    "pathlib.Path(params.run_dir(run_name), 'seen.json')"
                    ".write_text(json.dumps([params_path, run_name]))"])
    bad = tiny_notebook(["x = 1", "raise ValueError('boom in data')"])
    nbformat.write(ok, str(nbdir / "00_research.ipynb"))
    nbformat.write(bad, str(nbdir / "01_ngram_baseline.ipynb"))

    results = run_pipeline(str(prof), only="research", notebooks_dir=nbdir, log=lambda *a: None)
    assert results[0].notebook.is_file() and results[0].html.is_file()
    seen = json.loads((tmp_path / "out" / "t" / "seen.json").read_text())
    assert seen == [str(prof.resolve()), "t"]            # papermill passed the parameters

    with pytest.raises(NotebookFailed) as err:
        run_pipeline(str(prof), only="research,ngram", notebooks_dir=nbdir, log=lambda *a: None)
    msg = str(err.value)
    assert "01_ngram_baseline.ipynb" in msg and "boom in data" in msg and "cell" in msg
    assert (tmp_path / "out" / "t" / "01_ngram_baseline.html").is_file()


def test_b300_plan_counts_the_embedded_sharegpt_and_marks_the_missing_corpora():
    p = load_params("params/b300.yaml")
    plan = capacity_plan(p, memory=False)
    share, *public = plan["sources"]
    assert share["source"] == "sharegpt" and share["basis"] == "measured" and 16_000 < share["chats"] < 17_000
    for own in public:           # not on this machine: each assumed to give its cap
        assert own["basis"] == "assumed" and "no such file or folder on this machine" in own["problem"]
        assert own["chats"] == own["cap"]
    assert plan["chats_basis"] == "measured + assumed"
    # the caps give at least the chats the profile plans (train + held out); num_train binds
    assert plan["available_chats"] >= p.data.num_train + p.data.num_eval
    assert plan["train_conversations"] == p.data.num_train
    text = format_plan(plan)
    assert "NOT ON THIS MACHINE" in text and f"{share['chats']:,} chats [measured" in text
    assert "[backend vllm; assumed" in text


def test_source_counts_equal_load_chats_and_are_cached(tmp_path, monkeypatch):
    from eagle3lib import plan as plan_mod
    from eagle3lib.chats import load_chats
    a = tmp_path / "a.jsonl"
    a.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i % 4}"},
                                                    {"role": "assistant", "content": f"a{i % 4}"}]})
                           for i in range(6)) + "\n{bad\n")
    b = tmp_path / "b.jsonl"
    b.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                    {"role": "assistant", "content": f"a{i}"}]})
                           for i in range(2, 9)) + "\n")
    source = [str(a), {"path": str(b), "max_records": 5}]
    p = load_params("params/ci.yaml", {"output_dir": str(tmp_path / "out"), "data": {"source": source, "num_eval": 2}})
    rows = plan_mod.count_sources(p)
    chats, stats = load_chats(source)
    assert [r["chats"] for r in rows] == [s["valid"] for s in stats["sources"]] == [4, 3]
    assert rows[0]["malformed"] == {"invalid_json": 1} and rows[0]["duplicates"] == 2 and rows[1]["duplicates"] == 2
    assert plan_mod.train_conversations(p, rows) == len(chats) - 2
    def no_reading(*args):
        raise AssertionError("read again")
    monkeypatch.setattr(plan_mod, "_count_one", no_reading)
    assert plan_mod.count_sources(p) == rows                 # from outputs/source-counts
    b.write_text(b.read_text() + json.dumps({"messages": [{"role": "user", "content": "new"},
                                                          {"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(AssertionError, match="read again"):  # new content: counted again
        plan_mod.count_sources(p)


def test_plan_uses_the_runs_measured_rates_of_the_same_backend(tmp_path):
    from eagle3lib.params import dump
    p = load_params("params/ci.yaml", {"output_dir": str(tmp_path)})
    layout = p.layout()
    layout.root.mkdir(parents=True)
    layout.params.write_text(dump(p))
    layout.metrics.write_text(json.dumps({"extract": {"tokens_per_s": 1234.5},
                                          "train": {"train_tokens_per_s": 77.0}}))
    plan = capacity_plan(p, memory=False)
    assert plan["extract_tokens_per_s"] == 1234.5 and plan["extract_rate_basis"].startswith("measured")
    assert plan["train_tokens_per_s"] == 77.0 and plan["train_rate_basis"].startswith("measured")
    assert plan["regen_rate_basis"] == "measured (batched HF generate on the CPU, ci 2026-12-05)"   # not the run's
    other = load_params("params/ci.yaml", {"output_dir": str(tmp_path), "extract": {"backend": "vllm"}})
    plan = capacity_plan(other, memory=False)                 # the run measured the hf backend
    assert "metrics.json" not in plan["extract_rate_basis"] and plan["extract_tokens_per_s"] != 1234.5


def test_expected_stage_times_are_the_plans_stage_times(tmp_path):
    """The runner's "expected ~N s" of each stage is the plan's per-stage time (engine starts, kernel
    and the work included); a run folder's own last times win."""
    from eagle3lib.layout import RunLayout
    from eagle3lib.runner import expected_seconds
    kimi = load_params("params/mini-kimi.yaml")
    layout = RunLayout(tmp_path / "run")
    plan = capacity_plan(kimi, None, memory=False, layout=layout)
    got = expected_seconds(kimi, layout)
    for stage in ("research", "ngram", "data", "extract", "train", "eval"):
        assert got[stage][0] == pytest.approx(plan["stages"][stage]["seconds"])
    engine = [q for q in plan["stages"]["data"]["parts"] if "vLLM engine start" in q["name"]]
    assert engine and plan["stages"]["data"]["seconds"] > plan["regen_hours"] * 3600 + engine[0]["seconds"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"runner": {"stage_seconds": {"extract": 123.0}}}))
    assert expected_seconds(kimi, layout)["extract"] == (123.0, "this run folder's last run")


def test_cpu_rates_follow_the_host_kind(monkeypatch, tmp_path):
    """An AVX2-only host (bf16 emulated, `auto` = fp32) runs several times slower than a native-bf16
    host: the planner's CPU rates are those the recorded runs of this host kind measured
    (bench/recorded_stage_times.json). An empty run folder: no measured rates of an earlier run of
    the profile (outputs/local) apply."""
    from eagle3lib import stage_times
    params = load_params("params/local.yaml")
    empty = RunLayout(tmp_path / "local")
    monkeypatch.setattr(stage_times, "cpu_has_native_bf16", lambda: True)
    native = capacity_plan(params, None, memory=False, layout=empty)
    monkeypatch.setattr(stage_times, "cpu_has_native_bf16", lambda: False)
    avx2 = capacity_plan(params, None, memory=False, layout=empty)
    recorded = {r["host_kind"]: r["rates"] for r in stage_times.recorded_runs()
                if "extract_tokens_per_s" in r.get("rates", {})}              # the full records (local, local-long)
    assert native["extract_tokens_per_s"] == recorded["native_bf16"]["extract_tokens_per_s"][0]
    assert avx2["extract_tokens_per_s"] == recorded["avx2"]["extract_tokens_per_s"][0]
    assert native["extract_rate_basis"].startswith("measured (local, ")
    assert avx2["regen_hours"] > 2.5 * native["regen_hours"] and avx2["extract_hours"] > 2 * native["extract_hours"]
    assert "avx2" in avx2["throughput_basis"] and "native bf16" in native["throughput_basis"]
    share = params.train.time_budget_minutes / 60 / avx2["train_hours"]
    assert f"stops it after ~{share:.0%} of the planned tokens" in format_plan(avx2)      # the user sees the cut
    unlimited = capacity_plan(load_params("params/local.yaml", {"train": {"time_budget_minutes": None}}), None,
                              memory=False, layout=empty)
    assert "stops it" not in format_plan(unlimited)


def test_research_section_is_written_by_the_library(tmp_path):
    from eagle3lib.plan import record_research
    plans = {"this run": capacity_plan(load_params("params/ci.yaml"), memory=False),
             "local": capacity_plan(load_params("params/local.yaml"), memory=False),
             "b300": capacity_plan(load_params("params/b300.yaml"), memory=False)}
    section = record_research(tmp_path, plans, {"torch": "2.13.0", "transformers": "5.19"})
    written = json.loads((tmp_path / "metrics.json").read_text())["research"]
    assert written == json.loads(json.dumps(section))
    assert written["b300_cache_bytes"] == plans["b300"]["cache_bytes"] > written["cache_bytes_planned"] > 0
    assert written["torch"] == "2.13.0"
    assert set(written["b300_chats"]) == {r["source"] for r in plans["b300"]["sources"]}
