"""Render chat messages with the model's own template from its GGUF metadata."""

from __future__ import annotations

import json

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

# Used only when a GGUF carries no tokenizer.chat_template: ChatML, as SmolLM2 and Qwen use.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# For a template with no tool format of its own: the tools go into a system note asking for the
# Hermes-style block that api/tools.py parses.
TOOL_NOTE = (
    "You may call functions. The available functions, as JSON Schema:\n{tools}\n"
    "To call one, answer with only this block:\n<tool_call>\n"
    '{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


class ChatTemplate:
    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.source = "gguf" if template else "chatml-fallback"
        # HF templates with a tool format read a `tools` variable (Qwen2.5, Hermes, Llama 3.1, Mistral)
        self.has_tools = bool(template) and "tools" in template
        self._formatter = Jinja2ChatFormatter(
            template=template or CHATML, eos_token=eos_token, bos_token=bos_token, add_generation_prompt=True
        )

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text; raises ValueError when the template refuses the messages.

        With tools, or messages carrying tool calls and results: a template with a tool format
        gets them as HF's apply_chat_template passes them (`tools`, and each call's arguments as an
        object); one without gets a system note and the calls and results written in as text.
        """
        if self.has_tools:
            messages = [_hf_message(m) for m in messages]
            kw = {"tools": tools} if tools else {}
        else:
            messages = _as_text(messages, tools)
            kw = {}
        try:
            return self._formatter(messages=messages, **kw).prompt
        except ValueError:
            raise
        except Exception as exc:  # jinja errors from the model's template
            raise ValueError(f"the model's chat template could not render these messages: {exc}") from None


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
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        note = TOOL_NOTE.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out
