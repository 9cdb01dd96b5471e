"""The big box's path on the tiny Kimi-architecture target (tiny_targets.py: DeepSeek-V3 MLA + MoE,
noaux_tc sigmoid routing, yarn rope), end to end on this CPU as params/mini-kimi.yaml ships it, through
the CLI's smoke run (`eagle3 run --smoke --only data,extract,train`): vLLM regenerates the answers,
one vLLM engine extracts both splits (equal to the HF backend's) with 03's fidelity check, 2 torchrun
processes train the drafter with FSDP and a second leg resumes its DCP checkpoint to bit-equal
weights, the export loads, and eagle3lib's speculative decoding with it is lossless at T=0 against
the MoE target.

The module shares that one run (two vLLM engine starts of ~30-90 s each on the 2-core CPU). It runs
as it would on the big box: a sitecustomize shim makes transformers' model loading raise in every
Python process of the run (the CLI, papermill's kernels, vLLM's processes, torchrun's workers) and
gives each the CPU flags of an AMX CPU, so the engines run the attention backend such a CPU gets
(CPU_MLA, asked for explicitly; engine.cpu_attention_backend) whatever this CPU is. 05's reference
decoder loads the target in transformers by design (eagle3lib's decoder; vLLM's eagle3 against an MLA
target is GPU-only: README, 05), so the decoding test below runs after, without the shim."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_online import worst_state_difference
from test_smoke import check_smoke_metrics, run_cli_smoke, write_profile

from eagle3lib import engine
from eagle3lib import evaluate as ev
from eagle3lib import extract as ex
from eagle3lib.cache import HiddenCache
from eagle3lib.data import load_processed
from eagle3lib.decode import greedy_generate
from eagle3lib.export import export_vllm, load_export
from eagle3lib.files import read_json
from eagle3lib.online import HiddenStateServer, OnlineCache
from eagle3lib.params import load_params
from eagle3lib.regenerate import load_results, regen_key
from eagle3lib.smoke import smoke_params
from eagle3lib.target import load_target, load_target_tensors, load_tokenizer
from eagle3lib.tiny_targets import MINI_KIMI_SHAPE, build_mini_kimi

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, smollm2_dir) -> Path:
    return build_mini_kimi(tmp_path_factory.mktemp("models") / "mini-kimi", smollm2_dir)


AMX_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}   # a Sapphire Rapids CPU
NO_HF_LOAD = "transformers model loading is disabled: the big box never loads the target in transformers"
# Put first on PYTHONPATH, this makes every Python child (the CLI, papermill's kernels, vLLM's
# processes, torchrun's workers) refuse transformers' model loading and see an AMX CPU's flags where
# the engine settings are chosen (engine.cpu_flags only: the bf16 choice keeps this CPU's flags), and
# logs each process it patched.
SHIM = """import os
import transformers
import eagle3lib.engine

def _refuse(*args, **kwargs):
    raise RuntimeError({message!r})

for _cls in (transformers.PreTrainedModel, transformers.AutoModel, transformers.AutoModelForCausalLM,
             transformers.AutoModelForImageTextToText):
    _cls.from_pretrained = classmethod(_refuse)
eagle3lib.engine.cpu_flags = lambda: {flags!r}
with open("/proc/self/cmdline") as _c, open({log!r}, "a") as _f:
    _f.write(f"{{os.getpid()}} {{' '.join(_c.read().split(chr(0))[:4])}}\\n")
"""


def refuse_model_loading(mp: pytest.MonkeyPatch, folder: Path) -> Path:
    """transformers' from_pretrained of models raises in children started under `mp` (and the AMX
    flags are seen there); returns the shim's log."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "patched-processes.txt"
    (folder / "sitecustomize.py").write_text(SHIM.format(message=NO_HF_LOAD, flags=AMX_FLAGS, log=str(log)))
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    return log


