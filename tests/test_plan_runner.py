"""Capacity plan arithmetic and the papermill runner (stage selection, failure reporting)."""
import json
import subprocess
import sys

import nbformat
import pytest

from eagle3lib.params import ParamsError, load_params
from eagle3lib.plan import capacity_plan, format_plan
from eagle3lib.runner import NotebookFailed, run_pipeline, select_stages


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
    assert "8 GPUs" in plan["throughput_basis"]
    text = format_plan(plan)
    assert "TB" in text and " h" in text


def test_measured_stats_override_the_estimate():
    p = load_params("params/ci.yaml")
    plan = capacity_plan(p, {"train_tokens": 2400, "train_conversations": 24})
    assert plan["tokens_per_conversation"] == 100
    assert plan["tokens_to_extract"] == 24 * 100


def test_plan_counts_only_regenerated_chats_as_regeneration():
    full = load_params("params/local.yaml", {"data": {"regen_num_train": None}})
    mixed = load_params("params/local.yaml", {"data": {"num_train": 3000, "regen_num_train": 1000}})
    n = full.data.regen_max_new_tokens * full.data.regen_max_turns
    assert capacity_plan(full)["regen_tokens"] == full.data.num_train * n
    plan = capacity_plan(mixed)
    assert plan["regen_tokens"] == 1000 * n
    per_regen = capacity_plan(full)["tokens_per_conversation"]
    per_original = capacity_plan(load_params("params/local.yaml", {"data": {"regenerate": False}}))["tokens_per_conversation"]
    assert per_regen != per_original
    assert plan["tokens_per_conversation"] == pytest.approx((1000 * per_regen + 2000 * per_original) / 3000)


def test_cli_plan_prints_bytes_and_hours():
    r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "plan", "--params", "params/b300.yaml"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "hidden-state cache" in r.stdout and "TB" in r.stdout and "Kimi" in r.stdout


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


def _notebook(cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('params_path = "params/ci.yaml"\nrun_name = None')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


def test_runner_executes_writes_html_and_names_the_failing_cell(tmp_path):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    prof = tmp_path / "p.yaml"
    prof.write_text(f"inherit: {load_params.__globals__['repo_root']() / 'params/ci.yaml'}\n"
                    f"output_dir: {tmp_path / 'out'}\nrun_name: t\n")
    ok = _notebook(["import json, pathlib\n"
                    "from eagle3lib.params import load_params\n"
                    "P = load_params(params_path)\n"
                    "pathlib.Path(P.run_dir(run_name), 'seen.json').write_text(json.dumps([params_path, run_name]))"])
    bad = _notebook(["x = 1", "raise ValueError('boom in data')"])
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
