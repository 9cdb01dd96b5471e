"""Online hidden states (online.py): vLLM's OpenAI server started by the lab serves the same states
as the offline cache (same tolerance as the backend comparison), consumed files are deleted, and no
server process outlives its owner (normal exit, Ctrl-C, owner killed with -9); bad input gets a
clear error naming the server log. One server start is shared (~45 s on the 2-core CPU)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_data import openai, write_jsonl
from test_extract import make_dataset
from test_extract_vllm import make_params

from eagle3lib.cache import CacheError, HiddenCache
from eagle3lib.data import prepare_data
from eagle3lib.extract import cached_splits, extract_hidden_states
from eagle3lib.online import HiddenStateServer, OnlineCache, ServerError, engine_flags, support_error
from eagle3lib.params import ParamsError, load_params
from eagle3lib.scaling import study_cache
from eagle3lib.train import train

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


def test_online_states_equal_the_offline_cache_and_ctrl_c_leaves_no_server(offline, smollm2_dir, tmp_path, dataset):
    params = make_params(smollm2_dir, tmp_path, "vllm")
    layout = params.layout()
    with pytest.raises(KeyboardInterrupt):
        with HiddenStateServer(params, layout) as server:
            pid = server.proc.pid
            online = OnlineCache(dataset, server.client(), server.aux_layers, identity="test")
            assert online.seq_index == offline.seq_index and online.lengths == offline.lengths
            rows = [online.row(i) for i in range(3)]
            worst = {"aux": 0.0, "final": 0.0}
            for i in range(len(online)):
                on, off = online.get(i), offline.get(i)
                assert torch.equal(on["input_ids"], off["input_ids"]) and torch.equal(on["loss_mask"], off["loss_mask"])
                assert on["aux"].dtype == off["aux"].dtype and on["aux"].shape == off["aux"].shape
                for name in worst:
                    worst[name] = max(worst[name], float((on[name] - off[name]).norm() / off[name].norm()))
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


def test_online_training_survives_a_server_death_and_trains_the_offline_drafter(smollm2_dir, tmp_path):
    """Same chats, same data order: the online run, whose server is killed after step 2 (the run
    stops naming the server log, the step-2 checkpoint stands, the rerun resumes with a fresh
    server), gives the offline run's losses, accuracies and weights (fp32; HF-made cache)."""
    chats = [openai(("user", f"Name fact {i} about the sea."), ("assistant", f"Fact {i}: the sea is salty "
                    f"and {i} waves are tall.")) for i in range(10)]
    source = write_jsonl(tmp_path / "chats.jsonl", chats)

    def profile(mode):
        return load_params("params/ci.yaml", {
            "run_name": mode, "output_dir": str(tmp_path / "outputs"),
            "target": {"path": str(smollm2_dir), "dtype": "float32"},
            "data": {"source": str(source), "max_records": None, "num_train": 8, "num_eval": 2, "regenerate": False,
                     "max_length": 64, "draft_vocab_size": 256},
            "extract": {"mode": mode, "dtype": "float32", "backend": "hf"},
            "train": {"max_steps": 4, "warmup_steps": 1, "checkpoint_every": 2, "tracking": "none",
                      "batch_tokens": 128, "dtype": "float32"}})

    def prepare(params):
        prepare_data(params, params.run_dir(), progress=False)
        for split in cached_splits(params):
            extract_hidden_states(params, params.layout(), split, progress=False)

    offline, online = profile("offline"), profile("online")
    for params in (offline, online):
        prepare(params)
    off_records = []
    off = train(offline, offline.run_dir(), progress=False, callback=off_records.append)
    staging = online.layout().online / "states"

    def kill_server_after_step_2(record):
        on_records.append(record)
        if record["step"] == 2:
            for pid in server_pids(staging):
                os.kill(pid, signal.SIGKILL)
    on_records = []
    with pytest.raises(ServerError, match=r"did not answer(.|\n)*server\.log"):
        train(online, online.run_dir(), progress=False, callback=kill_server_after_step_2)
    assert [c.name for c in online.layout().checkpoints.glob("step-*")] == ["step-000002"]
    assert server_pids(staging) == []                                       # stopped with the run
    on_records = on_records[:2]
    on = train(online, online.run_dir(), progress=False, callback=on_records.append)   # resumes, fresh server
    assert [r["step"] for r in on_records] == [1, 2, 3, 4] and off["steps"] == on["steps"] == 4
    assert not online.layout().hidden("train").exists()                     # no train cache was written
    for a, b in zip(off_records, on_records):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["step_acc"] == pytest.approx(a["step_acc"], abs=1e-6)
    weights = [load_file(str(Path(s["final_dir"]) / "model.safetensors")) for s in (off, on)]
    for name, w in weights[0].items():                                      # fp32 noise of the two engines
        assert float((weights[1][name].float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)) < 1e-4, name
    assert list(staging.glob("*")) == []                                    # every served file consumed


def test_profiles_refuse_online_mode_where_it_cannot_run(tmp_path):
    with pytest.raises(ParamsError, match="extract.mode: online trains with one process"):
        load_params("params/ci.yaml", {"extract": {"mode": "online"}, "train": {"nproc": 2, "distributed": "ddp"}})
    with pytest.raises(ParamsError, match="extract.mode: must be one of"):
        load_params("params/ci.yaml", {"extract": {"mode": "stream"}})
    online = load_params("params/ci.yaml", {"output_dir": str(tmp_path), "extract": {"mode": "online"}})
    with pytest.raises(ParamsError, match="06_scaling trains its points on the run's hidden-state cache"):
        study_cache(online, online.layout())
