"""What a Redis server's settings promise about the writes it has acknowledged.

The Redis store is only as durable as its server. :func:`persistence_problems` reads the settings
that decide it and words each one that would lose acknowledged items as the setting to change;
:meth:`~turnstile.rollout.store.redis.RedisTrajectoryStore.check_durability` (``turnstile train`` calls it
before it starts anything) refuses the server unless the list is empty or
``store.require_durable=false``. What is refused, and why:

- No append-only file (``appendonly no``). RDB snapshots alone (``save``) do not count: a restart
  loses every write since the last snapshot, minutes of them.
- ``appendfsync no``: the kernel writes the log back when it likes (on Linux up to ~30 s late).
  ``everysec`` (Redis' default once the AOF is on) is accepted: each write reaches the kernel before
  its reply, so a killed or restarted redis-server loses nothing; only a crash of the host itself,
  or a kill while a stalled disk makes Redis hold writes back (at most 2 s), loses the last seconds.
  ``always`` closes that window too, for an fsync per batch of writes.
- ``maxmemory`` with an ``allkeys-*`` policy: a full server evicts items and de-duplication keys.
  (The store sets no expiry, so ``volatile-*`` policies never evict its keys.)
- ``CONFIG`` renamed or not permitted (managed services): ``INFO persistence`` still tells an AOF
  that is off, but not how often it is fsynced, so the user has to vouch for the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio import Redis

# One CONFIG GET each: a single CONFIG GET of several names needs Redis 7.
SETTINGS = ("appendonly", "appendfsync", "save", "maxmemory", "maxmemory-policy")


async def persistence_problems(client: Redis) -> list[str]:
    """The settings of ``client``'s server that would lose acknowledged items, each worded as the
    setting to change; empty when it keeps them. Network errors are the caller's to word."""
    from redis.exceptions import ResponseError

    try:
        async with client.pipeline(transaction=False) as pipe:
            for name in SETTINGS:
                pipe.config_get(name)
            replies = await pipe.execute()
    except ResponseError as error:  # CONFIG renamed away (rename-command) or not permitted (ACL)
        return [await _without_config(client, error)]
    settings = {name: str(reply.get(name, "")) for name, reply in zip(SETTINGS, replies, strict=True)}
    if settings["appendonly"] != "yes":
        snapshots = (f"RDB snapshots alone (save '{settings['save']}') lose every write since the last "
                     "one" if settings["save"] else "and it saves no snapshots either")
        return [f"appendonly is '{settings['appendonly']}' ({snapshots}). Start it with `--appendonly "
                "yes --appendfsync everysec` (on a running server: `CONFIG SET appendonly yes`, then "
                "`CONFIG REWRITE` so that a restart keeps it)"]
    problems = []
    if settings["appendfsync"] not in ("always", "everysec"):
        problems.append(f"appendfsync is '{settings['appendfsync']}' (the kernel writes the log back "
                        "when it likes, ~30 s late). Set `appendfsync everysec` (or always)")
    policy = settings["maxmemory-policy"]
    if settings["maxmemory"] not in ("", "0") and policy.startswith("allkeys"):
        problems.append(f"maxmemory-policy is '{policy}' with maxmemory {settings['maxmemory']}: a full "
                        "server evicts items and de-duplication keys. Set `maxmemory-policy noeviction`")
    return problems


async def _without_config(client: Redis, error: Exception) -> str:
    from redis.exceptions import ResponseError

    try:
        info = await client.info("persistence")
    except ResponseError:
        info = {}
    if str(info.get("aof_enabled", "")) == "0":
        return ("appendonly is off (INFO persistence: aof_enabled:0; CONFIG is not available to read "
                "more). Run it with `appendonly yes`, `appendfsync everysec`")
    return (f"its persistence settings cannot be read: CONFIG GET failed ({error}), renamed or not "
            "permitted for this user (a managed Redis?). Make sure it runs with `appendonly yes` and "
            "`appendfsync everysec` or `always`")
