"""How much two models decoding at once on two cores of this machine slow each other: the bound on
the two-machine speculative headline (bench/spec_two_machines.py) when both "machines" are cores
of one host.

Each model decodes one row per step on one thread, in a process of its own pinned to its core
(taskset), for the same wall-clock window: alone, then both at once (the window starts at a set
time, after both loaded, so the two overlap whole). Prints one JSON object: per round and model,
the median ms per step alone and beside the other, and their ratio. Two separate machines would
show 1.0; a shared memory system shows the slower side's price.

    flock -x /work/cpu.lock python bench/core_coupling.py [--verifier PATH] [--draft PATH]
        [--seconds 6] [--rounds 2] [--cores 0 1]

Defaults: the pair of the headline, SmolLM2-135M in BF16 (built from the shipped GGUF, as
bench/decode.py does) verifying, and the shipped Q4_1 drafting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LOAD_S = 20.0  # time given both processes to load before the measured window opens
CONTEXT = 200  # a sequence's positions before it starts over (a fresh 32-token prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    parser.add_argument("--child", nargs=2, metavar=("PATH", "START_AT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(decode_window(args.child[0], float(args.child[1]), args.seconds)))
        return
    from decode import model_path

    verifier = args.verifier or str(model_path("smollm2:BF16"))
    draft = args.draft or str(model_path("smollm2:Q4_1"))
    models = {"verifier": (verifier, args.cores[0]), "draft": (draft, args.cores[1])}
    rounds = []
    for _ in range(args.rounds):
        alone = {name: run({name: spec}, args.seconds)[name] for name, spec in models.items()}
        both = run(models, args.seconds)
        rounds.append({name: {"alone_ms": alone[name]["median_ms"], "beside_ms": both[name]["median_ms"],
                              "slowdown": round(both[name]["median_ms"] / alone[name]["median_ms"], 2)}
                       for name in models})
    print(json.dumps({"cpu": cpu_model(), "cpus": os.cpu_count(),
                      "verifier": Path(verifier).name, "draft": Path(draft).name, "cores": args.cores,
                      "seconds": args.seconds, "rounds": rounds,
                      "median_slowdown": {name: statistics.median(r[name]["slowdown"] for r in rounds)
                                          for name in models}}, indent=1))


def run(models: dict[str, tuple[str, int]], seconds: float) -> dict[str, dict]:
    """Each model's window, all starting at one moment; {name: {"median_ms", "steps"}}."""
    start_at = time.time() + LOAD_S
    procs = {name: subprocess.Popen(["taskset", "-c", str(core), sys.executable, __file__, "--seconds", str(seconds),
                                     "--child", path, str(start_at)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
             for name, (path, core) in models.items()}
    out = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=LOAD_S + seconds + 120)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed ({proc.returncode})")
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def decode_window(path: str, start_at: float, seconds: float) -> dict:
    import torch

    torch.set_num_threads(1)
    from meshllm.engine.dtypes import DEFAULT_DTYPE, DTYPES
    from meshllm.engine.host_memory import return_large_frees
    from meshllm.engine.kv_cache import SequenceKV
    from meshllm.engine.stage_weights import load_stage_decoder
    from meshllm.model.decoder import SeqSlice
    from meshllm.model.source import open_model

    return_large_frees()  # as every meshllm command does
    files = open_model(path, tokenizer=False)
    decoder = load_stage_decoder(files.source, files.config, dtype=DTYPES[DEFAULT_DTYPE])
    if time.time() > start_at:
        raise SystemExit("loading took longer than LOAD_S: the windows would not overlap")
    time.sleep(start_at - time.time())
    steps, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        kv = SequenceKV(decoder.kv_layout(), CONTEXT + 1)
        decoder(torch.arange(3, 35), torch.arange(32), [SeqSlice(kv, 0, 32)], torch.tensor([31]))
        token = torch.tensor([5])
        while kv.length < CONTEXT and time.monotonic() < end:
            started = time.perf_counter()
            logits = decoder(token, torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)], torch.arange(1))
            token = logits.argmax(dim=-1)
            steps.append(time.perf_counter() - started)
    return {"median_ms": round(1000 * statistics.median(steps), 2), "steps": len(steps)}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


if __name__ == "__main__":
    main()
