"""The plan's per-stage times: against recorded runs on this CPU, every figure measured or assumed,
the GPU model's bases; and what the plan refuses before a full run starts (disk, host memory,
thinking-mode answers cut)."""
import copy
import json
import os
from collections import namedtuple

import pytest

from eagle3lib import plan as planner
from eagle3lib import stage_times
from eagle3lib.layout import RunLayout
from eagle3lib.params import ParamsError, load_params
from eagle3lib.plan import capacity_plan, format_plan, full_run_problems, refuse_full_run
from eagle3lib.runner import run_pipeline
from eagle3lib.stage_times import BOX_CACHE_READ_BYTES_PER_S, H200_TRAIN_TOKENS_PER_S, recorded_runs

TOLERANCE = 0.30


def recorded_plan(run: dict, tmp_path, recorded=None) -> dict:
    """The plan of a recorded run's profile (as it was at the recorded commit) for its host kind,
    from an empty run folder (no measured rates of an earlier run apply)."""
    p = load_params(f"params/{run['profile']}.yaml", run.get("overrides") or None)
    return capacity_plan(p, memory=False, layout=RunLayout(tmp_path / run["profile"]),
                         host_kind=run["host_kind"], recorded=recorded)


@pytest.mark.parametrize("run", recorded_runs(), ids=lambda r: f"{r['profile']}-{r['host_kind']}-{r['date']}")
def test_each_recorded_stage_is_planned_within_30_percent(run, tmp_path):
    """bench/recorded_stage_times.json: wall times of real `eagle3 run`s on this 2-core CPU kind."""
    plan = recorded_plan(run, tmp_path)
    off = {stage: plan["stages"][stage]["seconds"] / seconds - 1 for stage, seconds in run["stage_seconds"].items()}
    assert all(abs(x) <= TOLERANCE for x in off.values()), {k: f"{v:+.0%}" for k, v in off.items()}


def test_recorded_runs_cover_both_host_kinds_and_every_stage_of_local():
    runs = recorded_runs()
    assert {r["host_kind"] for r in runs} == set(stage_times.HOST_KINDS)
    local = [r for r in runs if r["profile"] == "local" and r["host_kind"] == "native_bf16"]
    assert local and set(local[0]["stage_seconds"]) == set(stage_times.STAGES)


def test_the_cpu_rates_are_the_records_not_constants(tmp_path):
    """Halving a recorded rate doubles the planned work it times: the plan reads the record."""
    run = next(r for r in recorded_runs() if r["profile"] == "local" and r["host_kind"] == "native_bf16")
    slower = copy.deepcopy(recorded_runs())
    for r in slower:
        if r["host_kind"] == run["host_kind"] and "extract_tokens_per_s" in r.get("rates", {}):
            r["rates"]["extract_tokens_per_s"][0] /= 2
    base, half = recorded_plan(run, tmp_path), recorded_plan(run, tmp_path, recorded=slower)
    assert half["extract_hours"] == pytest.approx(2 * base["extract_hours"])
    assert half["train_hours"] == pytest.approx(base["train_hours"])
    with pytest.raises(ValueError, match="no recorded run on a avx2 host"):
        recorded_plan({**run, "host_kind": "avx2"}, tmp_path, recorded=[run])


def all_parts(plan: dict) -> list:
    return [part for st in plan["stages"].values() for part in st["parts"]]


