"""Memory of a long-horizon run: a running episode, a scored episode, a stored trajectory, a long run.

Four measurements, in one run, each read as a process' resident set size (``VmRSS`` and the peak
``VmHWM`` of ``/proc/self/status``, after ``gc.collect()``; Linux only):

1. Rollout worker, per running episode. ``--held`` episodes run through the real episode loop
   (:func:`~turnstile.rollout.episode.run_episode`) with an engine that writes a search call instantly and a
   search tool that returns ``--page-chars`` characters of the synthetic world's pages per call; the
   engine holds every episode at the request that starts its last turn (turn ``--turns``: the
   context then holds ``--turns`` − 1 responses and observations) until all of them are there. Per
   episode: (RSS with all held − RSS before they started) / held, the tokens of its context then
   (prompt + responses + observations), the bytes per token; then the same after ``malloc_trim``
   (without the free pages glibc keeps), and the Python objects reachable from its trajectory.
   The baseline is read after ``malloc_trim``, so no earlier free memory hides the episodes' own.
2. Reward worker, per scored episode, in a fresh process (a reward worker is a process of its
   own). The scripted expert's ``--turns``-turn trajectory (as in ``benchmarks/ig_scoring.py``) is scored with
   :class:`~turnstile.rewards.information_gain.scorers.HFInformationGainScorer` on the default tiny model
   (fp32), after the model is loaded, the trajectory made and the scorer warmed up; the peak RSS is
   reset just before (``/proc/self/clear_refs``) and read after. The increase is set against the KV
   cache of the context the scorer keeps (tokens × layers × 2 × key-value heads × head_dim × 4 bytes).
3. Redis store, per trajectory. A ``redis-server`` on a free loopback port (no persistence); the
   held episodes, finished, are put on the ``finished`` stream as the driver puts them (their
   ``to_json()`` under ``uid/sample``), ``--stored`` of them (cycled, each under its own id). Per
   trajectory: the growth of ``INFO memory`` ``used_memory`` (less the clients' buffers), the
   stream's ``MEMORY USAGE``, and the JSON payload's size. The server is stopped at the end, also on
   error.
4. A long run. ``--long-episodes`` episodes of the synthetic world's questions (cycled) through the
   episode loop with the scripted expert, the worker's default episode, context and tool-cache
   settings, and the search and in-memory visit tools, ``--concurrency`` at a time, in batches of
   ``--every``, in a fresh process; no finished trajectory is kept. After each batch (nothing in
   flight): RSS (no trim: what the worker's RSS is), the blocks Python's allocator holds
   (``sys.getallocatedblocks()``: leaked objects show there even when they fit in free memory), the
   tool cache's size; and the growth per episode from the first batch to the last, and from the
   first sample with the tool cache complete (it stops growing once every question has run).

    .venv/bin/python benchmarks/memory.py [--held 16] [--turns 200] [--page-chars 3000] [--stored 20]
        [--long-episodes 1000] [--concurrency 8] [--every 100]

Target: the long run's RSS is flat (< 1 KB per episode, or within noise) once the tool cache holds
the world's pages. The other figures are sizes to plan a machine with, each printed beside what it
is made of (tokens, the KV cache, the JSON payload).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from types import FunctionType, ModuleType
from typing import ClassVar

import redis.asyncio as aioredis
import torch
from transformers import AutoModelForCausalLM

from turnstile.envs.env import EnvConfig
from turnstile.envs.protocol import render_tool_call
from turnstile.envs.search.base import Document
from turnstile.envs.search.tool import SearchConfig, SearchTool
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonObject
from turnstile.envs.tools.cache import CacheConfig, MemoryCache
from turnstile.envs.tools.toolbox import Toolbox, ToolboxConfig
from turnstile.rewards.information_gain.scorers import HFInformationGainScorer
from turnstile.rewards.information_gain.values import segment_boundaries
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.engines.base import FINISH_STOP, Generation, SamplingParams
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.episode import EpisodeConfig, run_episode
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.store.base import FINISHED, StoreConfig, encode_payload
from turnstile.rollout.store.redis import RedisTrajectoryStore
from turnstile.rollout.trajectory import Trajectory

# A script's own folder is first on sys.path: the benchmark beside this one.
from ig_scoring import BASE, PageVisit, make_trajectories, warm_up
from turn_cost import InstantEngine

MB = 1 << 20


# ---- reading the process' memory -----------------------------------------------------------------

def status_kb(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``; this process by default), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}: this benchmark needs Linux")


def settled_rss(trim: bool = False) -> int:
    """RSS after a full garbage collection; with ``trim``, after glibc also returned its free pages
    (``malloc_trim``), so that what a measurement allocates next cannot hide in memory freed before."""
    gc.collect()
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: the reading keeps the allocator's free pages
    return status_kb("VmRSS")


def reset_peak(pid: int | str = "self") -> bool:
    """Reset a process' peak RSS (``VmHWM``) to its current RSS; False where the kernel does not allow it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


