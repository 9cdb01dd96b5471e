"""Speculative decoding is lossless: at T=0 the tokens equal plain greedy decoding (fp32), at T>0
the output distribution equals the target's (chi-square against the exact distribution).
Also: tau bounds, statistics bookkeeping, the drafter's cache handling, the n-gram matcher."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from drafter_fit import fit_drafter, greedy_sequences

from eagle3lib import decode
from eagle3lib.decode import (
    DecodeStats,
    Eagle3Proposer,
    NgramProposer,
    Proposal,
    Proposer,
    greedy_generate,
    random_drafter,
    speculative_generate,
    target_forward,
)
from eagle3lib.target import load_target, load_target_tensors

MAX_NEW = 40
# Token-id prompts with some repetition (so prompt lookup finds matches) and without.
PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 9690, 198, 2683],
           [100, 200, 300, 100, 200, 300, 400, 100, 200],
           [5000, 17, 17, 42, 31337, 8, 15]]


# ---------------------------------------------------------------------------------------------
# Fixtures: targets and drafters
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread (two threads on a busy 2-core machine are ~20x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    """The shared tiny target: random init std 0.02, whose greedy output repeats one token."""
    return load_target(tiny_target_dir, "float32"), tiny_target_dir


@pytest.fixture(scope="module")
def lively(tiny_target_dir, tmp_path_factory):
    """The same architecture with init std 0.1: greedy outputs vary (runs, switches, new tokens)."""
    from transformers import AutoConfig, LlamaForCausalLM
    cfg = AutoConfig.from_pretrained(str(tiny_target_dir))
    cfg.initializer_range = 0.1
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).float().eval()
    out = tmp_path_factory.mktemp("lively_target")
    model.save_pretrained(out, safe_serialization=True)
    return load_target(out, "float32"), out


def _draft_vocab_from(sequences, vocab_size, size):
    """Draft vocabulary: the tokens of `sequences`, filled up with the lowest ids (exercises d2t)."""
    from eagle3lib.vocab import build_draft_vocab
    counts = torch.bincount(torch.tensor(sum(sequences, [])), minlength=vocab_size)
    return build_draft_vocab(counts, size)


@pytest.fixture(scope="module")
def fitted(lively):
    """A drafter fitted in seconds to the lively target's greedy continuations of PROMPTS."""
    from eagle3lib.model import Eagle3Config, Eagle3Drafter
    target, path = lively
    seqs = greedy_sequences(target, PROMPTS, MAX_NEW)
    d2t, t2d = _draft_vocab_from(seqs, target.config.vocab_size, 256)
    torch.manual_seed(0)
    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=256, aux_layer_ids=[1, 3, 4])
    w = load_target_tensors(path)
    drafter = Eagle3Drafter.from_target_weights(cfg, d2t, t2d, w["embed"], w["lm_head"])
    losses = fit_drafter(target, drafter, seqs, steps=60, lr=5e-3)
    assert losses[-1] < 0.5 * losses[0], f"the fit did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
    return drafter


def make_proposer(kind, target_and_path, fitted_drafter=None):
    target, path = target_and_path
    if kind == "ngram":
        return NgramProposer(1, 4)
    if kind == "random":
        return Eagle3Proposer(random_drafter(path, draft_vocab_size=1024, seed=3))
    if kind == "fitted":
        return Eagle3Proposer(fitted_drafter)
    raise ValueError(kind)


def check_stats(stats: DecodeStats, out: list, k: int):
    """Bookkeeping that must hold for every run."""
    assert stats.num_new_tokens == len(out)
    assert stats.target_forwards == 1 + len(stats.rounds)
    assert 1 + sum(r.emitted for r in stats.rounds) == len(out)
    assert all(0 <= r.accepted <= r.drafted <= k for r in stats.rounds)
    assert all(1 <= r.emitted <= r.accepted + 1 for r in stats.rounds)
    assert 1.0 <= stats.tau <= k + 1
    assert 1.0 <= stats.acceptance_length <= k + 1
    rates = stats.per_position_acceptance()
    assert len(rates) == k and all(0.0 <= x <= 1.0 for x in rates)
    assert all(a >= b for a, b in zip(rates, rates[1:])), "cumulative rates cannot increase with position"


