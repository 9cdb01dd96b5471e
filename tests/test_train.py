"""The trainer: batching, schedule, a tiny run that learns, NaN detection, resume after SIGKILL,
and DDP / FSDP with 2 gloo processes against single-process training with the same global batch.

Hidden-state caches here are tiny and made by the tiny random target itself (H=64), written in
the hidden-state cache format (see eagle3lib/cache.py's docstring)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from eagle3lib.batches import aux_scale, bucket_batches, fold_aux_scale
from eagle3lib.cache import CacheError, HiddenCache, cache_params_hash, file_sha256
from eagle3lib.export import TRAINING_FILE
from eagle3lib.fingerprint import target_fingerprint
from eagle3lib.model import Eagle3Config
from eagle3lib.objective import acceptance_estimate, replay_chain
from eagle3lib.params import load_params
from eagle3lib.target import load_target_tensors
from eagle3lib.train import init_from_target_layer, lr_factor, torchrun_command, train
from eagle3lib.vocab import build_draft_vocab, count_assistant_tokens, save_vocab

TOKENS = 300          # the synthetic chats use token ids below this


def synthetic_sequences(n: int, seed: int) -> list:
    """Chats of 20..48 tokens from a noisy cyclic pattern (learnable); the first third is the
    'prompt' (loss_mask 0), the rest the 'answer'."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(20, 49, (1,), generator=g))
        x = [int(torch.randint(TOKENS, (1,), generator=g))]
        for _ in range(T - 1):
            noise = int(torch.randint(4, (1,), generator=g)) == 0
            x.append(int(torch.randint(TOKENS, (1,), generator=g)) if noise else (x[-1] * 7 + 3) % TOKENS)
        mask = [0] * (T // 3) + [1] * (T - T // 3)
        out.append((torch.tensor(x), torch.tensor(mask)))
    return out


def write_cache(out_dir: Path, target, seqs: list, aux_layers: list, params_hash: str, dtype=torch.bfloat16,
                poison: bool = False):
    """Run the target over `seqs` and write one shard + manifest.json in the extraction format."""
    out_dir.mkdir(parents=True, exist_ok=True)
    aux, final = [], []
    with torch.no_grad():
        for ids, _ in seqs:
            hs = target(ids[None], output_hidden_states=True).hidden_states
            aux.append(torch.stack([hs[k][0] for k in aux_layers], dim=1))        # [T, 3, H]
            final.append(hs[-1][0])                                              # [T, H] (after norm)
    lengths = [len(ids) for ids, _ in seqs]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {"offsets": offsets, "seq_index": torch.arange(len(seqs)),
               "aux": torch.cat(aux).to(dtype), "final": torch.cat(final).to(dtype),
               "input_ids": torch.cat([i for i, _ in seqs]).int(),
               "loss_mask": torch.cat([m for _, m in seqs]).to(torch.uint8)}
    if poison:
        tensors["final"][15] = float("inf")                    # a label position of sequence 0
    save_file(tensors, str(out_dir / "shard-00000.safetensors"))
    f = out_dir / "shard-00000.safetensors"
    H = tensors["final"].shape[-1]
    rec = {"index": 0, "file": f.name, "seq_index": list(range(len(seqs))), "num_tokens": sum(lengths),
           "bytes": f.stat().st_size, "sha256": file_sha256(f)}
    manifest = {"format": "eagle3lab-hidden-cache", "format_version": 1, "dtype": str(dtype).split(".")[-1],
                "aux_layers": aux_layers, "hidden_size": H, "num_shards": 1, "complete": True, "shards": [rec],
                "split": out_dir.name, "params_hash": params_hash}
    (out_dir / "manifest.json").write_text(json.dumps(manifest))


def make_run(root: Path, target_dir: Path, train_overrides: dict, n_train=24, n_eval=6,
             draft_vocab_size=128, poison=False):
    """A run folder with data/vocab.safetensors and hidden/{train,eval}; returns the params file."""
    from transformers import AutoModelForCausalLM
    aux_layers = [1, 3, 4]
    profile = {"inherit": str(Path(__file__).resolve().parents[1] / "params" / "ci.yaml"),
               "run_name": "t", "output_dir": str(root), "seed": 3,
               "target": {"path": str(target_dir), "dtype": "float32"},
               "data": {"draft_vocab_size": draft_vocab_size, "max_length": 64},
               "extract": {"aux_layers": aux_layers},
               "train": {"ttt_steps": 3, "lr": 3e-3, "warmup_steps": 2, "batch_tokens": 128,
                         "checkpoint_every": 2, "eval_sequences": 4, **train_overrides}}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(profile))
    params = load_params(path)
    run_dir = params.run_dir()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    train_seqs, eval_seqs = synthetic_sequences(n_train, 1), synthetic_sequences(n_eval, 2)
    counts = count_assistant_tokens(train_seqs, target.config.vocab_size)
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    save_vocab(run_dir / "data" / "vocab.safetensors", d2t, t2d)
    write_cache(run_dir / "hidden" / "train", target, train_seqs, aux_layers, cache_params_hash(params), poison=poison)
    write_cache(run_dir / "hidden" / "eval", target, eval_seqs, aux_layers, cache_params_hash(params))
    return path


