"""The big box's path on the tiny Kimi-architecture target (tiny_targets.py: DeepSeek-V3 MLA + MoE,
noaux_tc sigmoid routing, yarn rope), end to end on this CPU, stage by stage as params/mini-kimi.yaml
runs it: vLLM regenerates the answers, vLLM extracts the hidden states (equal to the HF backend's),
2 torchrun processes train the drafter with FSDP, the export loads, and eagle3lib's speculative
decoding with it is lossless at T=0 against the MoE target.

The module shares one run (two vLLM engine starts of ~30-90 s each on the 2-core CPU). Stages 02-04
(regeneration, extraction with 03's fidelity check, training) run as they would on the big box:
with transformers' model loading made to raise, in this process and in every child (vLLM, torchrun)
through a sitecustomize shim, and with the attention backend an AMX CPU gets (CPU_MLA, asked for
explicitly; engine.cpu_attention_backend) whatever this CPU is. 05's reference decoder loads the
target in transformers by design (eagle3lib's decoder; vLLM's eagle3 against an MLA target is
GPU-only: README, 05), so the decoding test below runs after, without the shim."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from test_online import worst_state_difference

from eagle3lib import engine
from eagle3lib import evaluate as ev
from eagle3lib import extract as ex
from eagle3lib.cache import HiddenCache, check_cache
from eagle3lib.data import load_processed, prepare_data
from eagle3lib.decode import greedy_generate
from eagle3lib.export import export_vllm, load_export
from eagle3lib.extract import extract_splits
from eagle3lib.files import read_json
from eagle3lib.online import HiddenStateServer, OnlineCache
from eagle3lib.params import load_params
from eagle3lib.regenerate import load_results, regen_key
from eagle3lib.target import load_target, load_target_tensors, load_tokenizer
from eagle3lib.tiny_targets import MINI_KIMI_SHAPE, build_mini_kimi
from eagle3lib.train import torchrun_command

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {"data": {"num_train": 8, "num_eval": 3, "regen_max_new_tokens": 12},
             "train": {"max_steps": 6, "checkpoint_every": 3},
             "eval": {"num_prompts": 2, "max_new_tokens": 12}}


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, smollm2_dir) -> Path:
    return build_mini_kimi(tmp_path_factory.mktemp("models") / "mini-kimi", smollm2_dir)


def write_params(root: Path, kimi_dir: Path, extra: dict) -> Path:
    """A profile inheriting params/mini-kimi.yaml with the target built here and a smaller run."""
    params = {"inherit": str(ROOT / "params" / "mini-kimi.yaml"), "run_name": "mk", "output_dir": str(root),
              "target": {"path": str(kimi_dir)}}
    for section, values in {**OVERRIDES, **extra}.items():
        params[section] = {**params.get(section, {}), **values}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


AMX_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}   # a Sapphire Rapids CPU
NO_HF_LOAD = "transformers model loading is disabled: the big box never loads the target in transformers"
# Put first on PYTHONPATH, this makes every Python child (vLLM's processes, torchrun's workers)
# refuse transformers' model loading, and logs each process it patched.
SHIM = """import os
import transformers

def _refuse(*args, **kwargs):
    raise RuntimeError({message!r})

for _cls in (transformers.PreTrainedModel, transformers.AutoModel, transformers.AutoModelForCausalLM,
             transformers.AutoModelForImageTextToText):
    _cls.from_pretrained = classmethod(_refuse)
with open("/proc/self/cmdline") as _c, open({log!r}, "a") as _f:
    _f.write(f"{{os.getpid()}} {{' '.join(_c.read().split(chr(0))[:4])}}\\n")
"""


def refuse_model_loading(mp: pytest.MonkeyPatch, folder: Path) -> Path:
    """transformers' from_pretrained of models raises here and in children; returns the shim's log."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "patched-processes.txt"
    (folder / "sitecustomize.py").write_text(SHIM.format(message=NO_HF_LOAD, log=str(log)))
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))

    def refuse(*args, **kwargs):
        raise RuntimeError(NO_HF_LOAD)
    for cls in (transformers.PreTrainedModel, transformers.AutoModel, transformers.AutoModelForCausalLM,
                transformers.AutoModelForImageTextToText):
        mp.setattr(cls, "from_pretrained", classmethod(refuse))
    return log


