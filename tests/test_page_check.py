"""The run's index page in a real headless browser (Chromium): headline, images, links, screenshot."""
from __future__ import annotations

import struct

import pytest
from test_report import executed, fake_run

from eagle3lib import page_check
from eagle3lib.layout import RunLayout
from eagle3lib.page_check import BrowserMissing, check_page
from eagle3lib.report import NOTEBOOKS, write_index
from eagle3lib.runner import check_report_page


def whole_run(tmp_path):
    """A run folder as a finished run leaves it: metrics, history, every executed notebook (html and
    ipynb), the acceptance explorer and TensorBoard event files."""
    run = fake_run(tmp_path, "page", lr=1e-3, acc=0.2)
    for stem in NOTEBOOKS.values():
        if stem != "06_scaling":                      # the optional study: not run, not linked
            executed(run, stem)
    (run / "eval" / "explorer").mkdir(parents=True)
    (run / "eval" / "explorer" / "explorer.html").write_text("<html><body>explorer</body></html>")
    (run / "train" / "tensorboard").mkdir(parents=True)
    (run / "train" / "tensorboard" / "events.out.tfevents.0.host").write_bytes(b"\0" * 16)
    return run


def png_size(path) -> tuple:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_a_whole_index_page_shows_its_headline_every_image_and_link_and_leaves_a_screenshot(tmp_path):
    run = whole_run(tmp_path)
    layout = RunLayout(run)
    check = check_page(write_index(run), screenshot=layout.index_png)
    assert check.problems() == []
    assert check.headline.startswith("EAGLE-3 in vLLM at k = 3: acceptance length 1.150, 2.09x plain")
    assert len(check.images) == 3 and all(i["src"].startswith("data:image/png") for i in check.images)
    hrefs = [a["href"] for a in check.links]
    assert "05_eval.html" in hrefs and "02_data.ipynb" in hrefs                # executed notebooks
    assert "eval/explorer/explorer.html" in hrefs and "train/tensorboard/" in hrefs
    assert len(hrefs) == 2 * 6 + 2
    assert png_size(layout.index_png) == (1100, 1800)                          # the window, in the run folder
    assert not list(run.glob(".*partial*"))                                    # no temporary left behind


def test_the_check_names_a_broken_image_a_broken_link_and_a_missing_headline(tmp_path):
    run = whole_run(tmp_path)
    page = write_index(run)
    text = page.read_text()
    page.write_text(text.replace("<h2>Plots</h2>", '<h2>Plots</h2><img src="plots/missing.png">'))
    (run / "03_extract.html").unlink()               # the index was written while it existed
    check = check_page(page)
    assert check.broken_images() == ["plots/missing.png"]
    assert check.broken_links() == ["03_extract.html"]
    assert [p.split(": ", 1)[1] for p in check.problems()] == [
        "image does not load: plots/missing.png", "link does not resolve: 03_extract.html"]
    page.write_text("<!doctype html><html><head></head><body><h1>Run</h1></body></html>")
    assert check_page(page).problems() == [f"{page}: no headline under the title"]


def test_an_index_links_only_the_notebooks_that_ran(tmp_path):
    run = fake_run(tmp_path, "partial", lr=1e-3, acc=0.2, with_eval=False)     # 02 and 04 ran
    write_index(run)
    md = run / "index.md"
    rows = {line.split("|")[1].strip(): line for line in md.read_text().splitlines() if line.startswith("| ")}
    assert "[02_data](02_data.html) ([ipynb](02_data.ipynb))" in rows["data"]
    assert "| 05_eval (not run) |" in rows["eval"]
    assert check_page(run / "index.html").problems() == []


def test_the_runner_checks_the_page_and_says_how_to_get_a_browser_when_there_is_none(tmp_path, monkeypatch):
    run = whole_run(tmp_path)
    write_index(run)
    lines = []
    check = check_report_page(RunLayout(run), lines.append)
    assert check is not None and check.problems() == [] and (run / "index.png").is_file()
    assert lines[-1].startswith("[eagle3] page check (whole): 3 images, 14 links; screenshot ")
    monkeypatch.setattr(page_check, "find_browser", lambda: None)
    with pytest.raises(BrowserMissing, match="apt-get install -y chromium"):
        check_page(run / "index.html")
    assert check_report_page(RunLayout(run), lines.append) is None
    assert "not checked in a browser" in lines[-1] and "apt-get install -y chromium" in lines[-1]