def deep_size(roots: Sequence[object]) -> int:
    """Bytes of the Python objects reachable from ``roots``, each counted once (types, modules and
    functions left out): what the trajectories hold, without the allocator's overhead."""
    seen: set[int] = set()
    stack = list(roots)
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, ModuleType, FunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


# ---- 1. running episodes held at their last turn -------------------------------------------------

class WorldPages:
    """A search tool that answers at once with ``page_chars`` characters of the world's pages (a new
    string each call, taken further along the pages each time, as different pages would be)."""

    name = "search"
    description = "page-sized search results"
    parameters: ClassVar[JsonObject] = {"type": "object", "properties": {"query": {"type": "array"}}}

    def __init__(self, documents: Sequence[Document], page_chars: int) -> None:
        self.text = "\n\n".join(doc.text for doc in documents)
        if len(self.text) < 2 * page_chars:
            raise ValueError(f"the world's pages hold {len(self.text)} characters, too few for "
                             f"pages of {page_chars}")
        self.page_chars = page_chars
        self.calls = 0

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        query = arguments.get("query", [])
        return {"query": list(query) if isinstance(query, list) else [str(query)]}

    async def call(self, arguments: JsonObject) -> str:
        start = self.calls * self.page_chars % (len(self.text) - self.page_chars)
        self.calls += 1
        page = self.text[start:start + self.page_chars]
        return f"A search for '{arguments['query'][0]}' found 1 results:\n\n{page}"

    async def aclose(self) -> None:
        return None


class HoldingEngine(InstantEngine):
    """Writes a search call every turn, instantly (tokenised afresh, as a real engine's ids are new
    objects), and holds each episode at its ``hold_at``-th request until ``episodes`` are held;
    scoring, weights and closing as the instant engine of ``turn_cost``."""

    def __init__(self, chat: ChatFormat, hold_at: int, episodes: int) -> None:
        super().__init__(chat)
        self.chat = chat
        self.hold_at = hold_at
        self.episodes = episodes
        self.requests: Counter[str] = Counter()
        self.held_tokens: list[int] = []  # context length of each held episode
        self.all_held = asyncio.Event()
        self.release = asyncio.Event()

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        key = affinity or ""
        self.requests[key] += 1
        turn = self.requests[key]
        if turn == self.hold_at:
            self.held_tokens.append(len(prompt_ids))
            if len(self.held_tokens) == self.episodes:
                self.all_held.set()
            await self.release.wait()
        text = render_tool_call("search", {"query": [f"Varny Bridge engineer {turn}"]}, "Keep searching.")
        ids = (*self.chat.encode(text), self.chat.turn_end_id)
        return Generation(ids, (0.0,) * len(ids), FINISH_STOP, 0)


