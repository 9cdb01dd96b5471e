"""The "flex" TTT attention over training batches of varying shape: its causal block mask is the one
create_block_mask builds, 50 length-bucketed micro-batches give the manual formulation's loss, and
torch.compile compiles a bounded number of graphs for them instead of one per (B, T).

Compilations are counted with a backend that counts the graphs Dynamo hands it and runs them as
they are (the "eager" backend's behaviour): on CPU inductor's flex cannot return the log-sum-exp, and
the number of Dynamo compilations does not depend on the backend that receives the graphs."""
from __future__ import annotations

import pytest
import torch
from test_model import random_drafter, small_config
from torch.nn.attention.flex_attention import create_block_mask

import eagle3lib.model as model_lib
from eagle3lib.batches import bucket_batches, collate
from eagle3lib.objective import TargetHead, prepare_batch, step_counts, ttt_loss

STEPS = 50
TTT_STEPS = 3
BATCH_TOKENS = 800


class CountingBackend:
    """A torch.compile backend that counts the graphs it receives and runs them unchanged."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def varied_batches(cfg, head, seed: int = 0) -> list:
    """STEPS prepared micro-batches as the trainer builds them (bucket_batches under a token budget,
    collate's right padding, prepare_batch's labels): B from 1 to ~20, T from 3 to 400."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 401, (400,), generator=g).tolist()
    items = []
    for n in lengths:
        mask = torch.rand(n, generator=g) < 0.7
        items.append({"input_ids": torch.randint(cfg.vocab_size, (n,), generator=g), "loss_mask": mask,
                      "aux": torch.randn(n, 3, cfg.hidden_size, generator=g),
                      "final": torch.randn(n, cfg.hidden_size, generator=g)})
    order = bucket_batches(lengths, BATCH_TOKENS, seed, 0)[:STEPS]
    return [prepare_batch(collate([items[i] for i in mb], BATCH_TOKENS), head, TTT_STEPS, "cpu") for mb in order]


@pytest.fixture
def drafter_and_batches():
    cfg = small_config(3, True, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = random_drafter(cfg, 3)
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1)),
                      model.d2t)
    batches = varied_batches(cfg, head)
    shapes = {tuple(b["input_ids"].shape) for b in batches}
    assert len(batches) == STEPS and len(shapes) >= 40, f"only {len(shapes)} distinct (B, T) shapes"
    assert {B for B, _ in shapes} != {1} and min(T for _, T in shapes) <= 128 < max(T for _, T in shapes)
    return model, batches


def batch_loss(model, batch, ttt_hidden=None) -> torch.Tensor:
    states = (ttt_hidden or model.ttt_hidden)(batch["aux"], batch["input_ids"], TTT_STEPS)
    return ttt_loss(states, model.lm_head, model.d2t, batch, step_counts(batch["tgt_u"], TTT_STEPS), 0.8)[0]


@pytest.mark.parametrize("T", [1, 5, 127, 128, 129, 256, 300, 513])
def test_causal_block_mask_has_the_blocks_of_create_block_mask(T):
    """Same block counts (full and partial, kv and q side), same block sets per row, and flex with it
    computes causal attention and its log-sum-exp."""
    mine = model_lib.causal_block_mask(T, "cpu")
    ref = create_block_mask(model_lib._causal, None, None, T, T, device="cpu")
    assert mine.shape == ref.shape and mine.BLOCK_SIZE == ref.BLOCK_SIZE
    for nums, idx in [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                      ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")]:
        assert torch.equal(getattr(mine, nums), getattr(ref, nums)), nums
        for row, n in enumerate(getattr(mine, nums).flatten().tolist()):
            used = lambda m: getattr(m, idx)[0, 0, row, :n].sort().values
            assert torch.equal(used(mine), used(ref)), f"{idx} row {row}"
    q, k, v = (torch.randn(2, 2, T, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))
    with torch.no_grad():
        o, lse = model_lib._flex_causal(q, k, v, {})
    causal_scores = (q @ k.transpose(-1, -2) / 4).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)
    torch.testing.assert_close(o, torch.softmax(causal_scores, -1) @ v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, causal_scores.logsumexp(-1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_flex_over_50_varied_batches_gives_the_manual_loss_and_compiles_at_most_4_graphs(
        drafter_and_batches, monkeypatch):
    """The uncompiled TTT forward calls model.compiled_flex (dynamic shapes). Over 50 micro-batches
    of ~48 distinct (B, T): the loss equals the manual formulation's on every batch (padding is
    masked), and Dynamo compiles at most 4 flex graphs: the first, B = 1 (0/1 specialisation), a
    single 128-block, and one size coincidence of the first batch (duck sizing). On GPUs the grad
    mode (training vs held-out eval) and inductor's short-query kernel choice (T < 128) may each
    double that; model.FLEX_RECOMPILE_LIMIT (16) leaves room and turns a runaway into an error."""
    model, batches = drafter_and_batches
    torch.compiler.reset()
    counting = CountingBackend()
    monkeypatch.setitem(model_lib.FLEX_BACKENDS, "cpu", counting)
    monkeypatch.setattr(model_lib, "_compiled_flex", {})
    with torch.no_grad():
        for step, batch in enumerate(batches):
            model.attention_impl = "manual"
            expected = batch_loss(model, batch)
            model.attention_impl = "flex"
            got = batch_loss(model, batch)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"batch {step}: {m}")
    assert 1 <= counting.graphs <= 4, f"{counting.graphs} flex compilations over {STEPS} batches"


def test_compiled_ttt_forward_with_flex_compiles_at_most_3_graphs_over_50_varied_batches(drafter_and_batches):
    """train.compile: objective.TTTObjective compiles drafter.ttt_hidden with dynamic=True and flex
    is traced into that graph. The block mask is built in the graph from the symbolic T (a cache
    lookup keyed by T specialised the graph on T: one compilation per length until Dynamo's
    recompile limit, then the eager forward with materialised scores). Over 50 varied batches:
    at most 3 graphs (the first, B = 1, a single 128-block) and the manual formulation's loss."""
    model, batches = drafter_and_batches
    torch.compiler.reset()
    counting = CountingBackend()
    model.attention_impl = "flex"
    compiled = torch.compile(model.ttt_hidden, dynamic=True, backend=counting)
    with torch.no_grad():
        for step, batch in enumerate(batches):
            got = batch_loss(model, batch, compiled)
            if step % 10 == 0:
                model.attention_impl = "manual"
                torch.testing.assert_close(got, batch_loss(model, batch), rtol=1e-5, atol=1e-6)
                model.attention_impl = "flex"
    assert 1 <= counting.graphs <= 3, f"{counting.graphs} compilations of the TTT forward over {STEPS} batches"


def test_flex_with_gradients_on_cpu_is_refused_with_the_fix():
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="train.attention auto, manual or chunked"):
        model_lib._flex_causal(q, q, q, {})