# ---------------------------------------------------------------------------------------------
# T = 0: lossless
# ---------------------------------------------------------------------------------------------


def test_greedy_generate_matches_transformers_generate(lively):
    target, _ = lively
    for prompt in PROMPTS:
        ours, stats = greedy_generate(target, prompt, MAX_NEW)
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                              do_sample=False)[0, len(prompt):].tolist()
        assert ours[:len(ref)] == ref         # transformers may stop earlier, at its EOS token
        assert len(ref) == MAX_NEW or ref[-1] == target.generation_config.eos_token_id
        assert stats.target_forwards == MAX_NEW and stats.tau == 1.0


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("target_name,kind", [("tiny", "ngram"), ("tiny", "random"),
                                              ("lively", "ngram"), ("lively", "random"),
                                              ("lively", "fitted")])
def test_greedy_speculative_equals_plain_greedy(request, target_name, kind, k, fitted):
    target_and_path = request.getfixturevalue(target_name)
    target = target_and_path[0]
    pooled = []
    for prompt in PROMPTS:
        plain, _ = greedy_generate(target, prompt, MAX_NEW)
        proposer = make_proposer(kind, target_and_path, fitted)
        out, stats = speculative_generate(target, proposer, prompt, MAX_NEW, k)
        assert out == plain, f"{kind} k={k}: speculative output differs from greedy for prompt {prompt}"
        check_stats(stats, out, k)
        pooled.append(stats)
    if kind in ("ngram", "fitted") and target_name == "lively" and k > 1:
        # the run must have exercised both branches of the verifier
        accepted = sum(s.num_accepted for s in pooled)
        drafted = sum(s.num_draft_tokens for s in pooled)
        assert accepted > 0, f"{kind}: no draft was accepted, the test proves nothing"
        assert accepted < drafted, f"{kind}: no draft was rejected, the test proves nothing"


class CheckedEagle3Proposer(Eagle3Proposer):
    """Recomputes every proposal from scratch (fresh cache, full target forward over the
    committed prefix) and compares: catches any cache crop / aux-state bookkeeping error."""

    def __init__(self, drafter, target):
        super().__init__(drafter)
        self.target = target
        self.checked = 0

    @torch.no_grad()
    def propose(self, tokens, k, temperature=0.0, generator=None):
        proposal = super().propose(tokens, k, temperature, generator)
        from eagle3lib.model import DraftKVCache
        L = len(tokens)
        _, aux = target_forward(self.target, tokens[:-1], decode._new_cache(self.target), self.aux_layer_ids)
        cache = DraftKVCache()
        g = self.drafter.fuse(aux)                                            # [1, L-1, H]
        logits, hidden = self.drafter(g, torch.tensor([tokens[1:]]), torch.arange(L - 1)[None], cache)
        for j in range(k):
            assert torch.allclose(logits[0, -1], self.last_draft_logits[j], atol=1e-4), \
                f"draft step {j} at length {L}: cached drafting differs from a fresh recompute"
            d = int(self.drafter.draft_to_target(logits[0, -1].argmax()))
            assert d == proposal.tokens[j]
            logits, hidden = self.drafter(hidden[:, -1:], torch.tensor([[d]]),
                                          torch.tensor([[L - 1 + j]]), cache)
        self.checked += 1
        return proposal


def test_eagle3_proposer_cache_equals_fresh_recompute(lively, fitted):
    target, _ = lively
    proposer = CheckedEagle3Proposer(fitted, target)
    out, stats = speculative_generate(target, proposer, PROMPTS[0], 30, 3)
    assert proposer.checked == len(stats.rounds) > 3
    assert 0 < stats.num_accepted < stats.num_draft_tokens   # crops after partial acceptance happened


