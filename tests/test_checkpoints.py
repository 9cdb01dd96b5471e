"""Training checkpoints: a direct save -> load round trip (model, optimizer state, RNG) and resume
after a SIGKILL at a random moment of the training loop and in the middle of a checkpoint write;
and 2 FSDP2 processes with sharded (torch.distributed.checkpoint) checkpoints killed and resumed.

The trainer runs on the tiny synthetic run of test_train.py (make_run, run_script and the
sharp_target_dir fixture come from there)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from test_train import make_run, run_script, sharp_target_dir  # noqa: F401  (a fixture)

from eagle3lib.checkpoints import SHARDED_META, latest_checkpoint, load_checkpoint, save_checkpoint
from eagle3lib.dist import Dist
from eagle3lib.model import Eagle3Config, Eagle3Drafter
from eagle3lib.params import load_params
from eagle3lib.train import torchrun_command, train

MAX_STEPS = 9          # checkpoint_every 2 (make_run): checkpoints at steps 2, 4, 6, 8, 9


# ---- direct round trip -------------------------------------------------------------------------
class TinyObjective(nn.Module):
    """The drafter under the name `drafter` (as in the trainer) with a soft-label TTT loss."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, aux: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.drafter.ttt_forward(aux, ids, 2)                       # 2 x [B, T, Dv]
        return sum(nn.functional.cross_entropy(lg.flatten(0, 1), labels.flatten()) for lg in logits)


def tiny_objective(seed: int) -> TinyObjective:
    cfg = Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=64, vocab_size=50, draft_vocab_size=20, target_hidden_size=16,
                       aux_layer_ids=[0, 1, 2])
    g = torch.Generator().manual_seed(123)                    # the same "target" for every model
    embed = torch.randn(50, 16, generator=g)
    d2t, t2d = torch.zeros(20, dtype=torch.long), torch.zeros(50, dtype=torch.bool)
    t2d[:20] = True
    torch.manual_seed(seed)
    return TinyObjective(Eagle3Drafter.from_target_weights(cfg, d2t, t2d, embed))


def optimizers_for(model: nn.Module) -> list:
    """The trainer's two-optimizer shape: Muon on the 2-D layer weights, AdamW on the rest."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if p.dim() == 2 and "midlayer." in n]
    rest = [p for n, p in named if not (p.dim() == 2 and "midlayer." in n)]
    return [torch.optim.Muon(muon, lr=0.02, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))]


def take_steps(model: TinyObjective, optimizers: list, n: int) -> None:
    g = torch.Generator().manual_seed(7)
    for step in range(n):
        aux, ids = torch.randn(2, 9, 3, 16, generator=g), torch.randint(50, (2, 9), generator=g)
        loss = model(aux, ids, torch.randint(20, (2, 9), generator=g))
        for o in optimizers:
            o.zero_grad()
            for group in o.param_groups:
                group["lr"] *= 0.5                         # a schedule: lr is part of the state
        loss.backward()
        for o in optimizers:
            o.step()


def as_lists(group: dict) -> dict:
    """A param group with tuples as lists: torch.distributed.checkpoint's set_optimizer_state_dict
    itself hands Muon's ns_coefficients tuple back as a list (torch 2.13); Muon unpacks either."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert [as_lists(g) for g in sa["param_groups"]] == [as_lists(g) for g in sb["param_groups"]]
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) > 0
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys(), i
        for key, value in sa["state"][i].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][i][key])), (i, key)


