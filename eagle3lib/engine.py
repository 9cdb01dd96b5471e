"""vLLM engine arguments: the one place that turns params into `vllm.LLM(**kwargs)` for every
stage that runs the target in vLLM (regeneration, extraction, the eval benchmarks).

    kwargs = engine_kwargs(params, "extract", model_path, max_model_len=params.data.max_length + 1)
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
    target.max_num_seqs             sequences one engine step decodes at most (null: vLLM's default)
    target.attention_backend        vLLM's attention backend by name (vLLM 0.32 takes it as the engine
                                    argument attention_backend; its VLLM_ATTENTION_BACKEND variable is
                                    gone), e.g. TRITON_MLA for Kimi on sm_120 (RTX PRO 6000); null: vLLM's
                                    choice, or on a CPU cpu_attention_backend's
    target.trust_remote_code        the checkpoint's own config/tokenizer code (Kimi, DeepSeek)
    target.dtype, seed              the dtype the weights run in; the engine's sampling seed
    max_model_len                   per stage: prompt + answer tokens it must hold
    extract.model_runner            vLLM's model runner for extraction; an environment variable,
                                    not an engine argument: engine_env(params, stage)

The process layout is an environment variable too (engine_env): an offline `vllm.LLM` by default
starts an engine-core process and, on a CPU, a worker process beside the caller, each importing
vLLM again and one CPU core kept for the scheduler. Regeneration on a CPU with one worker runs the
engine in its own process instead (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's own switch): same
tokens, started in seconds (NOTES.md, Decisions: vLLM's process layout). Extraction always keeps an
engine-core process: the connector hands each request's file over by a lock that the engine
releases in a later step, which an in-process engine never takes while its caller waits on the
lock. The eval benchmarks keep vLLM's default layout, the one `vllm serve` runs, so that their
tokens/s are a serving figure; a variable already set in the environment wins there (`make test`
sets it for the tests' engines).

Without target.attention_backend, the attention backend is chosen here by the CPU's flags
(`cpu_attention_backend`): on an AMX CPU, vLLM's CPU platform prefers its bf16-only AMX_MLA backend for MLA targets
(vllm/platforms/cpu.py `get_attn_backend_cls`), which cannot load fp32 weights; the engine then
asks for the reference CPU_MLA backend, which runs any dtype and is what non-AMX CPUs get anyway.

This module only builds plain dicts (JSON-able, no vllm import), so the parent process can
validate them before it starts a subprocess.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from .params import Params, ParamsError, cpu_flags

STAGES = ("regenerate", "extract", "eval")
# vLLM's CPU platform picks AMX_MLA when torch.cpu._is_amx_tile_supported(): the `amx_tile` flag
# (every AMX CPU also lists amx_bf16 / amx_int8).
AMX_CPU_FLAGS = {"amx_tile", "amx_bf16"}


def uses_mla(model) -> bool:
    """Whether the checkpoint at `model` is a multi-head latent attention (DeepSeek-V3 / Kimi)
    target: its config.json (or its text_config, for the multimodal Kimi wrapper) has kv_lora_rank."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any((c or {}).get("kv_lora_rank") for c in (config, config.get("text_config")))


def cpu_attention_backend(dtype: str, mla: bool, flags: Optional[set] = None,
                          cuda: Optional[bool] = None) -> Optional[str]:
    """The `attention_backend` a CPU engine must ask vLLM for, or None for vLLM's own choice.

    vLLM 0.32's CPU platform serves MLA with AMX_MLA whenever the CPU has AMX, unless CPU_MLA is
    requested; AMX_MLA takes bf16 weights only ("expect weight to be bfloat16, ..." for fp32).
    So: an MLA target in a dtype other than bf16 on an AMX CPU -> "CPU_MLA" (the reference
    backend non-AMX CPUs use anyway); everything else (GPUs, bf16, non-MLA targets) -> None."""
    if cuda is None:
        import torch  # only for MLA targets, to tell a CPU engine from a GPU one
        cuda = torch.cuda.is_available() if mla else False
    if not mla or cuda or dtype == "bfloat16":
        return None
    return "CPU_MLA" if (cpu_flags() if flags is None else flags) & AMX_CPU_FLAGS else None