def run_script(params_path: Path, extra: str = "", nproc: int = 1, check=True) -> subprocess.CompletedProcess:
    """Train in a fresh process: python running a script (with `extra` code, e.g. a callback), or
    torchrun with nproc gloo processes."""
    script = params_path.parent / "run_train.py"
    script.write_text(
        "import os, signal, sys\n"
        "from eagle3lib.params import load_params\n"
        "from eagle3lib.train import train\n"
        f"params = load_params({str(params_path)!r})\n"
        "callback = None\n" + extra +
        "train(params, params.run_dir(), progress=False, callback=callback)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # several processes: the same torchrun command the notebook launches
    cmd = [sys.executable, str(script)] if nproc == 1 else \
        torchrun_command(params_path, None, nproc) + ["--no-progress"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if check and res.returncode != 0:
        raise AssertionError(f"{cmd} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    return res


@pytest.fixture(scope="module")
def sharp_target_dir(tmp_path_factory, tiny_target_dir) -> Path:
    """The tiny target's architecture (H=64, 6 layers) with a 320-token vocabulary and larger random
    weights, so that its next-token distributions are peaked (the default init gives near-uniform
    ones, which leave nothing to learn) and its top-1 often lies in a 128-token draft vocabulary."""
    from transformers import AutoConfig, LlamaForCausalLM
    cfg = AutoConfig.from_pretrained(str(tiny_target_dir))
    cfg.initializer_range = 0.3
    cfg.vocab_size = 320
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = 0
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("sharp_target")
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


# ---- pure functions ----------------------------------------------------------------------------
def test_bucket_batches_cover_every_sequence_once_within_the_token_budget():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 200, (300,), generator=g).tolist()
    batches = bucket_batches(lengths, 512, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert all(len(b) * max(lengths[i] for i in b) <= 512 for b in batches)
    assert batches == bucket_batches(lengths, 512, seed=1, epoch=0)          # deterministic
    assert batches != bucket_batches(lengths, 512, seed=1, epoch=1)          # reshuffled per epoch
    # bucketing keeps padding low: padded tokens / real tokens
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded / sum(lengths) < 1.15


class ListCache:
    """A stand-in for HiddenCache: get(i) -> sequence i's fields (what collate reads)."""

    def __init__(self, lengths: list):
        g = torch.Generator().manual_seed(5)
        self.items = [{"input_ids": torch.randint(100, (n,), generator=g),
                       "loss_mask": torch.ones(n, dtype=torch.uint8),
                       "aux": torch.randn(n, 3, 4, generator=g), "final": torch.randn(n, 4, generator=g)}
                      for n in lengths]

    def get(self, i: int) -> dict:
        return self.items[i]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_loader_feeds_each_rank_the_old_slices_of_bucket_batches_from_any_step(workers):
    """micro_batch_loader reproduces the trainer's former in-step batching (bucket_batches per
    epoch, the step's slice, rank::world) from any start step, across epochs, with and without
    worker processes. Planted fault shown caught: StepSampler reshuffling with epoch + 1
    (the order assertion)."""
    from eagle3lib.batches import Schedule, collate, micro_batch_loader
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 40, (60,), generator=g).tolist()
    usable = list(range(5, 65))                                  # dataset index k -> cache item usable[k]
    cache = ListCache([3] * 5 + lengths)
    world, accum, batch_tokens, seed = 2, 2, 96, 3
    per_step = world * accum
    spe = len(bucket_batches(lengths, batch_tokens, seed, 0)) // per_step
    plan = Schedule(tuple(lengths), batch_tokens, seed, per_step, spe, total_steps=2 * spe + 3)
    for rank in range(world):
        for start in (0, spe - 1):
            expected = []
            for step in range(start, plan.total_steps):
                epoch, pos = divmod(step, spe)
                mbs = bucket_batches(lengths, batch_tokens, seed, epoch)[pos * per_step:(pos + 1) * per_step]
                expected += [collate([cache.get(usable[k]) for k in mb], batch_tokens) for mb in mbs[rank::world]]
            got = list(micro_batch_loader(cache, usable, plan, rank, world, start, workers=workers))
            assert len(got) == len(expected) == (plan.total_steps - start) * accum
            for a, b in zip(got, expected):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lr_schedule_warmup_then_cosine_to_min_ratio():
    f = [lr_factor(s, 10, 100, 0.1) for s in range(101)]
    assert f[0] < f[5] < f[9] <= 1.0
    assert abs(f[10] - 1.0) < 1e-9 and abs(f[100] - 0.1) < 1e-9
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_acceptance_estimate():
    assert acceptance_estimate([1.0, 1.0, 1.0]) == 4.0
    assert acceptance_estimate([0.0, 1.0]) == 1.0
    assert abs(acceptance_estimate([0.5, 0.5]) - 1.75) < 1e-12


def test_replay_chain_follows_the_decoding_rounds():
    # labels 5..12 are the first answer (13 is a gap: later turn at 20..22 is ignored)
    u = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 22])
    J = 3
    all_hit = torch.ones(len(u), J, dtype=torch.bool)
    # anchors 5 (drafts 6,7,8: 3 accepted) -> 9 (10,11,12) -> 13 > last label 12: stop
    assert replay_chain(u, all_hit, k=3) == (2, 6)
    assert replay_chain(u, all_hit, k=2) == (3, 5)     # 5 -> 8 -> 11 (drafts 12 only) -> stop
    none = torch.zeros(len(u), J, dtype=torch.bool)
    assert replay_chain(u, none, k=3) == (7, 0)        # one token per round: anchors 5..11
    # step-1 miss at label 7 (anchor 5): round 1 accepts 1; next anchor 7
    flags = all_hit.clone()
    flags[2, 1] = False                                  # label 7, step 1
    flags[4, 0] = False                                  # label 9, step 0 (anchor 8)
    # anchor 5: label 6 (j0 ok), 7 (j1 miss) -> 1; anchor 7: 8 (j0), 9 (j1 ok), 10 (j2) -> 3;
    # anchor 11: label 12 (j0) -> 1, stop
    assert replay_chain(u, flags, k=3) == (3, 5)
    # the flag of label 9 at step 0 matters only when a round is anchored at 8
    assert replay_chain(u, flags, k=3, max_answer_tokens=4) == (2, 2)   # labels 5..8 only
    with pytest.raises(ValueError, match="ttt_steps"):
        replay_chain(u, all_hit, k=4)
    assert replay_chain(torch.tensor([], dtype=torch.long), torch.zeros(0, J, dtype=torch.bool), k=3) == (0, 0)


