"""files: atomic_dir (a folder appears complete or not at all), remove_tree (deletes only inside
its root), run_lock (one process per run folder), update_metrics."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3lib.files import (
    LOCK_TOKEN_ENV,
    MetricsError,
    RunLocked,
    UnsafeLink,
    atomic_dir,
    check_run_links,
    read_metrics,
    remove_tree,
    run_lock,
    update_metrics,
)
from eagle3lib.layout import RunLayout


def test_atomic_dir_replaces_an_existing_folder_and_leaves_no_temp(tmp_path):
    out = tmp_path / "final"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".final-")
        (tmp / "new.txt").write_text("new")
        assert (out / "old.txt").read_text() == "old"      # untouched until the block ends
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]   # no temp or .old folders left


def test_atomic_dir_error_keeps_the_old_folder(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_dir(out) as tmp:
            (tmp / "config.json").write_text('{"half": ')
            raise RuntimeError("disk full")
    assert (out / "config.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_atomic_dir_creates_missing_parents(tmp_path):
    out = tmp_path / "a" / "b" / "step-000010"
    with atomic_dir(out) as tmp:
        (tmp / "x").write_bytes(b"1")
    assert (out / "x").read_bytes() == b"1"


# ---- remove_tree: deletes only strictly inside its root ----------------------------------------------
def test_remove_tree_deletes_inside_the_root(tmp_path):
    run = tmp_path / "outputs" / "ci"
    (run / "data" / "train").mkdir(parents=True)
    (run / "data" / "train" / "x").write_text("1")
    remove_tree(run / "data" / "train", under=run)
    assert not (run / "data" / "train").exists() and (run / "data").is_dir()
    remove_tree(run / "data" / "missing", under=run)          # absent: nothing to do


@pytest.mark.parametrize("target", ["root", "parent", "sibling", "dotdot", "link"])
def test_remove_tree_refuses_anything_not_strictly_inside(tmp_path, target):
    outputs = tmp_path / "outputs"
    run = outputs / "ci"
    run.mkdir(parents=True)
    outside = tmp_path / "x" / "data" / "train"
    outside.mkdir(parents=True)
    (outside / "keep").write_text("1")
    (run / "link").symlink_to(outside)
    path = {"root": run, "parent": outputs, "sibling": tmp_path / "x",
            "dotdot": run / ".." / ".." / "x" / "data" / "train", "link": run / "link"}[target]
    with pytest.raises(ValueError, match="refusing to delete"):
        remove_tree(path, under=run)
    assert (outside / "keep").read_text() == "1" and run.is_dir()


# ---- run_lock: one process per run folder --------------------------------------------------------
HOLDER = """
import sys, time
from eagle3lib.files import run_lock
with run_lock(sys.argv[1], log=lambda m: print(m, flush=True)):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(folder, seconds=60.0, env=None):
    """A separate process that takes the lock on `folder` and keeps it for `seconds`."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(seconds)],
                            stdout=subprocess.PIPE, text=True, env=env or _env_without_token())
    assert proc.stdout.readline().strip() == "held"
    return proc


def _env_without_token():
    env = dict(os.environ)
    env.pop(LOCK_TOKEN_ENV, None)
    return env


def test_second_holder_stops_naming_the_pid(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunLocked) as err:
            with run_lock(tmp_path, log=lambda m: None):
                pytest.fail("entered a folder another process holds")
        assert f"pid {proc.pid} on host {socket.gethostname()}" in str(err.value)
        assert str(tmp_path / ".lock") in str(err.value)            # how to clear a lock by hand
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == proc.pid   # not stolen
    finally:
        proc.kill()
        proc.wait()


def test_stale_lock_of_a_finished_process_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    (tmp_path / ".lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "token": "old"}))
    logged = []
    with run_lock(tmp_path, log=logged.append) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert len(logged) == 1 and "stale" in logged[0] and f"pid {dead}" in logged[0]
    assert not (tmp_path / ".lock").exists()


def test_lock_of_a_reused_pid_is_stale(tmp_path, monkeypatch):
    """The pid is alive but started at another time than the lock's owner: another process."""
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                "start": "-1", "token": "old"}))
    logged = []
    with run_lock(tmp_path, log=logged.append):
        pass
    assert len(logged) == 1 and "stale" in logged[0]


def test_lock_is_released_on_exceptions_and_the_env_restored(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        with run_lock(tmp_path):
            assert (tmp_path / ".lock").is_file() and os.environ[LOCK_TOKEN_ENV]
            raise RuntimeError("boom")
    assert not (tmp_path / ".lock").exists() and LOCK_TOKEN_ENV not in os.environ
    proc = _holder(tmp_path, seconds=0)        # a later process takes it at once
    assert proc.wait() == 0 and not (tmp_path / ".lock").exists()


def test_processes_started_by_the_holder_enter(tmp_path, monkeypatch):
    """`eagle3 run` holds the lock while its notebook starts `python -m eagle3lib.train`."""
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    with run_lock(tmp_path):
        child = _holder(tmp_path, seconds=0, env=dict(os.environ))
        assert child.wait() == 0
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()   # the child left it
        stranger = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path), "0"], capture_output=True,
                                  text=True, env=_env_without_token())
        assert stranger.returncode != 0 and f"RunLocked: {tmp_path} is in use by pid {os.getpid()}" in stranger.stderr
    assert not (tmp_path / ".lock").exists()


