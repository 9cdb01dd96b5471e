"""vLLM engine arguments: the one place that turns params into `vllm.LLM(**kwargs)` for every
stage that runs the target in vLLM (regeneration, extraction, the eval benchmarks).

    kwargs = engine_kwargs(P, "extract", model_path, max_model_len=P.data.max_length + 1)
    # ... passed as JSON to the stage's vLLM subprocess, which calls vllm.LLM(**kwargs, <its extras>)

Settings (params, see params.TargetParams; eval and extract may override the batch budget):

    target.tensor_parallel_size     GPUs one engine shards the weights over (8 on the b300 box)
    target.data_parallel_size       engine replicas; vLLM's offline `LLM` refuses > 1 in one process
                                    (vLLM 0.32: "not supported for single-process usage"), so > 1 is
                                    refused here with the fix, not passed on to hang
    target.enable_expert_parallel   MoE experts sharded over the TP x DP ranks instead of TP-split
    target.gpu_memory_utilization   share of each GPU the engine may take (weights + KV cache)
    target.max_num_batched_tokens   tokens per engine step (null: vLLM's default)
    target.enforce_eager            no CUDA graphs (faster start; needed by the CPU build)
    target.trust_remote_code        the checkpoint's own config/tokenizer code (Kimi, DeepSeek)
    target.dtype, seed              the dtype the weights run in; the engine's sampling seed
    max_model_len                   per stage: prompt + answer tokens it must hold

This module only builds plain dicts (JSON-able, no vllm import), so the parent process can
validate them before it starts a subprocess.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .params import Params, ParamsError

STAGES = ("regenerate", "extract", "eval")


def build_kwargs(model, dtype: str, max_model_len: int, seed: int = 0, *, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 gpu_memory_utilization: float = 0.5, max_num_batched_tokens: Optional[int] = None,
                 enforce_eager: bool = True, trust_remote_code: bool = False, where: str = "target") -> dict:
    """Checked `vllm.LLM` keyword arguments. `where` names the params section in errors."""
    def need(cond: bool, key: str, msg: str):
        if not cond:
            raise ParamsError(f"{where}.{key}: {msg}")

    need(tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {tensor_parallel_size}")
    need(data_parallel_size == 1, "data_parallel_size",
         f"{data_parallel_size}: vLLM's offline engine (vllm.LLM) refuses data_parallel_size > 1 in one "
         "process; use tensor_parallel_size (with enable_expert_parallel for MoE) to spread one engine "
         "over the GPUs, or run one engine per GPU group with extract.nproc")
    need(0 < gpu_memory_utilization <= 1, "gpu_memory_utilization",
         f"must be in (0, 1], got {gpu_memory_utilization}")
    need(max_model_len >= 2, "max_model_len", f"must be >= 2, got {max_model_len}")
    need(max_num_batched_tokens is None or max_num_batched_tokens >= 16, "max_num_batched_tokens",
         f"must be >= 16 (or null: vLLM's default), got {max_num_batched_tokens}")
    kwargs = {"model": str(model), "tokenizer": str(model), "dtype": dtype, "seed": seed,
              "max_model_len": int(max_model_len), "tensor_parallel_size": tensor_parallel_size,
              "enable_expert_parallel": enable_expert_parallel,
              "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": enforce_eager,
              "trust_remote_code": trust_remote_code}
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    return kwargs


def engine_kwargs(P: Params, stage: str, model: str | Path, max_model_len: int,
                  dtype: Optional[str] = None) -> dict:
    """`vllm.LLM` kwargs for `stage` ("regenerate" | "extract" | "eval") from the params.

    dtype: default target.dtype (eval passes eval.vllm_dtype). The batch budget is
    extract.vllm_max_num_batched_tokens / eval.vllm_max_num_batched_tokens when set, else
    target.max_num_batched_tokens."""
    if stage not in STAGES:
        raise ValueError(f"engine_kwargs: unknown stage {stage!r} (known: {', '.join(STAGES)})")
    t = P.target
    budget = {"extract": P.extract.vllm_max_num_batched_tokens,
              "eval": P.eval.vllm_max_num_batched_tokens}.get(stage)
    return build_kwargs(model, dtype or t.dtype, max_model_len, P.seed,
                        tensor_parallel_size=t.tensor_parallel_size, data_parallel_size=t.data_parallel_size,
                        enable_expert_parallel=t.enable_expert_parallel,
                        gpu_memory_utilization=t.gpu_memory_utilization,
                        max_num_batched_tokens=budget if budget is not None else t.max_num_batched_tokens,
                        enforce_eager=t.enforce_eager, trust_remote_code=t.trust_remote_code)
