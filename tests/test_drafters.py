"""Public EAGLE-3 drafters as 05's baseline (drafters.py, evaluate.py, verdict.py, params eval.drafters):
each layout is read right from config.json and the safetensors headers, a drafter made for another
target is refused before any engine naming the field (the run's own drafter too), vLLM on this CPU
loads the Llama layouts and the speculators format and decodes with them losslessly, and 05's modes,
verdict and metrics name the public drafters. Every drafter folder is built by tests/drafter_formats.py
at the ci target's shape (SmolLM2-135M: H 576, 30 layers, vocab 49152) or the mini-kimi shape."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import drafter_formats as F
import pandas as pd
import pytest
import torch

from eagle3lib import evaluate as ev
from eagle3lib import stage_times
from eagle3lib import verdict as V
from eagle3lib.drafters import (
    DrafterFormatError,
    DrafterMismatch,
    check_drafter,
    drafter_state_dict,
    read_drafter,
    target_text_config,
)
from eagle3lib.export import export_vllm
from eagle3lib.model import Eagle3Config, Eagle3Drafter
from eagle3lib.params import ParamsError, load_params
from eagle3lib.tiny_targets import MINI_KIMI_SHAPE
from eagle3lib.vllm_bench import speculative_config

CI_PROFILE = Path(__file__).resolve().parents[1] / "params" / "ci.yaml"
# The mini-kimi target's text config (DeepSeek-V3: MLA + MoE, 8 layers), as config.json states it.
MINI_KIMI = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **MINI_KIMI_SHAPE,
             "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0}}
# Kimi-K2.5 wraps its DeepSeek-V3 backbone (61 layers, H 7168, vocab 163840) in a multimodal config.
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
                            "num_hidden_layers": 61, "vocab_size": 163840}}


@pytest.fixture(scope="module")
def smollm2_shape(smollm2_dir) -> dict:
    return F.target_shape(smollm2_dir)


@pytest.fixture(scope="module")
def formats(tmp_path_factory, smollm2_shape) -> dict:
    """One folder per public layout at the ci target's shape, and the MLA one at mini-kimi's."""
    root = tmp_path_factory.mktemp("drafters")
    return {"draft_vocab": F.llama_draft_vocab(root / "draft_vocab", smollm2_shape),
            "full_vocab": F.llama_full_vocab(root / "full_vocab", smollm2_shape),
            "speculators": F.speculators(root / "speculators", smollm2_shape),
            "mla": F.mla(root / "mla", F.target_shape(MINI_KIMI), aux=[1, 4, 5])}


# ---- (a) each format is read right -----------------------------------------------------------------------


def test_draft_vocab_llama_layout(formats):
    info = read_drafter(formats["draft_vocab"])
    assert (info.format, info.architecture) == ("eagle3-llama", "LlamaForCausalLMEagle3")
    assert (info.hidden_size, info.target_hidden_size, info.vocab_size, info.draft_vocab_size, info.num_layers) == \
        (576, 576, 49152, 1024, 1)
    assert info.aux_layer_ids == info.aux_layer_ids_raw == (2, 15, 27)
    assert info.aux_convention == "unknown" and info.aux_source == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert (info.has_d2t, info.has_t2d, info.has_lm_head, info.has_embed_tokens) == (True, True, True, False)
    assert info.norm_before_residual is False                          # this layout's default
    assert info.tensors["d2t"] == ("I64", (1024,)) and info.tensors["t2d"] == ("BOOL", (49152,))
    assert info.tensors["fc.weight"][1] == (576, 3 * 576)


def test_full_vocab_llama_layout(formats):
    info = read_drafter(formats["full_vocab"])
    assert info.format == "eagle3-llama" and info.draft_vocab_size == info.vocab_size == 49152
    assert (info.has_d2t, info.has_t2d, info.has_embed_tokens) == (False, False, True)
    assert info.rope_type == "yarn"
    prefixes = {n.split(".")[0] for n in info.tensors}
    assert "layers" in prefixes and "midlayer" not in prefixes


def test_speculators_format(formats):
    info = read_drafter(formats["speculators"])
    assert (info.format, info.architecture) == ("speculators", "Eagle3Speculator")
    assert info.norm_before_residual is True                           # the speculators default, not written
    assert info.aux_convention == "vllm" and info.aux_layer_ids == (2, 15, 27)
    assert info.verifier == "HuggingFaceTB/SmolLM2-135M-Instruct" and info.draft_vocab_size == 1024


def test_mla_format_and_its_aux_note(formats):
    info = read_drafter(formats["mla"])
    assert info.format == "eagle3-mla" and info.is_mla and info.architecture == "Eagle3DeepseekV2ForCausalLM"
    assert (info.hidden_size, info.vocab_size, info.draft_vocab_size) == (256, 49152, 1024)
    assert info.aux_layer_ids_raw == (1, 4, 5) and info.aux_convention == "unknown"
    assert "[2, 5, 6]" in info.notes[0]                                # the output-naming hint: one layer on


def test_the_labs_own_folders_state_vllms_convention(tmp_path, smollm2_dir, smollm2_shape):
    final = read_drafter(F.lab_final(tmp_path / "final", smollm2_shape))
    assert (final.format, final.architecture, final.aux_convention, final.made_by_lab) == \
        ("eagle3lab", "Eagle3Drafter", "vllm", True)
    cfg = Eagle3Config.from_target_config(json.loads((smollm2_dir / "config.json").read_text()), 512, [3, 10, 20],
                                          norm_before_residual=False)
    export = export_vllm(Eagle3Drafter(cfg), tmp_path / "export", smollm2_dir, layout="eagle3", k=2)
    info = read_drafter(export)                                        # vLLM's layout, but the sidecar says: ours
    assert (info.format, info.aux_convention, info.aux_layer_ids) == ("eagle3-llama", "vllm", (3, 10, 20))


def test_no_ids_means_vllms_default(tmp_path, smollm2_shape):
    folder = F.llama_draft_vocab(tmp_path / "d", smollm2_shape)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eagle_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    info = read_drafter(folder)
    assert info.aux_layer_ids is None and info.aux_convention == "default"


def test_pickles_are_never_opened_and_contradictions_refused(tmp_path, smollm2_shape):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(F.llama_config(smollm2_shape, None)))
    (folder / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is a pickle"):
        read_drafter(folder)
    bad = F.llama_draft_vocab(tmp_path / "bad", smollm2_shape)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": 2048}))
    with pytest.raises(DrafterFormatError, match=r"lm_head.weight is \[1024, 576\]"):
        read_drafter(bad)
    with pytest.raises(DrafterFormatError, match="no EAGLE-3 drafter format"):
        read_drafter(F.write(tmp_path / "plain_llama", {"architectures": ["LlamaForCausalLM"]}, {}))


@pytest.mark.parametrize("name", ["draft_vocab", "full_vocab", "speculators"])
def test_state_dict_loads_into_an_eagle3_drafter(formats, smollm2_dir, name):
    """drafter_state_dict's names are Eagle3Drafter's: a drafter of the same shapes takes every tensor."""
    state, d2t, t2d, info = drafter_state_dict(formats[name])
    cfg = Eagle3Config.from_target_config(json.loads((smollm2_dir / "config.json").read_text()),
                                          info.draft_vocab_size, list(info.aux_layer_ids))
    model = Eagle3Drafter(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"embed_tokens.weight", "d2t", "t2d"}
    assert torch.equal(model.midlayer.self_attn.q_proj.weight, state["midlayer.self_attn.q_proj.weight"])
    assert (d2t is None) == (name == "full_vocab") and (t2d is None) == (name == "full_vocab")
    if d2t is not None:
        model.set_vocab(d2t, t2d)


def test_state_dict_refuses_an_mla_drafter(formats):
    with pytest.raises(DrafterFormatError, match="MLA"):
        drafter_state_dict(formats["mla"])


# ---- (b) a drafter made for another target is refused, naming the field --------------------------------


def test_the_ci_targets_own_drafters_pass(formats, smollm2_dir):
    for name in ("draft_vocab", "full_vocab", "speculators"):
        check_drafter(read_drafter(formats[name]), smollm2_dir, device="cpu")


def refusal(info, target, **kw) -> str:
    with pytest.raises(DrafterMismatch) as e:
        check_drafter(info, target, **kw)
    assert info.path in str(e.value)                                   # names the drafter folder
    return str(e.value)


def test_hidden_size_of_another_target(tmp_path, smollm2_dir):
    mini = F.target_shape(MINI_KIMI)
    text = refusal(read_drafter(F.llama_draft_vocab(tmp_path / "d", mini, aux=[2, 4, 5])), smollm2_dir, device="cpu")
    assert "target_hidden_size" in text and "the drafter has 256, the target has 576" in text
    assert "hidden_size: the drafter has 256" in text                  # no embed_tokens: vLLM shares the target's


def test_vocab_of_another_tokenizer(tmp_path, smollm2_dir, smollm2_shape):
    info = read_drafter(F.llama_draft_vocab(tmp_path / "d", smollm2_shape, vocab_size=32000))
    assert "vocab_size: the drafter has 32000, the target has 49152" in refusal(info, smollm2_dir, device="cpu")


def test_aux_ids_past_the_targets_layers(tmp_path, smollm2_dir, smollm2_shape):
    for build in (F.llama_draft_vocab, F.speculators):
        text = refusal(read_drafter(build(tmp_path / build.__name__, smollm2_shape, aux=[2, 15, 99])), smollm2_dir,
                       device="cpu")
        assert "aux layer ids: the drafter has [2, 15, 99], the target has 30 layers" in text


def test_draft_vocab_larger_than_the_vocab(formats, smollm2_dir):
    info = dataclasses.replace(read_drafter(formats["draft_vocab"]), draft_vocab_size=60000)
    assert "draft_vocab_size: the drafter has 60000" in refusal(info, smollm2_dir, device="cpu")


def test_vocabulary_maps_vllm_would_get_wrong(smollm2_dir, formats):
    info = read_drafter(formats["draft_vocab"])
    assert "d2t: the drafter has no d2t" in refusal(dataclasses.replace(info, has_d2t=False), smollm2_dir, device="cpu")
    full = read_drafter(formats["full_vocab"])
    assert "d2t: the drafter has a d2t tensor" in refusal(dataclasses.replace(full, has_d2t=True), smollm2_dir,
                                                          device="cpu")


def test_mla_drafters_run_on_cuda_only(formats):
    info = read_drafter(formats["mla"])
    assert "CUDA only" in refusal(info, MINI_KIMI, device="cpu")
    check_drafter(info, MINI_KIMI, device="cuda")
    wrapped = {"architectures": ["MiniKimiForConditionalGeneration"], "text_config": MINI_KIMI}
    check_drafter(info, wrapped, device="cuda")                        # the multimodal wrapper's text_config


def test_aux_id_zero_is_an_embedding_on_llama_and_nothing_on_deepseek(formats, smollm2_dir):
    info = dataclasses.replace(read_drafter(formats["mla"]), aux_layer_ids=(0, 4, 5))
    assert "vLLM counts 1..8" in refusal(info, MINI_KIMI, device="cuda")
    check_drafter(dataclasses.replace(read_drafter(formats["draft_vocab"]), aux_layer_ids=(0, 15, 30)), smollm2_dir,
                  device="cpu")                                         # 0..N on a Llama target


def test_kimi_k25s_wrapper_and_a_kimi_k2_drafter(formats):
    """A drafter at AQ-MedAI/Kimi-K2-Instruct-eagle3's sizes fits Kimi-K2.5's text_config, not the ci target."""
    info = dataclasses.replace(read_drafter(formats["draft_vocab"]), hidden_size=7168, target_hidden_size=7168,
                               vocab_size=163840, draft_vocab_size=32000, aux_layer_ids=(2, 30, 58))
    assert target_text_config(KIMI_K25)[0]["num_hidden_layers"] == 61
    check_drafter(info, KIMI_K25, device="cpu")
    text = refusal(dataclasses.replace(info, aux_layer_ids=(2, 30, 62)), KIMI_K25, device="cpu")
    assert "aux layer ids: the drafter has [2, 30, 62], the target has 61 layers" in text


# ---- (e) the run's own drafter, and 05's order: checks before any export, target load or engine ----------


def test_own_drafter_with_aux_99_is_refused(tmp_path, smollm2_dir, smollm2_shape):
    params = load_params(CI_PROFILE)
    final = F.lab_final(tmp_path / "train" / "final", smollm2_shape, aux=[2, 15, 99])
    with pytest.raises(DrafterMismatch, match="aux layer ids") as e:
        ev.check_eval_drafters(params, final, smollm2_dir, device="cpu")
    assert "[2, 15, 99]" in str(e.value) and "30 layers" in str(e.value)
    assert "extract.aux_layers" in str(e.value)                        # and not the layers it was extracted at
    ok = F.lab_final(tmp_path / "ok", smollm2_shape, aux=params.aux_layer_ids())
    assert ev.check_eval_drafters(params, ok, smollm2_dir, device="cpu") == {}


def test_public_drafters_are_read_and_checked_with_the_run(tmp_path, formats, smollm2_dir, smollm2_shape):
    final = F.lab_final(tmp_path / "final", smollm2_shape)
    params = load_params(CI_PROFILE, {"eval": {"drafters": [{"name": "aq", "path": str(formats["draft_vocab"])},
                                                           {"name": "spec", "path": str(formats["speculators"])}]}})
    infos = ev.check_eval_drafters(params, final, smollm2_dir, device="cpu")
    assert list(infos) == ["aq", "spec"] and infos["spec"].format == "speculators"
    assert list(ev.drafters_table(infos)["name"]) == ["aq", "spec"]
    bad = F.speculators(tmp_path / "bad", smollm2_shape, aux=[2, 15, 99])
    with pytest.raises(DrafterMismatch, match="aux layer ids"):
        ev.check_eval_drafters(load_params(CI_PROFILE, {"eval": {"drafters": [{"name": "b", "path": str(bad)}]}}),
                               final, smollm2_dir, device="cpu")
    gone = load_params(CI_PROFILE, {"eval": {"drafters": [{"name": "g", "path": str(tmp_path / "nowhere")}]}})
    with pytest.raises(FileNotFoundError, match=r"eval.drafters\[0\].path"):
        ev.check_eval_drafters(gone, final, smollm2_dir, device="cpu")


def code_of(notebook: str) -> str:
    cells = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / notebook).read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_05_checks_the_drafters_before_any_export_target_load_or_engine():
    code = code_of("05_eval.ipynb")
    check = code.index("ev.check_eval_drafters(")
    for later in ("export_vllm(", "load_eval_setup(", "run_decoder_eval(", "run_vllm_eval("):
        assert check < code.index(later), f"05 calls {later} before check_eval_drafters"
    assert "drafters=public_drafters" in code and "ev.drafters_metrics(" in code


# ---- (d) 05's modes, plan, verdict and metrics name the public drafters ----------------------------------


def test_profile_key_eval_drafters(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text(f"inherit: {CI_PROFILE}\neval:\n  drafters:\n    - {{name: aq, path: models/aq}}\n")
    p = load_params(profile)
    assert p.eval.drafters == [{"name": "aq", "path": str((tmp_path / "models" / "aq").resolve())}]   # profile's folder
    assert load_params(CI_PROFILE).eval.drafters == []
    assert stage_times.eval_modes(p, "eval")[-1] == f"drafter-aq_k{p.eval.k}"            # the plan counts its engine
    for drafters, key in [([{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}], "given twice"),
                          ([{"name": "a b", "path": "/x"}], r"eval.drafters\[0\].name"),
                          ([{"name": "a"}], r"eval.drafters\[0\]: needs exactly the keys name, path"),
                          ([{"name": "a", "path": ""}], r"eval.drafters\[0\].path"),
                          (["/x"], r"eval.drafters\[0\]: expected a mapping")]:
        with pytest.raises(ParamsError, match=key):
            load_params(CI_PROFILE, {"eval": {"drafters": drafters}})
    with pytest.raises(ParamsError, match="eval.use_vllm"):
        load_params(CI_PROFILE, {"eval": {"use_vllm": False, "drafters": [{"name": "a", "path": "/x"}]}})


def test_05s_vllm_modes_include_the_public_drafters(formats):
    infos = {"aq": read_drafter(formats["draft_vocab"]), "full": read_drafter(formats["full_vocab"])}
    modes = ev.vllm_modes([(3, 1, 4)], "/x/export", 3, drafters=infos)
    assert [m.name for m in modes] == ["plain", "ngram_k3_n1-4", "eagle3_k3", "drafter-aq_k3", "drafter-full_k3"]
    assert speculative_config(modes[3]) == {"method": "eagle3", "model": str(formats["draft_vocab"]),
                                            "num_speculative_tokens": 3}
    assert ev.drafter_modes(infos, 3) == {"aq": "drafter-aq_k3", "full": "drafter-full_k3"}


def vllm_table() -> pd.DataFrame:
    """05's vLLM summary: the trained drafter beats public drafter 'aq' on both counts, loses to 'big'."""
    rows = [("plain", 0, 20.0, 1.0, 0), ("ngram_k3_n1-4", 3, 24.0, 1.6, 30), ("eagle3_k3", 3, 30.0, 2.1, 55),
            ("drafter-aq_k3", 3, 25.0, 1.8, 40), ("drafter-big_k3", 3, 36.0, 2.6, 80)]
    return pd.DataFrame([{"method": m, "k": k, "tokens_per_s": t, "speedup": t / 20.0, "acceptance_length": a,
                          "accepted": acc, "new_tokens": 64, "per_position_acceptance": [0.5, 0.3, 0.1][:k],
                          "same_output_as_plain": "2/2"} for m, k, t, a, acc in rows])


