"""vLLM's suffix decoding as 01's second cheap baseline (eval.suffix_baseline): the mode and its
speculative config, a clear error when arctic-inference is missing, and the verdict/metrics lines.
The run itself (lossless at T=0, asserted by check_vllm_same_output) is 01 under nbval."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from eagle3lib import evaluate as ev
from eagle3lib import verdict as V
from eagle3lib import vllm_bench
from eagle3lib.params import ParamsError, load_params


def test_suffix_mode_and_its_speculative_config():
    m = vllm_bench.mode("suffix", 4)
    assert (m.name, m.k) == ("suffix_k4", 4)
    assert vllm_bench.speculative_config(m) == {"method": "suffix", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="needs k >= 1"):
        vllm_bench.mode("suffix")
    names = [x.name for x in ev.vllm_modes([(4, 1, 4)], suffix_k=4)]
    assert names == ["plain", "ngram_k4_n1-4", "suffix_k4"]
    assert [x.name for x in ev.vllm_modes([(4, 1, 4)])] == ["plain", "ngram_k4_n1-4"]


def test_missing_arctic_inference_is_a_clear_error(smollm2_dir, monkeypatch):
    spec = vllm_bench.BenchSpec(target=str(smollm2_dir), prompts=[[1, 2, 3]], max_new_tokens=4,
                                modes=[vllm_bench.mode("plain"), vllm_bench.mode("suffix", 3)])
    spec.check_runnable()                                            # installed here by make setup
    real = vllm_bench.importlib.util.find_spec
    monkeypatch.setattr(vllm_bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "arctic_inference" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"suffix_k3.*arctic-inference.*make setup.*eval.suffix_baseline"):
        spec.check_runnable()


def summary(suffix_tps: float) -> pd.DataFrame:
    rows = [("plain", 0, 10.0, 1.0, []), ("ngram_k4_n1-4", 4, 15.0, 2.9, [0.6, 0.5, 0.4, 0.4]),
            ("suffix_k4", 4, suffix_tps, 1.9, [0.4, 0.2, 0.2, 0.1])]
    return pd.DataFrame([{"method": m, "k": k, "new_tokens": 100, "accepted": 50 * k, "tokens_per_s": tps,
                          "speedup": tps / 10,
                          "acceptance_length": al, "tau": al, "per_position_acceptance": pp}
                         for m, k, tps, al, pp in rows])


@pytest.mark.parametrize("tps, word", [(18.0, "beats"), (15.2, "ties with"), (12.0, "loses to")])
def test_verdict_compares_suffix_with_the_best_ngram(tps, word):
    text = V.ngram_verdict(None, summary(tps))
    line = next(l for l in text.splitlines() if "suffix decoding" in l)
    assert f"suffix decoding (suffix_k4) {word} the best n-gram: {tps / 15:.2f}x" in line
    assert "best ngram_k4_n1-4" in text                     # suffix is not counted as an n-gram setting


def test_metrics_carry_the_suffix_row(tmp_path):
    class Setup:
        prompts, decoder_prompts, skipped_prompts = [1, 2], [], 0
    out = ev.ngram_metrics(summary(18.0).iloc[:1], summary(18.0), Setup(), 16, run_dir=tmp_path)
    written = json.loads((tmp_path / "metrics.json").read_text())["ngram"]
    assert written["speedup_vllm_suffix"] == pytest.approx(1.8) and written["verdict"] == out["verdict"]
    assert out["speedup_vllm_suffix"] == pytest.approx(1.8) and out["acceptance_length_vllm_suffix"] == 1.9
    assert out["best_ngram_vllm"] == "ngram_k4_n1-4"


def test_suffix_baseline_param():
    assert load_params("params/ci.yaml").eval.suffix_baseline is True
    with pytest.raises(ParamsError, match="eval.suffix_baseline"):
        load_params("params/ci.yaml", {"eval": {"suffix_baseline": "yes"}})


def test_suffix_decoding_runs_in_01_or_else_in_05_and_never_twice():
    """01 measures it beside its vLLM rows; where 01 runs no vLLM (b300), 05 does; off, or no vLLM: none."""
    from eagle3lib.params import suffix_stage
    assert suffix_stage(load_params("params/ci.yaml").eval) == "ngram"
    assert suffix_stage(load_params("params/b300.yaml").eval) == "eval"
    assert suffix_stage(load_params("params/local.yaml").eval) is None                 # left out of the hour
    assert suffix_stage(load_params("params/ci.yaml", {"eval": {"use_vllm": False}}).eval) is None
