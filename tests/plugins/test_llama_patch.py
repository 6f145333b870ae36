"""mk/patches/: the llama.cpp patch series mk/llama-wheel.sh applies (mk/llama-patches.sh) before it builds.

The series applies to the pristine source of the llama-cpp-python sdist, each patch exactly where it was written, and
each touches only the files and functions it says. It makes, byte for byte, the source the Python script it replaced
made (mk/llama-patch.py, string replacements with exact-count guards, removed when the series came).

The wheel this machine built carries one vector path of the K packing (0003) and of a few rows' products (0007):
AVX-512 here, AVX2 on another host; the engine's warm-up proves its bits on that path only. This compiles each, as
the patches add it, on its own for every x86 path this CPU can run, and checks it bit for bit against what
llama.cpp's own loops compute, at every tile size. 0001 lives in llama.cpp's weight kernels, which need all of ggml to
compile, and so do 0008 to 0012: the real build is checked instead, a row's logits against the same row's in
batches of other sizes (each size takes another kernel), and the repacked weights' greedy tokens against llama.cpp's
own q4_0 kernels'.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import model_in

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "mk" / "patches"
SERIES = sorted(PATCHES.glob("[0-9][0-9][0-9][0-9]-*.patch"))
VERSION = re.search(r"^VERSION=(\S+)$", (REPO / "mk" / "llama-wheel.sh").read_text(), re.M).group(1)
OPS = "ggml/src/ggml-cpu/ops.cpp"
REPACK = "ggml/src/ggml-cpu/arch/x86/repack.cpp"
REPACK_CORE = "ggml/src/ggml-cpu/repack.cpp"
SGEMM = "ggml/src/ggml-cpu/llamafile/sgemm.cpp"
FILES = (OPS, REPACK, REPACK_CORE, SGEMM)

# What each patch touches: its files, and in each the functions its hunks change or add ("(file head)": the lines
# before the first function). A patch that spills into another function or file fails here.
TOUCHES = {
    "0001": {REPACK: {"gemm_q4_b32_8x8_q8_0_lut_avx"}},
    "0002": {OPS: {"ggml_compute_forward_flash_attn_ext_tiled"}},
    "0003": {OPS: {"syshax_transpose16", "syshax_transpose8", "syshax_pack_k",
                   "ggml_compute_forward_flash_attn_ext_tiled"}},
    "0004": {OPS: {"ggml_compute_forward_flash_attn_ext_f16"}},
    "0005": {OPS: {"(file head)", "ggml_compute_forward_flash_attn_ext_f16"}},
    "0006": {OPS: {"ggml_compute_forward_flash_attn_ext_tiled", "ggml_compute_forward_flash_attn_ext_f16"}},
    "0007": {OPS: {"syshax_few", "syshax_prefetch_rows", "syshax_few_qk_rows", "syshax_few_v_rows", "syshax_few_qk",
                   "syshax_few_v", "ggml_compute_forward_flash_attn_ext_tiled"}},
    # REPACK_CORE's hunks lie in the class template tensor_traits, whose line git's hunk headers name has no "("
    "0008": {REPACK: {"syshax_gemv_rows", "gemv_q4_b32_8x8_q8_0_lut_avx"}, REPACK_CORE: {"(file head)"}},
    "0009": {SGEMM: {"syshax_half", "syshax_q8_0_rows", "syshax_q8_0_few_rows", "llamafile_sgemm"}},
    "0010": {REPACK: {"(file head)", "syshax_gemv_rows"}},  # the head: #include <vector>
    "0011": {SGEMM: {"(file head)", "syshax_dpbusd", "syshax_q8_0_rows", "syshax_q8_0_few_rows"}},  # ditto
    "0012": {REPACK: {"gemm_q4_b32_8x8_q8_0_lut_avx"}},
    "0013": {REPACK: {"ggml_gemv_q4_K_8x8_q8_K"}},
    "0014": {SGEMM: {"llamafile_sgemm"}},
    "0015": {SGEMM: {"syshax_hsum_float_8", "syshax_q6_K_rows", "syshax_q6_K_many_rows", "llamafile_sgemm"}},
    "0016": {SGEMM: {"llamafile_sgemm"}},
}
# the patches that replaced mk/llama-patch.py: what they make is what it made
SCRIPT_SERIES = ("0001", "0002", "0003", "0004", "0005", "0006", "0007")

# The sdist the series was written for, and the patched files mk/llama-patch.py made of it (its last version, before
# 0001 to 0007 replaced it: they were checked against it, the whole sdist tree compared, on 2026-12-05)
SDIST_SHA256 = {"0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
PATCHED_SHA256 = {"0.3.36": {OPS: "b9a56e1ee80e0bed0e449accdef71a09954f8cf92dc0291662d06c1e4c664352",
                             REPACK: "7282876a136b9ac3d490b27da793de1081e274c2237a5609bcd640dfbb237338"}}


def _hunks(patch: Path) -> list[tuple[str, str, list[str]]]:
    """(file, the function git names in the hunk's header, the hunk's lines) for every hunk of a patch."""
    hunks, file = [], None
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git "):
            file = line.split(" b/", 1)[1]
        elif line.startswith("@@ ") and file is not None:
            header = line.split("@@", 2)[2]
            function = re.search(r"(\w+)\(", header)
            hunks.append((file, function.group(1) if function else "(file head)", []))
        elif hunks and line[:1] in (" ", "+", "-"):
            hunks[-1][2].append(line)
        elif line == "-- ":  # format-patch's signature separator, if any
            break
    return hunks


def _defined(lines: list[str]) -> set[str]:
    """The functions a hunk's added lines define."""
    return {m.group(1) for line in lines if (m := re.match(r"\+static\b[^(=;]*?\b(\w+)\(", line))}


