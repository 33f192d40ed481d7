"""`turnstile train` on Ray's own autoscaling test cluster (tests/autoscaling_drill.py): load rises
and nodes and replicas appear, load falls and they drain and go, a node is killed mid-run and its
replica is replaced; every task's G samples reach the learner exactly once.

The drill runs in new PID, mount and network namespaces (``unshare``, as tests/test_ray_job.py
does): the cluster's `ray start` and `ray stop --force` see only the drill's own processes, and
`/tmp/ray` is a private tmpfs, so the test session's Ray is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(1500)
def test_a_training_job_on_an_autoscaling_cluster(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.fail("the drill needs util-linux's unshare and iproute2's ip (Debian: both installed by default)")
    isolate = ("ip link set lo up && mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray && "
               f"exec {sys.executable} {REPO / 'tests' / 'autoscaling_drill.py'}")
    env = {**os.environ, "DRILL_OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child",
                             "bash", "-c", isolate], cwd=REPO, env=env, capture_output=True, text=True, timeout=1400,
                            check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    report = json.loads(lines[-1])
    print(json.dumps({"nodes": report["nodes"][::5], "replica_nodes": report["replica_nodes"],
                      "killed": report["killed"], "events": [(e["at_s"], e["action"], e["member"])
                                                               for e in report["events"]]}))
    # Every step trained; every task's G samples exactly once.
    assert report["steps"] == 2 and report["weights_version"] == 2
    assert report["samples"] == report["distinct_samples"] == 2 * 4 * 4
    assert all(count == 4 for _, count in report["groups"])
    # Load rose: nodes came, and a replica served on one of them.
    counts = [n for _, n in report["nodes"]]
    assert max(counts) >= 2, report["nodes"]
    added = {r: n for r, n in report["replica_nodes"].items() if n != report["head"]}
    assert added, report["replica_nodes"]
    # A node holding a serving replica was killed; the fleet replaced the replica.
    killed = report["killed"]
    assert killed and killed["processes"] > 0, report
    events = report["events"]
    lost = [e for e in events if e["action"] == "replace" and e["member"] in killed["replicas"]]
    assert lost, events
    assert any(e["action"] == "ready" and e["member"].startswith("engine-") and e["at_s"] > lost[0]["at_s"]
               for e in events) or any(e["action"] == "down" for e in events if e["at_s"] > lost[0]["at_s"]), events
    # Load fell: replicas drained and were released, and the added nodes went.
    assert any(e["action"] == "released" and e["member"].startswith("engine-") for e in events), events
    assert counts[-1] == 1, report["nodes"]
