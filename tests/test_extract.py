"""Hidden-state extraction: layer convention, padding, file format, resume after SIGKILL,
torchrun sharding, bad input. All on the tiny fp32 target (6 layers, H=64)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from eagle3lib import cache as hc
from eagle3lib import extract as ex
from eagle3lib.cache import CacheError, HiddenCache, cache_params_hash, check_cache
from eagle3lib.extract import HiddenStateCapture, extract_hidden_states
from eagle3lib.params import ParamsError, load_params
from eagle3lib.target import load_target

AUX = [1, 3, 5]


def make_params(target_dir, out_dir, **extract):
    over = {"target": {"path": str(target_dir), "dtype": "float32"}, "output_dir": str(out_dir),
            "extract": {"aux_layers": AUX, "batch_tokens": 256, "shard_tokens": 300, **extract}}
    return load_params("params/ci.yaml", overrides=over)


def make_dataset(lengths, seed=0, vocab=49152):
    from datasets import Dataset
    rng = random.Random(seed)
    return Dataset.from_dict({
        "conv_id": [f"c{i}" for i in range(len(lengths))],
        "input_ids": [[rng.randrange(vocab) for _ in range(n)] for n in lengths],
        "loss_mask": [[rng.randint(0, 1) for _ in range(n)] for n in lengths]})


LENGTHS = [37, 120, 5, 64, 64, 99, 1, 128, 17, 80, 0, 45, 110, 9, 72]   # one empty row


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    return load_target(tiny_target_dir, "float32")


@pytest.fixture(scope="module")
def dataset():
    return make_dataset(LENGTHS)


def shard_bytes(out_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out_dir.glob("shard-*.safetensors"))}


@pytest.fixture(scope="module")
def clean_run(tiny_target_dir, tmp_path_factory, dataset):
    """An uninterrupted single-process run (bf16 cache): the reference for byte comparisons."""
    out = tmp_path_factory.mktemp("clean")
    params = make_params(tiny_target_dir, out)
    summary = extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    return params, summary, shard_bytes(params.layout().hidden("train"))


# ---- plan ------------------------------------------------------------------------------------
def test_plan_is_deterministic_and_respects_budgets():
    rng = random.Random(1)
    lengths = [rng.randint(0, 300) for _ in range(500)]
    plans = hc.plan_shards(lengths, shard_tokens=2000, batch_tokens=700)
    assert [p.seq_index for p in plans] == [p.seq_index for p in hc.plan_shards(lengths, 2000, 700)]
    rows = [i for p in plans for i in p.seq_index]
    assert sorted(rows) == [i for i, n in enumerate(lengths) if n > 0]       # each non-empty row once
    assert all(lengths[a] >= lengths[b] for a, b in zip(rows, rows[1:]))     # longest first
    for p in plans:
        assert p.num_tokens <= 2000 or len(p.seq_index) == 1
        assert [i for s, e in p.batches for i in range(s, e)] == list(range(len(p.seq_index)))
        for s, e in p.batches:
            assert (e - s) * p.lengths[s] <= 700 or e - s == 1
    # a sequence longer than the batch budget runs alone
    solo = hc.plan_shards([900, 10, 10], shard_tokens=10_000, batch_tokens=700)
    assert solo[0].batches == [(0, 1), (1, 3)]


# ---- capture: layer convention and padding ----------------------------------------------------
def test_capture_matches_unpadded_forward_and_layer_convention(tiny_model):
    """aux[:, j] == output_hidden_states[AUX[j]] and final == hidden_states[-1] (the lm_head input)
    of an unpadded single-sequence forward, for every sequence of a right-padded batch."""
    seqs = make_dataset([50, 13, 31], seed=3)["input_ids"]
    ids, mask = ex.pad_batch(seqs)
    cap = HiddenStateCapture(tiny_model, AUX)
    try:
        aux, final = cap(ids, mask, torch.float32)
    finally:
        cap.close()
    assert aux.shape == (sum(map(len, seqs)), 3, 64) and final.shape == (aux.shape[0], 64)
    start = 0
    for s in seqs:
        with torch.inference_mode():
            out = tiny_model(torch.tensor([s]), output_hidden_states=True)
        hs = out.hidden_states
        n = len(s)
        for j, k in enumerate(AUX):
            torch.testing.assert_close(aux[start:start + n, j], hs[k][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[start:start + n], hs[-1][0], rtol=1e-5, atol=1e-5)
        # the cached final state through the lm_head gives the model's logits
        torch.testing.assert_close(tiny_model.lm_head(final[start:start + n]), out.logits[0], rtol=1e-4, atol=1e-4)
        start += n
    # the hooks are removed by close(): a later forward is untouched and captures nothing
    assert not any(layer._forward_pre_hooks for layer in tiny_model.model.layers)


# ---- the stage end to end --------------------------------------------------------------------
def test_extract_roundtrip_fp32_matches_forward(tiny_target_dir, tiny_model, tmp_path, dataset):
    params = make_params(tiny_target_dir, tmp_path, dtype="float32")
    s = extract_hidden_states(params, params.run_dir(), "train", model=tiny_model, dataset=dataset, progress=False)
    nonempty = [i for i, n in enumerate(LENGTHS) if n > 0]
    assert s["complete"] and s["num_sequences"] == len(nonempty) and s["num_tokens"] == sum(LENGTHS)
    assert s["empty_rows_skipped"] == 1 and s["num_shards"] > 3

    cache = HiddenCache(params.layout().hidden("train"))
    assert len(cache) == len(nonempty) and cache.seq_index == nonempty
    assert cache.lengths == [LENGTHS[i] for i in nonempty]
    assert cache.hidden_size == 64 and cache.aux_layers == AUX and cache.verify()
    m = cache.manifest
    assert m.header.params_hash == cache_params_hash(params) and m.header.dtype == "float32"
    assert Path(m.header.target_path) == Path(tiny_target_dir)
    for i, row in enumerate(nonempty):
        item = cache.get(i)
        assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == dataset[row]["input_ids"]
        assert item["loss_mask"].tolist() == [bool(x) for x in dataset[row]["loss_mask"]]
        with torch.inference_mode():
            hs = tiny_model(torch.tensor([dataset[row]["input_ids"]]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(item["aux"], torch.stack([hs[k][0] for k in AUX], dim=1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["final"], hs[-1][0], rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError):
        cache.get(len(cache))
    # picklable for DataLoader workers: handles are dropped and reopened
    import pickle
    clone = pickle.loads(pickle.dumps(cache))
    assert torch.equal(clone.get(2)["aux"], cache.get(2)["aux"])


def test_shard_file_is_plain_safetensors_with_exact_size(clean_run):
    from safetensors.torch import load_file
    params, summary, shards = clean_run
    out = params.layout().hidden("train")
    H, total = 64, 0
    for rec in json.loads((out / "manifest.json").read_text())["shards"]:
        t = load_file(str(out / rec["file"]))
        n, nseq = rec["num_tokens"], len(rec["seq_index"])
        assert t["aux"].dtype == torch.bfloat16 and t["aux"].shape == (n, 3, H) and t["final"].shape == (n, H)
        assert t["input_ids"].dtype == torch.int32 and t["loss_mask"].dtype == torch.uint8
        assert t["offsets"].tolist()[-1] == n and t["seq_index"].tolist() == rec["seq_index"]
        header = int.from_bytes(shards[rec["file"]][:8], "little") + 8
        # bf16: 2 bytes x (3H + H) per token, 4 + 1 for id and mask, 8 per offset / row index
        assert rec["bytes"] == len(shards[rec["file"]]) == header + n * (2 * 4 * H + 5) + 8 * (2 * nseq + 1)
        total += rec["bytes"]
    assert summary["bytes_total"] == total


def test_rerun_skips_finished_shards_unhashed_and_redoes_the_ones_verification_found_bad(
        clean_run, tiny_target_dir, tmp_path, dataset, monkeypatch):
    params = make_params(tiny_target_dir, tmp_path)
    dataset.save_to_disk(str(params.layout().data_split("train")))  # where the data stage puts it
    first = extract_hidden_states(params, params.run_dir(), "train", progress=False)
    verified = hc.read_verified(params.layout().hidden("train"))  # the stage ends with the verification
    assert len(verified["hashed"]) == first["num_shards"] and verified["bad"] == {}
    hashed = []
    real_sha = hc.file_sha256
    monkeypatch.setattr(hc, "file_sha256", lambda path: hashed.append(Path(path).name) or real_sha(path))
    again = extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    assert first["shards_written"] == first["num_shards"] and again["shards_written"] == 0
    assert hashed == []                               # a rerun (or 04's check) reads no shard again
    out = params.layout().hidden("train")
    victim = out / "shard-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="shard-00001.*sha256"):
        check_cache(params, params.layout(), "train")  # the verification finds it and records it
    fixed = extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    assert fixed["shards_written"] == 1
    assert shard_bytes(out) == clean_run[2]           # same bytes as the clean run
    assert check_cache(params, params.layout(), "train") and HiddenCache(out).verify()
    assert extract_hidden_states(params, params.run_dir(), "train", dataset=dataset,
                                 progress=False)["shards_written"] == 0


def test_changed_params_refuse_to_mix(tiny_target_dir, tmp_path, dataset):
    params = make_params(tiny_target_dir, tmp_path)
    extract_hidden_states(params, params.run_dir(), "train", dataset=dataset.select(range(4)), progress=False)
    params2 = make_params(tiny_target_dir, tmp_path, batch_tokens=512)
    with pytest.raises(CacheError, match=r"params_hash.*delete .* or use another run name"):
        extract_hidden_states(params2, params2.run_dir(), "train", dataset=dataset.select(range(4)), progress=False)
    with pytest.raises(CacheError, match="dataset_fingerprint"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=dataset.select(range(5)), progress=False)


def test_partial_cache_is_refused_by_reader(tiny_target_dir, tmp_path, dataset, monkeypatch):
    """A failed write (disk full in the middle) leaves no temp file and no half shard; the
    reader refuses the unfinished cache; a rerun finishes it."""
    params = make_params(tiny_target_dir, tmp_path)
    real = hc._preallocate
    calls = []

    def full_after_two(fd, size):
        calls.append(size)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        real(fd, size)
    monkeypatch.setattr(hc, "_preallocate", full_after_two)
    with pytest.raises(CacheError, match="No space left on device.*rerun"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    out = params.layout().hidden("train")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.safetensors",
                                                     "shard-00001.safetensors"]
    m = json.loads((out / "manifest.json").read_text())
    assert not m["complete"] and [r["index"] for r in m["shards"]] == [0, 1]
    with pytest.raises(CacheError, match="unfinished"):
        HiddenCache(out)
    assert len(HiddenCache(out, allow_partial=True)) == sum(len(r["seq_index"]) for r in m["shards"])
    monkeypatch.setattr(hc, "_preallocate", real)
    done = extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    assert done["complete"] and done["shards_skipped"] == 2


# ---- what the trainer checks before it reads a cache --------------------------------------------
def copy_cache(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_verify_names_each_bad_shard_and_the_fix(clean_run, tmp_path):
    out = copy_cache(clean_run[0].layout().hidden("train"), tmp_path / "copy")
    assert HiddenCache(out).verify() is True                               # intact: passes
    m = json.loads((out / "manifest.json").read_text())
    assert len(m["shards"]) >= 3
    victim = out / "shard-00002.safetensors"                               # flip bytes inside the aux states
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4] = bytes(b ^ 0x5A for b in data[middle:middle + 4])
    victim.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"1 bad shard\(s\): shard-00002\.safetensors: sha256 differs.*"
                                         r"rerun 03_extract: eagle3 run --params <profile> --only extract"):
        HiddenCache(out).verify()
    size = m["shards"][1]["bytes"]                                         # a size other than recorded
    m["shards"][1]["bytes"] = size + 10
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CacheError, match=rf"2 bad shard\(s\): shard-00001\.safetensors: size {size} bytes, "
                                         rf"the manifest says {size + 10}; shard-00002\.safetensors: sha256 differs"):
        HiddenCache(out).verify()
    short = out / "shard-00001.safetensors"                                # truncated: unreadable, named
    short.write_bytes(short.read_bytes()[:-10])
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors: unreadable shard .*--only extract"):
        HiddenCache(out)


def test_fingerprint_is_a_content_id_from_the_manifest(clean_run, tiny_target_dir, tmp_path, dataset):
    src = clean_run[0].layout().hidden("train")
    fp = HiddenCache(src).fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    copy = copy_cache(src, tmp_path / "copy")
    assert HiddenCache(copy).fingerprint == fp                             # same bytes elsewhere: same id
    m = json.loads((copy / "manifest.json").read_text())
    m["shards"][0]["sha256"] = "0" * 64                                    # other shard content: another id
    (copy / "manifest.json").write_text(json.dumps(m))
    assert HiddenCache(copy).fingerprint != fp
    params = make_params(tiny_target_dir, tmp_path / "other")              # other data: another id
    extract_hidden_states(params, params.layout(), "train", dataset=dataset.select(range(6)), progress=False)
    assert HiddenCache(params.layout().hidden("train")).fingerprint != fp


def test_check_cache_refuses_stale_params_and_corrupt_shards(tiny_target_dir, tmp_path, dataset):
    params = make_params(tiny_target_dir, tmp_path)
    layout = params.layout()
    extract_hidden_states(params, layout, "train", dataset=dataset, progress=False)
    cache = check_cache(params, layout, "train")                           # intact, same params: passes
    assert isinstance(cache, HiddenCache) and len(cache) == 14 and cache.seq_index[0] == 0
    # num_train changed (resume: false would train on the old cache): refused, naming folder and stage
    params2 = load_params("params/ci.yaml", overrides={**params.to_dict(), "data": {**params.to_dict()["data"],
                                                                               "num_train": params.data.num_train + 1}})
    assert params2.layout() == layout
    folder = str(layout.hidden("train"))
    with pytest.raises(CacheError, match=rf"{folder} was extracted with other params \(params_hash "
                                         rf"'{cache_params_hash(params)}'.*--only data,extract"):
        check_cache(params2, params2.layout(), "train")
    with pytest.raises(CacheError, match=r"no manifest\.json.*--only extract"):
        check_cache(params, layout, "eval")                                # never extracted
    victim = layout.hidden("train") / "shard-00000.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"shard-00000\.safetensors: sha256 differs.*--only extract"):
        check_cache(params, layout, "train")


def test_writer_refuses_states_of_the_wrong_shape(tmp_path):
    """A backend that hands over the wrong width, dtype or too many rows gets a clear error and
    leaves neither a shard nor a temp file."""
    plan = hc.plan_shards([4, 3], shard_tokens=100, batch_tokens=100)[0]
    header = hc.CacheHeader(format=hc.FORMAT, format_version=hc.FORMAT_VERSION, dtype="bfloat16",
                            aux_layers=[1, 2, 3], hidden_size=8)
    bad = {"width": (torch.zeros(4, 3, 9, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16)),
           "dtype": (torch.zeros(4, 3, 8), torch.zeros(4, 8)),
           "rows": (torch.zeros(8, 3, 8, dtype=torch.bfloat16), torch.zeros(8, 8, dtype=torch.bfloat16))}
    for name, (aux, final) in bad.items():
        with pytest.raises(CacheError, match=r"shard-00000\.safetensors: states for rows 0\.\.\d+ of 7.*expected "
                                             r"\(\d+, 3, 8\), \(\d+, 8\) in bfloat16"):
            with hc.CacheWriter(tmp_path, header, {}, 1, tmp_path / "manifest.json") as w:
                w.start_shard(plan, [[1, 2, 3, 4], [5, 6, 7]], [[0, 1, 1, 1], [0, 0, 1]])
                w.write_rows(aux, final)
        assert list(tmp_path.iterdir()) == [], name


def test_manifest_reader_refuses_foreign_or_malformed_files(clean_run, tmp_path):
    copy = copy_cache(clean_run[0].layout().hidden("train"), tmp_path / "copy")
    m = hc.read_manifest(copy / "manifest.json")
    assert m.complete and m.header.split == "train" and [r.index for r in m.shards] == list(range(m.num_shards))
    assert m.to_json() == json.loads((copy / "manifest.json").read_text())     # the reader loses nothing
    for broken, why in (('{"format": "something-else"}', "is not a eagle3lab-hidden-cache version 1 manifest"),
                        (json.dumps({**m.to_json(), "format_version": 2}), "is not a .* version 1 manifest"),
                        ("{not json", "unreadable manifest"),
                        (json.dumps({**m.to_json(), "surprise": 1}), r"malformed .*unknown field\(s\) \['surprise'\]")):
        (copy / "manifest.json").write_text(broken)
        with pytest.raises(CacheError, match=why + ".*--only extract"):
            HiddenCache(copy)


# ---- SIGKILL and restart ---------------------------------------------------------------------
WORKER = """
import sys, time, torch
from datasets import load_from_disk
from eagle3lib.params import load_params
from eagle3lib.extract import extract_hidden_states
params_path, data, slow = sys.argv[1], sys.argv[2], float(sys.argv[3])
params = load_params(params_path)
if slow:   # slow the forward down so that the kill lands in the middle of the run
    import transformers.models.llama.modeling_llama as llama
    forward = llama.LlamaModel.forward
    def slow_forward(self, *a, **k):
        time.sleep(slow)
        return forward(self, *a, **k)
    llama.LlamaModel.forward = slow_forward
