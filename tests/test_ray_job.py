"""`ray job submit --working-dir . -- turnstile train --config ...` against a Ray cluster started with
`ray start --head` on this machine, as the README shows it.

The cluster is a second, separate Ray (its own ports and temp dir, its own process group), so it is
stopped by killing that group, never with `ray stop`, which would also stop the test session's Ray.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.test_train import SMALL

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _kill_cluster(head: subprocess.Popen[bytes], temp_dir: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(2)
    # Anything of this cluster that left the group (it is named by the temp dir) goes too.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if temp_dir.encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture()
def ray_head() -> Iterator[tuple[str, dict[str, str]]]:
    """`ray start --head --block` on free loopback ports; yields the job-submission address and the
    environment to call the `ray` CLI with (this venv first on PATH, as a user's shell would have)."""
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must stay < 108
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    # Ray 2.60 clusters require a token by default; say so explicitly, so the cluster and every CLI
    # call use the same token file (~/.ray/auth_token, generated on first use).
    env["RAY_AUTH_MODE"] = "token"
    dashboard = free_port()
    head = subprocess.Popen(
        # Every port its own (another Ray on this machine holds the defaults), all on loopback.
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=4",
         "--node-ip-address=127.0.0.1", f"--dashboard-agent-listen-port={free_port()}",
         f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
         f"--runtime-env-agent-port={free_port()}", f"--ray-client-server-port={free_port()}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--temp-dir={temp_dir}", "--object-store-memory=400000000", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        # Ready when a job runs: the job server answers before the node's agent can take jobs.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            probe = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address, "--", "echo",
                                    "ready"], env=env, capture_output=True, text=True, timeout=120)
            if probe.returncode == 0 and "ready" in probe.stdout:
                break
            assert head.poll() is None, "ray start --head exited"
            time.sleep(2)
        else:
            pytest.fail(f"the Ray head could not run a job within 180 s: {probe.stdout[-1000:]}"
                        f"{probe.stderr[-1000:]}")
        yield address, env
    finally:
        _kill_cluster(head, temp_dir)


def test_ray_job_submit_runs_turnstile_train(ray_head: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    address, env = ray_head
    out = tmp_path / "out"
    result = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--",
         "turnstile", "train", "--config", "examples/train.yaml", "--no-progress", *SMALL, "steps=1",
         "eval_every=0", f"out={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    printed = result.stdout + result.stderr
    assert result.returncode == 0, printed[-4000:]
    assert "done: 1 steps, weights version 1" in printed  # the job's own output, streamed back
    assert "succeeded" in printed
    assert (out / "checkpoint" / "learner.json").is_file() and (out / "run.json").is_file()
