"""Session-wide fixtures: the shared data folder and real services started once per test session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SESSION_CPUS = 8  # the session Ray's logical CPUs: what the largest pipeline test asks for, and more


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a ``slow`` test run first, then files holding an ``integration`` test, then the
    unit tests (the order within each group kept). With the suite's ``-n 2 --dist loadfile`` a long
    file handed out last runs alone at the end (the autoscaling drill alone is four minutes), while
    short files handed out last fill both workers to the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    integration = {item.path for item in items if item.get_closest_marker("integration")}
    items.sort(key=lambda item: 0 if item.path in slow else 1 if item.path in integration else 2)


def data_dir() -> Path:
    """The shared data folder: $TURNSTILE_DATA, else ../shared/data beside the repository."""
    return Path(os.environ.get("TURNSTILE_DATA", REPO.parent / "shared" / "data")).resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = data_dir()
    if not path.is_dir():
        pytest.skip(f"shared data folder {path} is absent; set TURNSTILE_DATA to point at it")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free loopback port for the whole session."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="turnstile-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
         "--appendfsync", "everysec", "--dir", workdir],  # durable, as turnstile train requires
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start within 10 s")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


# ---- the synthetic world of seed 0, its tasks, tools and expert (module-scoped; a module may
# define its own fixture of the same name instead) -------------------------------------------------

WORLD_BASE = "http://corpus.test"  # where the test world's pages claim to live (never fetched)


@pytest.fixture(scope="module")
def chat():  # noqa: ANN201 - imports stay inside: collecting unit tests must not load models
    from turnstile.rollout.chat import ChatFormat
    from turnstile.rollout.model_store import ensure_default_model

    return ChatFormat.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def world():  # noqa: ANN201
    from turnstile.envs.synthetic.world import WorldConfig, generate_world

    return generate_world(WorldConfig(seed=0))


@pytest.fixture(scope="module")
def tasks(world):  # noqa: ANN001, ANN201
    from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks

    return generate_tasks(world, QuestionConfig(), WORLD_BASE)


@pytest.fixture(scope="module")
def toolbox(world):  # noqa: ANN001, ANN201
    from tests.tools_for_tests import memory_toolbox
    from turnstile.envs.synthetic.render import world_documents

    return memory_toolbox(world_documents(world, WORLD_BASE))


@pytest.fixture(scope="module")
def expert(chat, tasks):  # noqa: ANN001, ANN201
    from turnstile.rollout.engines.scripted import ScriptedEngine

    return ScriptedEngine(chat, tasks=tasks)


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """One local Ray for the whole session (starting Ray takes seconds; never per test).

    A test that ran a command in-process before this fixture was first used may have started a
    smaller Ray (``rollout.ray.num_cpus``, 4 by default); tests after it that ask for more would
    wait on resources that never come, so that one is replaced.
    """
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < SESSION_CPUS:
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(num_cpus=SESSION_CPUS, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()
