"""Which CPU kernels the llama.cpp engine runs, decided from the config, the CPU and the llama.cpp build.

llama.cpp's CPU backend offers "extra buffer types" for weights: CPU_REPACK (q4_0 rows interleaved for
AVX2/AVX-512/NEON gemm kernels), AMX (Intel Xeons with amx_int8, when the build carries the AMX kernels)
and KLEIDIAI (ARM). They are taken or left all together (llama_model_params.use_extra_bufts): llama.cpp
puts each weight in the first one that supports it, AMX before repack. In this llama.cpp (0.3.36) the
AMX path segfaults in the first decode (ggml-org/llama.cpp#20824), so a build that carries AMX kernels
on a CPU that has AMX runs plain kernels unless the config insists. mk/llama-wheel.sh builds without
the AMX kernels, which keeps repacking.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass
from pathlib import Path

from syshaxd.sdk.types import REPACK_SETTINGS

_AMX_ISSUE = "ggml-org/llama.cpp#20824"


@dataclass(frozen=True)
class KernelChoice:
    """What the engine runs and why, in words a user can act on."""

    use_extra_bufts: bool  # llama_model_params.use_extra_bufts
    kernels: str  # "repack", "amx+repack", "kleidiai+repack", "plain", ...
    why: str
    safe_repack: str = ""  # the repack setting of safer kernels, to restart with if these crash; "": none is safer


# the line of /proc/cpuinfo that lists an architecture's features
_FLAGS_LINE = {"x86_64": "flags", "amd64": "flags", "i686": "flags", "aarch64": "Features", "arm64": "Features",
               "armv7l": "Features"}


def cpu_flags(cpuinfo: str, machine: str = "") -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo's text ("flags" on x86, "Features" on ARM). Given the machine this
    process runs as (platform.machine()), only that architecture's line counts: under qemu-user before 8.x (Debian
    bookworm's 7.2, make test-arm) an arm64 process reads the x86 host's /proc/cpuinfo, whose AVX flags its ARM
    llama.cpp has none of."""
    wanted = (_FLAGS_LINE[machine],) if machine in _FLAGS_LINE else ("flags", "Features")
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags(path: str = "/proc/cpuinfo", machine: str | None = None) -> frozenset[str]:
    """This CPU's flags (`machine`: the architecture to read them for; this process's by default)."""
    try:
        return cpu_flags(Path(path).read_text(errors="replace"), platform.machine() if machine is None else machine)
    except OSError:
        return frozenset()


def choose(setting: str, extra_bufts: list[str] | None, flags: frozenset[str]) -> KernelChoice:
    """The kernels for a `repack` setting, given the extra buffer types this build offers on this CPU
    (None: they could not be listed)."""
    if setting not in REPACK_SETTINGS:
        raise ValueError(f"repack: must be one of {', '.join(REPACK_SETTINGS)}; got {setting!r}")
    if setting == "off":
        return KernelChoice(False, "plain", 'repack = "off" in the config')
    if extra_bufts is None:
        return KernelChoice(True, "llama.cpp's choice", "llama.cpp's buffer types could not be listed", "off")
    if not extra_bufts:
        return KernelChoice(False, "plain", "this llama.cpp build has no repacked kernels for this CPU")
    names = "+".join(b.lower().removeprefix("cpu_") for b in extra_bufts)
    amx = "AMX" in extra_bufts and "amx_int8" in flags  # offered only where the CPU has it; checked all the same
    if amx and setting == "auto":
        return KernelChoice(
            False, "plain",
            f"this llama.cpp build carries AMX kernels, which crash on this CPU ({_AMX_ISSUE}), and turning them "
            "off turns off repacking too; for repacked kernels without AMX, rebuild llama-cpp-python with "
            "mk/llama-wheel.sh (make install does)")
    why = 'repack = "on" in the config' if setting == "on" else "the fastest kernels this build has for this CPU"
    if amx:
        why += f"; AMX is known to crash in this llama.cpp ({_AMX_ISSUE})"
    return KernelChoice(True, names, why, safe_repack="off")


def _ggml_libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    return ctypes.CDLL(str(lib / "libggml.so")), ctypes.CDLL(str(lib / "libggml-base.so"))


def extra_buffer_types() -> list[str]:
    """The names of the extra buffer types llama.cpp's CPU backend offers here, in the order it tries them.

    The same query llama.cpp makes when it places weights (make_cpu_buft_list in llama-model.cpp). AMX is
    offered only when the build has its kernels and the kernel granted this process the AMX tile state.
    """
    ggml, base = _ggml_libs()
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return []
    reg = ggml.ggml_backend_dev_backend_reg(dev)
    address = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return []
    get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    array = get(dev)
    names = []
    i = 0
    while array and array[i]:
        names.append(base.ggml_backend_buft_name(array[i]).decode())
        i += 1
    return names


def tiles_decode_cheaply(flags: frozenset[str]) -> bool:
    """Whether mk/llama-wheel.sh's llama.cpp computes a decode step's tiled attention with vectors on this CPU
    (mk/patches/, 0003 and 0007: AVX-512, or AVX2 with F16C and FMA): there it costs no more than llama.cpp's
    own row-at-a-time attention (bench/bench_decode_step.py). Elsewhere (ARM) K is packed a scalar at a time, and a
    decode step would pay for what the prefix cache saves."""
    return "avx512f" in flags or {"avx2", "f16c", "fma"} <= flags


def library_build() -> str:
    """A hash of the llama.cpp libraries this process loads (llama-cpp-python's lib/, or LLAMA_CPP_LIB_PATH) and of
    the CPU's flags: another build or another CPU may give a block of KV other bits, so the prefix cache's disk
    tier keeps blocks apart by it (syshaxd/engine/prefix_disk.py)."""
    import xxhash
    from llama_cpp import llama_cpp as lib

    h = xxhash.xxh3_64()
    for path in sorted(Path(lib._base_path).glob("lib*.so*")):
        if path.is_file() and not path.is_symlink():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(" ".join(sorted(read_cpu_flags())).encode())
    return h.hexdigest()


def why_not_tiled(flags: frozenset[str], machine: str | None = None) -> str:
    """Why a decode step's attention is not tiled on this CPU, in words for the log and the status ("" where it
    is tiled cheaply)."""
    if tiles_decode_cheaply(flags):
        return ""
    machine = platform.machine() if machine is None else machine
    if _FLAGS_LINE.get(machine) == "Features":
        return (f"this {machine} CPU: syshax's patches pack a tile's K with vectors on x86 only (AVX-512, or AVX2 with "
                "F16C and FMA), and packed a scalar at a time a decode step's tiled attention costs more than it "
                "saves")
    return ("this CPU has neither AVX-512 nor AVX2 with F16C and FMA, so a decode step's tiled attention would cost "
            "more than it saves")
