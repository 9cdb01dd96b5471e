"""The tiny Kimi-architecture target (tiny_targets.py) and the HF extraction backend on it: MLA + MoE
states equal a direct forward, the Kimi-K2.5-like wrapper gives the same cache as the bare causal
LM, and a capture that would cache logits is refused before anything is written."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from eagle3lib import extract as ex
from eagle3lib.cache import CacheError, HiddenCache
from eagle3lib.params import load_params
from eagle3lib.target import load_target, load_target_tensors
from eagle3lib.tiny_targets import MINI_KIMI_SHAPE, build_mini_kimi

AUX = [1, 4, 6]                     # layer 1 is the first MoE layer (layer 0 is dense)
LENGTHS = [23, 7, 41, 0, 15, 30]    # one empty row


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, smollm2_dir) -> Path:
    return build_mini_kimi(tmp_path_factory.mktemp("kimi") / "mini-kimi", smollm2_dir)


@pytest.fixture(scope="module")
def wrapped_dir(tmp_path_factory, smollm2_dir) -> Path:
    return build_mini_kimi(tmp_path_factory.mktemp("kimi") / "mini-kimi-wrapped", smollm2_dir, wrapped=True)


@pytest.fixture(scope="module")
def kimi_model(kimi_dir):
    return load_target(kimi_dir, "float32")


@pytest.fixture(scope="module")
def wrapped_model(wrapped_dir):
    return load_target(wrapped_dir, "float32", trust_remote_code=True)


@pytest.fixture(scope="module")
def dataset():
    from datasets import Dataset
    rng = random.Random(5)
    return Dataset.from_dict({
        "conv_id": [f"c{i}" for i in range(len(LENGTHS))],
        "input_ids": [[rng.randrange(MINI_KIMI_SHAPE["vocab_size"]) for _ in range(n)] for n in LENGTHS],
        "loss_mask": [[rng.randint(0, 1) for _ in range(n)] for n in LENGTHS]})


def make_params(target_dir, out_dir, trust_remote_code=False):
    over = {"target": {"path": str(target_dir), "dtype": "float32", "trust_remote_code": trust_remote_code},
            "output_dir": str(out_dir), "data": {"max_length": 48},
            "extract": {"aux_layers": AUX, "dtype": "float32", "batch_tokens": 48, "shard_tokens": 60}}
    return load_params("params/ci.yaml", overrides=over)


def extract(target_dir, out_dir, dataset, model, trust_remote_code=False) -> HiddenCache:
    params = make_params(target_dir, out_dir, trust_remote_code)
    summary = ex.extract_hidden_states(params, params.run_dir(), "train", model=model, dataset=dataset, progress=False)
    assert summary["complete"] and summary["hidden_size"] == MINI_KIMI_SHAPE["hidden_size"]
    return HiddenCache(params.layout().hidden("train"))


# ---- the target itself ------------------------------------------------------------------------
def test_mini_kimi_has_the_kimi_features_vllm_reads(kimi_dir, wrapped_dir, smollm2_dir):
    cfg = json.loads((kimi_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert (cfg["topk_method"], cfg["scoring_func"], cfg["num_nextn_predict_layers"]) == ("noaux_tc", "sigmoid", 0)
    assert cfg["q_lora_rank"] and cfg["kv_lora_rank"] and cfg["qk_rope_head_dim"] and cfg["v_head_dim"]
    assert cfg["n_routed_experts"] > cfg["num_experts_per_tok"] == 2 and cfg["n_shared_experts"] == 1
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_group"] > cfg["topk_group"]
    assert cfg["rope_parameters"]["rope_type"] == "yarn"
    assert {k: cfg[k] for k in MINI_KIMI_SHAPE} == MINI_KIMI_SHAPE
    # a real tokenizer with a chat template, its vocabulary = the model's
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(kimi_dir))
    assert len(tok) == cfg["vocab_size"] and tok.chat_template
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                             add_generation_prompt=True)
    # MoE weights per expert (the layout vLLM loads), layer 0 dense, random router bias
    with safe_open(str(kimi_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in keys and bias.abs().sum() > 0
    # the wrapper: Kimi-K2.5's layout, router keys inside text_config, remote code beside the weights
    wcfg = json.loads((wrapped_dir / "config.json").read_text())
    assert wcfg["auto_map"]["AutoModelForCausalLM"].startswith("modeling_mini_kimi.")
    assert (wrapped_dir / "modeling_mini_kimi.py").is_file()
    assert wcfg["text_config"]["topk_method"] == "noaux_tc" and wcfg["text_config"]["scoring_func"] == "sigmoid"
    # same weights under the language_model. prefix
    plain, wrapped = load_target_tensors(kimi_dir), load_target_tensors(wrapped_dir)
    assert all(torch.equal(plain[k], wrapped[k]) for k in ("embed", "lm_head"))


def test_build_is_deterministic(kimi_dir, smollm2_dir, tmp_path):
    again = build_mini_kimi(tmp_path / "again", smollm2_dir)
    assert (again / "model.safetensors").read_bytes() == (kimi_dir / "model.safetensors").read_bytes()
    assert build_mini_kimi(kimi_dir, smollm2_dir) == kimi_dir          # a finished folder is kept


def test_mini_kimi_profile_states_the_built_shape(root):
    profile = yaml.safe_load((root / "params" / "mini-kimi.yaml").read_text())
    assert profile["target"]["shape"] == MINI_KIMI_SHAPE


# ---- the HF backend on MLA + MoE, bare and wrapped ----------------------------------------------
def test_extraction_equals_a_direct_forward(kimi_dir, kimi_model, dataset, tmp_path):
    """aux j = output_hidden_states[AUX[j]] (the input of layer AUX[j]); final = the final-normed state,
    i.e. the lm_head input: lm_head(final) gives the model's logits."""
    cache = extract(kimi_dir, tmp_path, dataset, kimi_model)
    rows = [i for i, n in enumerate(LENGTHS) if n > 0]
    assert cache.seq_index == rows
    decisive = 0
    for i, row in enumerate(rows):
        item = cache.get(i)
        with torch.inference_mode():
            out = kimi_model(torch.tensor([dataset[row]["input_ids"]]), output_hidden_states=True)
        hs = out.hidden_states
        torch.testing.assert_close(item["aux"], torch.stack([hs[k][0] for k in AUX], dim=1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["final"], hs[-1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kimi_model.lm_head(item["final"]), out.logits[0], rtol=1e-4, atol=1e-3)
        top2 = out.logits[0].topk(2, dim=-1).values                     # [T, 2]
        decisive += int(((top2[:, 0] - top2[:, 1]) > 0.5).sum())
    assert decisive > 0.3 * sum(LENGTHS), decisive      # clear greedy decisions, as a trained LM has


def test_wrapped_target_gives_the_same_cache(kimi_dir, kimi_model, wrapped_dir, wrapped_model, dataset, tmp_path):
    """Kimi-K2.5's layout: get_decoder() returns the causal LM (its output is logits); the capture must
    find language_model.model's layers and norm instead and cache the same states as the bare LM."""
    assert wrapped_model.get_decoder() is wrapped_model.language_model   # the trap the old capture fell into
    bare = extract(kimi_dir, tmp_path / "bare", dataset, kimi_model)
    inner = extract(wrapped_dir, tmp_path / "wrapped", dataset, wrapped_model, trust_remote_code=True)
    assert inner.hidden_size == bare.hidden_size == MINI_KIMI_SHAPE["hidden_size"]
    for i in range(len(bare)):
        a, b = bare.get(i), inner.get(i)
        assert torch.equal(a["input_ids"], b["input_ids"])
        torch.testing.assert_close(b["aux"], a["aux"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b["final"], a["final"], rtol=1e-6, atol=1e-6)


def test_capturing_logits_is_refused_and_nothing_is_cached(wrapped_dir, wrapped_model, dataset, tmp_path,
                                                          monkeypatch):
    """Planted fault: the final state taken from the wrapper's causal LM (its output = logits
    [B, T, V]) instead of the final norm. The capture must raise before the writer sees a row."""
    def logits_instead_of_norm(model, num_layers, hidden_size):
        lm = model.language_model
        return ex.TextDecoder("language_model", lm.model.layers, lm)     # lm's output: logits
    monkeypatch.setattr(ex, "find_text_decoder", logits_instead_of_norm)
    params = make_params(wrapped_dir, tmp_path, trust_remote_code=True)
    with pytest.raises(CacheError, match=r"\(\d+, \d+, 49152\).*expected \(\d+, \d+, 256\)"):
        ex.extract_hidden_states(params, params.run_dir(), "train", model=wrapped_model, dataset=dataset,
                                 progress=False)
    out = params.layout().hidden("train")
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*.safetensors"))
    assert not list(out.glob("manifest*.json"))


def test_ambiguous_or_missing_text_decoder_is_a_clear_error(kimi_model):
    with pytest.raises(CacheError, match="found 0"):
        ex.find_text_decoder(kimi_model, num_layers=5, hidden_size=256)
    dec = ex.find_text_decoder(kimi_model, 8, 256)
    assert dec.path == "model" and dec.norm is kimi_model.model.norm and dec.layers is kimi_model.model.layers


def test_extraction_runs_the_root_forward_so_quantization_hooks_apply(kimi_dir, kimi_model, dataset, tmp_path):
    """An INT4 pack-quantized checkpoint (compressed-tensors) is decompressed by a hook on the ROOT
    model; a capture that calls the inner decoder directly meets layers without weights ("'Linear'
    object has no attribute 'weight'"). Simulated here: one MLA projection's weight is removed and
    a forward pre-hook on the root model puts it back (and takes it away again after)."""
    reference = extract(kimi_dir, tmp_path / "plain", dataset, kimi_model)
    proj = kimi_model.model.layers[1].self_attn.o_proj
    weight = proj.weight
    calls = []

    def decompress(module, args, kwargs):
        proj.weight = weight
        calls.append(1)

    def recompress(module, args, kwargs, output):
        del proj.weight

    del proj.weight
    hooks = [kimi_model.register_forward_pre_hook(decompress, with_kwargs=True),
             kimi_model.register_forward_hook(recompress, with_kwargs=True, always_call=True)]
    try:
        with pytest.raises(AttributeError):            # the inner decoder alone cannot run
            kimi_model.model(torch.tensor([[1, 2, 3]]))
        hooked = extract(kimi_dir, tmp_path / "hooked", dataset, kimi_model)
    finally:
        for h in hooks:
            h.remove()
        proj.weight = weight
    assert calls and len(hooked) == len(reference)
    for i in range(len(reference)):
        torch.testing.assert_close(hooked.get(i)["final"], reference.get(i)["final"], rtol=0, atol=0)
        torch.testing.assert_close(hooked.get(i)["aux"], reference.get(i)["aux"], rtol=0, atol=0)
