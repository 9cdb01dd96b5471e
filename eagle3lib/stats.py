"""The data stage's report `<run>/data/stats.json`, typed, and its one reader. Light (no torch,
no tokenizer), so `eagle3 plan` reads measured token counts at once.

    stats = load_stats(run_dir)            # DataStats; raises FileNotFoundError before the data stage
    stats.train.tokens / stats.train.conversations, stats.regen (None without regeneration)

Written by `data.prepare_data` (`DataStats.to_json`), last, as the stage's completion marker.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Optional

from .files import read_json
from .layout import RunLayout


@dataclass(frozen=True)
class SplitStats:
    """One tokenised split ("train" or "eval" in stats.json)."""
    conversations: int
    tokens: int                       # after truncation to data.max_length
    assistant_tokens: int             # tokens with loss mask 1
    truncated: int
    dropped_no_assistant_tokens: int
    template_error: int
    control_token_text: int = 0       # chats skipped: their text holds a special token's text (data.py)

    @classmethod
    def from_json(cls, d: dict) -> "SplitStats":
        return cls(**{f.name: int(d[f.name]) for f in fields(cls) if f.name in d or f.default is MISSING})


@dataclass(frozen=True)
class RegenStats:
    """Regeneration by the target (stats.json "regen"; regenerate.regenerate_chats plus the split)."""
    backend: str
    conversations: int
    regenerated: int
    from_cache: int
    kept: int
    dropped_empty: int
    dropped_too_long: int
    empty_outputs: int
    capped: int
    assistant_turns: int
    new_tokens_total: int
    new_tokens_this_run: int
    seconds_this_run: float
    tokens_per_s_this_run: Optional[float]
    dir: str
    train_regenerated: int
    train_original_answers: int
    cut_inconsistent: int = 0         # chats ended before a turn whose prompt did not extend the sequence
    cut_at_tool_result: int = 0       # chats ended after an answer the dataset's tool results follow
    dropped_control_token_text: int = 0   # chats not sent: their text holds a special token's text

    @classmethod
    def from_json(cls, d: dict) -> "RegenStats":
        speed = d["tokens_per_s_this_run"]
        return cls(**{f.name: int(d[f.name]) for f in fields(cls)
                      if f.type == "int" and (f.name in d or f.default is MISSING)},
                   backend=str(d["backend"]), dir=str(d["dir"]),
                   seconds_this_run=float(d["seconds_this_run"]),
                   tokens_per_s_this_run=None if speed is None else float(speed))


@dataclass(frozen=True)
class DataStats:
    """`<run>/data/stats.json`, the data stage's report and completion marker (see prepare_data)."""
    cache_key: dict[str, str]         # what the outputs were built from (cache_key(params))
    source: str
    records_read: int
    valid: int
    malformed: dict[str, int]         # reason (chats.MALFORMED_REASONS) -> records
    malformed_total: int
    repairs: dict[str, int]
    duplicates: int
    renamed_ids: int
    eval_prompts: int
    train_skipped_prompt_too_long: int
    train: SplitStats
    eval: SplitStats
    regen: Optional[RegenStats]       # None when data.regenerate is off
    vocab_size: int
    draft_vocab_size: int
    distinct_assistant_tokens: int
    coverage_train: float
    coverage_eval: float
    coverage_curve: dict[str, float]  # str(draft vocabulary size) -> coverage of the train answers
    seconds: float
    sources: list = field(default_factory=list)   # per data.source item: read, valid, malformed by reason
    tool_chats: int = 0               # valid chats that declare tools (chats.normalize_record)
    tools_ignored: int = 0            # train and eval chats with tools or tool calls the template does not render
    cached: bool = False              # not stored: prepare_data returned the stored stats

    def to_json(self) -> dict:
        d = asdict(self)
        del d["cached"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "DataStats":
        counts = ("records_read", "valid", "malformed_total", "duplicates", "renamed_ids",
                  "eval_prompts", "train_skipped_prompt_too_long", "vocab_size", "draft_vocab_size",
                  "distinct_assistant_tokens")
        return cls(**{k: int(d[k]) for k in counts},
                   cache_key={str(k): str(v) for k, v in d["cache_key"].items()},
                   source=str(d["source"]),
                   malformed={str(k): int(v) for k, v in d["malformed"].items()},
                   repairs={str(k): int(v) for k, v in d["repairs"].items()},
                   train=SplitStats.from_json(d["train"]), eval=SplitStats.from_json(d["eval"]),
                   regen=None if d["regen"] is None else RegenStats.from_json(d["regen"]),
                   coverage_train=float(d["coverage_train"]), coverage_eval=float(d["coverage_eval"]),
                   coverage_curve={str(k): float(v) for k, v in d["coverage_curve"].items()},
                   seconds=float(d["seconds"]), sources=list(d.get("sources", [])),
                   tool_chats=int(d.get("tool_chats", 0)), tools_ignored=int(d.get("tools_ignored", 0)))


def load_stats(run_dir) -> DataStats:
    """The one reader of `<run>/data/stats.json` (plan.py, notebooks 00 and 02 use it)."""
    path = RunLayout(run_dir).stats
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run data.prepare_data (notebook 02) first")
    try:
        return DataStats.from_json(read_json(path))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a data stats file of this version ({type(e).__name__}: {e}); "
                         f"rerun the data stage (notebook 02, or prepare_data(params, run_dir, force=True))") from e