print(extract_hidden_states(params, params.run_dir(), "train", dataset=load_from_disk(data), progress=False))
"""


def write_profile(tmp_path, tiny_target_dir, out_dir, name="p.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""\
        inherit: {Path("params/ci.yaml").resolve()}
        output_dir: {out_dir}
        target: {{path: {tiny_target_dir}, dtype: float32}}
        extract: {{aux_layers: {AUX}, batch_tokens: 256, shard_tokens: 300}}
        """))
    return path


def test_sigkill_then_restart_gives_identical_bytes(clean_run, tiny_target_dir, tmp_path, dataset):
    out_root = tmp_path / "out"
    profile = write_profile(tmp_path, tiny_target_dir, out_root)
    params = load_params(profile)
    assert cache_params_hash(params) == cache_params_hash(clean_run[0])
    dataset.save_to_disk(str(tmp_path / "ds"))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = params.layout().hidden("train")
    proc = subprocess.Popen([sys.executable, str(script), str(profile), str(tmp_path / "ds"), "0.4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (out / "shard-00000.safetensors").exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.time() < deadline, "the worker wrote no shard in 120 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = json.loads((out / "manifest.json").read_text())["shards"] if (out / "manifest.json").exists() else []
    assert len(done_before) < clean_run[1]["num_shards"]           # killed mid-run
    resumed = extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    assert resumed["complete"] and resumed["shards_skipped"] == len(done_before)
    assert not list(out.glob(".*tmp"))
    assert shard_bytes(out) == clean_run[2]
    clean_manifest = json.loads((clean_run[0].layout().hidden("train") / "manifest.json").read_text())
    assert json.loads((out / "manifest.json").read_text())["shards"] == clean_manifest["shards"]


# ---- torchrun: two ranks on CPU --------------------------------------------------------------
def test_torchrun_two_ranks_equal_single_process(clean_run, tiny_target_dir, tmp_path, dataset):
    out_root = tmp_path / "out"
    profile = write_profile(tmp_path, tiny_target_dir, out_root)
    dataset.save_to_disk(str(tmp_path / "ds"))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), str(profile), str(tmp_path / "ds"), "0"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "'world_size': 2" in r.stdout and "'rank': 1" in r.stdout
    import re
    per_rank = [int(n) for n in re.findall(r"'shards_written': (\d+)", r.stdout)]
    assert len(per_rank) == 2 and min(per_rank) > 0 and sum(per_rank) == clean_run[1]["num_shards"]
    out = load_params(profile).layout().hidden("train")
    assert not list(out.glob("manifest.part-*"))                  # merged by rank 0
    assert shard_bytes(out) == clean_run[2]
    merged = json.loads((out / "manifest.json").read_text())
    clean_manifest = json.loads((clean_run[0].layout().hidden("train") / "manifest.json").read_text())
    assert merged["complete"] and merged["shards"] == clean_manifest["shards"]
    assert HiddenCache(out).verify()


# ---- bad input ---------------------------------------------------------------------------------
def test_target_that_is_not_a_causal_lm(tiny_target_dir, tmp_path, dataset):
    from transformers import T5Config
    t5 = tmp_path / "t5"
    T5Config(vocab_size=100, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2).save_pretrained(t5)
    params = make_params(tiny_target_dir, tmp_path)
    params.target.path = str(t5)
    with pytest.raises(CacheError, match="T5Config.*not a causal language model"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    empty = tmp_path / "no_config"
    empty.mkdir()
    params.target.path = str(empty)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    assert not list((tmp_path / "ci" / "hidden" / "train").glob("shard-*"))


def test_aux_layers_out_of_range(tiny_target_dir, tiny_model, tmp_path, dataset):
    with pytest.raises(ParamsError, match="aux_layers.*out of range"):
        make_params(tiny_target_dir, tmp_path, aux_layers=[1, 3, 6])        # rejected by the params
    params = make_params(tiny_target_dir, tmp_path)
    params.extract.aux_layers = [1, 3, 99]                                   # bypassing validation
    with pytest.raises(ParamsError, match=r"out of range.*6 decoder layers \(valid ids 0..5"):
        extract_hidden_states(params, params.run_dir(), "train", model=tiny_model, dataset=dataset, progress=False)
    assert not list(params.layout().hidden("train").glob("shard-*"))


def test_cuda_requested_without_a_gpu(tiny_target_dir, tmp_path, dataset, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)        # also on a GPU machine
    params = make_params(tiny_target_dir, tmp_path, device="cuda")
    with pytest.raises(CacheError, match="extract.device: cuda requested but torch sees no GPU"):
        extract_hidden_states(params, params.layout(), "train", dataset=dataset, progress=False)
    assert not list(params.layout().hidden("train").glob("shard-*"))


def test_empty_and_malformed_datasets(tiny_target_dir, tmp_path):
    params = make_params(tiny_target_dir, tmp_path)
    for ds in (make_dataset([]), make_dataset([0, 0])):
        with pytest.raises(CacheError, match="has no tokens"):
            extract_hidden_states(params, params.run_dir(), "train", dataset=ds, progress=False)
    bad = make_dataset([4, 4]).map(lambda r, i: {"loss_mask": r["loss_mask"][:2] if i == 1 else r["loss_mask"]},
                                  with_indices=True)
    with pytest.raises(ValueError, match="row 1: 4 input_ids but 2 loss_mask"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=bad, progress=False)
    with pytest.raises(CacheError, match="token id 70000, beyond the target's vocabulary"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=make_dataset([3]).map(
            lambda r: {"input_ids": [1, 2, 70000]}), progress=False)
    assert not list((tmp_path / "ci" / "hidden").rglob("shard-*"))


def test_unwritable_or_full_output_dir(tiny_target_dir, tmp_path, dataset, monkeypatch):
    params = make_params(tiny_target_dir, tmp_path)
    blocker = tmp_path / "ci" / "hidden"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(CacheError, match="cannot write the hidden-state cache"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    with pytest.raises(CacheError, match="cannot write the hidden-state cache"):
        # a read-only file system
        extract_hidden_states(params, "/sys/eagle3lab-test-run", "train", dataset=dataset, progress=False)
    blocker.unlink()

    class Usage:
        free = 1000
    monkeypatch.setattr(ex.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(CacheError, match=r"not enough disk space.*GB are free"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    assert not list((tmp_path / "ci" / "hidden").rglob("shard-*"))


# ---- 03's fidelity check (extract.fidelity) ------------------------------------------------------
class ModelTop2:
    """Stands in for the vLLM backend's `top2`: the model's own top-2 next tokens per position;
    wrong=True names the wrong tokens (top-1 id + 1) with the right logprobs."""

    def __init__(self, model, wrong: bool = False):
        self.model, self.wrong, self.calls = model, wrong, 0

    def top2(self, rows):
        self.calls += 1
        out = []
        with torch.inference_mode():
            for row in rows:
                logp = self.model(torch.tensor([row])).logits[0].float().log_softmax(-1)      # [T, V]
                values, ids = logp.topk(2, dim=-1)                                        # [T, 2]
                if self.wrong:
                    ids = torch.stack([(ids[:, 0] + 1) % logp.shape[-1], ids[:, 1]], dim=-1)
                out.append((ids, values))
        return out

    def close(self):
        pass


@pytest.fixture(scope="module")
def confident_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with its final norm scaled x30: logits with decisive margins (the random
    tiny target's median top-1/top-2 margin is ~0.1 logits), the states unchanged up to the norm."""
    model = load_target(tiny_target_dir, "float32")
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    out = tmp_path_factory.mktemp("confident")
    model.save_pretrained(out, safe_serialization=True)
    return out


def test_fidelity_plan_follows_the_mode_and_the_target_size(tiny_target_dir, tmp_path, monkeypatch):
    params = make_params(tiny_target_dir, tmp_path)
    assert params.extract.fidelity == "auto" and ex.fidelity_plan(params) == ("hf", None)  # fits: as before
    monkeypatch.setattr(ex, "host_memory_bytes", lambda: 1000)                         # a target too big
    mode, reason = ex.fidelity_plan(params)
    assert mode is None and "exceed this machine's memory" in reason and "extract.backend: vllm" in reason
    params.extract.backend = "vllm"
    assert ex.fidelity_plan(params) == ("vllm", None)
    for explicit in ("hf", "vllm"):
        params.extract.fidelity = explicit
        assert ex.fidelity_plan(params) == (explicit, None)
    params.extract.fidelity = "never"
    assert ex.fidelity_plan(params)[0] is None and "'never'" in ex.fidelity_plan(params)[1]
    with pytest.raises(ParamsError, match="extract.fidelity"):
        make_params(tiny_target_dir, tmp_path, fidelity="sometimes")


def test_vllm_fidelity_reads_the_saved_reference_and_records_metrics(confident_target_dir, tmp_path, dataset,
                                                                    monkeypatch):
    """The cached final states through the head read by name agree with the engine's top-1 (here the
    model's own, fp32); a reference of other tokens fails the check and the numbers are recorded."""
    params = make_params(confident_target_dir, tmp_path, dtype="float32", fidelity="vllm")
    extract_hidden_states(params, params.layout(), "eval", dataset=dataset, progress=False)  # hf backend: no top2
    cache = HiddenCache(params.layout().hidden("eval"))
    model = load_target(confident_target_dir, "float32")
    rows = ex.fidelity_rows(dataset)
    assert [len(r) for r in rows] == [n for n in LENGTHS if n][:ex.FIDELITY_SEQUENCES]
    ex.save_top2_reference(cache.path, ModelTop2(model), rows)
    monkeypatch.setattr(ex, "open_vllm_backend", None)             # a saved reference: no engine start
    metrics = ex.check_fidelity(params, params.layout(), cache)
    assert metrics["fidelity"] == "vllm" and metrics["fidelity_skip_reason"] is None
    assert metrics["checked_tokens"] == sum(len(r) for r in rows) and metrics["decisive_tokens"] > 100
    assert metrics["argmax_agreement"] == 1.0 and metrics["decisive_argmax_agreement"] == 1.0
    assert metrics["top1_logprob_abs_error"] < 1e-4
    recorded = json.loads(params.layout().metrics.read_text())["extract"]
    assert recorded["decisive_argmax_agreement"] == 1.0 and recorded["fidelity"] == "vllm"

    ex.save_top2_reference(cache.path, ModelTop2(model, wrong=True), rows)
    with pytest.raises(CacheError, match="do not give the target's own next tokens"):
        ex.check_fidelity(params, params.layout(), cache)
    assert json.loads(params.layout().metrics.read_text())["extract"]["argmax_agreement"] == 0.0


def test_vllm_fidelity_without_a_matching_reference_asks_an_engine(confident_target_dir, tmp_path, dataset,
                                                                  monkeypatch):
    """A cache extracted earlier (no reference beside it, or one for other tokens) gets its
    reference from an engine started for it, once."""
    params = make_params(confident_target_dir, tmp_path, dtype="float32", fidelity="vllm")
    extract_hidden_states(params, params.layout(), "eval", dataset=dataset, progress=False)
    cache = HiddenCache(params.layout().hidden("eval"))
    model = load_target(confident_target_dir, "float32")
    ex.save_top2_reference(cache.path, ModelTop2(model), [[1, 2, 3]])                  # other tokens
    engine = ModelTop2(model)
    monkeypatch.setattr(ex, "open_vllm_backend", lambda params, path, dist: engine)
    assert ex.check_fidelity(params, params.layout(), cache)["decisive_argmax_agreement"] == 1.0
    assert engine.calls == 1
    ex.check_fidelity(params, params.layout(), cache)                                   # now saved
    assert engine.calls == 1


def test_fidelity_never_records_the_skip_and_loads_nothing(tiny_target_dir, tmp_path, dataset, monkeypatch):
    params = make_params(tiny_target_dir, tmp_path, fidelity="never")
    extract_hidden_states(params, params.layout(), "eval", dataset=dataset, progress=False)
    monkeypatch.setattr(ex, "load_reference", None)
    monkeypatch.setattr(ex, "load_target_tensors", None)
    metrics = ex.check_fidelity(params, params.layout(), HiddenCache(params.layout().hidden("eval")))
    assert metrics == {"fidelity": "skipped", "fidelity_skip_reason": ex.fidelity_plan(params)[1]}
    assert "'never'" in metrics["fidelity_skip_reason"]
    recorded = json.loads(params.layout().metrics.read_text())["extract"]
    assert {k: recorded[k] for k in metrics} == metrics                 # beside the stage's own keys
    assert recorded["eval_sequences"] == len(HiddenCache(params.layout().hidden("eval")))


def test_hf_fidelity_is_the_fresh_forward_as_before(confident_target_dir, tmp_path, dataset):
    params = make_params(confident_target_dir, tmp_path, dtype="float32", fidelity="hf")
    extract_hidden_states(params, params.layout(), "eval", dataset=dataset, progress=False)
    metrics = ex.check_fidelity(params, params.layout(), HiddenCache(params.layout().hidden("eval")))
    assert metrics["fidelity"] == "hf" and metrics["fidelity_reference"] == "a fresh transformers float32 forward"
    assert metrics["argmax_agreement"] == 1.0 and metrics["decisive_argmax_agreement"] == 1.0
    assert metrics["decisive_tokens"] > 100 and metrics["final_relative_error"] < 1e-5