def test_verdict_says_whether_the_trained_drafter_beats_each_public_one():
    text = V.eagle3_verdict(ev.empty_summary(), vllm_table(), eagle3="eagle3_k3", ngram="ngram_k3_n1-4",
                            drafters={"aq": "drafter-aq_k3", "big": "drafter-big_k3", "gone": "drafter-gone_k3"})
    assert ("the trained drafter (eagle3_k3) beats public drafter aq (drafter-aq_k3) in decode tokens/s (1.20x its "
            "25.0) and beats it in acceptance length (2.10 vs 1.80)") in text
    assert "loses to public drafter big (drafter-big_k3) in decode tokens/s (0.83x" in text
    assert "public drafter gone (drafter-gone_k3) not compared: it has no vLLM row" in text


def test_metrics_keep_the_eval_section_and_add_drafters(tmp_path, formats):
    infos = {"aq": read_drafter(formats["draft_vocab"]), "big": read_drafter(formats["speculators"])}
    section = ev.drafters_metrics(vllm_table(), infos, "eagle3_k3", 3)
    aq = section["aq"]
    assert aq["mode"] == "drafter-aq_k3" and aq["measured"] and aq["format"] == "eagle3-llama"
    assert aq["aux_layer_ids"] == [2, 15, 27] and aq["acceptance_length"] == 1.8
    assert aq["trained_vs_public"]["speed"] == "beats" and aq["trained_vs_public"]["acceptance"] == "beats"
    assert section["big"]["trained_vs_public"]["speed"] == "loses to" and "loses to" in section["big"]["verdict"]
    json.dumps(section)
    setup = ev.EvalSetup(tmp_path, None, None, [{"id": "a"}], [], 0, [], reference_skip="too big")
    kw = dict(eagle3="eagle3_k3", ngram="ngram_k3_n1-4", max_new_tokens=16)
    without = ev.eval_metrics(ev.empty_summary(), vllm_table(), setup, tmp_path, **kw)
    with_drafters = ev.eval_metrics(ev.empty_summary(), vllm_table(), setup, tmp_path, drafters=section, **kw)
    assert "drafters" not in without and with_drafters["drafters"] == section
    assert {k: v for k, v in with_drafters.items() if k not in ("drafters", "verdict")} == \
        {k: v for k, v in without.items() if k != "verdict"}
    assert with_drafters["verdict"].startswith(without["verdict"]) and "public drafter aq" in with_drafters["verdict"]