def test_label_positions_all_labels_every_token_with_a_successor():
    from eagle3lib.batches import collate
    from eagle3lib.objective import TargetHead, prepare_batch
    g = torch.Generator().manual_seed(3)
    V, H = 32, 8
    items = []
    for n, answer in ((9, (5, 9)), (6, (2, 4))):
        mask = torch.zeros(n, dtype=torch.long)
        mask[answer[0]:answer[1]] = 1
        items.append({"input_ids": torch.randint(V, (n,), generator=g), "loss_mask": mask,
                      "aux": torch.randn(n, 3, H, generator=g), "final": torch.randn(n, H, generator=g)})
    head = TargetHead(torch.randn(V, H, generator=g), torch.zeros(16, dtype=torch.long))
    batch = collate(items, 64)
    assistant = prepare_batch(batch, head, 2, "cpu")
    every = prepare_batch(batch, head, 2, "cpu", all_positions=True)
    # a label at u needs token u+1: 8 + 5 positions; the assistant ones: tokens 5..8 and 2..3
    assert len(every["tgt_u"]) == 8 + 5 and len(assistant["tgt_u"]) == 4 + 2
    assert (every["tgt_b"] == 1).sum() == 5 and int(every["tgt_u"][every["tgt_b"] == 1].max()) == 4
    pairs = set(zip(every["tgt_b"].tolist(), every["tgt_u"].tolist()))
    assert set(zip(assistant["tgt_b"].tolist(), assistant["tgt_u"].tolist())) <= pairs
    assert every["counts"].tolist() == [11.0, 9.0]                          # step j needs u >= 1 + j


def test_feature_noise_perturbs_only_aux_reproducibly_and_scales_with_s():
    from eagle3lib.objective import add_feature_noise
    g = torch.Generator().manual_seed(5)
    prepared = {"aux": torch.randn(2, 7, 3, 4, generator=g), "input_ids": torch.randint(9, (2, 7), generator=g),
                "target_p": torch.rand(5, 6, generator=g)}
    assert add_feature_noise(prepared, 0.0, None, 0, 3) is prepared
    a = add_feature_noise(prepared, 0.5, None, 0, 3)
    b = add_feature_noise(prepared, 0.5, None, 0, 3)
    c = add_feature_noise(prepared, 0.5, None, 0, 4)
    assert torch.equal(a["aux"], b["aux"]) and not torch.equal(a["aux"], c["aux"])   # a function of (seed, step)
    assert a["input_ids"] is prepared["input_ids"] and a["target_p"] is prepared["target_p"]
    noise = a["aux"] - prepared["aux"]
    assert 0.4 < float(noise.std()) < 0.6 and abs(float(noise.mean())) < 0.15
    scale = torch.tensor([1.0, 10.0, 100.0])[:, None].expand(3, 4)               # s [3, H]
    scaled = add_feature_noise(prepared, 0.5, scale, 0, 3)["aux"] - prepared["aux"]
    assert torch.allclose(scaled, noise * scale, rtol=1e-5, atol=1e-5)
    before = prepared["aux"].clone()
    add_feature_noise(prepared, 1.0, None, 1, 1)
    assert torch.equal(prepared["aux"], before)


@pytest.mark.parametrize("scan_dtype", [None, torch.bfloat16, torch.float32])   # None: this machine's
def test_target_labels_are_the_renormalised_draft_distribution_and_the_full_top1(scan_dtype):
    from eagle3lib.objective import TargetHead
    g = torch.Generator().manual_seed(0)
    V, H, Dv = 300, 16, 40
    head_w = torch.randn(V, H, generator=g)
    d2t = torch.arange(0, 2 * Dv, 2) - torch.arange(Dv)                       # draft i -> target 2i
    final = torch.randn(50, H, generator=g) * 3
    head = TargetHead(head_w, d2t, scan_dtype=scan_dtype)
    p, top = head.labels(final)
    full = torch.softmax(final @ head_w.T, dim=-1)                              # [N, V]
    want = full[:, 0:2 * Dv:2] / full[:, 0:2 * Dv:2].sum(-1, keepdim=True)
    torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(top, full.argmax(-1))                                    # over the FULL vocabulary
    p2, top_in_draft = head.labels(final, exact_top1=False)
    assert torch.equal(p2, p)
    assert torch.equal(top_in_draft, 2 * p.argmax(-1))                         # argmax within the draft vocab
    inside = top % 2 == 0
    inside &= top < 2 * Dv
    assert inside.any() and torch.equal(top_in_draft[inside], top[inside])


class _ListCache:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def get(self, i):
        return self.items[i]


def test_aux_scale_ignores_attention_sink_outliers_and_folding_keeps_the_function():
    g = torch.Generator().manual_seed(0)
    H = 16
    std = torch.rand(3, H, generator=g) * 5 + 0.1                               # per-dimension scales
    items = []
    for n in (40, 70, 30):
        a = torch.randn(n, 3, H, generator=g) * std
        a[0, 1:, :2] = 2.5e4                                                    # a sink: huge values at t=0
        items.append({"aux": a.to(torch.bfloat16)})
    s = aux_scale(_ListCache(items))
    assert s.shape == (3, H)
    ratio = s / std
    assert (ratio > 0.7).all() and (ratio < 1.4).all(), ratio                 # the outliers did not leak in
    # a drafter trained on aux / s, folded, computes the same fc output on raw aux
    cfg = Eagle3Config(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=64, vocab_size=50, draft_vocab_size=20, target_hidden_size=H,
                       aux_layer_ids=[0, 1, 2])
    from eagle3lib.model import Eagle3Drafter
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    aux = torch.randn(2, 5, 3, H) * std
    want = d.fuse(aux / s)
    folded = fold_aux_scale(d.state_dict(), s)
    assert not torch.equal(folded["fc.weight"], d.state_dict()["fc.weight"])
    d.load_state_dict(folded)
    torch.testing.assert_close(d.fuse(aux), want, rtol=1e-5, atol=1e-5)
    state = {"fc.weight": torch.ones(1)}
    assert fold_aux_scale(state, None) is state


