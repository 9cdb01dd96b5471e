"""Test helper (not a test module): EAGLE-3 drafter folders in the public layouts, BUILT here at a
target's shape with random weights (never downloaded), to read, check, load in vLLM or warm-start from.

    shape = target_shape(smollm2_dir)            # a target's config.json (text_config aware) or a dict
    llama_draft_vocab(out, shape)                # LlamaForCausalLMEagle3, midlayer.*, d2t + t2d, no embed_tokens
    llama_full_vocab(out, shape)                 # LlamaForCausalLMEagle3, layers.0.*, embed_tokens, YaRN rope
    speculators(out, shape)                      # speculators_config, transformer_layer_config, midlayer.*
    mla(out, shape)                              # Eagle3DeepseekV2ForCausalLM (one MLA layer), midlayer.*
    lab_final(out, shape)                        # the trainer's own train/final/ folder

Layouts after public checkpoints: AQ-MedAI/Kimi-K2-Instruct-eagle3 (draft vocabulary, midlayer.*,
d2t int64 [Dv], t2d bool [V]), lightseekorg/kimi-k2.5-eagle3 (full vocabulary, no d2t, YaRN rope,
embed_tokens shipped), the MLA drafters (Eagle3DeepseekV2ForCausalLM) and the speculators format.
Every builder takes `aux` (the ids written into config.json, default (2, N//2, N-3)) and `**config`
(keys that override config.json, e.g. vocab_size=32000 for a drafter made for another tokenizer).
Weights are float32 (vLLM's lossless check runs in fp32), norms ones, matrices N(0, 0.02)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "max_position_embeddings", "vocab_size")
# The MLA latent sizes of Kimi-K2.5 / DeepSeek-V3 (kept by the mini-kimi target), heads kept small.
MLA_DIMS = {"q_lora_rank": 96, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64}


def target_shape(target) -> dict:
    """The keys a drafter copies from its target: a checkpoint folder, its config.json or a dict
    (a multimodal wrapper's text_config is used)."""
    if not isinstance(target, dict):
        path = Path(target)
        target = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    cfg = target.get("text_config") or target
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    return {"hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
            "num_attention_heads": heads, "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
            "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
            "vocab_size": cfg["vocab_size"], "num_hidden_layers": cfg["num_hidden_layers"],
            "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0))}


def default_aux(shape: dict) -> list:
    n = shape["num_hidden_layers"]
    return [2, n // 2, n - 3]


# ---- tensors -------------------------------------------------------------------------------------


def _matrix(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=g) * 0.02


def draft_vocab(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> tuple:
    """(d2t int64 [Dv], t2d bool [V]) of a random draft vocabulary, sorted by target id."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size), t2d


def llama_layer(g: torch.Generator, prefix: str, c: dict) -> dict:
    """One EAGLE-3 Llama decoder layer (q/k/v read 2H: [embedding; hidden]) under `prefix`."""
    H, I, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {f"{prefix}{n}.weight": torch.ones(H) for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}
    out.update({f"{prefix}self_attn.q_proj.weight": _matrix(g, q, 2 * H),
                f"{prefix}self_attn.k_proj.weight": _matrix(g, kv, 2 * H),
                f"{prefix}self_attn.v_proj.weight": _matrix(g, kv, 2 * H),
                f"{prefix}self_attn.o_proj.weight": _matrix(g, H, q),
                f"{prefix}mlp.gate_proj.weight": _matrix(g, I, H), f"{prefix}mlp.up_proj.weight": _matrix(g, I, H),
                f"{prefix}mlp.down_proj.weight": _matrix(g, H, I)})
    return out


def mla_layer(g: torch.Generator, prefix: str, c: dict) -> dict:
    """One DeepSeek MLA decoder layer (vLLM's DeepseekV2MLAAttention names) reading 2H inputs."""
    H, I, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = {f"{prefix}{n}.weight": torch.ones(H) for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}
    out.update({f"{prefix}self_attn.q_a_proj.weight": _matrix(g, c["q_lora_rank"], 2 * H),
                f"{prefix}self_attn.q_a_layernorm.weight": torch.ones(c["q_lora_rank"]),
                f"{prefix}self_attn.q_b_proj.weight": _matrix(g, heads * qk, c["q_lora_rank"]),
                f"{prefix}self_attn.kv_a_proj_with_mqa.weight": _matrix(g, c["kv_lora_rank"] + c["qk_rope_head_dim"],
                                                                        2 * H),
                f"{prefix}self_attn.kv_a_layernorm.weight": torch.ones(c["kv_lora_rank"]),
                f"{prefix}self_attn.kv_b_proj.weight": _matrix(g, heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                                                               c["kv_lora_rank"]),
                f"{prefix}self_attn.o_proj.weight": _matrix(g, H, heads * c["v_head_dim"]),
                f"{prefix}mlp.gate_proj.weight": _matrix(g, I, H), f"{prefix}mlp.up_proj.weight": _matrix(g, I, H),
                f"{prefix}mlp.down_proj.weight": _matrix(g, H, I)})
    return out


def head_tensors(g: torch.Generator, c: dict, n_aux: int, d2t: Optional[torch.Tensor] = None,
                 t2d: Optional[torch.Tensor] = None, embed: bool = False) -> dict:
    """fc, norm, lm_head [, d2t, t2d, embed_tokens] of a drafter with config `c`."""
    H, V = c["hidden_size"], c["vocab_size"]
    TH = c.get("target_hidden_size", H)
    out = {"fc.weight": _matrix(g, H, n_aux * TH), "norm.weight": torch.ones(H),
           "lm_head.weight": _matrix(g, c.get("draft_vocab_size") or V, H)}
    if d2t is not None:
        out["d2t"] = d2t
    if t2d is not None:
        out["t2d"] = t2d
    if embed:
        out["embed_tokens.weight"] = _matrix(g, V, H)
    return out


def write(out, config: dict, tensors: dict) -> Path:
    """config.json and model.safetensors into `out` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- the layouts ---------------------------------------------------------------------------------


def llama_config(shape: dict, aux, **config) -> dict:
    """Layout A: Llama keys of one decoder layer + eagle_config (vLLM's / SpecForge's LlamaForCausalLMEagle3)."""
    c = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
         "hidden_act": "silu", "rope_theta": shape["rope_theta"], "tie_word_embeddings": False,
         "torch_dtype": "float32", **{k: shape[k] for k in LLAMA_KEYS},
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux or default_aux(shape)),
                          "use_aux_hidden_state": True}}
    c.update(config)
    return c


def llama_draft_vocab(out, shape: dict, aux=None, draft_vocab_size: int = 1024, seed: int = 0, **config) -> Path:
    """AQ-MedAI/Kimi-K2-Instruct-eagle3's layout: a draft vocabulary with d2t and t2d, midlayer.*,
    no embed_tokens (vLLM shares the target's)."""
    c = llama_config(shape, aux, draft_vocab_size=draft_vocab_size, target_hidden_size=shape["hidden_size"], **config)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = draft_vocab(c["vocab_size"], c["draft_vocab_size"], seed)
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return write(out, c, {**llama_layer(g, "midlayer.", c), **head_tensors(g, c, n_aux, d2t, t2d)})


def llama_full_vocab(out, shape: dict, aux=None, seed: int = 1, **config) -> Path:
    """lightseekorg/kimi-k2.5-eagle3's layout: the full vocabulary (no draft_vocab_size, no d2t or
    t2d), its own embed_tokens, YaRN rope, layers.0.* names."""
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": shape["max_position_embeddings"],
            "beta_fast": 32.0, "beta_slow": 1.0}
    c = llama_config(shape, aux, rope_scaling=rope, max_position_embeddings=2 * shape["max_position_embeddings"],
                     **config)
    g = torch.Generator().manual_seed(seed)
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return write(out, c, {**llama_layer(g, "layers.0.", c), **head_tensors(g, c, n_aux, embed=True)})


def speculators(out, shape: dict, aux=None, draft_vocab_size: int = 1024, seed: int = 2,
                verifier: str = "HuggingFaceTB/SmolLM2-135M-Instruct", **config) -> Path:
    """The speculators format (vLLM reads it through SpeculatorsConfig): Llama keys under
    transformer_layer_config, ids at the top level, norm_before_residual left to its default (true)."""
    layer = {k: v for k, v in llama_config(shape, aux).items() if k not in ("architectures", "eagle_config")}
    layer.update({k: v for k, v in config.items() if k in layer})
    c = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
         "draft_vocab_size": draft_vocab_size, "target_hidden_size": shape["hidden_size"],
         "eagle_aux_hidden_state_layer_ids": list(aux or default_aux(shape)), "transformer_layer_config": layer,
         "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    c.update({k: v for k, v in config.items() if k not in layer})
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = draft_vocab(layer["vocab_size"], draft_vocab_size, seed)
    dims = {**layer, "draft_vocab_size": draft_vocab_size}
    n_aux = len(c["eagle_aux_hidden_state_layer_ids"])
    return write(out, c, {**llama_layer(g, "midlayer.", dims), **head_tensors(g, dims, n_aux, d2t, t2d)})


def mla(out, shape: dict, aux=None, draft_vocab_size: int = 1024, seed: int = 3, **config) -> Path:
    """An MLA drafter (Eagle3DeepseekV2ForCausalLM, model_type deepseek_v3): one DeepSeek MLA layer
    with a dense MLP, Kimi-K2.5's latent sizes, a draft vocabulary."""
    c = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 1,
         "hidden_act": "silu", "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
         "num_attention_heads": shape["num_attention_heads"], "num_key_value_heads": shape["num_attention_heads"],
         "rms_norm_eps": shape["rms_norm_eps"], "max_position_embeddings": shape["max_position_embeddings"],
         "vocab_size": shape["vocab_size"], "draft_vocab_size": draft_vocab_size, **MLA_DIMS,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
         "rope_theta": shape["rope_theta"], "target_hidden_size": shape["hidden_size"],
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux or default_aux(shape))}}
    c.update(config)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = draft_vocab(c["vocab_size"], draft_vocab_size, seed)
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return write(out, c, {**mla_layer(g, "midlayer.", c), **head_tensors(g, c, n_aux, d2t, t2d)})


def lab_final(out, shape: dict, aux=None, draft_vocab_size: int = 1024, seed: int = 4, **config) -> Path:
    """The trainer's drafter folder (train/final/): config.json = asdict(Eagle3Config) (`config`
    overrides its fields, written as they are, e.g. an aux id past the target), model.safetensors
    without the frozen embedding."""
    from eagle3lib.model import Eagle3Config, Eagle3Drafter
    cfg = Eagle3Config(**{k: shape[k] for k in LLAMA_KEYS}, rope_theta=shape["rope_theta"], rope_scaling=None,
                       draft_vocab_size=draft_vocab_size, target_hidden_size=shape["hidden_size"],
                       aux_layer_ids=[2, 4, 5])            # placeholder: the written ids are `aux`
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg)
    d2t, t2d = draft_vocab(shape["vocab_size"], draft_vocab_size, seed)
    model.set_vocab(d2t, t2d)
    state = {k: v.detach() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    written = {**dataclasses.asdict(cfg), "aux_layer_ids": list(aux or default_aux(shape)), **config}
    return write(out, written, state)
