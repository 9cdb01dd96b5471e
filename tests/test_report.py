"""The run's index page and `eagle3 compare`: content, not just existence."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import yaml
from tiny_notebooks import tiny_notebook

from eagle3lib.params import dump, load_params, repo_root
from eagle3lib.report import compare_runs, markdown_table, plot_training_curves, write_index
from eagle3lib.runner import NotebookFailed, run_pipeline


def fake_run(root: Path, name: str, lr: float, acc: float, with_eval: bool = True) -> Path:
    """A run folder as the stages leave it: params.yaml, metrics.json sections, train/history.json."""
    run = root / name
    (run / "train").mkdir(parents=True)
    params = load_params("params/ci.yaml", overrides={"run_name": name, "train": {"lr": lr}})
    (run / "params.yaml").write_text(dump(params))
    metrics = {"runner": {"stage_seconds": {"data": 12.5, "train": 30.0}, "git_commit": "abc123def456",
                          "machine": {"cpu": "Test CPU", "cores": 2, "cpu_native_bf16": False, "gpus": []},
                          "params_path": "params/ci.yaml"},
               "data": {"train_conversations": 24, "train_tokens": 1767},
               "train": {"steps": 12, "final_loss": 8.0088, "eval_acceptance_estimate": 1 + acc}}
    if with_eval:
        metrics["eval"] = {"acceptance_length_vllm": 1.15, "speedup_vllm_eagle3": 2.0916,
                           "per_position_acceptance_vllm": [0.15, 0.0, 0.0],
                           "vllm": {"plain": {"tokens_per_s": 10.0}, "eagle3_k3": {"tokens_per_s": 20.9}},
                           "verdict": "vLLM: eagle3_k3 is 2.09x faster than plain decoding"}
    (run / "metrics.json").write_text(json.dumps(metrics))
    history = [{"step": s, "loss": 9 - 0.1 * s, "step_acc": [acc, acc / 2]} for s in range(1, 13)]
    history[4]["eval"] = {"acceptance_estimate": 1 + acc / 2}
    history[11]["eval"] = {"acceptance_estimate": 1 + acc}
    (run / "train" / "history.json").write_text(json.dumps(history))
    for stem in ("02_data", "04_train") + (("05_eval",) if with_eval else ()):     # the executed notebooks
        executed(run, stem)
    return run


def executed(run: Path, stem: str) -> None:
    """The executed copy of a stage's notebook and its html, as the runner leaves them."""
    (run / f"{stem}.ipynb").write_text("{}")
    (run / f"{stem}.html").write_text(f"<html><body>{stem}</body></html>")


def test_index_page_shows_params_stage_times_headlines_plots_and_links(tmp_path):
    run = fake_run(tmp_path, "a", lr=1e-3, acc=0.2)
    page = write_index(run).read_text()
    md = (run / "index.md").read_text()
    assert "abc123def456" in page and "Test CPU" in page                      # commit and machine
    assert "| train | held-out acceptance length, estimated | 1.200 |" in md     # a headline number
    assert "| data | [02_data](02_data.html) ([ipynb](02_data.ipynb)) | 12.5 |" in md     # wall time, links
    assert '<a href="05_eval.html">05_eval</a>' in page
    assert "| ngram | 01_ngram_baseline (not run) | - |" in md                  # no executed copy: no link
    assert "eagle3_k3 is 2.09x faster" in page                                # the verdict
    assert page.count("<img src=\"data:image/png;base64,") == 3              # curve, per position, speed
    assert "lr: 0.001" in page and "<details><summary>Params in use" in page  # params, collapsed
    # the headline comes first: the drafter in vLLM at the profile's k, the wall time, the verdict
    assert md.splitlines()[2] == ("**EAGLE-3 in vLLM at k = 3: acceptance length 1.150, 2.09x plain decoding.** "
                                  "Stages' wall time so far: 0.7 min. Verdict: vLLM: eagle3_k3 is 2.09x faster "
                                  "than plain decoding")
    assert "<p><b>EAGLE-3 in vLLM at k = 3" in page
    partial = fake_run(tmp_path, "b", lr=1e-3, acc=0.2, with_eval=False)
    write_index(partial)
    md = (partial / "index.md").read_text()
    assert "| eval | EAGLE-3 acceptance length (vLLM) | - |" in md              # not run yet: "-"
    assert "**EAGLE-3 not measured in vLLM yet**" in md
    assert "06_scaling" not in md                                              # the optional study: not run
    assert "tensorboard" not in md                                             # no event files: no link
    (partial / "train" / "tensorboard").mkdir(parents=True)
    write_index(partial)
    assert "[event files](train/tensorboard/)" in (partial / "index.md").read_text()
    assert "acceptance explorer" not in (partial / "index.md").read_text()
    (partial / "eval" / "explorer").mkdir(parents=True)
    (partial / "eval" / "explorer" / "explorer.html").write_text("<html></html>")
    write_index(partial)
    assert "(eval/explorer/explorer.html)" in (partial / "index.md").read_text()


