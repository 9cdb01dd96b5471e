"""The acceptance explorer: every token's mark agrees with the reference decoder's counts, and the
page and the loss table are built from those marks."""
from __future__ import annotations

import json

import pytest

from eagle3lib import evaluate as ev
from eagle3lib import explorer as X
from eagle3lib.decode import DecodeStats, RoundStats, random_drafter
from eagle3lib.layout import RunLayout
from eagle3lib.target import load_target, load_tokenizer


def test_marks_follow_the_rounds_and_stop_where_a_round_was_cut():
    s = DecodeStats(k=3, num_new_tokens=9)
    s.rounds = [RoundStats(3, 2, 3, 0, 0), RoundStats(3, 0, 1, 0, 0), RoundStats(3, 3, 4, 0, 0)]
    assert s.token_marks() == [-1, 0, 1, -1, -1, 0, 1, 2, -1]
    cut = DecodeStats(k=3, num_new_tokens=3)
    cut.rounds = [RoundStats(3, 3, 2, 0, 0)]               # the token budget cut the round after 2
    assert cut.token_marks() == [-1, 0, 1]
    assert DecodeStats(k=0, num_new_tokens=4).token_marks() == [-1] * 4      # plain decoding


@pytest.fixture(scope="module")
def decoded(tiny_target_dir):
    target = load_target(tiny_target_dir, "float32")
    tok = load_tokenizer(tiny_target_dir)
    prompts = [{"id": f"p{i}", "category": "chat",
                "input_ids": tok.apply_chat_template([{"role": "user", "content": q}],
                                                     add_generation_prompt=True)["input_ids"]}
               for i, q in enumerate(["Repeat: red blue red blue red blue", "Count: one two three one two"])]
    methods = [ev.ngram_method(3, 1, 3), ev.eagle3_method(random_drafter(tiny_target_dir), 3)]
    per_prompt, outputs = ev.run_decoder_eval(target, prompts, methods, 24, progress=False)
    return per_prompt, outputs, prompts, tok


def test_marks_agree_with_the_decoders_accepted_counts_on_every_prompt(decoded):
    per_prompt, outputs, prompts, tok = decoded
    records = X.explorer_records(per_prompt, outputs, prompts, tok)
    assert len(records) == len(per_prompt) == 3 * len(prompts)        # plain, n-gram, EAGLE-3
    for rec, row in zip(records, per_prompt.itertuples()):
        assert len(rec["marks"]) == len(rec["tokens"]) == row.new_tokens
        # every accepted draft is marked once; only the last round, cut by the 24-token budget (no EOS
        # here), can have accepted drafts it did not emit
        if row.new_tokens < 24:
            assert rec["accepted"] == row.num_accepted
        else:
            assert 0 <= row.num_accepted - rec["accepted"] <= 3
        assert sum(1 for m in rec["marks"] if m == 0) <= row.num_drafts
        for j, count in enumerate(row.accepted_per_position):
            assert sum(1 for m in rec["marks"] if m == j) <= count
        if row.method == ev.PLAIN:
            assert set(rec["marks"]) == {-1}
    ngram = [r for r in records if r["method"].startswith("ngram")]
    assert sum(r["accepted"] for r in ngram) > 0                       # repetitive prompts: drafts accepted


def test_the_page_and_the_loss_table_come_from_the_marks(decoded, tmp_path):
    per_prompt, outputs, prompts, tok = decoded
    records = X.explorer_records(per_prompt, outputs, prompts, tok)
    eagle3, ngram = "eagle3_k3", ev.ngram_name(3, 1, 3)
    table = X.loss_table(records, eagle3, ngram)
    marks = [(m, inside) for r in records if r["method"] == ngram for m, inside in zip(r["marks"], r["in_prompt"])]
    inside = [m for m, i in marks if i]
    assert table.loc["token in the prompt", ngram] == pytest.approx(sum(m >= 0 for m in inside) / len(inside))
    assert "EAGLE-3" in X.loss_sentence(table)
    page = X.write_explorer(RunLayout(tmp_path), records, X.loss_sentence(table))
    text = page.read_text()
    assert text.count("<div class='prompt'>") == len(prompts)
    assert text.count("title='accepted draft") == sum(r["accepted"] for r in records)
    assert json.loads((page.parent / "explorer.json").read_text()) == json.loads(json.dumps(records))
