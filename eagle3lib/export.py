"""Export a trained drafter as a folder vLLM 0.32 loads (../shared/docs/vllm-format.md).

Two layouts, one weight file:

- "speculators" (default): `speculators_model_type: eagle3`, `transformer_layer_config`,
  `speculators_config` (vLLM's speculators format);
- "eagle3": the original EAGLE-3 style, Llama keys + `eagle_config`.

`model.safetensors` holds fc, [input_norm,] midlayer.* (a one-layer drafter; with more layers
layers.0.*, layers.1.*, ..., see vllm_weight_names), norm, lm_head, d2t, t2d and NO embed_tokens
(vLLM then shares the target's, which the drafter froze anyway). d2t is left out when the draft
vocabulary is the whole target vocabulary (vLLM has no mapping to load it into).

Every design choice is written explicitly, because the two layouts default differently
(`norm_before_residual`: false in layout "eagle3", true in "speculators"):

    Eagle3Config field      vLLM key
    norm_before_residual -> norm_before_residual
    norm_before_fc       -> norm_before_fc (weights: input_norm.weight, RMSNorm over 3H)
    next_step_hidden     -> norm_output (post_norm: the next step gets the normed state)
    num_hidden_layers    -> num_hidden_layers
    aux_layer_ids        -> eagle_aux_hidden_state_layer_ids
    rope_theta/scaling   -> rope_theta, rope_parameters

A config holding anything vLLM 0.32's `llama_eagle3` cannot express makes the export refuse
(`VllmExportError`), rather than write a drafter that would silently compute something else.
`load_export` reads an export back into an `Eagle3Drafter` bit-exactly. final/ (training.json) and
the export (eagle3lab.json) record the target's fingerprint (fingerprint.py); loading either with
another target raises TargetMismatch.

Never imports the trainer.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors.torch import load_file, save_file

from .files import atomic_dir, atomic_write_json, remove_stale_temp_dirs
from .fingerprint import check_same_target, target_fingerprint
from .model import Eagle3Config, Eagle3Drafter
from .target import load_target_tensors
from .vocab import draft_to_target_ids

LAYOUTS = ("speculators", "eagle3")
WEIGHTS_FILE = "model.safetensors"
TRAINING_FILE = "training.json"       # final/: the training summary, with the target's fingerprint
EXPORT_SIDECAR = "eagle3lab.json"     # export/: the target's fingerprint (vLLM reads only config.json)
# Rope types computed the same way by the drafter (transformers' init functions) and by vLLM's
# get_rope. "dynamic" is rejected by the drafter; "proportional" means Gemma-4 rope in vLLM.
VLLM_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Every Eagle3Config field and whether export knows how to write it for vLLM.
KNOWN_FIELDS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                "vocab_size", "draft_vocab_size", "target_hidden_size", "aux_layer_ids",
                "norm_before_residual", "norm_before_fc", "next_step_hidden", "hidden_act",
                "num_hidden_layers"}


class VllmExportError(ValueError):
    """The drafter uses a choice vLLM 0.32's EAGLE-3 Llama drafter cannot express."""


# ---------------------------------------------------------------------------------------------
# Reading the trainer's output
# ---------------------------------------------------------------------------------------------


def _config_from_dict(d: dict):
    fields = {f.name for f in dataclasses.fields(Eagle3Config)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"drafter config has unknown keys {sorted(unknown)} (known: {sorted(fields)})")
    return Eagle3Config(**d)


def load_drafter(final_dir: Union[str, os.PathLike], target_path: Union[str, os.PathLike]):
    """The trainer's drafter folder (`train/final/`: config.json = asdict(Eagle3Config),
    model.safetensors without embed_tokens) -> Eagle3Drafter with the target's embedding."""
    final_dir = Path(final_dir)
    cfg_path, w_path = final_dir / "config.json", final_dir / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise FileNotFoundError(f"{final_dir}: expected config.json and {WEIGHTS_FILE} (a trained drafter "
                                "from the training stage, e.g. outputs/<run>/train/final/)")
    config = read_drafter_config(final_dir)
    check_same_target(recorded_target(final_dir / TRAINING_FILE), target_path, str(final_dir))
    state = load_file(str(w_path))
    return _build_drafter(Eagle3Drafter, config, state, target_path, source=str(w_path))


