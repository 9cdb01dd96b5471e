"""The schedule follows the run's size: warmup and checkpoint cadence as shares of the planned steps
(or minutes), warmup over 10 % refused, every 06_scaling point leaves its warmup."""
import json
import os

import pytest
import torch
from test_train import make_run, sharp_target_dir  # noqa: F401  (a fixture)

from eagle3lib import scaling as sc
from eagle3lib.layout import RunLayout
from eagle3lib.params import (
    MAX_WARMUP_FRACTION,
    ParamsError,
    checkpoint_interval,
    load_params,
    max_warmup_steps,
    planned_warmup,
)
from eagle3lib.plan import capacity_plan, planned_steps, tokens_per_conversation, train_conversations
from eagle3lib.train import lr_factor, schedule, train

PROFILES = ["ci", "local", "local-long", "mini-kimi", "b300"]


def profile(tmp_path, text: str):
    path = tmp_path / "p.yaml"
    path.write_text(f"inherit: {os.path.abspath('params/ci.yaml')}\nrun_name: p\n{text}\n")
    return load_params(path)


def test_warmup_over_a_tenth_of_max_steps_is_refused_naming_the_key_and_the_fix(tmp_path):
    with pytest.raises(ParamsError, match=r"train.warmup_steps: 20 warmup steps are 20% of the 100 planned.*"
                                          r"train.warmup_fraction"):
        profile(tmp_path, "train: {max_steps: 100, warmup_steps: 20}")
    assert profile(tmp_path, "train: {max_steps: 100, warmup_steps: 10}").train.warmup_steps == 10
    # tiny plumbing runs keep MIN_WARMUP_ALLOWED steps: ci's 2 of 12
    assert profile(tmp_path, "train: {max_steps: 12, warmup_steps: 2}").train.max_steps == 12
    with pytest.raises(ParamsError, match="train.warmup_steps"):
        profile(tmp_path, "train: {max_steps: 12, warmup_steps: 3}")
    # a fraction follows max_steps and is checked by its own bound
    both = profile(tmp_path, "train: {max_steps: 100, warmup_steps: 500, warmup_fraction: 0.05}")
    assert both.train.warmup_fraction == 0.05
    with pytest.raises(ParamsError, match=r"train.warmup_fraction: must be in \[0, 0.1\]"):
        profile(tmp_path, "train: {warmup_fraction: 0.2}")


@pytest.mark.parametrize("text, key", [
    ("train: {checkpoint_fraction: 0}", "train.checkpoint_fraction"),
    ("train: {checkpoint_fraction: 1.5}", "train.checkpoint_fraction"),
    ("train: {checkpoint_minutes: 0}", "train.checkpoint_minutes"),
    ("train: {checkpoint_minutes: -5}", "train.checkpoint_minutes"),
])
def test_bad_cadence_is_refused_naming_the_key(tmp_path, text, key):
    with pytest.raises(ParamsError, match=key):
        profile(tmp_path, text)


def test_warmup_and_checkpoints_as_shares_of_the_planned_steps(tmp_path):
    train_params = profile(tmp_path, "train: {warmup_fraction: 0.03, checkpoint_fraction: 0.1}").train
    assert (planned_warmup(train_params, 828), checkpoint_interval(train_params, 828)) == (25, 83)
    # at least one step between checkpoints
    assert (planned_warmup(train_params, 10), checkpoint_interval(train_params, 3)) == (0, 1)
    fixed = profile(tmp_path, "train: {warmup_steps: 2, checkpoint_every: 5}").train
    assert (planned_warmup(fixed, 828), checkpoint_interval(fixed, 828)) == (2, 5)
    assert max_warmup_steps(828) == 83 and max_warmup_steps(12) == 2
    # the lr schedule: linear warmup, the peak right after it, then cosine
    assert lr_factor(25, 25, 828, 0.1) == pytest.approx(1.0) and lr_factor(10, 25, 828, 0.1) < 0.5


class Lengths:
    """What train.schedule reads of a cache: the sequence lengths."""
    def __init__(self, lengths):
        self.lengths = lengths


