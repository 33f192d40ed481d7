"""The README's `ray job submit` recipe, run exactly as written.

The block after the README's ``<!-- ray-job-recipe -->`` marker is run verbatim by bash, inside new
PID, mount and network namespaces (``unshare``): there `ray start --head` gets the default ports,
`ray stop` sees only the recipe's own processes (the test session's Ray is untouched), and
`/tmp/ray` (Ray's session directory) is a private tmpfs — only that directory, so a checkout under
`/tmp` (its `.venv` on the recipe's PATH) stays visible. The namespaces isolate the recipe without
changing its commands. Killing ``unshare`` kills everything the recipe started.

One thing differs from the README: the job gets ``steps=2 eval_data.limit=16`` after its config, so
the recipe's mechanics (token, head, submit, the job's own driver, stop) run in minutes; the whole
default's learning is the business of ``turnstile train`` and its benchmark, not of this recipe.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- ray-job-recipe -->"


def readme_recipe() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert MARKER in text, "the README lost its ray job recipe marker"
    match = re.search(r"```bash\n(.*?)```", text[text.index(MARKER):], re.DOTALL)
    assert match is not None, "no bash block after the ray job recipe marker"
    return match.group(1)


def test_readme_recipe_names_the_auth_mode() -> None:
    recipe = readme_recipe()
    assert "export RAY_AUTH_MODE=token" in recipe  # without it the job client sends no token
    assert recipe.index("RAY_AUTH_MODE") < recipe.index("ray start")
    assert "ray job submit" in recipe and recipe.rstrip().endswith("ray stop")


JOB = "turnstile train --config examples/train.yaml"
SHORT = "steps=2 eval_data.limit=16"


@pytest.mark.timeout(1200)
def test_readme_ray_job_recipe_runs_as_written() -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.fail("the recipe test needs util-linux's unshare and iproute2's ip (Debian: both "
                    "installed by default)")
    recipe = readme_recipe()
    assert JOB in recipe, "the recipe no longer submits the default job"
    recipe = recipe.replace(JOB, f"{JOB} {SHORT}")
    isolate = "ip link set lo up && mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray && exec bash"
    result = subprocess.run(
        ["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child",
         "bash", "-c", isolate],
        input=recipe, cwd=REPO, capture_output=True, text=True, timeout=1100, check=False)
    printed = result.stdout + result.stderr
    assert "done: 2 steps, weights version 2" in printed, printed[-4000:]  # the job's own output
    assert "held-out accuracy" in printed and "(step 0 -> 2)" in printed, printed[-4000:]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", printed), printed[-4000:]
    assert "Stopped all" in printed or "stopped" in printed.lower(), printed[-2000:]  # ray stop ran
