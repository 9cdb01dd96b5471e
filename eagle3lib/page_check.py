"""Open a run's index page in a real headless browser (Debian's `chromium`): does the headline show,
does every image load, does every link resolve; and save a screenshot beside the page.

    check = check_page(layout.index_html, screenshot=layout.index_png)
    check.problems()          # [] when the page is whole; otherwise one line per broken item

The page is loaded as a copy with a `<base>` pointing at the run folder and a small script appended
that reports, after the load event, each image's load state and whether each link's target opens
(file:// reads need `--allow-file-access-from-files`); the copy lives in a temporary folder.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "install it with `apt-get install -y chromium` (`make setup` does, when run as root)"
REPORT_ID = "eagle3-page-check"
WINDOW = "1100,1800"

# Runs after the load event: image states, each link fetched synchronously, the headline's text.
PROBE = """<script>
window.addEventListener('load', () => {
  const out = {headline: '', title: document.title, images: [], links: []};
  const first = document.querySelector('h1 ~ p');
  out.headline = first ? first.textContent : '';
  for (const im of document.images) {
    out.images.push({src: im.getAttribute('src').slice(0, 80), ok: im.complete && im.naturalWidth > 0});
  }
  for (const a of document.querySelectorAll('a[href]')) {
    const href = a.getAttribute('href');
    let ok = false, why = '';
    try { const r = new XMLHttpRequest(); r.open('GET', a.href, false); r.send(); ok = true; }
    catch (e) { why = String(e); }
    out.links.push({href: href, ok: ok, why: why});
  }
  const pre = document.createElement('pre');
  pre.id = '%s';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>""" % REPORT_ID


class BrowserMissing(RuntimeError):
    pass


@dataclass
class PageCheck:
    page: Path
    headline: str
    images: list = field(default_factory=list)     # [{src, ok}]
    links: list = field(default_factory=list)      # [{href, ok, why}]
    screenshot: Optional[Path] = None

    def broken_images(self) -> list:
        return [i["src"] for i in self.images if not i["ok"]]

    def broken_links(self) -> list:
        return [a["href"] for a in self.links if not a["ok"]]

    def problems(self) -> list:
        """One line per thing a reader would find broken; [] when the page is whole."""
        out = [] if self.headline.strip() else [f"{self.page}: no headline under the title"]
        out += [f"{self.page}: image does not load: {src}" for src in self.broken_images()]
        out += [f"{self.page}: link does not resolve: {href}" for href in self.broken_links()]
        return out

    def summary(self) -> str:
        state = "whole" if not self.problems() else f"{len(self.problems())} problem(s)"
        return (f"page check ({state}): {len(self.images)} images, {len(self.links)} links"
                + (f"; screenshot {self.screenshot}" if self.screenshot else ""))


def find_browser() -> Optional[str]:
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def _browser_command(browser: str, profile_dir: str) -> list:
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--no-first-run", "--allow-file-access-from-files", f"--user-data-dir={profile_dir}",
            f"--window-size={WINDOW}", "--virtual-time-budget=5000"]


def _probe_copy(page: Path, folder: Path) -> Path:
    """The page with <base> at the run folder and the probe script before </body>."""
    text = page.read_text(encoding="utf-8")
    base = f'<base href="{html.escape(page.parent.resolve().as_uri())}/">'
    text = re.sub(r"<head>", "<head>" + base, text, count=1) if "<head>" in text else base + text
    text = text.replace("</body>", PROBE + "</body>") if "</body>" in text else text + PROBE
    probe = folder / "probe.html"
    probe.write_text(text, encoding="utf-8")
    return probe


def _run(cmd: list, timeout: float) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"headless {cmd[0]} did not finish within {timeout:.0f} s") from e
    if done.returncode != 0:
        raise RuntimeError(f"headless {cmd[0]} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def _read_report(dom: str, page: Path) -> dict:
    found = re.search(rf'<pre id="{REPORT_ID}">(.*?)</pre>', dom, re.S)
    if not found:
        raise RuntimeError(f"the browser did not finish loading {page} (no page report in its DOM)")
    return json.loads(html.unescape(found.group(1)))


def check_page(page, screenshot=None, browser: Optional[str] = None, timeout: float = 60) -> PageCheck:
    """Load `page` (an html file) in headless Chromium; with `screenshot`, also save a PNG of it there
    (written under a temporary name, then renamed). BrowserMissing when no Chromium is installed."""
    page = Path(page)
    browser = browser or find_browser()
    if browser is None:
        raise BrowserMissing(f"no headless browser found ({', '.join(BROWSERS)}): {INSTALL_HINT}")
    if not page.is_file():
        raise FileNotFoundError(f"page to check not found: {page}")
    with tempfile.TemporaryDirectory(prefix="eagle3-page-") as tmp:
        cmd = _browser_command(browser, str(Path(tmp) / "profile"))
        report = _read_report(_run(cmd + ["--dump-dom", _probe_copy(page, Path(tmp)).as_uri()], timeout), page)
        shot = None
        if screenshot is not None:
            shot = Path(screenshot)
            partial = shot.with_name(f".{shot.name}.partial.png")
            _run(cmd + [f"--screenshot={partial}", page.resolve().as_uri()], timeout)
            if not partial.is_file() or partial.stat().st_size == 0:
                raise RuntimeError(f"headless {browser} wrote no screenshot of {page}")
            os.replace(partial, shot)
    return PageCheck(page=page, headline=report["headline"], images=report["images"], links=report["links"],
                     screenshot=shot)
