"""The extraction engine's vLLM model runner (extract.model_runner -> engine.engine_env): the value
reaches the subprocess environment as VLLM_USE_V2_MODEL_RUNNER, and vLLM 0.32 reads that variable
as the runner choice (VllmConfig.use_v2_model_runner)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3lib.engine import engine_env
from eagle3lib.params import ParamsError, load_params


@pytest.mark.parametrize("runner, expected", [("v1", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
                                              ("v2", {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
                                              ("auto", {})])
def test_extract_model_runner_reaches_the_extraction_engine_env_only(runner, expected):
    params = load_params("params/ci.yaml", {"extract": {"model_runner": runner}})
    assert engine_env(params, "extract") == expected
    assert engine_env(params, "regenerate") == {} and engine_env(params, "eval") == {}


def test_default_runner_is_v1_in_every_profile():
    for profile in ("ci", "local", "mini-kimi", "b300"):
        assert engine_env(load_params(f"params/{profile}.yaml"), "extract") == {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_bad_runner_is_refused_by_validation_and_by_engine_env():
    with pytest.raises(ParamsError, match="extract.model_runner"):
        load_params("params/ci.yaml", {"extract": {"model_runner": "v3"}})
    params = load_params("params/ci.yaml")
    params.extract.model_runner = "V2"
    with pytest.raises(ParamsError, match="extract.model_runner"):
        engine_env(params, "extract")
    with pytest.raises(ValueError, match="unknown stage"):
        engine_env(params, "train")


@pytest.mark.parametrize("runner, v2", [("v1", False), ("v2", True)])
def test_vllm_reads_the_variable_as_the_runner_choice(runner, v2, monkeypatch):
    """vLLM's own property, on a stand-in config without the features that force V2 (HiSparse,
    watermarking): the variable engine_env sets decides, before vLLM's default logic runs."""
    from vllm.config.vllm import VllmConfig
    params = load_params("params/ci.yaml", {"extract": {"model_runner": runner}})
    for key, value in engine_env(params, "extract").items():
        monkeypatch.setenv(key, value)
    stand_in = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), watermark_config=None)
    assert VllmConfig.use_v2_model_runner.fget(stand_in) is v2
