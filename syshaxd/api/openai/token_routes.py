"""POST /tokenize and /detokenize, in llama-server's shapes (and vLLM's: `prompt`, `messages`, `count`).

Tokens are the engines' own: the model's llama.cpp vocabulary, and for chat messages its chat
template rendered as the engines render it. The work runs off the event loop.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from syshaxd.api.core.app_keys import CONFIG, MODEL_NAME, VOCAB
from syshaxd.api.core.errors import APIError, invalid
from syshaxd.api.core.reasoning import template_kwargs
from syshaxd.api.core.validate import parse_json_body, parse_message, type_error
from syshaxd.sdk.types import GenerateRequest

routes = web.RouteTableDef()


def _check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:  # optional here, as in vLLM; a wrong one is still wrong
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{served}`.", param="model",
                       code="model_not_found")


def _flag(body: dict, names: tuple[str, ...], default: bool) -> bool:
    for name in names:
        value = body.get(name)
        if value is not None:
            if not isinstance(value, bool):
                raise type_error(name, "a boolean", value)
            return value
    return default


def _piece(data: bytes) -> str | list[int]:
    """llama-server's `piece`: the text, or its bytes when they are not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    body = parse_json_body(await request.read())
    _check_model(body, request.app[MODEL_NAME])
    add_special = _flag(body, ("add_special", "add_special_tokens"), True)
    with_pieces = _flag(body, ("with_pieces",), False)
    if "messages" in body and body["messages"] is not None:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise invalid("Invalid 'messages': expected a non-empty array of messages.", param="messages")
        if not _flag(body, ("add_generation_prompt",), True):
            raise invalid("'add_generation_prompt': false is not supported; the engines always render the "
                          "assistant's turn start.", param="add_generation_prompt", code="unsupported_parameter")
        req = GenerateRequest("tokenize", None, messages=tuple(parse_message(i, m) for i, m in enumerate(messages)),
                              chat_template_kwargs=template_kwargs(body.get("chat_template_kwargs")) or None)
    else:
        name = "content" if "content" in body else "prompt"
        text = body.get(name)
        if text is None:
            raise invalid("you must provide 'content' (or 'prompt', or 'messages')", param="content",
                          code="missing_required_parameter")
        if not isinstance(text, str):
            raise type_error(name, "a string", text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(f"Invalid '{name}': it holds a lone UTF-16 surrogate, which is not text.",
                          param=name) from None
        req = GenerateRequest("tokenize", None, prompt=text)
    vocab = await request.app[VOCAB].get()

    def run() -> list[int]:
        if req.messages is not None:
            return vocab.prompt_tokens(req)  # the template writes its own special tokens
        return vocab.tokenize(req.prompt or "", add_special=add_special)

    try:
        tokens = await asyncio.to_thread(run)
    except ValueError as exc:  # the chat template refused the messages
        raise invalid(str(exc), param="messages", code="invalid_prompt") from None
    pieces = request.app[VOCAB].pieces
    shown = [{"id": t, "piece": _piece(pieces.bytes(t))} for t in tokens] if with_pieces else tokens
    return web.json_response({"tokens": shown, "count": len(tokens),
                              "max_model_len": request.app[CONFIG].n_ctx})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    body = parse_json_body(await request.read())
    _check_model(body, request.app[MODEL_NAME])
    tokens = body.get("tokens")
    if tokens is None:
        raise invalid("you must provide 'tokens'", param="tokens", code="missing_required_parameter")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise type_error("tokens", "an array of token ids", tokens)
    vocab = await request.app[VOCAB].get()
    bad = [t for t in tokens if not 0 <= t < vocab.n_vocab]
    if bad:
        raise invalid(f"Invalid 'tokens': token id {bad[0]} is outside the vocabulary (0..{vocab.n_vocab - 1}).",
                      param="tokens")
    pieces = request.app[VOCAB].pieces
    text = (await asyncio.to_thread(lambda: b"".join(pieces.bytes(t) for t in tokens))).decode(
        "utf-8", errors="replace")
    return web.json_response({"content": text, "prompt": text})


@routes.get("/tokenizer_info")
async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's tokenizer description (lm-eval's remote tokenizer reads it): special tokens and the chat template."""
    vocab = await request.app[VOCAB].get()
    llama = vocab._llama

    def special(token: int) -> str | None:
        return vocab.piece_text(token) if token >= 0 else None

    return web.json_response({
        "tokenizer_class": "llama.cpp", "vocab_size": vocab.n_vocab, "model_max_length": request.app[CONFIG].n_ctx,
        "bos_token": special(llama.llama_vocab_bos(vocab.vocab)),
        "eos_token": special(llama.llama_vocab_eos(vocab.vocab)),
        "pad_token": special(llama.llama_vocab_pad(vocab.vocab)),
        "chat_template": vocab.meta("tokenizer.chat_template"),
    })
