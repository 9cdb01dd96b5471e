"""train.tracking: the scalars a short training run writes for TensorBoard equal its history."""
from __future__ import annotations

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import make_run, sharp_target_dir  # noqa: F401  (a fixture)

from eagle3lib.objective import acceptance_estimate
from eagle3lib.params import ParamsError, load_params
from eagle3lib.tracking import open_tracker, scalars
from eagle3lib.train import train


def read_scalars(folder) -> dict:
    """{tag: [(step, value)]} of every event file under `folder`."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_every_steps_scalars_from_the_history(tmp_path, sharp_target_dir):
    torch.manual_seed(0)
    params_path = make_run(tmp_path, sharp_target_dir, {"max_steps": 4, "resume": False, "tracking": "tensorboard"})
    params = load_params(params_path)
    train(params, params.run_dir(), progress=False)
    history = json.loads((params.layout().history).read_text())
    logged = read_scalars(params.layout().tensorboard)
    steps = [r["step"] for r in history]
    assert [s for s, _ in logged["train/loss"]] == steps == [1, 2, 3, 4]
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("train/tokens_per_s", "tokens_per_s")):
        assert [v for _, v in logged[tag]] == pytest.approx([r[key] for r in history], rel=1e-6), tag
    for j in range(params.train.ttt_steps):
        assert [v for _, v in logged[f"train/acc_step{j}"]] == pytest.approx([r["step_acc"][j] for r in history])
    assert [v for _, v in logged["train/acceptance_estimate"]] == \
        pytest.approx([acceptance_estimate(r["step_acc"]) for r in history])
    evals = [r for r in history if "eval" in r]                 # checkpoint_every 2: steps 2 and 4
    assert [s for s, _ in logged["eval/acceptance_replayed"]] == [r["step"] for r in evals] == [2, 4]
    assert [v for _, v in logged["eval/acceptance_estimate"]] == \
        pytest.approx([r["eval"]["acceptance_estimate"] for r in evals])


def test_no_tracker_on_other_ranks_or_when_off_and_a_clear_error_for_an_unknown_kind(tmp_path):
    params = load_params("params/ci.yaml", {"output_dir": str(tmp_path)})
    assert open_tracker("none", params.layout(), 0) is None and open_tracker("tensorboard", params.layout(), 1) is None
    with pytest.raises(ValueError, match="train.tracking 'mlflow'"):
        open_tracker("mlflow", params.layout(), 0)
    with pytest.raises(ParamsError, match="train.tracking"):
        load_params("params/ci.yaml", {"train": {"tracking": "mlflow"}})
    record = {"step": 1, "lr": 1e-3, "loss": 2.0, "step_acc": [0.5, 0.5], "grad_norm": 1.0}
    assert scalars(record)["train/acceptance_estimate"] == pytest.approx(1.75)
    assert not any(tag.startswith("eval/") for tag in scalars(record))