class AlwaysWrong(Proposer):
    """Proposes k tokens whose first one is never the target's greedy choice."""

    def __init__(self, reference: list, prompt_len: int, vocab_size: int):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab_size

    def propose(self, tokens, k, temperature=0.0, generator=None):
        nxt = self.reference[len(tokens) - self.prompt_len]          # the true token after tokens
        return Proposal(tokens=[(nxt + 1 + i) % self.vocab for i in range(k)])


class Oracle(Proposer):
    """Proposes the true greedy continuation."""

    def __init__(self, reference: list, prompt_len: int):
        self.reference, self.prompt_len = reference, prompt_len

    def propose(self, tokens, k, temperature=0.0, generator=None):
        i = len(tokens) - self.prompt_len
        return Proposal(tokens=self.reference[i:i + k])


@pytest.mark.parametrize("k", [1, 4])
def test_tau_extremes(lively, k):
    target, _ = lively
    prompt = PROMPTS[2]
    ref, _ = greedy_generate(target, prompt, 60)
    out, stats = speculative_generate(target, AlwaysWrong(ref, len(prompt), target.config.vocab_size),
                                      prompt, 20, k)
    assert out == ref[:20]
    assert stats.tau == 1.0 and stats.num_accepted == 0 and stats.acceptance_length == 1.0
    assert stats.num_draft_tokens == k * len(stats.rounds)
    rounds = 4
    n = 1 + rounds * (k + 1)                 # prefill token + `rounds` fully accepted rounds
    out, stats = speculative_generate(target, Oracle(ref, len(prompt)), prompt, n, k)
    assert out == ref[:n]
    assert stats.acceptance_length == k + 1 and stats.tau == n / (1 + rounds)
    assert stats.per_position_acceptance() == [1.0] * k


def test_eos_stops_generation(lively):
    target, _ = lively
    prompt = PROMPTS[1]
    ref, _ = greedy_generate(target, prompt, MAX_NEW)
    eos = ref[7]
    stop = ref.index(eos) + 1
    plain, _ = greedy_generate(target, prompt, MAX_NEW, eos_token_id=eos)
    assert plain == ref[:stop]
    for k in (1, 4):
        out, _ = speculative_generate(target, Oracle(ref, len(prompt)), prompt, MAX_NEW, k, eos_token_id=[eos, 999999])
        assert out == ref[:stop]


def test_ngram_matcher():
    p = NgramProposer(min_n=1, max_n=3)
    # longest suffix n-gram "7 8 9" occurred at 0 and 4; earliest is vLLM's choice
    ctx = [7, 8, 9, 1, 7, 8, 9, 2, 3, 7, 8, 9]
    assert p.find(ctx, 2) == [1, 7]
    assert NgramProposer(1, 3, match="latest").find(ctx, 2) == [2, 3]
    assert p.find(ctx, 10) == [1, 7, 8, 9, 2, 3, 7, 8, 9]     # may propose fewer than k at the end
    assert NgramProposer(2, 3).find([1, 2, 3, 4, 3], 2) == []  # only a 1-gram matches
    assert NgramProposer(1, 3).find([1, 2, 3, 4, 3], 2) == [4, 3]
    assert p.find([5], 3) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# ---------------------------------------------------------------------------------------------
# T > 0: the output distribution is the target's
# ---------------------------------------------------------------------------------------------

