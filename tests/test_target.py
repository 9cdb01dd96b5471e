"""The embedded target: GGUF -> clean bf16 HF checkpoint, cached and atomic."""
import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3lib.target import (
    _DONE_MARKER,
    EMBEDDED_DIRNAME,
    eos_ids,
    load_target,
    load_target_tensors,
    load_tokenizer,
    materialize_embedded,
    missing_checkpoint_parts,
)


def test_materialised_checkpoint_is_a_clean_bf16_llama(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    weights = load_file(str(smollm2_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert (smollm2_dir / _DONE_MARKER).is_file()


def test_target_answers_a_chat_sensibly(smollm2_dir):
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


def test_folder_with_only_config_json_is_a_clear_error(tmp_path, smollm2_dir):
    """A target folder holding only config.json used to end in transformers asking to
    install sentencepiece (load_tokenizer) and a bare OSError (load_target). Both now name the
    folder, what is missing and the fix."""
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text((smollm2_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(only_config)
    msg = str(err.value)
    assert str(only_config) in msg and "tokenizer files" in msg and "weights" in msg
    assert "Copy the whole HF checkpoint folder" in msg and "sentencepiece" not in msg
    with pytest.raises(FileNotFoundError, match=r"only_config is incomplete: missing tokenizer files.*weights"):
        load_target(only_config, dtype="float32")
    assert missing_checkpoint_parts(smollm2_dir) == []
    (only_config / "pytorch_model.bin").write_bytes(b"")                # never unpickled: says so
    assert "convert it to safetensors" in missing_checkpoint_parts(only_config)[-1]


def test_eos_ids_from_generation_config_then_config(tmp_path, smollm2_dir):
    assert eos_ids(smollm2_dir) == [2]                                  # SmolLM2's <|im_end|>
    assert eos_ids(tmp_path) == []                                      # no config at all
    (tmp_path / "config.json").write_text('{"eos_token_id": [2, 7]}')
    assert eos_ids(tmp_path) == [2, 7]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 5}')
    assert eos_ids(tmp_path) == [5]
