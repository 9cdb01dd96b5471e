"""The existing box (8x RTX PRO 6000 Blackwell, params/rtx-pro-6000.yaml) and the port to B300: the GPU kind's
figures and interconnect in the plan, the refusals of what does not fit 96 GB (trainer step, engine KV room,
online hidden states), the engine settings sm_120 needs, and b300.yaml as a small diff of the existing box."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from eagle3lib import gpus, stage_times
from eagle3lib.cli import main
from eagle3lib.engine import engine_kwargs
from eagle3lib.engine_memory import engine_memory, online_problem
from eagle3lib.layout import RunLayout
from eagle3lib.online import engine_flags
from eagle3lib.params import VLLM_ATTENTION_BACKENDS, ParamsError, load_params, repo_root
from eagle3lib.plan import REGEN_PROMPT_TOKENS, capacity_plan, format_plan
from eagle3lib.preflight import NCCL_P2P_FIXED, nccl_check
from eagle3lib.smoke import flat_fields
from eagle3lib.stage_times import FSDP_SCALING, collective_seconds, gpu_kind, kv_cache

ROOT = repo_root()
RTX = "params/rtx-pro-6000.yaml"
B300 = "params/b300.yaml"
KIMI_KV_BYTES = 61 * (512 + 64) * 2          # MLA latent + rope key per layer, bf16: 70,272 B per token


def plan_of(p, tmp_path, name="run", memory=False, modes=True) -> dict:
    return capacity_plan(p, memory=memory, layout=RunLayout(tmp_path / name), modes=modes)


def problems(plan: dict) -> dict:
    return {key: (level, text) for level, key, text in plan["problems"]}


# ---- the GPU kind ----------------------------------------------------------------------------------------
def test_the_rtx_pro_6000_figures_are_assumed_with_their_source():
    flops, bandwidth, memory_gb = gpus.GPU_KINDS["RTX-PRO-6000"]
    assert (flops, bandwidth, memory_gb) == (0.5e15, 1.6e12, 96)
    assert gpus.INTERCONNECT["RTX-PRO-6000"] == (64e9, "PCIe Gen5 x16, no NVLink") and gpus.pcie_only("RTX-PRO-6000")
    assert set(gpus.INTERCONNECT) == set(gpus.GPU_KINDS) == set(gpus.SOURCES)
    for kind in ("H100", "H200", "B200", "B300"):
        assert "NVLink" in gpus.INTERCONNECT[kind][1] and not gpus.pcie_only(kind)
        assert gpus.INTERCONNECT[kind][0] >= 7 * gpus.INTERCONNECT["RTX-PRO-6000"][0]
    text = gpus.kind_figures("RTX-PRO-6000")
    assert text.startswith("assumed") and "third-party" in text and "Server edition" in text and "64 GB/s" in text
    assert stage_times.GPU_KINDS is gpus.GPU_KINDS                  # one table: the plan's and the validation's


def test_the_profile_names_its_gpu_kind_and_the_validation_checks_it():
    p = load_params(RTX)
    assert gpu_kind(p) == ("RTX-PRO-6000", "train.gpu_kind")
    guessed = load_params(RTX, {"train": {"gpu_kind": None}})       # without the key: nearest memory, as before
    assert gpu_kind(guessed)[0] == "RTX-PRO-6000" and "train.gpu_memory_gb = 96" in gpu_kind(guessed)[1]
    with pytest.raises(ParamsError, match=r"train.gpu_kind: 'RTX-6000' is not a GPU kind the plan knows"):
        load_params(RTX, {"train": {"gpu_kind": "RTX-6000"}})
    with pytest.raises(ParamsError, match=r"train.gpu_memory_gb: 288 GB is more than one RTX-PRO-6000 has \(96 GB\)"):
        load_params(RTX, {"train": {"gpu_memory_gb": 288}})


def test_the_plan_states_the_kind_and_its_figures(tmp_path):
    plan = plan_of(load_params(RTX), tmp_path)
    assert plan["gpu_kind"] == "RTX-PRO-6000" and plan["gpu_memory_gb"] == 96
    assert "8 x RTX-PRO-6000 GPUs (train.gpu_kind; assumed RTX-PRO-6000: 0.5 PFLOP/s" in plan["throughput_basis"]
    assert "PCIe Gen5" in plan["train_rate_basis"] and "1.6 TB/s" in plan["regen_rate_basis"]


# ---- the interconnect term of FSDP -------------------------------------------------------------------------
def test_fsdp_moves_three_times_the_trainable_bf16_bytes_and_the_embedding_once(tmp_path):
    p = load_params(RTX)
    work = stage_times.Workload(chats=1, regen_tokens_train=0, regen_tokens_eval=0, extract_tokens=0, cache_bytes=0,
                                train_tokens=0, tokens_per_chat=1, planned_steps=1, active_params=1, total_params=1,
                                checkpoint_bytes=1, checkpoint_basis="", drafter_flops_per_token=1,
                                drafter_params=1e9, frozen_params=2e9)
    host = stage_times.Host("gpu", gpus=8, gpu="RTX-PRO-6000")
    seconds, basis = collective_seconds(p, host, work, 8)
    assert seconds == pytest.approx((3 * 2 * 1e9 + 2 * 2e9) * 7 / 8 / 64e9)
    assert basis.startswith("assumed") and "PCIe Gen5 x16" in basis and "64 GB/s" in basis
    ddp = load_params(RTX, {"train": {"distributed": "ddp"}})
    assert collective_seconds(ddp, host, work, 8)[0] == pytest.approx(2 * 4 * 1e9 * 7 / 8 / 64e9)


def test_fsdp_over_pcie_is_slower_than_over_nvlink_at_the_same_flops(tmp_path, monkeypatch):
    """A kind with the RTX PRO 6000's FLOP/s, bandwidth and memory but NVLink: at 256-token micro-batches
    the collectives over PCIe (~0.12 s) outlast the compute (~0.06 s) and bound the step; over NVLink they
    hide under it. At the profile's 16,384-token micro-batches both hide: the same rate."""
    monkeypatch.setitem(gpus.GPU_KINDS, "NVLINK-TWIN", gpus.GPU_KINDS["RTX-PRO-6000"])
    monkeypatch.setitem(gpus.INTERCONNECT, "NVLINK-TWIN", (900e9, "NVLink 5"))
    monkeypatch.setitem(gpus.SOURCES, "NVLINK-TWIN", "a test kind")
    small = {"data": {"max_length": 256}, "train": {"batch_tokens": 256}}
    pcie = plan_of(load_params(RTX, small), tmp_path, "pcie")
    nvlink = plan_of(load_params(RTX, {**small, "train": {"batch_tokens": 256, "gpu_kind": "NVLINK-TWIN"}}),
                     tmp_path, "nvlink")
    assert pcie["train_tokens_per_s"] < 0.6 * nvlink["train_tokens_per_s"]
    assert "they bound the step" in pcie["train_rate_basis"] and "hidden under it" in nvlink["train_rate_basis"]
    per_rank = nvlink["train_tokens_per_s"] / (8 * FSDP_SCALING)   # compute-bound: the FLOP-scaled rate
    assert per_rank == pytest.approx(stage_times.H200_TRAIN_TOKENS_PER_S * 0.5e15 / 0.989e15)
    assert pcie["train_hours"] > nvlink["train_hours"]
    full_pcie = plan_of(load_params(RTX), tmp_path, "full-pcie")
    full_nvlink = plan_of(load_params(RTX, {"train": {"gpu_kind": "NVLINK-TWIN"}}), tmp_path, "full-nvlink")
    assert full_pcie["train_tokens_per_s"] == pytest.approx(full_nvlink["train_tokens_per_s"])


