"""Verification of the hidden-state cache (cache.verify_cache through check_cache): once per cache
(a second call hashes nothing until a shard changes), full / sampled / sizes modes, the hashing
split across 2 gloo ranks, and the process-group timeout reaching init_process_group.

The caches here are written through cache.CacheWriter with random states (no target needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from eagle3lib import cache as hc
from eagle3lib.cache import CacheError, check_cache, read_verified, sample_shards
from eagle3lib.params import ParamsError, load_params

NUM_SHARDS = 8
HIDDEN = 16


def make_params(out_dir: Path, **train):
    return load_params("params/ci.yaml", overrides={"output_dir": str(out_dir), "train": train})


def write_cache(params, split: str = "train", num_shards: int = NUM_SHARDS) -> Path:
    """`num_shards` shards of 3 sequences of 4 tokens of random bf16 states, in the cache format, with
    the identity check_cache expects of `params`."""
    folder = params.layout().hidden(split)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = [4] * (3 * num_shards)
    plans = hc.plan_shards(lengths, shard_tokens=12, batch_tokens=64)
    assert len(plans) == num_shards
    header = hc.CacheHeader(format=hc.FORMAT, format_version=hc.FORMAT_VERSION, dtype="bfloat16",
                            aux_layers=[1, 2, 3], hidden_size=HIDDEN, split=split,
                            params_hash=hc.cache_params_hash(params))
    g = torch.Generator().manual_seed(0)
    with hc.CacheWriter(folder, header, {}, len(plans), folder / hc.MANIFEST) as w:
        for plan in plans:
            w.start_shard(plan, [[7] * n for n in plan.lengths], [[1] * n for n in plan.lengths])
            for s, e in plan.batches:
                n = sum(plan.lengths[s:e])
                w.write_rows(torch.randn(n, 3, HIDDEN, generator=g).bfloat16(),
                             torch.randn(n, HIDDEN, generator=g).bfloat16())
            w.finish_shard()
    return folder


def corrupt(path: Path):
    """Flip bytes in the middle of a shard (inside the states); the size stays."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def counted_sha(monkeypatch):
    """file_sha256 that records the name of every file it hashes."""
    hashed = []
    real = hc.file_sha256
    monkeypatch.setattr(hc, "file_sha256", lambda path: hashed.append(Path(path).name) or real(path))
    return hashed


def shard(folder: Path, i: int) -> Path:
    return folder / f"shard-{i:05d}.safetensors"


def test_the_cache_is_hashed_once_until_a_shard_changes(tmp_path, counted_sha):
    params = make_params(tmp_path)
    folder = write_cache(params)
    counted_sha.clear()
    check_cache(params, params.layout(), "train")
    assert sorted(counted_sha) == [shard(folder, i).name for i in range(NUM_SHARDS)]
    record = read_verified(folder)
    assert record["fingerprint"] == hc.HiddenCache(folder).fingerprint and record["bad"] == {}
    assert record["last"]["shards_hashed"] == NUM_SHARDS and record["last"]["bytes_hashed"] > 0
    counted_sha.clear()
    check_cache(params, params.layout(), "train")               # verified already: nothing is read again
    check_cache(params, params.layout(), "train", mode="sampled")
    assert counted_sha == []
    assert read_verified(folder)["last"]["shards_already_verified"] == len(sample_shards(NUM_SHARDS, 0.05, params.seed))
    victim = shard(folder, 3)
    victim.write_bytes(victim.read_bytes())                     # rewritten (same bytes): hashed again, alone
    check_cache(params, params.layout(), "train")
    assert counted_sha == [victim.name]
    (folder / hc.VERIFIED).write_text("{not json")              # an unreadable record: everything again
    counted_sha.clear()
    check_cache(params, params.layout(), "train")
    assert len(counted_sha) == NUM_SHARDS


def test_full_mode_catches_a_corrupt_shard_and_keeps_refusing_it(tmp_path, counted_sha):
    params = make_params(tmp_path)
    folder = write_cache(params)
    check_cache(params, params.layout(), "train")               # verified intact
    corrupt(shard(folder, 5))                                   # then changed: its stat changed too
    counted_sha.clear()
    with pytest.raises(CacheError, match=r"1 bad shard\(s\): shard-00005\.safetensors: sha256 differs.*"
                                         r"--only extract"):
        check_cache(params, params.layout(), "train")
    assert counted_sha == [shard(folder, 5).name]
    assert list(read_verified(folder)["bad"]) == [shard(folder, 5).name]
    assert hc.found_bad(folder) == {shard(folder, 5).name}      # what the extract stage redoes
    # a later check, even one that hashes nothing, still refuses the shard found bad
    with pytest.raises(CacheError, match=r"shard-00005\.safetensors: sha256 differs.*earlier verification"):
        check_cache(params, params.layout(), "train", mode="sizes")
    # sizes mode alone never reads a shard's bytes, but checks sizes and shapes
    clean = make_params(tmp_path / "b")
    folder_b = write_cache(clean)
    corrupt(shard(folder_b, 2))
    counted_sha.clear()
    check_cache(clean, clean.layout(), "train", mode="sizes")
    assert counted_sha == []
    manifest = json.loads((folder_b / hc.MANIFEST).read_text())
    manifest["shards"][6]["bytes"] += 10                        # a size other than the file's
    (folder_b / hc.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match=r"1 bad shard\(s\): shard-00006\.safetensors: size \d+ bytes, the "
                                         r"manifest says"):
        check_cache(clean, clean.layout(), "train", mode="sizes")
    assert counted_sha == []


