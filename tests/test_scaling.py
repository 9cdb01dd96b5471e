"""The data-scaling study's pieces (06_scaling runs them end to end under nbval on ci)."""
import math
import os

import numpy as np
import pytest

from eagle3lib import scaling as sc
from eagle3lib.layout import RunLayout
from eagle3lib.params import ParamsError, load_params
from eagle3lib.runner import select_stages


def test_the_log_fit_recovers_a_known_curve_and_inverts_it():
    chats = [250, 500, 1000, 2000]
    tau = [1.2 + 0.15 * math.log(n) for n in chats]
    fit = sc.fit_log_curve(chats, tau)
    assert fit["a"] == pytest.approx(1.2) and fit["b"] == pytest.approx(0.15) and fit["r2"] == pytest.approx(1.0)
    assert fit["per_doubling"] == pytest.approx(0.15 * math.log(2))
    n = sc.chats_for(fit, 2.5, k=4)
    assert n == pytest.approx(math.exp((2.5 - 1.2) / 0.15)) and sc.predict(fit, [n])[0] == pytest.approx(2.5)
    table = sc.targets_table(fit, [2.3, 2.5, 5.0], k=4)
    assert list(table["status"]) == ["inside the measured range",
                                     f"extrapolated {n / 2000:.1f}x beyond the largest point",
                                     "not reached by the fitted curve"]      # 5.0 = k + 1: unreachable


def test_a_flat_or_falling_curve_never_reaches_a_target():
    falling = sc.fit_log_curve([100, 200, 400], [2.0, 1.9, 1.8])
    flat = sc.fit_log_curve([100, 200, 400], [1.5, 1.5 + 1e-6, 1.5 + 2e-6])
    assert falling["b"] < 0 and sc.chats_for(falling, 2.5, k=4) is None
    assert sc.chats_for(flat, 2.5, k=4) is None                          # would need more than MAX_CHATS
    with pytest.raises(ValueError, match="two distinct sizes"):
        sc.fit_log_curve([100, 100], [1.5, 1.6])


def test_point_params_train_n_chats_for_matched_epochs_without_caps():
    params = load_params("params/local.yaml")
    point = sc.point_params(params, 500)
    assert (point.train.max_sequences, point.train.epochs, point.train.max_steps, point.train.time_budget_minutes) == \
        (500, params.scaling.epochs, None, None)
    assert (point.train.lr, point.train.optimizer, point.data, point.extract) == \
        (params.train.lr, params.train.optimizer, params.data, params.extract)


def test_a_point_folder_links_the_runs_data_and_cache_and_refuses_a_stranger(tmp_path):
    layout = RunLayout(tmp_path / "run")
    (layout.data).mkdir(parents=True)
    (layout.hidden("train")).mkdir(parents=True)
    (layout.data / "vocab.safetensors").write_text("v")
    point = sc.point_layout(layout, 250)
    assert point.root == tmp_path / "run" / "scaling" / "n000250"
    assert os.readlink(point.data) == os.path.join("..", "..", "data")    # relative: the run folder can move
    assert (point.vocab).read_text() == "v" and point.hidden("train").is_dir()
    assert sc.point_layout(layout, 250) == point                         # idempotent
    other = layout.scaling_point(500)
    (other / "data").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="expected a link"):
        sc.point_layout(layout, 500)


def test_a_point_passes_the_training_stage_link_check(tmp_path, monkeypatch):
    """A point's data/ and hidden/ link into its run, outside the point's own folder; training the
    point must accept them (the link guard once refused every point, failing 06 under nbval)."""
    import eagle3lib.train as train_module

    class PastTheLinkCheck(Exception):
        pass

    def stop(*args, **kwargs):
        raise PastTheLinkCheck
    monkeypatch.setattr(train_module, "Dist", stop)        # the first step after the link check
    params = load_params("params/ci.yaml", {"output_dir": str(tmp_path / "outputs")})
    layout = params.layout()
    layout.data.mkdir(parents=True)
    layout.hidden("train").mkdir(parents=True)
    with pytest.raises(PastTheLinkCheck):
        sc.train_point(params, layout, 8)


@pytest.mark.parametrize("text, match", [
    ("scaling: {sizes: [500, 250]}", "scaling.sizes: must be distinct positive chat counts in ascending order"),
    ("scaling: {sizes: [0, 250]}", "scaling.sizes"),
    ("scaling: {sizes: [250, 250]}", "scaling.sizes"),
    ("scaling: {epochs: 0}", "scaling.epochs"),
    ("scaling: {targets: [1.0]}", "scaling.targets"),
    ("train: {max_sequences: 0}", "train.max_sequences"),
])
def test_bad_study_params_are_refused_naming_the_key(tmp_path, text, match):
    path = tmp_path / "p.yaml"
    path.write_text(f"inherit: {os.path.abspath('params/ci.yaml')}\nrun_name: p\n{text}\n")
    with pytest.raises(ParamsError, match=match):
        load_params(path)