def recorded_target(path: Path) -> Optional[dict]:
    """The target fingerprint stored under "target" in a drafter's JSON sidecar (final/training.json,
    export/eagle3lab.json); None where the file or the key is missing."""
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("target")


def read_drafter_config(final_dir: Union[str, os.PathLike]):
    """The Eagle3Config of a trainer's drafter folder (config.json = asdict(Eagle3Config))."""
    cfg_path = Path(final_dir) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{final_dir}: no config.json (expected a trained drafter folder)")
    return _config_from_dict(json.loads(cfg_path.read_text()))


def _build_drafter(cls, config, state: dict, target_path, source: str):
    """A drafter with the target's embedding and `state` (all other tensors) loaded exactly."""
    Dv, V = config.draft_vocab_size, config.vocab_size
    d2t = state.get("d2t")
    if d2t is None:
        if Dv != V:
            raise ValueError(f"{source}: no d2t although the draft vocabulary ({Dv}) is smaller than the "
                             f"target's ({V})")
        d2t = torch.zeros(Dv, dtype=torch.int64)
    t2d = state.get("t2d")
    if t2d is None:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[draft_to_target_ids(d2t)] = True
    embed = load_target_tensors(target_path, ("embed",))["embed"]                  # [V, H], frozen
    model = cls.from_target_weights(config, d2t, t2d, embed)     # lm_head: loaded from `state` below
    dtypes = {v.dtype for k, v in state.items() if v.is_floating_point()}
    if len(dtypes) == 1:
        model = model.to(dtypes.pop())
    full = {**state, "d2t": d2t, "t2d": t2d}
    missing, unexpected = model.load_state_dict(full, strict=False)
    missing = [m for m in missing if m != "embed_tokens.weight"]
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the drafter (missing {missing}, unexpected {unexpected})")
    return model.eval()


# ---------------------------------------------------------------------------------------------
# What vLLM can express
# ---------------------------------------------------------------------------------------------


def vllm_incompatibilities(config) -> list:
    """Reasons why vLLM 0.32 would not compute this drafter's function (empty: exportable).
    Checked against vllm/model_executor/models/llama_eagle3.py (vLLM 0.32.0)."""
    problems = []
    d = dataclasses.asdict(config)
    for key in sorted(set(d) - KNOWN_FIELDS):
        problems.append(f"config field {key!r}={d[key]!r}: export does not know how vLLM expresses it")
    if d.get("hidden_act") != "silu":
        problems.append(f"hidden_act={d.get('hidden_act')!r}: vLLM's LlamaMLP supports only silu")
    if d.get("target_hidden_size") != d.get("hidden_size"):
        problems.append("hidden_size != target_hidden_size: vLLM shares the target's embedding "
                        "and asserts the hidden state and embedding widths are equal")
    if d.get("next_step_hidden") not in ("pre_norm", "post_norm"):
        problems.append(f"next_step_hidden={d.get('next_step_hidden')!r}: vLLM offers pre_norm "
                        "(default) or post_norm (norm_output)")
    rope = d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if rope_type not in VLLM_ROPE_TYPES:
        problems.append(f"rope type {rope_type!r}: not computed identically by vLLM's get_rope "
                        f"(supported here: {', '.join(VLLM_ROPE_TYPES)})")
    if not d.get("aux_layer_ids"):
        problems.append("aux_layer_ids is empty")
    return problems


# ---------------------------------------------------------------------------------------------
# config.json of both layouts
# ---------------------------------------------------------------------------------------------


def _rope_parameters(config) -> dict:
    rope = dict(config.rope_scaling or {})
    if "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type", "default")
    rope["rope_theta"] = config.rope_theta
    return rope