def test_b300_plan_marks_every_figure_and_counts_every_engine_start(tmp_path):
    p = load_params("params/b300.yaml")
    plan = capacity_plan(p, memory=False, layout=RunLayout(tmp_path / "b300"))
    for part in all_parts(plan):
        assert part["basis"].startswith(("measured", "assumed")), part
    engines = {name: sum(int(q["name"].split()[0]) for q in st["parts"] if "vLLM engine start" in q["name"])
               for name, st in plan["stages"].items()}
    # 01: none (05 measures plain and n-gram); 02: regeneration; 03: extraction (+ its fidelity check);
    # 05: plain, n-gram, suffix, EAGLE-3
    assert engines["ngram"] == 0 and not p.eval.baseline_vllm and p.eval.suffix_baseline
    assert (engines["data"], engines["extract"], engines["eval"]) == (1, 1, 4)
    assert sum(engines[s] for s in stage_times.STAGES) == 6
    names = " | ".join(q["name"] for q in all_parts(plan))
    for io in ("connector saves", "parent re-reads and re-writes", "writer's sha256", "verify the cache"):
        assert io in names
    text = format_plan(plan)
    assert "stage times" in text and "03 extract" in text and "assumed (120 s + 0.5 s/GB x 595 GB" in text


def test_gpu_training_is_the_h200_measurement_scaled_per_gpu_kind(tmp_path):
    """At the measured shapes (Kimi, ttt 7, draft vocab 32k) on one H200 rank the plan's rate IS the
    measurement; on a B300 it scales by dense bf16 FLOP/s, on 8 ranks by 8 x the FSDP share."""
    one = {"train": {"nproc": 1, "distributed": "none", "ttt_steps": 7, "gpu_memory_gb": 141, "gpu_kind": "H200"},
           "target": {"tensor_parallel_size": 1}}
    h200 = capacity_plan(load_params("params/b300.yaml", one), memory=False, layout=RunLayout(tmp_path / "a"))
    assert h200["train_tokens_per_s"] == pytest.approx(H200_TRAIN_TOKENS_PER_S)
    assert h200["train_rate_basis"].startswith("measured on one H200 rank")
    b300 = capacity_plan(load_params("params/b300.yaml", {**one, "train": {**one["train"], "gpu_memory_gb": 288,
                                                                           "gpu_kind": "B300"}}),
                         memory=False, layout=RunLayout(tmp_path / "b"))
    flops = stage_times.GPU_KINDS
    assert b300["train_tokens_per_s"] == pytest.approx(H200_TRAIN_TOKENS_PER_S * flops["B300"][0] / flops["H200"][0])
    node = capacity_plan(load_params("params/b300.yaml"), memory=False, layout=RunLayout(tmp_path / "c"))
    assert node["train_tokens_per_s"] == pytest.approx(8 * stage_times.FSDP_SCALING * b300["train_tokens_per_s"])


def test_regeneration_is_bandwidth_bound_and_extraction_io_bound(tmp_path):
    """Regeneration follows HBM bandwidth (half the GPUs: each reads twice the weights, and the whole MLA
    KV cache as before); extraction's I/O (save, copy, hash of the cache) outweighs its prefill at Kimi
    scale; verification is seconds per GB."""
    full = capacity_plan(load_params("params/b300.yaml"), memory=False, layout=RunLayout(tmp_path / "a"))
    half = capacity_plan(load_params("params/b300.yaml", {"target": {"tensor_parallel_size": 4},
                                                          "train": {"nproc": 4}}),
                         memory=False, layout=RunLayout(tmp_path / "b"))
    bandwidth = stage_times.GPU_KINDS["B300"][1] * stage_times.HBM_EFFICIENCY
    weights_s = full["checkpoint_bytes"] / 8 / bandwidth                    # each of 8 GPUs reads its eighth
    kv_s = stage_times.REGEN_DECODE_BATCH * 2048 * 61 * 576 * 2 / bandwidth   # 256 x max_length / 2, on every GPU
    batch = stage_times.REGEN_DECODE_BATCH
    assert full["regen_tokens_per_s"] == pytest.approx(batch / (weights_s + kv_s))
    assert half["regen_tokens_per_s"] == pytest.approx(batch / (2 * weights_s + kv_s))
    assert "decode-bandwidth" in full["regen_rate_basis"] and "MFU" not in full["regen_rate_basis"]
    extract = {q["name"].split()[0]: q["seconds"] for q in full["stages"]["extract"]["parts"]}
    assert extract["connector"] + extract["parent"] + extract["writer's"] > 3 * extract["prefill"]
    # 03 ends with the verification, over its extract.nproc processes (b300: the one vLLM client)
    verify = next(q for q in full["stages"]["extract"]["parts"] if q["name"].startswith("verify"))
    # 8 threads hash faster than the box's disk reads (assumed): bound by the disk, marked so
    assert verify["seconds"] == pytest.approx(full["cache_bytes"] / BOX_CACHE_READ_BYTES_PER_S, rel=1e-3)
    assert "measured" in verify["basis"] and "assumed" in verify["basis"] and "disk" in verify["basis"]
    assert not [q for q in full["stages"]["train"]["parts"] if q["name"].startswith("verify")]
    sampled = capacity_plan(load_params("params/b300.yaml", {"train": {"verify_cache": "sizes"}}), memory=False,
                            layout=RunLayout(tmp_path / "c"))
    assert not [q for q in sampled["stages"]["extract"]["parts"] if q["name"].startswith("verify")]