def _added_code(number: str, function: str) -> str:
    """The code the patch numbered `number` adds in the hunk that defines `function`, as it adds it."""
    patch = next(p for p in SERIES if p.name.startswith(number + "-"))
    for _, _, lines in _hunks(patch):
        if function in _defined(lines):
            return "\n".join(line[1:] for line in lines if line.startswith("+")) + "\n"
    raise AssertionError(f"{patch.name} defines no {function}")


def test_the_series_is_numbered_and_each_patch_touches_what_it_says():
    assert [p.name[:4] for p in SERIES] == sorted(TOUCHES), [p.name for p in SERIES]
    for patch in SERIES:
        touched: dict[str, set[str]] = {}
        for file, function, lines in _hunks(patch):
            # a hunk that adds functions touches those (git's header names the function above them), another the
            # function it is in
            touched.setdefault(file, set()).update(_defined(lines) or {function})
        assert touched == TOUCHES[patch.name[:4]], patch.name
        head = patch.read_text().split("\n---\n", 1)[0]
        assert re.search(r"^Subject: \[PATCH\] ggml-cpu: ", head, re.M), f"{patch.name}: no ggml-cpu: subject"
        assert len(head.split("\n\n", 1)[1].strip().splitlines()) >= 3, f"{patch.name}: says not why"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The files the series touches, as the llama-cpp-python sdist holds them (llama.cpp's layout): from
    $SYSHAX_LLAMA_SDIST, or pip download (pip's cache, as mk/llama-source.sh)."""
    where = tmp_path_factory.mktemp("sdist")
    sdist = os.environ.get("SYSHAX_LLAMA_SDIST")
    if not sdist:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              "-d", str(where), f"llama-cpp-python=={VERSION}"], capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"no llama-cpp-python {VERSION} sdist (pip download: {got.stderr.strip()[-300:]}); "
                        "set SYSHAX_LLAMA_SDIST")
        sdist = where / f"llama_cpp_python-{VERSION}.tar.gz"
    if VERSION in SDIST_SHA256:
        assert hashlib.sha256(Path(sdist).read_bytes()).hexdigest() == SDIST_SHA256[VERSION], f"{sdist} is not pristine"
    tree = where / "llama.cpp"
    top = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.name.startswith(top) and member.name[len(top):] in FILES:
                tar.extract(member, where, filter="data")
    (where / top).rename(tree)
    assert all((tree / file).is_file() for file in FILES)
    return tree


def _apply(tree: Path, patches: Path = PATCHES) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "mk" / "llama-patches.sh"), str(tree), str(patches)], capture_output=True,
                          text=True)