# ---- (c) vLLM on this CPU loads the public layouts and decodes losslessly ---------------------------------


@pytest.mark.vllm
def test_vllm_loads_the_public_layouts_and_decodes_losslessly(formats, smollm2_dir, tmp_path):
    """Random drafters (acceptance ~0), fp32, T=0: every mode's tokens equal the target's greedy
    decoding (transformers, fp32). One vLLM child, one engine per layout, 2 prompts x 12 tokens."""
    from eagle3lib.decode import greedy_generate
    from eagle3lib.target import load_target, load_tokenizer
    from eagle3lib.vllm_bench import BenchSpec, mode, run_vllm
    tok = load_tokenizer(smollm2_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in ("Write a short poem about the sea.", "List three uses of Python.")]
    target = load_target(smollm2_dir, "float32")
    greedy = [greedy_generate(target, p, 12)[0] for p in prompts]
    names = ("draft_vocab", "full_vocab", "speculators")
    spec = BenchSpec(target=str(smollm2_dir), dtype="float32", prompts=prompts, max_new_tokens=12,
                     modes=[mode("eagle3", 2, name=n, model=str(formats[n])) for n in names])
    result = {m["name"]: m for m in run_vllm(spec, workdir=tmp_path / "vllm", timeout=600)["modes"]}
    for n in names:
        assert result[n]["num_drafts"] > 0, f"{n}: vLLM made no drafts (did the drafter load?)"
        assert result[n]["outputs"] == greedy, f"{n}: vLLM's output differs from greedy decoding"
