"""Where the drafter fails: every token of every evaluated prompt marked by how it was produced.

    records = explorer_records(per_prompt, outputs, setup.decoder_prompts, tokenizer)
    write_explorer(layout, records)          # <run>/eval/explorer/{explorer.json, explorer.html}
    loss_table(records, "eagle3_k3", "ngram_k3_n1-4")   # accepted share by token kind, both methods
    explorer_widget(records)                 # JupyterLab: pick the prompt and the method

A mark comes from eagle3lib's reference decoder (DecodeStats.token_marks): j >= 0 an accepted draft
token at draft position j, -1 the target's own token (first token, correction or bonus). The page
shows the methods side by side on the same prompt; plain decoding marks every token -1.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd

from .files import atomic_write_bytes
from .layout import RunLayout

PALETTE = ["#2e7d32", "#66bb6a", "#a5d6a7", "#c8e6c9", "#e8f5e9"]    # draft position 0, 1, 2, ...
TARGET_STYLE = "background:#ffe0b2"                                   # the target's own token


def explorer_records(per_prompt: pd.DataFrame, outputs: dict, prompts: list, tokenizer) -> list:
    """[{prompt_id, category, prompt_text, method, k, tokens [str], ids, marks, in_prompt [bool],
    acceptance_length, accepted}] for every (prompt, method) the reference decoder ran. per_prompt
    and outputs: evaluate.run_decoder_eval's; prompts: the decoded prompts, in the same order."""
    by_id = {p["id"]: (i, p) for i, p in enumerate(prompts)}
    out = []
    for row in per_prompt.itertuples():
        i, prompt = by_id[row.prompt_id]
        ids = list(outputs[row.method][i])
        marks = list(row.token_marks)
        if len(marks) != len(ids):
            raise ValueError(f"{row.method} on prompt {row.prompt_id}: {len(marks)} marks for {len(ids)} tokens")
        seen = set(prompt["input_ids"])
        out.append({"prompt_id": row.prompt_id, "category": row.category,
                    "prompt_text": tokenizer.decode(prompt["input_ids"]), "method": row.method, "k": int(row.k),
                    "tokens": [tokenizer.decode([t]) for t in ids], "ids": ids, "marks": marks,
                    "in_prompt": [t in seen for t in ids],
                    "acceptance_length": 1.0 + row.num_accepted / row.num_drafts if row.num_drafts else 1.0,
                    "accepted": sum(1 for m in marks if m >= 0)})
    return out


def loss_table(records: list, eagle3: str, ngram: str) -> pd.DataFrame:
    """Share of the generated tokens that were accepted drafts, per method, split by whether the
    token also occurs in the prompt (n-gram's home ground) and by draft position; the difference
    EAGLE-3 minus n-gram says where EAGLE-3 loses most."""
    rows = []
    for method in (eagle3, ngram):
        recs = [r for r in records if r["method"] == method]
        for kind, want in (("token in the prompt", True), ("token not in the prompt", False)):
            marks = [m for r in recs for m, inside in zip(r["marks"], r["in_prompt"]) if inside == want]
            rows.append({"method": method, "tokens": kind, "count": len(marks),
                         "accepted_share": sum(m >= 0 for m in marks) / len(marks) if marks else float("nan")})
    table = pd.DataFrame(rows).pivot(index="tokens", columns="method", values="accepted_share")
    table["eagle3 - ngram"] = table[eagle3] - table[ngram]
    return table


def loss_sentence(table: pd.DataFrame) -> str:
    worst = table["eagle3 - ngram"].idxmin()
    gap = table.loc[worst, "eagle3 - ngram"]
    if gap >= 0:
        return "EAGLE-3 accepts at least as large a share of tokens as n-gram in every token kind."
    return (f"EAGLE-3 loses most to n-gram on tokens {worst.removeprefix('token ')}: "
            f"{gap:+.1%} of those tokens accepted (EAGLE-3 minus n-gram).")


def _token_html(token: str, mark: int) -> str:
    style = TARGET_STYLE if mark < 0 else f"background:{PALETTE[min(mark, len(PALETTE) - 1)]}"
    title = "target" if mark < 0 else f"accepted draft, position {mark + 1}"
    text = html.escape(token).replace("\n", "&#8629;<br>")
    return f"<span style='{style}' title='{title}'>{text}</span>"


def record_html(record: dict) -> str:
    body = "".join(_token_html(t, m) for t, m in zip(record["tokens"], record["marks"]))
    return (f"<div class='method'><h4>{html.escape(record['method'])}: acceptance length "
            f"{record['acceptance_length']:.2f}, {record['accepted']} of {len(record['marks'])} tokens "
            f"drafted</h4><div class='text'>{body}</div></div>")


LEGEND = ("<p>" + "".join(f"<span style='background:{c}'>&nbsp;draft {i + 1}&nbsp;</span> "
                          for i, c in enumerate(PALETTE[:4]))
          + f"<span style='{TARGET_STYLE}'>&nbsp;target (first, correction or bonus token)&nbsp;</span></p>")
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}"
         ".prompt{border-top:1px solid #ccc;margin-top:1.5em}.row{display:flex;gap:1em}"
         ".method{flex:1;min-width:0}.text{font-family:monospace;white-space:pre-wrap;line-height:1.6}"
         "pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap}")


def explorer_html(records: list, summary: str = "") -> str:
    """A self-contained page: per prompt, its text and the methods side by side, every token marked."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>acceptance explorer</title>"
             f"<style>{STYLE}</style></head><body><h1>Acceptance explorer</h1>{LEGEND}"]
    if summary:
        parts.append(f"<p><b>{html.escape(summary)}</b></p>")
    for pid in dict.fromkeys(r["prompt_id"] for r in records):
        mine = [r for r in records if r["prompt_id"] == pid]
        parts.append(f"<div class='prompt'><h3>{html.escape(str(pid))} ({html.escape(mine[0]['category'])})</h3>"
                     f"<pre>{html.escape(mine[0]['prompt_text'][-1500:])}</pre><div class='row'>"
                     + "".join(record_html(r) for r in mine) + "</div></div>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_explorer(layout: RunLayout, records: list, summary: str = "") -> Path:
    """<run>/eval/explorer/explorer.json (the records) and explorer.html; returns the page's path."""
    folder = layout.eval_work("explorer")
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "explorer.json", json.dumps(records).encode())
    page = folder / "explorer.html"
    atomic_write_bytes(page, explorer_html(records, summary).encode())
    return page


def explorer_widget(records: list):
    """JupyterLab: a prompt and a method selector over the marked text (ipywidgets)."""
    import ipywidgets as widgets  # lazy: only in a notebook

    prompts = list(dict.fromkeys(r["prompt_id"] for r in records))
    methods = list(dict.fromkeys(r["method"] for r in records))
    pick_prompt = widgets.Dropdown(options=prompts, description="prompt")
    pick_method = widgets.SelectMultiple(options=methods, value=tuple(methods), description="methods")
    view = widgets.HTML()

    def show(*_):
        mine = [r for r in records if r["prompt_id"] == pick_prompt.value and r["method"] in pick_method.value]
        view.value = LEGEND + "<div style='display:flex;gap:1em'>" + "".join(record_html(r) for r in mine) + "</div>"
    pick_prompt.observe(show, "value")
    pick_method.observe(show, "value")
    show()
    return widgets.VBox([widgets.HBox([pick_prompt, pick_method]), view])
