"""The run folder: every path under outputs/<run>/ is named here and nowhere else.

    layout = RunLayout(run_dir)            # or params.layout(run_name)
    layout.stats, layout.vocab, layout.hidden("train"), layout.checkpoints, layout.final, layout.metrics,
    layout.notebook("04_train")

outputs/<run>/
    data/            train/ eval/ (datasets.save_to_disk), eval_prompts.jsonl, vocab.safetensors,
                     stats.json (written last: the data stage's "done" marker), regen/<key>/chunk-*.jsonl
    hidden/<split>/  shard-*.safetensors + manifest.json (cache.py)
    train/           checkpoints/step-*/, final/ (config.json + model.safetensors), summary.json,
                     history.json, tensorboard/
    export/          the vLLM export of final/
    eval/<name>/     vLLM benchmark work folders (vllm_ngram, vllm, scaling)
    scaling/n<N>[-variant]/  06_scaling's points (and bench/loss_ab.py's variants): data -> ../../data,
                     hidden -> ../../hidden (links), train/, export/
    metrics.json     headline numbers, one section per stage (`runner`: stage times, commit, machine)
    params.yaml      the resolved profile of the last `eagle3 run`
    index.html/.md   the run's one-page report (report.py)
    NN_stage.ipynb   executed notebooks, with an .html beside each
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunLayout:
    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    # ---- data stage (02) ----
    @property
    def data(self) -> Path:
        return self.root / "data"

    def data_split(self, split: str) -> Path:
        return self.data / split

    @property
    def eval_prompts(self) -> Path:
        return self.data / "eval_prompts.jsonl"

    @property
    def vocab(self) -> Path:
        return self.data / "vocab.safetensors"

    @property
    def stats(self) -> Path:
        return self.data / "stats.json"

    def regen(self, key: str) -> Path:
        return self.data / "regen" / key

    # ---- extraction stage (03) ----
    @property
    def hidden_root(self) -> Path:
        return self.root / "hidden"

    def hidden(self, split: str) -> Path:
        return self.hidden_root / split

    @property
    def online(self) -> Path:
        """The online hidden-state server's folder: its log and the files in flight (online.py)."""
        return self.hidden_root / "online"

    # ---- training stage (04) ----
    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def checkpoints(self) -> Path:
        return self.train / "checkpoints"

    @property
    def final(self) -> Path:
        return self.train / "final"

    @property
    def summary(self) -> Path:
        return self.train / "summary.json"

    @property
    def history(self) -> Path:
        return self.train / "history.json"

    @property
    def tensorboard(self) -> Path:
        return self.train / "tensorboard"

    # ---- data-scaling study (06) ----
    def scaling_point(self, n: int, variant: str = "") -> Path:
        """scaling/n<N>[-variant]/: one study point's run folder (its data/ and hidden/ link to this
        run's); a variant (e.g. "lk_hybrid") is the same point with a changed training recipe."""
        return self.root / "scaling" / (f"n{n:06d}" + (f"-{variant}" if variant else ""))

    # ---- evaluation stage (05) and reports ----
    @property
    def export(self) -> Path:
        return self.root / "export"

    def eval_work(self, name: str) -> Path:
        return self.root / "eval" / name

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    def notebook(self, stem: str) -> Path:
        return self.root / f"{stem}.ipynb"

    @property
    def params(self) -> Path:
        """The resolved profile the runner executed the notebooks with."""
        return self.root / "params.yaml"

    @property
    def index_html(self) -> Path:
        return self.root / "index.html"

    @property
    def index_md(self) -> Path:
        return self.root / "index.md"

    @property
    def index_png(self) -> Path:
        """The index page as headless Chromium renders it (page_check.py)."""
        return self.root / "index.png"
