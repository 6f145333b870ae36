"""Make the tiny test models of every family (tests/families.py) into a directory and print what they are.

Each family's random-weight model is converted by llama.cpp's own convert_hf_to_gguf.py (the llama-cpp-python
0.3.36 sdist's, unpacked by mk/llama-source.sh) and cached in the directory; the table is read from each GGUF's
header: its file type, head_dim (attention.key_length, else n_embd / n_head), heads and KV heads, architecture,
and the seconds it took to make (0 when it was cached). With --check each is also loaded by llama-cpp-python and
answers one greedy chat (8 tokens) through the chat template it carries.

    .venv/bin/python bench/make_family_models.py DIR [--quant f16] [--family qwen3 ...] [--check]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

from families import FAMILIES, NOTES, make_family_model  # noqa: E402
from syshaxd.sdk.gguf.header import read_gguf_header  # noqa: E402
from syshaxd.sdk.gguf.quantize import FTYPE_NAMES  # noqa: E402


def describe(path: Path) -> dict:
    meta, _ = read_gguf_header(path)
    arch = meta["general.architecture"]
    n_head = meta.get(f"{arch}.attention.head_count")
    n_embd = meta.get(f"{arch}.embedding_length")
    head_dim = meta.get(f"{arch}.attention.key_length") or (n_embd // n_head if n_embd and n_head else None)
    ftype = meta.get("general.file_type")
    return {"file type": FTYPE_NAMES.get(ftype, str(ftype)), "head_dim": head_dim, "n_head": n_head,
            "n_head_kv": meta.get(f"{arch}.attention.head_count_kv"), "arch": arch,
            "vocab": meta.get("tokenizer.ggml.model")}


def check(path: Path) -> str:
    """Load the GGUF with llama-cpp-python and answer one greedy chat: 'ok: <text>' or the error."""
    import llama_cpp

    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False)
    except Exception as exc:  # noqa: BLE001 - the report names whatever failed
        return f"load failed: {exc}"
    try:
        out = llm.create_chat_completion(messages=[{"role": "user", "content": "Hello, who are you?"}],
                                         max_tokens=8, temperature=0)
        choice = out["choices"][0]
        return (f"ok: {out['usage']['completion_tokens']} tokens, {choice['finish_reason']}, "
                f"{choice['message']['content']!r}")
    except Exception as exc:  # noqa: BLE001
        return f"generate failed: {type(exc).__name__}: {exc}"
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--quant", default="f16", help="f32/f16/bf16/q8_0 (converter) or a llama.cpp type (q4_0, q4_k_m)")
    ap.add_argument("--family", action="append", choices=FAMILIES, help="only these (default: all)")
    ap.add_argument("--check", action="store_true", help="load each with llama-cpp-python and generate 8 tokens")
    ap.add_argument("--notes", action="store_true", help="print what each family exercises")
    args = ap.parse_args()

    rows, failed = [], 0
    for family in args.family or FAMILIES:
        t0 = time.monotonic()
        try:
            path = make_family_model(family, args.dir, args.quant)
        except Exception as exc:  # noqa: BLE001 - one family's failure must not hide the others'
            failed += 1
            print(f"{family}: FAILED: {exc}", file=sys.stderr)
            traceback.print_exc(limit=1)
            rows.append({"family": family, "file": "-", "file type": "FAILED"})
            continue
        row = {"family": family, "file": path.name, **describe(path), "seconds": f"{time.monotonic() - t0:.1f}"}
        if args.check:
            row["check"] = check(path)
            failed += not row["check"].startswith("ok")
        rows.append(row)
        print(f"{family}: {path}", file=sys.stderr, flush=True)

    cols = ["family", "file", "file type", "head_dim", "n_head", "n_head_kv", "arch", "vocab", "seconds"]
    cols += ["check"] if args.check else []
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols).rstrip())
    if args.notes:
        print()
        for family in args.family or FAMILIES:
            print(f"{family}: {NOTES[family]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