def test_verification_follows_the_measured_hash_rate_threads_and_the_box_disk():
    from eagle3lib.stage_times import HASH_BYTES_PER_S, VERIFY_THREADS, Host, verify_seconds
    cpu, box = Host(kind="native_bf16"), Host(kind="gpu", gpus=8, gpu="B300")
    threads = min(VERIFY_THREADS, os.cpu_count() or 1)
    one, basis = verify_seconds(10.0, 1, cpu)
    assert one == pytest.approx(10e9 / (threads * HASH_BYTES_PER_S)) and basis.startswith("measured")
    assert verify_seconds(10.0, 2, cpu)[0] == pytest.approx(one / 2)                 # processes split the shards
    disk, disk_basis = verify_seconds(1000.0, 1, box)
    assert disk == pytest.approx(1000e9 / BOX_CACHE_READ_BYTES_PER_S) and "disk" in disk_basis
    assert disk < 1000 * 1.0                     # below the 1 s/GB per process assumed before the measurement


# ---- bad input: the full run cannot finish although its smoke slice would -------------------------
DiskUsage = namedtuple("DiskUsage", "total used free")


def problems_of(p, tmp_path) -> dict:
    layout = RunLayout(tmp_path / "run")
    plan = capacity_plan(p, memory=False, layout=layout)
    assert plan["problems"] == full_run_problems(p, plan, layout)
    return {key: (level, text) for level, key, text in plan["problems"]}


