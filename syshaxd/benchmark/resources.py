"""What the machine is and what the server uses while the benchmark runs: CPU per core, RSS, GPU memory.

psutil gives CPU and memory; GPU figures come from nvidia-ml-py (module pynvml)
when it is installed and a GPU answers, and are simply absent otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .stats import summarize

__all__ = ["describe_machine", "ResourceSampler", "gpu_memory_mib"]

_MIB = 1024 * 1024


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith(("model name", "hardware", "processor\t: ")) and ":" in line:
                    name = line.split(":", 1)[1].strip()
                    if name and not name.isdigit():
                        return name
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _os_name() -> str:
    try:
        with open("/etc/os-release", encoding="utf-8") as release:
            for line in release:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def _nvml():
    """The pynvml module, initialised, or None when it is missing or no NVIDIA driver answers."""
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml raises its own NVMLError family; any failure means "no GPU figures"
        return None
    return pynvml


def _gpus() -> list[dict]:
    nvml = _nvml()
    if nvml is None:
        return []
    gpus = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({
                "index": index,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "memory_total_mib": round(memory.total / _MIB, 1),
            })
        driver = nvml.nvmlSystemGetDriverVersion()
        for gpu in gpus:
            gpu["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:
        pass
    return gpus


def gpu_memory_mib() -> list[float] | None:
    """Memory in use on each NVIDIA GPU, or None when none can be read."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return [
            round(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).used / _MIB, 1)
            for i in range(nvml.nvmlDeviceGetCount())
        ]
    except Exception:
        return None


def describe_machine() -> dict:
    """The machine the benchmark ran on: CPU model, cores, memory, OS, Python, GPUs."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        import llama_cpp

        llama_version = getattr(llama_cpp, "__version__", None)
    except ImportError:
        llama_version = None
    from .. import __version__ as syshax_version

    return {
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "cpu_cores_logical": psutil.cpu_count(logical=True),
        "cpu_cores_usable": affinity,
        "memory_total_gib": round(psutil.virtual_memory().total / (1024**3), 1),
        "os": _os_name(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "gpus": _gpus(),
        "syshax": syshax_version,
        "llama_cpp_python": llama_version,
    }


@dataclass
class _Samples:
    cpu_per_core: list[list[float]] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    other_cpu: list[float] = field(default_factory=list)
    daemon_rss: list[float] = field(default_factory=list)
    workers_rss: list[float] = field(default_factory=list)
    workers_count: list[int] = field(default_factory=list)
    gpu_used: list[list[float]] = field(default_factory=list)


class ResourceSampler:
    """Samples CPU and memory in a background thread between start() and stop().

    server_pid is the server's main process (the daemon); its descendants are its
    workers. Without one, only the machine-wide and the client's own figures are kept.
    """

    def __init__(self, server_pid: int | None = None, interval_s: float = 0.5):
        self.server_pid = server_pid
        self.interval_s = interval_s
        self._samples = _Samples()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = psutil.Process()
        self._tracked: dict[int, psutil.Process] = {}
        self._gpu = _nvml() is not None

    def _server_processes(self) -> tuple[psutil.Process | None, list[psutil.Process]]:
        if self.server_pid is None:
            return None, []
        try:
            root = self._tracked.get(self.server_pid) or psutil.Process(self.server_pid)
            self._tracked[self.server_pid] = root
            children = root.children(recursive=True)
        except psutil.Error:
            return None, []
        # Keep the same Process objects between samples: cpu_percent measures since the previous call.
        kept = []
        for child in children:
            kept.append(self._tracked.setdefault(child.pid, child))
        return root, kept

    def _sample(self, first: bool) -> None:
        per_core = psutil.cpu_percent(percpu=True)
        client_cpu = self._client.cpu_percent()
        root, workers = self._server_processes()
        server_cpu = 0.0
        daemon_rss = None
        workers_rss = 0.0
        for proc in ([root] if root else []) + workers:
            try:
                server_cpu += proc.cpu_percent()
                rss = proc.memory_info().rss / _MIB
            except psutil.Error:
                continue
            if proc is root:
                daemon_rss = rss
            else:
                workers_rss += rss
        if first:
            return  # cpu_percent's first call has nothing to compare with
        s = self._samples
        s.cpu_per_core.append(per_core)
        s.client_cpu.append(client_cpu)
        if root is not None:
            s.server_cpu.append(server_cpu)
            # What neither the server nor this client used: other load on the host, which the
            # figures then also measure (per-core % summed, so 100 is one busy core).
            s.other_cpu.append(max(0.0, sum(per_core) - server_cpu - client_cpu))
            if daemon_rss is not None:
                s.daemon_rss.append(daemon_rss)
            s.workers_rss.append(workers_rss)
            s.workers_count.append(len(workers))
        if self._gpu:
            used = gpu_memory_mib()
            if used is not None:
                s.gpu_used.append(used)

    def _loop(self) -> None:
        self._sample(first=True)
        while not self._stop.wait(self.interval_s):
            self._sample(first=False)

    def start(self) -> "ResourceSampler":
        self._thread = threading.Thread(target=self._loop, name="syshax-bench-resources", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling and summarise: CPU % per core (mean), client and server CPU %, RSS in MiB, GPU MiB."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self._samples.cpu_per_core:
            self._sample(first=False)  # a level shorter than one interval still gets one sample
        s = self._samples
        cores = len(s.cpu_per_core[0]) if s.cpu_per_core else 0
        per_core_mean = [
            round(sum(sample[i] for sample in s.cpu_per_core) / len(s.cpu_per_core), 1) for i in range(cores)
        ]
        totals = [sum(sample) / max(1, len(sample)) for sample in s.cpu_per_core]
        summary = {
            "samples": len(s.cpu_per_core),
            "interval_s": self.interval_s,
            "cpu_percent_per_core_mean": per_core_mean,
            "cpu_percent_total": _brief(totals),
            "client_cpu_percent": _brief(s.client_cpu),
            "server_pid": self.server_pid,
            "server_cpu_percent": _brief(s.server_cpu) if s.server_cpu else None,
            "other_cpu_percent": _brief(s.other_cpu) if s.other_cpu else None,
            "daemon_rss_mib": _brief(s.daemon_rss) if s.daemon_rss else None,
            "workers_rss_mib": _brief(s.workers_rss) if s.workers_rss else None,
            "workers": max(s.workers_count) if s.workers_count else None,
            "gpu_memory_used_mib_max": (
                [max(sample[i] for sample in s.gpu_used) for i in range(len(s.gpu_used[0]))] if s.gpu_used else None
            ),
        }
        return summary


def _brief(values: list[float]) -> dict:
    figures = summarize(values)
    return {"mean": _round(figures["mean"]), "max": _round(figures["max"])}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def save_figures(path: str | Path, started: str, args, rows) -> tuple[float, float, float]:
    """A bench's figures with its arguments, the machine, and the load average at the end (how busy the host was,
    which decides whether the ratios mean anything); returns that load average."""
    load = os.getloadavg()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"started": started, "args": vars(args), "machine": describe_machine(),
                                "load_average_end": load, "rows": rows}, indent=1, default=str))
    return load
