"""Online hidden states (online.py): vLLM's OpenAI server started by the lab serves the same states
as the offline cache (same tolerance as the backend comparison), consumed files are deleted, and no
server process outlives its owner (normal exit, Ctrl-C, owner killed with -9); bad input gets a
clear error naming the server log. One server start is shared (~45 s on the 2-core CPU)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_checkpoints import descendants
from test_data import openai, write_jsonl
from test_extract import make_dataset
from test_extract_vllm import make_params

from eagle3lib.cache import CacheError, HiddenCache
from eagle3lib.data import prepare_data
from eagle3lib.dist import Dist
from eagle3lib.extract import cached_splits, extract_hidden_states
from eagle3lib.files import atomic_write_json
from eagle3lib.mode_plan import staging_bound_bytes
from eagle3lib.online import HiddenStateServer, OnlineCache, ServerError, engine_flags, support_error
from eagle3lib.params import ParamsError, load_params
from eagle3lib.scaling import run_study, study_cache
from eagle3lib.train import torchrun_command, train

pytestmark = pytest.mark.vllm

LENGTHS = [37, 120, 5, 64, 0, 99, 17]          # one empty row: skipped by both modes


def group_gone(pid: int, within: float = 30.0) -> bool:
    """True once no process of the process group `pid` is left (the server leads its own group)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def dataset():
    return make_dataset(LENGTHS, seed=3)


@pytest.fixture(scope="module")
def offline(smollm2_dir, tmp_path_factory, dataset):
    params = make_params(smollm2_dir, tmp_path_factory.mktemp("offline"), "hf")       # the reference backend
    extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    return HiddenCache(params.layout().hidden("train"))


def test_engine_kwargs_become_server_flags():
    assert engine_flags({"dtype": "float32", "enforce_eager": True, "trust_remote_code": False,
                         "max_num_batched_tokens": None, "seed": 0, "x": {"a": 1}}) == \
        ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--x", '{"a": 1}']


def worst_state_difference(online: OnlineCache, offline: HiddenCache) -> dict:
    """Row by row, the served states against the cache's: ids, masks, dtypes and shapes equal
    (asserted); returns the largest relative difference of the aux and final states."""
    worst = {"aux": 0.0, "final": 0.0}
    for i in range(len(online)):
        on, off = online.get(i), offline.get(i)
        assert torch.equal(on["input_ids"], off["input_ids"]) and torch.equal(on["loss_mask"], off["loss_mask"])
        assert on["aux"].dtype == off["aux"].dtype
        assert on["aux"].shape == off["aux"].shape and on["final"].shape == off["final"].shape
        for name in worst:
            worst[name] = max(worst[name], float((on[name] - off[name]).norm() / off[name].norm()))
    return worst


def test_online_states_equal_the_offline_cache_and_ctrl_c_leaves_no_server(offline, smollm2_dir, tmp_path, dataset):
    params = make_params(smollm2_dir, tmp_path, "vllm")
    layout = params.layout()
    with pytest.raises(KeyboardInterrupt):
        with HiddenStateServer(params, layout) as server:
            pid = server.proc.pid
            online = OnlineCache(dataset, server.client(), server.aux_layers, identity="test")
            assert online.seq_index == offline.seq_index and online.lengths == offline.lengths
            rows = [online.row(i) for i in range(3)]
            worst = worst_state_difference(online, offline)
            assert worst["aux"] < 1e-5 and worst["final"] < 1e-5, worst      # the backends' tolerance (fp32)
            batch = server.client().states(rows)                              # requests sent together
            assert all(torch.equal(a, online.get(i)["aux"]) for i, (a, _) in enumerate(batch))
            assert list((layout.online / "states").glob("*.safetensors")) == []    # consumed: deleted
            assert "Application startup complete" in server.log_tail(200)
            raise KeyboardInterrupt                                          # Ctrl-C in the trainer
    assert group_gone(pid), "the vLLM server outlived a Ctrl-C"


