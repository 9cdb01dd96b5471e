"""The per-position losses (train.loss): kl (soft cross-entropy, unchanged), lk (-log alpha) and
lk_hybrid, alpha = sum_v min(p_v, q_v). Forward and gradients against direct reference formulas,
kl bit-identical to LinearSoftCrossEntropy, the per-step stats, the param, and a tiny lk run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_model import _loss_setup, random_drafter, small_config
from test_train import make_run

from eagle3lib.objective import (
    LinearAcceptanceLoss,
    LinearSoftCrossEntropy,
    TTTObjective,
    heldout_scores,
    step_counts,
    ttt_loss,
)
from eagle3lib.params import ParamsError, load_params

ETA = 3.0


# ---- reference formulas, written from the definitions (no chunks, no hand-derived gradient) -------------
def reference_losses(z: torch.Tensor, p: torch.Tensor, kind: str, eta: float = ETA) -> torch.Tensor:
    """z [N, Dv] logits, p [N, Dv] target distribution -> per-row loss [N] (autograd-differentiable)."""
    q = torch.softmax(z, -1)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "kl_ce":                      # soft cross-entropy, what kl minimises
        return -(p * torch.log_softmax(z, -1)).sum(-1)
    if kind == "lk":
        return -torch.log(alpha.clamp_min(LinearAcceptanceLoss.LOG_EPS))
    kl = (torch.special.xlogy(p, p) - p * torch.log_softmax(z, -1)).sum(-1)
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha)


def random_problem(dtype, seed=0, N=37, H=16, Dv=23, M=29, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(N, H, generator=g, dtype=dtype)
    weight = torch.randn(Dv, H, generator=g, dtype=dtype) / H ** 0.5
    p = torch.softmax(sharp * torch.randn(M, Dv, generator=g, dtype=dtype), -1)
    p[0, :5] = 0                                                           # zeros in p (xlogy, min)
    p = p / p.sum(-1, keepdim=True)
    index = torch.randint(M, (N,), generator=g)
    index[0] = 0
    return rows, weight, p, index


@pytest.mark.parametrize("kind", ["lk", "lk_hybrid"])
def test_forward_matches_the_reference_formula_across_chunks(kind, monkeypatch):
    monkeypatch.setattr(LinearAcceptanceLoss, "CHUNK", 8)                  # 37 rows: 5 chunks, a ragged last
    rows, weight, p, index = random_problem(torch.float32)
    loss, ce, pred = LinearAcceptanceLoss.apply(rows, weight, p, index, kind, ETA)
    z = (rows @ weight.T).double()
    pi = p[index].double()
    torch.testing.assert_close(loss.double(), reference_losses(z, pi, kind).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ce.double(), reference_losses(z, pi, "kl_ce").sum(), rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, (rows @ weight.T).argmax(-1))
    assert not ce.requires_grad and pred.dtype == torch.long


@pytest.mark.parametrize("kind", ["lk", "lk_hybrid"])
def test_gradients_equal_autograd_on_the_reference_formula(kind, monkeypatch):
    monkeypatch.setattr(LinearAcceptanceLoss, "CHUNK", 8)
    rows, weight, p, index = random_problem(torch.float64, seed=1)
    rows.requires_grad_(True)
    weight.requires_grad_(True)
    scale = torch.tensor(0.7, dtype=torch.float64)                        # an upstream gradient != 1
    loss, _, _ = LinearAcceptanceLoss.apply(rows, weight, p, index, kind, ETA)
    g_rows, g_w = torch.autograd.grad(scale * loss, (rows, weight))
    ref = reference_losses(rows @ weight.T, p[index], kind).sum()
    r_rows, r_w = torch.autograd.grad(scale * ref, (rows, weight))
    torch.testing.assert_close(g_rows, r_rows, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g_w, r_w, rtol=1e-9, atol=1e-12)
    assert g_rows.abs().sum() > 0


def test_lk_gradient_passes_gradcheck_in_float64():
    """-log alpha is differentiable away from ties p_v = q_v (random data has none): its gradient
    is the true derivative. (lk_hybrid's stop-gradient weight makes its gradient not a derivative
    of its value, so it is checked against autograd on the reference formula instead.)"""
    rows, weight, p, index = random_problem(torch.float64, seed=2, N=6, H=5, Dv=7, M=4)
    rows.requires_grad_(True)
    weight.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda r, w: LinearAcceptanceLoss.apply(r, w, p, index, "lk", ETA)[0], (rows, weight))


def test_lk_is_zero_exactly_when_the_drafter_matches_the_target():
    """alpha = 1 when q = p: -log alpha = 0 and the hybrid's KL and TV terms vanish; a wrong q costs more."""
    rows, weight, _, _ = random_problem(torch.float64, seed=3)
    q = torch.softmax(rows @ weight.T, -1)
    index = torch.arange(len(q))
    for kind in ("lk", "lk_hybrid"):
        same, _, _ = LinearAcceptanceLoss.apply(rows, weight, q, index, kind, ETA)
        other, _, _ = LinearAcceptanceLoss.apply(rows, weight, q.roll(1, 0), index, kind, ETA)
        assert abs(float(same)) < 1e-10 and float(other) > 0.1


