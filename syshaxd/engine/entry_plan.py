"""Reads each [[models]] entry's GGUF at start and plans it as what its header says it is: an embedding model (a
pooling type: engine/embedders.py) or a chat model (none: engine/chat_models.py); ModelsError names an entry that
cannot be served, so the daemon does not start with it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import psutil

from syshaxd.config import Config
from syshaxd.engine.chat_models import plan_chat
from syshaxd.engine.embedders import plan_embedding
from syshaxd.engine.entry_models import EntryModel, EntryModels, ModelsError
from syshaxd.engine.numa import read_host_topology
from syshaxd.model_entries import EntryError, folder_entries
from syshaxd.sdk.gguf.header import GGUFError, read_gguf_header

log = logging.getLogger(__name__)


def plan_entries(cfg: Config, chat_model: str, chat_model_path: Path, env: Mapping[str, str]) -> EntryModels:
    """The entries of cfg.models, each read and planned, under max_loaded_models."""
    models: list[EntryModel] = []
    entries = cfg.models
    if cfg.models_dir:
        try:
            found = folder_entries(Path(cfg.models_dir).expanduser(), entries, chat_model_path, chat_model)
        except EntryError as exc:
            raise ModelsError(str(exc)) from None
        log.info("models_dir %s: %d GGUF files served by name, loaded on demand: %s", cfg.models_dir, len(found),
                 ", ".join(e.name for e in found) or "none")
        entries += found
    if not entries:
        return EntryModels(models, cfg.max_loaded_models)
    topology = read_host_topology()
    for i, entry in enumerate(entries):
        where = f"models[{i}] ({entry.name})" if i < len(cfg.models) else f"models_dir ({entry.path})"
        if entry.name == chat_model:
            raise ModelsError(f"{where}: the daemon's own model is served as {chat_model!r}; give this entry "
                              "another name")
        path = Path(entry.path).expanduser().absolute()
        if not path.is_file():
            raise ModelsError(f"{where}: {path} does not exist; set path to a GGUF file")
        try:
            meta, _ = read_gguf_header(path)
        except (GGUFError, OSError) as exc:
            raise ModelsError(f"{where}: {path} is not a GGUF file llama.cpp reads ({exc})") from None
        arch = str(meta.get("general.architecture", ""))
        if int(meta.get(f"{arch}.pooling_type", 0) or 0) == 0:  # no pooling: a model that generates text
            models.append(plan_chat(cfg, entry, where, path, env))
        else:
            models.append(plan_embedding(entry, where, path, meta, cfg.cpu_engine, cfg.repack, topology))
    _check_memory(models, cfg.max_loaded_models, chat_model_path)
    return EntryModels(models, cfg.max_loaded_models)


def _check_memory(models: list[EntryModel], max_loaded: int, chat_model_path: Path) -> None:
    """ModelsError when the largest files that may be loaded at once (max_loaded_models of them, or all) and the
    daemon's own model cannot fit in this machine's memory even before their KV caches: a plan that can only
    end in swapping or the OOM killer is refused at start, naming the models."""
    biggest = sorted(models, key=lambda m: m.path.stat().st_size, reverse=True)[:max_loaded or None]
    need = sum(m.path.stat().st_size for m in biggest) + chat_model_path.stat().st_size
    total = psutil.virtual_memory().total
    if need > total:
        names = ", ".join(f"{m.name} ({m.path.stat().st_size >> 20} MiB)" for m in biggest)
        raise ModelsError(f"models: the files loaded at once ({names}, and the daemon's own model, "
                          f"{chat_model_path.stat().st_size >> 20} MiB) need {need >> 20} MiB, more than this "
                          f"machine's {total >> 20} MiB of memory; lower max_loaded_models or remove an entry")
    log.info("models: %d entries; at most %s loaded at once, their files %d MiB with the daemon's own model",
             len(models), max_loaded or "all", need >> 20)