# ---- refusals: what does not fit 96 GB -----------------------------------------------------------------------
def test_a_sequence_whose_trainer_step_exceeds_96_gb_is_refused(tmp_path):
    """49,152-token sequences (and micro-batches, which hold one) put the step at ~90 GB per GPU, over
    96 GB less 20 % headroom; the plan refuses it naming train.batch_tokens and data.max_length, and takes
    the budget from the kind's memory when train.gpu_memory_gb is not set."""
    long = {"data": {"max_length": 49152}, "train": {"batch_tokens": 49152, "gpu_memory_gb": None}}
    plan = plan_of(load_params(RTX, long), tmp_path, memory=True, modes=False)
    level, text = problems(plan)["train.batch_tokens"]
    assert level == "refuse" and "data.max_length 49,152" in text and "train.batch_tokens" in text
    assert "train.gpu_kind RTX-PRO-6000" in text and "96 GB less 20% headroom" in text
    assert plan["memory"][49152]["peak_bytes"] > 0.8 * 96e9 and "DOES NOT FIT" in format_plan(plan)
    # the profile's own 16,384-token micro-batches fit: test_eagle3_plan_of_the_rtx_box_prints_the_night_with_its_bases


def test_a_regeneration_batch_over_the_kv_room_is_refused_naming_the_keys(tmp_path):
    plan = plan_of(load_params(RTX, {"target": {"max_num_seqs": 512}}), tmp_path)
    level, text = problems(plan)["target.max_num_seqs"]
    regen = next(m for m in plan["engine_memory"] if m["engine"] == "regeneration")
    assert level == "refuse" and regen["needs"][1]["gb"] > regen["kv_room_gb"]
    for key in ("target.max_num_seqs <=", "data.regen_max_new_tokens", "target.gpu_memory_utilization"):
        assert key in text
    fits = int(re.search(r"target.max_num_seqs <= ([\d,]+)", text).group(1).replace(",", ""))
    assert 128 <= fits < 512                                  # the profile's 128 fit; the refusal says how many do
    # an engine share below the weights: nothing left for the KV cache
    low = problems(plan_of(load_params(RTX, {"target": {"gpu_memory_utilization": 0.8}}), tmp_path, "low"))
    assert low["target.gpu_memory_utilization"][0] == "refuse" and "exceed" in low["target.gpu_memory_utilization"][1]
    assert not {"target.max_num_seqs", "target.gpu_memory_utilization"} & set(problems(plan_of(
        load_params(RTX), tmp_path, "rtx")))


