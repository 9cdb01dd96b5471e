"""Preflight (eagle3lib/preflight.py): each check `eagle3 plan` prints and `eagle3 run` applies before 01
starts can fail, naming the item and the fix: the tokenizer under the installed transformers, the
lm_head as a plain float tensor (a tie only where config.json says so), /dev/shm against 04's
DataLoader, the disk's read rate against 04's."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3lib import preflight
from eagle3lib.batches import PREFETCH_FACTOR
from eagle3lib.checkpoint_keys import TargetHeadError
from eagle3lib.cli import main
from eagle3lib.layout import RunLayout
from eagle3lib.params import ParamsError, load_params
from eagle3lib.plan import capacity_plan, refuse_full_run
from eagle3lib.preflight import (
    disk_read_check,
    head_check,
    remote_import_problems,
    shm_check,
    shm_need_bytes,
    tokenizer_check,
)
from eagle3lib.stage_times import BOX_CACHE_READ_BYTES_PER_S, CACHE_READ_PART
from eagle3lib.target import load_target_tensors

GONE_IMPORT = "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode"


def with_target(folder: Path, trust_remote_code: bool = True):
    """The ci profile pointed at a checkpoint folder (only target.path and trust_remote_code matter here)."""
    ci = load_params("params/ci.yaml")
    return dataclasses.replace(ci, target=dataclasses.replace(ci.target, path=str(folder),
                                                              trust_remote_code=trust_remote_code))


def word_level_tokenizer(folder: Path) -> Path:
    """A loadable fast tokenizer built here (no download): tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "[UNK]"}))
    return folder