def test_the_series_applies_to_the_pristine_source_and_makes_what_llama_patch_py_made(pristine, tmp_path):
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine, tree)
    run = _apply(tree)
    assert run.returncode == 0, run.stderr
    if VERSION not in PATCHED_SHA256:
        pytest.skip(f"no record of what mk/llama-patch.py made of {VERSION} (it never patched that version)")
    # the script's part of the series, on its own
    first = tmp_path / "first"
    first.mkdir()
    for patch in SERIES:
        if patch.name[:4] in SCRIPT_SERIES:
            shutil.copy(patch, first)
    shutil.rmtree(tree)
    shutil.copytree(pristine, tree)
    run = _apply(tree, first)
    assert run.returncode == 0, run.stderr
    for file, want in PATCHED_SHA256[VERSION].items():
        assert hashlib.sha256((tree / file).read_bytes()).hexdigest() == want, file


def test_a_patch_that_does_not_apply_exactly_is_refused_and_named(pristine, tmp_path):
    """Where a patch's text is not found, or found some lines away from where it was written, the series stops
    there and names the patch."""
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine, tree)
    ops = tree / OPS
    ops.write_text(ops.read_text().replace("use_split_kv_path = !use_ref", "use_split_kv_path = !use_reference"))
    run = _apply(tree)
    assert run.returncode == 1 and "0004-" in run.stderr and "does not apply cleanly" in run.stderr, run.stderr
    shutil.rmtree(tree)
    shutil.copytree(pristine, tree)
    repack = tree / REPACK
    repack.write_text("// one line more\n" + repack.read_text())  # every hunk of 0001 would land one line down
    run = _apply(tree)
    assert run.returncode == 1 and "0001-" in run.stderr and "offset 1 line" in run.stderr, run.stderr
    assert (tree / REPACK).read_text().startswith("// one line more\n")
    assert "syshax_rb" not in (tree / REPACK).read_text()  # nothing of it applied


HARNESS = r"""
#include <initializer_list>
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
typedef uint16_t ggml_fp16_t;
enum ggml_type { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1 };
#define GGML_UNUSED(x) (void)(x)
#include "pack.inc"
int main() {
    const int DK = 64, KV = 64;
    int bad = 0;
    for (int type = 0; type < 2; type++)
    for (int kv_tile : {64, 1, 7, 16, 17, 33, 63}) {
        const size_t nbk1 = 3 * DK * (type ? 2 : 4) + 64;  // rows apart as in a KV cache of 3 heads, and more
        char * base = (char *) malloc(nbk1 * 64);
        for (size_t i = 0; i < nbk1 * 64 / 2; i++) ((uint16_t *) base)[i] = (uint16_t) (rand() & 0x7bff);
        float got[DK * KV], want[DK * KV];
        for (int i = 0; i < DK * KV; i++) got[i] = want[i] = -7.0f;
        if (!syshax_pack_k(base, nbk1, kv_tile, DK, (ggml_type) type, got, KV)) {
            printf("no vector path\n");
            return 2;
        }
        for (int tk = 0; tk < kv_tile; tk++)  // llama.cpp's own loop
            for (int dk = 0; dk < DK; dk++)
                want[dk * KV + tk] = type ? _cvtsh_ss(((ggml_fp16_t *)(base + tk * nbk1))[dk])
                                          : ((float *)(base + tk * nbk1))[dk];
        for (int tk = 0; tk < kv_tile; tk++)
            for (int dk = 0; dk < DK; dk++)
                bad += memcmp(&got[dk * KV + tk], &want[dk * KV + tk], 4) != 0;
        free(base);
    }
    printf("%d mismatches\n", bad);
    return bad != 0;
}
"""


# the x86 vector paths of 0003 and 0007: what the harness is compiled with, and what the CPU must have to run it
PATHS = [
    ("avx512", ["-mavx512f", "-mf16c", "-mfma"], {"avx512f", "f16c", "fma"}),
    ("avx2", ["-mavx2", "-mf16c", "-mfma"], {"avx2", "f16c", "fma"}),
]


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


PACK_K = _added_code("0003", "syshax_pack_k")  # 0003: K packed with vector loads
FEW_ROWS = _added_code("0007", "syshax_few_qk")  # 0007: a few rows' products from K's and V's halves