def test_a_disk_too_small_for_the_cache_is_refused_before_any_stage(tmp_path, monkeypatch):
    p = load_params("params/ci.yaml", {"output_dir": str(tmp_path / "out")})
    assert "output_dir" not in problems_of(p, tmp_path)
    cache = capacity_plan(p, memory=False, layout=RunLayout(tmp_path / "run"))["cache_bytes"]
    monkeypatch.setattr(planner.shutil, "disk_usage", lambda path: DiskUsage(cache, cache // 2, cache // 2))
    level, text = problems_of(p, tmp_path)["output_dir"]
    assert level == "refuse" and "more" in text and "free" in text and "output_dir" in text
    with pytest.raises(ParamsError, match="output_dir: the hidden-state caches need"):
        refuse_full_run(p, RunLayout(tmp_path / "run"))
    nbdir = tmp_path / "notebooks"                 # no notebooks at all: a stage would fail differently
    nbdir.mkdir()
    prof = tmp_path / "p.yaml"
    prof.write_text(f"inherit: {os.path.abspath('params/ci.yaml')}\noutput_dir: {tmp_path / 'out'}\nrun_name: t\n")
    with pytest.raises(ParamsError, match="output_dir"):
        run_pipeline(str(prof), only="research", notebooks_dir=nbdir, log=lambda *a: None)
    assert not (tmp_path / "out" / "t" / "params.yaml").exists()         # refused before the run began


def test_host_memory_too_small_for_the_held_out_set_is_refused(tmp_path, monkeypatch):
    p = load_params("params/ci.yaml", {"output_dir": str(tmp_path / "out")})
    held = capacity_plan(p, memory=False, layout=RunLayout(tmp_path / "run"))["heldout_host_bytes"]
    assert held > 0 and "train.eval_sequences" not in problems_of(p, tmp_path)
    monkeypatch.setattr(planner, "host_memory_bytes", lambda: held)       # the set would take all of it
    level, text = problems_of(p, tmp_path)["train.eval_sequences"]
    assert level == "refuse" and "lower train.eval_sequences" in text
    # b300's 256 held-out sequences at Kimi shapes: the ~100 GB the trainer's own docstring states
    b300 = capacity_plan(load_params("params/b300.yaml"), memory=False, layout=RunLayout(tmp_path / "b300"))
    assert 50e9 < b300["heldout_host_bytes"] < 200e9


def kimi_like_target(tmp_path, thinking: bool):
    """A target folder whose chat template opens a <think> block (Kimi-K2.5's default), not loadable."""
    folder = tmp_path / ("thinker" if thinking else "plain")
    folder.mkdir()
    template = "{% if add_generation_prompt %}<|im_assistant|>" + ("<think>" if thinking else "") + "{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return {"path": str(folder), "shape": {"num_hidden_layers": 8, "hidden_size": 256, "vocab_size": 49152}}


def test_a_thinking_template_whose_answers_the_cap_cuts_is_refused(tmp_path):
    data = {"regenerate": True, "regen_max_new_tokens": 2048, "max_length": 4096, "max_records": 300,
            "num_train": 16, "num_eval": 6}
    base = {"output_dir": str(tmp_path / "out"), "data": data,
            "extract": {"aux_layers": [1, 4, 6], "batch_tokens": 4096},
            "train": {"batch_tokens": 4096}}
    thinks = kimi_like_target(tmp_path, True)
    thinker = load_params("params/ci.yaml", {**base, "target": thinks})
    level, text = problems_of(thinker, tmp_path)["data.regen_max_new_tokens"]
    assert level == "refuse" and "data.thinking: off" in text
    plain = load_params("params/ci.yaml", {**base, "target": kimi_like_target(tmp_path, False)})
    assert "data.regen_max_new_tokens" not in problems_of(plain, tmp_path)
    instant = load_params("params/ci.yaml", {**base, "target": thinks, "data": {**data, "thinking": "off"}})
    assert "data.regen_max_new_tokens" not in problems_of(instant, tmp_path)
    assert "data.regen_max_new_tokens" not in problems_of(load_params("params/b300.yaml"), tmp_path)
    unknown = problems_of(load_params("params/b300.yaml", {"data": {"thinking": "auto"}}), tmp_path)
    assert unknown["data.thinking"][0] == "warn"                # its template is not on this machine


def test_warnings_do_not_stop_the_run(tmp_path):
    p = load_params("params/ci.yaml", {"output_dir": str(tmp_path / "out"), "train": {"checkpoint_every": 50}})
    level, text = problems_of(p, tmp_path)["train.checkpoint_every"]
    assert level == "warn" and "no intermediate checkpoint" in text
    seen = []
    assert refuse_full_run(p, RunLayout(tmp_path / "run"), log=seen.append) == [f"train.checkpoint_every: {text}"]
    assert seen and "warning" in seen[0]


def test_the_plan_compares_offline_and_online_layouts_by_hours_disk_and_memory(tmp_path):
    """b300 on 8 GPUs: offline (03's cache), online on every GPU, and online with 4 GPUs serving and
    4 training. Online's disk is the held-out cache plus the staging bound, its hours pay the
    server's prefill of every trained token (both epochs) and no cache I/O; the split's hours are
    the slower of its two sides; the memory verdicts use the memory model per layout."""
    from eagle3lib.mode_plan import served_seconds, staging_bound_bytes
    p = load_params("params/b300.yaml")
    plan = capacity_plan(p, memory=True, layout=RunLayout(tmp_path / "b300"))
    modes = {m["layout"]: m for m in plan["modes"]}
    assert list(modes) == ["offline", "online, shared", "online, split 4 serve / 4 train"]
    off, shared, split = modes.values()
    assert off["disk_bytes"] == plan["cache_bytes"] > 1e12
    online = capacity_plan(load_params("params/b300.yaml", {"extract": {"mode": "online"}}), memory=False,
                           layout=RunLayout(tmp_path / "b300-online"))
    held_out = online["cache_bytes"]
    assert held_out < plan["cache_bytes"] / 50 and online["tokens_to_extract"] < plan["tokens_to_extract"] / 50
    assert shared["disk_bytes"] == held_out + staging_bound_bytes(7168, p.train.batch_tokens, p.train.num_workers, 8)
    prefill = [q for q in online["stages"]["train"]["parts"] if q["name"].startswith(stage_times.SERVED_PART)]
    assert len(prefill) == 1 and f"of {online['train_tokens']:,.0f} tokens" in prefill[0]["name"]   # every epoch
    trainer = online["stages"]["train"]["seconds"] - served_seconds(online)
    assert shared["hours"] * 3600 == pytest.approx(online["stages"]["extract"]["seconds"] + trainer
                                                   + served_seconds(online))
    prefill_s = prefill[0]["seconds"]                     # the split halves the serving GPUs: prefill x 2
    assert split["hours"] * 3600 == pytest.approx(online["stages"]["extract"]["seconds"]
                                                  + max(trainer * 2, served_seconds(online) + prefill_s))
    # memory: the shared trainer gets what the server (gpu_memory_utilization 0.9) leaves: it does not fit
    assert shared["trainer_budget_gb"] == pytest.approx(288 * 0.1) and shared["fits"] is False
    assert off["fits"] is True and split["trainer_peak_gb"] > off["trainer_peak_gb"]     # 4 ranks shard less
    assert split["weights_gb_per_gpu"] == pytest.approx(2 * shared["weights_gb_per_gpu"])
    text = format_plan(plan)
    assert "hidden states: offline or online" in text and "online, split 4 serve / 4 train" in text
    # a CPU profile compares the two modes on the CPU, no memory rows
    ci = {m["layout"]: m for m in capacity_plan(load_params("params/ci.yaml"), memory=False,
                                                 layout=RunLayout(tmp_path / "ci"))["modes"]}
    assert list(ci) == ["offline", "online, shared"] and ci["online, shared"]["trainer_peak_gb"] is None


def test_01_without_its_vllm_baseline_plans_no_engine_there_and_05_keeps_both_methods():
    """local and b300 leave vLLM's plain and n-gram rows to 05 (eval.baseline_vllm: false), where
    b300's suffix decoding runs too (params.suffix_stage; local leaves it out of the hour); with 01's
    vLLM run on, suffix decoding is 01's."""
    local, b300 = load_params("params/local.yaml"), load_params("params/b300.yaml")
    assert local.eval.baseline_vllm is False and b300.eval.baseline_vllm is False
    assert stage_times.eval_modes(local, "ngram") == [] == stage_times.eval_modes(b300, "ngram")
    assert stage_times.eval_modes(local, "eval") == ["plain", f"ngram_k{local.eval.k}", f"eagle3_k{local.eval.k}"]
    assert stage_times.eval_modes(b300, "eval") == ["plain", "ngram_k4", "suffix", "eagle3_k4"]
    with_01 = load_params("params/b300.yaml", {"eval": {"baseline_vllm": True}})
    assert stage_times.eval_modes(with_01, "ngram") == ["plain", "ngram_k2", "suffix"]
    assert stage_times.eval_modes(with_01, "eval") == ["plain", "ngram_k4", "eagle3_k4"]
    with pytest.raises(ParamsError, match="eval.baseline_vllm"):
        load_params("params/ci.yaml", {"eval": {"baseline_vllm": "no"}})
