"""Reference speculative decoding on a transformers target (batch size 1, chain drafts).

One verifier, several proposers behind one interface:

- `NgramProposer`   prompt lookup: the tokens that followed an earlier occurrence of the
                    context's suffix (as vLLM's `ngram` method);
- `Eagle3Proposer`  an EAGLE-3 drafter (`model.Eagle3Drafter`) fed with the target's auxiliary
                    hidden states; random or trained weights alike.

The loop (eagle3.md, "Inference and evaluation"):

    prefill   the target reads the prompt x_0..x_n            -> x_{n+1}, aux states g_0..g_n
    repeat    the proposer drafts d_1..d_m (m <= k, maybe 0)
              the target reads [x_last, d_1..d_m] in ONE forward (the verify forward)
              T=0: accept the longest prefix equal to the target argmax, plus the bonus token
              T>0: rejection sampling (accept d_i with prob min(1, p/q), else sample from
                   norm(max(0, p - q)); bonus from p), which keeps the target distribution
              crop the target KV cache to the accepted prefix, hand the accepted positions'
              aux states to the proposer

At T=0 the emitted tokens equal plain greedy decoding (tests check it in fp32).
Acceptance length tau = emitted tokens / target forwards (prefill included), 1 <= tau <= k+1.

This module never imports the trainer; the drafter comes from `model.py`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from transformers import AutoConfig, DynamicCache

from .model import DraftKVCache, Eagle3Config, Eagle3Drafter
from .target import load_target_tensors, text_config

# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


@dataclass
class RoundStats:
    """One draft-and-verify round."""
    drafted: int        # draft tokens proposed (m)
    accepted: int       # draft tokens accepted (a <= m)
    emitted: int        # tokens added to the output (a + 1, fewer at the end / at EOS)
    draft_s: float      # wall time of the proposer
    verify_s: float     # wall time of the target verify forward + acceptance


@dataclass
class DecodeStats:
    """Everything measured while generating one sequence."""
    k: int
    prefill_s: float = 0.0
    total_s: float = 0.0
    num_new_tokens: int = 0
    target_forwards: int = 0                     # prefill + one per round
    rounds: list = field(default_factory=list)   # list[RoundStats]

    @property
    def tau(self) -> float:
        """Emitted tokens per target forward (prefill included)."""
        return self.num_new_tokens / max(self.target_forwards, 1)

    @property
    def num_drafts(self) -> int:
        """Rounds in which the proposer drafted at least one token (vLLM's `num_drafts`)."""
        return sum(1 for r in self.rounds if r.drafted > 0)

    @property
    def num_draft_tokens(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def num_accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance_length(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted draft tokens / drafting rounds."""
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 1.0

    def token_marks(self) -> list:
        """How each new token was produced, in output order: j >= 0 an accepted draft token at draft
        position j (0 = the first draft of its round), -1 the target's own token (the prefill's
        first token, each round's correction or bonus token). A round cut at EOS or at the token
        budget emits fewer tokens than it accepted: its marks stop there."""
        marks = [-1] if self.num_new_tokens else []
        for r in self.rounds:
            drafted = min(r.accepted, r.emitted)
            marks += list(range(drafted)) + [-1] * (r.emitted - drafted)
        if not self.rounds:                     # plain decoding: every token is the target's
            marks = [-1] * self.num_new_tokens
        return marks

    def accepted_per_position(self) -> list:
        """accepted_per_position()[i] = rounds whose draft i+1 was accepted (vLLM's per_pos)."""
        return [sum(1 for r in self.rounds if r.accepted > i) for i in range(self.k)]

    def per_position_acceptance(self) -> list:
        """Rate at draft position i+1: accepted there / drafting rounds (vLLM's definition)."""
        n = self.num_drafts
        return [c / n if n else 0.0 for c in self.accepted_per_position()]

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> dict:
        return {"new_tokens": self.num_new_tokens, "target_forwards": self.target_forwards,
                "tau": self.tau, "acceptance_length": self.acceptance_length,
                "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted": self.num_accepted,
                "per_position_acceptance": self.per_position_acceptance(),
                "tokens_per_s": self.tokens_per_s, "total_s": self.total_s,
                "prefill_s": self.prefill_s,
                "draft_s": sum(r.draft_s for r in self.rounds),
                "verify_s": sum(r.verify_s for r in self.rounds)}


def merge_stats(stats: Sequence[DecodeStats]) -> dict:
    """Pool several sequences' statistics (counts summed, rates recomputed from the sums)."""
    if not stats:
        raise ValueError("merge_stats: no statistics to merge")
    k = max(s.k for s in stats)
    pooled = DecodeStats(k=k)
    for s in stats:
        pooled.prefill_s += s.prefill_s
        pooled.total_s += s.total_s
        pooled.num_new_tokens += s.num_new_tokens
        pooled.target_forwards += s.target_forwards
        pooled.rounds.extend(s.rounds)
    return pooled.summary()


# ---------------------------------------------------------------------------------------------
# The target: one forward with a KV cache (and optionally the auxiliary hidden states)
# ---------------------------------------------------------------------------------------------


def _as_id_list(input_ids) -> list:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"batch size 1 only, got input_ids of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    return ids


def _eos_set(eos_token_id) -> set:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _new_cache(target):
    return DynamicCache(config=target.config)


def _crop_target_cache(cache, keep: int) -> None:
    """Drop everything after the first `keep` positions of an HF DynamicCache. A negative
    argument to `crop` removes that many tokens (the positive form is deprecated)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _device(module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def target_forward(target, token_ids: list, cache, aux_layer_ids: Optional[Sequence[int]] = None):
    """The target reads `token_ids` after the cached prefix.

    Returns (logits [T, V] float32, aux [1, T, len(aux_layer_ids) * H] or None). The cache
    grows by T. aux[k-th block] is transformers' `output_hidden_states[aux_layer_ids[k]]`,
    the residual stream entering decoder layer aux_layer_ids[k] (eagle3.md, "Notation")."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=_device(target))  # [1, T]
    out = target(input_ids=ids, past_key_values=cache, use_cache=True,
                 output_hidden_states=aux_layer_ids is not None)
    logits = out.logits[0].float()                                              # [T, V]
    aux = None
    if aux_layer_ids is not None:
        aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)  # [1, T, 3H]
    return logits, aux


# ---------------------------------------------------------------------------------------------
# Plain greedy decoding (the baseline and the T=0 reference)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_generate(target, input_ids, max_new_tokens: int, eos_token_id=None):
    """Plain greedy decoding with a KV cache, one target forward per token.

    Returns (new_tokens: list[int], stats: DecodeStats with k=0). Stops after an EOS token
    (which is included) or after max_new_tokens."""
    prompt = _as_id_list(input_ids)
    eos = _eos_set(eos_token_id)
    stats = DecodeStats(k=0)
    cache = _new_cache(target)
    t0 = time.perf_counter()
    logits, _ = target_forward(target, prompt, cache)
    tokens = [int(logits[-1].argmax())]
    stats.prefill_s = time.perf_counter() - t0
    stats.target_forwards = 1
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        logits, _ = target_forward(target, tokens[-1:], cache)
        tokens.append(int(logits[-1].argmax()))
        stats.target_forwards += 1
    stats.total_s = time.perf_counter() - t0
    stats.num_new_tokens = len(tokens)
    return tokens, stats


# ---------------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------------


@dataclass
class Proposal:
    tokens: list                          # d_1..d_m as target token ids, m <= k (may be empty)
    q: Optional[torch.Tensor] = None      # [m, V] draft distributions over the target vocabulary;
                                          # None: each draft is deterministic (one-hot q)


class Proposer:
    """Interface of every proposer.

    The decoder calls `start(prompt)` once, then per round `propose(tokens, k, ...)` with the
    whole committed sequence (prompt + emitted tokens; the last one has not been read by the
    target yet), and after each target forward `observe(aux)` with the auxiliary hidden states
    of the positions the target has just read AND that were committed, in order."""
    name = "proposer"
    aux_layer_ids: Optional[list] = None   # target layers whose hidden states the proposer needs

    def start(self, prompt: list) -> None:
        pass

    def propose(self, tokens: list, k: int, temperature: float = 0.0,
                generator: Optional[torch.Generator] = None) -> Proposal:
        raise NotImplementedError

    def observe(self, aux: Optional[torch.Tensor]) -> None:
        pass


class NoProposer(Proposer):
    """Never drafts: every round is a plain target step (plain sampling at T > 0)."""
    name = "none"

    def propose(self, tokens, k, temperature=0.0, generator=None) -> Proposal:
        return Proposal(tokens=[])


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's `ngram`): find the longest n-gram, min_n <= n <= max_n, that ends
    the context and occurred before; propose the (up to) k tokens that followed it.

    match="earliest" (vLLM's choice) takes the earliest earlier occurrence of that n-gram,
    match="latest" the most recent one. No match: no proposal (the round is a plain step)."""
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4, match: str = "earliest"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if match not in ("earliest", "latest"):
            raise ValueError(f"NgramProposer: match must be 'earliest' or 'latest', got {match!r}")
        self.min_n, self.max_n, self.match = min_n, max_n, match

    def find(self, tokens: list, k: int) -> list:
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):   # longest n-gram first
            suffix = tokens[L - n:]
            starts = range(0, L - n) if self.match == "earliest" else range(L - n - 1, -1, -1)
            for i in starts:                # occurrence tokens[i:i+n], strictly before the suffix
                if tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
        return []

    def propose(self, tokens, k, temperature=0.0, generator=None) -> Proposal:
        return Proposal(tokens=self.find(tokens, k))


class Eagle3Proposer(Proposer):
    """Chain drafting with an EAGLE-3 drafter and its own KV cache.

    Drafter input at position t is (g_t, x_{t+1}) at rope position t; it predicts x_{t+2}.
    The drafter cache holds only positions fed with TRUE fused states g_t; draft steps j > 0
    (fed with the drafter's own next_hidden) are cropped away before the next round, and the
    newly accepted positions are then fed with their true g's and shifted tokens."""
    name = "eagle3"

    def __init__(self, drafter, name: Optional[str] = None):
        self.drafter = drafter.eval()
        self.aux_layer_ids = list(drafter.config.aux_layer_ids)
        if name:
            self.name = name
        self.device = _device(drafter)
        self.dtype = next(drafter.parameters()).dtype
        # draft id -> target id for the whole draft vocabulary (for q over the target vocab)
        dv = drafter.config.draft_vocab_size
        self.draft_ids_in_target = drafter.draft_to_target(torch.arange(dv, device=self.device))  # [Dv]
        self.vocab_size = drafter.config.vocab_size

    def start(self, prompt):
        self.cache = DraftKVCache()
        self.num_true = 0               # positions 0..num_true-1 are in the cache with true g's
        self.pending_g = []             # fused g's of target positions num_true.. (not yet fed)

    @torch.no_grad()
    def observe(self, aux):
        g = self.drafter.fuse(aux.to(device=self.device, dtype=self.dtype))  # [1, m, H]
        self.pending_g.append(g)

    def _sample(self, logits: torch.Tensor, temperature: float, generator):
        """logits [Dv] -> (target token id, q over the target vocab [V] or None)."""
        if temperature <= 0:
            return int(self.draft_ids_in_target[int(logits.argmax())]), None
        q_draft = torch.softmax(logits.float() / temperature, dim=-1)                  # [Dv]
        i = int(torch.multinomial(q_draft.cpu(), 1, generator=generator))
        q = torch.zeros(self.vocab_size, dtype=torch.float32)
        q[self.draft_ids_in_target.cpu()] = q_draft.cpu()
        return int(self.draft_ids_in_target[i]), q

    @torch.no_grad()
    def propose(self, tokens, k, temperature=0.0, generator=None) -> Proposal:
        L = len(tokens)                # the target has read positions 0..L-2; x_{L-1} is pending
        if k <= 0:
            return Proposal(tokens=[])
        # 1. forget draft steps of the last round, feed the new true positions num_true..L-2
        self.cache.crop(self.num_true)
        g = torch.cat(self.pending_g, dim=1)                                         # [1, m, H]
        m = g.shape[1]
        if self.num_true + m != L - 1:
            raise RuntimeError(f"Eagle3Proposer: drafter has {self.num_true} + {m} true states, "
                               f"expected {L - 1} (the target has read {L - 1} positions)")
        ids = torch.tensor([tokens[self.num_true + 1:L]], device=self.device)       # [1, m] shifted
        pos = torch.arange(self.num_true, L - 1, device=self.device)[None]          # [1, m]
        logits, hidden = self.drafter(g, ids, pos, cache=self.cache)                # [1, m, Dv], [1, m, H]
        self.num_true, self.pending_g = L - 1, []
        # 2. draft step 0 from the last true position, then steps j > 0 from its own hidden
        drafts, qs = [], []
        self.last_draft_logits = []     # [Dv] per draft step (for inspection and tests)
        for j in range(k):
            self.last_draft_logits.append(logits[0, -1])
            d, q = self._sample(logits[0, -1], temperature, generator)
            drafts.append(d)
            qs.append(q)
            if j == k - 1:
                break
            ids = torch.tensor([[d]], device=self.device)                           # [1, 1]
            pos = torch.tensor([[L - 1 + j]], device=self.device)                   # [1, 1]
            logits, hidden = self.drafter(hidden[:, -1:], ids, pos, cache=self.cache)
        q = torch.stack(qs) if temperature > 0 else None                            # [k, V]
        return Proposal(tokens=drafts, q=q)


def random_drafter(target_path, aux_layer_ids=None, draft_vocab_size: Optional[int] = None,
                   seed: int = 0, dtype: torch.dtype = torch.float32, **choices):
    """An untrained Eagle3Drafter for `target_path` (random weights, lm_head from the target's
    head rows). With draft_vocab_size None or equal to V the draft vocabulary is the whole
    target vocabulary; otherwise the lowest ids (a plumbing test, not a frequency vocabulary)."""
    cfg = text_config(AutoConfig.from_pretrained(str(target_path)))
    V, N = cfg.vocab_size, cfg.num_hidden_layers
    dv = V if draft_vocab_size is None else int(draft_vocab_size)
    aux = list(aux_layer_ids) if aux_layer_ids is not None else [2, N // 2, N - 3]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:dv] = True
    d2t = torch.zeros(dv, dtype=torch.long)          # target id = i + d2t[i] = i
    torch.manual_seed(seed)
    config = Eagle3Config.from_target_config(cfg, draft_vocab_size=dv, aux_layer_ids=aux, **choices)
    w = load_target_tensors(target_path)
    return Eagle3Drafter.from_target_weights(config, d2t, t2d, w["embed"], w["lm_head"]).to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------


def _sample(probs: torch.Tensor, generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(logits: torch.Tensor, drafts: list) -> tuple:
    """logits [m+1, V] of the verify forward. Returns (accepted a, next token): the longest
    prefix of the drafts equal to the target argmax, and the argmax after it (the bonus)."""
    argmax = logits.argmax(dim=-1).tolist()                                   # [m+1]
    a = 0
    while a < len(drafts) and drafts[a] == argmax[a]:
        a += 1
    return a, int(argmax[a])


def verify_sampled(logits: torch.Tensor, drafts: list, q: Optional[torch.Tensor],
                   temperature: float, generator) -> tuple:
    """Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    p = softmax(logits / T) [m+1, V]; q [m, V] the draft distributions (None: one-hot on the
    drafts). Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    sample from norm(max(0, p_i - q_i)); if all are accepted sample the bonus from p_m.
    Returns (accepted a, next token). The output is distributed exactly as the target's."""
    p = torch.softmax(logits.float().cpu() / temperature, dim=-1)              # [m+1, V]
    for i, d in enumerate(drafts):
        q_d = float(q[i, d]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if u < min(1.0, float(p[i, d]) / q_d):
            continue
        if q is not None:
            residual = (p[i] - q[i]).clamp_min(0.0)
        else:
            residual = p[i].clone()
            residual[d] = 0.0
        if float(residual.sum()) <= 0.0:     # p == q exactly: a rejection cannot happen; be safe
            residual = p[i]
        return i, _sample(residual / residual.sum(), generator)
    return len(drafts), _sample(p[len(drafts)], generator)


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def speculative_generate(target, proposer: Proposer, input_ids, max_new_tokens: int, k: int,
                         temperature: float = 0.0, generator: Optional[torch.Generator] = None,
                         eos_token_id=None):
    """Generate with chain speculative decoding. Returns (new_tokens: list[int], DecodeStats).

    temperature 0: greedy (tokens equal `greedy_generate`'s); > 0: sampling from
    softmax(logits / temperature), exact via rejection sampling (pass a seeded `generator`).
    A proposal shorter than k (even empty) is verified as it is."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt = _as_id_list(input_ids)
    eos = _eos_set(eos_token_id)
    aux_ids = proposer.aux_layer_ids
    stats = DecodeStats(k=k)

    def pick(logits_row: torch.Tensor) -> int:
        if temperature <= 0:
            return int(logits_row.argmax())
        return _sample(torch.softmax(logits_row.float().cpu() / temperature, dim=-1), generator)

    t0 = time.perf_counter()
    cache = _new_cache(target)
    proposer.start(prompt)
    logits, aux = target_forward(target, prompt, cache, aux_ids)               # [n+1, V], [1, n+1, A]
    tokens = prompt + [pick(logits[-1])]                                       # + x_{n+1}
    if aux is not None:
        proposer.observe(aux)
    stats.prefill_s = time.perf_counter() - t0
    stats.target_forwards = 1
    new = 1

    while new < max_new_tokens and tokens[-1] not in eos:
        t1 = time.perf_counter()
        proposal = proposer.propose(tokens, k, temperature, generator)
        drafts = list(proposal.tokens)[:k]
        t2 = time.perf_counter()
        # verify forward: the target reads [x_last, d_1..d_m]; cache holds positions 0..L-2
        L = len(tokens)
        logits, aux = target_forward(target, [tokens[-1]] + drafts, cache, aux_ids)  # [m+1, V]
        if temperature <= 0:
            a, nxt = verify_greedy(logits, drafts)
        else:
            q = proposal.q[:len(drafts)] if proposal.q is not None else None
            a, nxt = verify_sampled(logits, drafts, q, temperature, generator)
        _crop_target_cache(cache, L + a)      # keep positions 0..L-1+a (the read, accepted ones)
        if aux is not None:
            proposer.observe(aux[:, :a + 1])  # aux states of positions L-1..L-1+a
        emitted = drafts[:a] + [nxt]
        for i, t in enumerate(emitted):       # stop at EOS / the token budget
            if t in eos or new + i + 1 >= max_new_tokens:
                emitted = emitted[:i + 1]
                break
        tokens += emitted
        new += len(emitted)
        stats.target_forwards += 1
        stats.rounds.append(RoundStats(drafted=len(drafts), accepted=a, emitted=len(emitted),
                                       draft_s=t2 - t1, verify_s=time.perf_counter() - t2))

    stats.total_s = time.perf_counter() - t0
    stats.num_new_tokens = new
    return tokens[len(prompt):], stats
