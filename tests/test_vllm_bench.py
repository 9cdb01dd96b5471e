"""vllm_bench's spec and result dataclasses: the JSON the parent and the child exchange keeps its
shape (the keys metrics.json and the notebooks read), and a malformed file is refused with an error
naming the bad field; bench/engine_spread.py's rounds. No vLLM run here (test_vllm.py,
test_vllm_breadth.py run it)."""
from __future__ import annotations

import importlib.util
import json
import types

import pandas as pd
import pytest

from eagle3lib.params import ParamsError, repo_root
from eagle3lib.vllm_bench import BenchResult, BenchSpec, GroupSpec, ModeSpec, mode


def spec() -> BenchSpec:
    return BenchSpec(target="/x/target", prompts=[[1, 2, 3], [4, 5]], max_new_tokens=8, temperature=0.0, seed=3,
                     modes=[mode("plain"), mode("ngram", 4), mode("suffix", 3), mode("eagle3", 5, model="/x/export")],
                     groups=[GroupSpec(name="chat@T0.7", prompts=[[7, 8]], temperature=0.7)],
                     engine={"tensor_parallel_size": 1})


def measured(outputs, drafts=2, accepted=1) -> dict:
    return {"elapsed_s": 0.5, "num_new_tokens": sum(map(len, outputs)), "tokens_per_s": 12.0, "decode_s": 0.25,
            "decode_tokens_per_s": 8.0, "num_drafts": drafts, "num_draft_tokens": 2 * drafts,
            "num_accepted": accepted, "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "per_position_acceptance": [0.5, 0.0], "outputs": outputs,
            "per_prompt": [{"num_drafts": drafts, "num_draft_tokens": 2 * drafts, "num_accepted": accepted,
                            "accepted_per_position": [accepted, 0]} for _ in outputs]}


RESULT = {"vllm_version": "0.32.0", "platform": "cpu", "iomp_preloaded": True, "dtype": "float32", "batched": False,
          "modes": [{"name": "plain", "method": "plain", "k": 0, "load_s": 24.5, **measured([[5, 6]], 0, 0),
                     "groups": []},
                    {"name": "eagle3_k2", "method": "eagle3", "k": 2, "load_s": 25.0, **measured([[5, 6]]),
                     "groups": [{"name": "chat@T0.7", "temperature": 0.7, "seeded_repeat_equal": False,
                                 **measured([[9], [9, 9]])}]}]}


def test_modes_keep_their_json_keys():
    assert mode("plain").to_json() == {"name": "plain", "method": "plain", "k": 0}
    assert mode("ngram", 4).to_json() == {"name": "ngram_k4", "method": "ngram", "k": 4,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert mode("eagle3", 5, name="e", model="/x/export").to_json() == {"name": "e", "method": "eagle3", "k": 5,
                                                                         "model": "/x/export"}


def test_spec_round_trips_through_json():
    s = spec()
    text = json.dumps(s.to_json())
    assert BenchSpec.from_json(json.loads(text)) == s
    minimal = {"target": "/x/target", "prompts": [[1]], "max_new_tokens": 4, "modes": [{"name": "plain",
                                                                                     "method": "plain", "k": 0}]}
    assert BenchSpec.from_json(minimal) == BenchSpec(target="/x/target", prompts=[[1]], max_new_tokens=4,
                                                     modes=[ModeSpec(name="plain", method="plain")])


def test_result_round_trips_through_json_with_the_same_keys_in_the_same_order():
    back = BenchResult.from_json(json.loads(json.dumps(RESULT))).to_json()
    assert back == RESULT
    assert json.dumps(back) == json.dumps(RESULT)
    batched = {**RESULT, "batched": True, "modes": [{**RESULT["modes"][0], "per_prompt": None, "decode_s": None}]}
    assert BenchResult.from_json(batched).to_json() == batched


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("max_new_tokens"), r"vLLM bench spec: missing key\(s\) \['max_new_tokens'\]"),
    (lambda d: d.update(surprise=1), r"vLLM bench spec: unknown key\(s\) \['surprise'\]"),
    (lambda d: d.update(max_new_tokens="8"), r"vLLM bench spec: max_new_tokens must be an int >= 1, got '8'"),
    (lambda d: d.update(batched=True), "groups run one request at a time"),
    (lambda d: d["modes"][1].update(method="medusa"), r"unknown vLLM mode 'medusa'"),
    (lambda d: d["modes"][2].update(k=0), r"mode 'suffix' needs k >= 1"),
    (lambda d: d["modes"][1].pop("name"), r"vLLM bench spec: modes\[1\]: missing key\(s\) \['name'\]"),
    (lambda d: d["groups"][0].update(temperature=-1), r"group 'chat@T0.7': temperature must be >= 0"),
    (lambda d: d["groups"][0].update(prompts=[[]]), r"group 'chat@T0.7': prompts must be a non-empty list"),
])
def test_a_malformed_spec_names_the_bad_field(change, message):
    data = json.loads(json.dumps(spec().to_json()))
    change(data)
    with pytest.raises(ValueError, match=message):
        BenchSpec.from_json(data)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("platform"), r"vLLM bench result: missing key\(s\) \['platform'\]"),
    (lambda d: d["modes"][1].pop("num_drafts"), r"modes\[1\]: missing key\(s\) \['num_drafts'\]"),
    (lambda d: d["modes"][1].update(num_accepted=1.5), r"num_accepted must be an int, got 1.5"),
    (lambda d: d["modes"][1]["groups"][0].update(seeded_repeat_equal=None),
     r"group 'chat@T0.7': seeded_repeat_equal must be true or false"),
    (lambda d: d["modes"][0].update(outputs=[["a"]]), r"outputs must be a list of token-id lists"),
    (lambda d: d["modes"][0]["per_prompt"][0].pop("num_drafts"), r"per_prompt\[0\]: missing key\(s\)"),
])
def test_a_malformed_result_names_the_bad_field(change, message):
    data = json.loads(json.dumps(RESULT))
    change(data)
    with pytest.raises(ValueError, match=message):
        BenchResult.from_json(data)


