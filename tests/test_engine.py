"""engine.engine_env: the extraction engine's vLLM model runner (extract.model_runner) reaches the
subprocess environment as VLLM_USE_V2_MODEL_RUNNER, and vLLM 0.32 reads that variable as the runner
choice (VllmConfig.use_v2_model_runner); the process layout per stage (in-process on a CPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3lib.engine import IN_PROCESS_ENV, engine_env
from eagle3lib.params import ParamsError, load_params


@pytest.mark.parametrize("runner, expected", [("v1", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
                                              ("v2", {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
                                              ("auto", {})])
def test_extract_model_runner_reaches_the_extraction_engine_env_only(runner, expected):
    params = load_params("params/ci.yaml", {"extract": {"model_runner": runner}})
    assert engine_env(params, "extract") == {**expected, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert "VLLM_USE_V2_MODEL_RUNNER" not in {**engine_env(params, "regenerate"), **engine_env(params, "eval")}


def test_default_runner_is_v1_in_every_profile():
    for profile in ("ci", "local", "mini-kimi", "b300"):
        assert engine_env(load_params(f"params/{profile}.yaml"), "extract")["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_regeneration_runs_the_engine_in_process_on_a_cpu_and_extraction_never_does(monkeypatch):
    """engine_env's process layout: in-process for regeneration on a CPU with one worker (unless the
    environment says otherwise); vLLM's default for the eval benchmarks (a serving figure), GPUs and
    tensor parallelism; extraction (the online server included) always with an engine-core process, whatever the
    environment says (the connector's lock handover would wait on its own engine)."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)     # conftest sets it for the tests
    params = load_params("params/ci.yaml", {"extract": {"model_runner": "auto"}})
    assert engine_env(params, "regenerate", cuda=False) == IN_PROCESS_ENV == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_env(params, "eval", cuda=False) == {} == engine_env(params, "regenerate", cuda=True)
    b300 = load_params("params/b300.yaml")
    assert engine_env(b300, "regenerate", cuda=False) == {}                 # tensor_parallel_size 8
    assert engine_env(params, "extract", cuda=False) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert engine_env(params, "extract", cuda=False) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert engine_env(params, "regenerate", cuda=False) == {}


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
