"""Information gain measured on the engine during rollout (rollout/probes.py): its values and its cost.

Two measurements on one vLLM engine (CPU, the default tiny model, fp32), in one run:

- **Equality.** The values the probes recorded during rollout against the KV-cached transformers
  scorer (:class:`~turnstile.rewards.information_gain.scorers.HFInformationGainScorer`) on the same
  fp32 weights, on the scripted expert's trajectories and on the engine's own rollouts (the policy
  writes its turns; the tiny model's random weights make them mostly malformed, so every episode
  runs its ``--policy-turns`` turns). Target: within 1e-4.
- **Cost.** The rollout phase with and without probes, at 8, 50 and 200 turns. Each episode
  replays a scripted expert's aggregation episode (``benchmarks/ig_scoring.py``'s long questions,
  one question per episode) through the real episode loop and tools: every turn is a real vLLM
  request on the real context that decodes as many tokens as the expert's turn has (what the engine
  would do had the policy written it), and the episode continues with the expert's ids, so both
  arms see the same contexts. The probes' prefill is vLLM's own count (``num_cached_tokens``), per
  boundary, against ``R`` (the pseudo-response's length, the least a probe forwards) and against
  ``R`` plus half a cache block (what the block-granular prefix cache leaves on average). The
  prefix cache is emptied before each arm; the arms alternate, ``--rounds`` times.

    .venv/bin/python benchmarks/ig_online.py [--turns 8 50 200] [--episodes 8 4 2] [--block-size 32]

Goals (issue 49): extra prefill per boundary ≤ 1.5·R; values within 1e-4.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time
from collections.abc import Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from turnstile.envs.env import EnvConfig
from turnstile.envs.search.tool import SearchConfig, SearchTool
from turnstile.envs.synthetic.questions import generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.rewards.information_gain.scorers import HFInformationGainScorer
from turnstile.rewards.information_gain.values import information_gain_values
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.engines.base import Generation, Probe, SamplingParams
from turnstile.rollout.engines.config import EngineConfig, VllmEngineConfig
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.engines.vllm import VllmEngine
from turnstile.rollout.episode import EpisodeConfig, run_episode
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.probes import COST_KEY, MISSING_KEY, IgProbeConfig
from turnstile.rollout.trajectory import Trajectory

# A script's own folder is first on sys.path: the benchmark beside this one.
from ig_scoring import BASE, LONG_QUESTIONS, PageVisit  # isort: skip


class ExpertOnVllm:
    """The expert's turns, each costed as a real vLLM request on the real context (see the module
    docstring); probes go to vLLM."""

    def __init__(self, expert: ScriptedEngine, engine: VllmEngine) -> None:
        self.expert, self.engine = expert, engine

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        turn = await self.expert.generate(prompt_ids, sampling, affinity)
        cost = SamplingParams(max_new_tokens=len(turn.token_ids), temperature=1.0)
        await self.engine.generate(prompt_ids, cost, affinity)  # no stop token: decodes exactly that many
        return turn

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        return await self.engine.score(sequences, spans)

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        return await self.engine.probe(context, continuation, span, affinity)

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    async def weights_version(self) -> int:
        return 0

    async def aclose(self) -> None:
        return None


def world_tools() -> tuple[list[Task], Toolbox]:
    world = generate_world(WorldConfig(seed=0))
    tasks = generate_tasks(world, LONG_QUESTIONS, BASE)
    documents = world_documents(world, BASE)
    return tasks, Toolbox([SearchTool.from_config(SearchConfig(), documents), PageVisit(documents)])


async def episodes(tasks: Sequence[Task], engine: object, toolbox: Toolbox, chat: ChatFormat,
                   turns: int, probes: bool, context_budget: int,
                   max_new_tokens: int = 1024) -> tuple[list[Trajectory], float]:
    """Run one episode of each task at once, cut at ``turns``; their trajectories and the wall time."""
    config = EpisodeConfig(env=EnvConfig(max_turns=turns, stall_turns=1000), context_budget=context_budget,
                           max_new_tokens=max_new_tokens, ig_probe=IgProbeConfig(enabled=probes, timeout_s=3600))
    began = time.perf_counter()
    done = await asyncio.gather(*(run_episode(task, task.id, 0, engine, toolbox, chat,  # type: ignore[arg-type]
                                              build_context_manager(ContextConfig(kind="mono")), config)
                                  for task in tasks))
    return list(done), time.perf_counter() - began


async def worst_gap(trajectories: Sequence[Trajectory], chat: ChatFormat, model: PreTrainedModel) -> float:
    """The largest |online - KV-cached scorer| over every boundary of ``trajectories``."""
    worst = 0.0
    for trajectory in trajectories:
        online = [turn.ig_value for turn in trajectory.turns]
        if None in online:
            raise RuntimeError(f"{trajectory.uid}: information gain missing: {trajectory.metadata.get(MISSING_KEY)}")
        reference = await information_gain_values(copy.deepcopy(trajectory), chat, HFInformationGainScorer(model))
        assert reference is not None
        worst = max(worst, *(abs(a - b) for a, b in zip(online, reference, strict=True)))  # type: ignore[operator]
    return worst


def probe_cost(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    costs = [trajectory.metadata[COST_KEY] for trajectory in trajectories]
    boundaries = sum(c["boundaries"] for c in costs)  # type: ignore[index,misc]
    return {"boundaries": boundaries,
            "prefill": sum(c["prefill_tokens"] for c in costs) / boundaries,  # type: ignore[index,misc]
            "R": sum(c["pseudo_tokens"] for c in costs) / boundaries,  # type: ignore[index,misc]
            "misses": sum(c["cache_misses"] for c in costs),  # type: ignore[index,misc]
            "wait_s": statistics.fmean(c["wait_s"] for c in costs)}  # type: ignore[index,misc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 50, 200])
    parser.add_argument("--episodes", type=int, nargs="+", default=[8, 4, 2],
                        help="episodes run at once, one number per --turns entry")
    parser.add_argument("--rounds", type=int, default=2, help="times each arm runs, alternating")
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM's KV-cache block (the prefix cache's unit); 0 = vLLM's own (128 on CPU)")
    parser.add_argument("--policy-episodes", type=int, default=4)
    parser.add_argument("--policy-turns", type=int, default=8)
    parser.add_argument("--equality-up-to", type=int, default=50,
                        help="check values against the transformers scorer on rows of at most this many turns")
    args = parser.parse_args()
    if len(args.episodes) != len(args.turns):
        parser.error("give one --episodes number per --turns entry")
    path = ensure_default_model()
    chat = ChatFormat.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tasks, toolbox = world_tools()
    aggregates = sorted((t for t in tasks if t.metadata["kind"] == "aggregate"),
                        key=lambda t: -int(t.metadata["members"]))  # type: ignore[arg-type]
    budget = 1 << 17
    loop = asyncio.new_event_loop()
    engine = VllmEngine.from_config(EngineConfig(
        kind="vllm", model=str(path), dtype="float32", seed=0, max_model_len=budget,
        vllm=VllmEngineConfig(kv_cache_memory_bytes=3 << 30, max_num_seqs=32, block_size=args.block_size)))
    loop.run_until_complete(engine.start())
    block = args.block_size or "vLLM's own (128 on CPU)"
    print(f"vLLM on {path.name}, fp32, KV-cache block {block}; torch threads {torch.get_num_threads()}", flush=True)

    if args.policy_episodes:  # the engine's own rollouts: the policy writes the turns, the probes measure them
        policy_tasks = [t for t in tasks if t.metadata["kind"] == "chain"][:args.policy_episodes]
        loop.run_until_complete(engine.reset_prefix_cache())
        policy, _ = loop.run_until_complete(episodes(policy_tasks, engine, toolbox, chat, args.policy_turns, True,
                                                     budget, max_new_tokens=256))
        gap = loop.run_until_complete(worst_gap(policy, chat, model))
        cost = probe_cost(policy)
        print(f"policy rollouts: {len(policy)} episodes, {cost['boundaries']:.0f} boundaries, max |online - "
              f"transformers| {gap:.1e}; prefill per probe {cost['prefill']:.1f} tokens, R {cost['R']:.1f}",
              flush=True)

    print("| turns | episodes | context tokens (mean) | rollout without probes (s) | with probes (s) | ratio | "
          "prefill per probe (tokens) | R | prefill / R | cache misses | episode's wait for its last probes (s) "
          "| max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for turns, count in zip(args.turns, args.episodes, strict=True):
        chosen = aggregates[:count]
        if any(2 * int(t.metadata["members"]) < turns for t in chosen):  # type: ignore[arg-type]
            raise SystemExit(f"not enough aggregation questions of {turns} turns or more")
        times: dict[bool, list[float]] = {False: [], True: []}
        probed: list[Trajectory] = []
        for _ in range(args.rounds):
            for probes in (False, True):
                loop.run_until_complete(engine.reset_prefix_cache())
                expert = ExpertOnVllm(ScriptedEngine(chat, tasks=tasks), engine)  # fresh episode state
                done, wall = loop.run_until_complete(episodes(chosen, expert, toolbox, chat, turns, probes, budget))
                if any(len(t.turns) != turns for t in done):
                    raise RuntimeError(f"an episode did not run {turns} turns: {[len(t.turns) for t in done]}")
                times[probes].append(wall)
                if probes:
                    probed = done
        cost = probe_cost(probed)
        gap_text = "-"
        if turns <= args.equality_up_to:
            gap_text = f"{loop.run_until_complete(worst_gap(probed, chat, model)):.1e}"
        without, with_ = statistics.fmean(times[False]), statistics.fmean(times[True])
        context = statistics.fmean(len(t.segments[0].flat_ids()) for t in probed)
        print(f"| {turns} | {count} | {context:,.0f} | {without:.1f} | {with_:.1f} | {with_ / without:.2f} | "
              f"{cost['prefill']:.1f} | {cost['R']:.1f} | {cost['prefill'] / cost['R']:.2f} | {cost['misses']:.0f} | "
              f"{cost['wait_s']:.2f} | {gap_text} |", flush=True)
    loop.run_until_complete(engine.aclose())


if __name__ == "__main__":
    main()