# ---- 1. tokenizer -------------------------------------------------------------------------------------
def test_remote_tokenizer_code_importing_a_name_gone_from_transformers_is_refused(tmp_path):
    """An older Kimi revision's tokenization_kimi.py imports bytes_to_unicode from GPT-2's tokenizer
    module, which transformers 5 no longer has: read statically and on loading, refused naming the file."""
    folder = tmp_path / "old-kimi"
    folder.mkdir()
    (folder / "tokenization_kimi.py").write_text(
        f"{GONE_IMPORT}\nfrom transformers import PreTrainedTokenizer\n\n\n"
        "class TikTokenTokenizer(PreTrainedTokenizer):\n    pass\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                                 None]}}))
    static = remote_import_problems(folder)
    assert len(static) == 1 and static[0].startswith("tokenization_kimi.py line 1:") and "bytes_to_unicode" in static[0]
    check = tokenizer_check(with_target(folder))
    assert check.verdict == "refuse", check
    assert "tokenization_kimi.py" in check.text and "bytes_to_unicode" in check.text
    assert "transformers.convert_slow_tokenizer" in check.text          # the exact import fix
    assert check.basis.startswith("measured here (")


def test_a_loadable_tokenizer_passes_and_stray_remote_code_is_a_warning(tmp_path):
    folder = word_level_tokenizer(tmp_path / "good")
    assert tokenizer_check(with_target(folder, trust_remote_code=False)).verdict == "ok"
    (folder / "modeling_old.py").write_text(f"import torch\n{GONE_IMPORT}\n")
    (folder / "media_utils.py").write_text("import no_such_package_here\ntry:\n    import also_missing\n"
                                           "except ImportError:\n    pass\n")
    check = tokenizer_check(with_target(folder, trust_remote_code=False))
    assert check.verdict == "warn" and "modeling_old.py line 2" in check.text, check
    assert "package no_such_package_here is not installed" in check.text and "also_missing" not in check.text


def test_a_target_not_on_this_machine_is_not_checked():
    p = load_params("params/b300.yaml")
    if Path(p.target.path).exists():
        pytest.skip(f"{p.target.path} is on this machine")
    for check in (tokenizer_check(p), head_check(p)):
        assert check.verdict == "not checked" and check.text == f"{p.target.path} not found on this machine"


# ---- 2. lm_head ---------------------------------------------------------------------------------------
def checkpoint(folder: Path, tensors: dict, config: dict) -> Path:
    """A tiny safetensors checkpoint written here: model.safetensors and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


EMBED = torch.randn(16, 8, dtype=torch.bfloat16)


@pytest.mark.parametrize("prefix,config", [
    ("model.", {"tie_word_embeddings": True}),                                      # SmolLM2-style
    ("language_model.model.", {"text_config": {"tie_word_embeddings": True}}),      # a multimodal wrapper
])
def test_a_tied_checkpoint_reads_the_embedding_as_its_head(tmp_path, prefix, config):
    folder = checkpoint(tmp_path / "tied", {f"{prefix}embed_tokens.weight": EMBED,
                                            f"{prefix}norm.weight": torch.ones(8)}, config)
    w = load_target_tensors(folder)
    assert torch.equal(w["lm_head"], EMBED) and torch.equal(w["embed"], EMBED)
    check = head_check(with_target(folder))
    assert check.verdict == "ok" and "ties" in check.text


@pytest.mark.parametrize("config", [{}, {"tie_word_embeddings": False},
                                    {"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}])
def test_an_untied_checkpoint_without_a_head_is_refused_naming_its_keys(tmp_path, config):
    """Another prefix for the head (or none at all) was silently read as the embedding: refused now,
    naming what it saw; an MTP module's head is not the target's."""
    folder = checkpoint(tmp_path / "untied", {"model.embed_tokens.weight": EMBED,
                                              "model.head_proj.weight": EMBED.clone(),
                                              "model.mtp.lm_head.weight": EMBED.clone()}, config)
    with pytest.raises(TargetHeadError, match=r"no lm_head tensor .*tie_word_embeddings .*model.head_proj.weight"):
        load_target_tensors(folder, ("lm_head",))
    assert load_target_tensors(folder, ("embed",))["embed"].shape == (16, 8)   # the embedding alone still reads
    check = head_check(with_target(folder))
    assert check.verdict == "refuse" and str(folder) in check.text and "Fix:" in check.text


@pytest.mark.parametrize("tied", [False, True])
def test_a_quantized_head_is_refused_naming_the_key(tmp_path, tied):
    """A pack-quantized head (compressed-tensors' weight_packed + weight_scale) is never replaced by the
    embedding, even where config.json ties them."""
    folder = checkpoint(tmp_path / "int4-head", {
        "language_model.model.embed_tokens.weight": EMBED,
        "language_model.lm_head.weight_packed": torch.zeros(16, 1, dtype=torch.int32),
        "language_model.lm_head.weight_scale": torch.ones(16, 1, dtype=torch.bfloat16)},
        {"text_config": {"tie_word_embeddings": tied}})
    with pytest.raises(TargetHeadError, match=r"language_model\.lm_head\.weight_packed"):
        load_target_tensors(folder)
    check = head_check(with_target(folder))
    assert check.verdict == "refuse" and "language_model.lm_head.weight_packed" in check.text


def test_an_integer_head_is_refused_naming_its_dtype(tmp_path):
    folder = checkpoint(tmp_path / "int8-head", {"model.embed_tokens.weight": EMBED,
                                                 "lm_head.weight": torch.zeros(16, 8, dtype=torch.int8)}, {})
    with pytest.raises(TargetHeadError, match=r"lm_head\.weight: dtype I8"):
        load_target_tensors(folder)


# ---- 3. /dev/shm ---------------------------------------------------------------------------------------
def workers_profile(tmp_path, workers: int = 2):
    return load_params("params/ci.yaml", {"output_dir": str(tmp_path / "out"), "train": {"num_workers": workers}})


def test_shm_need_over_the_free_size_is_refused_with_the_fixes(tmp_path):
    p = workers_profile(tmp_path)
    need = shm_need_bytes(p, 576)
    assert need == 1 * 2 * PREFETCH_FACTOR * p.train.batch_tokens * (4 * 576 * 2 + 9)
    refused = shm_check(p, 576, free=need / 2)
    assert refused.verdict == "refuse" and "--shm-size" in refused.text and "train.num_workers (2 now" in refused.text
    assert refused.basis.startswith("measured here (")
    assert shm_check(p, 576, free=need * 4).verdict == "ok"
    assert shm_check(workers_profile(tmp_path, 0), 576, free=0).verdict == "ok"     # no workers: no shared memory


def test_b300_needs_about_120_gb_of_shm():
    assert shm_need_bytes(load_params("params/b300.yaml"), 7168) == pytest.approx(120.3e9, rel=0.01)


def test_a_shm_refusal_stops_eagle3_run_before_any_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda path=preflight.SHM: 1e6)
    p = workers_profile(tmp_path)
    layout = RunLayout(tmp_path / "run")
    problems = capacity_plan(p, memory=False, layout=layout)["problems"]
    assert any(level == "refuse" and key == "preflight /dev/shm" for level, key, _ in problems), problems
    with pytest.raises(ParamsError, match=r"preflight /dev/shm: 04's DataLoader holds"):
        refuse_full_run(p, layout)


# ---- 4. disk read --------------------------------------------------------------------------------------
def test_the_disk_read_row_is_assumed_without_a_cache_and_measured_with_one(tmp_path, monkeypatch):
    p = load_params("params/ci.yaml", {"output_dir": str(tmp_path / "out")})
    layout = RunLayout(tmp_path / "run")
    plan = capacity_plan(p, memory=False, layout=layout)
    row = next(c for c in plan["preflight"] if c["name"] == "disk read")
    assert row["verdict"] == "ok" and row["basis"].startswith("assumed")
    assert "BOX_CACHE_READ_BYTES_PER_S" in row["basis"]
    shard = layout.hidden("train") / "shard-00000.safetensors"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"\0" * (3 * 2**20))
    monkeypatch.setattr(preflight, "READ_PROBE_MIN_BYTES", 2**20)
    plan = capacity_plan(p, memory=False, layout=layout)
    row = next(c for c in plan["preflight"] if c["name"] == "disk read")
    assert row["basis"].startswith("measured here (") and shard.name in row["basis"], row
    assert plan["cache_read_basis"] == row["basis"] and plan["cache_read_bytes_per_s"] > 0


def test_a_disk_slower_than_training_bounds_04_and_warns(tmp_path):
    """b300 trains ~140k tok/s x 57 KB per cached token, over the assumed 5 GB/s: 04 takes the read time."""
    plan = capacity_plan(load_params("params/b300.yaml"), memory=False, layout=RunLayout(tmp_path / "b300"))
    parts = plan["stages"]["train"]["parts"]
    compute = next(q for q in parts if q["name"].startswith("train "))
    read = next(q for q in parts if q["name"].startswith(CACHE_READ_PART))
    read_s = plan["train_tokens"] * plan["cache_bytes_per_token"] / BOX_CACHE_READ_BYTES_PER_S
    assert compute["seconds"] + read["seconds"] == pytest.approx(max(compute["seconds"], read_s))
    assert read["basis"].startswith("assumed")
    check = disk_read_check(load_params("params/b300.yaml"), plan)
    assert check.verdict == "warn" and "04 waits on the disk" in check.text


# ---- the plan prints them ------------------------------------------------------------------------------
def test_eagle3_plan_b300_prints_the_preflight_rows_with_their_bases(capsys):
    code = main(["plan", "--params", "params/b300.yaml"])
    out = capsys.readouterr().out
    assert code == (4 if "REFUSED" in out else 0)
    block = out[out.index("\npreflight "):]
    rows = {name: next(line for line in block.splitlines() if line.startswith(f"  {name} "))
            for name in ("tokenizer", "lm_head", "/dev/shm", "disk read")}
    for name, line in rows.items():
        assert line.rstrip().endswith("]") and any(v in line for v in ("ok:", "REFUSED:", "WARNING:", "not checked:"))
    assert "[measured here (" in rows["/dev/shm"] and "[assumed (5 GB/s" in rows["disk read"]
