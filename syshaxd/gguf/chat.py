"""Render chat messages with the model's own template from its GGUF metadata."""

from __future__ import annotations

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

# Used only when a GGUF carries no tokenizer.chat_template: ChatML, as SmolLM2 and Qwen use.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplate:
    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.source = "gguf" if template else "chatml-fallback"
        self._formatter = Jinja2ChatFormatter(
            template=template or CHATML, eos_token=eos_token, bos_token=bos_token, add_generation_prompt=True
        )

    def render(self, messages: list[dict]) -> str:
        """The prompt text; raises ValueError when the template refuses the messages."""
        try:
            return self._formatter(messages=messages).prompt
        except ValueError:
            raise
        except Exception as exc:  # jinja errors from the model's template
            raise ValueError(f"the model's chat template could not render these messages: {exc}") from None
