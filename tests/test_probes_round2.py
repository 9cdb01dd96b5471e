"""The second round of reliability probes (NOTES.md, "Reliability: the probe list"): profiles a
careless or hostile user writes, refused at load time with the key or line named and the fix."""
import time
from pathlib import Path

import pytest

from eagle3lib.params import ParamsError, load_params

CI = Path(__file__).resolve().parents[1] / "params" / "ci.yaml"


def write_profile(tmp_path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(f"inherit: {CI}\n" + text)
    return path


@pytest.mark.parametrize("text, match", [
    ("data: {num_train: 5}\ntrain: {lr: 0.1}\ndata: {num_eval: 3}\n", r"^data: given twice .*lines 2 and 4"),
    ("train:\n  lr: 0.1\n  lr: 0.2\n", r"^lr: given twice .*lines 3 and 4"),
])
def test_a_key_given_twice_is_refused(tmp_path, text, match):
    with pytest.raises(ParamsError, match=match):
        load_params(write_profile(tmp_path, text))


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """Nine levels of nine aliases: 387 M list items once expanded (and formatted into a message)."""
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = write_profile(tmp_path, "\n".join(lines) + "\nscaling: {sizes: *l8}\n")
    t0 = time.monotonic()
    with pytest.raises(ParamsError, match=r"line 3: YAML aliases .*inherit"):
        load_params(path)
    assert time.monotonic() - t0 < 5.0, "the alias must be refused while parsing, before any expansion"


def test_a_long_list_is_not_formatted_into_the_message():
    sizes = list(range(100_000, 0, -1))                 # wrong order: refused
    with pytest.raises(ParamsError) as err:
        load_params(CI, {"scaling": {"sizes": sizes}})
    assert "a list of 100000 items" in str(err.value) and len(str(err.value)) < 400


@pytest.mark.parametrize("output_dir", [".", "..", "/", "params", "eagle3lib/x", ".git"])
def test_output_dir_may_not_be_the_checkout_or_its_folders(output_dir):
    with pytest.raises(ParamsError, match=r"^output_dir: .* use 'outputs'"):
        load_params(CI, {"output_dir": output_dir})


def test_output_dir_elsewhere_is_fine(tmp_path):
    assert load_params(CI, {"output_dir": str(tmp_path / "runs")}).outputs_root() == tmp_path / "runs"


@pytest.mark.parametrize("aux, match", [([5, 5, 5], "repeats a layer"), ([True, 15, 20], r"ints\), got \[True")])
def test_aux_layers_are_three_distinct_ints(aux, match):
    with pytest.raises(ParamsError, match=rf"^extract.aux_layers: .*{match}"):
        load_params(CI, {"extract": {"aux_layers": aux}})


@pytest.mark.parametrize("ngram_k", [[0], [17], [2, 100], [True]])
def test_ngram_k_is_bounded_like_k(ngram_k):
    with pytest.raises(ParamsError, match=r"^eval.ngram_k: .*1..16"):
        load_params(CI, {"eval": {"ngram_k": ngram_k}})


def test_a_relative_target_path_is_taken_from_the_profiles_folder(tmp_path, monkeypatch):
    """The CLI (any current folder) and the notebooks (kernels in notebooks/) read the same target."""
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 4096}')
    path = write_profile(tmp_path, "target: {path: models/tiny}\ndata: {draft_vocab_size: 512}\n")
    for cwd in (tmp_path, tmp_path / "models", Path(__file__).parent):
        monkeypatch.chdir(cwd)
        assert load_params(path).target.path == str(model)


