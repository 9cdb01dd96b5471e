"""Shared fixtures. Nothing here downloads: the real target is the embedded SmolLM2 (materialised
once under outputs/models/), the tiny target is a random Llama with SmolLM2's tokenizer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3lib.params import load_params, repo_root

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM engines in their caller's process, as `make test` runs them (Makefile; engine.py): the same
# tokens and states as vLLM's default process layout, which tests/test_vllm_breadth.py runs once.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def ci_params():
    return load_params("params/ci.yaml")


@pytest.fixture(scope="session")
def smollm2_dir(ci_params) -> Path:
    """The real embedded target, materialised from the GGUF once (cached across runs)."""
    from eagle3lib.target import target_path
    return target_path(ci_params)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A random 6-layer Llama (H=64, 4 heads, 2 kv heads) with SmolLM2's tokenizer and vocab,
    saved as a local HF checkpoint in fp32. Fast enough for exactness tests in fp32."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_target")
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def root() -> Path:
    return repo_root()