@pytest.fixture(scope="module")
def run(tmp_path_factory, kimi_dir):
    """Data (vLLM regeneration), extraction (vLLM backend) and 03's fidelity check of the mini-kimi
    profile, without any transformers model load and with the AMX CPU's attention backend."""
    path = write_params(tmp_path_factory.mktemp("mk"), kimi_dir, {})
    params = load_params(path)
    assert params.data.regen_backend == "vllm" and params.extract.backend == "vllm"  # what the profile states
    assert params.extract.fidelity == "vllm"
    with pytest.MonkeyPatch.context() as mp:
        shim_log = refuse_model_loading(mp, tmp_path_factory.mktemp("shim"))
        mp.setattr(engine, "cpu_flags", lambda: AMX_FLAGS)
        kwargs = engine.engine_kwargs(params, "extract", kimi_dir, params.data.max_length + 1)
        stats = prepare_data(params, params.run_dir(), progress=False)
        starts = []
        open_backend = ex.BACKENDS["vllm"]
        mp.setitem(ex.BACKENDS, "vllm", lambda *a, **kw: starts.append(1) or open_backend(*a, **kw))
        extracted = extract_splits(params, params.layout(), ("train", "eval"), progress=False)
        saved_reference = (params.layout().hidden("eval") / ex.FIDELITY_REFERENCE).is_file()
        mp.setattr(ex, "open_vllm_backend", None)       # the check must not start another engine
        fidelity = ex.check_fidelity(params, params.layout(), check_cache(params, params.layout(), "eval"))
    return path, params, stats, extracted, {"engine": kwargs, "shim_log": shim_log, "fidelity": fidelity,
                                            "saved_reference": saved_reference, "extraction_engines": len(starts)}


def test_stages_ran_without_transformers_model_loading_and_with_the_amx_backend(run):
    """The shim was active in vLLM's processes (regeneration and extraction) and the patch refuses a
    load; the engines ran with attention_backend CPU_MLA, the choice an AMX CPU gets."""
    _, params, _, _, checks = run
    assert checks["engine"]["attention_backend"] == "CPU_MLA" and checks["engine"]["dtype"] == "float32"
    patched = checks["shim_log"].read_text().splitlines()
    assert sum("eagle3lib.extract_vllm" in line for line in patched) >= 1, patched   # one engine, both splits
    assert sum("eagle3lib.regenerate" in line for line in patched) >= 1, patched
    refused = subprocess.run([sys.executable, "-c", "import transformers; "
                              "transformers.AutoModelForCausalLM.from_pretrained('/nowhere')"],
                             env={**os.environ, "PYTHONPATH": str(checks["shim_log"].parent)},
                             capture_output=True, text=True)
    assert refused.returncode != 0 and NO_HF_LOAD in refused.stderr
    log = (params.layout().hidden("train").parent / "vllm-extract-0.log").read_text()
    assert "Using CPU_MLA backend" in log and "AMX_MLA" not in log


def test_fidelity_check_ran_through_vllm_in_the_extraction_engine(run):
    """03's check on the big box's path: the reference was saved by the extraction's own engine
    start, the check read it (opening another engine would fail here), metrics.json records it.
    Both splits were extracted through ONE engine start (extract_splits; the plan counts one)."""
    _, params, _, extracted, checks = run
    assert checks["extraction_engines"] == 1 and set(extracted) == {"train", "eval"}
    assert all(s["shards_written"] > 0 for s in extracted.values())
    fidelity = checks["fidelity"]
    assert checks["saved_reference"]
    assert fidelity["fidelity"] == "vllm" and fidelity["fidelity_skip_reason"] is None
    cache = HiddenCache(params.layout().hidden("eval"))
    assert fidelity["checked_tokens"] == sum(cache.lengths[:ex.FIDELITY_SEQUENCES]) > 50
    assert fidelity["decisive_tokens"] >= 10                       # 26 of 65 on the miniature (sharp head)
    # fp32 everywhere: the cached final state through the head picks vLLM's own top-1
    assert fidelity["argmax_agreement"] >= 0.99 and fidelity["decisive_argmax_agreement"] == 1.0, fidelity
    assert fidelity["top1_logprob_abs_error"] < 1e-3, fidelity
    recorded = read_json(params.layout().metrics)["extract"]
    assert recorded["decisive_argmax_agreement"] == fidelity["decisive_argmax_agreement"]