# ---- a drafter is never paired with another target ------------------------------------------------
def _copy_target(src: Path, dst: Path, change_weights: bool) -> Path:
    """A copy of a checkpoint folder; with change_weights, the same shapes with other values
    (a fine-tune of the same architecture)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    if change_weights:
        for f in dst.glob("*.safetensors"):
            state = {k: v + 0.01 for k, v in load_file(str(f)).items()}
            save_file(state, str(f), metadata={"format": "pt"})
    return dst


def test_a_drafter_refuses_another_target_of_the_same_shape(tiny_target_dir, tmp_path):
    """Reproduction: same run, target.path changed to another checkpoint of the same shape, then
    `--only eval`: the export and the eval loaded the drafter against it and exit 0."""
    from test_export import make_drafter

    from eagle3lib.checkpoints import save_final
    from eagle3lib.export import export_vllm, load_drafter, load_export
    from eagle3lib.fingerprint import TargetMismatch, target_fingerprint

    model = make_drafter(tiny_target_dir, 300)
    final = tmp_path / "train" / "final"
    save_final(final, model.state_dict(), model.config, {"target": target_fingerprint(tiny_target_dir)})
    export = export_vllm(final, tmp_path / "export", tiny_target_dir)
    same = _copy_target(tiny_target_dir, tmp_path / "same", change_weights=False)
    load_export(export, same)                          # a byte-identical copy elsewhere is the same target
    other = _copy_target(tiny_target_dir, tmp_path / "other", change_weights=True)
    with pytest.raises(TargetMismatch, match=r"final was trained for another target .*weights differs"):
        load_drafter(final, other)
    with pytest.raises(TargetMismatch, match=r"export was trained for another target .*weights differs"):
        load_export(export, other)
    with pytest.raises(TargetMismatch):
        export_vllm(final, tmp_path / "export2", other)
    assert not (tmp_path / "export2").exists()


# ---- bad bytes and escapes in a source -------------------------------------------------------------
def _chat(i: int, user: str = "q") -> dict:
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"{user}{i}"},
                                       {"role": "assistant", "content": f"a{i}"}]}


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_lone_surrogate_escape_is_a_counted_malformed_record(tmp_path, suffix):
    """Reproduction: one record with "\\ud800" made the planner's source count die with a raw
    UnicodeEncodeError naming neither the file nor the record, before any stage."""
    import json

    from eagle3lib import chats as C
    from eagle3lib.plan import count_sources
    recs = [_chat(i) for i in range(3)]
    recs[1]["messages"][0]["content"] = "q\ud8001"
    text = json.dumps(recs) if suffix == ".json" else "\n".join(json.dumps(r) for r in recs) + "\n"
    assert "\\ud800" in text                                          # the escape, as a user's file has it
    src = tmp_path / f"chats{suffix}"
    src.write_text(text)
    chats, stats = C.load_chats(str(src))
    assert stats["malformed"] == {"invalid_json": 1} and [c["id"] for c in chats] == ["c0", "c2"]
    bad = [r for r in C.iter_raw_records(str(src)) if isinstance(r, C.MalformedRecord)]
    assert src.name in str(bad[0]) and "lone surrogate escape \\ud800" in str(bad[0])
    params = load_params(CI, {"data": {"source": str(src), "max_records": None, "num_eval": 1}})
    counts = count_sources(params, cache_dir=tmp_path / "counts")
    assert counts[0]["chats"] == 2 and counts[0]["malformed"] == {"invalid_json": 1}, counts


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_utf8_bom_before_the_records_is_read(tmp_path, suffix):
    import json

    from eagle3lib import chats as C
    recs = [_chat(i) for i in range(2)]
    text = json.dumps(recs) if suffix == ".json" else "\n".join(json.dumps(r) for r in recs) + "\n"
    src = tmp_path / f"bom{suffix}"
    src.write_bytes(b"\xef\xbb\xbf" + text.encode())
    chats, stats = C.load_chats(str(src))
    assert [c["id"] for c in chats] == ["c0", "c1"] and stats["malformed"] == {}


# ---- the runner and the data stage -----------------------------------------------------------------
def _ci_profile(tmp_path, extra: str = "") -> Path:
    return write_profile(tmp_path, f"output_dir: {tmp_path / 'out'}\nrun_name: probe\n{extra}")


@pytest.mark.parametrize("only", [",", " , ", ""])
def test_an_only_naming_no_stage_is_refused(tmp_path, only, capsys):
    """Reproduction: `--only ,` ran nothing and exited 0."""
    from eagle3lib.cli import main
    assert main(["run", "--params", str(_ci_profile(tmp_path)), "--only", only]) == 2
    assert "names no stage" in capsys.readouterr().err


@pytest.mark.parametrize("content", ['{"runner": {"params_path": "x"', "[1, 2]", '{"data": 3}'])
def test_a_corrupt_metrics_file_is_named_with_the_fix(tmp_path, content, capsys):
    """Reproduction: a truncated metrics.json (or a list) made `eagle3 run` and `eagle3 compare`
    die with a raw JSONDecodeError / AttributeError."""
    from eagle3lib.cli import main
    metrics = tmp_path / "out" / "probe" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(content)
    assert main(["run", "--params", str(_ci_profile(tmp_path)), "--only", "research", "--no-html"]) == 2
    err = capsys.readouterr().err
    assert str(metrics) in err and "mv " in err and "Traceback" not in err
    assert main(["compare", "probe", "--outputs", str(tmp_path / "out")]) == 2
    assert str(metrics) in capsys.readouterr().err
    assert metrics.read_text() == content                          # left as it was, for the user to look at


def test_ctrl_c_leaves_the_stage_time_the_index_and_a_marked_copy(tmp_path, monkeypatch, capsys):
    """Reproduction: Ctrl-C gave rc 130 with a raw KeyboardInterrupt traceback; the executed copy
    looked finished and neither the stage time nor the index page was written."""
    import nbformat
    import papermill

    from eagle3lib.cli import main

    def interrupted(src, dst, **kwargs):                   # the kernel got as far as the first cell
        nb = nbformat.read(src, as_version=4)
        nbformat.write(nb, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(papermill, "execute_notebook", interrupted)
    assert main(["run", "--params", str(_ci_profile(tmp_path)), "--only", "research", "--no-html"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C) in stage research" in err and "Traceback" not in err
    run = tmp_path / "out" / "probe"
    import json
    runner = json.loads((run / "metrics.json").read_text())["runner"]
    assert runner["interrupted"]["stage"] == "research" and "research" in runner["stage_seconds"]
    assert (run / "index.html").is_file()
    first = nbformat.read(run / "00_research.ipynb", as_version=4).cells[0]
    assert first.cell_type == "markdown" and "Interrupted" in first.source


def test_a_run_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch, capsys):
    """Reproduction: an immutable run folder (chattr +i) gave a raw PermissionError. Tests run as
    root here, where modes do not stop writes: the write itself is made to fail as chattr +i does."""
    from eagle3lib import runner
    from eagle3lib.cli import main

    def denied(path, data):
        raise PermissionError(13, "Operation not permitted", str(path))

    monkeypatch.setattr(runner, "atomic_write_bytes", denied)
    assert main(["run", "--params", str(_ci_profile(tmp_path)), "--only", "research", "--no-html"]) == 2
    err = capsys.readouterr().err
    assert "permission denied on" in err and "params.yaml" in err and "Traceback" not in err


def test_an_empty_dataset_is_refused_and_not_marked_done(tmp_path):
    """Reproduction: with every prompt longer than max_length, 02 wrote stats.json (its completion
    marker) with 0 train chats; 03 and 04 then died with IndexError from `datasets`."""
    from eagle3lib.data import EmptyDataset, prepare_data
    from eagle3lib.layout import RunLayout
    params = load_params(_ci_profile(tmp_path, "data: {max_length: 16}\n"))
    with pytest.raises(EmptyDataset, match=r"no train sequence left .*longer than data.max_length \(16\)"):
        prepare_data(params, params.run_dir(), progress=False)
    assert not RunLayout(params.run_dir()).stats.exists()


def test_num_train_over_what_the_sources_hold_is_said(tmp_path):
    """Reproduction: num_train: 1000 with 18 chats available trained on 18 without a word."""
    from eagle3lib.plan import refuse_full_run
    params = load_params(_ci_profile(tmp_path, "data: {num_train: 100000}\n"))
    said = []
    warnings = refuse_full_run(params, log=said.append)
    assert any(w.startswith("data.num_train: 100,000 asked, the sources hold") for w in warnings), warnings
    assert any("data.num_train" in s for s in said)


def test_a_20_mb_message_costs_little_and_truncation_is_unchanged(tmp_path):
    """Reproduction: one 20 MB message cost 5.4 GB of memory to skip (the whole text tokenised,
    its ids and offsets as Python lists). Cut to what max_length can hold, the first max_length
    tokens are those of the uncut chat."""
    import subprocess
    import sys
    code = f"""
