"""The trajectory store contract, its config, and the pieces both backends share.

The store sits between the roles of the asynchronous loop (docs/design.md §1): the driver ``put``\\s
finished trajectories on the ``finished`` stream, reward workers ``claim`` them as one consumer group, score
them, ``put`` them on ``scored`` and ``ack`` the originals; the learner claims from ``scored``. A
worker that dies while holding claimed items leaves them pending; another worker ``reclaim``\\s them
once they have been idle long enough. Delivery is therefore *at least once*: a consumer must finish
an item before acking it, and a consumer that may see an item twice (after a reclaim) should make its
work idempotent by item id.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

from turnstile.envs.tools.base import JsonObject

FINISHED = "finished"  # trajectories waiting for the reward service
SCORED = "scored"  # scored trajectories waiting for the learner

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
# ``scheme://user:password@``: the user stops at the first ``:``; the password runs to the last ``@``
# before a space, so a password with unescaped ``@ / # ?`` is masked whole, never in part (the price:
# a URL with an ``@`` in its path after ``host:port`` is masked too).
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/]*:)\S*@")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)[^&\s]*")  # redis-py reads ?password= too


@dataclass
class StoreConfig:
    """Which store to use.

    ``kind``: ``memory`` (default: state in one named Ray actor, lost with it) or ``redis`` (Redis
    Streams; survives worker, driver and store-client restarts). ``url``: the Redis URL, e.g.
    ``redis://127.0.0.1:6379/0`` (redis only). ``namespace``: prefix of every stream and checkpoint,
    one per run, so runs sharing a Redis (or a memory actor) never see each other's items.
    ``actor_name``: the named Ray actor that holds a memory store. ``timeout_s``: connect and read
    timeout of one Redis command; ``retries``: how often a command that failed on the network is
    tried again (puts are idempotent, so a retried put never duplicates).

    ``password_env`` (redis): the name of the environment variable that holds the Redis password,
    e.g. ``REDIS_PASSWORD``; every process that connects reads it (set it on every node before
    ``ray start``), so the secret is in no config file, log or Ray object. A password in ``url``
    (``redis://:pw@host``) works too, and is masked wherever the URL is printed.
    ``require_durable`` (redis): ``turnstile train`` refuses, before anything starts, a server that
    would lose acknowledged items if it restarted (see :meth:`TrajectoryStore.check_durability`);
    ``false`` runs on it anyway (a throwaway test server, or a managed Redis whose ``CONFIG`` is
    hidden but whose provider persists writes). A restart that lost the run's data is detected
    either way and stops the run with :class:`StoreDataLostError`.
    """

    kind: str = "memory"
    url: str = ""
    namespace: str = "turnstile"
    actor_name: str = "turnstile-store"
    timeout_s: float = 5.0
    retries: int = 2
    password_env: str = ""
    require_durable: bool = True

    def __repr__(self) -> str:  # a config that reaches a log or a traceback keeps its secret
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["url"] = without_password(self.url)
        return f"StoreConfig({', '.join(f'{name}={value!r}' for name, value in shown.items())})"


@dataclass(frozen=True)
class Claimed:
    """One item handed to a consumer: its producer-given id, its payload, and how many times it has
    been delivered to this group (1 on the first claim, +1 each time it is reclaimed)."""

    id: str
    payload: JsonObject
    deliveries: int


class StoreError(RuntimeError):
    """The store cannot do what was asked; the message says why and what to do."""


class StoreUnavailableError(StoreError):
    """The store's backend cannot be reached (Redis down, the memory store's actor dead)."""


class StoreNotDurableError(StoreError):
    """The backend would lose acknowledged items if its server restarted; the message names the
    server setting to change, and the opt-out (``store.require_durable=false``)."""


class StoreDataLostError(StoreError):
    """The backend lost this run's items (a Redis restart without persistence, a flush): going on
    would work on an empty store, accept duplicates and forget pending items, so the run stops."""


class TrajectoryStore(ABC):
    """Streams of JSON items read by consumer groups, plus checkpoints of episodes in progress.

    Contract (every backend; ``tests/test_store.py`` checks each against it):

    - ``put`` appends an item to a stream. It is idempotent per ``(stream, item_id)``: a second put
      of an id already in the stream is ignored and counted in ``duplicates``, so a producer that
      retries after an error never duplicates an item.
    - A consumer group reads every item of a stream, from the first one, independently of other
      groups (a group is created by its first ``claim``/``reclaim``). Within a group, ``claim`` hands
      each new item to exactly one consumer and records it as pending for that consumer.
    - ``ack`` ends an item's life in the group (it leaves the pending list). An item claimed and
      never acked stays pending until ``reclaim`` moves it to another consumer: items idle (not
      delivered) for at least ``min_idle_ms`` change owner, oldest first, and their delivery count
      rises (Redis XAUTOCLAIM). A plain ack deletes nothing from the stream.
    - ``ack(..., release=True)`` also drops the items' payloads for good: the caller is the
      stream's last reader (a run's reward workers on ``finished``, its collector on ``scored``),
      so a long run holds only what is still in flight, not every trajectory it ever made. A
      released item is skipped by every group that has not read it, its id stays known (a second
      put is still a duplicate) and ``length`` still counts it; ``held`` counts what is still held.
    - ``claim`` with ``block_ms > 0`` waits up to that long for new items; ``0`` returns at once.
    - Checkpoints are single JSON objects by key, overwritten by each ``checkpoint``; a missing
      key loads as ``None``; dropping a missing key is not an error; ``checkpoint_keys`` lists the
      namespace's keys.
    - Payloads are JSON objects (a trajectory's ``to_json()`` form); what comes out is an equal copy.
    - Stream, group and consumer names are 1-200 characters of letters, digits and ``_ . : -``.
    - The client is picklable: pass it to Ray actors; it reconnects lazily where it lands.
    - ``close`` releases this client's connections; it is safe to call twice and never deletes data.
    - A backend that notices it lost items it had acknowledged (its server restarted empty) raises
      :class:`StoreDataLostError` from then on, instead of answering as an empty store.
    """

    @abstractmethod
    def __init__(self, config: StoreConfig) -> None:
        """A client of ``config``'s store, built by :func:`turnstile.rollout.store.build_store`."""

    @classmethod
    @abstractmethod
    def check_durability(cls, config: StoreConfig) -> None:
        """Raise :class:`StoreNotDurableError` (naming the setting to change) if a restart of the
        backend's server would lose acknowledged items, unless ``config.require_durable`` is false.
        Synchronous and needs no Ray: the driver calls it before it starts anything."""

    @abstractmethod
    async def ready(self) -> None:
        """Raise :class:`StoreUnavailableError` (saying what to do) unless the backend answers."""

    @abstractmethod
    async def put(self, stream: str, item_id: str, payload: JsonObject) -> None: ...

    @abstractmethod
    async def claim(self, stream: str, group: str, consumer: str, count: int = 1,
                    block_ms: int = 0) -> list[Claimed]: ...

    @abstractmethod
    async def ack(self, stream: str, group: str, ids: list[str], *, release: bool = False) -> int:
        """Acknowledge items by id; returns how many were pending (unknown or acked ids count 0).
        With ``release``, the items' payloads are dropped too (see the contract)."""

    @abstractmethod
    async def reclaim(self, stream: str, group: str, consumer: str, min_idle_ms: int,
                      count: int = 100) -> list[Claimed]: ...

    @abstractmethod
    async def pending(self, stream: str, group: str) -> int:
        """Items claimed in ``group`` and not yet acked (0 for a group that never claimed)."""

    @abstractmethod
    async def length(self, stream: str) -> int:
        """Items ever put on the stream (acks do not remove them, nor do releases)."""

    @abstractmethod
    async def held(self, stream: str) -> int:
        """Items whose payload the stream still holds: ``length`` less the released ones."""

    @abstractmethod
    async def duplicates(self, stream: str) -> int:
        """Puts ignored because their item id was already in the stream."""

    @abstractmethod
    async def checkpoint(self, key: str, payload: JsonObject) -> None: ...

    @abstractmethod
    async def load_checkpoint(self, key: str) -> JsonObject | None: ...

    @abstractmethod
    async def drop_checkpoint(self, key: str) -> None: ...

    @abstractmethod
    async def checkpoint_keys(self) -> list[str]:
        """The keys of the checkpoints held in this namespace, sorted (episodes in progress)."""

    @abstractmethod
    async def close(self) -> None: ...


# ---- shared by the backends ----------------------------------------------------------------------

def without_password(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` (and every
    ``?password=...`` query) in it replaced by ``***`` (``redis://:***@host:6379/0``): for URLs in
    messages, logs and dumped configs."""
    return _QUERY_PASSWORD.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>***@", text))


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what} name {name!r} is not valid: use 1-200 letters, digits or _ . : -")
    return name


def check_id(what: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def check_count(what: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def encode_payload(item_id: str, payload: JsonObject) -> str:
    """The payload as compact JSON; both backends store this text, so both accept the same payloads
    and hand back equal copies, never the producer's own object."""
    if not isinstance(payload, dict):
        raise ValueError(f"payload of {item_id!r} must be a JSON object (dict), got "
                         f"{type(payload).__name__}")
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise ValueError(f"payload of {item_id!r} is not JSON-serialisable: {error}") from None


def decode_payload(text: str) -> JsonObject:
    return json.loads(text)
