"""The vLLM extraction backend (extract.backend: vllm) on the real SmolLM2 target in fp32: the cache
equals the HF backend's (same reader, same tokens, states within fp32 tolerance, the target head's
argmax agrees), kill -9 then rerun gives the same bytes, and bad input gets a clear CacheError.

One vLLM extraction is shared by the module (an engine start costs ~30-90 s on the 2-core CPU)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_extract import make_dataset

from eagle3lib.cache import CacheError, HiddenCache
from eagle3lib.engine import build_kwargs, engine_kwargs
from eagle3lib.extract import extract_hidden_states
from eagle3lib.extract_vllm import vllm_support_error
from eagle3lib.params import ParamsError, load_params
from eagle3lib.target import load_target_tensors
from eagle3lib.vllm_states import FinalNorm, check_states, find_final_norm

pytestmark = pytest.mark.vllm

LENGTHS = [37, 120, 5, 64, 64, 99, 1, 110, 17, 80, 0, 45]     # one empty row; shards of <= 300 tokens


def make_params(target_dir, out_dir, backend):
    over = {"target": {"path": str(target_dir), "dtype": "float32"}, "output_dir": str(out_dir),
            "extract": {"backend": backend, "dtype": "float32", "batch_tokens": 256, "shard_tokens": 300}}
    return load_params("params/ci.yaml", overrides=over)


def shard_bytes(out_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out_dir.glob("shard-*.safetensors"))}


@pytest.fixture(scope="module")
def dataset():
    return make_dataset(LENGTHS)


@pytest.fixture(scope="module")
def runs(smollm2_dir, tmp_path_factory, dataset):
    """The same split extracted by both backends (fp32 target, fp32 cache)."""
    out = {}
    for backend in ("vllm", "hf"):
        params = make_params(smollm2_dir, tmp_path_factory.mktemp(backend), backend)
        summary = extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
        out[backend] = (params, summary, HiddenCache(params.layout().hidden("train")))
    return out


def test_vllm_cache_equals_hf_cache(runs):
    (_, sv, vc), (_, sh, hc) = runs["vllm"], runs["hf"]
    assert sv["complete"] and sv["num_shards"] == sh["num_shards"] >= 3
    assert sv["bytes_total"] == sh["bytes_total"]                   # same file sizes, same reader
    assert vc.aux_layers == hc.aux_layers and len(vc) == len(hc) == 11
    assert not list(Path(sv["path"]).glob(".vllm-staging-*"))
    assert not list(Path(sv["path"]).parent.glob(".vllm-staging-*"))
    worst = {"aux": 0.0, "final": 0.0}
    for i in range(len(hc)):
        v, h = vc.get(i), hc.get(i)
        assert torch.equal(v["input_ids"], h["input_ids"]) and torch.equal(v["loss_mask"], h["loss_mask"])
        for name in worst:
            rel = float((v[name] - h[name]).norm() / h[name].norm())
            worst[name] = max(worst[name], rel)
    # fp32 on both sides; SmolLM2's massive activations (|x| ~ 1e4) make absolute errors look large
    assert worst["aux"] < 1e-5 and worst["final"] < 1e-5, worst


def test_final_state_is_after_the_norm_and_argmax_agrees(runs, smollm2_dir):
    """The target head on vLLM's cached final state picks the HF final state's token on >= 99 % of
    decisive tokens (top-1 leads top-2 by > 0.5)."""
    head = load_target_tensors(smollm2_dir)["lm_head"].float()                  # [V, H]
    vc, hc = runs["vllm"][2], runs["hf"][2]
    agree = decisive = 0
    for i in range(len(hc)):
        ref = hc.get(i)["final"].float() @ head.T                               # [T, V]
        top2 = ref.topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > 0.5
        got = (vc.get(i)["final"].float() @ head.T).argmax(-1)
        decisive += int(clear.sum())
        agree += int(((got == top2.indices[:, 0]) & clear).sum())
    assert decisive > 100 and agree / decisive >= 0.99, (agree, decisive)


WORKER = textwrap.dedent("""
    import sys
    from datasets import load_from_disk
    from eagle3lib.extract import extract_hidden_states
    from eagle3lib.params import load_params
    params = load_params("params/ci.yaml", overrides=__import__("json").loads(sys.argv[1]))
    extract_hidden_states(params, params.run_dir(), "train", dataset=load_from_disk(sys.argv[2]), progress=False)