def test_unknown_kind_is_refused():
    rows, weight, p, index = random_problem(torch.float32)
    with pytest.raises(ValueError, match="unknown kind 'tv'"):
        LinearAcceptanceLoss.apply(rows, weight, p, index, "tv", ETA)


# ---- inside the TTT loss ------------------------------------------------------------------------------
def _ttt(loss_kind: str, backward: bool = True, seed: int = 5):
    model, items, head, J, prep = _loss_setup(seed=seed)
    batch = prep(items)
    model.zero_grad()
    states = model.ttt_hidden(batch["aux"], batch["input_ids"], J)
    kwargs = {} if loss_kind is None else {"loss": loss_kind}
    loss, stats, correct = ttt_loss(states, model.lm_head, model.d2t, batch, step_counts(batch["tgt_u"], J), 0.8,
                                    flags=True, **kwargs)
    if backward:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, stats, correct, grads, (model, batch, J)


def test_kl_is_bit_identical_to_the_soft_cross_entropy_of_linear_soft_cross_entropy():
    """loss: kl (and the default) runs LinearSoftCrossEntropy exactly as before the loss choice existed."""
    loss_default, stats_default, _, g_default, _ = _ttt(None)
    loss_kl, stats_kl, _, g_kl, (model, batch, J) = _ttt("kl")
    assert torch.equal(loss_kl, loss_default) and torch.equal(stats_kl, stats_default)
    assert g_kl.keys() == g_default.keys() and all(torch.equal(g_kl[n], g_default[n]) for n in g_kl)
    # today's loop, written out: LinearSoftCrossEntropy per step, weighted decay**j / count_j
    with torch.no_grad():
        states = model.ttt_hidden(batch["aux"], batch["input_ids"], J)
    u, b, denom = batch["tgt_u"], batch["tgt_b"], step_counts(batch["tgt_u"], J)
    total = states[0].new_zeros((), dtype=torch.float32)
    for j, s in enumerate(states):
        keep = (u >= 1 + j).nonzero().squeeze(-1)
        loss_sum, _ = LinearSoftCrossEntropy.apply(s[b[keep], u[keep] - 1 - j], model.lm_head.weight,
                                                   batch["target_p"], keep)
        total = total + (0.8 ** j) * loss_sum / denom[j].to(loss_sum.dtype)
        assert torch.equal(stats_kl[j, 0], loss_sum.double())
    assert torch.equal(total, loss_kl)


