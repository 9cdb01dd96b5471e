"""Small random targets built by code (fixed seed, nothing downloaded): the Kimi-K2.5 architecture
in miniature, so the whole pipeline can run against an MLA + MoE target on a CPU.

    build_mini_kimi(out_dir, tokenizer_dir)                 # DeepseekV3ForCausalLM, fp32 safetensors
    build_mini_kimi(out_dir, tokenizer_dir, wrapped=True)   # the same LM inside a Kimi-K2.5-like wrapper

Kimi-K2.5 (hub: moonshotai/Kimi-K2.5) is a DeepSeek-V3 text model (61 layers, hidden 7168, MLA,
384 routed experts top-8 + 1 shared, first layer dense, noaux_tc sigmoid routing, yarn rope,
vocab 163,840) inside a multimodal remote-code class whose `language_model` is the causal LM. The
miniature keeps every one of those features at toy sizes (8 layers, hidden 256, 8 experts top-2)
and SmolLM2's tokenizer and chat template (vocab 49,152, so the model's vocab_size matches it).

`topk_method` and `scoring_func` are written into config.json although transformers' DeepseekV3Config
does not keep them (save_pretrained leaves them out): vLLM's DeepSeek-V3 model reads them to pick its
router. `num_nextn_predict_layers` is 0 as in Kimi-K2.5 (no MTP weights are written).

The wrapped variant stores `modeling_mini_kimi.py` (a copy of mini_kimi_modeling.py) and an
`auto_map` in config.json, so it loads offline with trust_remote_code=True like Kimi's own code.
Both variants hold the same weights: the wrapper's `language_model.*` tensors equal the plain
model's tensors, so the two must give the same hidden-state cache.

No INT4 variant (Kimi-K2.5 ships its routed experts pack-quantized, int4 group 32): transformers 5.19
holds DeepSeek-V3's routed experts as fused 3-D parameters (DeepseekV3Experts.gate_up_proj
[E, 2I, H], down_proj), not nn.Linear modules, so compressed-tensors 0.17 cannot target them
("Could not match ... experts.N.gate_proj"); pack-quantizing the other Linear layers writes a
checkpoint whose experts transformers cannot reload (experts.gate_up_proj MISSING). Writing the
per-expert weight_packed / weight_scale / weight_shape tensors by hand is the way left open.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from .files import atomic_dir, remove_tree
from .mini_kimi_modeling import MiniKimiConfig, MiniKimiForConditionalGeneration

SEED = 0
# The lm_head is drawn LM_HEAD_SCALE x wider than the default init (std 0.02): logits with std ~5
# instead of ~0.3, so most greedy decisions lead by > 0.5 logits, as a trained LM's do (the
# extraction notebook's fidelity check and the lossless-decoding check need decisive tokens).
LM_HEAD_SCALE = 16.0
DONE_MARKER = "eagle3lab_tiny_target.json"
REMOTE_CODE_FILE = "modeling_mini_kimi.py"
# config.json keys vLLM's DeepSeek-V3 reads and DeepseekV3Config drops on save (values of Kimi-K2.5).
VLLM_ROUTER_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# Shape of the miniature (the text model); params profiles state it as target.shape.
# Kimi-K2.5's (and DeepSeek-V3's) MLA latent sizes, kept in the miniature (see mini_kimi_config).
MLA_LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
MINI_KIMI_SHAPE = {"num_hidden_layers": 8, "hidden_size": 256, "vocab_size": 49152,
                   "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4}


def mini_kimi_config(vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> DeepseekV3Config:
    """DeepSeek-V3 at toy sizes with every Kimi-K2.5 feature: MLA (q/kv LoRA ranks, decoupled rope
    head), MoE (8 routed experts top-2 in 2 groups, 1 shared expert, layer 0 dense), yarn rope."""
    s = MINI_KIMI_SHAPE
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=s["hidden_size"], num_hidden_layers=s["num_hidden_layers"],
        intermediate_size=s["intermediate_size"],            # the dense layer(s)' MLP
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
        # MLA at Kimi-K2.5's latent sizes: vLLM's CPU MLA kernel (0.32) compiles only for a latent
        # cache of kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 ("Head dimension 80 is not
        # supported by MLA" with 64 + 16); the heads themselves stay small.
        q_lora_rank=96, kv_lora_rank=MLA_LATENT["kv_lora_rank"], qk_rope_head_dim=MLA_LATENT["qk_rope_head_dim"],
        qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        num_mtp_layers=0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def mini_kimi_lm(tokenizer) -> DeepseekV3ForCausalLM:
    """The random causal LM (seed SEED, fp32, eval mode). The router's score-correction bias is
    random too (zeros at init), so noaux_tc's biased expert choice is exercised; the lm_head is
    scaled by LM_HEAD_SCALE."""
    vocab = len(tokenizer)
    if vocab != MINI_KIMI_SHAPE["vocab_size"]:
        raise ValueError(f"the mini-kimi tokenizer has {vocab} tokens, the miniature is sized for "
                         f"{MINI_KIMI_SHAPE['vocab_size']} (SmolLM2's tokenizer); use that tokenizer")
    cfg = mini_kimi_config(vocab, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape))
    return model.eval()


def wrap_like_kimi(lm: DeepseekV3ForCausalLM) -> MiniKimiForConditionalGeneration:
    """The same LM inside the Kimi-K2.5-like multimodal wrapper (its weights copied, not re-drawn)."""
    cfg = MiniKimiConfig(text_config=lm.config, architectures=["MiniKimiForConditionalGeneration"],
                         auto_map={"AutoConfig": f"{REMOTE_CODE_FILE[:-3]}.MiniKimiConfig",
                                   "AutoModelForCausalLM": f"{REMOTE_CODE_FILE[:-3]}.MiniKimiForConditionalGeneration"})
    torch.manual_seed(SEED)
    wrapper = MiniKimiForConditionalGeneration(cfg).to(torch.float32)
    wrapper.language_model.load_state_dict(lm.state_dict(), strict=True)
    return wrapper.eval()


def _add_vllm_router_keys(config_file: Path, wrapped: bool):
    """Write VLLM_ROUTER_KEYS (and no MTP layers) into the text model's part of config.json."""
    cfg = json.loads(config_file.read_text())
    text = cfg["text_config"] if wrapped else cfg
    text.update(VLLM_ROUTER_KEYS)
    text["num_nextn_predict_layers"] = 0
    config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def recipe(wrapped: bool) -> dict:
    """What a built miniature depends on: a folder built from another recipe (e.g. before the MLA
    latent sizes changed) is rebuilt, not reused."""
    cfg = mini_kimi_config(MINI_KIMI_SHAPE["vocab_size"], 0, 0, 0).to_dict()
    blob = json.dumps({"config": cfg, "seed": SEED, "lm_head_scale": LM_HEAD_SCALE,
                       "router": VLLM_ROUTER_KEYS, "wrapped": wrapped}, sort_keys=True, default=str)
    return {"builder": "eagle3lib.tiny_targets.build_mini_kimi", "seed": SEED, "wrapped": wrapped,
            "dtype": "float32", "recipe_sha256": hashlib.sha256(blob.encode()).hexdigest()}


def build_mini_kimi(out: Path, tokenizer_dir: Path, wrapped: bool = False) -> Path:
    """Write the miniature to `out` once (atomic; a finished folder carries DONE_MARKER with the
    recipe it was built from; another recipe's folder is rebuilt).
    tokenizer_dir: a folder with SmolLM2's tokenizer (e.g. the materialised embedded target)."""
    out = Path(out)
    want = recipe(wrapped)
    marker = out / DONE_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("recipe_sha256") == want["recipe_sha256"]:
        return out
    if out.exists():            # unfinished, or built from another recipe
        remove_tree(out, under=out.parent)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    lm = mini_kimi_lm(tok)
    model = wrap_like_kimi(lm) if wrapped else lm
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _add_vllm_router_keys(tmp / "config.json", wrapped)
        if wrapped:
            shutil.copyfile(Path(__file__).with_name("mini_kimi_modeling.py"), tmp / REMOTE_CODE_FILE)
        (tmp / DONE_MARKER).write_text(json.dumps(want))
    return out