def test_the_study_is_an_optional_stage():
    assert "scaling" not in select_stages(None)                           # `make pipeline` does not run it
    assert select_stages("scaling") == ["scaling"]
    assert select_stages("eval,scaling") == ["eval", "scaling"]


def test_run_study_refuses_a_profile_without_sizes_or_with_more_chats_than_the_run_has(tmp_path):
    params = load_params("params/mini-kimi.yaml")
    with pytest.raises(ValueError, match="scaling.sizes is empty"):
        sc.run_study(params, params.layout())
    point = load_params("params/ci.yaml", overrides={"output_dir": str(tmp_path), "data": {"num_train": 10}})
    with pytest.raises(ValueError, match="the largest size 16 exceeds data.num_train=10"):
        sc.run_study(point, point.layout())
    assert not (tmp_path / "ci").exists()                                  # refused before any work


def test_the_plot_draws_points_fit_and_extrapolation():
    import pandas as pd
    table = pd.DataFrame({"chats": [250, 500, 1000], "acceptance_replayed": [1.4, 1.5, 1.6]})
    fit = sc.fit_log_curve(table["chats"], table["acceptance_replayed"])
    fig = sc.plot_curve(table, fit, targets=[2.0], k=4)
    lines = fig.axes[0].get_lines()
    labels = [l.get_label() for l in lines]
    assert "replayed (held-out cache)" in labels and "extrapolation (optimistic)" in labels
    extrap = lines[labels.index("extrapolation (optimistic)")]
    assert np.isclose(extrap.get_xdata()[-1], sc.chats_for(fit, 2.0, k=4))


def test_a_recipe_variant_of_a_point_lives_in_its_own_folder_and_changes_only_the_recipe(tmp_path):
    layout = RunLayout(tmp_path / "run")
    layout.data.mkdir(parents=True)
    assert sc.point_layout(layout, 2000, "lk_hybrid").root.name == "n002000-lk_hybrid"
    params = load_params("params/local.yaml")
    base, lk = sc.point_params(params, 2000), sc.point_params(params, 2000, loss="lk_hybrid")
    assert lk.train.loss == "lk_hybrid" and base.train.loss == "kl"
    assert {k for k, v in vars(lk.train).items() if vars(base.train)[k] != v} == {"loss"}
    with pytest.raises(ValueError, match="a variant needs both"):
        sc.train_point(params, layout, 2000, variant="lk_hybrid")
    with pytest.raises(ValueError, match="a variant needs both"):
        sc.train_point(params, layout, 2000, loss="lk")


def test_the_minutes_curve_charges_each_point_its_share_of_02_and_03_plus_its_training(tmp_path):
    import pandas as pd

    from eagle3lib.evaluate import ngram_name
    from eagle3lib.files import update_metrics
    params = load_params("params/local.yaml")
    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir(parents=True)
    update_metrics(layout.root, "runner", {"stage_seconds": {"data": 480.0, "extract": 360.0, "train": 999.0}})
    table = pd.DataFrame({"chats": [500, 2000], "train_s": [120.0, 600.0]})
    vllm_table = pd.DataFrame({"method": ["eagle3_n500_k2", "eagle3_n2000_k2"], "chats": [500, 2000],
                               "tokens_per_s": [25.0, 33.0], "acceptance_length": [1.5, 1.8]})
    ngram = ngram_name(*sc.ngram_setting(params))
    summary = pd.concat([vllm_table.drop(columns="chats"),
                         pd.DataFrame({"method": ["plain", ngram], "tokens_per_s": [20.0, 30.0],
                                       "acceptance_length": [1.0, 1.8]})])
    curve = sc.minutes_curve(params, layout, table, vllm_table, summary, cached_chats=2000)
    # 500 of 2,000 chats: a quarter of 02 + 03 (840 s) plus its 120 s of training
    assert curve["minutes"].tolist() == pytest.approx([(210 + 120) / 60, (840 + 600) / 60])
    assert curve["vs_ngram"].tolist() == pytest.approx([25 / 30, 33 / 30])
    assert sc.plot_minutes(curve).axes[0].get_ylabel().startswith("EAGLE-3 / n-gram")
    with pytest.raises(ValueError, match="n-gram beside the points"):
        sc.minutes_curve(params, layout, table, vllm_table, summary[summary["method"] != ngram], 2000)