@pytest.fixture(scope="module")
def run(tmp_path_factory, kimi_dir):
    """`eagle3 run --smoke --only data,extract,train` of the mini-kimi profile (its own target path),
    every process under the shim. -> (smoke Params, metrics.json, the shim's log, the profile, the CLI's stdout).
    The suite's one CLI smoke run (test_smoke.py checks the slices of every profile without running them)."""
    profile = write_profile(tmp_path_factory.mktemp("mk"), "mini-kimi.yaml", target={"path": str(kimi_dir)})
    params = smoke_params(load_params(profile))
    assert params.data.regen_backend == "vllm" and params.extract.backend == "vllm"  # what the profile states
    assert params.extract.fidelity == "vllm" and params.extract.mode == "offline"
    with pytest.MonkeyPatch.context() as mp:
        shim_log = refuse_model_loading(mp, tmp_path_factory.mktemp("shim"))
        r, metrics = run_cli_smoke(profile, only="data,extract,train")
    return params, metrics, shim_log, profile, r.stdout


def test_the_smoke_run_completes_with_two_process_dcp_resume(run):
    """The CLI's smoke run of the profile as shipped: every stage asked for ran beside the plan's
    figures (printed too); the second training leg resumed the first's DCP checkpoint to bit-equal weights."""
    params, metrics, _, _, stdout = run
    check_smoke_metrics(metrics, full_steps=20, fmt="dcp", stages=["data", "extract", "train", "train-resume"])
    assert "plan (full run)" in stdout and "resume: dcp checkpoint of step 10 -> step 20" in stdout
    assert metrics["smoke"]["resume"]["final_weights_equal"] is True                    # offline: bit for bit
    branches = metrics["smoke"]["branches"]
    assert branches["extraction"]["backend"] == "vllm" and branches["regeneration"] == "vllm"
    assert branches["extraction"]["mode"] == "offline" == metrics["extract"]["mode"]
    assert all(list(params.layout().hidden(split).glob("shard-*.safetensors")) for split in ("train", "eval"))


def test_stages_ran_without_transformers_model_loading_and_with_the_amx_backend(run, monkeypatch):
    """The shim was active in every process of the run (regeneration, extraction, both training
    legs) and it refuses a load; the engines ran with attention_backend CPU_MLA, the choice an AMX
    CPU gets, in fp32 (the profile's dtype)."""
    params, _, shim_log, _, _ = run
    patched = shim_log.read_text().splitlines()
    assert sum("eagle3lib.regenerate" in line for line in patched) >= 1, patched
    assert sum("torch.distributed.run" in line for line in patched) == 2, patched     # two legs (torchrun)
    assert sum("-m eagle3lib.train" in line for line in patched) == 4, patched        # of two workers each
    refused = subprocess.run([sys.executable, "-c", "import transformers; "
                              "transformers.AutoModelForCausalLM.from_pretrained('/nowhere')"],
                             env={**os.environ, "PYTHONPATH": str(shim_log.parent)}, capture_output=True, text=True)
    assert refused.returncode != 0 and NO_HF_LOAD in refused.stderr
    log = (params.layout().hidden("train").parent / "vllm-extract-0.log").read_text()
    assert "Using CPU_MLA backend" in log and "AMX_MLA" not in log
    monkeypatch.setattr(engine, "cpu_flags", lambda: AMX_FLAGS)
    kwargs = engine.engine_kwargs(params, "extract", Path(params.target.path), params.data.max_length + 1)
    assert kwargs["attention_backend"] == "CPU_MLA" and kwargs["dtype"] == "float32"


def test_fidelity_check_ran_through_vllm_in_the_extraction_engine(run):
    """03's check on the big box's path: the reference was saved by the extraction's own engine
    start and the check read it; both splits were extracted through ONE engine start
    (extract_splits; the plan counts one), and nothing else started one."""
    params, metrics, shim_log, _, _ = run
    engines = [line for line in shim_log.read_text().splitlines() if "eagle3lib.extract_vllm" in line]
    assert len(engines) == 1, engines
    assert (params.layout().hidden("eval") / ex.FIDELITY_REFERENCE).is_file()
    fidelity = metrics["extract"]
    assert fidelity["fidelity"] == "vllm" and fidelity["fidelity_skip_reason"] is None
    cache = HiddenCache(params.layout().hidden("eval"))
    assert fidelity["checked_tokens"] == sum(cache.lengths[:ex.FIDELITY_SEQUENCES]) > 50
    assert fidelity["decisive_tokens"] >= 10                       # 26 of 65 on the miniature (sharp head)
    # fp32 everywhere: the cached final state through the head picks vLLM's own top-1
    assert fidelity["argmax_agreement"] >= 0.99 and fidelity["decisive_argmax_agreement"] == 1.0, fidelity
    assert fidelity["top1_logprob_abs_error"] < 1e-3, fidelity