def _run_harness(tmp_path: Path, harness: str, includes: dict[str, str], flags: list[str], what: str,
                 needs: set[str]) -> subprocess.CompletedProcess:
    """Compile `harness` with the patches' code in `includes` (file name -> text) for an x86 CPU with `flags`, and
    run it; skips where this machine cannot (another architecture, a CPU without `needs`, no compiler)."""
    if platform.machine() != "x86_64":
        pytest.skip(f"{what} is x86-64's; this is {platform.machine()}")
    if not needs <= _cpu_flags():
        lacks = ", ".join(sorted(needs - _cpu_flags()))
        pytest.skip(f"this CPU lacks {lacks} (/proc/cpuinfo), so cannot run {what}")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (mk/llama-wheel.sh needs one too)")
    for name, text in includes.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "t.cpp").write_text(harness)
    # -ffp-contract=off: a reference's chain is its own fmaf calls, nothing the compiler fuses on its own
    subprocess.run([compiler, "-O2", "-ffp-contract=off", *flags, "t.cpp", "-o", "t"], cwd=tmp_path, check=True)
    return subprocess.run([str(tmp_path / "t")], capture_output=True, text=True)


@pytest.mark.parametrize("path, flags, needs", PATHS)
def test_the_vector_packing_of_k_packs_what_llama_cpps_loop_packs(tmp_path, path, flags, needs):
    run = _run_harness(tmp_path, HARNESS, {"pack.inc": PACK_K}, flags, f"the {path} path", needs)
    assert run.returncode == 0 and run.stdout.strip() == "0 mismatches", run.stdout + run.stderr


FEW_HARNESS = r"""
#include <initializer_list>
#include <immintrin.h>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
typedef uint16_t ggml_fp16_t;
enum ggml_type { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1 };
#define GGML_UNUSED(x) (void)(x)
#include "pack.inc"
#include "few.inc"
static float half(ggml_fp16_t h) { return _cvtsh_ss(h); }
static ggml_fp16_t random_half() { return (ggml_fp16_t) (rand() & 0x3bff) | (ggml_fp16_t) ((rand() & 1) << 15); }
int main() {
    const int KV = 64;
    int bad = 0;
    if (!syshax_few(1, 64, 64, GGML_TYPE_F16, KV)) { printf("no vector path\n"); return 2; }
    for (int DK : {64, 128})
    for (int rows = 1; rows <= SYSHAX_FEW_ROWS; rows++)
    for (int kv_tile : {64, 1, 7, 16, 17, 33, 63}) {
        if (!syshax_few(rows, DK, DK, GGML_TYPE_F16, KV)) { printf("no vector path for %d rows\n", rows); return 2; }
        const size_t nb1 = 3 * DK * 2 + 64;  // rows apart as in a KV cache of 3 heads, and more
        ggml_fp16_t * k = (ggml_fp16_t *) malloc(nb1 * KV), * v = (ggml_fp16_t *) malloc(nb1 * KV);
        for (size_t i = 0; i < nb1 * KV / 2; i++) { k[i] = random_half(); v[i] = random_half(); }
        float * q = (float *) malloc(sizeof(float) * rows * DK);
        float * kq = (float *) malloc(sizeof(float) * rows * KV), * vkq = (float *) malloc(sizeof(float) * rows * DK);
        float * want = (float *) malloc(sizeof(float) * rows * DK);
        for (int i = 0; i < rows * DK; i++) q[i] = (float) rand() / RAND_MAX - 0.5f;
        syshax_few_qk(kq, q, rows, (const char *) k, nb1, kv_tile, DK, KV);
        for (int tq = 0; tq < rows; tq++)
            for (int tk = 0; tk < kv_tile; tk++) {  // simd_gemm's chain over the packed tile: one fma per dk, in order
                float acc = 0.0f;
                for (int dk = 0; dk < DK; dk++)
                    acc = fmaf(half(((ggml_fp16_t *)((char *) k + tk * nb1))[dk]), q[tq * DK + dk], acc);
                bad += memcmp(&acc, &kq[tq * KV + tk], 4) != 0;
            }
        for (int i = 0; i < rows * KV; i++) kq[i] = (float) rand() / RAND_MAX;  // softmax weights
        for (int i = 0; i < rows * DK; i++) vkq[i] = want[i] = (float) rand() / RAND_MAX - 0.5f;
        syshax_few_v(vkq, kq, rows, (const char *) v, nb1, kv_tile, DK, KV);
        for (int tq = 0; tq < rows; tq++)
            for (int dv = 0; dv < DK; dv++) {
                float acc = want[tq * DK + dv];
                for (int tk = 0; tk < kv_tile; tk++)
                    acc = fmaf(half(((ggml_fp16_t *)((char *) v + tk * nb1))[dv]), kq[tq * KV + tk], acc);
                bad += memcmp(&acc, &vkq[tq * DK + dv], 4) != 0;
            }
        free(k); free(v); free(q); free(kq); free(vkq); free(want);
    }
    printf("%d mismatches\n", bad);
    return bad != 0;
}
"""