def build_kwargs(model, dtype: str, max_model_len: int, seed: int = 0, *, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 gpu_memory_utilization: float = 0.5, max_num_batched_tokens: Optional[int] = None,
                 enforce_eager: bool = True, trust_remote_code: bool = False, max_num_seqs: Optional[int] = None,
                 attention_backend: Optional[str] = None, where: str = "target") -> dict:
    """Checked `vllm.LLM` keyword arguments. `where` names the params section in errors;
    max_num_seqs: None (vLLM's default); attention_backend: None (vLLM's choice), target.attention_backend
    or cpu_attention_backend's answer."""
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
    need(max_num_seqs is None or max_num_seqs >= 1, "max_num_seqs", f"must be >= 1 (or null), got {max_num_seqs}")
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if attention_backend is not None:
        kwargs["attention_backend"] = attention_backend
    return kwargs


def engine_kwargs(params: Params, stage: str, model: str | Path, max_model_len: int,
                  dtype: Optional[str] = None) -> dict:
    """`vllm.LLM` kwargs for `stage` ("regenerate" | "extract" | "eval") from the params.

    dtype: default target.dtype (eval passes eval.vllm_dtype). The batch budget is
    extract.vllm_max_num_batched_tokens / eval.vllm_max_num_batched_tokens when set, else
    target.max_num_batched_tokens."""
    if stage not in STAGES:
        raise ValueError(f"engine_kwargs: unknown stage {stage!r} (known: {', '.join(STAGES)})")
    t = params.target
    budget = {"extract": params.extract.vllm_max_num_batched_tokens,
              "eval": params.eval.vllm_max_num_batched_tokens}.get(stage)
    dtype = dtype or t.dtype
    return build_kwargs(model, dtype, max_model_len, params.seed,
                        tensor_parallel_size=t.tensor_parallel_size, data_parallel_size=t.data_parallel_size,
                        enable_expert_parallel=t.enable_expert_parallel,
                        gpu_memory_utilization=t.gpu_memory_utilization,
                        max_num_batched_tokens=budget if budget is not None else t.max_num_batched_tokens,
                        enforce_eager=t.enforce_eager, trust_remote_code=t.trust_remote_code,
                        max_num_seqs=t.max_num_seqs,
                        attention_backend=t.attention_backend or cpu_attention_backend(dtype, uses_mla(model)))


# vLLM 0.32 has no engine argument for the model runner: VllmConfig.use_v2_model_runner reads the
# environment variable VLLM_USE_V2_MODEL_RUNNER ("0" V1, "1" V2, unset: V2 on CUDA with Triton
# unless a feature it lacks is configured, else V1); the engine core processes inherit it.
MODEL_RUNNER_ENV = {"v1": "0", "v2": "1"}
# The engine core (and, on a CPU, its worker) in the calling process: vLLM's documented switch.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
IN_PROCESS_STAGES = ("regenerate",)
ENGINE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}      # vLLM's default, stated


def engine_env(params: Params, stage: str, cuda: Optional[bool] = None) -> dict:
    """Environment variables the vLLM subprocess of `stage` must start with (on top of its own),
    next to engine_kwargs: for "extract", VLLM_USE_V2_MODEL_RUNNER from extract.model_runner
    (nothing for auto: vLLM's own choice), and always an engine-core process (ENGINE_PROCESS_ENV,
    whatever the environment says: the connector's file handover needs it; the online server is an
    "extract" engine too); for "regenerate" on a CPU with one worker, IN_PROCESS_ENV unless the
    environment already sets it. cuda: None asks torch."""
    if stage not in STAGES:
        raise ValueError(f"engine_env: unknown stage {stage!r} (known: {', '.join(STAGES)})")
    runner = params.extract.model_runner if stage == "extract" else "auto"
    if runner not in ("auto", *MODEL_RUNNER_ENV):
        raise ParamsError(f"extract.model_runner: {runner!r}; expected auto, v1 or v2")
    env = {} if runner == "auto" else {"VLLM_USE_V2_MODEL_RUNNER": MODEL_RUNNER_ENV[runner]}
    if stage == "extract":
        env.update(ENGINE_PROCESS_ENV)
    elif stage in IN_PROCESS_STAGES and params.target.tensor_parallel_size == 1:
        if cuda is None:
            import torch  # lazy: this module stays light; the stages that call this have torch loaded
            cuda = torch.cuda.is_available()
        if not cuda:
            env.update({k: v for k, v in IN_PROCESS_ENV.items() if k not in os.environ})
    return env
