"""b300's data.source: public corpora a user fetches onto the box beside the embedded ShareGPT, in
forms chats.py reads without a converter, with caps that give the planned chats."""
import re

import datasets
import pytest
import yaml

from eagle3lib.chats import load_chats
from eagle3lib.params import data_sources, load_params

# One row of each corpus as its dataset card describes it (columns and message roles).
ROWS = {
    "ultrachat_200k": {"prompt": "How do bees fly?", "prompt_id": "a1",
                       "messages": [{"role": "user", "content": "How do bees fly?"},
                                    {"role": "assistant", "content": "By flapping."},
                                    {"role": "user", "content": "How fast?"},
                                    {"role": "assistant", "content": "About 200 beats a second."}]},
    "smoltalk-self-oss-instruct": {"messages": [{"role": "user", "content": "Write a Python function that adds."},
                                                {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
                                   "source": "self-oss-instruct"},
    "apigen-synth-trl": {"messages": [{"role": "system", "content": "You are an expert in composing functions."},
                                      {"role": "user", "content": "You have access to the following tools: [...]"},
                                      {"role": "assistant", "content": '[{"name": "f", "arguments": {}}]'}]},
}


def test_the_public_corpora_are_read_as_saved_without_a_converter(tmp_path):
    folders = []
    for name, row in ROWS.items():
        rows = [{**row, "messages": [{**m, "content": f"{m['content']} #{i}"} for m in row["messages"]]}
                for i in range(5)]
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / name))
        folders.append(str(tmp_path / name))
    chats, stats = load_chats([{"path": f, "max_records": 4} for f in folders])
    assert [s["valid"] for s in stats["sources"]] == [4, 4, 4] and sum(stats["malformed"].values()) == 0
    assert {c["messages"][0]["role"] for c in chats} == {"user", "system"}


@pytest.mark.parametrize("name", ["b300", "rtx-pro-6000"])
def test_b300_names_each_public_corpus_with_the_command_that_fetches_it(name):
    """data.source is stated once, in rtx-pro-6000.yaml, which b300.yaml inherits: its comment holds the commands."""
    text = open("params/rtx-pro-6000.yaml").read()
    p = load_params(f"params/{name}.yaml")
    public = [path for path, _, _ in data_sources(p.data.source) if path != "sharegpt"]
    assert {path.rsplit("/", 1)[1] for path in public} == set(ROWS)
    for path in public:                          # the profile's comment writes exactly that folder
        assert re.search(rf"save_to_disk\('{re.escape(path)}'\)", text), path
    assert "own-corpus" not in yaml.safe_dump(p.to_dict())

