"""Reasoning models' thinking (DeepSeek-R1 distills, Qwen3, QwQ: `<think>...</think>` before the answer), read apart.

What vLLM's `--reasoning-parser deepseek_r1` / `qwen3` and llama-server's `reasoning_format` do, for the three
endpoints: the thinking comes back as chat's `reasoning_content` (Responses' reasoning item, Messages' thinking
block) and the rest as the answer. A request says how it wants its output read (`reasoning_format`, llama-server's
field) and whether the model should think (`chat_template_kwargs.enable_thinking`, `reasoning_effort`); once its
prompt is rendered it is settled (api/core/generation.prepared) whether its output is read apart and whether it starts
inside a thinking block -- some templates open `<think>` in the prompt themselves (DeepSeek-R1 distills, QwQ). A
grammar the daemon built (a JSON schema, a forced tool call) then holds the answer after the thinking, not the
thinking itself, as vLLM and llama-server apply theirs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum, StrEnum
from typing import Any

from syshaxd.api.core.errors import invalid, one_of
from syshaxd.sdk.gguf.chat import RENDER_NAMES, THINK_CLOSE, THINK_OPEN


class ReasoningFormat(StrEnum):
    """llama-server's reasoning_format: how a chat answer shows the model's thinking."""

    NONE = "none"  # as the model wrote it: the tags stay in content
    DEEPSEEK = "deepseek"  # the thinking in reasoning_content, the rest in content
    AUTO = "auto"  # deepseek where the model's chat template is a thinking template, else none (the default)


# OpenAI's values of reasoning_effort; "none" turns thinking off, as in llama-server
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class Thinking:
    """How one chat request's output is read for thinking: what it asked when parsed, settled once its prompt is
    rendered (settle)."""

    format: ReasoningFormat = ReasoningFormat.AUTO
    # the endpoint's field that asked the model to think (Messages' `thinking`, Responses' `reasoning.effort`): a 400
    # names it where the model's template has no thinking. "": nothing asked for it
    demanded_by: str = ""
    settled: bool = False
    split: bool = False  # the output is read apart into thinking and answer
    opened: bool = False  # the rendered prompt ends inside an open <think>: the output starts as thinking

    def settle(self, template_thinks: bool, prompt_end: str) -> "Thinking":
        """This request's reading, given whether the model's template is a thinking one and the end of its rendered
        prompt."""
        if self.demanded_by and not template_thinks:
            raise invalid(f"'{self.demanded_by}' asks the model to think, but the served model's chat template has "
                          "no thinking (no <think> ... </think>); leave it out, or serve a reasoning model "
                          "(DeepSeek-R1 distills, Qwen3, QwQ).", param=self.demanded_by, code="unsupported_parameter")
        split = self.format == ReasoningFormat.DEEPSEEK or (self.format == ReasoningFormat.AUTO and template_thinks)
        return replace(self, settled=True, split=split, opened=split and opens_thinking(prompt_end))


def opens_thinking(prompt_end: str) -> bool:
    """Whether a rendered prompt leaves a thinking block open for the output: it ends with `<think>` (and whitespace),
    as DeepSeek-R1's (`<｜Assistant｜><think>\\n`) and QwQ's generation prompts do. Only the end counts: a user's
    message that mentions `<think>` is followed by the template's own turn markers."""
    head = prompt_end.rstrip()
    return head.endswith(THINK_OPEN)


