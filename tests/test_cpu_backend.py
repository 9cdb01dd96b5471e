"""The CPU attention backend chosen by the CPU's flags (engine.cpu_attention_backend): an fp32 MLA
target on an AMX CPU asks vLLM for CPU_MLA (its AMX_MLA backend takes bf16 weights only); on
AVX512-BF16-only and AVX2-only CPUs, on GPUs, in bf16 and for non-MLA targets vLLM chooses.
The pipeline run with the AMX choice forced on this host is tests/test_kimi_pipeline.py."""
from __future__ import annotations

import json

import pytest

from eagle3lib import engine
from eagle3lib.engine import build_kwargs, cpu_attention_backend, engine_kwargs, uses_mla
from eagle3lib.params import cpu_flags, load_params

AMX = {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}   # Sapphire Rapids
AVX512_BF16 = {"fpu", "avx2", "avx512f", "avx512_bf16"}                              # AMD Zen 4/5
AVX2 = {"fpu", "sse2", "avx", "fma", "avx2"}


@pytest.mark.parametrize("flags, dtype, mla, cuda, expected", [
    (AMX, "float32", True, False, "CPU_MLA"),          # the failing case: AMX_MLA refuses fp32 weights
    (AMX, "float16", True, False, "CPU_MLA"),          # AMX_MLA's supported_dtypes is [bfloat16]
    (AMX, "bfloat16", True, False, None),              # AMX_MLA runs bf16: vLLM's fast choice stays
    (AMX, "float32", False, False, None),              # not MLA: vLLM's CPU_ATTN, nothing to choose
    (AMX, "float32", True, True, None),                # a GPU engine on an AMX host: GPU backends
    (AVX512_BF16, "float32", True, False, None),       # no AMX: vLLM picks CPU_MLA itself
    (AVX512_BF16, "bfloat16", True, False, None),
    (AVX2, "float32", True, False, None),
    (set(), "float32", True, False, None),             # flags unreadable
])
def test_cpu_attention_backend_by_flags(flags, dtype, mla, cuda, expected):
    assert cpu_attention_backend(dtype, mla, flags=flags, cuda=cuda) == expected


def test_amx_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n")
    assert cpu_attention_backend("float32", True, flags=cpu_flags(info), cuda=False) == "CPU_MLA"


def test_uses_mla_reads_the_config(tmp_path):
    (tmp_path / "dsv3").mkdir()
    (tmp_path / "dsv3" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512}))
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps({"model_type": "kimi_k25",
                                                               "text_config": {"kv_lora_rank": 512}}))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "kv_lora_rank": None}))
    assert uses_mla(tmp_path / "dsv3") and uses_mla(tmp_path / "kimi")
    assert not uses_mla(tmp_path / "llama") and not uses_mla(tmp_path / "missing")


@pytest.mark.parametrize("flags, expected", [(AMX, "CPU_MLA"), (AVX512_BF16, None), (AVX2, None)])
def test_engine_kwargs_carry_the_choice_to_every_stage(tmp_path, monkeypatch, flags, expected):
    """regeneration, extraction and eval build their engines through engine_kwargs; the eval
    subprocess rebuilds them with build_kwargs, which must accept the key."""
    model = tmp_path / "mla"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    monkeypatch.setattr(engine, "cpu_flags", lambda: flags)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    params = load_params("params/ci.yaml", overrides={"target": {"dtype": "float32"}})
    for stage in engine.STAGES:
        kw = engine_kwargs(params, stage, model, 200)
        assert kw.get("attention_backend") == expected, stage
        assert build_kwargs(**{k: v for k, v in kw.items() if k != "tokenizer"}) == kw
    assert "attention_backend" not in engine_kwargs(params, "eval", model, 200, dtype="bfloat16")
