"""Information-gain scoring cost: the KV-cached scorer against one full forward per boundary.

Makes real trajectories of 50, 100 and 200 turns: the synthetic world's scripted expert answers an
aggregation question (100+ members, about two tool calls each) through the episode loop with the
real search tool over the world's pages and a visit tool that returns each page's text from
memory (what the real visit tool extracts, without an HTTP server); ``max_turns`` cuts the episode
at 50, 100 or 200 turns with the forced final answer. Then it scores ``v_s`` at every turn of each
trajectory on the default tiny model with :class:`~rewards.information_gain.scorers.HFInformationGainScorer`,
and with :class:`~rewards.information_gain.scorers.PerPrefixScorer` (a full forward per boundary).

The naive scorer needs ``Σ_s prefix_s`` token forwards (about an hour on 2 CPU cores at 200
turns), so by default it is timed on ``--naive-samples`` boundaries evenly spaced over the
trajectory and its total is extrapolated (mean × T); ``--naive-samples 0`` times every boundary.
The largest |difference| is over the gold log-probs of the boundaries the naive scorer ran.

    .venv/bin/python benchmarks/ig_scoring.py [--turns 50 100 200] [--naive-samples 12]

Targets: speed-up ≥ 10 at 200 turns, largest |difference| ≤ 1e-4.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from envs.env import EnvConfig
from envs.search.base import Document
from envs.search.tool import SearchConfig, SearchTool
from envs.synthetic.questions import QuestionConfig, generate_tasks
from envs.synthetic.render import world_documents
from envs.synthetic.world import WorldConfig, generate_world
from envs.tasks import Task
from envs.tools.base import JsonObject, ToolError
from envs.tools.toolbox import Toolbox
from rewards.information_gain.scorers import HFInformationGainScorer, PerPrefixScorer
from rewards.information_gain.values import SegmentBoundaries, segment_boundaries
from rollout.chat import ChatFormat
from rollout.context import ContextConfig, build_context_manager
from rollout.engines.scripted import ScriptedEngine
from rollout.episode import EpisodeConfig, run_episode
from rollout.model_store import ensure_default_model
from rollout.trajectory import Trajectory

BASE = "http://corpus.test"
# Hubs this large give aggregation questions of 200+ turns (the default questions stop at 90).
LONG_QUESTIONS = QuestionConfig(count=20, aggregation_fraction=0.5, aggregation_min_members=100,
                                aggregation_max_members=130)


class PageVisit:
    """The visit tool's answer for a page of the world: the page's text, read from memory."""

    name = "visit"
    description = "Visit a page."
    def __init__(self, documents: Sequence[Document]) -> None:
        self.parameters: JsonObject = {"type": "object"}
        self._by_url = {doc.url: doc for doc in documents}

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        return {"url": str(arguments.get("url")), "goal": str(arguments.get("goal"))}

    async def call(self, arguments: JsonObject) -> str:
        doc = self._by_url.get(str(arguments["url"]))
        if doc is None:
            raise ToolError("http_status", "404 Not Found")
        return f"Content of {doc.url} (goal: {arguments['goal']}):\n{doc.text}"

    async def aclose(self) -> None:
        return None


def make_trajectories(chat: ChatFormat, turns: Sequence[int]) -> list[Trajectory]:
    """One scripted-expert episode per entry of ``turns``, cut at that many turns."""
    world = generate_world(WorldConfig(seed=0))
    tasks = generate_tasks(world, LONG_QUESTIONS, BASE)
    task = max((t for t in tasks if t.metadata["kind"] == "aggregate"),
               key=lambda t: int(t.metadata["members"]))  # type: ignore[arg-type]
    documents = world_documents(world, BASE)
    toolbox = Toolbox([SearchTool.from_config(SearchConfig(), documents), PageVisit(documents)])
    return [asyncio.run(_episode(task, tasks, toolbox, chat, limit)) for limit in turns]


async def _episode(task: Task, tasks: list[Task], toolbox: Toolbox, chat: ChatFormat,
                   max_turns: int) -> Trajectory:
    config = EpisodeConfig(env=EnvConfig(max_turns=max_turns), context_budget=1 << 20,
                           max_new_tokens=1024)
    trajectory = await run_episode(task, task.id, 0, ScriptedEngine(chat, tasks=tasks), toolbox, chat,
                                   build_context_manager(ContextConfig(kind="mono")), config)
    if len(trajectory.turns) != max_turns:
        raise RuntimeError(f"the episode ran {len(trajectory.turns)} turns, not {max_turns}")
    return trajectory


class TokenCounter:
    """Counts the input ids of every forward of a model (a pre-hook; removed on close)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.tokens = 0
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: torch.nn.Module, args: tuple[object, ...],
               kwargs: dict[str, object]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self.tokens += ids.numel()

    def close(self) -> None:
        self._handle.remove()