def test_vllm_regeneration_equals_the_targets_greedy_answer(run, kimi_dir):
    """The regenerated first answers are the MoE target's own greedy continuation in transformers
    (vLLM fp32 = HF fp32 on MLA + noaux_tc MoE)."""
    params, _, _, _, _ = run
    stats = read_json(params.layout().data / "stats.json")
    assert stats["regen"]["backend"] == "vllm" and stats["train"]["conversations"] == params.data.num_train
    tok = load_tokenizer(kimi_dir)
    target = load_target(kimi_dir, "float32")
    results = [r for r in load_results(params.layout().regen(regen_key(params))).values() if r["status"] == "ok"]
    assert len(results) >= params.data.num_train
    for r in sorted(results, key=lambda r: r["id"])[:3]:
        first = next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")
        text = tok.apply_chat_template(r["messages"][:first], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        greedy, _ = greedy_generate(target, ids, params.data.regen_max_new_tokens, eos_token_id=tok.eos_token_id)
        assert tok.decode(greedy, skip_special_tokens=True) == r["messages"][first]["content"], r["id"]


def test_vllm_extraction_equals_hf_extraction_on_the_kimi_target(run, tmp_path, kimi_dir):
    """Same tokens and masks, states within fp32 tolerance, and the target head's argmax on the
    cached final state agrees with HF's on >= 99 % of decisive tokens (top-1 leads by > 0.5)."""
    params, metrics, _, profile, _ = run
    params_hf = smoke_params(load_params(profile,
                                         overrides={"extract": {"backend": "hf"}, "output_dir": str(tmp_path)}))
    dataset = load_processed(params.run_dir(), "train")
    hf = ex.extract_hidden_states(params_hf, params_hf.layout(), "train", dataset=dataset, progress=False)
    vc, hc = HiddenCache(params.layout().hidden("train")), HiddenCache(params_hf.layout().hidden("train"))
    assert hf["complete"] and hf["bytes_total"] == metrics["extract"]["train_cache_bytes"]
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
    params, _, _, _, _ = run
    dataset = load_processed(params.run_dir(), "train")
    offline = HiddenCache(params.layout().hidden("train"))
    with HiddenStateServer(params, params.layout()) as server:
        online = OnlineCache(dataset, server.client(), server.aux_layers, identity="mini-kimi")
        assert online.aux_layers == offline.aux_layers == [1, 4, 6] and online.lengths == offline.lengths
        worst = worst_state_difference(online, offline)
    assert worst["aux"] < 1e-3 and worst["final"] < 1e-3, worst
    assert not list((params.layout().online / "states").glob("*.safetensors"))      # consumed: deleted


def test_two_process_fsdp_training_on_the_kimi_cache(run):
    """04 as the notebook launches it: torchrun, 2 gloo processes, FSDP, every step logged and the
    loss falling; the resumed leg continued the history from its checkpoint."""
    params, metrics, _, _, _ = run
    summary = json.loads((params.layout().train / "summary.json").read_text())
    assert summary["world_size"] == 2 == metrics["train"]["world_size"] and summary["steps"] == params.train.max_steps
    history = json.loads((params.layout().train / "history.json").read_text())
    assert [r["step"] for r in history] == list(range(1, params.train.max_steps + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert history[-1]["loss"] < history[0]["loss"]


def test_export_decodes_losslessly_against_the_moe_target(run):
    """05's path with the reference decoder: the exported drafter (what vLLM reads) proposes, the
    MLA + MoE target verifies, and every output equals plain greedy decoding in fp32 at T=0."""
    params = run[0]
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
