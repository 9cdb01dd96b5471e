"""The identity of a target checkpoint, recorded with every trained drafter and export and checked
wherever a drafter meets a target again (export, eval), so a drafter is never paired with another
target than the one it was trained on.

    fp = target_fingerprint(target_dir)           # {"config": ..., "tokenizer": ..., "weights": ...}
    check_same_target(recorded_fp, target_dir, "outputs/ci/train/final")

Three parts, each a short sha256: config.json's bytes; the tokenizer and chat-template files; the
weight files (names, sizes, and SAMPLE_BYTES read at the start, middle and end of each), so a
fine-tune of the same shape differs, while a 0.6 TB checkpoint is fingerprinted in seconds.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

SAMPLE_BYTES = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "tiktoken.model")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
PARTS = ("config", "tokenizer", "weights")


class TargetMismatch(ValueError):
    """A drafter or export was made for another target than the one it is used with now."""


def _sha(h) -> str:
    return h.hexdigest()[:16]


def _file_samples(path: Path) -> bytes:
    """SAMPLE_BYTES at the start, middle and end of `path` (the whole file when it is small)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE_BYTES:
            return f.read()
        out = []
        for offset in (0, size // 2, size - SAMPLE_BYTES):
            f.seek(offset)
            out.append(f.read(SAMPLE_BYTES))
        return b"".join(out)


def target_fingerprint(target_dir: str | os.PathLike) -> dict:
    """{"config", "tokenizer", "weights"}: short sha256 of each part of the checkpoint folder."""
    folder = Path(target_dir)
    config = hashlib.sha256((folder / "config.json").read_bytes())
    tokenizer = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            tokenizer.update(name.encode() + b"\0" + (folder / name).read_bytes())
    weights = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        weights.update(f"{path.name}\0{path.stat().st_size}\0".encode() + _file_samples(path))
    return {"config": _sha(config), "tokenizer": _sha(tokenizer), "weights": _sha(weights)}


def check_same_target(recorded: Optional[dict], target_dir: str | os.PathLike, what: str) -> None:
    """Raise TargetMismatch when `recorded` (the fingerprint stored with `what`) is not the
    fingerprint of `target_dir`. None (a drafter written before fingerprints existed) passes with a
    printed warning: nothing says which target it was made for."""
    if recorded is None:
        print(f"[eagle3] warning: {what} records no target fingerprint (made before they were recorded); "
              f"cannot check that it belongs to {target_dir}")
        return
    now = target_fingerprint(target_dir)
    differ = [part for part in PARTS if recorded.get(part) != now[part]]
    if differ:
        raise TargetMismatch(
            f"{what} was trained for another target than {target_dir}: its {', '.join(differ)} "
            f"differ{'s' if len(differ) == 1 else ''} (recorded {recorded}, now {now}). Set target.path back "
            "to the checkpoint it was trained on, or train a drafter for this target (another run name, "
            "or rerun data, extract and train)")
