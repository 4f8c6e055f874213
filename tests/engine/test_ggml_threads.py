"""ggml's compute threads are one pool per process, whichever threads ask it to compute.

Stage steps reach ggml from several threads (stream pumps, the in-process pipeline, a Load's
warm-up). ggml built with OpenMP gave every such thread its own team of workers; with more
workers alive than CPUs, libgomp makes them all sleep at each barrier instead of spinning, and
decode through the leader at 2 threads fell to 65-72 tok/s from 175-205 (SmolLM2 Q4_1, 2-vCPU
AMD Zen 4). install.sh builds ggml with its own thread pool instead (GGML_OPENMP=OFF): this
checks that property, in a fresh process so no other test's threads come and go meanwhile, and
that torch's own ops then run on one thread (their OpenMP workers spinning took the pool's cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from meshllm.engine.ggml_lib import runtime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")

CALLERS = 3

SCRIPT = textwrap.dedent(f"""
    import json, os, threading
    import torch
    from meshllm.engine.ggml_lib import runtime
    from meshllm.engine.ggml_weights import GraphScope

    cores = torch.get_num_threads()
    rt = runtime(2)
    weight, x = torch.randn(256, 512), torch.randn(4, 512)
    expected = x @ weight.T  # here: torch's matmul starts threads of its own (MKL's) on a new thread

    def product():
        y = torch.empty(4, 256)
        with GraphScope(rt) as s:
            out = rt.lib.ggml_mul_mat(s.ctx, s.wrap(weight), s.wrap(x))
            s.point(out, y)
            s.compute(out)
        return y

    def threads():
        return len(os.listdir("/proc/self/task"))

    exact = bool(torch.allclose(product(), expected, atol=1e-3, rtol=1e-4))  # the pool is up
    before = threads()
    computed, stop = threading.Barrier({CALLERS} + 1), threading.Event()

    def caller():
        assert torch.allclose(product(), expected, atol=1e-3, rtol=1e-4)
        computed.wait()
        stop.wait()  # alive while counted: a caller's OpenMP team lives as long as it does

    callers = [threading.Thread(target=caller) for _ in range({CALLERS})]
    for c in callers:
        c.start()
    computed.wait(timeout=60)
    during = threads()
    stop.set()
    for c in callers:
        c.join()
    print(json.dumps({{"exact": exact, "before": before, "during": during, "pool": rt.num_threads,
                      "torch": torch.get_num_threads(), "cores": cores, "default_pool": runtime().num_threads}}))
""")


def test_callers_on_other_threads_share_the_one_pool():
    if runtime() is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["exact"] and counts["pool"] == 2, counts
    assert counts["torch"] == 1, counts  # torch's ops leave the cores to the pool (ggml_lib.runtime)
    # and a pool made after that still gets torch's count from before, not the one thread left it
    assert counts["default_pool"] == counts["cores"], counts
    # The callers themselves and nothing else: no workers started per calling thread.
    assert counts["during"] == counts["before"] + CALLERS, counts
