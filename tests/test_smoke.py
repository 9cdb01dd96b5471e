"""`eagle3 run --smoke`: the smoke slice of every shipped profile changes only sizes and takes the
same branches as the profile (params level, fast). The suite runs the CLI's smoke once, on the
profile with the most branches: test_kimi_pipeline's shared mini-kimi run (vLLM regeneration and
extraction, two FSDP ranks, a DCP resume), checked there stage by stage with check_smoke_metrics
below; the safetensors resume it does not take is test_checkpoints' and test_train's."""
from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import yaml

from eagle3lib.files import read_json
from eagle3lib.layout import RunLayout
from eagle3lib.params import (
    checkpoint_interval,
    load_params,
    max_warmup_steps,
    planned_warmup,
    regen_cap_problem,
    repo_root,
)
from eagle3lib.smoke import (
    SIZE_FIELDS,
    SLICE,
    branches,
    changed_fields,
    checkpoint_format,
    smoke_chats,
    smoke_params,
    train_ranks,
)
from eagle3lib.train import schedule

ROOT = repo_root()
PROFILES = sorted(p.name for p in (ROOT / "params").glob("*.yaml"))


def write_profile(folder: Path, parent: str, **sections) -> Path:
    """A profile inheriting params/<parent> with its outputs under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "p.yaml"
    path.write_text(yaml.safe_dump({"inherit": str(ROOT / "params" / parent), "output_dir": str(folder / "out"),
                                    "run_name": "t", **sections}))
    return path


# ---- params level: the same branches, only sizes changed --------------------------------------
@pytest.mark.parametrize("name", PROFILES)
def test_smoke_profile_changes_only_sizes_and_takes_the_same_branches(name):
    full = load_params(ROOT / "params" / name)
    smoke = smoke_params(full)
    changed = changed_fields(full, smoke)
    assert set(changed) <= SIZE_FIELDS, sorted(set(changed) - SIZE_FIELDS)
    assert branches(smoke) == branches(full)
    assert smoke.run_name == f"{full.run_name}-smoke" and smoke.output_dir == full.output_dir
    # a slice: never more work than the full run, and a checkpoint before the last step (the resume leg)
    assert smoke.train.max_steps <= (full.train.max_steps or 10**9) and smoke.train.max_steps <= 20
    assert checkpoint_interval(smoke.train, smoke.train.max_steps) < smoke.train.max_steps and smoke.train.resume
    assert smoke.data.num_train <= min(full.data.num_train or 10**9, smoke_chats(full, SLICE, smoke.data.max_length,
                                                                              smoke.data.regen_max_new_tokens))
    assert smoke.data.num_eval <= min(full.data.num_eval, 8) and smoke.eval.num_prompts <= 8
    assert smoke.eval.max_new_tokens <= 32 and smoke.train.warmup_steps <= max_warmup_steps(smoke.train.max_steps)
    may_think = full.data.thinking != "off" and regen_cap_problem(full.data, thinking=True) is None
    assert smoke.data.regen_max_new_tokens == full.data.regen_max_new_tokens if may_think \
        else smoke.data.regen_max_new_tokens <= 32


def modelled_lengths(p, model: str, seed: int = 0) -> list:
    """Sequence lengths a run of profile p produces, without running it: one per training chat, each at
    least its answer (data.regen_max_new_tokens: the slice's answers are cut there) and at most
    data.max_length. "shortest": every sequence its answer alone (the bound smoke_chats rests on);
    "spread": seeded, uniform between the two; "longest": every one cut at max_length."""
    d = p.data
    lo, hi = min(d.regen_max_new_tokens, d.max_length), d.max_length
    n = d.num_train or 1000                        # a profile that takes every chat: a thousand of them
    g = random.Random(seed)
    return {"shortest": [lo] * n, "spread": [g.randint(lo, hi) for _ in range(n)], "longest": [hi] * n}[model]


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_trains_its_smoke_slice_and_its_full_run(name):
    """The trainer's schedule (train.schedule, as 04 calls it) on the lengths each run would produce:
    the smoke slice under every length model, the full run where its sequences spread or fill
    max_length, give optimizer steps (one micro-batch per rank and grad_accum step), a warmup within
    its bound, and for the smoke a checkpoint before the last step for the resume leg. Before the slice
    scaled its micro-batch, b300's 32 chats at a 32,768-token micro-batch made fewer than the 8
    micro-batches one step of 8 ranks needs: 0 steps, after an hour of engine starts."""
    full = load_params(ROOT / "params" / name)
    smoke = smoke_params(full)
    runs = [(smoke, m) for m in ("shortest", "spread", "longest")] + [(full, m) for m in ("spread", "longest")]
    for p, model in runs:
        lengths = modelled_lengths(p, model)
        _, per_step, steps_per_epoch, total = schedule(SimpleNamespace(lengths=lengths), p.train, p.seed,
                                                       train_ranks(p))
        assert per_step == train_ranks(p) * p.train.grad_accum, (p.run_name, model)
        assert steps_per_epoch >= 1 and total >= 1, (p.run_name, model)
        assert planned_warmup(p.train, total) <= max_warmup_steps(total)
        if p is smoke:
            assert total == smoke.train.max_steps and checkpoint_interval(p.train, total) < total


def test_the_slice_of_eight_ranks_scales_its_micro_batch_and_its_chats():
    """b300 (8 FSDP ranks): the slice cuts sequences at 256 tokens, a micro-batch holds one such, and it
    takes 8 x ceil(256 / 32) = 64 chats, so that even 32-token sequences fill every rank's micro-batch;
    the old slice (its 32,768-token micro-batch kept) gives no optimizer step."""
    full = load_params(ROOT / "params" / "b300.yaml")
    smoke = smoke_params(full)
    assert train_ranks(smoke) == 8 and smoke.data.max_length == smoke.train.batch_tokens == 256
    assert smoke.data.num_train == 64 and smoke.data.regen_max_new_tokens == 32
    old = dataclasses.replace(smoke, train=dataclasses.replace(smoke.train, batch_tokens=full.train.batch_tokens),
                              data=dataclasses.replace(smoke.data, num_train=32))
    with pytest.raises(ValueError, match="fewer micro-batches than one optimizer step needs"):
        schedule(SimpleNamespace(lengths=modelled_lengths(old, "spread")), old.train, old.seed, 8)


@pytest.mark.parametrize("name,backend", [("b300", None), ("rtx-pro-6000", "TRITON_MLA")])
def test_b300_smoke_keeps_the_parallel_layout_and_reads_every_source(name, backend):
    full = load_params(ROOT / "params" / f"{name}.yaml")
    smoke = smoke_params(full)
    b = branches(smoke)
    assert b["engine layout"] == {"tensor_parallel": 8, "data_parallel": 1, "expert_parallel": True,
                                  "enforce_eager": False, "attention_backend": backend}
    assert b["training"]["distributed"] == "fsdp" and b["training"]["processes"] == 8
    assert b["checkpoint format"] == "dcp" and b["regeneration"] == "vllm" and b["extraction"]["backend"] == "vllm"
    assert b["scaling study"]["on"] and b["reference decoder"] == "never"
    # each listed source keeps a share of the records (a global cap would stop inside the first one)
    assert len(full.data.source) >= 2
    assert [s["path"] for s in smoke.data.source] == [s["path"] for s in full.data.source]
    records = (smoke.data.num_train + smoke.data.num_eval) * SLICE.records_per_chat
    assert all(1 <= s["max_records"] <= records // len(full.data.source) for s in smoke.data.source)
    assert smoke.scaling.sizes == [32, 64] and smoke.extract.shard_tokens < full.extract.shard_tokens


def test_branches_see_what_a_wrong_slice_would_change():
    """The check can fail: a slice that switched a backend, the world size, the checkpoint format or
    a study off would differ in branches (and in a field outside SIZE_FIELDS)."""
    full = load_params(ROOT / "params" / "mini-kimi.yaml")
    wrong = [dataclasses.replace(full, extract=dataclasses.replace(full.extract, backend="hf")),
             dataclasses.replace(full, train=dataclasses.replace(full.train, nproc=1)),
             dataclasses.replace(full, data=dataclasses.replace(full.data, regen_backend="hf")),
             dataclasses.replace(full, eval=dataclasses.replace(full.eval, use_vllm=True)),
             dataclasses.replace(full, data=dataclasses.replace(full.data, regen_num_train=4))]
    for w in wrong:
        assert branches(w) != branches(full)
    assert checkpoint_format(wrong[1]) == "safetensors" != checkpoint_format(full) == "dcp"
    assert set(changed_fields(full, wrong[0])) == {"extract.backend"} and not {"extract.backend"} <= SIZE_FIELDS
    ci = load_params(ROOT / "params" / "ci.yaml")
    no_study = dataclasses.replace(ci, scaling=dataclasses.replace(ci.scaling, sizes=[]))
    assert branches(no_study)["scaling study"]["on"] is False and branches(smoke_params(no_study)) == branches(no_study)


def test_a_thinking_target_keeps_its_answer_cap_and_a_fraction_cadence_checkpoints_half_way(tmp_path):
    """Thinking answers cut at 32 tokens would be refused (params.regen_cap_problem): the smoke slice
    keeps the cap of a profile that may think; checkpoint_fraction (which replaces checkpoint_every)
    is set to half the run, so the resume leg has its checkpoint."""
    full = load_params(write_profile(tmp_path, "b300.yaml", data={"thinking": "on", "regen_max_new_tokens": 8192,
                                                                  "max_length": 8192},
                                     extract={"batch_tokens": 131072},
                                     train={"checkpoint_fraction": 0.1, "warmup_fraction": 0.05}))
    smoke = smoke_params(full)
    assert smoke.data.regen_max_new_tokens == 8192 and smoke.data.thinking == "on"
    assert smoke.train.checkpoint_fraction == 0.5 and smoke.train.warmup_fraction == 0.05
    assert branches(smoke) == branches(full) and set(changed_fields(full, smoke)) <= SIZE_FIELDS
    instant = smoke_params(load_params(write_profile(tmp_path, "b300.yaml", data={"thinking": "off"})))
    assert instant.data.regen_max_new_tokens == 32


def test_partial_regeneration_stays_partial_and_a_long_run_name_stays_valid(tmp_path):
    full = load_params(write_profile(tmp_path, "local.yaml", run_name="r" * 100,
                                     data={"regen_num_train": 500}))
    smoke = smoke_params(full)
    assert branches(full)["regeneration scope"] == "partial" == branches(smoke)["regeneration scope"]
    assert 1 <= smoke.data.regen_num_train < smoke.data.num_train
    assert len(smoke.run_name) == 100 and smoke.run_name.endswith("-smoke")


def test_cli_smoke_refuses_a_bad_profile_before_any_work(tmp_path):
    bad = write_profile(tmp_path, "ci.yaml", train={"lr": -1})
    r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "run", "--params", str(bad), "--smoke"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "train.lr: must be > 0" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_planned_seconds_read_the_plans_stage_model_and_format_smoke_shows_them():
    from eagle3lib.runner import format_smoke, planned_seconds
    p = load_params(ROOT / "params" / "ci.yaml")
    plan = {"stages": {"data": {"seconds": 90.0, "optional": False,
                                "parts": [{"name": "kernel", "seconds": 15.0, "basis": "assumed (15 s)"},
                                          {"name": "regen", "seconds": 75.0, "basis": "measured (x)"}]}}}
    assert planned_seconds(p, plan) == {"data": (90.0, "capacity plan: measured + assumed")}
    report = {"stages": [{"stage": "data", "seconds": 120.0, "planned_smoke_s": 90.0, "planned_full_s": 7200.0,
                          "planned_full_at_smoke_rates_s": None}],
              "resume": {"checkpoint_format": "dcp", "resumed_from_step": 10, "steps": 20, "final_weights_equal": True,
                         "final_weights_max_rel_diff": 0.0, "final_weights_match": True},
              "branches_equal_full_run": True}
    text = format_smoke(report)
    assert "data" in text and "2.0 min" in text and "2.0 h" in text and "step 10 -> step 20" in text


# ---- the smoke runs, through the CLI (heavy: vLLM engines, notebooks) ------------------------
ALL_STAGES = ["research", "ngram", "data", "extract", "train", "train-resume", "eval"]


def run_cli_smoke(profile: Path, only: Optional[str] = None) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "run", "--params", str(profile), "--smoke",
                        "--no-html", *(["--only", only] if only else [])],
                       capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    layout = RunLayout(load_params(profile).outputs_root() / "t-smoke")
    return r, read_json(layout.metrics)


def check_smoke_metrics(metrics: dict, full_steps: int, fmt: str, stages: list = ALL_STAGES) -> None:
    """Every stage asked for ran, each with its time beside the plan's; training resumed."""
    smoke = metrics["smoke"]
    assert smoke["complete"] and smoke["branches_equal_full_run"] and smoke["failed_stage"] is None
    rows = {r["stage"]: r for r in smoke["stages"]}
    assert list(rows) == stages
    assert all(r["seconds"] > 0 for r in rows.values())
    for stage in ("data", "extract", "train"):
        assert rows[stage]["planned_smoke_s"] > 0 and rows[stage]["planned_full_s"] >= rows[stage]["planned_smoke_s"]
        assert rows[stage]["planned_full_at_smoke_rates_s"] > 0
    assert {"regen_hours", "extract_hours", "train_hours"} <= set(smoke["plan_full_hours"])
    resume = smoke["resume"]
    assert resume["steps"] == full_steps and resume["resumed_from_step"] == full_steps // 2
    assert resume["checkpoint_format"] == fmt
    # the uninterrupted leg and the resumed one reach the same weights (train.py's resume contract):
    # bit for bit offline; online within ONLINE_RESUME_RTOL (two server starts)
    assert resume["final_weights_match"] is True and resume["final_weights_max_rel_diff"] <= 1e-4
    assert resume["final_weights_equal"] is True or metrics["extract"].get("mode") == "online"
    assert metrics["train"]["steps"] == full_steps and ("eval" not in stages or metrics["eval"])


def test_the_resumed_leg_matches_bit_for_bit_offline_and_within_the_tolerance_online():
    from eagle3lib.runner import ONLINE_RESUME_RTOL, legs_match
    assert legs_match(True, 0.0, "offline") and legs_match(True, 0.0, "online")
    assert not legs_match(False, 1e-9, "offline")                       # offline states are the same bytes
    assert legs_match(False, ONLINE_RESUME_RTOL / 2, "online")
    assert not legs_match(False, ONLINE_RESUME_RTOL * 2, "online")


def test_the_smoke_run_stops_on_an_export_that_accepts_less_in_vllm_than_04_replayed(tmp_path):
    """05's export check (verdict.export_check) ends the smoke run where it failed, and only there."""
    from eagle3lib.files import update_metrics
    from eagle3lib.runner import check_export
    from eagle3lib.verdict import export_check
    layout = RunLayout(tmp_path)
    update_metrics(tmp_path, "eval", {"export_check": export_check(1.3, 1.9, 4, 4)})
    with pytest.raises(RuntimeError, match="smoke: vLLM acceptance 1.300 vs 04's replayed 1.900 at k = 4"):
        check_export(layout)
    for passing in (export_check(1.85, 1.9, 4, 4), export_check(1.3, 1.9, 7, 4)):
        update_metrics(tmp_path, "eval", {"export_check": passing})
        check_export(layout)