UNFUSED = r"""
#if defined(__AVX512F__)
static inline __m512 unfused512(__m512 a, __m512 b, __m512 c) { return _mm512_add_ps(_mm512_mul_ps(a, b), c); }
#endif
#if defined(__AVX2__)
static inline __m256 unfused256(__m256 a, __m256 b, __m256 c) { return _mm256_add_ps(_mm256_mul_ps(a, b), c); }
#endif
"""


def _few_rows(fused: bool = True) -> dict[str, str]:
    """0007's code as the harness includes it; not fused: each fused multiply-add of the AVX-512 and AVX2 paths
    made a product and a sum, rounded twice (what the harness must tell apart from simd_gemm's chain)."""
    few = FEW_ROWS
    if not fused:
        for width in ("512", "256"):
            few = few.replace(f"_mm{width}_fmadd_ps(", f"unfused{width}(")
        few = UNFUSED + few
    return {"pack.inc": PACK_K, "few.inc": few}


@pytest.mark.parametrize("path, flags, needs", PATHS)
def test_a_few_rows_products_are_simd_gemms_chains_over_the_packed_tiles(tmp_path, path, flags, needs):
    """0007: a decode step's tile takes its products straight from the halves of K and V. Each element must be
    the chain simd_gemm computes over the packed tiles (a fused multiply-add per term, in order), which the prompt
    path's tiles compute, or a kept token's KV would differ from a prompt chunk's."""
    run = _run_harness(tmp_path, FEW_HARNESS, _few_rows(), flags, f"the {path} path", needs)
    assert run.returncode == 0 and run.stdout.strip() == "0 mismatches", run.stdout + run.stderr


@pytest.mark.parametrize("path, flags, needs", PATHS)
def test_the_few_rows_check_tells_an_unfused_product_from_the_chain(tmp_path, path, flags, needs):
    """The check above can fail: the same code with each fused multiply-add split in two (rounded twice) differs."""
    run = _run_harness(tmp_path, FEW_HARNESS, _few_rows(fused=False), flags, f"the {path} path", needs)
    assert run.returncode == 1 and run.stdout.strip().endswith(" mismatches"), run.stdout + run.stderr
    assert int(run.stdout.split()[0]) > 0


def test_without_avx2_a_few_rows_take_llama_cpps_own_tiles(tmp_path):
    """A CPU with neither AVX-512 nor AVX2 + FMA (an old x86, or ARM) has no vector path of 0007: syshax_few
    says no, and the tiled path packs K and V as llama.cpp does. Compiled here as such a CPU's build would be (with
    F16C, which the harness's reference converts halves with)."""
    run = _run_harness(tmp_path, FEW_HARNESS, _few_rows(), ["-march=x86-64", "-mf16c"],
                       "a build for an x86-64 without AVX2", {"f16c"})
    assert run.returncode == 2 and run.stdout.strip() == "no vector path", run.stdout + run.stderr


