"""Compile the C matrix-vector kernel next to its source: `python -m meshllm.engine.kernels.build`.

Run by install.sh after pip install. Plain gcc, no torch headers, so it takes about a second;
-march=native because the kernel is only ever loaded on the machine that built it (the loader
re-checks the CPU flags anyway). A failed build is not fatal: the torch path is used instead.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
SOURCE = KERNEL_DIR / "gemv.c"
LIBRARY = KERNEL_DIR / "libgemv.so"
# ggml custom ops, built only with ggml's header (each needs its tensor struct): the remainder of a
# Q4_1 matrix held as Q4_0 (plain C, any CPU ggml runs on) and few-row products of repacked Q4_0 and
# of Q8_0 (AVX-512 VNNI; elsewhere they build as ops that report themselves unavailable).
REMAINDER_LIBRARY = KERNEL_DIR / "libq4remainder.so"
QUANT_FEW_ROWS_LIBRARY = KERNEL_DIR / "libquantfewrows.so"
ATTENTION_LIBRARY = KERNEL_DIR / "libfewrowsattention.so"  # causal attention of a few rows (AVX-512)
# few-row products of K-quants (Q4_K, Q5_K, Q6_K plain; Q4_K repacked; AVX-512 VNNI), which quantize
# activations with ggml's own function: linked against ggml's CPU library
K_QUANT_FEW_ROWS_LIBRARY = KERNEL_DIR / "libkquantfewrows.so"
GGML_OPS = {KERNEL_DIR / "q4_remainder.c": REMAINDER_LIBRARY, KERNEL_DIR / "quant_few_rows.c": QUANT_FEW_ROWS_LIBRARY,
            KERNEL_DIR / "few_rows_attention.c": ATTENTION_LIBRARY,
            KERNEL_DIR / "k_quant_few_rows.c": K_QUANT_FEW_ROWS_LIBRARY}
# -ffp-contract=fast: a * b + c as one fused multiply-add wherever written so (GCC's default in its
# GNU dialect, stated so a -std=c11 never changes it): the ops' row-by-row sums must round as the
# kernels they match do (quant_few_rows.c's Q4_1 remainder and q4_remainder.c's, the same sums).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
# The pinned ggml's header, installed beside the ggml package: with it the kernel is also built
# as a ggml custom op (meshllm_ggml_bf16_few_rows), which needs ggml's tensor struct.
GGML_INCLUDE = Path(sysconfig.get_paths()["purelib"]) / "include"
GGML_LIBRARIES = Path(sysconfig.get_paths()["purelib"]) / "ggml" / "lib"  # libggml-cpu.so, as ggml-python loads it
LINKS_GGML_CPU = {K_QUANT_FEW_ROWS_LIBRARY: ["-L" + str(GGML_LIBRARIES), "-lggml-cpu", f"-Wl,-rpath,{GGML_LIBRARIES}"]}

log = logging.getLogger(__name__)


def build(compiler: str = "gcc") -> Path | None:
    """Compile gemv.c into libgemv.so; returns its path, or None (and says why) when it cannot."""
    if shutil.which(compiler) is None:
        log.warning("no %s on PATH: the fast bf16 CPU kernel is not built (torch's path is used)", compiler)
        return None
    ggml_op = ["-DMESHLLM_GGML_OP", f"-I{GGML_INCLUDE}"] if (GGML_INCLUDE / "ggml.h").exists() else []
    jobs = {LIBRARY: [compiler, *COMPILE_FLAGS, *ggml_op, str(SOURCE), "-o", str(LIBRARY)]}
    for source, library in GGML_OPS.items() if ggml_op else ():
        jobs[library] = [compiler, *COMPILE_FLAGS, *ggml_op, str(source), "-o", str(library),
                         *LINKS_GGML_CPU.get(library, [])]
    # All at once: each is one gcc process, and the install waits for the slowest only (9 s -> 4 on 2 cores).
    running = {library: subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for library, command in jobs.items()}
    results = {library: _finish(p) for library, p in running.items()}
    for source, library in GGML_OPS.items() if ggml_op else ():
        code, stderr = results[library]
        if code != 0:
            library.unlink(missing_ok=True)  # not an earlier build of another source
            log.warning("building the ggml op %s failed (ggml's own ops do its work, slower):\n%s",
                        source.name, stderr)
    code, stderr = results[LIBRARY]
    if code != 0:
        LIBRARY.unlink(missing_ok=True)
        log.warning("building the bf16 CPU kernel failed (torch's path is used):\n%s", stderr)
        return None
    return LIBRARY


def _finish(process: subprocess.Popen) -> tuple[int, str]:
    """(exit code, stderr); communicate, not wait: a long error output would fill the pipe and stall gcc."""
    stderr = process.communicate()[1]
    return process.returncode, stderr


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build()
    print(f"built {built}" if built else "bf16 CPU kernel not built; meshllm falls back to torch")
    sys.exit(0)  # never fail the install over an optional kernel