def test_checkpoint_round_trip_restores_model_optimizer_and_rng_exactly(tmp_path):
    """save_checkpoint -> load_checkpoint into fresh objects: every model tensor, every optimizer
    state tensor, the param_groups (lr, betas, ...) and the torch RNG state are equal.
    Planted faults shown caught: (a) load_checkpoint without torch.set_rng_state (RNG assertion),
    (b) save_checkpoint leaving out the optimizers' `step` state (AdamW's step differs),
    (c) load_checkpoint restoring param_groups with another lr (param_groups differ)."""
    model = tiny_objective(seed=0)
    optimizers = optimizers_for(model)
    take_steps(model, optimizers, 2)
    torch.manual_seed(99)
    torch.rand(5)                                             # an RNG state that is no seed's start
    rng = torch.get_rng_state()
    ckpt = save_checkpoint(tmp_path / "checkpoints", 2, model, optimizers, {"note": "x"}, Dist())
    assert ckpt == latest_checkpoint(tmp_path / "checkpoints")
    torch.rand(5)                                             # move on, so the load has to restore it

    fresh = tiny_objective(seed=1)
    fresh_optimizers = optimizers_for(fresh)
    assert not torch.equal(fresh.drafter.fc.weight, model.drafter.fc.weight)
    meta = load_checkpoint(ckpt, fresh, fresh_optimizers)
    assert meta["step"] == 2 and meta["note"] == "x"
    assert torch.equal(torch.get_rng_state(), rng)
    sa, sb = model.state_dict(), fresh.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    for a, b in zip(optimizers, fresh_optimizers):
        assert_same_optimizer_state(a, b)
    # and the restored pair trains on identically
    take_steps(model, optimizers, 1)
    take_steps(fresh, fresh_optimizers, 1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k


# ---- resume after SIGKILL -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, sharp_target_dir):    # noqa: F811  (the imported fixture)
    """The reference: an uninterrupted run's final weights and its mean seconds per step. It runs
    in a subprocess like the killed and resumed runs (one thread), so the weights compare exactly."""
    path = make_run(tmp_path_factory.mktemp("full"), sharp_target_dir, {"max_steps": MAX_STEPS, "resume": True})
    stamps = path.parent / "stamps.json"
    run_script(path, "import json, time\nstamps = []\n"
                     "def callback(r):\n"
                     "    stamps.append(time.perf_counter())\n"
                     f"    open({str(stamps)!r}, 'w').write(json.dumps(stamps))\n")
    t = json.loads(stamps.read_text())
    weights = load_file(str(load_params(path).run_dir() / "train" / "final" / "model.safetensors"))
    return weights, (t[-1] - t[0]) / (len(t) - 1)


def resume_and_compare(params_path, reference: dict) -> None:
    """Resume the killed run to the end: the same final weights, a complete history."""
    run_dir = load_params(params_path).run_dir()
    assert not (run_dir / "train" / "final").exists()
    run_script(params_path)
    resume_and_compare_files(run_dir, reference)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resume_after_sigkill_at_a_random_moment(tmp_path, sharp_target_dir, uninterrupted, seed):  # noqa: F811
    """The trainer kills itself (a timer thread, SIGKILL) a seeded random time after a seeded
    random step: anywhere in batching, forward, backward, eval or a checkpoint write. The
    callback of the last step waits for the timer, so the kill always lands before final/.
    Planted fault shown caught: load_checkpoint not restoring the optimizer state (no
    set_optimizer_state_dict): the resumed weights differ from the uninterrupted run's."""
    reference, step_s = uninterrupted
    rnd = random.Random(seed)
    kill_after_step, delay = rnd.randint(1, MAX_STEPS - 2), rnd.uniform(0.0, 2.0 * step_s)
    path = make_run(tmp_path, sharp_target_dir, {"max_steps": MAX_STEPS, "resume": True})
    kill = ("import threading, time\n"
            "def callback(r):\n"
            f"    if r['step'] == {kill_after_step}:\n"
            f"        threading.Timer({delay!r}, os.kill, (os.getpid(), signal.SIGKILL)).start()\n"
            f"    if r['step'] == {MAX_STEPS}:\n"
            "        time.sleep(120)        # the timer fires first: never reach final/\n")
    res = run_script(path, kill, check=False)
    assert res.returncode == -9, res.stderr[-2000:]
    resume_and_compare(path, reference)


def test_resume_after_sigkill_during_a_checkpoint_write(tmp_path, sharp_target_dir, uninterrupted):  # noqa: F811
    """The trainer is killed while the step-4 checkpoint is being written: its temp folder
    `.step-000004-*` holds a half-written file and step-000004 does not exist. latest_checkpoint
    picks step 2, the resumed run reaches the uninterrupted weights and removes the temp folder.
    Planted fault shown caught: save_checkpoint writing straight into step-XXXXXX (no atomic_dir):
    a half-written step-000004 is left where latest_checkpoint looks (the folder assertion)."""
    reference, _ = uninterrupted
    path = make_run(tmp_path, sharp_target_dir, {"max_steps": MAX_STEPS, "resume": True})
    kill = ("import eagle3lib.checkpoints\n"               # the name save_checkpoint calls
            "_save = eagle3lib.checkpoints.save_file\n"
            "def save_then_die(tensors, filename, metadata=None):\n"
            "    _save(tensors, filename, metadata=metadata)\n"
            "    if 'step-000004' in filename:\n"
            "        size = os.path.getsize(filename)\n"
            "        os.truncate(filename, size // 2)          # half written\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "eagle3lib.checkpoints.save_file = save_then_die\n")
    res = run_script(path, kill, check=False)
    assert res.returncode == -9, res.stderr[-2000:]
    ckpts = load_params(path).run_dir() / "train" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000002"]
    assert len(list(ckpts.glob(".step-000004-*"))) == 1, sorted(p.name for p in ckpts.iterdir())
    assert latest_checkpoint(ckpts).name == "step-000002"
    resume_and_compare(path, reference)


# ---- sharded checkpoints: 2 FSDP2 processes -------------------------------------------------------
def descendants(pid: int) -> list:
    """The process ids below `pid` (from /proc): torchrun starts its workers in their own sessions,
    so killing torchrun's process group would leave them running."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                                             # the process ended meanwhile
        parent[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out, frontier = out + kids, kids
    return out


def is_running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def kill_torchrun_after(params_path, checkpoint: str, delay: float) -> int:
    """Start 2-process training under torchrun and SIGKILL torchrun and every process below it
    `delay` seconds after checkpoints/<checkpoint> appears; returns torchrun's exit status."""
    ckpts = load_params(params_path).run_dir() / "train" / "checkpoints"
    cmd = torchrun_command(params_path, None, 2) + ["--no-progress"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (ckpts / checkpoint).is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"training ended before {checkpoint}: {proc.stderr.read()[-3000:]}"
    time.sleep(delay)
    workers = descendants(proc.pid)
    assert len(workers) >= 2, workers
    for pid in workers + [proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    for pid in workers:                                          # dead before the resume starts
        while is_running(pid):
            time.sleep(0.05)
    return proc.returncode


def test_two_process_fsdp_sharded_checkpoint_resume_after_kill_reaches_the_uninterrupted_weights(
        tmp_path, sharp_target_dir):  # noqa: F811
    """2 FSDP2 (gloo) processes write DCP checkpoints (each rank its shards, no gathered file); the
    whole torchrun process group is killed with SIGKILL a moment after step-000002 appears (a few
    steps later at most, possibly inside a checkpoint write), the run is resumed and must reach the uninterrupted
    2-process run's final weights bit for bit: both runs do the same fp32 gloo reductions in the
    same order, and the resumed one restores every rank's parameter and optimizer shards exactly.
    A resume with another world size is refused, naming the checkpoint.
    Planted fault shown caught: _load_sharded loading only the model shards (the optimizer state
    left fresh): fc.weight differs. (Killing only torchrun's process group does not stop its
    workers, which finished the run: the kill targets every process below torchrun.)"""
    overrides = {"max_steps": MAX_STEPS, "resume": True, "grad_accum": 1, "distributed": "fsdp", "nproc": 2}
    full = make_run(tmp_path / "full", sharp_target_dir, overrides)
    run_script(full, nproc=2)
    killed = make_run(tmp_path / "killed", sharp_target_dir, overrides)
    assert kill_torchrun_after(killed, "step-000002", random.Random(0).uniform(0.0, 0.3)) == -9
    run_dir = load_params(killed).run_dir()
    ckpt = latest_checkpoint(run_dir / "train" / "checkpoints")
    assert not (run_dir / "train" / "final").exists() and ckpt.name < f"step-{MAX_STEPS:06d}", ckpt
    assert (ckpt / SHARDED_META).is_file() and (ckpt / ".metadata").is_file()
    assert len(list(ckpt.glob("*.distcp"))) == 2 and len(list(ckpt.glob("rng-rank-*.safetensors"))) == 2
    assert not (ckpt / "checkpoint.safetensors").exists()                # nothing gathered
    assert json.loads((ckpt / SHARDED_META).read_text())["world_size"] == 2
    run_script(killed, nproc=2)                                          # resumes
    reference = load_file(str(load_params(full).run_dir() / "train" / "final" / "model.safetensors"))
    resume_and_compare_files(run_dir, reference)
    single = load_params(killed, overrides={"train": {"nproc": 1, "distributed": "none", "grad_accum": 2}})
    with pytest.raises(RuntimeError, match=r"step-000009 was written by 2 process\(es\), this run has 1"):
        train(single, run_dir, progress=False)


def resume_and_compare_files(run_dir, reference: dict) -> None:
    final = load_file(str(run_dir / "train" / "final" / "model.safetensors"))
    assert final.keys() == reference.keys()
    for k in reference:
        assert torch.equal(final[k], reference[k]), f"{k}: resumed weights differ from the uninterrupted run"
    hist = json.loads((run_dir / "train" / "history.json").read_text())
    assert [r["step"] for r in hist] == list(range(1, MAX_STEPS + 1))
    assert not list((run_dir / "train" / "checkpoints").glob(".step-*")), "a temp checkpoint folder was left"