def test_the_index_lists_the_scaling_study_and_its_verdict_once_it_ran(tmp_path):
    run = fake_run(tmp_path, "s", lr=1e-3, acc=0.2)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["runner"]["stage_seconds"]["scaling"] = 3000.0
    metrics["scaling"] = {"verdict": "Verdict (vLLM): from 250 to 2000 chats, each doubling added +0.100"}
    (run / "metrics.json").write_text(json.dumps(metrics))
    executed(run, "06_scaling")
    write_index(run)
    md = (run / "index.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| scaling | [06_scaling](06_scaling.html)"))
    assert row.endswith(" |") and "3" in row.split("|")[-2]                 # its wall time
    assert "## Verdict (scaling)" in md and "each doubling added +0.100" in md


def test_compare_lists_headlines_and_only_the_params_that_differ(tmp_path):
    a, b = fake_run(tmp_path, "a", lr=1e-3, acc=0.2), fake_run(tmp_path, "b", lr=3e-3, acc=0.3)
    metrics, params = compare_runs([a, b])
    assert list(metrics.columns) == ["a", "b"]
    row = metrics.loc["train: held-out acceptance length, estimated"]
    assert (row["a"], row["b"]) == ("1.200", "1.300")
    assert list(params.index) == ["train.lr"]                                 # run_name left out, rest equal
    assert (params.loc["train.lr", "a"], params.loc["train.lr", "b"]) == ("0.001", "0.003")
    table = markdown_table(metrics, "quantity")
    assert table.splitlines()[0] == "| quantity | a | b |"
    fig = plot_training_curves([a, b])
    loss_ax, acc_ax = fig.axes
    assert len(loss_ax.lines) == 4 and len(acc_ax.lines) == 2                # smoothed + raw per run; held-out
    assert list(acc_ax.lines[1].get_ydata()) == [1.15, 1.3]


def test_runner_writes_the_index_after_every_stage_even_a_failed_one(tmp_path):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    nbformat.write(tiny_notebook(["from eagle3lib.params import load_params\n"
                             "from eagle3lib.files import update_metrics\n"
                             "update_metrics(load_params(params_path).run_dir(run_name), 'data', "
                             "{'train_conversations': 4321})"]), str(nbdir / "02_data.ipynb"))
    nbformat.write(tiny_notebook(["raise ValueError('boom')"]), str(nbdir / "03_extract.ipynb"))
    prof = tmp_path / "p.yaml"
    prof.write_text(f"inherit: {repo_root() / 'params/ci.yaml'}\noutput_dir: {tmp_path / 'out'}\n"
                    "run_name: t\ntrain: {lr: 0.0042}\n")
    lines = []
    try:
        run_pipeline(str(prof), only="data,extract", notebooks_dir=nbdir, html=False, log=lines.append)
        raise AssertionError("the failing notebook did not stop the run")
    except NotebookFailed:
        pass
    run = tmp_path / "out" / "t"
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics["runner"]["stage_seconds"]) == {"data", "extract"}     # the failed stage too
    assert metrics["runner"]["machine"]["cores"] >= 1
    assert yaml.safe_load((run / "params.yaml").read_text())["train"]["lr"] == 0.0042
    md = (run / "index.md").read_text()
    assert "| data | train chats | 4,321 |" in md
    assert "lr: 0.0042" in (run / "index.html").read_text()
    assert any(line.startswith("[eagle3] data: 02_data.ipynb") and "expected ~" in line for line in lines)


def test_numbers_keep_about_three_significant_digits():
    from eagle3lib.report import fmt
    assert [fmt(1.25), fmt(38.9), fmt(20.1), fmt(622.4), fmt(3043.9), fmt(1e-8), fmt(16542)] == \
        ["1.250", "38.9", "20.1", "622", "3,044", "1e-08", "16,542"]
    assert (fmt(None), fmt(True), fmt(float("nan"))) == ("-", "yes", "-")