def llama_layer_config(config, dtype: str) -> dict:
    """Llama keys of the decoder layer(s) (vocab_size = the TARGET vocabulary)."""
    c = {"model_type": "llama", "hidden_size": config.hidden_size,
         "intermediate_size": config.intermediate_size,
         "num_attention_heads": config.num_attention_heads,
         "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
         "num_hidden_layers": int(config.num_hidden_layers), "rms_norm_eps": config.rms_norm_eps,
         "rope_theta": config.rope_theta, "rope_parameters": _rope_parameters(config),
         "max_position_embeddings": config.max_position_embeddings,
         "vocab_size": config.vocab_size, "hidden_act": config.hidden_act,
         "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
         "dtype": dtype}
    if config.rope_scaling:
        c["rope_scaling"] = _rope_parameters(config)
    return c


def _choices(config) -> dict:
    """The design switches, always explicit (vllm-format.md: the layouts default differently)."""
    return {"norm_before_residual": bool(config.norm_before_residual),
            "norm_before_fc": bool(config.norm_before_fc),
            "norm_output": config.next_step_hidden == "post_norm",
            "fc_norm": False}


def _target_architectures(target_path) -> list:
    cfg = Path(target_path) / "config.json"
    if cfg.is_file():
        return list(json.loads(cfg.read_text()).get("architectures") or [])
    return []


def config_json(config, layout: str, target_path, k: int, dtype: str) -> dict:
    if layout == "eagle3":
        return {**llama_layer_config(config, dtype), "architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": config.draft_vocab_size,
                "target_hidden_size": config.target_hidden_size, **_choices(config),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
                                 "use_aux_hidden_state": True}}
    if layout == "speculators":
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "draft_vocab_size": config.draft_vocab_size,
                "target_hidden_size": config.target_hidden_size, **_choices(config),
                "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
                "transformer_layer_config": llama_layer_config(config, dtype),
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
                    "verifier": {"name_or_path": str(target_path),
                                 "architectures": _target_architectures(target_path)}}}
    raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")


def config_from_export(cfg: dict):
    """Eagle3Config from an export's config.json (either layout), from the vLLM keys alone."""
    if "speculators_model_type" in cfg:
        if cfg["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type {cfg['speculators_model_type']!r} is not eagle3")
        layer, aux = cfg["transformer_layer_config"], cfg["eagle_aux_hidden_state_layer_ids"]
        nbr_default = True
    else:
        layer, aux = cfg, (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        nbr_default = False
    rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", layer.get("rope_theta"))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return Eagle3Config(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
        rms_norm_eps=layer["rms_norm_eps"], rope_theta=theta,
        rope_scaling=None if rope_type == "default" else rope,
        max_position_embeddings=layer["max_position_embeddings"], vocab_size=layer["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"], target_hidden_size=cfg["target_hidden_size"],
        aux_layer_ids=list(aux),
        norm_before_residual=bool(cfg.get("norm_before_residual", nbr_default)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        next_step_hidden="post_norm" if cfg.get("norm_output", False) else "pre_norm",
        hidden_act=layer.get("hidden_act", "silu"), num_hidden_layers=int(layer.get("num_hidden_layers", 1)))


# ---------------------------------------------------------------------------------------------
# Export and load
# ---------------------------------------------------------------------------------------------


LATER_LAYER = re.compile(r"^later_layers\.(\d+)\.")
VLLM_LAYER = re.compile(r"^layers\.(\d+)\.")


def vllm_weight_names(state: dict, num_layers: int) -> dict:
    """The drafter's tensor names -> the names vLLM 0.32 loads. One layer: unchanged (midlayer.*,
    which vLLM maps to layers.0.*). More: midlayer.* -> layers.0.*, later_layers.i.* ->
    layers.{i+1}.*, and layers.{i+1}.hidden_norm.weight as ones: vLLM's LlamaDecoderLayer creates
    that norm in every layer and only layer 0 uses it, so it is written rather than left to chance."""
    if num_layers == 1:
        return dict(state)
    out = {}
    for name, tensor in state.items():
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        elif LATER_LAYER.match(name):
            name = LATER_LAYER.sub(lambda m: f"layers.{int(m.group(1)) + 1}.", name)
        out[name] = tensor
    norm = out["layers.0.hidden_norm.weight"]
    for i in range(1, num_layers):
        out[f"layers.{i}.hidden_norm.weight"] = torch.ones_like(norm)
    return out


def drafter_weight_names(state: dict) -> dict:
    """vllm_weight_names inverted (also reads layers.0.* of a one-layer export): layers.0.* ->
    midlayer.*, layers.{i}.* -> later_layers.{i-1}.*; the unused hidden_norm of layers >= 1 is dropped."""
    out = {}
    for name, tensor in state.items():
        m = VLLM_LAYER.match(name)
        if m:
            i = int(m.group(1))
            rest = name[m.end():]
            if i == 0:
                name = "midlayer." + rest
            elif rest == "hidden_norm.weight":
                continue
            else:
                name = f"later_layers.{i - 1}." + rest
        out[name] = tensor
    return out


def export_state_dict(model) -> dict:
    """The tensors vLLM loads, under vLLM's names: everything but the frozen embedding (and d2t for
    a full vocab)."""
    cfg = model.config
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
             if k != "embed_tokens.weight"}
    if cfg.draft_vocab_size == cfg.vocab_size:
        if torch.any(state["d2t"] != 0):
            raise VllmExportError("full draft vocabulary with a non-identity d2t: vLLM applies no mapping then")
        del state["d2t"]
    return vllm_weight_names(state, int(cfg.num_hidden_layers))


