"""The embedded target: GGUF -> clean bf16 HF checkpoint, cached and atomic."""
import json

import torch
from safetensors.torch import load_file

from eagle3lib.target import _DONE_MARKER, EMBEDDED_DIRNAME, load_target, load_target_tensors, materialize_embedded


def test_materialised_checkpoint_is_a_clean_bf16_llama(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    weights = load_file(str(smollm2_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert (smollm2_dir / _DONE_MARKER).is_file()


def test_target_answers_a_chat_sensibly(smollm2_dir):
    from eagle3lib.target import load_tokenizer
    tok = load_tokenizer(smollm2_dir)
    model = load_target(smollm2_dir, dtype="float32")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_embed_and_head_tensors_without_building_the_model(smollm2_dir):
    t = load_target_tensors(smollm2_dir)
    assert t["embed"].shape == (49152, 576)
    assert torch.equal(t["embed"], t["lm_head"])          # SmolLM2 ties its head


def test_half_built_folder_is_rebuilt_and_result_is_deterministic(tmp_path, smollm2_dir):
    half = tmp_path / EMBEDDED_DIRNAME
    half.mkdir()
    (half / "config.json").write_text("{}")                # killed run: no marker
    out = materialize_embedded(tmp_path)
    assert (out / _DONE_MARKER).is_file()
    assert (out / "model.safetensors").read_bytes() == (smollm2_dir / "model.safetensors").read_bytes()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert materialize_embedded(tmp_path) == out           # cached: not rebuilt
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
