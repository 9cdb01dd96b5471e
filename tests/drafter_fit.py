"""Test helper (not a test module): fit a drafter to a target in seconds, so that speculative
decoding tests see accepted AND rejected drafts without the training pipeline.

The fit is the EAGLE-3 objective on hard labels: TTT step j at position t reads
(g_t or h_{j-1,t}, x_{t+1+j}) and learns the target's argmax at position t+1+j. It overfits the
given sequences on purpose (the tests then decode those same prompts)."""
from __future__ import annotations

import torch

from eagle3lib.decode import _new_cache, target_forward


def greedy_sequences(target, prompts, max_new_tokens):
    from eagle3lib.decode import greedy_generate
    return [list(p) + greedy_generate(target, p, max_new_tokens)[0] for p in prompts]


def fit_drafter(target, drafter, sequences, steps: int = 150, lr: float = 3e-3, ttt_steps: int = 2,
                seed: int = 0) -> list:
    """Train `drafter` in place on `sequences` (token-id lists). Returns the loss per step."""
    torch.manual_seed(seed)
    aux_ids = drafter.config.aux_layer_ids
    data = []
    for seq in sequences:
        with torch.no_grad():
            logits, aux = target_forward(target, seq, _new_cache(target), aux_ids)   # [T, V], [1, T, 3H]
        argmax = logits.argmax(-1)                                                  # [T]
        data.append((aux.float(), torch.tensor([seq]), argmax))
    t2d = drafter.t2d
    target_to_draft = torch.cumsum(t2d.long(), 0) - 1                               # [V] valid where t2d
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    drafter.train()
    losses = []
    for step in range(steps):
        aux, ids, argmax = data[step % len(data)]
        T = ids.shape[1]
        logits = drafter.ttt_forward(aux, ids, ttt_steps)                           # list of [1, T, Dv]
        loss = 0.0
        for j, lg in enumerate(logits):
            t = torch.arange(T)
            label_pos = t + 1 + j                                                   # target position
            valid = label_pos < T
            lab = argmax[label_pos.clamp(max=T - 1)]
            valid &= t2d[lab]
            if valid.any():
                loss = loss + torch.nn.functional.cross_entropy(lg[0][valid], target_to_draft[lab[valid]])
        if not torch.is_tensor(loss):       # no label of this sequence is in the draft vocabulary
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    drafter.eval()
    return losses