RACER = """
import sys, time
from pathlib import Path
from eagle3lib.files import RunLocked, run_lock
while not Path(sys.argv[2]).exists():
    time.sleep(0.01)
try:
    with run_lock(sys.argv[1], log=lambda m: None):
        print("got", flush=True)
        time.sleep(4)
except RunLocked:
    print("locked", flush=True)
"""


def test_racing_takeovers_of_a_stale_lock_have_one_winner(tmp_path):
    run, go = tmp_path / "run", tmp_path / "go"
    run.mkdir()
    (run / ".lock").write_text(json.dumps({"pid": 2 ** 22 + 7, "host": socket.gethostname(), "token": "x"}))
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(run), str(go)], stdout=subprocess.PIPE,
                              text=True, env=_env_without_token()) for _ in range(4)]
    time.sleep(2.0)                                             # let all four import and wait
    go.write_text("")
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs == ["got", "locked", "locked", "locked"], outs


def test_update_metrics_merges_sections_in_the_layouts_file(tmp_path):
    update_metrics(tmp_path, "data", {"n": 1})
    update_metrics(tmp_path, "train", {"loss": 2.0})
    assert json.loads(RunLayout(tmp_path).metrics.read_text()) == {"data": {"n": 1}, "train": {"loss": 2.0}}


# ---- links inside a run folder never carry writes or deletes elsewhere -----------------------------
def test_remove_tree_refuses_a_root_that_is_a_link_out(tmp_path):
    """outputs/<run>/data is a link to a folder elsewhere: deleting data/train through it is refused
    even though both sides resolve into the same place."""
    run = tmp_path / "outputs" / "ci"
    run.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "train").mkdir(parents=True)
    (elsewhere / "train" / "keep").write_text("1")
    (run / "data").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="goes through a link"):
        remove_tree(run / "data" / "train", under=run / "data")
    assert (elsewhere / "train" / "keep").read_text() == "1"


def test_check_run_links_refuses_links_out_and_allows_links_inside(tmp_path):
    run = tmp_path / "outputs" / "ci"
    (run / "data").mkdir(parents=True)
    point = run / "scaling" / "n000008"
    point.mkdir(parents=True)
    (point / "data").symlink_to(Path("..") / ".." / "data")      # 06_scaling's links stay inside
    check_run_links(run)
    check_run_links(point, within=run)           # the point trains on its own, its links in the run
    with pytest.raises(UnsafeLink, match="outside the run folder"):
        check_run_links(point)                   # without `within` the point's own folder is the bound
    with pytest.raises(ValueError, match="is not inside"):
        check_run_links(run, within=point)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "hidden").symlink_to(elsewhere)
    with pytest.raises(UnsafeLink, match=r"hidden is a link to .*outside the run folder"):
        check_run_links(run)


def test_data_stage_refuses_a_data_link_out_of_the_run(tmp_path):
    """The reproduction: `eagle3 run --only data` with outputs/<run>/data linked elsewhere wrote and
    deleted in that folder. The stage now stops before writing anything."""
    from eagle3lib.data import prepare_data
    from eagle3lib.params import load_params
    params = load_params("params/ci.yaml", {"output_dir": str(tmp_path / "outputs")})
    run = params.run_dir()
    run.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stats.json").write_text("mine")
    (run / "data").symlink_to(elsewhere)
    with pytest.raises(UnsafeLink, match="outside the run folder"):
        prepare_data(params, run, progress=False)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["stats.json"]
    assert (elsewhere / "stats.json").read_text() == "mine"


@pytest.mark.parametrize("content", ['{"data": {"n": 1', "[1, 2]", '{"data": 3}', "\xff"])
def test_a_corrupt_metrics_file_is_named_with_the_fix(tmp_path, content):
    path = RunLayout(tmp_path).metrics
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(MetricsError, match=rf"{path.name}.*mv .*metrics.json .*\.bad"):
        update_metrics(tmp_path, "data", {"n": 1})
    with pytest.raises(MetricsError, match="metrics.json"):
        read_metrics(path)


def test_run_lock_refuses_a_run_folder_with_a_link_out(tmp_path):
    run = tmp_path / "ci"
    run.mkdir()
    (run / "train").symlink_to(tmp_path)
    with pytest.raises(UnsafeLink, match="train is a link"):
        with run_lock(run):
            pass
    assert not (run / ".lock").exists()
