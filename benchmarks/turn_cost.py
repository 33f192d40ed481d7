"""Orchestration cost of a turn as an episode grows: is turn 200 as cheap as turn 10?

Runs 200-turn episodes through the real episode loop (context building, chat deltas, parsing, the
environment, the toolbox, trajectory bookkeeping) with an engine and a tool that answer instantly,
so what is measured is turnstile's own work per turn. The engine stamps when each request arrives
and when it returns; a turn's orchestration cost is the gap between one return and the next request.

    .venv/bin/python benchmarks/turn_cost.py [--episodes 8] [--turns 200] [--concurrency 8]

Prints the median cost at turns 5–15 and 190–200, their ratio (target ≤ 1.5), turns per
second per core (turns over the process' CPU time), and the share of that CPU time spent turning
observations into token ids (``ChatFormat.delta_ids``: the tokenizer's work, which any system must
do) against the rest (turnstile's own: context, parsing, environment, bookkeeping).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch

from turnstile.envs.env import EnvConfig
from turnstile.envs.protocol import render_tool_call
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonObject
from turnstile.envs.tools.cache import CacheConfig
from turnstile.envs.tools.toolbox import Toolbox, ToolboxConfig
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.engines.base import FINISH_STOP, Generation, SamplingParams
from turnstile.rollout.episode import EpisodeConfig, run_episode
from turnstile.rollout.model_store import ensure_default_model

PAGE = ("The Varny Bridge crosses the river at its narrowest point and was completed in 1911 by "
        "the engineer who also designed the harbour of the city. ") * 12


class InstantSearch:
    """A search tool that answers at once with a page-sized text."""

    name = "search"
    description = "instant search"
    parameters: ClassVar[JsonObject] = {"type": "object", "properties": {"query": {"type": "array"}}}

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        query = arguments.get("query", [])
        return {"query": list(query) if isinstance(query, list) else [str(query)]}

    async def call(self, arguments: JsonObject) -> str:
        return f"A search for '{arguments['query'][0]}' found 1 results:\n\n{PAGE}"

    async def aclose(self) -> None:
        return None


class InstantEngine:
    """Writes a well-formed search call every turn, instantly (its ids made once, a new query each
    turn of an episode, so the environment's stall detection sees progress), and stamps each request."""

    TURNS = 256  # calls prepared; an episode's turn n writes call n

    def __init__(self, chat: ChatFormat) -> None:
        self.calls = [(*chat.encode(render_tool_call("search", {"query": [f"Varny Bridge engineer {n}"]},
                                                     "Keep searching.")), chat.turn_end_id)
                      for n in range(self.TURNS)]
        self.arrived: dict[str, list[float]] = defaultdict(list)
        self.returned: dict[str, list[float]] = defaultdict(list)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        key = affinity or ""
        self.arrived[key].append(time.perf_counter())
        ids = self.calls[(len(self.arrived[key]) - 1) % self.TURNS]
        generation = Generation(ids, (0.0,) * len(ids), FINISH_STOP, 0)
        self.returned[key].append(time.perf_counter())
        return generation

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        return [[0.0] * (end - start) for start, end in spans]

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        return None

    async def weights_version(self) -> int:
        return 0

    async def aclose(self) -> None:
        return None


class Stopwatch:
    """Adds up the time spent in the calls it wraps (one thread: the episode loop's)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, function: Callable[..., list[int]]) -> Callable[..., list[int]]:
        def timed(*args: object, **kwargs: object) -> list[int]:
            began = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - began
        return timed


async def measure(episodes: int, turns: int, concurrency: int) -> None:
    chat = ChatFormat.from_pretrained(ensure_default_model())
    tokenising = Stopwatch()
    chat.delta_ids = tokenising.wrap(chat.delta_ids)  # type: ignore[method-assign]
    engine = InstantEngine(chat)
    toolbox = Toolbox([InstantSearch()], ToolboxConfig(cache=CacheConfig(backend="none")))
    config = EpisodeConfig(max_new_tokens=64, context_budget=1_000_000,
                           env=EnvConfig(max_turns=turns))
    task = Task(id="bench", question="Who designed the harbour?", answers=("Ada",))
    limit = asyncio.Semaphore(concurrency)

    async def one(sample: int) -> int:
        async with limit:
            trajectory = await run_episode(task, "bench", sample, engine, toolbox, chat,
                                           build_context_manager(ContextConfig()), config)
        return len(trajectory.turns)

    cpu, wall = time.process_time(), time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(episodes)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    gaps: dict[int, list[float]] = defaultdict(list)
    for key, arrivals in engine.arrived.items():
        for turn in range(1, len(arrivals)):
            gaps[turn].append(arrivals[turn] - engine.returned[key][turn - 1])
    early = [g for t in range(5, 16) for g in gaps[t]]
    late = [g for t in range(turns - 10, turns) for g in gaps[t]]
    early_ms, late_ms = statistics.median(early) * 1e3, statistics.median(late) * 1e3
    print(f"episodes {episodes} x {turns} turns (ran {sum(done)} turns), concurrency {concurrency}")
    print(f"orchestration per turn: turns 5-15 {early_ms:.3f} ms, turns {turns - 10}-{turns} "
          f"{late_ms:.3f} ms, ratio {late_ms / early_ms:.2f} (target <= 1.5)")
    print(f"throughput: {sum(done) / cpu:.0f} turns per CPU-second ({sum(done) / wall:.0f} turns/s wall)")
    per_turn = cpu / sum(done) * 1e3
    tokenised = tokenising.seconds / sum(done) * 1e3
    print(f"CPU per turn {per_turn:.3f} ms: observation to ids {tokenised:.3f} ms "
          f"({tokenised / per_turn:.0%}), the rest {per_turn - tokenised:.3f} ms ({1 - tokenised / per_turn:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(measure(args.episodes, args.turns, args.concurrency))


if __name__ == "__main__":
    main()