def parse_thinking(body: dict) -> tuple[Thinking, dict[str, Any]]:
    """A chat body's reasoning_format, and the keyword arguments its chat template gets from chat_template_kwargs and
    reasoning_effort (vLLM's and llama-server's fields; "none" effort is enable_thinking false, any other effort is
    passed on as `reasoning_effort`, as llama-server passes it)."""
    fmt = body.get("reasoning_format")
    if fmt is None:
        fmt = ReasoningFormat.AUTO
    else:
        one_of(fmt, tuple(ReasoningFormat), "reasoning_format")
    kwargs = template_kwargs(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        if one_of(effort, EFFORTS, "reasoning_effort") == "none":
            if kwargs.get("enable_thinking") is True:
                raise invalid("'reasoning_effort': 'none' turns thinking off, and 'chat_template_kwargs."
                              "enable_thinking' turns it on; send one of them.", param="reasoning_effort")
            kwargs["enable_thinking"] = False
        else:
            kwargs.setdefault("reasoning_effort", effort)
    return Thinking(ReasoningFormat(fmt)), kwargs


def template_kwargs(value: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """chat_template_kwargs, checked: an object whose keys do not replace what the renderer passes itself."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"Invalid type for '{where}': expected an object of the chat template's variables.",
                      param=where, code="invalid_type")
    taken = sorted(k for k in value if k in RENDER_NAMES)
    if taken:
        raise invalid(f"Invalid '{where}.{taken[0]}': the server sets it itself (the messages, the tools and the "
                      f"special tokens come from the request and the model); keys other than "
                      f"{', '.join(sorted(RENDER_NAMES))} are passed to the template.", param=f"{where}.{taken[0]}")
    thinks = value.get("enable_thinking")
    if thinks is not None and not isinstance(thinks, bool):
        raise invalid(f"Invalid type for '{where}.enable_thinking': expected a boolean.",
                      param=f"{where}.enable_thinking", code="invalid_type")
    return dict(value)


# --- the output read apart ----------------------------------------------------------------------------------------


class _Part(Enum):
    START = 0  # nothing read yet (the output may open with <think>)
    THINKING = 1
    ANSWER = 2


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag (held until the next piece tells)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplit:
    """One output read apart into thinking and answer as it streams. The thinking is what stands between `<think>`
    (at the output's start, after whitespace, or in the prompt: `opened`) and the first `</think>`, without the
    whitespace around it; the answer is the rest, without its leading whitespace, as llama-server gives them. An
    output that does not open a thinking block is all answer, as it came. Fed the same text in any pieces, it gives
    the same two texts (a stream and a JSON answer agree)."""

    def __init__(self, opened: bool) -> None:
        self.part = _Part.THINKING if opened else _Part.START
        self.thought = opened  # the output has a thinking block
        self._held = ""  # text whose part is not known yet: a tag may be starting
        self._space = ""  # whitespace at the end of the thinking so far: shown only if more thinking follows
        self._shown_thought = False  # some thinking went out (the whitespace before it is dropped)
        self._shown_answer = False

    @property
    def thinking(self) -> bool:
        """The output is still (or may still be) in its thinking."""
        return self.part != _Part.ANSWER

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) that can go out after this piece of output."""
        self._held += text
        thought: list[str] = []
        answer: list[str] = []
        while self._held:
            if self.part is _Part.START:
                head = self._held.lstrip()
                if head.startswith(THINK_OPEN):
                    self._held = head[len(THINK_OPEN):]
                    self.part, self.thought = _Part.THINKING, True
                elif THINK_OPEN.startswith(head):  # whitespace, or the start of <think>
                    break
                else:  # no thinking: the output is the answer, as it came
                    self.part = _Part.ANSWER
                    self._shown_answer = True
            elif self.part is _Part.THINKING:
                end = self._held.find(THINK_CLOSE)
                if end >= 0:
                    thought.append(self._thinking(self._held[:end]))
                    self._space = ""
                    self._held = self._held[end + len(THINK_CLOSE):]
                    self.part = _Part.ANSWER
                else:
                    keep = len(self._held) - _partial_tag(self._held, THINK_CLOSE)
                    thought.append(self._thinking(self._held[:keep]))
                    self._held = self._held[keep:]
                    break
            else:
                if not self._shown_answer:
                    self._held = self._held.lstrip()
                    if not self._held:
                        break
                    self._shown_answer = True
                answer.append(self._held)
                self._held = ""
        return "".join(thought), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """(thinking, answer) still held when the output ended. Cut inside its thinking (max_tokens), the output is
        all thinking; a closing tag cut short stays in it, as the model wrote it."""
        held, self._held = self._held, ""
        if self.part is _Part.START:
            return "", held
        if self.part is _Part.THINKING:
            return self._thinking(held), ""
        return "", ""

    def _thinking(self, text: str) -> str:
        """Thinking text as it goes out: none of the whitespace before it, and whitespace at its end held until more
        thinking follows."""
        if not self._shown_thought:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out = self._space + body
        self._space = text[len(body):]
        self._shown_thought = True
        return out


class ThinkingReader:
    """One choice's output read apart into thinking and answer as its events arrive, and the tokens that went into
    the thinking (each event's, until and with the one that ended it)."""

    def __init__(self, opened: bool) -> None:
        self.split = ThinkSplit(opened)
        self.tokens = 0

    def feed(self, text: str, n_tokens: int, finished: bool, pieces: list[str] | None = None) -> tuple[str, str]:
        """(thinking, answer) an event's text adds; `finished`: the output ends with it. `pieces`: the text token by
        token, where an event holds several (a decode step that kept guessed tokens): then the tokens that went into
        the thinking are counted one by one, not the event's all (fed in any pieces, the split gives the same
        texts). Where the pieces do not make up the text (a character split between tokens), the event counts
        whole, as one token's event does."""
        if pieces is not None and n_tokens > 1 and self.split.thinking and "".join(pieces) == text:
            parts = [self._feed(piece, 1, finished and i == len(pieces) - 1) for i, piece in enumerate(pieces)]
            return "".join(t for t, _ in parts), "".join(a for _, a in parts)
        return self._feed(text, n_tokens, finished)

    def _feed(self, text: str, n_tokens: int, finished: bool) -> tuple[str, str]:
        thinking = self.split.thinking
        thought, answer = self.split.feed(text)
        if finished:
            more_thought, more_answer = self.split.finish()
            thought, answer = thought + more_thought, answer + more_answer
        if thinking and self.split.thought:
            self.tokens += n_tokens
        return thought, answer


def split_whole(text: str, opened: bool) -> tuple[str, str, bool]:
    """(thinking, answer, whether the output had a thinking block) of a whole output."""
    split = ThinkSplit(opened)
    thought, answer = split.feed(text)
    more_thought, more_answer = split.finish()
    return thought + more_thought, answer + more_answer, split.thought


# --- a grammar for the answer after the thinking --------------------------------------------------------------------

_WORD = re.compile(r"[a-zA-Z0-9-]+")  # a GBNF rule name (llama.cpp's is_word_char)
LITERAL_GRAMMAR_FIELDS = ("grammar",)  # llama-server's `grammar` holds the whole output, its thinking too


def _renamed(gbnf: str, old: str, new: str) -> str:
    """The grammar with rule `old` named `new` wherever it is defined or referred to (not inside literals, character
    classes or comments)."""
    out: list[str] = []
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            j = min(j + 1, n)
        elif c == "#":
            j = gbnf.find("\n", i)
            j = n if j < 0 else j
        elif word := _WORD.match(gbnf, i):
            out.append(new if word.group() == old else word.group())
            i = word.end()
            continue
        else:
            j = i + 1
        out.append(gbnf[i:j])
        i = j
    return "".join(out)


def _escape(c: str) -> str:
    return "\\" + c if c in '"\\]-^[' else c


def after_thinking(grammar: str, opened: bool) -> str:
    """A grammar whose output may think first and then matches `grammar` (root rule "root"): with the prompt's
    thinking open, text up to and including the first `</think>`; else an optional `<think>` block. Whitespace may
    stand between the thinking and the answer, as models write it."""
    prefix = "think"
    while f"{prefix}-" in grammar:
        prefix = "x" + prefix
    rule = lambda k: f"{prefix}-{k}"  # noqa: E731 -- k: characters of </think> matched so far
    tag = THINK_CLOSE
    rules = [f'{rule(0)} ::= "<" {rule(1)} | [^<] {rule(0)}']
    for k in range(1, len(tag)):
        c = tag[k]
        on = f'"{c}"' if k == len(tag) - 1 else f'"{c}" {rule(k + 1)}'
        rules.append(f'{rule(k)} ::= {on} | "<" {rule(1)} | [^{_escape(c)}<] {rule(0)}')
    thinking = f"{rule(0)} {rule('space')}"
    head = thinking if opened else f'("{THINK_OPEN}" {thinking})?'
    return "\n".join([f"root ::= {head} {rule('answer')}",
                      f"{rule('space')} ::= [ \\t\\n]{{0,4}}",
                      *rules,
                      _renamed(grammar, "root", rule("answer"))])