import resource, sys
from eagle3lib.params import load_params
from eagle3lib.target import load_tokenizer, target_path
from eagle3lib.data import first_answer_fits, tokenize_chat
params = load_params({str(CI)!r})
tok = load_tokenizer(target_path(params), False)
long = ("lorem ipsum dolor sit amet, consectetur adipiscing elit " * 400_000)[:20_000_000]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
row = tokenize_chat(tok, [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": long}}], 128)
fits = first_answer_fits(tok, [{{"role": "user", "content": long}}, {{"role": "assistant", "content": "x"}}], 128)
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
print(row["truncated"], len(row["input_ids"]), fits, grew)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    truncated, n, fits, grew_mb = out.stdout.split()
    assert (truncated, n, fits) == ("True", "128", "False"), out.stderr[-2000:]
    assert int(grew_mb) < 500, f"tokenising a 20 MB message grew the process by {grew_mb} MB"

    from eagle3lib.data import tokenize_chat
    from eagle3lib.target import load_tokenizer, target_path
    tok = load_tokenizer(target_path(load_params(CI)), False)
    text = " ".join(f"word{i % 97}, and{i % 13}" for i in range(60_000))          # ~0.8 M characters
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]
    whole = tok.apply_chat_template(chat, tokenize=False)
    assert tokenize_chat(tok, chat, 256)["input_ids"] == tok(whole, add_special_tokens=False)["input_ids"][:256]