def test_vllm_regeneration_equals_the_targets_greedy_answer(run, kimi_dir):
    """The regenerated first answers are the MoE target's own greedy continuation in transformers
    (vLLM fp32 = HF fp32 on MLA + noaux_tc MoE)."""
    _, params, stats, _, _ = run
    assert stats.regen.backend == "vllm" and stats.train.conversations == OVERRIDES["data"]["num_train"]
    tok = load_tokenizer(kimi_dir)
    target = load_target(kimi_dir, "float32")
    results = [r for r in load_results(params.layout().regen(regen_key(params))).values() if r["status"] == "ok"]
    assert len(results) >= OVERRIDES["data"]["num_train"]
    for r in sorted(results, key=lambda r: r["id"])[:3]:
        first = next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")
        text = tok.apply_chat_template(r["messages"][:first], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        greedy, _ = greedy_generate(target, ids, OVERRIDES["data"]["regen_max_new_tokens"],
                                    eos_token_id=tok.eos_token_id)
        assert tok.decode(greedy, skip_special_tokens=True) == r["messages"][first]["content"], r["id"]


def test_vllm_extraction_equals_hf_extraction_on_the_kimi_target(run, tmp_path, kimi_dir):
    """Same tokens and masks, states within fp32 tolerance, and the target head's argmax on the
    cached final state agrees with HF's on >= 99 % of decisive tokens (top-1 leads by > 0.5)."""
    path, params, _, extracted, _ = run
    params_hf = load_params(path, overrides={"extract": {"backend": "hf"}, "output_dir": str(tmp_path)})
    dataset = load_processed(params.run_dir(), "train")
    hf = ex.extract_hidden_states(params_hf, params_hf.layout(), "train", dataset=dataset, progress=False)
    assert extracted["train"]["complete"] and hf["complete"]
    assert extracted["train"]["bytes_total"] == hf["bytes_total"]
    vc, hc = HiddenCache(params.layout().hidden("train")), HiddenCache(params_hf.layout().hidden("train"))
    assert vc.aux_layers == hc.aux_layers == [1, 4, 6] and len(vc) == len(hc) == len(dataset)
    head = load_target_tensors(kimi_dir)["lm_head"].float()                          # [V, H]
    worst = {"aux": 0.0, "final": 0.0}
    agree = decisive = 0
    for i in range(len(hc)):
        v, h = vc.get(i), hc.get(i)
        assert torch.equal(v["input_ids"], h["input_ids"]) and torch.equal(v["loss_mask"], h["loss_mask"])
        assert v["final"].shape == (len(v["input_ids"]), MINI_KIMI_SHAPE["hidden_size"])
        for name in worst:
            worst[name] = max(worst[name], float((v[name] - h[name]).norm() / h[name].norm()))
        top2 = (h["final"].float() @ head.T).topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > 0.5
        got = (v["final"].float() @ head.T).argmax(-1)
        decisive += int(clear.sum())
        agree += int(((got == top2.indices[:, 0]) & clear).sum())
    assert worst["aux"] < 1e-3 and worst["final"] < 1e-3, worst        # fp32 both sides (bf16 would be ~1e-2)
    assert decisive > 100 and agree / decisive >= 0.99, (agree, decisive)


def test_online_states_equal_the_offline_cache_on_the_kimi_target(run):
    """extract.mode online on the big box's architecture: vLLM's server (the lab's own start, the
    hidden-states connector) serves the states of the offline vLLM cache, within the backends'
    fp32 tolerance above; ids and masks equal."""
    _, params, _, _, _ = run
    dataset = load_processed(params.run_dir(), "train")
    offline = HiddenCache(params.layout().hidden("train"))
    with HiddenStateServer(params, params.layout()) as server:
        online = OnlineCache(dataset, server.client(), server.aux_layers, identity="mini-kimi")
        assert online.aux_layers == offline.aux_layers == [1, 4, 6] and online.lengths == offline.lengths
        worst = worst_state_difference(online, offline)
    assert worst["aux"] < 1e-3 and worst["final"] < 1e-3, worst
    assert not list((params.layout().online / "states").glob("*.safetensors"))      # consumed: deleted


@pytest.fixture(scope="module")
def trained(run):
    """04's training as the notebook launches it: torchrun, 2 gloo processes, FSDP; transformers'
    model loading refused in every process."""
    path, params, _, _, _ = run
    cmd = torchrun_command(path, None, 2) + ["--no-progress"]
    with pytest.MonkeyPatch.context() as mp:
        shim_log = refuse_model_loading(mp, params.run_dir().parent / "shim-train")
        res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                             timeout=600, cwd=ROOT)
    assert res.returncode == 0, f"{cmd}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert len(shim_log.read_text().splitlines()) >= 3      # torchrun and its two workers were patched
    return json.loads((params.layout().train / "summary.json").read_text())


def test_two_process_fsdp_training_on_the_kimi_cache(trained, run):
    params = run[1]
    assert trained["world_size"] == 2 and trained["steps"] == OVERRIDES["train"]["max_steps"]
    history = json.loads((params.layout().train / "history.json").read_text())
    assert [r["step"] for r in history] == list(range(1, OVERRIDES["train"]["max_steps"] + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert history[-1]["loss"] < history[0]["loss"]


def test_export_decodes_losslessly_against_the_moe_target(trained, run):
    """05's path with the reference decoder: the exported drafter (what vLLM reads) proposes, the
    MLA + MoE target verifies, and every output equals plain greedy decoding in fp32 at T=0."""
    params = run[1]
    layout = params.layout()
    setup = ev.load_eval_setup(params, params.run_dir())
    assert setup.reference_skip is None and len(setup.decoder_prompts) >= 1
    export_dir = export_vllm(ev.trained_drafter_dir(layout), layout.export, setup.target_dir, layout="speculators", k=3)
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    drafter = load_export(export_dir, setup.target_dir)
    methods = [ev.eagle3_method(drafter, 3), ev.ngram_method(3, 1, 3)]
    per_prompt, outputs = ev.run_decoder_eval(setup.target, setup.decoder_prompts, methods, 12,
                                              eos_token_id=setup.eos, progress=False)
    assert "NOT" not in ev.check_lossless(per_prompt, params)
    eagle = per_prompt[per_prompt["method"] == "eagle3_k3"]
    assert eagle["lossless"].all() and len(eagle) == len(setup.decoder_prompts)
    assert outputs["eagle3_k3"] == outputs[ev.PLAIN] and all(len(o) > 0 for o in outputs[ev.PLAIN])