def export_vllm(final_dir_or_model, out_dir: Union[str, os.PathLike], target_path: Union[str, os.PathLike],
                layout: str = "speculators", k: int = 4) -> Path:
    """Write a vLLM-loadable drafter folder (config.json + model.safetensors) to `out_dir`.

    final_dir_or_model: the trainer's `train/final/` folder or an Eagle3Drafter. The folder is
    built under a temp name and renamed into place; temp folders a killed export left beside it
    are deleted first. Returns out_dir. Raises VllmExportError if
    the drafter uses a choice vLLM 0.32 cannot express."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    if int(k) < 1:
        raise ValueError(f"k (speculative tokens) must be >= 1, got {k}")
    from_folder = isinstance(final_dir_or_model, (str, os.PathLike))
    config = read_drafter_config(final_dir_or_model) if from_folder else final_dir_or_model.config
    problems = vllm_incompatibilities(config)       # checked before any weights are read
    if problems:
        raise VllmExportError("this drafter cannot be exported for vLLM 0.32:\n  - " + "\n  - ".join(problems))
    model = load_drafter(final_dir_or_model, target_path) if from_folder else final_dir_or_model
    state = export_state_dict(model)
    dtype = str(state["fc.weight"].dtype).replace("torch.", "")
    cfg = config_json(model.config, layout, target_path, k, dtype)

    remove_stale_temp_dirs(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", cfg)
        atomic_write_json(tmp / EXPORT_SIDECAR, {"target": target_fingerprint(target_path)})
    return Path(out_dir)


def load_export(export_dir: Union[str, os.PathLike], target_path: Union[str, os.PathLike]):
    """Read an export (either layout) back into an Eagle3Drafter, bit-exactly."""
    export_dir = Path(export_dir)
    cfg_path, w_path = export_dir / "config.json", export_dir / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise FileNotFoundError(f"{export_dir}: expected config.json and {WEIGHTS_FILE} (an export_vllm folder)")
    config = config_from_export(json.loads(cfg_path.read_text()))
    check_same_target(recorded_target(export_dir / EXPORT_SIDECAR), target_path, str(export_dir))
    state = drafter_weight_names(load_file(str(w_path)))
    return _build_drafter(Eagle3Drafter, config, state, target_path, source=str(w_path))


def export_layout(export_dir: Union[str, os.PathLike]) -> str:
    """"speculators" or "eagle3" for an export folder."""
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    return "speculators" if "speculators_model_type" in cfg else "eagle3"
