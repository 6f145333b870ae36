"""Render chat messages with the model's own template from its GGUF metadata."""

from __future__ import annotations

import hashlib
import json

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

# Used only when a GGUF carries no tokenizer.chat_template: ChatML, as SmolLM2 and Qwen use.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# For a template with no tool format of its own: the tools go into a system note asking for the
# Hermes-style block that api/core/tools.py parses.
TOOL_NOTE = (
    "You may call functions. The available functions, as JSON Schema:\n{tools}\n"
    "To call one, answer with only this block:\n<tool_call>\n"
    '{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)

# A reasoning model's thinking, as DeepSeek-R1, Qwen3 and QwQ write it (and their templates name it)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The variables the renderer sets itself; a request's chat_template_kwargs may set any other
RENDER_NAMES = frozenset({"messages", "tools", "bos_token", "eos_token", "add_generation_prompt", "raise_exception",
                          "functions", "function_call", "tool_choice", "strftime_now"})
# What the template gets unless the request says otherwise: thinking on, as llama-server renders it (Qwen3's template
# thinks unless enable_thinking is false; llama.cpp's copies of DeepSeek-R1's and QwQ's close the block unless true)
DEFAULT_KWARGS = {"enable_thinking": True}


class ChatTemplate:
    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.source = "gguf" if template else "chatml-fallback"
        # HF templates with a tool format read a `tools` variable (Qwen2.5, Hermes, Llama 3.1, Mistral)
        self.has_tools = template is not None and "tools" in template
        # a reasoning model's template: it writes or strips <think> blocks (DeepSeek-R1 distills, Qwen3, QwQ)
        self.thinking = template is not None and (THINK_OPEN in template or THINK_CLOSE in template)
        # Mistral's templates take only 9-character alphanumeric call ids, and refuse OpenAI's ("call_...")
        self.short_call_ids = template is not None and "length 9" in template
        self._formatter = Jinja2ChatFormatter(
            template=template or CHATML, eos_token=eos_token, bos_token=bos_token, add_generation_prompt=True
        )

    def render(self, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """The prompt text; raises ValueError when the template refuses the messages.

        With tools, or messages carrying tool calls and results: a template with a tool format
        gets them as HF's apply_chat_template passes them (`tools`, and each call's arguments as an
        object); one without gets a system note and the calls and results written in as text.
        `kwargs`: the request's chat_template_kwargs (none of RENDER_NAMES), over DEFAULT_KWARGS.
        """
        kw = DEFAULT_KWARGS | (kwargs or {})
        if self.has_tools:
            messages = [_hf_message(m) for m in messages]
            if self.short_call_ids:
                messages = _with_short_call_ids(messages)
            if tools:
                kw["tools"] = tools
        else:
            messages = _as_text(messages, tools)
        try:
            return self._render(messages, kw)
        except ValueError as exc:
            # Gemma's templates refuse any system turn (Gemma 3's own folds it into the first user turn): do that
            # for them, so a system message, or the tool note above, reaches such a model too. Only that refusal:
            # others that name the system message ("must be at the beginning") are the request's to fix
            folded = _system_folded(messages) if SYSTEM_REFUSED in str(exc) else None
            if folded is None:
                raise
            return self._render(folded, kw)

    def _render(self, messages: list[dict], kw: dict) -> str:
        try:
            return self._formatter(messages=messages, **kw).prompt  # type: ignore[arg-type]  # plain dicts of its shape
        except ValueError:
            raise
        except Exception as exc:  # jinja errors from the model's template
            raise ValueError(f"the model's chat template could not render these messages: {exc}") from None


# the refusal of Gemma's templates (google-gemma-2-2b-it.jinja in llama.cpp's models/templates)
SYSTEM_REFUSED = "System role not supported"


def _system_folded(messages: list[dict]) -> list[dict] | None:
    """The messages with the system turns' text put before the first user turn's (None: nothing to fold)."""
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    if not system or not rest or rest[0].get("role") != "user" or not isinstance(rest[0].get("content"), str):
        return None
    text = "\n\n".join(str(m.get("content") or "") for m in system)
    return [rest[0] | {"content": f"{text}\n\n{rest[0]['content']}"}] + rest[1:]


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _hf_message(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return m | {"tool_calls": calls}


def short_call_id(call_id: str) -> str:
    """A 9-character alphanumeric id for an OpenAI call id (as vLLM gives Mistral models): its last 9 letters and
    digits where it has them, else a hash of it; the same id always maps to the same short one."""
    chars = "".join(c for c in call_id if c.isascii() and c.isalnum())
    if len(chars) >= 9:
        return chars[-9:]
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _with_short_call_ids(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = m | {"tool_calls": [c | {"id": short_call_id(str(c.get("id", "")))} for c in m["tool_calls"]]}
        if m.get("role") == "tool" and m.get("tool_call_id"):
            m = m | {"tool_call_id": short_call_id(str(m["tool_call_id"]))}
        out.append(m)
    return out


def _as_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows only roles and text: calls as <tool_call> blocks, results as user turns."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = "".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": _arguments(c["function"]["arguments"])}) + "\n</tool_call>"
                for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + blocks})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]}
                       | ({"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") else {}))
    if tools:
        note = TOOL_NOTE.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out
