"""files.atomic_dir: a folder appears complete or not at all."""
import pytest

from eagle3lib.files import atomic_dir


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
