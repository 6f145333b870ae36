"""The `[[models]]` tables of the config: models served beside the daemon's chat model (the `model` key), by name.

An entry is an embedding model (a GGUF with a pooling type), served by POST /v1/embeddings (engine/embedders.py),
a reranker (pooling "rank", or a cross-encoder's one-output classifier), served by POST /v1/rerank, or a chat model, served by a syshaxd of its own that this daemon starts and forwards to (engine/chat_models.py); the
daemon reads the file's header at start to know which. Every key of an entry is checked here, and one this daemon
does not know is refused by name, never ignored.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

LOADS = ("start", "on_demand")


class EntryError(ValueError):
    """A [[models]] entry is wrong; the message names the entry and its key."""


@dataclass(frozen=True)
class ModelEntry:
    """One [[models]] table."""

    name: str  # what clients send as "model"
    path: str  # the GGUF file
    n_ctx: int = 0  # tokens one input may hold; 0: the model's training context, at most 2048
    threads: int = 0  # 0: one per CPU of cpu_affinity (or of the daemon's CPUs)
    cpu_affinity: str = ""  # a cpulist; "": the CPUs the daemon may use, shared with the chat model's workers
    load: str = "start"  # "start": loaded with the daemon; "on_demand": at its first request
    keep_alive: float = -1.0  # seconds idle before it is unloaded (its next request loads it again); -1: never
    # a chat model's own keys; empty or 0: the daemon's (mode, quantize, draft_model, cpu_max_batch_size)
    mode: str = ""
    quantize: str = ""
    draft_model: str = ""
    batch_slots: int = 0


_DOCS = {"name": 'the id clients send as "model"', "path": "the GGUF file",
         "n_ctx": "an embedding model: tokens one input may hold (0: its training context, at most 2048); a chat "
                  "model: tokens a request may hold (0: the daemon's n_ctx)",
         "threads": "threads of each of its workers (0: one per CPU of its set)",
         "cpu_affinity": 'its workers\' CPUs as a cpulist (a chat model: sets separated by ";", one worker each)',
         "load": '"start" or "on_demand"',
         "keep_alive": 'seconds idle before it is unloaded, or "5m", "1h" (-1: never)',
         "mode": 'a chat model: "cpu", "gpu", "hetero" or "auto" ("": the daemon\'s mode)',
         "quantize": 'a chat model: the type an unquantized file is quantized to ("": the daemon\'s quantize)',
         "draft_model": "a chat model: its draft model's GGUF (\"\": the daemon's draft_model)",
         "batch_slots": "a chat model: sequences a CPU worker decodes together (0: cpu_max_batch_size)"}
ENTRY_KEYS = tuple(f.name for f in fields(ModelEntry))
CHAT_ONLY_KEYS = ("mode", "quantize", "draft_model", "batch_slots")


def parse_models(value: Any) -> tuple[ModelEntry, ...]:
    """The entries of `models` (an array of tables); EntryError names what is wrong where."""
    if isinstance(value, tuple) and all(isinstance(e, ModelEntry) for e in value):
        return value  # parsed already (Config.replace)
    if not isinstance(value, (list, tuple)) or not all(isinstance(e, dict) for e in value):
        raise EntryError("models: expected [[models]] tables, each with a name and a path, e.g.\n"
                         '[[models]]\nname = "embed"\npath = "/var/lib/syshax/models/qwen3-embedding-0.6b-q8_0.gguf"')
    entries = tuple(_entry(i, table) for i, table in enumerate(value))
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EntryError(f"models: the name {twice[0]!r} is given to more than one entry; each model needs its own")
    return entries


def _entry(i: int, table: dict) -> ModelEntry:
    where = f"models[{i}]"
    unknown = sorted(set(table) - set(ENTRY_KEYS))
    if unknown:
        raise EntryError(f"{where}: unknown key(s) {', '.join(unknown)}; an entry takes "
                         + "; ".join(f"{k}: {d}" for k, d in _DOCS.items()))
    for required in ("name", "path"):
        if not isinstance(table.get(required), str) or not table.get(required):
            raise EntryError(f"{where}: {required} is required, a string: {_DOCS[required]}")
    defaults = ModelEntry(name="", path="")
    values: dict[str, Any] = {}
    for f in fields(ModelEntry):
        value = table.get(f.name, getattr(defaults, f.name))
        kind = type(getattr(defaults, f.name))
        if f.name == "keep_alive":
            values[f.name] = seconds(value, f"{where}.keep_alive")
            continue
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise EntryError(f"{where}.{f.name}: expected an integer, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise EntryError(f"{where}.{f.name}: expected a string, got {value!r}")
        values[f.name] = value
    entry = ModelEntry(**values)
    name = f"{where} ({entry.name})"
    if entry.n_ctx < 0 or entry.threads < 0 or entry.batch_slots < 0:
        raise EntryError(f"{name}: n_ctx, threads and batch_slots must be 0 or more")
    if entry.mode and entry.mode not in ("cpu", "gpu", "hetero", "auto"):
        raise EntryError(f'{name}.mode: must be "cpu", "gpu", "hetero" or "auto" (or left out: the daemon\'s mode); '
                         f"got {entry.mode!r}")
    if entry.load not in LOADS:
        raise EntryError(f'{name}.load: must be "start" (loaded with the daemon) or "on_demand" (at its first '
                         f"request); got {entry.load!r}")
    if entry.cpu_affinity:
        from syshaxd.sdk.placement import parse_cpulist

        try:
            for part in entry.cpu_affinity.split(";"):
                parse_cpulist(part, what=f"{name}.cpu_affinity")
        except ValueError as exc:
            raise EntryError(str(exc)) from None
    return entry


_UNITS = {"s": 1, "m": 60, "h": 3600}


def seconds(value: Any, where: str) -> float:
    """keep_alive as Ollama writes it: seconds as a number, or "30s", "5m", "1h"; -1 (or any negative): never."""
    if isinstance(value, str) and value[-1:] in _UNITS:
        try:
            return max(-1.0, float(value[:-1]) * _UNITS[value[-1]])
        except ValueError:
            pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return max(-1.0, float(value))
    raise EntryError(f'{where}: expected seconds (a number, or a string such as "30s", "5m", "1h"; -1: never), '
                     f"got {value!r}")


def folder_entries(folder: Path, own: tuple[ModelEntry, ...], served: Path,
                   served_name: str) -> tuple[ModelEntry, ...]:
    """An entry for each GGUF of `folder` (models_dir), named by its file name, loaded on demand; not the file the
    daemon serves itself (`served`, as `served_name`), nor one an entry of `own` names, nor what is no model of its
    own: a quantized copy the daemon cached beside its source (NAME.q4_0.gguf beside NAME.gguf), a vision projector
    (mmproj), the later parts of a split file."""
    if not folder.is_dir():
        raise EntryError(f"models_dir: {folder} is not a folder; set it to the folder of your GGUF files")
    taken = {e.name for e in own} | {served_name}
    files = sorted(folder.glob("*.gguf"))
    sources = {p.name for p in files}
    out = []
    for path in files:
        stem = path.name[:-len(".gguf")]
        copy = re.fullmatch(r"(.+)\.(q4_0|q8_0)", stem)
        part = re.search(r"-(\d{5})-of-\d{5}$", stem)
        if (copy and f"{copy.group(1)}.gguf" in sources) or stem.lower().startswith("mmproj") \
                or (part and int(part.group(1)) > 1):
            continue
        if path.resolve() == served.resolve() or stem in taken:
            continue
        out.append(ModelEntry(name=stem, path=str(path), load="on_demand"))
    return tuple(out)


def models_to_json(entries: tuple[ModelEntry, ...]) -> list[dict]:
    """The entries as the tables they came from, keys at their defaults left out (TOML, JSON, the admin socket)."""
    defaults = asdict(ModelEntry(name="", path=""))
    return [{k: v for k, v in asdict(e).items() if k in ("name", "path") or v != defaults[k]} for e in entries]
