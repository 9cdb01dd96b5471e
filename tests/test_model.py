"""The drafter: parallel TTT forward == naive inference loop; masked positions carry no loss or
gradient; vLLM-compatible parameter names."""
from __future__ import annotations

import copy

import pytest
import torch

from eagle3lib.model import (
    ATTENTION_CHOICES,
    ATTENTION_IMPLS,
    DraftKVCache,
    Eagle3Config,
    Eagle3Drafter,
    resolve_attention,
)
from eagle3lib.params import CHOICES, TrainParams

# CUDA joins the device-parametrised tests where there is one (run them on a GPU machine with
# `pytest tests/test_model.py -k cuda`); there are no skips on a CPU-only machine, the case is absent.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def has_backward(impl: str, device: str) -> bool:
    """flex_attention has no backward on CPU (PyTorch raises NotImplementedError)."""
    return not (impl == "flex" and device == "cpu")


def small_config(seed: int, norm_before_residual: bool, **kw) -> Eagle3Config:
    """A random small config (head counts, sizes and vocab drawn from the seed)."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]
    heads, kv = pick([(4, 2), (2, 1), (4, 4)])
    head_dim = pick([8, 16])
    H = pick([32, 48])
    base = dict(hidden_size=H, intermediate_size=pick([64, 96]), num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-5,
                rope_theta=pick([10000.0, 100000.0]), rope_scaling=None, max_position_embeddings=256,
                vocab_size=97, draft_vocab_size=pick([31, 97]), target_hidden_size=H,
                aux_layer_ids=[1, 2, 3], norm_before_residual=norm_before_residual)
    base.update(kw)
    return Eagle3Config(**base)


def random_drafter(cfg: Eagle3Config, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg).double().float()
    model.reset_parameters(std=0.1)   # larger than init: attention far from uniform
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for m in model.modules():     # non-trivial norm weights, so every norm is exercised
            if type(m).__name__ == "RMSNorm":
                m.weight.uniform_(0.5, 1.5)
    perm = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[perm] = True
    model.set_vocab(perm - torch.arange(cfg.draft_vocab_size), t2d)
    return model.eval()


def naive_ttt_logits(model: Eagle3Drafter, aux, input_ids, ttt_steps, step_advances_position=True):
    """For every position t rebuild the inference situation: the drafter reads the prefix
    (g_0..g_t, x_1..x_{t+1}) into a fresh DraftKVCache, then runs j real drafting steps feeding
    its own output hidden and the ground-truth next token x_{t+1+j} at position t+j."""
    B, T = input_ids.shape
    ids = torch.cat([input_ids, torch.zeros(B, ttt_steps + 1, dtype=input_ids.dtype)], dim=1)
    out = [torch.zeros(B, T, model.config.draft_vocab_size, dtype=aux.dtype) for _ in range(ttt_steps)]
    g = model.fuse(aux)
    for t in range(T):
        cache = DraftKVCache()
        pos = torch.arange(t + 1).expand(B, t + 1)
        logits, hidden = model(g[:, : t + 1], ids[:, 1: t + 2], pos, cache)
        out[0][:, t] = logits[:, -1]
        hidden = hidden[:, -1:]
        for j in range(1, ttt_steps):
            tok = ids[:, t + 1 + j: t + 2 + j]
            pos_j = t + j if step_advances_position else t
            logits, hidden = model(hidden, tok, torch.full((B, 1), pos_j), cache)
            out[j][:, t] = logits[:, -1]
        assert cache.length == t + ttt_steps
        assert len(cache.k) == model.config.num_hidden_layers         # every layer cached its keys
    return out


@pytest.mark.parametrize("norm_before_residual", [True, False])
@pytest.mark.parametrize("ttt_steps", [1, 2, 3, 4])
def test_parallel_ttt_equals_naive_inference_loop(norm_before_residual, ttt_steps):
    seed = ttt_steps * 10 + int(norm_before_residual)
    cfg = small_config(seed, norm_before_residual,
                       next_step_hidden="pre_norm" if ttt_steps % 2 else "post_norm",
                       norm_before_fc=ttt_steps == 3, num_hidden_layers=1 if norm_before_residual else 2)
    model = random_drafter(cfg, seed)
    B, T = 2, 11
    torch.manual_seed(seed + 1)
    aux = torch.randn(B, T, 3, cfg.hidden_size)
    ids = torch.randint(cfg.vocab_size, (B, T))
    with torch.no_grad():
        naive = naive_ttt_logits(model, aux, ids, ttt_steps)
        for impl in ATTENTION_IMPLS:
            model.attention_impl = impl
            par = model.ttt_forward(aux, ids, ttt_steps)
            assert len(par) == ttt_steps
            for j in range(ttt_steps):
                err = (par[j] - naive[j]).abs().max().item()
                assert err < 1e-5, f"impl {impl} step {j}: max |parallel - naive| = {err}"
    # the check can fail: a loop that keeps the rope position fixed over the steps disagrees
    if ttt_steps > 1:
        with torch.no_grad():
            wrong = naive_ttt_logits(model, aux, ids, ttt_steps, step_advances_position=False)
        assert (wrong[0] - naive[0]).abs().max() < 1e-5
        assert (wrong[1] - naive[1]).abs().max() > 1e-3


def _weighted_logit_sum(logits: list, seed: int) -> torch.Tensor:
    """A scalar that depends on every logit of every step with its own random weight."""
    g = torch.Generator().manual_seed(seed)
    return sum((torch.randn(l.shape, generator=g).to(l.device) * l).sum() for l in logits)


def _logits_and_grads(model: Eagle3Drafter, aux: torch.Tensor, run) -> tuple[list, dict]:
    """run(model, aux) -> per-step logits; their weighted sum's gradients of aux and of every
    parameter, all returned in float64 on the CPU (the logits too)."""
    model.zero_grad()
    aux = aux.clone().requires_grad_(True)
    logits = run(model, aux)
    _weighted_logit_sum([l.double() for l in logits], 7).backward()
    grads = {"aux": aux.grad, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    return [l.detach().cpu().double() for l in logits], {n: g.cpu().double() for n, g in grads.items()}


def fp32_error_budget(naive32: torch.Tensor, exact: torch.Tensor, factor: float = 4.0) -> float:
    """How far an fp32 formulation of this computation may land from its float64 value: `factor`
    times what the naive fp32 loop itself misses it by (rounding grows with depth and reduction
    length, and so does the naive loop's), plus 8 ulps of the tensor's scale. Measured on this
    test's shapes under ATEN_CPU_CAPABILITY native, avx2 and default: every parallel formulation
    stays within 1.7x of the naive loop's own error (NOTES.md, Decisions: Numerics tests)."""
    scale = exact.abs().max().item()
    return factor * (naive32 - exact).abs().max().item() + 8 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
@pytest.mark.parametrize("layers", [1, 3])
def test_every_attention_formulation_matches_the_naive_unroll_forward_and_gradients(impl, device, layers):
    """GQA (4 query heads on 2 kv heads), fp32, T=11 with query blocks of 4 (3 blocks, the last one
    short) for "chunked": logits and the gradients of every parameter and of aux equal the naive
    inference loop's, for a one-layer and a three-layer drafter. Both fp32 routes are compared with
    the naive loop in float64 (the exact value); the parallel route must land within a few times the
    naive fp32 loop's own error (fp32_error_budget), whatever kernels this CPU picks. flex on CPU runs
    PyTorch's eager reference (forward only: no CPU backward); head_dim 16: compiled flex (CUDA)
    refuses head dims under 16."""
    cfg = small_config(3, True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_hidden_layers=layers)
    model = random_drafter(cfg, 3)
    J, B, T = 4, 2, 11
    torch.manual_seed(4)
    aux = torch.randn(B, T, 3, cfg.hidden_size)
    ids = torch.randint(cfg.vocab_size, (B, T))

    naive = lambda m, a: naive_ttt_logits(m, a, ids, J)
    exact_logits, exact_grads = _logits_and_grads(copy.deepcopy(model).double(), aux.double(), naive)
    naive_logits, naive_grads = _logits_and_grads(model, aux, naive)
    assert "midlayer.self_attn.k_proj.weight" in naive_grads and "fc.weight" in naive_grads
    assert all(f"later_layers.{i}.self_attn.k_proj.weight" in naive_grads for i in range(layers - 1))

    model = model.to(device)
    model.attention_impl, model.attention_block = impl, 4
    parallel = lambda m, a: m.ttt_forward(a.to(device), ids.to(device), J)
    if not has_backward(impl, device):
        with torch.no_grad():
            par_logits, par_grads = [l.cpu().double() for l in parallel(model, aux)], {}
    else:
        par_logits, par_grads = _logits_and_grads(model, aux, parallel)
        assert par_grads.keys() == exact_grads.keys()
    # compiled flex on CUDA is a Triton kernel with its own summation order (measured 1.3e-5 against
    # 1e-5 on one of 1,488 lm_head gradients on an H200, torch 2.11): a wider factor there
    factor = 16.0 if (impl, device) == ("flex", "cuda") else 4.0
    for j in range(J):
        budget = fp32_error_budget(naive_logits[j], exact_logits[j], factor)
        err = (par_logits[j] - exact_logits[j]).abs().max().item()
        assert err <= budget, f"{impl} on {device}, step {j}: max |parallel - exact| = {err:.3g} > {budget:.3g}"
    for n in par_grads:                                     # none where there is no backward
        exact = exact_grads[n]
        budget = fp32_error_budget(naive_grads[n], exact, factor)
        assert budget < 1e-3 * exact.abs().max().item(), f"{n}: a budget this wide checks nothing"
        err = (par_grads[n] - exact).abs().max().item()
        assert err <= budget, f"{impl} on {device}, grad {n}: max |parallel - exact| = {err:.3g} > {budget:.3g}"


def _saved_bytes(run) -> int:
    """Bytes of the distinct storages that autograd saves for backward while run() builds the graph
    (saved_tensors_hooks; tensors saved inside a non-reentrant checkpoint are not seen: it keeps
    the checkpointed function's inputs instead, counted by the caller)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(storages.values()), out


@pytest.mark.parametrize("impl", ["manual", "chunked"])
def test_activation_checkpointing_gives_the_same_gradients_and_saves_less(impl):
    from eagle3lib.objective import step_counts, ttt_loss
    model, items, _, J, prep = _loss_setup(seed=11, ttt_steps=4)
    model.attention_impl, model.attention_block = impl, 4
    batch = prep(items)

    def run(ckpt: bool):
        model.zero_grad()
        model.activation_checkpointing = ckpt
        def forward():
            states = model.ttt_hidden(batch["aux"], batch["input_ids"], J)
            return ttt_loss(states, model.lm_head, model.d2t, batch, step_counts(batch["tgt_u"], J), 0.8)[0]
        saved, loss = _saved_bytes(forward)
        loss.backward()
        return saved, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    saved_plain, loss_plain, g_plain = run(False)
    saved_ckpt, loss_ckpt, g_ckpt = run(True)
    assert loss_ckpt == loss_plain
    assert g_ckpt.keys() == g_plain.keys() and "fc.weight" in g_plain
    for n in g_plain:
        assert torch.equal(g_ckpt[n], g_plain[n]), f"{n}: gradient differs with activation checkpointing"
    # what the checkpoints keep instead: their inputs, i.e. g and each step's h, k, v (an upper bound)
    cfg = model.config
    B, T = batch["input_ids"].shape
    step_inputs = 4 * B * T * ((J + 1) * cfg.hidden_size + 2 * J * cfg.num_attention_heads * cfg.head_dim)
    assert saved_ckpt + step_inputs < 0.5 * saved_plain, (saved_ckpt, step_inputs, saved_plain)
    model.activation_checkpointing = False


def test_attention_choice_resolves_per_device_and_params_accept_exactly_the_choices():
    assert resolve_attention("auto", "cpu") == "manual"           # fastest measured on the 2-core CPU
    assert resolve_attention("auto", "cuda") == "flex"            # no T x T scores (chosen by memory)
    assert resolve_attention("auto", torch.device("cuda", 1)) == "flex"
    for impl in ATTENTION_IMPLS:
        assert resolve_attention(impl, "cuda") == impl and resolve_attention(impl, "cpu") == impl
    with pytest.raises(ValueError, match="attention 'sdpa'"):
        resolve_attention("sdpa", "cpu")
    assert CHOICES["train.attention"] == set(ATTENTION_CHOICES)
    assert TrainParams().attention == "auto" and TrainParams().activation_checkpointing is False


def test_parameter_names_follow_vllm():
    cfg = small_config(0, True, norm_before_fc=True)
    names = set(Eagle3Drafter(cfg).state_dict())
    expected = {"fc.weight", "input_norm.weight", "embed_tokens.weight", "norm.weight", "lm_head.weight",
                "d2t", "t2d"} | {f"midlayer.{n}.weight" for n in (
                    "hidden_norm", "input_layernorm", "post_attention_layernorm",
                    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert names == expected
    sd = Eagle3Drafter(cfg).state_dict()
    H = cfg.hidden_size
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * cfg.head_dim, 2 * H)
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert not Eagle3Drafter(cfg).embed_tokens.weight.requires_grad


def test_later_layers_are_plain_llama_layers_over_the_hidden_width():
    """Layers after the first read H (no embedding half, no hidden_norm), as vLLM's layers.1.. do."""
    cfg = small_config(0, True, num_hidden_layers=3)
    sd = Eagle3Drafter(cfg).state_dict()
    H = cfg.hidden_size
    later = {k for k in sd if k.startswith("later_layers.")}
    assert later == {f"later_layers.{i}.{n}.weight" for i in (0, 1) for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert sd["later_layers.1.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * cfg.head_dim, H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * cfg.head_dim, 2 * H)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        small_config(0, True, num_hidden_layers=0)


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_to_target_and_cache_crop(layers):
    cfg = small_config(1, True, num_hidden_layers=layers)
    model = random_drafter(cfg, 1)
    ids = torch.arange(cfg.draft_vocab_size)
    tgt = model.draft_to_target(ids)
    assert torch.equal(model.t2d.nonzero().flatten(), tgt)
    # crop: after dropping a draft step, re-running it reproduces the same logits exactly
    g = torch.randn(1, 5, 3 * cfg.hidden_size)
    x = torch.randint(cfg.vocab_size, (1, 5))
    h1, h2 = torch.randn(1, 1, cfg.hidden_size), torch.randn(1, 1, cfg.hidden_size)
    cache = DraftKVCache()
    with torch.no_grad():
        model(model.fuse(g), x, torch.arange(5)[None], cache)
        a, _ = model(h1, x[:, :1], torch.tensor([[5]]), cache)
        cache.crop(5)
        assert cache.length == 5
        b, _ = model(h2, x[:, :1], torch.tensor([[5]]), cache)
        assert not torch.allclose(a, b)                      # different hidden -> different logits
        cache.crop(5)
        c, _ = model(h1, x[:, :1], torch.tensor([[5]]), cache)
    assert cache.length == 6
    torch.testing.assert_close(a, c, rtol=0, atol=1e-6)


def test_from_target_config_reads_rope_parameters(tiny_target_dir):
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(str(tiny_target_dir))
    cfg = Eagle3Config.from_target_config(hf, 64, [2, 3, 3], norm_before_residual=False)
    assert cfg.hidden_size == 64 and cfg.head_dim == 16 and cfg.num_key_value_heads == 2
    assert cfg.rope_theta == float(hf.rope_parameters["rope_theta"]) and cfg.rope_scaling is None
    assert cfg.vocab_size == hf.vocab_size and cfg.norm_before_residual is False
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 1024}
    hf.rope_parameters = {**scaled, "rope_theta": 500000.0}
    cfg2 = Eagle3Config.from_target_config(hf, 64, [2, 3, 3])
    assert cfg2.rope_scaling == scaled and cfg2.rope_theta == 500000.0
    m1, m2 = Eagle3Drafter(cfg), Eagle3Drafter(cfg2)
    assert not torch.allclose(m1.rotary.inv_freq, m2.rotary.inv_freq)


def test_from_target_copies_embedding_and_head_rows(tiny_target_dir):
    from transformers import AutoConfig

    from eagle3lib.target import load_target_tensors
    hf = AutoConfig.from_pretrained(str(tiny_target_dir))
    Dv = 50
    cfg = Eagle3Config.from_target_config(hf, Dv, [2, 3, 3])
    target_ids = torch.arange(0, 5 * Dv, 5)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    w = load_target_tensors(tiny_target_dir)
    model = Eagle3Drafter.from_target_weights(cfg, target_ids - torch.arange(Dv), t2d, w["embed"], w["lm_head"])
    t = load_target_tensors(tiny_target_dir)
    assert torch.equal(model.embed_tokens.weight, t["embed"].float())
    assert torch.equal(model.lm_head.weight, t["lm_head"][target_ids].float())
    assert torch.equal(model.draft_to_target(torch.arange(Dv)), target_ids)


# ---- the TTT loss: which (position, step) pairs count ---------------------------------------------
def _loss_setup(seed: int = 5, ttt_steps: int = 3):
    from eagle3lib.batches import collate
    from eagle3lib.objective import TargetHead, prepare_batch
    cfg = small_config(seed, True)
    model = random_drafter(cfg, seed)
    H, V = cfg.hidden_size, cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 6, 9]
    items = []
    for n in lengths:
        mask = torch.rand(n, generator=g) < 0.7
        mask[:2] = False
        items.append({"input_ids": torch.randint(V, (n,), generator=g), "loss_mask": mask,
                      "aux": torch.randn(n, 3, H, generator=g), "final": torch.randn(n, H, generator=g)})
    head = TargetHead(torch.randn(V, H, generator=g), model.d2t)
    return model, items, head, ttt_steps, lambda its: prepare_batch(collate(its, 64), head, ttt_steps, "cpu")


def reference_ttt_loss(model, items, head, ttt_steps, decay):
    """Straight from the spec: step j at position t predicts x_{t+2+j} with label p_{t+1+j},
    counted iff t+2+j < length and loss_mask[t+2+j]; mean over counted pairs per step."""
    from eagle3lib.batches import collate
    batch = collate(items, 64)
    logits = model.ttt_forward(batch["aux"], batch["input_ids"], ttt_steps)
    total = 0.0
    for j in range(ttt_steps):
        losses = []
        for b, it in enumerate(items):
            n = len(it["input_ids"])
            for t in range(n):
                if t + 2 + j < n and it["loss_mask"][t + 2 + j]:
                    p = torch.softmax(it["final"][t + 1 + j] @ head.draft.T, -1)
                    losses.append(-(p * torch.log_softmax(logits[j][b, t], -1)).sum())
        total = total + decay ** j * torch.stack(losses).mean()
    return total


def test_ttt_loss_matches_the_spec_and_ignores_masked_positions_exactly():
    from eagle3lib.objective import step_counts, ttt_loss
    model, items, head, J, prep = _loss_setup()
    batch = prep(items)
    states = model.ttt_hidden(batch["aux"], batch["input_ids"], J)
    for s in states:
        s.retain_grad()
    loss, stats = ttt_loss(states, model.lm_head, model.d2t, batch, step_counts(batch["tgt_u"], J), 0.8)
    ref = reference_ttt_loss(model, items, head, J, 0.8)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # (t, j) pairs that do not count get exactly zero gradient; counted ones get some
    T = batch["input_ids"].shape[1]
    for j, s in enumerate(states):
        counted = torch.zeros(len(items), T, dtype=torch.bool)
        for b, it in enumerate(items):
            n = len(it["input_ids"])
            for t in range(n):
                counted[b, t] = t + 2 + j < n and bool(it["loss_mask"][t + 2 + j])
        assert int(stats[j, 2]) == int(counted.sum())
        assert torch.count_nonzero(s.grad[~counted]) == 0, f"step {j}: gradient at uncounted positions"
        assert bool((s.grad[counted].abs().sum(-1) > 0).all())
    # changing what the mask hides (labels of non-assistant targets, padding content) changes nothing
    hidden = []
    for it in items:
        it = dict(it)
        n = len(it["input_ids"])
        no_label = [u for u in range(n) if not (u + 1 < n and it["loss_mask"][u + 1])]
        it["final"] = it["final"].clone()
        it["final"][no_label] = 1e3 * torch.randn(len(no_label), it["final"].shape[1])
        hidden.append(it)
    batch2 = prep(hidden)
    batch2["aux"][1, 6:] = torch.randn_like(batch2["aux"][1, 6:]) * 100          # padding of row 1
    batch2["input_ids"][1, 6:] = 3
    model.zero_grad()
    states2 = model.ttt_hidden(batch2["aux"], batch2["input_ids"], J)
    loss2, _ = ttt_loss(states2, model.lm_head, model.d2t, batch2, step_counts(batch2["tgt_u"], J), 0.8)
    loss2.backward()
    assert torch.equal(loss2, loss)
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n]), n
    # and the loss does depend on what it should: a label of a counted position
    counted_u = int(batch["tgt_u"][0])
    changed = [dict(it) for it in items]
    changed[int(batch["tgt_b"][0])]["final"] = changed[int(batch["tgt_b"][0])]["final"].clone()
    changed[int(batch["tgt_b"][0])]["final"][counted_u] += 5
    b3 = prep(changed)
    loss3, _ = ttt_loss(model.ttt_hidden(b3["aux"], b3["input_ids"], J), model.lm_head, model.d2t, b3,
                        step_counts(b3["tgt_u"], J), 0.8)
    assert not torch.equal(loss3, loss)


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_bf16_autocast_loss_and_gradients_stay_close_to_fp32(impl):
    """Every formulation; flex on CPU compares the loss only (no CPU backward)."""
    from eagle3lib.objective import step_counts, ttt_loss
    model, items, _, J, prep = _loss_setup(seed=9)
    model.attention_impl, model.attention_block = impl, 4
    batch = prep(items)
    backward = has_backward(impl, "cpu")

    def run(bf16: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.set_grad_enabled(backward):
            states = model.ttt_hidden(batch["aux"], batch["input_ids"], J)
            loss, _ = ttt_loss(states, model.lm_head, model.d2t, batch, step_counts(batch["tgt_u"], J), 0.8)
        if backward:
            loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss32, g32 = run(False)
    loss16, g16 = run(True)
    assert abs(loss16 - loss32) < 1e-2 * abs(loss32)
    if not backward:
        return
    assert g16.keys() == g32.keys() and "lm_head.weight" in g32 and "fc.weight" in g32
    for name in g32:
        rel = ((g16[name] - g32[name]).norm() / g32[name].norm()).item()
        assert rel < 0.05, f"{name}: bf16 gradient differs by {rel:.3f} (relative)"


def test_ttt_loss_flags_are_the_per_position_top1_hits():
    from eagle3lib.objective import step_counts, ttt_loss
    model, items, head, J, prep = _loss_setup()
    batch = prep(items)
    with torch.no_grad():
        states = model.ttt_hidden(batch["aux"], batch["input_ids"], J)
        loss, stats, correct = ttt_loss(states, model.lm_head, model.d2t, batch,
                                        step_counts(batch["tgt_u"], J), 0.8, flags=True)
        logits = model.ttt_forward(batch["aux"], batch["input_ids"], J)    # J x [B, T, Dv]
    b, u = batch["tgt_b"], batch["tgt_u"]
    assert correct.shape == (len(u), J) and correct.dtype == torch.bool
    for j in range(J):
        assert int(correct[:, j].sum()) == int(stats[j, 1])
        for i in range(len(u)):
            if u[i] < 1 + j:
                assert not correct[i, j]                                   # anchor u-1-j does not exist
                continue
            top = int(logits[j][b[i], u[i] - 1 - j].argmax())
            assert bool(correct[i, j]) == (top + int(model.d2t[top]) == int(batch["target_top"][i]))
    assert bool(correct.any()) or int(stats[:, 1].sum()) == 0
