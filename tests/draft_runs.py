"""tests/plugins/test_draft_model.py's in-process runs, in a process of their own (a guessing engine tiles its attention, which
llama.cpp reads once per process): greedy texts of prompts one after another with every guess checked (the
draft's where the prompt lookup has none), and the draft's guessed tokens, those kept and its refused steps, as one
JSON line. An engine that cannot be built exits 1 with the reason on stderr.

    python tests/draft_runs.py MODEL.gguf DRAFT.gguf|"" PROMPTS.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "llamacpp")]

from syshax_llamacpp.engine import LlamaCppEngine  # noqa: E402
from syshaxd.sdk.types import Delta, EngineSpec, GenerateRequest, SamplingParams  # noqa: E402


def main() -> int:
    model, draft, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    try:
        engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=model, model_name="m",
                                           n_ctx=1024, max_batch_size=4, threads=2, tiled_attention=True,
                                           speculative_tokens=8, draft_model=draft, guess_always=True))
    except Exception as exc:  # the test reads the reason
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    try:
        engine.warm_up()
        texts = []
        for i, prompt in enumerate(prompts):
            engine.submit(GenerateRequest(request_id=str(i), max_tokens=96, ignore_eos=True,
                                          messages=({"role": "user", "content": prompt},),
                                          sampling=SamplingParams(temperature=0)))
            text = ""
            while engine.has_work():
                text += "".join(e.text for e in engine.step() if isinstance(e, Delta))
            texts.append(text)
        stats, draft = engine.stats(), engine.guesser.draft
        print(json.dumps({"texts": texts, "guessed": stats.drafted_tokens, "kept": stats.kept_drafts,
                          "failures": draft.failures if draft is not None else 0}))
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
