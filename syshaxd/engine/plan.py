"""Which engine workers a configuration asks for, and where each one runs."""

from __future__ import annotations

from pathlib import Path

from syshaxd.config import Config
from syshaxd.engine.types import EngineSpec
from syshaxd.numa import ENV_CPU_AFFINITY, ENV_THREADS, PlacementError, plan_cpu_workers, read_host_topology


class PlanError(RuntimeError):
    """The configuration asks for workers this host cannot run; the message says what to change."""


def worker_specs(cfg: Config, model_path: Path, model_name: str, env: dict) -> list[EngineSpec]:
    if cfg.mode != "cpu":
        raise PlanError(
            f"mode {cfg.mode!r} is not available in this build yet: only 'cpu' serves today "
            "(hetero, gpu and auto arrive with the KV ring and GPU engines); start with --mode cpu"
        )
    # the environment overrides the config file, as the seed's CUSTOM_CPU_AFFINITY did
    overrides = {}
    if env.get(ENV_CPU_AFFINITY) or cfg.cpu_affinity:
        overrides[ENV_CPU_AFFINITY] = env.get(ENV_CPU_AFFINITY) or cfg.cpu_affinity
    if env.get(ENV_THREADS) or cfg.threads:
        overrides[ENV_THREADS] = env.get(ENV_THREADS) or str(cfg.threads)
    try:
        placements = plan_cpu_workers(read_host_topology(), overrides, role="generate")
    except PlacementError as exc:
        raise PlanError(str(exc)) from None
    return [
        EngineSpec(
            backend="llamacpp", role="generate", model_path=str(model_path), model_name=model_name,
            n_ctx=cfg.n_ctx, max_batch_size=cfg.cpu_max_batch_size, threads=p.threads,
            prefill_chunk_size=cfg.prefill_chunk_size, placement=p, quantize=cfg.quantize,
            cache_dir=str(cfg.model_dir_path()),
        )
        for p in placements
    ]