def test_init_from_target_layer_reproduces_that_target_layer(tiny_target_dir):
    """With the embedding half of q/k/v zeroed, step 0 of a drafter started from target layer L
    (norm_before_residual false) IS layer L applied to the aux state fed to it: the drafter's
    pre-norm output equals the target's hidden state after layer L (rope, GQA, norms, residuals
    all as in the target)."""
    from transformers import AutoModelForCausalLM

    from eagle3lib.model import Eagle3Drafter
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()
    hf = json.loads((Path(tiny_target_dir) / "config.json").read_text())
    aux_layers, L = [1, 3, 4], 4
    V = hf["vocab_size"]
    d2t, t2d = torch.zeros(64, dtype=torch.long), torch.zeros(V, dtype=torch.bool)
    t2d[:64] = True
    cfg = Eagle3Config.from_target_config(hf, 64, aux_layers, norm_before_residual=False)
    w = load_target_tensors(tiny_target_dir)
    ids = torch.randint(0, 300, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        aux = torch.stack([hs[k][0] for k in aux_layers], dim=1)[None]             # [1, T, 3, H]
        for scale in (None, aux_scale(_ListCache([{"aux": aux[0]}]))):
            torch.manual_seed(0)
            d = Eagle3Drafter.from_target_weights(cfg, d2t, t2d, w["embed"], w["lm_head"])
            init_from_target_layer(d, tiny_target_dir, L, scale)
            H = cfg.hidden_size
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(d.midlayer.self_attn, name).weight[:, :H] = 0
            fed = aux if scale is None else aux / scale
            _, pre_norm = d(d.fuse(fed), ids, torch.arange(ids.shape[1])[None])
            torch.testing.assert_close(pre_norm[0], hs[L + 1][0], rtol=1e-4, atol=1e-4)
        with pytest.raises(KeyError, match="layers.99"):
            init_from_target_layer(d, tiny_target_dir, 99)


# ---- training runs -----------------------------------------------------------------------------
def test_tiny_run_learns_and_writes_a_vllm_named_final_drafter(tmp_path, sharp_target_dir):
    path = make_run(tmp_path, sharp_target_dir, {"max_steps": 16, "resume": False})
    params = load_params(path)
    records = []
    summary = train(params, params.run_dir(), progress=False, callback=records.append)
    assert summary["steps"] == 16 and len(records) == 16
    first, last = records[0], records[-1]
    assert last["loss"] < 0.8 * first["loss"], (first["loss"], last["loss"])
    assert len(last["step_acc"]) == 3 and summary["eval"]["acceptance_estimate"] >= 1.0
    assert 1.0 <= summary["eval"]["acceptance_replayed"] <= 4.0 and summary["eval"]["replay_rounds"] > 0
    # 05 decodes at eval.k = 3 = ttt_steps: the replay at 05's k is the replay itself
    assert summary["eval"]["decode_k"] == 3
    assert summary["eval"]["acceptance_replayed_decode_k"] == summary["eval"]["acceptance_replayed"]
    section = json.loads((params.run_dir() / "metrics.json").read_text())["train"]
    assert section["eval_decode_k"] == 3 and section["eval_acceptance_replayed_decode_k"] is not None
    assert any("eval" in r for r in records[:-1])                           # eval at checkpoints
    final = Path(summary["final_dir"])
    # the target trained against is recorded with the drafter (export and eval check it)
    assert json.loads((final / TRAINING_FILE).read_text())["target"] == target_fingerprint(sharp_target_dir)
    weights = load_file(str(final / "model.safetensors"))
    cfg = Eagle3Config(**json.loads((final / "config.json").read_text()))
    assert "embed_tokens.weight" not in weights
    assert {"fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d",
            "midlayer.self_attn.q_proj.weight"} <= set(weights)
    assert weights["lm_head.weight"].shape == (cfg.draft_vocab_size, cfg.hidden_size)
    assert cfg.aux_layer_ids == [1, 3, 4] and cfg.norm_before_residual is True
    ckpts = sorted((params.run_dir() / "train" / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-000014", "step-000016"]         # the last two kept
    # fc was trained on aux / s (fc_input_scaling): final/ holds it folded, fc'(a) = fc(a / s)
    s = aux_scale(HiddenCache(params.run_dir() / "hidden" / "train"))
    last = load_file(str(ckpts[-1] / "checkpoint.safetensors"))
    torch.testing.assert_close(weights["fc.weight"] * s.reshape(1, -1), last["model.drafter.fc.weight"],
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(weights["midlayer.mlp.up_proj.weight"], last["model.drafter.midlayer.mlp.up_proj.weight"])


def test_non_finite_loss_names_the_step(tmp_path, sharp_target_dir):
    path = make_run(tmp_path, sharp_target_dir, {"max_steps": 30, "resume": False}, poison=True)
    params = load_params(path)
    with pytest.raises(FloatingPointError, match=r"train step \d+: loss is (nan|inf)"):
        train(params, params.run_dir(), progress=False)


def test_resume_after_sigkill_reaches_the_uninterrupted_weights(tmp_path, sharp_target_dir):
    full = make_run(tmp_path / "a", sharp_target_dir, {"max_steps": 9, "resume": True})
    train(load_params(full), load_params(full).run_dir(), progress=False)   # uninterrupted, in-process
    killed = make_run(tmp_path / "b", sharp_target_dir, {"max_steps": 9, "resume": True})
    kill = "callback = lambda r: os.kill(os.getpid(), signal.SIGKILL) if r['step'] == 5 else None\n"
    res = run_script(killed, kill, check=False)
    assert res.returncode == -9, res.stderr[-2000:]
    run_b = load_params(killed).run_dir()
    assert not (run_b / "train" / "final").exists()
    assert sorted(p.name for p in (run_b / "train" / "checkpoints").glob("step-*")) == ["step-000002", "step-000004"]
    run_script(killed)                                                      # resumes from step 4
    a = load_file(str(load_params(full).run_dir() / "train" / "final" / "model.safetensors"))
    b = load_file(str(run_b / "train" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    hist = json.loads((run_b / "train" / "history.json").read_text())
    assert [r["step"] for r in hist] == list(range(1, 10))
    # and resuming did change something: the weights moved after step 4
    ck8 = load_file(str(run_b / "train" / "checkpoints" / "step-000008" / "checkpoint.safetensors"))
    assert not torch.equal(ck8["model.drafter.midlayer.mlp.up_proj.weight"], b["midlayer.mlp.up_proj.weight"])
    # a checkpoint is not resumed under params that change the math
    changed = yaml.safe_load(killed.read_text())
    changed["train"]["lr"] = 1e-4
    killed.write_text(yaml.safe_dump(changed))
    with pytest.raises(RuntimeError, match="other train/data params"):
        train(load_params(killed), run_b, progress=False)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_process_training_matches_single_process_with_the_same_global_batch(tmp_path, sharp_target_dir, mode):
    """FSDP runs a two-layer drafter (one FSDP unit per decoder layer), DDP the default one layer."""
    common = {"max_steps": 4, "resume": False, "checkpoint_every": 100, "draft_layers": 2 if mode == "fsdp" else 1}
    single = make_run(tmp_path / "single", sharp_target_dir, {**common, "grad_accum": 2})
    dual = make_run(tmp_path / "dual", sharp_target_dir, {**common, "grad_accum": 1, "distributed": mode, "nproc": 2})
    train(load_params(single), load_params(single).run_dir(), progress=False)
    run_script(dual, nproc=2)
    h1 = json.loads((load_params(single).run_dir() / "train" / "history.json").read_text())
    h2 = json.loads((load_params(dual).run_dir() / "train" / "history.json").read_text())
    assert [r["step"] for r in h2] == [1, 2, 3, 4]
    for r1, r2 in zip(h1, h2):
        assert abs(r1["loss"] - r2["loss"]) < 1e-4 * max(1.0, abs(r1["loss"])), (r1["loss"], r2["loss"])
        for a1, a2 in zip(r1["step_acc"], r2["step_acc"]):
            assert abs(a1 - a2) < 1e-6
    assert h1[-1]["loss"] != h1[0]["loss"]
    s2 = json.loads((load_params(dual).run_dir() / "train" / "summary.json").read_text())
    assert s2["world_size"] == 2
    # the headless route (torchrun -m eagle3lib.train) leaves what the notebook route leaves
    section = json.loads((load_params(dual).run_dir() / "metrics.json").read_text())["train"]
    assert section["steps"] == 4 and section["world_size"] == 2 and section["stopped_by"] == s2["stopped_by"]
    assert section["final_loss"] == round(h2[-1]["loss"], 4)
    assert "| train | training steps | 4 |" in (load_params(dual).run_dir() / "index.md").read_text()


# NCCL's device rule on a CPU: a backend registered for the "cuda" device only (gloo underneath)
# refuses CPU tensors exactly as NCCL does. The worker creates the process group with the backend
# under test and trains (FSDP, held-out evals, DCP checkpoints), then resumes from the half-way
# checkpoint: every collective of the trainer runs once.
NCCL_RULE_WORKER = """
import shutil, sys
import torch
import torch.distributed as td
from torch.distributed import ProcessGroupGloo
import eagle3lib.dist
from eagle3lib.checkpoints import latest_checkpoint
from eagle3lib.dist import Dist
from eagle3lib.params import load_params
from eagle3lib.train import train
td.Backend.register_backend("cudaonly", lambda store, rank, size, timeout: ProcessGroupGloo(store, rank, size, timeout),
                            devices=["cuda"])
eagle3lib.dist.ACCELERATOR_BACKEND = "cudaonly"
backend = eagle3lib.dist.process_group_backend(cuda=True) if sys.argv[2] == "dist" else sys.argv[2]
td.init_process_group(backend=backend)
Dist().all_sum(torch.zeros(2, dtype=torch.float64))   # optimizer_step's token counts: a CPU float64 tensor
params = load_params(sys.argv[1])
layout_root = params.run_dir()
train(params, layout_root, progress=False)
td.barrier()
if td.get_rank() == 0:
    shutil.rmtree(latest_checkpoint(layout_root / "train" / "checkpoints"))   # the second leg resumes at half way
td.barrier()
train(params, layout_root, progress=False)
td.barrier()
td.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["dist", "cudaonly"])
def test_every_collective_of_training_runs_under_a_backend_that_takes_only_cuda_tensors(
        tmp_path, sharp_target_dir, backend):
    """Two FSDP ranks train, evaluate, checkpoint and resume in a process group built the way Dist
    builds one on a CUDA machine (process_group_backend: gloo for CPU tensors, the accelerator's
    backend for CUDA ones), where the accelerator's backend takes CUDA tensors only, as NCCL does.
    The negative control, a group with that backend alone (Dist's choice before: NCCL alone), stops
    at the trainer's reduction of a CPU tensor with NCCL's own error: the rule is really enforced."""
    params = make_run(tmp_path / backend, sharp_target_dir, {"max_steps": 4, "checkpoint_every": 2, "resume": True,
                                                            "distributed": "fsdp", "nproc": 2})
    script = tmp_path / "nccl_rule_worker.py"
    script.write_text(NCCL_RULE_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(params), backend]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    if backend == "cudaonly":
        assert r.returncode != 0 and "No backend type associated with device type cpu" in r.stderr, r.stderr[-3000:]
        return
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    history = json.loads((load_params(params).run_dir() / "train" / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]


def test_dist_builds_a_group_with_a_backend_for_cpu_tensors_on_a_cuda_machine(monkeypatch):
    """On a CUDA machine Dist's group maps CPU tensors to gloo and CUDA tensors to NCCL; elsewhere gloo."""
    import eagle3lib.dist as dist_module
    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(dist_module.td, "is_initialized", lambda: False)
    monkeypatch.setattr(dist_module.td, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    monkeypatch.setattr(dist_module.torch.cuda, "is_available", lambda: True)
    dist_module.Dist()
    assert seen["backend"] == "cpu:gloo,cuda:nccl"
    assert dist_module.process_group_backend(cuda=False) == "gloo"


HELDOUT_WORKER = """
import json, sys
import torch
from eagle3lib.dist import Dist
from eagle3lib.layout import RunLayout
from eagle3lib.params import load_params
from eagle3lib.train import heldout_eval, setup
params = load_params(sys.argv[1])
dist = Dist()
run = setup(params, RunLayout(params.run_dir()), dist, torch.device("cpu"))
out = {"eval": heldout_eval(run), "forwards": len(run.eval_batches), "mine": len(run.eval_batches.batches)}
with open(sys.argv[2] + f".{dist.rank}.json", "w") as f:
    json.dump(out, f)
dist.barrier()   # both ranks done before the group is destroyed (seen once: rank 1 aborted in a lone teardown)
dist.close()
"""


@pytest.mark.parametrize("mode, sequences, batches", [("fsdp", 6, 3), ("ddp", 1, 1)])
def test_each_rank_holds_a_share_of_the_held_out_set_and_the_metrics_equal_one_process(
        tmp_path, sharp_target_dir, mode, sequences, batches):
    """Two gloo ranks prepare disjoint shares of the held-out batches (the one with fewer runs a
    filler forward: DDP / FSDP forwards are collectives) and reduce the sums: the held-out metrics
    of the same weights equal one process scoring every batch."""
    overrides = {"eval_sequences": sequences, "resume": False, "max_steps": 2}
    single = make_run(tmp_path / "single", sharp_target_dir, overrides)
    dual = make_run(tmp_path / "dual", sharp_target_dir, {**overrides, "distributed": mode, "nproc": 2})
    script = tmp_path / "heldout_worker.py"
    script.write_text(HELDOUT_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for params, cmd in ((single, [sys.executable]),
                        (dual, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"])):
        r = subprocess.run(cmd + [str(script), str(params), str(params.parent / "heldout")], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    (one,) = [json.loads((single.parent / "heldout.0.json").read_text())]
    two = [json.loads((dual.parent / f"heldout.{rank}.json").read_text()) for rank in (0, 1)]
    assert one["forwards"] == one["mine"] == batches
    assert [r["forwards"] for r in two] == [(batches + 1) // 2] * 2                 # every rank runs as many
    assert sum(r["mine"] for r in two) == batches and two[1]["mine"] == batches // 2  # disjoint shares
    for r in two:
        assert r["eval"]["positions"] == one["eval"]["positions"] and sum(one["eval"]["positions"]) > 0
        assert r["eval"]["replay_rounds"] == one["eval"]["replay_rounds"]
        assert r["eval"]["acceptance_replayed"] == pytest.approx(one["eval"]["acceptance_replayed"], abs=1e-12)
        assert r["eval"]["acc"] == pytest.approx(one["eval"]["acc"], abs=1e-12)
        assert r["eval"]["loss"] == pytest.approx(one["eval"]["loss"], rel=1e-6)


def test_design_choices_are_wired_and_the_time_budget_stops_cleanly(tmp_path, sharp_target_dir):
    from eagle3lib.vocab import load_vocab
    choices = {"norm_before_residual": False, "norm_before_fc": True, "fc_input_scaling": False,
               "next_step_hidden": "post_norm",
               "init_lm_head": True, "freeze_lm_head": True, "loss_average": "all", "label_positions": "all",
               "optimizer": "muon", "draft_layers": 2,
               "feature_noise": 0.3,
               "decay": 0.5, "max_steps": 50, "time_budget_minutes": 1e-4, "resume": False}
    path = make_run(tmp_path, sharp_target_dir, choices)
    params = load_params(path)
    summary = train(params, params.run_dir(), progress=False)
    assert summary["stopped_by"] == "time_budget" and summary["steps"] == 1
    final = Path(summary["final_dir"])
    cfg = json.loads((final / "config.json").read_text())
    assert (cfg["norm_before_residual"], cfg["norm_before_fc"], cfg["next_step_hidden"]) == (False, True, "post_norm")
    weights = load_file(str(final / "model.safetensors"))
    assert "input_norm.weight" in weights                                     # norm_before_fc
    assert cfg["num_hidden_layers"] == 2 and "later_layers.0.mlp.up_proj.weight" in weights   # draft_layers
    d2t, _ = load_vocab(params.run_dir() / "data" / "vocab.safetensors")
    head = load_target_tensors(sharp_target_dir, ("lm_head",))["lm_head"]
    ids = torch.arange(len(d2t)) + d2t
    assert torch.equal(weights["lm_head.weight"], head[ids].float())          # initialised and frozen
    assert (params.run_dir() / "train" / "checkpoints" / "step-000001").is_dir()  # saved on the way out


# ---- reliability: divergence guard, cache fingerprint -------------------------------------------
def _record(step, loss, step_loss, grad_norm, lr=1e-3):
    return {"step": step, "lr": lr, "loss": loss, "step_loss": step_loss, "grad_norm": grad_norm}


def test_divergence_guard_criteria_need_consecutive_steps():
    import math

    from eagle3lib.params import TrainParams
    from eagle3lib.train import DivergenceGuard
    train_params = TrainParams(diverge_steps=3)
    uniform = math.log(128)
    # a learning run that passes the uniform level on single steps (the tiny test run's curve)
    guard = DivergenceGuard(train_params, 128)
    curve = [(18.6, [7.6, 7.6, 7.6]), (13.2, [5.38, 5.40, 5.47]), (11.9, [4.87, 4.83, 4.98]),
             (11.7, [4.75, 4.84, 4.85]), (12.3, [4.94, 5.07, 5.14]), (11.7, [4.78, 4.80, 4.79])]
    assert all(guard.check(_record(i + 1, l, sl, 5.0)) is None for i, (l, sl) in enumerate(curve))
    # stuck at uniform: trips on the 3rd consecutive step, naming the first bad one
    guard = DivergenceGuard(train_params, 128)
    assert guard.check(_record(1, 18.0, [7.0, 7.0, 7.0], 5.0)) is None
    results = [guard.check(_record(s, 11.8, [uniform] * 3, 1.0)) for s in (2, 3, 4)]
    assert results[:2] == [None, None] and "uniform" in results[2][0] and results[2][1] == 2
    # a streak broken by one good step starts over
    guard = DivergenceGuard(train_params, 128)
    for s, g in ((1, 0.0), (2, 0.0), (3, 1.0), (4, 0.0), (5, 0.0)):
        assert guard.check(_record(s, 5.0, [1.0], g)) is None
    found = guard.check(_record(6, 5.0, [1.0], 0.0))
    assert "gradient norm" in found[0] and found[1] == 4
    # far above the running minimum
    guard = DivergenceGuard(train_params, 128)
    losses = [4.0, 3.0, 2.0, 9.0, 9.5, 10.0]
    found = [guard.check(_record(s + 1, l, [1.0], 1.0)) for s, l in enumerate(losses)]
    assert found[:5] == [None] * 5 and "running minimum" in found[5][0] and found[5][1] == 4
    # diverge_steps 0: off
    guard = DivergenceGuard(TrainParams(diverge_steps=0), 128)
    assert all(guard.check(_record(s, 11.8, [uniform] * 3, 0.0)) is None for s in range(1, 20))


def test_last_good_checkpoint_is_older_than_the_first_bad_step(tmp_path):
    from eagle3lib.checkpoints import CHECKPOINT_FILE, last_good_checkpoint
    for k in (4, 6, 8):
        (tmp_path / f"step-{k:06d}").mkdir()
        (tmp_path / f"step-{k:06d}" / CHECKPOINT_FILE).write_bytes(b"x")
    # step 7's loss was computed with step-6's weights: step-4 is the last good one
    assert last_good_checkpoint(tmp_path, 7).name == "step-000004"
    assert last_good_checkpoint(tmp_path, 8).name == "step-000006"
    assert last_good_checkpoint(tmp_path, 5) is None


def test_a_diverged_run_stops_with_the_step_lr_and_last_good_checkpoint(tmp_path, sharp_target_dir):
    """lr 1e4 collapses the drafter after one step: its output is uniform (loss log(Dv) on every
    TTT step) and its gradients are exactly 0, so the loss stays finite and the old trainer ran
    to the end and reported success."""
    from eagle3lib.train import TrainingDiverged
    path = make_run(tmp_path, sharp_target_dir, {"max_steps": 20, "resume": False, "lr": 1e4})
    params = load_params(path)
    records = []
    with pytest.raises(TrainingDiverged, match=r"train step 6 \(lr [0-9.e+]+\): the run diverged: the loss stays "
                                               r"at the uniform level .* since step 2 .*Last good checkpoint: none"):
        train(params, params.run_dir(), progress=False, callback=records.append)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]                 # stopped at step 6
    assert not (params.run_dir() / "train" / "final").exists()


def test_resume_is_refused_on_another_hidden_state_cache(tmp_path, sharp_target_dir):
    overrides = {"max_steps": 4, "resume": True}
    path = make_run(tmp_path, sharp_target_dir, overrides)
    params = load_params(path)
    train(params, params.run_dir(), progress=False)
    again = train(params, params.run_dir(), progress=False)    # unchanged cache: resumed at step 4
    assert again["steps"] == 4 and again["tokens_per_s_this_run"] == 0
    manifest = params.run_dir() / "hidden" / "eval" / "manifest.json"
    shard = manifest.parent / "shard-00000.safetensors"
    original, original_shard = manifest.read_bytes(), shard.read_bytes()
    tensors = load_file(str(shard))
    tensors["final"][0] += 1                                   # a repaired / rewritten cache: intact, other bytes
    save_file(tensors, str(shard))
    changed = json.loads(original)
    changed["shards"][0].update(bytes=shard.stat().st_size, sha256=file_sha256(shard))
    manifest.write_text(json.dumps(changed))
    with pytest.raises(RuntimeError, match="trained on another hidden-state cache"):
        train(params, params.run_dir(), progress=False)
    manifest.write_bytes(original)
    shard.write_bytes(original_shard)
    assert train(params, params.run_dir(), progress=False)["tokens_per_s_this_run"] == 0
    make_run(tmp_path, sharp_target_dir, overrides, n_train=20)  # re-extracted from other data, same params
    with pytest.raises(RuntimeError, match="trained on another hidden-state cache"):
        train(params, params.run_dir(), progress=False)


def test_the_trainer_refuses_a_corrupt_or_stale_cache(tmp_path, sharp_target_dir):
    """Flipped bytes inside a shard, and a cache extracted for other data params
    (num_train changed, resume off), both trained on silently before (planted fault: train.setup
    opening HiddenCache instead of check_cache makes both cases train and return)."""
    path = make_run(tmp_path, sharp_target_dir, {"max_steps": 2, "resume": False})
    params = load_params(path)
    shard = params.run_dir() / "hidden" / "train" / "shard-00000.safetensors"
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[-100] ^= 0xFF                                      # inside the tensor data
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CacheError, match="shard-00000.safetensors.*sha256|sha256.*shard-00000"):
        train(params, params.run_dir(), progress=False)
    shard.write_bytes(original)
    assert train(params, params.run_dir(), progress=False)["steps"] == 2
    stale = load_params(path, overrides={"data": {"num_train": 7}})
    with pytest.raises(CacheError, match="extracted with other params"):
        train(stale, stale.run_dir(), progress=False)


# ---- Muon with the Newton-Schulz iteration in fp32 (eagle3lib/muon.py) ------------------------
def _muon_trajectory(make_opt, steps=3, seed=0) -> list:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(24, 10)), torch.nn.Parameter(torch.randn(6, 16))]  # tall and wide
    opt = make_opt(params)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_muon_with_bf16_newton_schulz_reproduces_torch_muon_step_for_step(adjust):
    from eagle3lib.muon import Muon
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    ours = _muon_trajectory(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))
    ref = _muon_trajectory(lambda ps: torch.optim.Muon(ps, **kw))
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_muon_in_fp32_stays_within_bf16_rounding_of_torch_muon_and_orthogonalises():
    from eagle3lib.muon import Muon, newton_schulz
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ours = _muon_trajectory(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    ref = _muon_trajectory(lambda ps: torch.optim.Muon(ps, **kw))
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            assert not torch.equal(x, y)                                # computed in another dtype
            torch.testing.assert_close(x, y, rtol=0, atol=0.02 * 0.2 * 24 ** 0.5 * 0.05)  # ~5% of one update
    g = torch.randn(32, 12, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.5 and s.max() < 1.5                              # U S' V^T with S' ~ U(0.5, 1.5)


def test_the_trainer_uses_fp32_newton_schulz_only_where_it_trains_in_fp32():
    from eagle3lib.muon import Muon
    from eagle3lib.params import TrainParams
    from eagle3lib.train import make_optimizers_for
    model = torch.nn.Module()
    model.fc = torch.nn.Linear(8, 4, bias=False)
    model.norm = torch.nn.LayerNorm(4)
    fp32 = make_optimizers_for(model, TrainParams(optimizer="muon", dtype="float32"))
    bf16 = make_optimizers_for(model, TrainParams(optimizer="muon", dtype="bfloat16"))
    assert type(fp32[0]) is Muon and fp32[0].ns_dtype == torch.float32
    assert type(bf16[0]) is torch.optim.Muon
    assert [p.shape for p in fp32[0].param_groups[0]["params"]] == [torch.Size([4, 8])]   # fc only; norm on AdamW


# ---- train.max_sequences: nested subsets of one cache (06_scaling) -------------------------------
def test_max_sequences_takes_nested_seeded_subsets_and_refuses_more_than_the_cache_holds():
    from eagle3lib.train import subset_of
    usable = list(range(0, 200, 2))
    small, large = subset_of(usable, 10, seed=5), subset_of(usable, 40, seed=5)
    assert len(small) == 10 and len(large) == 40 and set(small) <= set(large)
    assert small == sorted(small) and set(large) <= set(usable)
    assert subset_of(usable, 10, seed=5) == small and subset_of(usable, 10, seed=6) != small
    assert subset_of(usable, 100, seed=5) == usable
    with pytest.raises(ValueError, match="train.max_sequences: 101 > the 100 usable"):
        subset_of(usable, 101, seed=5)


def test_a_run_with_max_sequences_trains_on_that_many_chats(tmp_path, sharp_target_dir):
    path = make_run(tmp_path, sharp_target_dir, {"max_sequences": 8, "epochs": 1, "max_steps": None, "resume": False})
    params = load_params(path)
    summary = train(params, params.run_dir(), progress=False)
    full = make_run(tmp_path / "full", sharp_target_dir, {"epochs": 1, "max_steps": None, "resume": False})
    params_full = load_params(full)
    summary_full = train(params_full, params_full.run_dir(), progress=False)
    assert summary["train_sequences"] == 8 and summary_full["train_sequences"] == 24
    assert summary["steps"] < summary_full["steps"] and summary["epochs_done"] == pytest.approx(1.0)


def test_a_warm_start_begins_at_the_drafters_held_out_accuracy_and_trains_on(tmp_path, sharp_target_dir):
    """train.init_from_drafter: a run started from an exported drafter (train/final, fc folded into raw-aux
    units) scores on the held-out set what that drafter scored at its end, not what a fresh drafter
    scores; then it trains on. A drafter of another depth is refused naming the weight."""
    import shutil

    from eagle3lib.dist import Dist
    from eagle3lib.layout import RunLayout
    from eagle3lib.train import heldout_eval, setup
    path = make_run(tmp_path, sharp_target_dir, {"max_steps": 16, "resume": False})
    params = load_params(path)
    first = train(params, params.run_dir(), progress=False)
    shutil.copytree(params.run_dir() / "train" / "final", tmp_path / "drafter")

    def held_out(overrides: dict) -> dict:
        profile = yaml.safe_load(path.read_text())
        profile["train"].update(overrides)
        path.write_text(yaml.safe_dump(profile))
        p = load_params(path)
        run = setup(p, RunLayout(p.run_dir()), Dist(), torch.device("cpu"))
        return heldout_eval(run)

    from eagle3lib.export import LAYOUTS, export_vllm
    for layout in LAYOUTS:               # vLLM's names (layers.0.*) in the export layouts a user downloads
        export_vllm(tmp_path / "drafter", tmp_path / f"export-{layout}", sharp_target_dir, layout=layout, k=3)
    fresh = held_out({})
    for source in ["drafter"] + [f"export-{layout}" for layout in LAYOUTS]:
        warm = held_out({"init_from_drafter": str(tmp_path / source)})
        for j, acc in enumerate(first["eval"]["acc"]):
            assert warm["acc"][j] == pytest.approx(acc, abs=0.01), (source, warm["acc"], first["eval"]["acc"])
        assert warm["loss"][0] == pytest.approx(first["eval"]["loss"][0], rel=1e-3), source
        assert warm["loss"][0] < 0.9 * fresh["loss"][0], (source, warm["loss"], fresh["loss"])
    held_out({"init_from_drafter": str(tmp_path / "drafter"), "max_steps": 4, "checkpoint_every": 4})
    second = train(load_params(path), params.run_dir(), progress=False)
    assert second["steps"] == 4 and second["eval"]["loss"][0] <= 1.05 * first["eval"]["loss"][0]
    with pytest.raises(ValueError, match="later_layers|draft_layers"):
        held_out({"init_from_drafter": str(tmp_path / "drafter"), "draft_layers": 2})