def test_the_engine_memory_is_weights_other_and_kv_room_per_gpu(tmp_path):
    p = load_params(RTX)
    rows = {r.engine: r for r in engine_memory(p, "RTX-PRO-6000", 595e9, REGEN_PROMPT_TOKENS)}
    assert set(rows) == {"regeneration", "extraction", "eval"}
    regen = rows["regeneration"]
    assert regen.share_gb == pytest.approx(0.95 * 96) and regen.weights_gb == pytest.approx(595 / 8)
    assert regen.kv_bytes_per_token == KIMI_KV_BYTES
    assert regen.needs[1][1] == pytest.approx(128 * (REGEN_PROMPT_TOKENS + 1024) * KIMI_KV_BYTES / 1e9)
    assert 0 < regen.needs[1][1] < regen.kv_room_gb < 20 and regen.basis.startswith("assumed")
    assert rows["extraction"].other_gb > regen.other_gb              # 16,384 batched tokens against 8,192


def test_the_kv_cache_per_token_comes_from_the_config_where_it_is(tmp_path):
    p = load_params(RTX)
    assumed = kv_cache(p)
    assert (assumed.bytes_per_token, assumed.replicated) == (KIMI_KV_BYTES, True)
    assert assumed.basis.startswith("assumed: Kimi-K2.5's MLA")
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "kv_lora_rank": 256,
        "qk_rope_head_dim": 64}}))
    measured = kv_cache(load_params(RTX, {"target": {"path": str(folder)}}))
    assert measured.bytes_per_token == 61 * (256 + 64) * 2 and measured.basis.startswith("measured: config.json")


def test_online_hidden_states_are_refused_where_the_weights_leave_no_trainer_room(tmp_path):
    online = load_params(RTX, {"extract": {"mode": "online"}})
    level, text = problems(plan_of(online, tmp_path, memory=True))["extract.mode"]
    assert level == "refuse" and "no room for a trainer" in text and "extract.mode: offline" in text
    assert "of 96 GB" in text and "trainer's peak is" in text
    split = load_params(RTX, {"extract": {"mode": "online", "online_gpus": [0, 1, 2, 3]},
                              "target": {"tensor_parallel_size": 4}})
    rows = engine_memory(split, "RTX-PRO-6000", 595e9, REGEN_PROMPT_TOKENS)
    assert online_problem(split, rows, 40.0)[1] == "extract.mode"          # 149 GB of weights per serving GPU
    big = load_params(B300, {"extract": {"mode": "online"}})             # 288 GB leave the trainer its room
    assert online_problem(big, engine_memory(big, "B300", 595e9, REGEN_PROMPT_TOKENS), 65.0) is None
    assert online_problem(load_params(RTX), engine_memory(load_params(RTX), "RTX-PRO-6000", 595e9, 84), 40.0) is None


# ---- the engine settings sm_120 needs --------------------------------------------------------------------
def test_the_attention_backend_and_batch_reach_every_engine():
    rtx, b300 = load_params(RTX), load_params(B300)
    for stage in ("regenerate", "extract", "eval"):
        kwargs = engine_kwargs(rtx, stage, "/models/Kimi-K2.5", 4096)
        assert kwargs["attention_backend"] == "TRITON_MLA" and kwargs["max_num_seqs"] == 128
        assert "attention_backend" not in engine_kwargs(b300, stage, "/models/Kimi-K2.5", 4096)
    flags = engine_flags(engine_kwargs(rtx, "extract", "/models/Kimi-K2.5", 4096))      # the online server's
    assert flags[flags.index("--attention-backend") + 1] == "TRITON_MLA"
    assert flags[flags.index("--max-num-seqs") + 1] == "128"
    with pytest.raises(ParamsError, match="target.attention_backend: 'TRITON' is not one of vLLM 0.32's backends"):
        load_params(RTX, {"target": {"attention_backend": "TRITON"}})
    with pytest.raises(ParamsError, match="target.max_num_seqs: must be >= 1"):
        load_params(RTX, {"target": {"max_num_seqs": 0}})


