"""Reads each [[models]] entry's GGUF at start and plans it as what its header says it is: an embedding model or a
reranker (a pooling type, or a cross-encoder's classifier: engine/embedders.py) or a chat model (neither:
engine/chat_models.py); ModelsError names an entry that cannot be served, so the daemon does not start with it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import psutil

from syshaxd.config import Config
from syshaxd.engine.chat_models import ChatModel, plan_chat
from syshaxd.engine.embedders import EmbeddingModel, file_pooling, plan_embedding
from syshaxd.engine.entry_models import EntryModel, EntryModels, ModelsError
from syshaxd.engine.numa import Topology, read_host_topology
from syshaxd.model_entries import EntryError, ModelEntry, folder_entries
from syshaxd.sdk.gguf.header import GGUFError, fingerprint_from_gguf, read_gguf_header
from syshaxd.sdk.placement import format_cpulist, parse_cpulist

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
    if cfg.max_loaded_models == 1:
        raise ModelsError("max_loaded_models = 1 leaves no room for the models of [[models]]: it counts the daemon's "
                          "own model, which is always loaded; set 2 or more (2: one entry at a time), or 0 (no bound)")
    topology = read_host_topology()
    for i, entry in enumerate(entries):
        where = f"models[{i}] ({entry.name})" if i < len(cfg.models) else f"models_dir ({entry.path})"
        try:
            models.append(_plan_one(cfg, entry, where, chat_model, topology, env))
        except ModelsError as exc:
            if i < len(cfg.models):
                raise
            # a file of the folder that cannot serve (an unknown pooling type, one still downloading) is left out, as
            # llama-server's router leaves it; an entry written by hand stops the start
            log.warning("%s; not served", exc)
    _check_memory(models, cfg.max_loaded_models, cfg, chat_model_path, strict=not cfg.models_dir)
    _warn_shared_cpus(cfg.models, cfg.cpu_affinity)
    return EntryModels(models, cfg.max_loaded_models)


def _plan_one(cfg: Config, entry: ModelEntry, where: str, chat_model: str, topology: Topology,
              env: Mapping[str, str]) -> EntryModel:
    """One entry, read and planned as what its header says it is; ModelsError names what cannot serve."""
    if entry.name == chat_model:
        raise ModelsError(f"{where}: the daemon's own model is served as {chat_model!r}; give this entry "
                          "another name")
    path = Path(entry.path).expanduser().absolute()
    if not path.is_file():
        raise ModelsError(f"{where}: {path} does not exist; set path to a GGUF file")
    try:
        meta, tensors = read_gguf_header(path)
    except (GGUFError, OSError) as exc:
        raise ModelsError(f"{where}: {path} is not a GGUF file llama.cpp reads ({exc})") from None
    if file_pooling(meta, tensors, path, where) == 0:  # no pooling, no reranker's classifier: it generates text
        _check_cpus(entry.cpu_affinity, topology.cpus, where)
        return plan_chat(cfg, entry, where, path, env)
    return plan_embedding(entry, where, path, meta, tensors, cfg.cpu_engine, cfg.repack, topology)


def _check_cpus(affinity: str, allowed: frozenset[int], where: str) -> None:
    """ModelsError when a chat entry's cpu_affinity names CPUs this daemon may not use (its daemon would fail to
    place its workers at its first load, long after the start)."""
    for part in affinity.split(";") if affinity else ():
        missing = sorted(parse_cpulist(part, what=f"{where}.cpu_affinity") - allowed)
        if missing:
            raise ModelsError(f"{where}.cpu_affinity: CPUs {format_cpulist(missing)} are not this daemon's to use "
                              f"(it may use {format_cpulist(sorted(allowed))}); name CPUs among those")


def _warn_shared_cpus(entries, own: str) -> None:
    """A warning for models given the same CPUs by hand: they are placed as asked, and take turns when both busy."""
    sets = [("the daemon's own model", own)] + [(e.name, e.cpu_affinity) for e in entries]
    cpus = [(name, set().union(*(parse_cpulist(p) for p in affinity.split(";")))) for name, affinity in sets
            if affinity]
    for i, (a, first) in enumerate(cpus):
        for b, second in cpus[i + 1:]:
            if first & second:
                log.warning("models: %s and %s share CPUs %s by their cpu_affinity; when both are busy they take "
                            "turns on them", a, b, format_cpulist(sorted(first & second)))


def kv_bytes_per_token(path: Path) -> int:
    """The KV cache one token takes in F16 (K and V of every layer), from the GGUF's header; 0 when it says none."""
    try:
        f = fingerprint_from_gguf(path)
    except (GGUFError, OSError):
        return 0
    return 2 * f.n_layer * f.n_head_kv * f.head_dim * 2


def _need(path: Path, tokens: int) -> tuple[int, int]:
    """(file bytes, KV bytes for `tokens`) of a model."""
    return path.stat().st_size, kv_bytes_per_token(path) * tokens


def _check_memory(models: list[EntryModel], max_loaded: int, cfg: Config, chat_model_path: Path,
                  strict: bool = True) -> None:
    """ModelsError when the entries that may be loaded at once (the biggest that fit under max_loaded_models, or
    all) and the daemon's own model need more than this machine's memory: each its file and its KV cache (n_ctx
    tokens for each of its sequences). A plan that can only end in swapping or the OOM killer is refused at start,
    naming them."""
    def tokens(model: EntryModel) -> int:
        if isinstance(model, ChatModel):
            return int(model.config["n_ctx"]) * int(model.config["cpu_max_batch_size"])
        return model.spec.n_ctx if isinstance(model, EmbeddingModel) else 0

    needs = {m.name: _need(m.path, tokens(m)) for m in models}
    biggest = sorted(models, key=lambda m: sum(needs[m.name]), reverse=True)[:max_loaded - 1 if max_loaded else None]
    own = _need(chat_model_path, cfg.n_ctx * cfg.cpu_max_batch_size)
    need = sum(sum(needs[m.name]) for m in biggest) + sum(own)
    total = psutil.virtual_memory().total
    if need > total and not strict:  # a folder's files, unbounded: the operator learns it now, not from the OOM killer
        log.warning("models: the %d models that may be loaded at once need %d MiB, more than this machine's %d MiB; "
                    "set max_loaded_models", len(biggest) + 1, need >> 20, total >> 20)
    elif need > total:
        names = ", ".join(f"{m.name} ({needs[m.name][0] >> 20} MiB file, {needs[m.name][1] >> 20} MiB KV)"
                          for m in biggest)
        raise ModelsError(f"models: the models loaded at once ({names}, and the daemon's own model: {own[0] >> 20} "
                          f"MiB file, {own[1] >> 20} MiB KV) need {need >> 20} MiB, more than this machine's "
                          f"{total >> 20} MiB of memory; lower max_loaded_models, an entry's n_ctx or batch_slots, "
                          "or remove an entry")
    log.info("models: %d entries; at most %s loaded at once, needing %d MiB with the daemon's own model (files and "
             "KV caches)", len(models), max_loaded or "all", need >> 20)