def test_schedule_refuses_a_warmup_the_cache_makes_too_long_before_the_first_step(tmp_path):
    cache = Lengths([32] * 64)                    # 64 sequences of 32 tokens: 16 micro-batches of 128 tokens
    train_params = profile(tmp_path, "train: {batch_tokens: 128, max_steps: null, epochs: 2, warmup_steps: 8}").train
    with pytest.raises(ValueError, match=r"train.warmup_steps: 8 warmup steps are 25% of the 32 planned"):
        schedule(cache, train_params, seed=0, world=1)
    ok = profile(tmp_path, "train: {batch_tokens: 128, max_steps: null, epochs: 2, warmup_fraction: 0.1}").train
    assert schedule(cache, ok, seed=0, world=1)[3] == 32


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_leaves_warmup_early_and_checkpoints_inside_the_run(name):
    p = load_params(f"params/{name}.yaml")
    plan = capacity_plan(p, memory=False)
    steps = plan["planned_steps"]
    assert plan["warmup_steps"] <= max_warmup_steps(steps)
    assert steps == 1 or plan["checkpoint_interval"] < steps or p.train.checkpoint_minutes is not None
    assert not [x for x in plan["problems"] if x[1] in ("train.warmup_steps", "train.checkpoint_every")]


def test_b300_schedule_follows_the_plan():
    p = load_params("params/b300.yaml")
    plan = capacity_plan(p, memory=False)
    assert 600 < plan["planned_steps"] < 1100                     # ~838 by the arithmetic
    assert plan["warmup_steps"] == round(p.train.warmup_fraction * plan["planned_steps"])
    assert 0.05 <= plan["checkpoint_interval"] / plan["planned_steps"] <= 0.15            # about ten per run
    old = load_params("params/b300.yaml", {"train": {"warmup_fraction": None, "warmup_steps": 500}})
    refused = [x for x in capacity_plan(old, memory=False)["problems"] if x[1] == "train.warmup_steps"]
    assert refused and refused[0][0] == "refuse" and "train.warmup_fraction" in refused[0][2]


@pytest.mark.parametrize("name", [n for n in PROFILES if load_params(f"params/{n}.yaml").scaling.sizes])
def test_every_scaling_point_leaves_warmup(name):
    """Each 06_scaling point trains scaling.epochs on its chats: its warmup (the main run's share)
    ends within the first 10 % of its own planned steps."""
    p = load_params(f"params/{name}.yaml")
    n_conv = train_conversations(p)
    per_chat = tokens_per_conversation(p, None, n_conv)
    main = planned_steps(p, n_conv * per_chat, n_conv)
    for n in p.scaling.sizes:
        q = sc.point_params(p, n, main_steps=main)
        steps = planned_steps(q, n * per_chat, n)
        warmup = planned_warmup(q.train, steps)
        assert warmup <= max(1, MAX_WARMUP_FRACTION * steps), (name, n, warmup, steps)
        assert warmup < steps


def test_a_point_keeps_the_main_runs_warmup_share():
    local = load_params("params/local.yaml")             # warmup_steps of max_steps (20 of 1,700)
    assert local.train.warmup_steps and local.train.max_steps
    assert sc.point_warmup_fraction(local.train) == pytest.approx(local.train.warmup_steps / local.train.max_steps)
    b300 = load_params("params/b300.yaml")
    assert sc.point_params(b300, 6250).train.warmup_fraction == b300.train.warmup_fraction
    long = load_params("params/local-long.yaml")         # epochs, no max_steps: the main run's steps are needed
    with pytest.raises(ValueError, match="main run's planned steps"):
        sc.point_params(long, 250)
    assert sc.point_params(long, 250, main_steps=2500).train.warmup_fraction == pytest.approx(50 / 2500)


def eval_steps(params_path) -> list:
    """Steps at which the run checkpointed and ran the held-out eval (history.json)."""
    params = load_params(params_path)
    history = json.loads(RunLayout(params.run_dir()).history.read_text())
    return [r["step"] for r in history if "eval" in r]


def test_checkpoint_fraction_and_minutes_set_the_trainers_cadence(tmp_path, sharp_target_dir):
    torch.manual_seed(0)
    by_share = make_run(tmp_path / "share", sharp_target_dir,
                        {"max_steps": 8, "resume": False, "checkpoint_every": 100, "checkpoint_fraction": 0.25})
    train(load_params(by_share), load_params(by_share).run_dir(), progress=False)
    assert eval_steps(by_share) == [2, 4, 6, 8]
    by_clock = make_run(tmp_path / "clock", sharp_target_dir,
                        {"max_steps": 3, "resume": False, "checkpoint_every": 100, "checkpoint_minutes": 1e-9})
    train(load_params(by_clock), load_params(by_clock).run_dir(), progress=False)
    assert eval_steps(by_clock) == [1, 2, 3]                  # every step: the minutes passed each time
