"""What the Redis store keeps when its server restarts, what it refuses, and where its password goes.

Each test starts a redis-server of its own (its own free port and directory), kills it with SIGKILL
(as a crash or the OOM killer would) and starts it again on the same directory: without an
append-only file the store must notice that it came back empty and stop (``StoreDataLostError``),
with one (``appendfsync always``, so the test does not depend on timing) everything must be there
and the run go on. ``turnstile train`` must refuse a server without persistence before Ray starts,
unless ``store.require_durable=false``. Passwords must never reach a dumped config or a message.

Run: ``pytest tests/test_store_durability.py`` (all but the unit tests are marked ``integration``).
"""

from __future__ import annotations

import pickle
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port
from tests.test_train import EXAMPLE
from turnstile.cluster.cli import main
from turnstile.cluster.cli.config import dump_config, load_config
from turnstile.cluster.jobs.run import TrainJob
from turnstile.rollout.store import (
    FINISHED,
    StoreConfig,
    StoreDataLostError,
    StoreNotDurableError,
    StoreUnavailableError,
    TrajectoryStore,
    build_store,
    check_durability,
    without_password,
)

NO_PERSISTENCE = ("--appendonly", "no", "--save", "")
SNAPSHOTS_ONLY = ("--appendonly", "no", "--save", "3600 1")
AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always", "--save", "")
AOF_EVERYSEC = ("--appendonly", "yes", "--appendfsync", "everysec", "--save", "")
PASSWORD = "s3cret-Pw-4711"  # a test server's password, looked for in every output
PASSWORD_ENV = "TURNSTILE_TEST_REDIS_PASSWORD"