def test_a_server_whose_owner_is_killed_dies_with_it(smollm2_dir, tmp_path):
    script = textwrap.dedent(f"""
        import time
        from test_extract_vllm import make_params
        from eagle3lib.online import HiddenStateServer
        params = make_params({str(smollm2_dir)!r}, {str(tmp_path)!r}, "vllm")
        server = HiddenStateServer(params, params.layout())
        server._wait_ready = lambda: (print(server.proc.pid, flush=True), time.sleep(3600))
        server.start()
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    pid = int(owner.stdout.readline())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    assert group_gone(pid), "the vLLM server outlived its owner (kill -9)"


def test_bad_input_names_the_server_log_and_leaves_no_process(smollm2_dir, tmp_path, monkeypatch):
    params = make_params(smollm2_dir, tmp_path, "vllm")
    layout = params.layout()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is in use"):
            HiddenStateServer(params, layout, port=port).start()

    class BadFlag(HiddenStateServer):
        def command(self):
            return super().command() + ["--no-such-flag"]
    server = BadFlag(params, layout)
    with pytest.raises(ServerError, match=r"exited \(code 2\) before it became healthy(.|\n)*server.log"):
        server.start()
    assert server.proc is None and "--no-such-flag" in server.log_tail()

    slow = HiddenStateServer(params, layout, ready_timeout=2)
    with pytest.raises(ServerError, match="did not become healthy within 2 s"):
        slow.start()
    assert slow.proc is None

    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "vllm is not installed" in support_error()
    with pytest.raises(ServerError, match="vllm is not installed"):
        HiddenStateServer(params, layout).start()


def test_a_connector_file_of_the_wrong_shape_is_refused_and_deleted(smollm2_dir, tmp_path):
    params = make_params(smollm2_dir, tmp_path, "vllm")
    client = HiddenStateServer(params, params.layout()).client()         # never started: reads only
    bad = tmp_path / "req.safetensors"
    save_file({"hidden_states": torch.zeros(3, 2, 576), "token_ids": torch.tensor([1, 2, 3])}, str(bad))
    with pytest.raises(CacheError, match=r"req.safetensors holds hidden_states of shape \[3, 2, 576\]"):
        client._read([1, 2, 3], str(bad))
    assert not bad.exists()


def server_pids(staging) -> list:
    """Processes whose command line names this server's staging folder (the api_server's)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(staging) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def sea_chats(tmp_path_factory) -> Path:
    chats = [openai(("user", f"Name fact {i} about the sea."), ("assistant", f"Fact {i}: the sea is salty "
                    f"and {i} waves are tall.")) for i in range(10)]
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", chats)


def chat_profile(root: Path, smollm2_dir, source, mode: str, train: dict = None, extract: dict = None) -> Path:
    """A ci profile over the sea chats (fp32 target, HF-made fp32 cache), written as a file (torchrun
    reads it), with data prepared and the cached splits extracted."""
    profile = {"inherit": str(Path("params/ci.yaml").resolve()), "run_name": mode, "output_dir": str(root / "outputs"),
               "target": {"path": str(smollm2_dir), "dtype": "float32"},
               "data": {"source": str(source), "max_records": None, "num_train": 8, "num_eval": 2,
                        "regenerate": False, "max_length": 64, "draft_vocab_size": 256},
               "extract": {"mode": mode, "dtype": "float32", "backend": "hf", **(extract or {})},
               "train": {"max_steps": 4, "warmup_steps": 1, "checkpoint_every": 2, "tracking": "none",
                         "batch_tokens": 128, "dtype": "float32", **(train or {})}}
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(profile))
    params = load_params(path)
    prepare_data(params, params.run_dir(), progress=False)
    for split in cached_splits(params):
        extract_hidden_states(params, params.layout(), split, progress=False)
    return path


def assert_same_training(off_records: list, on_records: list, off: dict, on: dict) -> None:
    """Same losses and accuracies step by step, and the same final weights, within fp32 noise of the two
    engines (1e-4 relative)."""
    assert [r["step"] for r in on_records] == [r["step"] for r in off_records] and off["steps"] == on["steps"]
    for a, b in zip(off_records, on_records):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["step_acc"] == pytest.approx(a["step_acc"], abs=1e-6), a["step"]
    weights = [load_file(str(Path(s["final_dir"]) / "model.safetensors")) for s in (off, on)]
    for name, w in weights[0].items():
        assert float((weights[1][name].float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)) < 1e-4, name


@pytest.fixture(scope="module")
def sea_runs(smollm2_dir, tmp_path_factory, sea_chats) -> dict:
    """{mode: profile path} of an offline and an online run over the sea chats, data and caches made."""
    root = tmp_path_factory.mktemp("sea")
    return {mode: chat_profile(root, smollm2_dir, sea_chats, mode) for mode in ("offline", "online")}


