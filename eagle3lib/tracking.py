"""Experiment tracking of a training run (train.tracking), written by rank 0 in the run folder:

    tracker = open_tracker("tensorboard", layout, rank)     # None for "none" and on ranks > 0
    tracker.log(record, step)                               # after every optimizer step
    tracker.close()

Scalars per step: train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/acc_step{j},
train/acceptance_estimate (from the step's accuracies), and, when a held-out evaluation ran,
eval/loss_step{j}, eval/acc_step{j}, eval/acceptance_estimate, eval/acceptance_replayed.
tensorboard writes <run>/train/tensorboard/ (open it during a run: tensorboard --logdir
outputs/<run>/train/tensorboard); wandb runs offline in <run>/train/wandb/ unless WANDB_MODE says
otherwise (`wandb sync` uploads later). Nothing here reaches the network.
"""
from __future__ import annotations

import os
from typing import Optional

from .layout import RunLayout
from .objective import acceptance_estimate

TRACKERS = ("none", "tensorboard", "wandb")


def scalars(record: dict) -> dict:
    """{tag: value} of one step's record (train.loop's: step, lr, loss, grad_norm, tokens_per_s,
    step_acc, and eval when a held-out evaluation ran)."""
    out = {"train/loss": record["loss"], "train/lr": record["lr"]}
    for key in ("grad_norm", "tokens_per_s"):
        if record.get(key) is not None:
            out[f"train/{key}"] = float(record[key])
    out.update({f"train/acc_step{j}": a for j, a in enumerate(record["step_acc"])})
    out["train/acceptance_estimate"] = acceptance_estimate(record["step_acc"])
    ev = record.get("eval")
    if ev:
        out.update({f"eval/acc_step{j}": a for j, a in enumerate(ev["acc"])})
        out.update({f"eval/loss_step{j}": x for j, x in enumerate(ev.get("loss", []))})
        for key in ("acceptance_estimate", "acceptance_replayed"):
            if ev.get(key) is not None:
                out[f"eval/{key}"] = float(ev[key])
    return out


class TensorBoardTracker:
    def __init__(self, folder):
        try:   # lazy: the writer pulls in tensorboard
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError("train.tracking: tensorboard is not installed; `make setup` installs it "
                               "(or pip install tensorboard), or set train.tracking: none") from e
        self.writer = SummaryWriter(str(folder))

    def log(self, record: dict, step: int) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()            # a run watched live sees every step

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, folder, name: str, config: dict):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("train.tracking: wandb is not installed (pip install wandb), or set "
                               "train.tracking: tensorboard / none") from e
        os.environ.setdefault("WANDB_MODE", "offline")
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project="eagle3lab", name=name, dir=str(folder), config=config)

    def log(self, record: dict, step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(kind: str, layout: RunLayout, rank: int, config: Optional[dict] = None):
    """The tracker of train.tracking on rank 0, else None."""
    if kind not in TRACKERS:
        raise ValueError(f"train.tracking {kind!r}: use one of {', '.join(TRACKERS)}")
    if kind == "none" or rank != 0:
        return None
    if kind == "tensorboard":
        return TensorBoardTracker(layout.tensorboard)
    return WandbTracker(layout.train / "wandb", layout.root.name, config or {})