def load_bench(name: str):
    """bench/<name>.py, imported by path (bench/ is not a package)."""
    spec_ = importlib.util.spec_from_file_location(name, repo_root() / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


def test_engine_spread_rotates_the_order_and_computes_each_rounds_ratio():
    bench = load_bench("engine_spread")
    params = types.SimpleNamespace(eval=types.SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=4))
    modes = bench.round_modes(params, "/x/export", 2, 3)
    assert [m.name for m in modes] == ["plain_r1", "ngram_r1", "eagle3_r1", "ngram_r2", "eagle3_r2", "plain_r2",
                                       "eagle3_r3", "plain_r3", "ngram_r3"]
    assert {m.k for m in modes if m.method != "plain"} == {2}
    # round 1: EAGLE-3 1.5x n-gram; round 2 (reordered): one EAGLE-3 output differs from plain
    rows = [("plain_r1", 10.0, 1.0, "20/20"), ("ngram_r1", 12.0, 1.8, "20/20"), ("eagle3_r1", 18.0, 1.8, "20/20"),
            ("ngram_r2", 15.0, 1.8, "20/20"), ("eagle3_r2", 15.0, 1.8, "19/20"), ("plain_r2", 10.0, 1.0, "20/20")]
    summary = pd.DataFrame([{"method": n, "tokens_per_s": t, "acceptance_length": a, "same_output_as_plain": s,
                             "prompts": 20} for n, t, a, s in rows])
    out = bench.round_rows(summary, 2)
    assert out[0]["order"] == ["plain_r1", "ngram_r1", "eagle3_r1"]
    assert out[1]["order"] == ["ngram_r2", "eagle3_r2", "plain_r2"]
    assert out[0]["eagle3_vs_ngram"] == pytest.approx(1.5) and out[1]["eagle3_vs_ngram"] == pytest.approx(1.0)
    assert out[0]["eagle3_round_cost"] == pytest.approx(1.8 * 10 / 18)
    assert out[0]["ngram_round_cost"] == pytest.approx(1.5)
    assert out[0]["lossless"] is True and out[1]["lossless"] is False


def test_train_sweep_variant_keeps_a_lists_commas_and_refuses_an_out_of_range_aux_choice(tmp_path):
    bench = load_bench("train_sweep")
    name, changes = bench.parse_variant("aux29:aux_layers=[2,15,29],lr=0.005,label_positions=all")
    assert name == "aux29"
    assert changes == {"aux_layers": [2, 15, 29], "lr": 0.005, "label_positions": "all"}
    assert bench.parse_variant("base:") == ("base", {})
    # an aux choice out of the target's range is refused before any engine starts
    params = types.SimpleNamespace(target_shape=lambda: {"num_hidden_layers": 30},
                                   target=types.SimpleNamespace(path="smol"))
    with pytest.raises(ParamsError, match=r"extract.aux_layers: \[2, 15, 30\] out of range"):
        bench.aux_cache(params, types.SimpleNamespace(root=tmp_path / "local"), tmp_path, [2, 15, 30])
    assert not any(tmp_path.iterdir())
