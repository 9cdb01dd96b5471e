"""The target's chat template as token ids: thinking mode, generation prompts, a Kimi-like template.

Reasoning targets render the same chat two ways. Kimi-K2.5 (like DeepSeek-V3.1, Qwen3, GLM-4.5)
reads a boolean template variable: thinking (its default) ends the generation prompt with `<think>`
and the target writes its reasoning, `</think>`, then the answer; instant mode ends the prompt
with `<think></think>`. Past assistant turns render as `<think></think>` + content in both modes,
so a thinking answer is never re-rendered as the target wrote it.

`data.thinking` picks the mode for regeneration, the render path of the data stage and the eval
prompts alike: "auto" passes nothing (the template's own default), "on"/"off" pass
`thinking` and `enable_thinking` (the two names these templates read; a template ignores the other).
HF `apply_chat_template(**kwargs)` hands extra keyword arguments to the Jinja template as variables.

Chats with tools render with the template's `tools` argument (the OpenAI tools list, chats.py), so
the target reads its own tools declaration and answers with its own tool-call markers; a template
that renders `tools` or an assistant turn's `tool_calls` no differently from a chat without them
ignores them (ignored_tool_features: the data stage counts such chats and says so once).

Control-token text: a chat whose text (a message's content, its tool calls, the tools list) holds the
text of one of the tokenizer's special tokens (`<|im_end|>`, `<|im_start|>` on SmolLM2) is never
rendered: the tokenizer would read that text as the control token itself (a fake turn inside a user
message, a control id mid-answer with loss mask 1). `control_token_text` finds it; the data stage,
regeneration and the eval prompts skip such a chat and count it (NOTES.md, Decisions: Data). The
ids the target generates are never checked: its own control tokens (tool-call markers) stay as it
produced them.

`KIMI_LIKE_TEMPLATE` behaves like Kimi-K2.5's template (thinking generation prompt, empty think
block in history, tools declaration, tool-call markers, tool results) on any tokenizer; the tests
give it to SmolLM2's tokenizer.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Iterator, Optional

THINKING_CHOICES = ("auto", "on", "off")
THINK_START, THINK_END = "<think>", "</think>"
PROBE_CHAT = [{"role": "user", "content": "Hi"}]


def template_kwargs(thinking: str) -> dict:
    """The Jinja variables that select data.thinking's mode ({} for "auto": the template's default)."""
    if thinking not in THINKING_CHOICES:
        raise ValueError(f"data.thinking: must be one of {THINKING_CHOICES}, got {thinking!r}")
    if thinking == "auto":
        return {}
    on = thinking == "on"
    return {"thinking": on, "enable_thinking": on}


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool, thinking: str = "auto",
                tools: Optional[list[dict]] = None) -> str:
    """The chat as text; `tools` (a chat's OpenAI tools list) goes to the template only when there are
    some, so a chat without tools renders exactly as it did before tools existed."""
    kwargs = template_kwargs(thinking)
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def prompt_ids(tokenizer, messages: list[dict], thinking: str = "auto",
               tools: Optional[list[dict]] = None) -> list[int]:
    """The ids the engine gets for the next assistant turn: the template with its generation prompt
    (and the chat's tools declaration), tokenised without special tokens (the template writes them)."""
    text = render_text(tokenizer, messages, True, thinking, tools)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


class ControlTokenText(ValueError):
    """A chat's text holds a special token's text (`token`), which the tokenizer would read as that token."""

    def __init__(self, token: str):
        super().__init__(f"the chat's text holds {token!r}, the text of a control token of the target's tokenizer")
        self.token = token


@functools.lru_cache(maxsize=8)
def _control_token_pattern(tokenizer) -> Optional[re.Pattern]:
    """A regex matching the text of any special token of `tokenizer` (added tokens marked special and
    the named special tokens); None when it has none. Non-special added tokens (whitespace runs, words)
    are ordinary text the model reads as those ids everywhere."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = {str(t) for t in decoder.values() if getattr(t, "special", False)}
    tokens |= {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    tokens = sorted((t for t in tokens if t.strip()), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON-like value (dict values, list items)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def control_token_text(tokenizer, messages: list[dict], tools: Optional[list[dict]] = None) -> Optional[str]:
    """The first special token whose text occurs in the chat's text (messages and tools), else None."""
    pattern = _control_token_pattern(tokenizer)
    if pattern is None:
        return None
    for text in _strings([messages, tools or []]):
        found = pattern.search(text)
        if found:
            return found.group(0)
    return None


def check_no_control_token_text(tokenizer, messages: list[dict], tools: Optional[list[dict]] = None) -> None:
    """Raise ControlTokenText when the chat's text holds a special token's text (control_token_text)."""
    token = control_token_text(tokenizer, messages, tools)
    if token is not None:
        raise ControlTokenText(token)


PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                               "parameters": {"type": "object", "properties": {}}}}
PROBE_CALL = [{"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "functions.probe:0", "type": "function", "function": {"name": "probe", "arguments": "{}"}}]}]


def _renders_differently(render_with, render_without) -> bool:
    try:
        return render_with() != render_without()
    except Exception:  # a template may refuse what it does not support (jinja2's raise_exception)
        return False


def ignored_tool_features(tokenizer) -> list[str]:
    """What of a chat with tools the template does not render: "tools" (the declaration: the prompt
    is the same with and without `tools=`), "tool_calls" (an assistant turn with calls renders as one
    without). Empty for a template with tools support."""
    ignored = []
    if not _renders_differently(lambda: render_text(tokenizer, PROBE_CHAT, True, tools=[PROBE_TOOL]),
                                lambda: render_text(tokenizer, PROBE_CHAT, True)):
        ignored.append("tools")
    plain = [PROBE_CALL[0], {"role": "assistant", "content": ""}]
    if not _renders_differently(lambda: render_text(tokenizer, PROBE_CALL, False),
                                lambda: render_text(tokenizer, plain, False)):
        ignored.append("tool_calls")
    return ignored


def thinking_active(tokenizer, thinking: str = "auto") -> bool:
    """Whether the generation prompt opens a reasoning block (ends with `<think>`): the target will
    write its reasoning before the answer."""
    return render_text(tokenizer, PROBE_CHAT, True, thinking).rstrip().endswith(THINK_START)


def check_thinking_kwarg(tokenizer, thinking: str) -> None:
    """Refuse data.thinking on/off for a template that renders both modes alike (it reads neither
    `thinking` nor `enable_thinking`): the profile would claim a mode the target never gets."""
    if thinking == "auto":
        return
    if render_text(tokenizer, PROBE_CHAT, True, "on") == render_text(tokenizer, PROBE_CHAT, True, "off"):
        raise ValueError(f"data.thinking: {thinking!r}, but the target's chat template renders the same "
                         f"prompt with thinking on and off (it reads neither `thinking` nor "
                         f"`enable_thinking`): set data.thinking: auto")


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a generated text: split at the last `</think>`; no marker: all answer."""
    head, sep, tail = text.rpartition(THINK_END)
    return (head, tail) if sep else ("", text)


# A template shaped like Kimi-K2.5's: role headers <|im_system|>/<|im_user|>/<|im_assistant|> +
# <|im_middle|>, the tools declaration first (a `tool_declare` system turn, compact JSON), default
# system prompt, `thinking` variable (default true), reasoning kept only for assistant turns after the
# last user turn, tool calls (`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
# <|tool_call_end|>` inside a tool-calls section) and tool results.
KIMI_LIKE_TEMPLATE = (
    "{%- set thinking = thinking if thinking is defined else true -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- if not messages or messages[0].role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n"
    "{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ m.reasoning_content or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m.content }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    "{%- if tc.function.arguments is string -%}{{ tc.function.arguments }}"
    "{%- else -%}{{ tc.function.arguments | tojson }}{%- endif -%}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking -%}<think>{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}")


def save_kimi_like_tokenizer(src_dir: Path, out_dir: Path) -> Path:
    """`src_dir`'s tokenizer with KIMI_LIKE_TEMPLATE as its chat template, saved to `out_dir`.
    No token is added (the markers are ordinary text), so the vocabulary and every model that
    reads `src_dir`'s ids stay valid; `<|im_end|>` must be the tokenizer's end-of-turn token."""
    from transformers import AutoTokenizer  # heavy import, only for building test tokenizers
    tok = AutoTokenizer.from_pretrained(str(src_dir))
    if tok.convert_tokens_to_ids("<|im_end|>") in (None, tok.unk_token_id):
        raise ValueError(f"{src_dir}: the tokenizer has no <|im_end|> token to end a turn")
    tok.chat_template = KIMI_LIKE_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return out_dir