@dataclass
class RedisServer:
    """One test's redis-server: its port and directory survive a kill, so ``restart`` brings back
    whatever the server's persistence kept."""

    settings: tuple[str, ...]
    directory: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: run scripts/setup.sh")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             *self.settings], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"redis-server {' '.join(self.settings)} exited with {self.process.returncode}")
            try:  # answering at all (PONG, or NOAUTH with a password) and done loading its files
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if not sock.recv(64).startswith(b"-LOADING"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        pytest.fail("redis-server did not start within 30 s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.start()

    def url(self, password: str = "") -> str:
        return f"redis://{':' + password + '@' if password else ''}127.0.0.1:{self.port}/0"

    def raw(self, password: str = "") -> redis.Redis:
        """A plain client, to look at keys or flush the server behind the store's back."""
        return redis.Redis(port=self.port, password=password or None, decode_responses=True)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def start(*settings: str) -> RedisServer:
        directory = tmp_path / f"redis-{len(servers)}"
        directory.mkdir()
        server = RedisServer(settings, directory, free_port())
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.kill()


def config_for(server: RedisServer, **changes: object) -> StoreConfig:
    return replace(StoreConfig(kind="redis", url=server.url(), namespace=f"test-{uuid.uuid4().hex[:12]}",
                               timeout_s=2.0, retries=2), **changes)


async def fill(store: TrajectoryStore, count: int) -> list[str]:
    names = [f"item-{i}" for i in range(count)]
    for i, name in enumerate(names):
        await store.put(FINISHED, name, {"n": i})
    return names


# ---- the start check ---------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("settings", [NO_PERSISTENCE, SNAPSHOTS_ONLY], ids=["nothing", "rdb-only"])
def test_a_server_without_an_append_only_file_is_refused(redis_server: Callable[..., RedisServer],
                                                         settings: tuple[str, ...]) -> None:
    server = redis_server(*settings)
    config = config_for(server)
    with pytest.raises(StoreNotDurableError) as refused:
        check_durability(config)
    message = str(refused.value)
    assert "appendonly is 'no'" in message and "--appendonly yes" in message
    assert "store.require_durable=false" in message and "\n" not in message
    if settings == SNAPSHOTS_ONLY:  # snapshots are not enough: they lose all since the last one
        assert "RDB snapshots alone (save '3600 1')" in message
    check_durability(replace(config, require_durable=False))  # the explicit opt-out runs


@pytest.mark.integration
@pytest.mark.parametrize(("settings", "named"), [
    (("--appendonly", "yes", "--appendfsync", "no"), "`appendfsync everysec`"),
    ((*AOF_EVERYSEC, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"),
     "`maxmemory-policy noeviction`"),
], ids=["fsync-no", "evicting"])
def test_settings_that_lose_acknowledged_writes_are_named(redis_server: Callable[..., RedisServer],
                                                          settings: tuple[str, ...], named: str) -> None:
    with pytest.raises(StoreNotDurableError, match=named):
        check_durability(config_for(redis_server(*settings)))


@pytest.mark.integration
@pytest.mark.parametrize("settings", [AOF_ALWAYS, AOF_EVERYSEC, (*AOF_EVERYSEC, "--maxmemory", "100mb")],
                         ids=["always", "everysec", "noeviction"])
def test_an_append_only_file_passes(redis_server: Callable[..., RedisServer],
                                    settings: tuple[str, ...]) -> None:
    server = redis_server(*settings)
    check_durability(config_for(server))
    server.raw().config_set("appendonly", "no")  # what counts is the server's live setting
    with pytest.raises(StoreNotDurableError, match="appendonly is 'no'"):
        check_durability(config_for(server))


@pytest.mark.integration
@pytest.mark.parametrize("settings", [AOF_ALWAYS, NO_PERSISTENCE], ids=["aof", "no-aof"])
def test_a_server_that_hides_config_needs_the_opt_out(redis_server: Callable[..., RedisServer],
                                                      settings: tuple[str, ...]) -> None:
    server = redis_server(*settings, "--rename-command", "CONFIG", "")  # as managed services do
    config = config_for(server)
    with pytest.raises(StoreNotDurableError, match="require_durable=false") as refused:
        check_durability(config)
    if settings == AOF_ALWAYS:  # INFO says the AOF is on, not how often it is fsynced
        assert "CONFIG GET failed" in str(refused.value)
    else:
        assert "aof_enabled:0" in str(refused.value)
    check_durability(replace(config, require_durable=False))


# ---- a restart -----------------------------------------------------------------------------------

@pytest.mark.integration
async def test_a_restart_that_lost_everything_stops_the_store(
        redis_server: Callable[..., RedisServer]) -> None:
    server = redis_server(*NO_PERSISTENCE)
    config = config_for(server)
    store = build_store(config)
    names = await fill(store, 3)
    claimed = await store.claim(FINISHED, "rewards", "w0", count=2)
    await store.checkpoint("episode", {"turn": 3})
    worker_copy = pickle.loads(pickle.dumps(store))  # as sent to a Ray actor: it knows the marker
    server.restart()
    # Not an empty store that answers: a duplicate put is not accepted, an ack does not count 0.
    with pytest.raises(StoreDataLostError, match=r"lost this run's data.*appendonly yes"):
        await store.put(FINISHED, names[0], {"n": 0})
    assert server.raw().xlen(f"{config.namespace}:stream:{{{FINISHED}}}") == 0  # nothing written
    with pytest.raises(StoreDataLostError):
        await store.ack(FINISHED, "rewards", [item.id for item in claimed])
    with pytest.raises(StoreDataLostError):
        await store.load_checkpoint("episode")
    with pytest.raises(StoreDataLostError):
        await store.claim(FINISHED, "rewards", "w0", count=10)
    with pytest.raises(StoreDataLostError):
        await store.ready()
    with pytest.raises(StoreDataLostError):
        await worker_copy.length(FINISHED)
    # A client that starts afterwards begins the namespace anew; the old ones still refuse.
    late = build_store(config)
    assert await late.length(FINISHED) == 0
    with pytest.raises(StoreDataLostError, match="replaced by another client's"):
        await store.pending(FINISHED, "rewards")
    for client in (store, worker_copy, late):
        await client.close()


@pytest.mark.integration
async def test_with_an_append_only_file_a_restart_loses_nothing(
        redis_server: Callable[..., RedisServer]) -> None:
    server = redis_server(*AOF_ALWAYS)
    config = config_for(server)
    check_durability(config)
    store = build_store(config)
    names = await fill(store, 3)
    await store.put(FINISHED, names[0], {"again": True})
    claimed = await store.claim(FINISHED, "rewards", "w0", count=2)
    await store.checkpoint("episode", {"turn": 3})
    worker_copy = pickle.loads(pickle.dumps(store))
    server.restart()
    assert await store.length(FINISHED) == 3
    assert await store.pending(FINISHED, "rewards") == 2
    assert await store.load_checkpoint("episode") == {"turn": 3}
    await store.put(FINISHED, names[1], {"again": True})  # still a duplicate
    assert await store.length(FINISHED) == 3 and await store.duplicates(FINISHED) == 2
    # The run goes on: the items claimed before the restart are acked, the rest is claimed.
    assert await store.ack(FINISHED, "rewards", [item.id for item in claimed]) == 2
    assert [item.id for item in await store.claim(FINISHED, "rewards", "w1", count=10)] == names[2:]
    assert await worker_copy.load_checkpoint("episode") == {"turn": 3}
    server.restart()  # and again, with a client that never saw the first server
    fresh = build_store(config)
    await fresh.ready()
    assert await fresh.pending(FINISHED, "rewards") == 1
    taken = await fresh.reclaim(FINISHED, "rewards", "w2", min_idle_ms=0)
    assert [(item.id, item.deliveries) for item in taken] == [(names[2], 2)]
    server.raw().flushall()  # the guard is still armed after restarts that kept everything
    with pytest.raises(StoreDataLostError):
        await fresh.put(FINISHED, names[0], {"n": 0})
    for client in (store, worker_copy, fresh):
        await client.close()


@pytest.mark.integration
async def test_a_flush_is_noticed_on_a_live_connection(redis_server: Callable[..., RedisServer]) -> None:
    server = redis_server(*AOF_ALWAYS)
    store = build_store(config_for(server))
    names = await fill(store, 2)
    claimed = await store.claim(FINISHED, "rewards", "w0", count=2)
    server.raw().flushall()  # no restart: the store's connection stays up
    with pytest.raises(StoreDataLostError):
        await store.put(FINISHED, names[0], {"n": 0})
    with pytest.raises(StoreDataLostError):
        await store.ack(FINISHED, "rewards", [item.id for item in claimed])
    with pytest.raises(StoreDataLostError):
        await store.load_checkpoint("episode")
    with pytest.raises(StoreDataLostError):  # the consumer group vanished with the data
        await store.claim(FINISHED, "rewards", "w0", count=10)
    await store.close()


# ---- secrets -------------------------------------------------------------------------------------

def test_passwords_are_masked_in_urls_configs_and_reprs(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert without_password(f"redis://:{PASSWORD}@h:6379/0") == "redis://:***@h:6379/0"
    assert without_password(f"rediss://user:{PASSWORD}@h/0") == "rediss://user:***@h/0"
    assert without_password("x redis://:a/b#c@d@h/0 y") == "x redis://:***@h/0 y"  # unescaped: all masked
    assert without_password("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert without_password(f"redis://h:6379/0?password={PASSWORD}&db=1") == "redis://h:6379/0?password=***&db=1"
    url = f"redis://:{PASSWORD}@127.0.0.1:6379/0"
    assert PASSWORD not in repr(StoreConfig(kind="redis", url=url))
    # OmegaConf resolves ${oc.env:...} when the config is loaded: the dump must mask it as well.
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    yaml = tmp_path / "job.yaml"
    yaml.write_text(f"store:\n  kind: redis\n  url: redis://:${{oc.env:{PASSWORD_ENV}}}@h:6379/0\n")
    job = load_config(TrainJob, yaml, [f"rollout.tools.toolbox.cache.redis_url={url}"])
    assert job.store.url == f"redis://:{PASSWORD}@h:6379/0"
    dumped = dump_config(job)
    assert PASSWORD not in dumped and "url: redis://:***@h:6379/0" in dumped
    assert "redis_url: redis://:***@127.0.0.1:6379/0" in dumped


def test_a_password_in_the_url_and_in_the_environment_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keep one") as refused:
        build_store(StoreConfig(kind="redis", url=f"redis://:{PASSWORD}@h/0", password_env=PASSWORD_ENV))
    assert PASSWORD not in str(refused.value)


@pytest.mark.integration
async def test_the_password_comes_from_the_environment(redis_server: Callable[..., RedisServer],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    server = redis_server(*AOF_ALWAYS, "--requirepass", PASSWORD)
    config = config_for(server, password_env=PASSWORD_ENV)
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    store = build_store(config)
    assert await store.persistence_problems() == []  # type: ignore[attr-defined]
    await store.put(FINISHED, "a", {"n": 1})
    copy = pickle.loads(pickle.dumps(store))  # what travels holds no password: it reads it there
    assert PASSWORD.encode() not in pickle.dumps(store)
    assert await copy.length(FINISHED) == 1
    for client in (store, copy):
        await client.close()
    monkeypatch.setenv(PASSWORD_ENV, "wrong-" + PASSWORD)
    wrong = build_store(config)
    with pytest.raises(StoreUnavailableError,
                       match=rf"refused the connection.*\${PASSWORD_ENV} \(store.password_env\)") as refused:
        await wrong.ready()
    assert PASSWORD not in str(refused.value)
    monkeypatch.delenv(PASSWORD_ENV)
    unset = build_store(config)
    with pytest.raises(StoreUnavailableError, match=rf"\${PASSWORD_ENV} is not set in this process"):
        await unset.ready()
    for client in (wrong, unset):
        await client.close()


@pytest.mark.integration
async def test_no_message_holds_the_password(redis_server: Callable[..., RedisServer]) -> None:
    server = redis_server(*NO_PERSISTENCE, "--requirepass", PASSWORD)
    config = config_for(server, url=server.url(PASSWORD))
    with pytest.raises(StoreNotDurableError) as refused:
        check_durability(config)
    store = build_store(config)
    await store.put(FINISHED, "a", {"n": 1})
    server.restart()
    with pytest.raises(StoreDataLostError) as lost:
        await store.length(FINISHED)
    await store.close()
    wrong = build_store(config_for(server, url=server.url("not-" + PASSWORD)))
    with pytest.raises(StoreUnavailableError) as denied:
        await wrong.ready()
    await wrong.close()
    for error in (refused.value, lost.value, denied.value):
        assert PASSWORD not in str(error) and "redis://:***@127.0.0.1" in str(error)


# ---- turnstile train -----------------------------------------------------------------------------

class RayStarted(Exception):  # a marker, not an error
    """Raised in place of starting Ray: the run got past its checks."""


@pytest.mark.integration
def test_train_refuses_a_redis_without_persistence_before_ray_starts(
        redis_server: Callable[..., RedisServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_ray(*_: object) -> None:
        raise RayStarted

    monkeypatch.setattr("turnstile.cluster.jobs.train.init_ray", no_ray)
    server = redis_server(*NO_PERSISTENCE, "--requirepass", PASSWORD)
    out = tmp_path / "run"
    command = ["train", "--config", str(EXAMPLE), "--no-progress", f"out={out}", "store.kind=redis",
               f"store.url={server.url(PASSWORD)}"]
    with pytest.raises(SystemExit) as done:
        main(command)
    printed = capsys.readouterr()
    refusal = [line for line in printed.out.splitlines() if line.startswith("turnstile train:")]
    assert done.value.code == 2 and len(refusal) == 1
    assert "appendonly is 'no'" in refusal[0] and "store.require_durable=false" in refusal[0]
    assert "Traceback" not in printed.out + printed.err
    assert PASSWORD not in printed.out + printed.err
    assert not out.exists()  # refused before the banner: no config.yaml, no rollouts
    with pytest.raises(RayStarted):  # the explicit opt-out gets past the check
        main([*command, "store.require_durable=false"])
    written = (out / "config.yaml").read_text()
    assert "url: redis://:***@127.0.0.1" in written and PASSWORD not in written
    durable = redis_server(*AOF_EVERYSEC, "--requirepass", PASSWORD)
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    with pytest.raises(RayStarted):  # and so does a persistent server, its password from the environment
        main([*command[:-1], f"store.url={durable.url()}", f"store.password_env={PASSWORD_ENV}"])
    assert PASSWORD not in (out / "config.yaml").read_text()