def new_log(path: Path, since: int) -> str:
    """The server log written after byte `since` (runs of one folder append to one log)."""
    return path.read_bytes()[since:].decode(errors="replace")


def test_a_dead_server_is_restarted_and_the_run_trains_the_offline_drafter(sea_runs):
    """Same chats, same data order. Online, the server is killed after step 2: the watchdog starts it
    again, step 3 sends its batch again, and the run's losses, accuracies and weights equal the
    offline run's: no batch trained twice or skipped. (Restarts spent: the next test; a rerun that
    resumes from a checkpoint with a fresh server: the two-rank test.)"""
    offline = load_params(sea_runs["offline"])
    online = load_params(sea_runs["online"], {"extract": {"online_restarts": 1}})   # not part of the cache's hash
    log_path = online.layout().online / "server.log"
    since = log_path.stat().st_size if log_path.exists() else 0
    off_records, on_records = [], []
    off = train(offline, offline.run_dir(), progress=False, callback=off_records.append)
    staging = online.layout().online / "states"

    def kill_server_after_step_2(record):
        on_records.append(record)
        if record["step"] == 2:
            for pid in server_pids(staging):
                os.kill(pid, signal.SIGKILL)
    on = train(online, online.run_dir(), progress=False, callback=kill_server_after_step_2)
    log = new_log(log_path, since)
    assert "restarting it (0 restart(s) left)" in log and log.count("Application startup complete") == 2
    assert_same_training(off_records, on_records, off, on)
    assert not online.layout().hidden("train").exists()                     # no train cache was written
    assert server_pids(staging) == [] and not (online.layout().online / "server.json").exists()
    assert list(staging.glob("*")) == []


def test_a_client_stops_naming_the_log_once_the_restarts_are_spent(smollm2_dir, tmp_path):
    """No server on the port; server.json first says `restarting` (the client waits), then `failed`
    (restarts spent: the client raises naming the log); an answer that is the same generation and
    healthy would be another failure (also raised, not waited on)."""
    params = make_params(smollm2_dir, tmp_path, "vllm")
    server = HiddenStateServer(params, params.layout())                  # never started: its paths and port
    server.folder.mkdir(parents=True)
    status = {"port": server.port, "run_id": None, "generation": 1, "log": str(server.log_path)}
    atomic_write_json(server.status_path, {**status, "state": "restarting"})
    client = server.client()
    threading.Timer(1.5, atomic_write_json, (server.status_path, {**status, "state": "failed"})).start()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"was not restarted \(extract.online_restarts spent(.|\n)*server\.log"):
        client.states([[1, 2, 3]])
    assert time.monotonic() - t0 >= 1.4                                    # it waited while `restarting`


def test_the_scaling_study_trains_its_points_online_on_one_server_as_offline(sea_runs):
    """06_scaling in online mode: its points (4 and 8 chats, one epoch) train on states from one server
    start, and each point's steps and replayed acceptance equal the offline study's."""
    study = {"scaling": {"sizes": [4, 8], "epochs": 1, "vllm": False}}
    offline, online = (load_params(sea_runs[mode], study) for mode in ("offline", "online"))
    log_path = online.layout().online / "server.log"
    since = log_path.stat().st_size if log_path.exists() else 0
    assert len(study_cache(online, online.layout())) == len(study_cache(offline, offline.layout())) == 8
    off, on = (run_study(params, params.layout(), progress=False, log=lambda line: None)
               for params in (offline, online))
    assert list(on.chats) == [4, 8] and list(on.steps) == list(off.steps)
    assert on.acceptance_replayed.tolist() == pytest.approx(off.acceptance_replayed.tolist(), abs=1e-4)
    assert new_log(log_path, since).count("Application startup complete") == 1
    assert not online.layout().hidden("train").exists()


def kill_torchrun_when(proc: subprocess.Popen, folder: Path, keep: callable) -> list:
    """SIGKILL torchrun and every process below it except `keep(pid)` ones, once `folder` exists;
    returns the killed pids."""
    deadline = time.time() + 240
    while not folder.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"training ended before {folder.name}: {proc.stderr.read()[-3000:]}"
    victims = [pid for pid in descendants(proc.pid) if not keep(pid)] + [proc.pid]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return victims