@pytest.mark.parametrize("kind", ["lk", "lk_hybrid"])
def test_lk_stats_keep_their_meaning_and_the_loss_its_weighting(kind):
    """stats [J, 3] = (summed soft CE, correct top-1, count) whatever is minimised: bit-equal to kl's
    stats on the same states; the loss is sum_j decay**j * (sum of the chosen per-position loss) / count_j."""
    _, stats_kl, correct_kl, _, _ = _ttt("kl")
    loss, stats, correct, grads, (model, batch, J) = _ttt(kind)
    assert torch.equal(stats, stats_kl) and torch.equal(correct, correct_kl)
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    with torch.no_grad():
        logits = model.ttt_forward(batch["aux"], batch["input_ids"], J)       # J x [B, T, Dv]
    u, b = batch["tgt_u"], batch["tgt_b"]
    ref = 0.0
    for j in range(J):
        keep = (u >= 1 + j).nonzero().squeeze(-1)
        z = logits[j][b[keep], u[keep] - 1 - j].double()
        pj = batch["target_p"][keep].double()
        ref += 0.8 ** j * reference_losses(z, pj, kind).sum() / len(keep)
        assert int(stats[j, 2]) == len(keep)
        torch.testing.assert_close(stats[j, 0], reference_losses(z, pj, "kl_ce").sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_ttt_objective_takes_the_loss_choice_and_refuses_an_unknown_one():
    cfg = small_config(5, True)
    drafter = random_drafter(cfg, 5)
    assert TTTObjective(drafter, 2, 0.8, loss="lk_hybrid", lk_eta=1.5).lk_eta == 1.5
    with pytest.raises(ValueError, match="train.loss"):
        TTTObjective(drafter, 2, 0.8, loss="tv")


# ---- the param ----------------------------------------------------------------------------------------
def _profile(tmp_path, train: dict):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"inherit": str(Path(__file__).resolve().parents[1] / "params" / "ci.yaml"),
                                    "train": train}))
    return path


def test_train_loss_param_defaults_to_kl_and_is_validated(tmp_path, ci_params):
    assert ci_params.train.loss == "kl" and ci_params.train.lk_eta == 3.0
    assert load_params(_profile(tmp_path, {"loss": "lk_hybrid", "lk_eta": 2})).train.loss == "lk_hybrid"
    with pytest.raises(ParamsError, match=r"^train\.loss: must be one of \['kl', 'lk', 'lk_hybrid'\]"):
        load_params(_profile(tmp_path, {"loss": "tv"}))
    with pytest.raises(ParamsError, match=r"^train\.lk_eta"):
        load_params(_profile(tmp_path, {"lk_eta": -1.0}))


# ---- training with it ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_map_target_dir(tmp_path_factory) -> Path:
    """A tiny Llama (H=64, 6 layers, 320 tokens) whose next-token distribution is a sharp function of
    the current token: the residual stream stays close to the token's embedding (attention and MLP
    outputs scaled by 0.1) and lm_head row v is 8 x the embedding of token perm[v], so the top-1 after
    token x is perm^-1(x). A drafter learns that from held-in tokens within a few steps and it carries
    over to held-out chats (the random targets of test_train do not show a top-1 gain in 16 steps)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, initializer_range=0.02)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        model.lm_head.weight.copy_(8.0 * model.model.embed_tokens.weight[torch.randperm(320)])
    out = tmp_path_factory.mktemp("token_map_target")
    model.save_pretrained(out, safe_serialization=True)
    return out


def test_a_tiny_lk_run_raises_the_heldout_acceptance_estimate(tmp_path, token_map_target_dir):
    from eagle3lib.dist import Dist
    from eagle3lib.layout import RunLayout
    from eagle3lib.train import setup, train
    path = make_run(tmp_path, token_map_target_dir, {"max_steps": 16, "resume": False, "loss": "lk"},
                    draft_vocab_size=320)
    params = load_params(path)
    run0 = setup(params, RunLayout(params.run_dir()), Dist(), torch.device("cpu"))  # the drafter train() starts from
    assert run0.scoring.objective.loss == "lk"
    before = heldout_scores(run0.model, run0.eval_batches, params.train.ttt_steps, run0.scoring.amp)
    summary = train(params, params.run_dir(), progress=False)
    after = summary["eval"]
    assert summary["steps"] == 16
    # replayed at a smaller decoding k too (05's eval.k below train.ttt_steps): at most k + 1 per round,
    # and never more than the replay at ttt_steps; the replay at ttt_steps itself unchanged
    at_k1 = heldout_scores(run0.model, run0.eval_batches, params.train.ttt_steps, run0.scoring.amp, decode_k=1)
    assert at_k1["decode_k"] == 1 and at_k1["acceptance_replayed"] == before["acceptance_replayed"]
    assert 1.0 <= at_k1["acceptance_replayed_decode_k"] <= min(2.0, before["acceptance_replayed"])
    # measured: 1.00 -> 1.14 (kl: 1.00 -> 1.12); step 0 has ~1 % top-1 hits
    assert after["acceptance_estimate"] > before["acceptance_estimate"] + 0.05, (before, after)
    assert after["acc"][0] > before["acc"][0] + 0.05, (before, after)