ROWS_SCRIPT = r"""
import sys
import numpy as np
import llama_cpp as ll

STREAMS, CTX, PROMPT = 16, 256, 9
# batches of 16 and 12 rows: the q4_0 gemm (0001, 0012); fewer: the q4_0 gemv, 8 rows a pass and the rest (0008,
# 0010); 2 to 16 rows: the q8_0 output layer's few-rows kernel (0009, 0011); alone: llama.cpp's own vec_dot for the
# output layer
ROWS = (16, 12, 11, 9, 8, 7, 6, 5, 4, 3, 2)
ll.llama_backend_init()
mparams = ll.llama_model_default_params()
mparams.use_extra_bufts = True  # repacked weights, whose x86 kernels 0001 and 0008 change
model = ll.llama_model_load_from_file(sys.argv[1].encode(), mparams)
n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
p = ll.llama_context_default_params()
p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = CTX * STREAMS, 64, 64, STREAMS, False
p.n_threads = p.n_threads_batch = 2
p.flash_attn_type, p.no_perf = 1, True
ctx = ll.llama_init_from_model(model, p)
memory = ll.llama_get_memory(ctx)
batch = ll.llama_batch_init(64, 0, 1)


def add(token, pos, seq):
    i = batch.n_tokens
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, pos, 1, seq, True
    batch.n_tokens = i + 1


rng = np.random.default_rng(3)
for s in range(STREAMS):  # a prompt of its own in every stream
    batch.n_tokens = 0
    for i, t in enumerate(rng.integers(100, 30000, PROMPT)):
        add(int(t), i, s)
    assert ll.llama_decode(ctx, batch) == 0
following = [int(t) for t in rng.integers(100, 30000, STREAMS)]


def step(rows):
    # one decode step of every stream, in batches of `rows` rows (streams in order); every row's logits; the
    # step's position is taken back after
    out = np.empty((STREAMS, n_vocab), np.float32)
    for first in range(0, STREAMS, rows):
        batch.n_tokens = 0
        streams = range(first, min(first + rows, STREAMS))
        for s in streams:
            add(following[s], PROMPT, s)
        assert ll.llama_decode(ctx, batch) == 0
        for j, s in enumerate(streams):
            out[s] = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, j), (n_vocab,))
            ll.llama_memory_seq_rm(memory, s, PROMPT, -1)
    return out


alone = step(1)
for rows in ROWS:
    print(rows, int((step(rows).view(np.uint32) != alone.view(np.uint32)).any(axis=1).sum()))
"""


def test_a_rows_logits_keep_their_bits_whatever_number_of_rows_share_the_weights_pass(default_model):
    """0001: 8 rows share a pass over the repacked weights (llama.cpp took 16, or 4); 0008: up to 8 rows share the
    gemv's pass, and a batch of fewer than 12 rows goes to it whole; 0009: 2 to 16 rows share the q8_0 output
    layer's pass; 0010 to 0012: those kernels take the weights unsigned and each block's offset back. 16 sequences
    decode one token each, in one batch of 16 rows, in batches of 12, 11, 9, 8, 7, 6, 5, 4, 3, 2 (the last batch
    holds what is left) and alone; every row's logits must be the same bits each time. Tried by hand: a pass of 8
    that left out its second group of 4 rows fails here with 8 rows; 0009 with its horizontal sum taken lane after
    lane (not in llama.cpp's order) fails at every batch size; 0010 and 0011 with each block's offset 7 (not 8, not
    128) times its activations' sum fail at every batch size (16 of 16 rows differ). The attention is tiled
    (SYSHAX_FA_TILED=1), so that it too gives a row its bits whatever else its batch holds, as the engine's cpu mode
    runs it."""
    run = subprocess.run([sys.executable, "-c", ROWS_SCRIPT, str(default_model)], capture_output=True, text=True,
                         env=os.environ | {"SYSHAX_FA_TILED": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    differing = dict(line.split() for line in run.stdout.splitlines())
    assert differing == {"16": "0", "12": "0", "11": "0", "9": "0", "8": "0", "7": "0", "6": "0", "5": "0", "4": "0",
                         "3": "0", "2": "0"}, run.stdout


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q3_K_M", "IQ4_NL", "IQ4_XS", "F16", "BF16",
                                       "Q4_1", "Q5_0", "Q5_1"])
