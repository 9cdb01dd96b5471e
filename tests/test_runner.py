"""The runner and the `eagle3` CLI: run names never leave outputs/, one run per folder (lock)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from tiny_notebooks import tiny_notebook

from eagle3lib.files import LOCK_TOKEN_ENV, RunLocked
from eagle3lib.layout import RunLayout
from eagle3lib.params import ParamsError, repo_root
from eagle3lib.runner import NotebookFailed, run_pipeline

CI = repo_root() / "params" / "ci.yaml"


def profile(tmp_path: Path, run_name="t") -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(f"inherit: {CI}\noutput_dir: {tmp_path / 'out'}\nrun_name: {run_name}\n")
    return path


def files_under(folder: Path) -> set:
    return {p.relative_to(folder) for p in folder.rglob("*")} if folder.exists() else set()


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "..", ".", "a/b", ".hidden", ""])
def test_run_pipeline_refuses_a_run_name_outside_outputs_before_any_work(tmp_path, name):
    prof = profile(tmp_path)
    before = files_under(tmp_path)
    with pytest.raises(ParamsError, match="^--run-name: .*not a valid run name"):
        run_pipeline(str(prof), run_name=name, notebooks_dir=tmp_path / "nb", log=lambda *a: None)
    assert files_under(tmp_path) == before                 # nothing created, inside or outside outputs/


@pytest.mark.parametrize("name", ["../x", "/tmp/eagle3-escape", ".", ""])
def test_cli_run_refuses_a_bad_run_name_with_exit_2(tmp_path, name):
    r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "run", "--params", str(profile(tmp_path)),
                        "--run-name", name], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "--run-name:" in r.stderr and "letters, digits" in r.stderr
    assert not (tmp_path / "out").exists() and not Path("/tmp/eagle3-escape").exists()


def test_yaml_run_name_dotdot_is_refused_by_the_runner(tmp_path):
    with pytest.raises(ParamsError, match="^run_name:"):
        run_pipeline(str(profile(tmp_path, run_name="..")), notebooks_dir=tmp_path / "nb", log=lambda *a: None)
    assert not (tmp_path / "out").exists()


def test_run_stops_at_once_when_another_process_holds_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    run_dir = tmp_path / "out" / "t"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom eagle3lib.files import run_lock\n"
         "with run_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n", str(run_dir)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        nbdir = tmp_path / "nb"
        nbdir.mkdir()
        nbformat.write(tiny_notebook(["open('ran', 'w')"]), str(nbdir / "00_research.ipynb"))
        with pytest.raises(RunLocked, match=f"in use by pid {holder.pid}"):
            run_pipeline(str(profile(tmp_path)), only="research", notebooks_dir=nbdir, log=lambda *a: None)
        assert not (nbdir / "ran").exists() and not RunLayout(run_dir).notebook("00_research").exists()
        r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "run", "--params", str(profile(tmp_path)),
                            "--only", "research"], capture_output=True, text=True)
        assert r.returncode == 3 and f"pid {holder.pid}" in r.stderr, r.stderr
    finally:
        holder.kill()
        holder.wait()


def test_run_holds_the_lock_lets_its_notebooks_in_and_releases_it_on_failure(tmp_path, monkeypatch):
    """The notebook (a kernel process started by the runner) takes the same lock as
    `python -m eagle3lib.train` would: it enters; the failing notebook still releases the lock."""
    monkeypatch.delenv(LOCK_TOKEN_ENV, raising=False)
    nbdir = tmp_path / "nb"
    nbdir.mkdir()
    nbformat.write(tiny_notebook([
        "import json, os\n"
        "from eagle3lib.files import run_lock\n"
        "from eagle3lib.params import load_params\n"
        "run_dir = load_params(params_path).run_dir(run_name)\n"
        "owner = json.loads((run_dir / '.lock').read_text())\n"
        "with run_lock(run_dir):\n"
        "    (run_dir / 'nested.json').write_text(json.dumps([owner['pid'], os.getpid()]))",
        "raise ValueError('boom after the lock')"]), str(nbdir / "00_research.ipynb"))
    with pytest.raises(NotebookFailed, match="boom after the lock"):
        run_pipeline(str(profile(tmp_path)), only="research", run_name="r-1", notebooks_dir=nbdir,
                     html=False, log=lambda *a: None)
    layout = RunLayout(tmp_path / "out" / "r-1")
    owner_pid, kernel_pid = json.loads((layout.root / "nested.json").read_text())
    assert owner_pid == os.getpid() != kernel_pid            # the runner held it, the kernel entered
    assert layout.notebook("00_research").is_file()           # executed copy where the layout says
    assert not (layout.root / ".lock").exists() and LOCK_TOKEN_ENV not in os.environ


def test_vllm_subprocess_progress_lines_reach_stderr_and_the_log(tmp_path, capsys, monkeypatch):
    """vllm_bench's child runs for minutes per mode: under the headless runner (text progress) its
    [vllm_bench] lines are relayed to stderr as they come (the terminal shows only stderr), every
    line stays in the log, and a timeout still kills it."""
    from eagle3lib import vllm_bench
    from eagle3lib.progress import PROGRESS_ENV
    monkeypatch.setenv(PROGRESS_ENV, "text")
    child = [sys.executable, "-c", "print('INFO engine noise'); print('[vllm_bench] mode plain', flush=True); "
             "print('[vllm_bench] plain: 12.0 tok/s'); raise SystemExit(3)"]
    log = tmp_path / "log.txt"
    returncode, tail = vllm_bench.run_logged(child, log, "[vllm_bench]", timeout=60, cwd=tmp_path)
    assert returncode == 3
    assert tail == ["INFO engine noise", "[vllm_bench] mode plain", "[vllm_bench] plain: 12.0 tok/s"]
    err = capsys.readouterr().err.splitlines()
    assert err == ["[vllm_bench] mode plain", "[vllm_bench] plain: 12.0 tok/s"]
    assert "INFO engine noise" in log.read_text() and "[vllm_bench] mode plain" in log.read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        vllm_bench.run_logged([sys.executable, "-c", "import time; time.sleep(30)"], log, "[vllm_bench]", timeout=1)