def evenly_spaced(count: int, samples: int) -> list[int]:
    """``samples`` indices spread over ``range(count)`` from first to last (all when 0 or more)."""
    if samples <= 0 or samples >= count:
        return list(range(count))
    return sorted({round(i * (count - 1) / (samples - 1)) for i in range(samples)})


def bench(model: PreTrainedModel, chat: ChatFormat, trajectory: Trajectory,
          naive_samples: int) -> dict[str, float]:
    (segment,) = segment_boundaries(trajectory, chat, trajectory.answers[0]) or []
    counter = TokenCounter(model)
    began = time.perf_counter()
    cached = HFInformationGainScorer(model).gold_logprobs_now([segment])
    cached_s = time.perf_counter() - began
    cached_tokens, counter.tokens = counter.tokens, 0
    naive = PerPrefixScorer(model)
    chosen = evenly_spaced(len(segment.prefix_lens), naive_samples)
    began = time.perf_counter()
    reference = {boundary: naive.boundary_now(segment, boundary) for boundary in chosen}
    naive_measured_s = time.perf_counter() - began
    counter.close()
    turns = len(segment.prefix_lens)
    worst = max(abs(a - b) for boundary, want in reference.items()
                for a, b in zip(cached[boundary], want, strict=True))
    return {"turns": turns, "context": len(segment.context_ids), "R": len(segment.pseudo[0].ids),
            "cached_s": cached_s, "naive_s": naive_measured_s * turns / len(chosen),
            "sampled": len(chosen), "cached_tokens": cached_tokens,
            "naive_tokens": sum(len(segment.sequence(b)) for b in range(turns)), "worst": worst}


def warm_up(model: PreTrainedModel, chat: ChatFormat, trajectory: Trajectory) -> None:
    """Score the first two boundaries once: torch's first calls are slow, keep them out of timings."""
    (segment,) = segment_boundaries(trajectory, chat, trajectory.answers[0]) or []
    first_two = SegmentBoundaries(segment.context_ids[:segment.prefix_lens[1]],
                                  segment.prefix_lens[:2], segment.pseudo[:2], segment.turns[:2])
    HFInformationGainScorer(model).gold_logprobs_now([first_two])
    PerPrefixScorer(model).gold_logprobs_now([first_two])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--naive-samples", type=int, default=12,
                        help="boundaries the naive scorer is timed on (0 = all of them)")
    args = parser.parse_args()
    path = ensure_default_model()
    chat = ChatFormat.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trajectories = make_trajectories(chat, args.turns)
    warm_up(model, chat, trajectories[0])
    print(f"torch threads: {torch.get_num_threads()}; model: {path.name} (fp32, "
          f"{model.config._attn_implementation})")
    print("turns  context L  R   cached s  naive s (timed/extrapolated)  speed-up  "
          "tokens fwd cached / naive   max |diff|")
    for trajectory in trajectories:
        row = bench(model, chat, trajectory, args.naive_samples)
        naive_note = ("all" if row["sampled"] == row["turns"] else f"{row['sampled']:.0f} timed")
        print(f"{row['turns']:5.0f}  {row['context']:9.0f}  {row['R']:.0f}  {row['cached_s']:8.1f}  "
              f"{row['naive_s']:8.1f} ({naive_note:>9})            {row['naive_s'] / row['cached_s']:7.1f}  "
              f"{row['cached_tokens']:11.0f} / {row['naive_tokens']:<11.0f}  {row['worst']:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