SMALL_V = 6
N_SAMPLES = 1200
# (n tokens observed, k drafts, temperature). k=2 with n=3: the bonus token of a fully accepted
# round is always cut by the token limit. k=1 with n=3: a fully accepted first round emits its
# bonus token as x_3 (observed), and T=0.6 makes a missing division by T visible.
CASES = {"k2_T1": (3, 2, 1.0), "k1_T0.6": (3, 1, 0.6)}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 4-layer target over a 6-token vocabulary: its exact distributions are computable."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=SMALL_V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.3,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).float().eval()
    out = tmp_path_factory.mktemp("small_target")
    model.save_pretrained(out, safe_serialization=True)
    return load_target(out, "float32"), out


def exact_joint(target, prompt, n: int, temperature: float) -> torch.Tensor:
    """p(x_1..x_n | prompt) at `temperature` for every sequence: [V]*n (float64)."""
    V = SMALL_V
    seqs = torch.cartesian_prod(*[torch.arange(V)] * n).reshape(-1, n)           # [V^n, n]
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)     # [V^n, P+n]
    with torch.no_grad():
        logits = target(input_ids=ids).logits.double()                            # [V^n, P+n, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)[:, len(prompt) - 1:-1]   # [V^n, n, V]
    joint = logp.gather(-1, seqs[..., None]).squeeze(-1).sum(-1).exp()            # [V^n]
    return joint.reshape([V] * n)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def sample_first_tokens(target, make, prompt, n, k, temperature, seed, samples=N_SAMPLES):
    """Counts [V]*n of the first n tokens over `samples` runs, and the verification outcomes:
    accepted / rejected drafts, and bonus tokens emitted after a fully accepted round."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros([SMALL_V] * n)
    accepted = rejected = bonus = 0
    for _ in range(samples):
        out, stats = speculative_generate(target, make(), prompt, n, k, temperature=temperature, generator=gen)
        counts[tuple(out)] += 1
        accepted += stats.num_accepted
        rejected += stats.num_draft_tokens - stats.num_accepted
        bonus += sum(1 for r in stats.rounds if 0 < r.drafted == r.accepted and r.emitted == r.accepted + 1)
    return counts, accepted, rejected, bonus


@pytest.fixture(scope="module")
def small_drafter(small):
    _, path = small
    d = random_drafter(path, aux_layer_ids=[1, 2, 3], draft_vocab_size=4, seed=2)
    torch.manual_seed(2)
    d.reset_parameters(std=0.5)      # a peaked q, far from p: many rejections and acceptances
    return d


PROMPT = [3, 3, 3, 3]                    # lookup proposes 3s; p(3 | ...) is about 0.5


def proposer_factory(kind, small_drafter):
    return (lambda: NgramProposer(1, 3)) if kind == "ngram" else (lambda: Eagle3Proposer(small_drafter))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_sampling_distribution_matches_target(small, small_drafter, kind, case):
    """x_1 comes from the prefill, x_2 and x_3 from verification (k2_T1: two drafts, the bonus
    never observed; k1_T0.6: one draft, the bonus observed as x_3, at a temperature != 1).
    Planted faults shown caught: see test_chi_square_rejects_mutated_samplers."""
    target, _ = small
    n, k, T = CASES[case]
    counts, accepted, rejected, bonus = sample_first_tokens(target, proposer_factory(kind, small_drafter),
                                                            PROMPT, n, k, T, seed=11)
    assert accepted > 100 and rejected > 100, (accepted, rejected)
    if k == 1:
        assert bonus > 100, f"only {bonus} bonus tokens observed"
    p = exact_joint(target, PROMPT, n, T)
    pval = chi_square_pvalue(counts, p)
    assert pval > 1e-3, f"{kind} {case}: joint of the first {n} tokens deviates from the target (p={pval:.2e})"
    # the second token alone (decided by the first verification round)
    pval2 = chi_square_pvalue(counts.sum(dim=(0, 2)), p.sum(dim=(0, 2)))
    assert pval2 > 1e-3, f"{kind} {case}: second-token distribution deviates (p={pval2:.2e})"


def mutated_verify_sampled(mutation: Optional[str]):
    """decode.verify_sampled with one planted fault (None: a faithful copy).

    resample_from_p: after a rejection sample from p_i instead of norm(max(0, p_i - q_i));
    bonus_from_previous_row: the bonus after full acceptance from p_{m-1} instead of p_m;
    no_temperature: p = softmax(logits) without the division by T."""
    def verify(logits, drafts, q, temperature, generator):
        p = torch.softmax(logits.float().cpu() / (1.0 if mutation == "no_temperature" else temperature), dim=-1)
        for i, d in enumerate(drafts):
            q_d = float(q[i, d]) if q is not None else 1.0
            u = float(torch.rand((), generator=generator))
            if u < min(1.0, float(p[i, d]) / q_d):
                continue
            if mutation == "resample_from_p":
                residual = p[i].clone()
            elif q is not None:
                residual = (p[i] - q[i]).clamp_min(0.0)
            else:
                residual = p[i].clone()
                residual[d] = 0.0
            if float(residual.sum()) <= 0.0:
                residual = p[i]
            return i, decode._sample(residual / residual.sum(), generator)
        m = len(drafts)
        row = m - 1 if mutation == "bonus_from_previous_row" and m > 0 else m
        return m, decode._sample(p[row], generator)
    return verify


def test_mutated_sampler_copy_is_faithful(small, small_drafter, monkeypatch):
    """Without a mutation the copy draws exactly the real verifier's samples (same seed), so the
    mutants below differ from the real code by their mutation only."""
    target, _ = small
    n, k, T = CASES["k1_T0.6"]
    make = proposer_factory("eagle3", small_drafter)
    real = sample_first_tokens(target, make, PROMPT, n, k, T, seed=5, samples=100)
    monkeypatch.setattr(decode, "verify_sampled", mutated_verify_sampled(None))
    copy = sample_first_tokens(target, make, PROMPT, n, k, T, seed=5, samples=100)
    assert torch.equal(real[0], copy[0]) and real[1:] == copy[1:]


@pytest.mark.parametrize("mutation", ["resample_from_p", "bonus_from_previous_row", "no_temperature"])
def test_chi_square_rejects_mutated_samplers(small, small_drafter, monkeypatch, mutation):
    """The eagle3 k1_T0.6 case of test_sampling_distribution_matches_target (half the samples),
    on a verifier with one planted fault: the chi-square test must reject it, p < 1e-4, ten times
    below the 1e-3 the real verifier must pass. Measured with 1200 samples, seed 11: real p=0.20;
    resample_from_p 3e-19, bonus_from_previous_row 0, no_temperature 3e-173; the k2_T1 case
    passes bonus_from_previous_row with the real code's p (0.89: the bonus is never observed)
    and cannot see no_temperature (T=1)."""
    target, _ = small
    n, k, T = CASES["k1_T0.6"]
    monkeypatch.setattr(decode, "verify_sampled", mutated_verify_sampled(mutation))
    counts, *_ = sample_first_tokens(target, proposer_factory("eagle3", small_drafter), PROMPT, n, k, T,
                                     seed=11, samples=N_SAMPLES // 2)
    pval = chi_square_pvalue(counts, exact_joint(target, PROMPT, n, T))
    assert pval < 1e-4, f"{mutation}: the chi-square test did not reject the mutated sampler (p={pval:.2e})"


def test_chi_square_detects_a_wrong_sampler(small, small_drafter, monkeypatch):
    """The same test on a broken verifier (every draft accepted: samples follow q, not p) fails."""
    target, _ = small
    monkeypatch.setattr(decode, "verify_sampled",
                        lambda logits, drafts, q, T, g: (len(drafts), decode._sample(
                            torch.softmax(logits[len(drafts)].float() / T, -1), g)))
    counts, *_ = sample_first_tokens(target, lambda: Eagle3Proposer(small_drafter), PROMPT, 3, 2, 1.0, seed=11)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT, 3, 1.0)) < 1e-6