def test_sampled_mode_hashes_a_seeded_share_and_catches_a_corrupt_shard_in_it(tmp_path, counted_sha):
    params = make_params(tmp_path, verify_cache="sampled", verify_sample=0.25)
    sample = sample_shards(NUM_SHARDS, 0.25, params.seed)
    assert len(sample) == 2 and sample == sample_shards(NUM_SHARDS, 0.25, params.seed)
    assert sample_shards(NUM_SHARDS, 1.0, params.seed) == list(range(NUM_SHARDS))
    outside = next(i for i in range(NUM_SHARDS) if i not in sample)

    folder = write_cache(params)
    corrupt(shard(folder, outside))                             # not in the sample: not seen
    counted_sha.clear()
    check_cache(params, params.layout(), "train")
    assert sorted(counted_sha) == [shard(folder, i).name for i in sample]
    with pytest.raises(CacheError, match=rf"shard-{outside:05d}\.safetensors: sha256 differs"):
        check_cache(params, params.layout(), "train", mode="full")  # the full check, asked for, sees it

    params2 = make_params(tmp_path / "b", verify_cache="sampled", verify_sample=0.25)
    folder = write_cache(params2)
    corrupt(shard(folder, sample[1]))                           # in the sample: caught
    with pytest.raises(CacheError, match=rf"1 bad shard\(s\): shard-{sample[1]:05d}\.safetensors: sha256"):
        check_cache(params2, params2.layout(), "train")


WORKER = """
import json, sys
from pathlib import Path
from eagle3lib import cache as hc
from eagle3lib.dist import Dist
from eagle3lib.params import load_params
params = load_params(sys.argv[1])
hashed = []
real = hc.file_sha256
hc.file_sha256 = lambda path: hashed.append(Path(path).name) or real(path)
dist = Dist(timeout_minutes=params.train.pg_timeout_minutes)
try:
    hc.check_cache(params, params.layout(), "train", dist)
    error = None
except hc.CacheError as e:
    error = str(e)
out = {"rank": dist.rank, "world": dist.world, "hashed": sorted(hashed), "error": error}
Path(sys.argv[2] + f".{dist.rank}.json").write_text(json.dumps(out))
dist.close()
"""


def verify_in_processes(tmp_path: Path, params_path: Path, nproc: int) -> list:
    """Run check_cache under torchrun with nproc gloo processes (nproc 1: a plain process); every
    rank's {rank, world, hashed files, error}."""
    script = tmp_path / "verify_worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"result-{nproc}"
    cmd = [sys.executable, str(script), str(params_path), str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + cmd[1:]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


def test_two_ranks_split_the_hashing_and_agree_with_one_process(tmp_path):
    results = {}
    for nproc in (1, 2):
        root = tmp_path / f"n{nproc}"
        root.mkdir()
        params_path = root / "params.yaml"
        params_path.write_text(f"inherit: {Path('params/ci.yaml').resolve()}\noutput_dir: {root}\n")
        params = load_params(params_path)
        folder = write_cache(params)
        corrupt(shard(folder, 4))
        results[nproc] = (verify_in_processes(root, params_path, nproc), read_verified(folder))
    (one,), one_record = results[1]
    two, two_record = results[2]
    names = [f"shard-{i:05d}.safetensors" for i in range(NUM_SHARDS)]
    assert one["hashed"] == names and one["world"] == 1
    assert [r["world"] for r in two] == [2, 2]
    assert two[0]["hashed"] == names[0::2] and two[1]["hashed"] == names[1::2]   # each rank its half
    assert one["error"] is not None and "shard-00004.safetensors: sha256 differs" in one["error"]
    # every rank raises the error of one process (the same bad shard, the same words but the folder)
    for r in two:
        assert r["error"].replace(str(tmp_path / "n2"), "") == one["error"].replace(str(tmp_path / "n1"), "")
    assert list(two_record["hashed"]) == list(one_record["hashed"]) == [n for n in names if n != names[4]]
    assert list(two_record["bad"]) == list(one_record["bad"]) == [names[4]]


def test_the_process_group_timeout_reaches_init_process_group(tmp_path, monkeypatch):
    """Training and extraction create their process group with train.pg_timeout_minutes."""
    import torch.distributed as td
    from datasets import Dataset

    from eagle3lib.extract import extract_hidden_states
    from eagle3lib.train import train

    class Created(Exception):
        pass

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        raise Created

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(td, "is_initialized", lambda: False)
    monkeypatch.setattr(td, "init_process_group", fake_init)
    params = make_params(tmp_path, pg_timeout_minutes=95)
    with pytest.raises(Created):
        train(params, params.run_dir(), progress=False)
    data = Dataset.from_dict({"conv_id": ["a"], "input_ids": [[1, 2, 3, 4]], "loss_mask": [[0, 1, 1, 1]]})
    with pytest.raises(Created):
        extract_hidden_states(params, params.layout(), "train", dataset=data, progress=False)
    assert [c["timeout"] for c in calls] == [timedelta(minutes=95)] * 2
    assert calls[1]["backend"] == "gloo"


@pytest.mark.parametrize("train, match", [
    ({"verify_cache": "some"}, "train.verify_cache: must be one of"),
    ({"verify_sample": 0}, r"train.verify_sample: must be in \(0, 1\]"),
    ({"verify_sample": 1.5}, r"train.verify_sample: must be in \(0, 1\]"),
    ({"pg_timeout_minutes": 0.5}, "train.pg_timeout_minutes: must be >= 1"),
])
def test_verification_and_timeout_params_are_validated(tmp_path, train, match):
    with pytest.raises(ParamsError, match=match):
        make_params(tmp_path, **train)