""")


@pytest.mark.slow
def test_sigkill_then_rerun_gives_identical_bytes(runs, smollm2_dir, tmp_path, dataset):
    params = make_params(smollm2_dir, tmp_path / "out", "vllm")
    over = {"target": {"path": str(smollm2_dir), "dtype": "float32"}, "output_dir": str(tmp_path / "out"),
            "extract": {"backend": "vllm", "dtype": "float32", "batch_tokens": 256, "shard_tokens": 300}}
    dataset.save_to_disk(str(tmp_path / "ds"))
    out = params.layout().hidden("train")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    # its own session, so that the kill takes the vLLM child and engine processes with it
    proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(over), str(tmp_path / "ds")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + 400
    while not (out / "shard-00000.safetensors").exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.time() < deadline, "the worker wrote no shard in 400 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = json.loads((out / "manifest.json").read_text())["shards"] if (out / "manifest.json").exists() else []
    assert len(done) < runs["vllm"][1]["num_shards"]                  # killed mid-run
    resumed = extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    assert resumed["complete"] and resumed["shards_skipped"] == len(done)
    assert_same_shards(out, Path(runs["vllm"][1]["path"]))


def assert_same_shards(resumed: Path, clean: Path) -> None:
    """The resumed cache equals the clean run's byte for byte, except the states of one-token rows:
    vLLM CPU gives a one-token prompt float-level different states from one engine start to the next
    (seen twice in CI, ~1e-6 relative, always that row; NOTES.md, Decisions: Extraction), so those
    tokens are compared within the backends' tolerance and everything else exactly."""
    a, b = shard_bytes(resumed), shard_bytes(clean)
    assert sorted(a) == sorted(b)
    for name in a:
        if a[name] == b[name]:
            continue
        x, y = load_file(str(resumed / name)), load_file(str(clean / name))
        lengths = (y["offsets"][1:] - y["offsets"][:-1]).tolist()
        one_token = [int(y["offsets"][i]) for i, n in enumerate(lengths) if n == 1]
        assert one_token, f"{name} differs and holds no one-token row"
        for key in y:
            if key in ("aux", "final"):
                keep = torch.ones(len(y[key]), dtype=torch.bool)
                keep[one_token] = False
                assert torch.equal(x[key][keep], y[key][keep]), (name, key)
                for t in one_token:
                    assert float((x[key][t] - y[key][t]).norm() / y[key][t].norm()) < 1e-5, (name, key, t)
            else:
                assert torch.equal(x[key], y[key]), (name, key)


# ---- bad input -------------------------------------------------------------------------------
def test_connector_output_missing_short_or_wrong_width_is_refused():
    row = [5, 6, 7, 8]
    good = {"hidden_states": torch.zeros(4, 4, 8), "token_ids": torch.tensor(row)}
    assert check_states(good, row, "f", 4, 8).shape == (4, 4, 8)
    with pytest.raises(CacheError, match=r"extract \(backend vllm\): f lacks hidden_states"):
        check_states({"token_ids": torch.tensor(row)}, row, "f", 4, 8)
    with pytest.raises(CacheError, match=r"shape \[3, 4, 8\], expected \[4, 4, 8\].*extract.backend: hf"):
        check_states({**good, "hidden_states": torch.zeros(3, 4, 8)}, row, "f", 4, 8)     # short
    with pytest.raises(CacheError, match=r"shape \[4, 4, 16\], expected \[4, 4, 8\]"):
        check_states({**good, "hidden_states": torch.zeros(4, 4, 16)}, row, "f", 4, 8)    # wrong width
    with pytest.raises(CacheError, match="other token ids"):
        check_states({**good, "token_ids": torch.tensor([5, 6, 7, 9])}, row, "f", 4, 8)


def test_old_vllm_is_refused():
    assert vllm_support_error("0.32.0", True) is None
    assert "vLLM 0.16.1 has no extract_hidden_states" in vllm_support_error("0.16.1", True)
    assert "extract.backend: hf" in vllm_support_error("0.40.0", False)


def test_unsupported_architecture_is_a_clear_error_and_writes_nothing(smollm2_dir, tmp_path, dataset):
    target = tmp_path / "foo-model"
    target.mkdir()
    for f in smollm2_dir.iterdir():
        if f.is_file():
            (target / f.name).symlink_to(f)
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    params = make_params(target, tmp_path / "out", "vllm")
    with pytest.raises(CacheError, match=r"extract \(backend vllm\).*\['FooForCausalLM'\] is not one vLLM can run"
                                          r".*extract.backend: hf"):
        extract_hidden_states(params, params.run_dir(), "train", dataset=dataset, progress=False)
    out = params.layout().hidden("train")
    assert not list(out.glob("shard-*")) and not (out / "manifest.json").exists()


def test_final_norm_matches_transformers(smollm2_dir):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    name, w = find_final_norm(smollm2_dir)
    assert name == "model.norm.weight" and w.shape == (576,)
    ref = LlamaRMSNorm(576, eps=1e-5)
    ref.weight.data.copy_(w.float())
    x = torch.randn(7, 576) * 30
    assert torch.allclose(FinalNorm(w.float(), 1e-5)(x), ref(x), atol=1e-6)


def test_engine_kwargs_from_params(ci_params):
    kw = engine_kwargs(ci_params, "regenerate", "/m", max_model_len=200)
    assert kw["tensor_parallel_size"] == 1 and kw["enforce_eager"] and "max_num_batched_tokens" not in kw
    assert engine_kwargs(ci_params, "eval", "/m", 200)["max_num_batched_tokens"] == 512
    params = load_params("params/b300.yaml")
    kw = engine_kwargs(params, "extract", "/k", 4097)
    assert kw["tensor_parallel_size"] == 8 and kw["enable_expert_parallel"] and kw["trust_remote_code"]
    with pytest.raises(ParamsError, match="data_parallel_size: 2: vLLM's offline engine"):
        build_kwargs("/m", "float32", 100, data_parallel_size=2)
    with pytest.raises(ParamsError, match="target.gpu_memory_utilization"):
        load_params("params/ci.yaml", overrides={"target": {"gpu_memory_utilization": 1.5}})