async def held_episodes(chat: ChatFormat, documents: Sequence[Document], episodes: int, turns: int,
                        page_chars: int) -> tuple[dict[str, float], list[Trajectory]]:
    """Per-episode memory of ``episodes`` episodes held at the start of turn ``turns``; returns the
    figures and the finished trajectories."""
    toolbox = Toolbox([WorldPages(documents, page_chars)], ToolboxConfig(cache=CacheConfig(backend="none")))
    config = EpisodeConfig(max_new_tokens=256, context_budget=1 << 24, env=EnvConfig(max_turns=turns, stall_turns=0))
    task = Task(id="held", question="Who designed the harbour of the city?", answers=("Ada",))

    def episode(engine: HoldingEngine, uid: str, sample: int,
                limits: EpisodeConfig = config) -> asyncio.Future[Trajectory]:
        return asyncio.ensure_future(run_episode(task, uid, sample, engine, toolbox, chat,
                                                 build_context_manager(ContextConfig()), limits))

    # A short episode first: one-time allocations happen there, and it frees little to reuse.
    await episode(HoldingEngine(chat, 0, 0), "warm-up", 0, replace(config, env=EnvConfig(max_turns=3)))
    engine = HoldingEngine(chat, turns, episodes)
    before = settled_rss(trim=True)
    running = [episode(engine, "held", sample) for sample in range(episodes)]
    await engine.all_held.wait()
    held = settled_rss()
    live = settled_rss(trim=True)  # without the free pages glibc kept
    alive = [obj for obj in gc.get_objects() if type(obj) is Trajectory]
    reachable = deep_size(alive) if len(alive) == episodes else float("nan")
    engine.release.set()
    finished = list(await asyncio.gather(*running))
    tokens = sum(engine.held_tokens) / episodes
    per_episode = (held - before) / episodes
    figures = {"episodes": episodes, "turns": turns, "page_chars": page_chars, "tokens": tokens,
               "per_episode": per_episode, "per_token": per_episode / tokens,
               "live": (live - before) / episodes, "reachable": reachable / episodes,
               "rss_before": before, "rss_held": held}
    return figures, finished


# ---- 2. scoring one long trajectory ---------------------------------------------------------------

def scoring_peak(chat: ChatFormat, turns: int) -> dict[str, float]:
    """Peak RSS increase of scoring one ``turns``-turn trajectory, and its context's KV cache."""
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    (trajectory,) = make_trajectories(chat, [turns])
    warm_up(model, chat, trajectory)
    (segment,) = segment_boundaries(trajectory, chat, trajectory.answers[0]) or []
    scorer = HFInformationGainScorer(model)
    last = max(range(len(segment.prefix_lens)), key=segment.prefix_lens.__getitem__)
    context = len(segment.context_ids) + len(segment.pseudo[last].ids)  # what the prefill caches
    config = model.config
    kv = context * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    before = settled_rss(trim=True)
    exact = reset_peak()
    cpu, wall = time.process_time(), time.perf_counter()
    scorer.gold_logprobs_now([segment])
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = status_kb("VmHWM")
    return {"turns": len(segment.prefix_lens), "context": context, "kv": kv,
            "increase": peak - before, "exact": exact, "cpu_s": cpu, "wall_s": wall,
            "model": sum(p.numel() * p.element_size() for p in model.parameters()),
            "intermediate": context * config.intermediate_size * 4}


# ---- 3. trajectories in Redis ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence); its URL. Always stopped."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="turnstile-memory-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


async def data_memory(client: aioredis.Redis) -> int:
    """``used_memory`` less the clients' buffers (a put's query buffer, freed when the client has
    been idle a while or is gone: not what a stored trajectory costs)."""
    info = await client.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


async def stored_bytes(url: str, trajectories: Sequence[Trajectory], count: int) -> dict[str, float]:
    """Redis memory per trajectory put on the ``finished`` stream, as the driver puts them."""
    namespace = "memory-bench"
    store = RedisTrajectoryStore(StoreConfig(kind="redis", url=url, namespace=namespace,
                                             require_durable=False))
    client = aioredis.Redis.from_url(url)
    try:
        await store.ready()  # connected, the namespace's marker written
        before = await data_memory(client)
        payload_bytes = 0
        tokens = 0
        for index in range(count):
            trajectory = trajectories[index % len(trajectories)]
            item = f"{trajectory.uid}-{index}/{trajectory.sample}"
            payload = trajectory.to_json()
            payload_bytes += len(encode_payload(item, payload).encode())
            tokens += sum(len(segment) for segment in trajectory.segments)
            await store.put(FINISHED, item, payload)
        await store.close()  # its connection's buffers (a put's query buffer) go with it
        await asyncio.sleep(0.5)
        after = await data_memory(client)
        stream = await client.memory_usage(f"{namespace}:stream:{{{FINISHED}}}", samples=0)
        # Then as the reward workers do: claim each, and ack it with release once scored.
        while claimed := await store.claim(FINISHED, "reward", "bench", count=count):
            await store.ack(FINISHED, "reward", [item.id for item in claimed], release=True)
        await store.close()
        await asyncio.sleep(0.5)
        released = await data_memory(client)
        held = await store.held(FINISHED)
    finally:
        await client.aclose()
        await store.close()
    return {"count": count, "per_trajectory": (after - before) / count, "stream": (stream or 0) / count,
            "json": payload_bytes / count, "tokens": tokens / count,
            "released": (released - before) / count, "held": held}


