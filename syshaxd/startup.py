"""What a daemon, front or decode node, creates before its workers start, and the error that stops a start."""

from __future__ import annotations

import logging

from syshaxd.engine.plan import PrefixStorePlan, RingPlan
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
