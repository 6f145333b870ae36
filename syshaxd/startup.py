"""What a daemon, front or decode node, creates before its workers start, and the error that stops a start."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

from syshaxd.config import Config
from syshaxd.engine.plan import PrefixStorePlan, RingPlan
from syshaxd.engine.prefix_disk import DiskTier, model_identity
from syshaxd.sdk.kv import block_store
from syshaxd.sdk.kv.block_store import BlockStore
from syshaxd.sdk.kv.ring import KVRing, sweep_stale

log = logging.getLogger("syshaxd")


class StartupError(RuntimeError):
    """The daemon cannot start as configured; the message says what to change."""


def create_ring(plan: RingPlan) -> KVRing:
    """The plan's KV ring, created in /dev/shm after removing any that daemons killed with -9 left."""
    for stale in sweep_stale():
        log.warning("removed a KV ring left by a daemon that is gone: %s", stale)
    return KVRing.create(plan.instance, plan.size)


def create_store(plan: PrefixStorePlan) -> BlockStore:
    """The prefix cache's block store in /dev/shm, after removing any that daemons killed with -9 left."""
    for stale in block_store.sweep_stale():
        log.warning("removed a prefix cache left by a daemon that is gone: %s", stale)
    log.info("prefix cache: %d blocks of %d tokens and %d whole prompts' last chunks (%d MiB)", plan.n_slots,
             plan.block_tokens, plan.n_wide, (plan.n_slots * plan.slot_bytes + plan.n_wide * plan.wide_bytes) // 2**20)
    return BlockStore.create(plan.instance, plan.n_slots, plan.slot_bytes, plan.n_wide, plan.wide_bytes)


def create_disk_tier(cfg: Config, plan: PrefixStorePlan, store: BlockStore, model_path: Path,
                     env: Mapping[str, str]) -> DiskTier | None:
    """The prefix cache's disk tier (prefix_cache_disk_gb; None when 0), waiting for an engine to name its kernels."""
    from syshaxd.sdk.gguf.header import GGUFError, fingerprint_from_gguf

    if cfg.prefix_cache_disk_gb <= 0:
        return None
    directory = cfg.prefix_cache_dir_path(env)
    try:
        model = model_identity(model_path, fingerprint_from_gguf(model_path).to_bytes())
    except (GGUFError, OSError) as exc:
        log.warning("no prefix cache on disk: cannot identify %s (%s)", model_path.name, exc)
        return None
    return DiskTier(directory, int(cfg.prefix_cache_disk_gb * 2**30), store, model, plan.block_tokens,
                    plan.chunk_tokens)
