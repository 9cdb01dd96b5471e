"""The target checkpoint's weights by name, read from its safetensors index and headers as JSON (no
torch): which key is the lm_head (a plain float tensor; the embedding only where config.json ties
them, never silently) and which the input embedding. target.load_target_tensors reads the tensors
these name; preflight.head_check turns a refusal into a row of `eagle3 plan`.

    key = head_key(folder, weight_map(folder), read_config(folder))   # TargetHeadError naming the keys seen
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

# The lm_head and embedding by name (as load_target_tensors reads them; MTP heads are not the target's).
HEAD_SUFFIXES = ("lm_head.weight", "output.weight")
EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
# Tensors beside a quantized layer's weight (compressed-tensors, GPTQ/AWQ, bitsandbytes).
QUANTIZED_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale",
                   "qweight", "qzeros", "scales", "g_idx", "SCB", "weight_format")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")       # safetensors' names of plain float tensors


class TargetHeadError(ValueError):
    """The checkpoint's lm_head cannot serve as the soft labels' head: missing and not tied, or quantized."""


def read_config(folder: Path) -> dict:
    """config.json of a checkpoint folder ({} without one)."""
    f = Path(folder) / "config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def tied_embeddings(config: dict) -> Optional[bool]:
    """tie_word_embeddings as the checkpoint states it: the language model's (text_config, for multimodal
    wrappers such as Kimi-K2.5), else the top level's; None when neither says."""
    text = config.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return bool(config["tie_word_embeddings"]) if "tie_word_embeddings" in config else None


def safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file ({tensor: {"dtype", "shape", "data_offsets"}}), read
    without the safetensors package: an 8-byte little-endian length, then the JSON."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 28:
            raise ValueError(f"{file}: not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n))


def weight_map(folder: Path) -> dict:
    """{tensor name: safetensors file name} of a checkpoint folder, sharded or single-file ({} without weights)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if single.is_file():
        return {k: single.name for k in safetensors_header(single) if k != "__metadata__"}
    return {}


def _find(keys, suffixes) -> Optional[str]:
    for suffix in suffixes:                       # lm_head.weight before output.weight
        for key in keys:
            if key.endswith(suffix) and "mtp" not in key and "layers." not in key:
                return key
    return None


def _module_name(key: str) -> str:
    """The last component of a tensor's module ("lm_head" of "language_model.lm_head.weight_packed")."""
    parts = key.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def embed_key(weights: dict) -> Optional[str]:
    """The input embedding's tensor name, or None."""
    return _find(weights, EMBED_SUFFIXES)


def head_like_keys(keys, limit: int = 8) -> list:
    """The first `limit` names that look like an output head (for the error that names what it saw)."""
    like = sorted(k for k in keys if any(w in k for w in ("lm_head", "output", "head")) and "layers." not in k)
    return like[:limit]


def head_key(folder: Path, weights: dict, config: dict) -> str:
    """The tensor name of the checkpoint's lm_head as a plain float tensor; the embedding's name only
    where config.json ties them (tied_embeddings). Raises TargetHeadError naming the checkpoint, the
    head-like keys it holds and the fix, for a missing untied head or a quantized one."""
    key = _find(weights, HEAD_SUFFIXES)
    if key is not None:
        module = key[: -len(".weight")]
        companions = sorted(k for k in weights
                            if k.startswith(module + ".") and k.rsplit(".", 1)[-1] in QUANTIZED_PARTS)
        dtype = safetensors_header(Path(folder) / weights[key]).get(key, {}).get("dtype")
        if companions or (dtype is not None and dtype not in FLOAT_DTYPES):
            what = f"stored beside {', '.join(companions[:4])}" if companions else f"dtype {dtype}"
            raise TargetHeadError(quantized_head_text(folder, key, what))
        return key
    quantized = sorted(k for k in weights if k.rsplit(".", 1)[-1] in QUANTIZED_PARTS and "mtp" not in k
                       and "layers." not in k and _module_name(k) in ("lm_head", "output"))
    if quantized:
        raise TargetHeadError(quantized_head_text(folder, quantized[0], f"no plain {HEAD_SUFFIXES[0]} beside it"))
    tied = tied_embeddings(config)
    embed = embed_key(weights)
    if tied and embed is not None:
        return embed
    said = ("not stated" if tied is None else "true, but no embedding tensor was found" if tied else "false")
    seen = head_like_keys(weights) or sorted(weights)[-5:]
    raise TargetHeadError(
        f"target checkpoint {folder}: no lm_head tensor (a name ending in {' or '.join(HEAD_SUFFIXES)}) and "
        f"config.json's tie_word_embeddings is {said}, so the embedding cannot stand in for it (every soft label "
        f"would be wrong). Head-like keys it holds: {seen or 'none'} ({len(weights):,} tensors). Fix: point "
        "target.path at a checkpoint whose lm_head is stored as a plain float tensor (its original release), "
        "or, if the model does tie its head to the embedding, set tie_word_embeddings: true in its config.json")


def quantized_head_text(folder: Path, key: str, what: str) -> str:
    return (f"target checkpoint {folder}: the lm_head is not a plain float tensor ({key}: {what}); the soft labels "
            "need the head in bf16/fp32. Fix: use a checkpoint that keeps lm_head unquantized (the quantization "
            "config's ignore list: Kimi-K2.5's release quantizes only its routed experts) or write it dequantized as "
            "lm_head.weight")