def test_the_backend_names_are_vllms():
    registry = pytest.importorskip("vllm.v1.attention.backends.registry")
    assert VLLM_ATTENTION_BACKENDS == tuple(sorted(e.name for e in registry.AttentionBackendEnum))


def test_the_nccl_row_warns_on_pcie_before_the_fix(tmp_path):
    old = nccl_check(version=(2, 27, 3), env={})
    assert old.verdict == "warn" and "NCCL_P2P_DISABLE=1" in old.text and "2.31.2" in old.text
    assert nccl_check(version=NCCL_P2P_FIXED, env={}).verdict == "ok"
    assert nccl_check(version=(2, 27, 3), env={"NCCL_P2P_DISABLE": "1"}).verdict == "ok"
    rtx = [c["name"] for c in plan_of(load_params(RTX), tmp_path, "rtx")["preflight"]]
    b300 = [c["name"] for c in plan_of(load_params(B300), tmp_path, "b300")["preflight"]]
    assert "nccl p2p" in rtx and "nccl p2p" not in b300                  # NVLink: no row


# ---- the night and the port -----------------------------------------------------------------------------------
def test_eagle3_plan_of_the_rtx_box_prints_the_night_with_its_bases(capsys):
    """`eagle3 plan --params params/rtx-pro-6000.yaml`: per-stage hours, the cache's disk, the host's memory,
    per-GPU memory of the engines and the trainer, each with its basis; stages 00-05 within one night."""
    code = main(["plan", "--params", RTX])
    out = capsys.readouterr().out
    assert code == (4 if "REFUSED" in out else 0)
    total = float(re.search(r"^stage times +([\d.]+) h for stages 00-05", out, re.M).group(1))
    assert 5 <= total <= 10
    for stage in ("00 research", "01 ngram", "02 data", "03 extract", "04 train", "05 eval"):
        assert re.search(rf"^  {stage} +[\d,.]+ [sh]$", out, re.M), stage
    assert re.search(r"^hidden-state cache +[\d.]+ TB", out, re.M)                          # disk
    assert re.search(r"^held-out set on the host +[\d.]+ GB \[assumed", out, re.M)         # host memory
    engines = out[out.index("\nengine memory per GPU"):]
    for engine in ("regeneration", "extraction", "eval"):
        assert re.search(rf"^  {engine} +[\d.]+ of 96 GB = weights 74.4 .*\[assumed: ", engines, re.M), engine
    assert re.search(r"^memory @ 8 x 2048 +peak [\d.]+ GB per GPU .* of 96 GB", out, re.M)   # the trainer
    assert "[measured (meta)]" in out and "[assumed (formula)]" in out
    assert "train.batch_tokens" not in re.findall(r"^REFUSED +(\S+):", out, re.M)
    assert not {"target.max_num_seqs", "target.gpu_memory_utilization", "extract.mode"} & set(
        re.findall(r"^REFUSED +(\S+):", out, re.M))


def test_b300_inherits_the_existing_box_and_states_only_what_the_bigger_box_changes():
    text = {name: yaml.safe_load((ROOT / "params" / f"{name}.yaml").read_text()) for name in ("b300", "rtx-pro-6000")}
    assert text["b300"]["inherit"] == "rtx-pro-6000.yaml" and text["rtx-pro-6000"]["inherit"] == "local.yaml"
    stated = {f"{section}.{key}" for section, keys in text["b300"].items() if isinstance(keys, dict) for key in keys}
    assert len(stated) <= 16, sorted(stated)
    rtx, b300 = flat_fields(load_params(RTX)), flat_fields(load_params(B300))
    changed = {key for key in rtx if rtx[key] != b300[key]}
    assert changed == {"run_name", "description", "target.gpu_memory_utilization", "target.max_num_batched_tokens",
                       "target.max_num_seqs", "target.attention_backend", "data.num_train", "data.max_length",
                       "data.regen_max_new_tokens", "extract.vllm_max_num_batched_tokens", "train.batch_tokens",
                       "train.gpu_kind", "train.gpu_memory_gb", "eval.suffix_baseline", "scaling.sizes"}
    assert (b300["train.gpu_kind"], b300["train.gpu_memory_gb"], b300["data.num_train"]) == ("B300", 288, 50000)