# ---- 4. a long run ----------------------------------------------------------------------------------

class CountingCache(MemoryCache):
    """The worker's in-memory tool cache, counting what is put in it (the toolbox puts a result
    after a miss only, so these are its entries and their characters; nothing expires here)."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.entries = 0
        self.chars = 0

    async def put(self, key: str, value: str) -> None:
        self.entries += 1
        self.chars += len(value)
        await super().put(key, value)


async def long_run(chat: ChatFormat, episodes: int, concurrency: int,
                   every: int) -> list[tuple[int, int, int, int, int]]:
    """(episodes done, RSS, Python's allocated blocks, tool-cache entries, cached characters) before
    the first episode and after each batch of ``every``."""
    world = generate_world(WorldConfig(seed=0))
    tasks = generate_tasks(world, QuestionConfig(), BASE)
    documents = world_documents(world, BASE)
    cache = CountingCache(CacheConfig())
    toolbox = Toolbox([SearchTool.from_config(SearchConfig(), documents), PageVisit(documents)],
                      cache=cache)
    engine = ScriptedEngine(chat, tasks=tasks)
    config = EpisodeConfig()  # the worker's defaults: 200 turns, a 32k context budget
    limit = asyncio.Semaphore(concurrency)
    del world, documents

    async def one(index: int) -> int:
        task = tasks[index % len(tasks)]
        async with limit:
            trajectory = await run_episode(task, f"long-{task.id}", index // len(tasks), engine,
                                           toolbox, chat, build_context_manager(ContextConfig()),
                                           config)
        return len(trajectory.turns)  # and the trajectory is dropped, as a worker writes it out

    samples = [(0, settled_rss(), sys.getallocatedblocks(), 0, 0)]
    for start in range(0, episodes, every):
        await asyncio.gather(*(one(i) for i in range(start, min(start + every, episodes))))
        rss = settled_rss()
        samples.append((min(start + every, episodes), rss, sys.getallocatedblocks(), cache.entries,
                        cache.chars))
    return samples


def in_fresh_process(only: str) -> object:
    """Run measurement ``only`` (``scoring`` or ``long``) in a fresh process with this run's options,
    as a worker is a process of its own: no memory freed by the other measurements is there to
    absorb its own. Returns what it printed last (JSON)."""
    child = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--only", only],
                           capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"measurement {only} failed ({child.returncode}):\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def report_long_run(samples: Sequence[Sequence[int]]) -> list[tuple[str, str, str]]:
    """Print the long run's samples and its growth per episode from the first batch done, and from
    the first sample with the tool cache complete; returns the growths as rows of the summary."""
    print("4. long run (its own process): episodes  RSS MB  Python blocks  tool-cache entries  "
          "cached MB of text")
    for done, rss, blocks, entries, chars in samples:
        print(f"   {done:34,d}  {rss / MB:6.1f}  {blocks:13,d}  {entries:18,d}  {chars / MB:17.1f}")
    first, last = samples[min(1, len(samples) - 1)], samples[-1]  # from the first batch done
    steady = next(sample for sample in samples if sample[3] == last[3])
    spans = [(first, "")]
    if steady[0] not in (first[0], last[0]):
        spans.append((steady, ", tool cache complete"))
    rows = []
    for start, note in spans:
        episodes = max(last[0] - start[0], 1)
        kb = (last[1] - start[1]) / episodes / 1024
        blocks = (last[2] - start[2]) / episodes
        print(f"   growth from episode {start[0]} to {last[0]}{note}: {(last[1] - start[1]) / MB:+.2f} MB, "
              f"{kb:+.2f} KB per episode (target < 1 KB), {blocks:+.1f} Python blocks per episode; the "
              f"tool cache's text grew {(last[4] - start[4]) / MB:+.2f} MB", flush=True)
        rows.append((f"long run, episodes {start[0]}-{last[0]}{note}", f"{kb:+.2f} KB/episode",
                     f"{blocks:+.1f} Python blocks/episode; target < 1 KB"))
    return rows


# ---- the run ---------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--held", type=int, default=16, help="episodes held at their last turn")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--page-chars", type=int, default=3000, help="characters per search result")
    parser.add_argument("--stored", type=int, default=20, help="trajectories put in Redis")
    parser.add_argument("--long-episodes", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--every", type=int, default=100, help="episodes between RSS samples")
    parser.add_argument("--only", choices=["scoring", "long"], help=argparse.SUPPRESS)  # a child's part
    args = parser.parse_args()
    began_cpu, began = time.process_time(), time.perf_counter()
    chat = ChatFormat.from_pretrained(ensure_default_model())
    if args.only == "scoring":
        print(json.dumps(scoring_peak(chat, args.turns)))
        return
    if args.only == "long":
        print(json.dumps(asyncio.run(long_run(chat, args.long_episodes, args.concurrency, args.every))))
        return
    documents = world_documents(generate_world(WorldConfig(seed=0)), BASE)
    print(f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), torch threads "
          f"{torch.get_num_threads()}, Python {sys.version.split()[0]}, baseline RSS "
          f"{settled_rss() / MB:.0f} MB", flush=True)

    held, finished = asyncio.run(held_episodes(chat, documents, args.held, args.turns, args.page_chars))
    del documents
    print(f"1. {held['episodes']:.0f} episodes held at turn {held['turns']:.0f} "
          f"({held['page_chars']:.0f}-char pages): RSS {held['rss_before'] / MB:.0f} -> "
          f"{held['rss_held'] / MB:.0f} MB; per episode {held['per_episode'] / MB:.2f} MB, "
          f"{held['tokens']:,.0f} tokens, {held['per_token']:.0f} B/token; "
          f"{held['live'] / MB:.2f} MB after malloc_trim, of which objects reachable from its trajectory "
          f"{held['reachable'] / MB:.2f} MB", flush=True)

    scored: dict[str, float] = in_fresh_process("scoring")  # type: ignore[assignment]
    print(f"2. IG scoring of a {scored['turns']:.0f}-turn trajectory ({scored['context']:,.0f} context "
          f"tokens, {scored['cpu_s']:.0f} CPU-s, {scored['wall_s']:.0f} s wall): peak RSS +"
          f"{scored['increase'] / MB:.0f} MB"
          f"{'' if scored['exact'] else ' (the peak could not be reset: it is since the start)'}; "
          f"KV cache {scored['kv'] / MB:.0f} MB, one context x intermediate_size fp32 activation "
          f"{scored['intermediate'] / MB:.0f} MB, weights {scored['model'] / MB:.0f} MB", flush=True)

    with redis_server() as url:
        stored = asyncio.run(stored_bytes(url, finished, args.stored))
    del finished
    print(f"3. Redis, {stored['count']:.0f} trajectories of {stored['tokens']:,.0f} tokens on the finished "
          f"stream: used_memory +{stored['per_trajectory'] / MB:.2f} MB each (stream MEMORY USAGE "
          f"{stored['stream'] / MB:.2f} MB), JSON {stored['json'] / MB:.2f} MB each; after the reward "
          f"group acked them with release: {stored['released']:+,.0f} B each, {stored['held']:.0f} held",
          flush=True)

    samples: list[list[int]] = in_fresh_process("long")  # type: ignore[assignment]
    growths = report_long_run(samples)

    rows = [("what", "figure", "reference"),
            (f"running {held['turns']:.0f}-turn episode (rollout worker)",
             f"{held['per_episode'] / MB:.2f} MB",
             f"{held['tokens']:,.0f} tokens: {held['per_token']:.0f} B/token"),
            (f"scoring one {scored['turns']:.0f}-turn trajectory (reward worker)",
             f"+{scored['increase'] / MB:.0f} MB peak",
             f"KV cache {scored['kv'] / MB:.0f} MB: {scored['increase'] / scored['kv']:.1f}x"),
            ("one trajectory on the Redis stream", f"{stored['per_trajectory'] / MB:.2f} MB",
             f"JSON {stored['json'] / MB:.2f} MB: {stored['per_trajectory'] / stored['json']:.2f}x"),
            ("... once released by its last reader", f"{stored['released']:+,.0f} B",
             f"{stored['released'] / stored['per_trajectory']:.1e} of the stored figure"),
            *growths]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    print()
    for what, figure, reference in rows:
        print(f"{what:<{widths[0]}}  {figure:>{widths[1]}}  {reference}")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"total {time.process_time() - began_cpu + children.ru_utime + children.ru_stime:.0f} CPU-s "
          f"(with its child processes), {time.perf_counter() - began:.0f} s wall")


if __name__ == "__main__":
    main()