def test_every_row_exact_weight_type_gives_a_row_its_bits_whatever_shares_its_step(default_model, file_type):
    """The rows test above on SmolLM2 as llama.cpp's quantizer makes each file type a user downloads, with the engine's
    kernel settings (contexts.ONE_KERNEL_PER_TYPE: vec_dot's arithmetic for the K-quants at every row count). Their
    weights: Q4_K (repacked: 0013 gives the gemv the gemm's sums), Q6_K (2 rows and more in 0015), Q5_K, Q3_K and
    IQ4_XS (vec_dot), F16 and BF16 (tinyBLAS for a lone row too: 0014), IQ4_NL (repacked), and the Q4_0, Q5_0, Q5_1
    and Q8_0 that a K-quant file falls back to where a row of 576 does not fill a block of 256. Each is one of
    ROW_EXACT_TYPES, which the status reads. Without 0013 the Q4_K files differ from 4 rows on; without 0014 every F16
    row differs from its lone run; with llama.cpp's own choice of kernel (tiled from 8 rows, vec_dot below) Q6_K rows
    differ from 8 rows on (found by hand, 2 to 16 of 16 rows)."""
    from syshax_llamacpp.contexts import ONE_KERNEL_PER_TYPE

    from syshaxd.sdk.gguf.quantize import ROW_EXACT_TYPES, weight_types

    model = model_in(file_type)
    assert set(weight_types(model)) <= set(ROW_EXACT_TYPES), weight_types(model)
    run = subprocess.run([sys.executable, "-c", ROWS_SCRIPT, str(model)], capture_output=True, text=True,
                         env=os.environ | ONE_KERNEL_PER_TYPE | {"SYSHAX_FA_TILED": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    differing = dict(line.split() for line in run.stdout.splitlines())
    assert set(differing.values()) == {"0"}, f"{file_type} ({', '.join(weight_types(model))}): {run.stdout}"


REPACKED_SCRIPT = r"""
import json
import sys
import numpy as np
import llama_cpp as ll

TEXT = ("The lighthouse stood on the northern cliff for two hundred years. Its keeper, an old sailor named Tom, "
        "climbed the ninety-nine steps every evening to light the lamp. Ships passing in the night saw its beam and")
TOKENS = 8
ll.llama_backend_init()


def greedy(repacked):
    # a prompt's chunk (the gemm), then greedy tokens one row at a time (the gemv): their logits
    mparams = ll.llama_model_default_params()
    mparams.use_extra_bufts = repacked
    model = ll.llama_model_load_from_file(sys.argv[1].encode(), mparams)
    vocab = ll.llama_model_get_vocab(model)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    buf = (ll.llama_token * 256)()
    n = ll.llama_tokenize(vocab, TEXT.encode(), len(TEXT.encode()), buf, 256, True, False)
    p = ll.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_threads, p.n_threads_batch = 256, 64, 64, 2, 2
    p.flash_attn_type, p.no_perf = 1, True
    ctx = ll.llama_init_from_model(model, p)
    batch = ll.llama_batch_init(64, 0, 1)
    rows, tokens = [], list(buf[:n])
    for step in range(TOKENS):
        feed = tokens if step == 0 else tokens[-1:]
        batch.n_tokens = 0
        for j, t in enumerate(feed):
            i = batch.n_tokens
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, len(tokens) - len(feed) + j, 1, 0
            batch.logits[i], batch.n_tokens = j == len(feed) - 1, i + 1
        assert ll.llama_decode(ctx, batch) == 0
        rows.append(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, batch.n_tokens - 1), (n_vocab,)).copy())
        tokens.append(int(np.argmax(rows[-1])))
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return tokens[n:], np.array(rows)


(got, got_logits), (want, want_logits) = greedy(True), greedy(False)
print(json.dumps({"got": got, "want": want, "largest": float(np.abs(got_logits - want_logits).max())}))
"""


def test_the_repacked_kernels_agree_with_llama_cpps_own_q4_0_kernels(default_model):
    """The rows test above compares the patched kernels with each other; were every one of them wrong alike (an
    offset of 0010 to 0012 taken back wrong in each), it could not see it. This compares them with llama.cpp's own
    q4_0 kernels (no repacking: its vec_dot and tinyBLAS, which no patch touches): a text's prompt (a chunk: the
    gemm) and 8 greedy tokens one at a time (the gemv), the same tokens, every logit within 3 of theirs. Other
    kernels sum in another order, so the logits are not the same bits: found 0.57 to 1.07 apart (AVX-512 and AVX2
    builds); 0010 to 0012 with the offset 7 times the sum put the first token's 18 apart."""
    run = subprocess.run([sys.executable, "-c", REPACKED_SCRIPT, str(default_model)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["got"] == got["want"] and got["largest"] < 3.0, got
