"""EAGLE-3 drafter folders the lab did not train (public drafters) and its own, read without loading
the target or vLLM: config.json and the safetensors headers (weights only through safetensors; a
pickle is never opened), checked against the target before any engine starts.

    info = read_drafter(folder)                          # DrafterInfo: format, sizes, aux layers, weights
    check_drafter(info, target_dir, extract_aux_layers)  # DrafterMismatch naming field, both values, fix
    state, d2t, t2d, info = drafter_state_dict(folder)   # Eagle3Drafter's names, for a warm start

Formats (FORMATS; what vLLM 0.32 loads, read from its llama_eagle3.py, deepseek_eagle3.py and
transformers_utils/configs/speculators):
  eagle3-llama  `LlamaForCausalLMEagle3` (vLLM's and SpecForge's layout, our export's layout "eagle3"):
                Llama keys, `draft_vocab_size` (absent: the full vocabulary), `eagle_config`; weights
                midlayer.* or layers.0.*, fc, norm, lm_head, optional d2t/t2d and embed_tokens.
  speculators   a config with `speculators_config` (the speculators library's format, our default
                export): `transformer_layer_config` holds the Llama keys; norm_before_residual
                defaults to TRUE here (false in the other formats).
  eagle3-mla    `Eagle3DeepseekV2ForCausalLM` (or ...V3...): one DeepSeek MLA layer; vLLM runs it
                on CUDA only (its CPU MLA and standard attention backends share no block size).
  eagle3lab     the trainer's own folder (train/final/: config.json = asdict(model.Eagle3Config)).

Aux-layer convention. vLLM counts id k as the hidden state ENTERING decoder layer k (transformers'
output_hidden_states[k]; 0 = the embedding output, N = the last layer's output before the final
norm). Some trainers name the OUTPUT of layer k instead, one less: [1, 29, 57] for vLLM's
[2, 30, 58] on Kimi's 61 layers. DrafterInfo keeps what the checkpoint says (aux_layer_ids_raw) and
the ids in vLLM's counting (aux_layer_ids) with aux_convention:
  "vllm"     the format states vLLM's counting: the lab's own folders and exports (eagle3.md) and the
             speculators format (vLLM reads its ids unchanged; the speculators library takes its
             training states from vLLM with the same ids). No format read here states the output
             counting, so aux_layer_ids == aux_layer_ids_raw wherever the convention is known.
  "unknown"  eagle3-llama and eagle3-mla: `eagle_aux_hidden_state_layer_ids` is vLLM's key, but
             trainers write either counting and nothing in the folder says which. The lab passes
             the ids to vLLM as written (it measures the drafter as vLLM 0.32 runs it: inputs of
             those layers), checks their range in vLLM's counting, and adds a note where the first
             id is 1 (the output counting's usual mark: an embedding output is never an aux state):
             such a drafter loads and stays lossless but may accept less than its publisher
             measured; a copy of the folder with every id + 1 is the fix if that is the cause.
  "default"  no ids in the checkpoint: vLLM takes its default for the target, (2, N//2, N-3).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from safetensors import safe_open
from safetensors.torch import load_file

from .export import EXPORT_SIDECAR, TRAINING_FILE, drafter_weight_names

FORMATS = ("eagle3-llama", "speculators", "eagle3-mla", "eagle3lab")
LLAMA_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
LAB_ARCHITECTURE = "Eagle3Drafter"            # eagle3lib.model's class (the trainer's folder)
LAB_KEYS = {"aux_layer_ids", "target_hidden_size"}   # asdict(Eagle3Config) has these, no architectures
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
INDEX_FILE = "model.safetensors.index.json"
PICKLES = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
# Targets whose vLLM 0.32 model (DeepseekV2Model) adds the residual to the state before layer idx:
# before layer 0 there is none, so aux id 0 fails there (Llama-family models return the embedding).
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


class DrafterFormatError(ValueError):
    """A drafter folder is not one of FORMATS, or its config.json and weights disagree."""


class DrafterMismatch(ValueError):
    """A drafter was made for another target, or this machine's vLLM cannot run it.
    `problems`: [(field, the drafter's value, what the target has (a phrase), fix)]."""

    def __init__(self, folder, problems: list, target: str):
        self.folder, self.problems, self.target = str(folder), list(problems), target
        lines = [f"  - {f}: the drafter has {d}, {t}; {fix}" for f, d, t, fix in problems]
        super().__init__(f"drafter {folder} does not fit the target {target}:\n" + "\n".join(lines))


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter folder says about itself (read_drafter); sizes are the config's, checked
    against the weight headers."""
    path: str
    format: str                         # one of FORMATS
    architecture: str                   # config.json's architectures[0] (eagle3lab: "Eagle3Drafter")
    hidden_size: int                    # the drafter's width
    target_hidden_size: int             # the width of each aux state it reads (fc input / aux count)
    vocab_size: int                     # the TARGET vocabulary it was made for
    draft_vocab_size: int               # rows of lm_head (== vocab_size: a full vocabulary)
    num_layers: int                     # decoder layers of the drafter
    aux_layer_ids: Optional[tuple]      # in vLLM's counting where known, else as vLLM reads them; None: default
    aux_layer_ids_raw: Optional[tuple]  # as the checkpoint writes them
    aux_convention: str                 # "vllm" | "unknown" | "default" (module docstring)
    aux_source: Optional[str]           # the config key they came from
    has_embed_tokens: bool              # ships its own embedding (else vLLM shares the target's)
    has_d2t: bool                       # draft -> target id offsets
    has_t2d: bool                       # target -> in-draft-vocab mask (vLLM ignores it)
    has_lm_head: bool                   # else vLLM shares the target's head
    norm_before_residual: bool          # the value vLLM uses (the format's default where absent)
    rope_type: str = "default"
    verifier: Optional[str] = None      # speculators: the target named in speculators_config
    made_by_lab: bool = False           # a trainer folder or an export of this lab (its sidecar is there)
    notes: tuple = ()                   # remarks for the reader (e.g. the aux-convention hint)
    tensors: dict = field(default_factory=dict, repr=False)   # name -> (dtype, shape) from the headers

    @property
    def is_mla(self) -> bool:
        return self.format == "eagle3-mla"

    def summary(self) -> dict:
        """The JSON-friendly fields (no tensor table), for metrics.json and notebook display."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "tensors"}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_drafter(folder: Union[str, os.PathLike]) -> DrafterInfo:
    """A drafter folder (config.json + safetensors) -> DrafterInfo, without loading any weight.
    Raises FileNotFoundError (no config.json, no safetensors; pickles are refused by name) or
    DrafterFormatError (an unknown format, or a config that contradicts the weights)."""
    folder = Path(folder)
    cfg = _read_json(folder / "config.json", "config.json (a drafter folder holds config.json and safetensors)")
    tensors = weight_headers(folder)
    fmt = drafter_format(cfg, folder)
    try:
        fields = READERS[fmt](cfg)
    except (KeyError, TypeError) as e:                 # a missing key, or a value of the wrong kind
        raise DrafterFormatError(f"{folder}/config.json: not a complete {fmt} config ({type(e).__name__}: {e})") \
            from None
    made_by_lab = fmt == "eagle3lab" or (folder / EXPORT_SIDECAR).is_file() or (folder / TRAINING_FILE).is_file()
    raw = fields.pop("aux_raw")
    convention = "default" if raw is None else "vllm" if made_by_lab or fmt == "speculators" else "unknown"
    names = set(tensors)
    info = DrafterInfo(
        path=str(folder), format=fmt, **fields, aux_layer_ids=raw, aux_layer_ids_raw=raw,
        aux_convention=convention, has_embed_tokens=any(n.endswith("embed_tokens.weight") for n in names),
        has_d2t="d2t" in names, has_t2d="t2d" in names, has_lm_head="lm_head.weight" in names,
        made_by_lab=made_by_lab, notes=_aux_notes(convention, raw), tensors=tensors)
    _check_weights(info)
    return info


def drafter_format(cfg: dict, folder="the drafter") -> str:
    """Which of FORMATS a drafter's config.json is (DrafterFormatError naming what it is instead)."""
    if cfg.get("speculators_config") is not None:
        kind = cfg.get("speculators_model_type")
        if kind != "eagle3":
            raise DrafterFormatError(f"{folder}: speculators_model_type {kind!r} is not an EAGLE-3 drafter "
                                     "(only 'eagle3' is measured here)")
        return "speculators"
    arch = (cfg.get("architectures") or [None])[0]
    if arch in MLA_ARCHITECTURES:
        return "eagle3-mla"
    if arch in LLAMA_ARCHITECTURES:
        return "eagle3-llama"
    if arch is None and LAB_KEYS <= set(cfg):
        return "eagle3lab"
    raise DrafterFormatError(f"{folder}: config.json architectures {cfg.get('architectures')!r} is no EAGLE-3 "
                             f"drafter format known here ({', '.join(LLAMA_ARCHITECTURES + MLA_ARCHITECTURES)}, "
                             "a speculators config, or the lab's own train/final config)")


def weight_headers(folder: Union[str, os.PathLike]) -> dict:
    """{tensor name: (dtype, shape)} of a folder's safetensors files (model.safetensors, or the
    files of model.safetensors.index.json, or every *.safetensors), read from the headers only."""
    out = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                out[name] = (part.get_dtype(), tuple(part.get_shape()))
    return out


def weight_files(folder: Union[str, os.PathLike]) -> list:
    """The safetensors files of a drafter folder. Pickled weights (pytorch_model.bin, *.pt) are
    never opened: a folder with only those raises FileNotFoundError naming the conversion."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(_read_json(index, INDEX_FILE).get("weight_map", {}).values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if files and not missing:
        return files
    pickles = sorted(p.name for pattern in PICKLES for p in folder.glob(pattern))
    hint = (f" ({', '.join(pickles)} is a pickle, never opened here: convert it to safetensors)" if pickles else "")
    what = f"{', '.join(str(m) for m in missing)} listed in {INDEX_FILE} but" if missing else "no *.safetensors"
    raise FileNotFoundError(f"{folder}: {what} not there{hint}")


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DrafterFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DrafterFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _rope_type(layer: dict) -> str:
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    return str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"


def _ids(value) -> Optional[tuple]:
    return tuple(int(i) for i in value) if value else None


def _layer_fields(cfg: dict, layer: dict, nbr_default: bool, aux) -> dict:
    """The DrafterInfo fields shared by the formats: `layer` holds the Llama/DeepSeek keys."""
    H, V = int(layer["hidden_size"]), int(layer["vocab_size"])
    return dict(architecture=(cfg.get("architectures") or ["?"])[0], hidden_size=H,
                target_hidden_size=int(cfg.get("target_hidden_size") or layer.get("target_hidden_size") or H),
                vocab_size=V, draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or V),
                num_layers=int(layer.get("num_hidden_layers", 1)),
                norm_before_residual=bool(cfg.get("norm_before_residual", nbr_default)),
                rope_type=_rope_type(layer), aux_raw=_ids(aux))


def _llama_fields(cfg: dict) -> dict:
    """eagle3-llama and eagle3-mla: vLLM reads a top-level id list first, then eagle_config's."""
    aux, source = cfg.get(AUX_KEY), AUX_KEY
    if not aux:
        aux, source = (cfg.get("eagle_config") or {}).get(AUX_KEY), f"eagle_config.{AUX_KEY}"
    return {**_layer_fields(cfg, cfg, False, aux), "aux_source": source if aux else None}


def _speculators_fields(cfg: dict) -> dict:
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterFormatError("speculators config without a transformer_layer_config mapping")
    verifier = (cfg["speculators_config"].get("verifier") or {}).get("name_or_path")
    aux = cfg.get(AUX_KEY)
    return {**_layer_fields(cfg, layer, True, aux), "aux_source": AUX_KEY if aux else None, "verifier": verifier}


def _lab_fields(cfg: dict) -> dict:
    return {**_layer_fields(cfg, cfg, True, cfg.get("aux_layer_ids")), "architecture": LAB_ARCHITECTURE,
            "aux_source": "aux_layer_ids"}


READERS = {"eagle3-llama": _llama_fields, "eagle3-mla": _llama_fields, "speculators": _speculators_fields,
           "eagle3lab": _lab_fields}


def _aux_notes(convention: str, raw: Optional[tuple]) -> tuple:
    if convention == "unknown" and raw and raw[0] == 1:
        return (f"aux layer ids {list(raw)} start at 1, the usual mark of trainers that name a layer's OUTPUT: "
                f"if this one did, it was trained on vLLM's {[i + 1 for i in raw]}, but vLLM 0.32 reads "
                f"{list(raw)} and feeds it the states one layer earlier; it loads and stays lossless but may accept "
                f"less: a copy of the folder with ids {[i + 1 for i in raw]} is the fix if so",)
    return ()


def _check_weights(info: DrafterInfo) -> None:
    """The config and the weight headers agree on every shape vLLM relies on (DrafterFormatError)."""
    t, H, TH = info.tensors, info.hidden_size, info.target_hidden_size
    n_aux = len(info.aux_layer_ids) if info.aux_layer_ids else 3
    want = {"fc.weight": (H, n_aux * TH), "lm_head.weight": (info.draft_vocab_size, H), "d2t": (info.draft_vocab_size,),
            "t2d": (info.vocab_size,), "embed_tokens.weight": (info.vocab_size, H)}
    problems = [f"{name} is {list(t[name][1])}, the config implies {list(shape)}"
                for name, shape in want.items() if name in t and tuple(t[name][1]) != shape]
    if "fc.weight" not in t:
        problems.append("no fc.weight (the fusion of the aux states)")
    if not any(n.startswith(("midlayer.", "layers.0.")) for n in t):
        problems.append("no midlayer.* or layers.0.* tensors (the decoder layer)")
    if problems:
        raise DrafterFormatError(f"{info.path}: config.json and the weights disagree: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# Checking against the target
# ---------------------------------------------------------------------------------------------


def target_text_config(target: Union[dict, str, os.PathLike]) -> tuple:
    """(the language model's config dict, a label naming it) of a target: a parsed config.json, a
    checkpoint folder or its config.json. A multimodal wrapper's `text_config` is used (Kimi-K2.5
    keeps its DeepSeek-V3 backbone there), as vLLM does."""
    if isinstance(target, dict):
        cfg, label = target, "(config given)"
    else:
        path = Path(target)
        path = path / "config.json" if path.is_dir() else path
        cfg, label = _read_json(path, "the target's config.json"), str(path.parent)
    text = cfg.get("text_config")
    return (text if isinstance(text, dict) else cfg), label


def vllm_device() -> str:
    """"cuda" where torch sees a CUDA device (vLLM's GPU build runs there), else "cpu"."""
    import torch  # lazy: the check itself is plain data
    return "cuda" if torch.cuda.is_available() else "cpu"


def aux_id_range(target_cfg: dict) -> tuple:
    """(lowest, highest) aux id vLLM 0.32 captures on this target: 0..N on Llama-family targets,
    1..N on DeepSeek-family ones (no residual before their layer 0)."""
    n = int(target_cfg["num_hidden_layers"])
    deepseek = target_cfg.get("model_type") in DEEPSEEK_MODEL_TYPES or any(
        "Deepseek" in a for a in target_cfg.get("architectures") or [])
    return (1 if deepseek else 0), n


def check_drafter(info: DrafterInfo, target: Union[dict, str, os.PathLike],
                  extract_aux_layers: Optional[Sequence[int]] = None, *, device: Optional[str] = None) -> None:
    """Refuse a drafter made for another target, or one this machine's vLLM cannot run, before any
    engine starts: raises DrafterMismatch naming the folder, each field, both values and the fix.

    target: the target's parsed config.json, its folder or its config.json (text_config is used).
    extract_aux_layers: the layers the run's hidden states were extracted at (params.aux_layer_ids());
    give it for the run's OWN drafter, whose ids must equal them; None for a public drafter (vLLM
    captures whatever layers the drafter names). device: "cuda" or "cpu" (None: vllm_device())."""
    cfg, label = target_text_config(target)
    problems = _size_problems(info, cfg) + _vocab_map_problems(info, cfg) + _aux_problems(info, cfg, extract_aux_layers)
    if info.is_mla and (device or vllm_device()) != "cuda":
        problems.append(("architecture", f"{info.architecture} (MLA attention)", "this machine runs vLLM on the CPU",
                         "vLLM runs MLA drafters on CUDA only (its CPU MLA and standard attention backends "
                         "share no block size): measure it on a GPU machine, or drop it from eval.drafters here"))
    if problems:
        raise DrafterMismatch(info.path, problems, label)


def _size_problems(info: DrafterInfo, cfg: dict) -> list:
    H, V = cfg.get("hidden_size"), cfg.get("vocab_size")
    out = []
    if info.target_hidden_size != H:
        out.append(("target_hidden_size (fc input per aux state)", info.target_hidden_size, f"the target has {H}",
                    "this drafter reads another target's hidden states: use the drafter made for this target"))
    if not info.has_embed_tokens and info.hidden_size != H:
        out.append(("hidden_size", info.hidden_size, f"the target has {H}", "the drafter ships no embed_tokens, so "
                    "vLLM shares the target's, which must be as wide: use the drafter made for this target"))
    if info.vocab_size != V:
        out.append(("vocab_size", info.vocab_size, f"the target has {V}",
                    "the drafter was made for another tokenizer: use the drafter made for this target"))
    if info.draft_vocab_size > (V or 0):
        out.append(("draft_vocab_size", info.draft_vocab_size, f"the target's vocab_size is {V}",
                    "a draft vocabulary cannot exceed the target's: use the drafter made for this target"))
    return out


def _vocab_map_problems(info: DrafterInfo, cfg: dict) -> list:
    """d2t where vLLM 0.32 has no mapping to load it into, or none where it would silently map draft
    token i to target token i."""
    V = cfg.get("vocab_size")
    if info.has_d2t and info.draft_vocab_size == V:
        return [("d2t", f"a d2t tensor with draft_vocab_size {info.draft_vocab_size}",
                 f"the target's vocab_size is {V}",
                 "vLLM 0.32 has no mapping to load it into (its loader fails): remove d2t from the weights")]
    if not info.has_d2t and info.draft_vocab_size < (V or 0):
        return [("d2t", f"no d2t with draft_vocab_size {info.draft_vocab_size}", f"the target's vocab_size is {V}",
                 "vLLM would map draft token i to target token i: ship the drafter's d2t")]
    return []


def _aux_problems(info: DrafterInfo, cfg: dict, extract_aux_layers) -> list:
    ids = info.aux_layer_ids
    if ids is None:
        return []
    lo, hi = aux_id_range(cfg)
    out = []
    if any(not lo <= i <= hi for i in ids):
        ours = (f"{info.aux_source} in its config.json does not fit this target (edited after training, or "
                "trained against another target): restore it, or retrain (04)")
        theirs = (f"the drafter was made for a deeper target, or {info.aux_source} is mistyped: use the drafter "
                  "made for this target")
        fix = ours if info.made_by_lab else theirs
        out.append(("aux layer ids", list(ids), f"the target has {hi} layers (vLLM counts {lo}..{hi}: id k is "
                    "the input of layer k)", fix))
    if extract_aux_layers is not None and list(ids) != list(extract_aux_layers):
        out.append(("aux layer ids", list(ids), f"the run's hidden states were extracted at "
                    f"{list(extract_aux_layers)} (extract.aux_layers)", "the drafter's config.json no longer "
                    "names the layers it was trained on: retrain (04) or restore its config.json"))
    return out


# ---------------------------------------------------------------------------------------------
# Weights for a warm start
# ---------------------------------------------------------------------------------------------


def drafter_state_dict(folder: Union[str, os.PathLike]) -> tuple:
    """(state dict under eagle3lib's Eagle3Drafter names, d2t or None, t2d or None, DrafterInfo).

    vLLM's names map to ours as export.drafter_weight_names does (layers.0.* -> midlayer.*,
    layers.i.* -> later_layers.{i-1}.*, their unused hidden_norm dropped); fc, norm, lm_head,
    input_norm and embed_tokens keep their names. d2t and t2d are returned apart, not in the state
    (None where the folder has none: a full vocabulary, or only d2t; vocab.draft_to_target_ids
    rebuilds t2d from d2t). Warm start: build an Eagle3Drafter whose config has the same shapes,
    `load_state_dict(state, strict=False)` (embed_tokens, when shipped, may be replaced by the
    target's), then `set_vocab(d2t, t2d)`. MLA drafters are refused: Eagle3Drafter is a Llama layer."""
    info = read_drafter(folder)
    if info.is_mla:
        raise DrafterFormatError(f"{folder}: an MLA drafter ({info.architecture}); eagle3lib's Eagle3Drafter "
                                 "has Llama attention, so its weights have no place there")
    state = {}
    for file in weight_files(folder):
        state.update(load_file(str(file)))
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    return drafter_weight_names(state), d2t, t2d, info