def test_two_ranks_share_one_server_survive_a_trainer_kill_and_match_offline(smollm2_dir, tmp_path, sea_chats):
    """torchrun with 2 gloo ranks (ddp) in online mode: rank 0 starts the server, rank 1 attaches. The
    trainer (torchrun and its ranks) is killed with SIGKILL after the step-2 checkpoint: the server
    dies with rank 0; the rerun resumes and its history and weights equal the offline single-process
    run with the same global batch (grad_accum 2). The connector files on disk, sampled every 5 ms
    through both legs, stay under online.staging_bound_bytes."""
    steps = {"max_steps": 8}
    offline = load_params(chat_profile(tmp_path / "off", smollm2_dir, sea_chats, "offline",
                                       train={**steps, "grad_accum": 2}))
    online_path = chat_profile(tmp_path / "on", smollm2_dir, sea_chats, "online",
                               train={**steps, "distributed": "ddp", "nproc": 2})
    online = load_params(online_path)
    off = train(offline, offline.run_dir(), progress=False)
    staging = online.layout().online / "states"
    peak, sampling = [0, 0], threading.Event()

    def sample_staging():
        while not sampling.wait(0.005):
            try:
                size = sum(f.stat().st_size for f in staging.glob("*.safetensors"))
            except OSError:
                continue                                         # a file consumed while listed
            peak[0], peak[1] = max(peak[0], size), peak[1] + 1
    sampler = threading.Thread(target=sample_staging, daemon=True)
    sampler.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = torchrun_command(online_path, None, 2) + ["--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    servers = []

    def is_server(pid):
        servers[:] = server_pids(staging)
        return pid in servers or any(pid in descendants(s) for s in servers)
    kill_torchrun_when(proc, online.layout().checkpoints / "step-000002", keep=is_server)
    assert servers, "no server was running at the kill"
    assert not online.layout().summary.exists()                           # killed mid-run
    assert all(group_gone(pid) for pid in servers), "the vLLM server outlived the killed trainer"
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    sampling.set()
    sampler.join()
    assert rerun.returncode == 0, rerun.stderr[-5000:]
    on = json.loads(online.layout().summary.read_text())
    assert on["world_size"] == 2 and not online.layout().hidden("train").exists()
    history = json.loads(online.layout().history.read_text())
    assert_same_training(json.loads(offline.layout().history.read_text()), history, off, on)
    bound = staging_bound_bytes(576, 128, num_workers=0, world=2)
    assert peak[1] > 100 and 0 < peak[0] <= bound, (peak, bound)
    assert server_pids(staging) == [] and list(staging.glob("*")) == []


def test_online_params_are_checked_before_any_work():
    with pytest.raises(ParamsError, match="extract.online_restarts: must be >= 0"):
        load_params("params/ci.yaml", {"extract": {"mode": "online", "online_restarts": -1}})
    with pytest.raises(ParamsError, match="extract.online_gpus: is for extract.mode: online only"):
        load_params("params/ci.yaml", {"extract": {"online_gpus": [1]}})
    with pytest.raises(ParamsError, match=r"extract.online_gpus: gives the server 1 GPU\(s\), fewer than"):
        load_params("params/ci.yaml", {"extract": {"mode": "online", "online_gpus": [3]},
                                       "target": {"tensor_parallel_size": 2}})
    with pytest.raises(ParamsError, match="extract.online_gpus: must be null"):
        load_params("params/ci.yaml", {"extract": {"mode": "online", "online_gpus": [1, 1]}})
    with pytest.raises(ParamsError, match="extract.mode: must be one of"):
        load_params("params/ci.yaml", {"extract": {"mode": "stream"}})


def test_the_node_split_gives_the_training_ranks_the_gpus_the_server_does_not_take(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    picked = []
    for local_rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        picked.append(Dist().device("auto", avoid=(4, 5, 6, 7)).index)
    assert picked == [0, 1, 2, 3]
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert Dist().device("auto").index == 5                                  # no split: every GPU
    with pytest.raises(RuntimeError, match=r"rank 4: no GPU left for training \(8 visible, \[4, 5, 6, 7\]"):
        monkeypatch.setenv("LOCAL_RANK", "4")
        Dist().device("auto", avoid=(4, 5, 6, 7))


def test_the_staging_bound_counts_ranks_workers_and_the_states_of_a_micro_batch():
    per_token = 4 * 576 * 4 + 8 + 512
    assert staging_bound_bytes(576, 128, num_workers=0, world=2) == 2 * 1 * 128 * per_token
    assert staging_bound_bytes(576, 128, num_workers=3, world=1) == 6 * 128 * per_token
