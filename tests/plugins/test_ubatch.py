"""The CPU decoder's batch goes to llama.cpp as one ubatch at every step, whatever order requests come and go in.

llama.cpp splits a batch over several KV streams into one ubatch per run of consecutive, ascending
sequence ids; each extra ubatch is another pass over the weights. The count is read from llama.cpp
itself: its eval callback sees the output node of every graph it computes on the batch context.
"""

from __future__ import annotations

import uuid

from syshaxd.sdk.types import Delta, EngineSpec, GenerateRequest, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def quicksort(arr):", "The best way to learn is",
           "In 1969, astronauts", "Water boils at", "My favourite colour is", "The recipe needs",
           "A haiku about autumn:", "SELECT name FROM", "Dear Sir or Madam,", "The mitochondria is"]
# (step it arrives at, max_tokens): arrivals and finishes scattered, so ids free up inside the run
SCHEDULE = [(0, 30), (0, 9), (0, 22), (1, 14), (3, 40), (4, 6), (6, 26), (8, 11), (9, 33), (15, 8), (18, 24),
            (25, 12)]


def engine(model, on_graph=None):
    from syshax_llamacpp.engine import LlamaCppEngine

    spec = EngineSpec(backend="llamacpp", role="generate", model_path=str(model), model_name="m", n_ctx=256,
                      max_batch_size=6, threads=2, prefill_chunk_size=64)
    return LlamaCppEngine(spec, on_graph=on_graph)


def request(prompt: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=uuid.uuid4().hex, max_tokens=max_tokens, ignore_eos=True,
                           sampling=SamplingParams(temperature=0), prompt=prompt)


def test_every_decode_step_is_one_ubatch_and_each_request_decodes_as_alone(default_model):
    alone = {}
    eng = engine(default_model)
    try:
        for prompt, (_, max_tokens) in zip(PROMPTS, SCHEDULE):
            eng.submit(request(prompt, max_tokens))
            text = ""
            while eng.has_work():
                text += "".join(e.text for e in eng.step() if isinstance(e, Delta))
            alone[prompt] = text
    finally:
        eng.close()

    graphs: list[int] = []
    eng = engine(default_model, on_graph=lambda: graphs.append(1))
    texts: dict[str, str] = {}
    ids: dict[str, str] = {}
    per_step: list[tuple[int, int]] = []  # (rows decoded, graphs llama.cpp computed) per step
    try:
        step = 0
        while step <= SCHEDULE[-1][0] or eng.has_work():
            for prompt, (at, max_tokens) in zip(PROMPTS, SCHEDULE):
                if at == step:
                    req = request(prompt, max_tokens)
                    ids[req.request_id] = prompt
                    eng.submit(req)
            decoding = sum(1 for s in eng.slots.active.values() if s.next_token is not None)
            before = len(graphs)
            for event in eng.step():
                if isinstance(event, Delta):
                    texts[ids[event.request_id]] = texts.get(ids[event.request_id], "") + event.text
            per_step.append((decoding, len(graphs) - before))
            step += 1
        moves = eng.stats().stream_moves
    finally:
        eng.close()

    split = [(i, rows, n) for i, (rows, n) in enumerate(per_step) if n != (1 if rows else 0)]
    assert not split, f"steps (index, rows, ubatches) that llama.cpp split: {split}"
    assert texts == alone  # concurrent == alone, moves included
    assert moves > 0, "the schedule left no hole inside the run: it tests nothing"
    assert max(rows for rows, _ in per_step) >= 5
