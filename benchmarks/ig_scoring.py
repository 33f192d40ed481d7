"""Information-gain scoring cost: the KV-cached scorer and the vLLM path against one full forward per boundary.

Makes real trajectories of 50, 100 and 200 turns: the synthetic world's scripted expert answers an
aggregation question (100+ members, about two tool calls each) through the episode loop with the
real search tool over the world's pages and a visit tool that returns each page's text from
memory (what the real visit tool extracts, without an HTTP server); ``max_turns`` cuts the episode
at 50, 100 or 200 turns with the forced final answer. Then it scores ``v_s`` at every turn of each
trajectory on the default tiny model with :class:`~turnstile.rewards.information_gain.scorers.HFInformationGainScorer`,
with :class:`~turnstile.rewards.information_gain.scorers.PerPrefixScorer` (a full forward per boundary) and,
with ``--vllm``, through vLLM (:class:`~turnstile.rewards.information_gain.values.EngineGoldScorer`: prefix-cache
reads, the longest boundary first) in the same run, on the same trajectories.

The naive scorer needs ``Σ_s prefix_s`` token forwards (about an hour on 2 CPU cores at 200
turns), so by default it is timed on ``--naive-samples`` boundaries evenly spaced over the
trajectory and its total is extrapolated (mean × T); ``--naive-samples 0`` times every boundary.
The largest |difference| is over the gold log-probs of the boundaries the naive scorer ran.

The limit of a speed-up is the ratio of the work done. Two measures of it: token forwards
(``Σ_s (prefix_s + R)`` against ``L + T·R``) and FLOPs, which add attention: each query token
attends to every key before it, ``4 · layers · heads · head_dim`` FLOPs a (query, key) pair, beside
``2 · parameters`` a token for the layers' matrices. On the tiny model at these lengths attention is
most of the work (a forward of L tokens costs about 4× one of L/2), and the naive scorer's prefixes
are on average half as long as the cached scorer's one context, so the FLOP ratio, about T/3, is the
limit; the token ratio, about T/2, is not reachable by any exact method.

    .venv/bin/python benchmarks/ig_scoring.py [--turns 50 100 200] [--naive-samples 12] [--vllm [--vllm-parts]]

Targets: speed-up ≥ 0.8 of the FLOP limit, largest |difference| ≤ 1e-5.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from turnstile.envs.env import EnvConfig
from turnstile.envs.search.base import Document
from turnstile.envs.search.tool import SearchConfig, SearchTool
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonObject, ToolError
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.rewards.information_gain.scorers import HFInformationGainScorer, PerPrefixScorer
from turnstile.rewards.information_gain.values import EngineGoldScorer, SegmentBoundaries, segment_boundaries
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.episode import EpisodeConfig, run_episode
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.trajectory import Trajectory

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


def work(model: PreTrainedModel, forwards: Sequence[tuple[int, int]]) -> float:
    """FLOPs of forwards given as (tokens, attended (query, key) pairs): the layers' matrices and
    attention (the embedding and the logits of the few kept rows left out)."""
    config = model.config
    layers = sum(p.numel() for p in model.model.layers.parameters())
    per_pair = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    return sum(2.0 * layers * tokens + per_pair * pairs for tokens, pairs in forwards)


def naive_forwards(segment: SegmentBoundaries) -> list[tuple[int, int]]:
    """One causal forward per boundary over its whole sequence."""
    lengths = [len(segment.sequence(b)) for b in range(len(segment.prefix_lens))]
    return [(n, n * (n + 1) // 2) for n in lengths]


def cached_forwards(segment: SegmentBoundaries) -> list[tuple[int, int]]:
    """The context with the last boundary's pseudo-response, causally; then each other boundary's
    R ids, each attending to its prefix and its own earlier ids (packing changes no count)."""
    last = max(range(len(segment.prefix_lens)), key=segment.prefix_lens.__getitem__)
    first = len(segment.context_ids) + len(segment.pseudo[last].ids)
    rest = [(len(segment.pseudo[b].ids), len(segment.pseudo[b].ids) * segment.prefix_lens[b]
             + len(segment.pseudo[b].ids) * (len(segment.pseudo[b].ids) + 1) // 2)
            for b in range(len(segment.prefix_lens)) if b != last]
    return [(first, first * (first + 1) // 2), *rest]


def bench(model: PreTrainedModel, chat: ChatFormat, trajectory: Trajectory, naive_samples: int,
          engine: object | None, loop: asyncio.AbstractEventLoop, parts: bool = False) -> dict[str, float]:
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
    row = {"turns": turns, "context": len(segment.context_ids), "R": len(segment.pseudo[0].ids),
           "cached_s": cached_s, "naive_s": naive_measured_s * turns / len(chosen),
           "sampled": len(chosen), "cached_tokens": cached_tokens,
           "naive_tokens": sum(len(segment.sequence(b)) for b in range(turns)), "worst": worst,
           "flop_limit": work(model, naive_forwards(segment)) / work(model, cached_forwards(segment))}
    if engine is not None:
        loop.run_until_complete(engine.reset_prefix_cache())  # cold: nothing of an earlier row is cached
        began = time.perf_counter()
        through = loop.run_until_complete(EngineGoldScorer(engine).gold_logprobs([segment]))
        row["vllm_s"] = time.perf_counter() - began
        row["vllm_worst"] = max(abs(a - b) for boundary, want in reference.items()
                                for a, b in zip(through[boundary], want, strict=True))
        if parts:
            row.update(loop.run_until_complete(vllm_parts(engine, segment)))
    return row


async def vllm_parts(engine: object, segment: SegmentBoundaries) -> dict[str, float]:
    """Where the vLLM path's time goes, each part from a cold prefix cache: the longest boundary
    alone (its request computes prompt log-probs over the whole context), the other boundaries
    after it (each its own request, reading the cached context), and for comparison a plain
    prefill of the same context (one generated token, no prompt log-probs)."""
    from turnstile.rollout.engines.base import SamplingParams

    longest = max(range(len(segment.prefix_lens)), key=lambda b: segment.prefix_lens[b])
    others = [b for b in range(len(segment.prefix_lens)) if b != longest]
    sequence, span = segment.sequence(longest), segment.gold_span(longest)
    await engine.reset_prefix_cache()
    began = time.perf_counter()
    await engine.score([sequence], [span])
    alone = time.perf_counter() - began
    await engine.score([segment.sequence(b) for b in others], [segment.gold_span(b) for b in others])
    rest = time.perf_counter() - began - alone
    await engine.reset_prefix_cache()
    began = time.perf_counter()
    await engine.generate(sequence[:span[0]], SamplingParams(max_new_tokens=1, temperature=0.0))
    prefill = time.perf_counter() - began
    return {"vllm_longest_s": alone, "vllm_others_s": rest, "vllm_prefill_s": prefill}


def warm_up(model: PreTrainedModel, chat: ChatFormat, trajectory: Trajectory) -> None:
    """Score the first two boundaries once: torch's first calls are slow, keep them out of timings."""
    (segment,) = segment_boundaries(trajectory, chat, trajectory.answers[0]) or []
    first_two = SegmentBoundaries(segment.context_ids[:segment.prefix_lens[1]],
                                  segment.prefix_lens[:2], segment.pseudo[:2], segment.turns[:2])
    HFInformationGainScorer(model).gold_logprobs_now([first_two])
    PerPrefixScorer(model).gold_logprobs_now([first_two])


def vllm_engine(path: object, context: int, loop: asyncio.AbstractEventLoop) -> object:
    """A vLLM engine on the same model, in this process, with room for the longest sequence."""
    from turnstile.rollout.engines.config import EngineConfig, VllmEngineConfig
    from turnstile.rollout.engines.vllm import VllmEngine

    engine = VllmEngine.from_config(EngineConfig(
        kind="vllm", model=str(path), dtype="float32", seed=0, max_model_len=context + 256,
        vllm=VllmEngineConfig(kv_cache_memory_bytes=1 << 30, max_num_seqs=32)))
    loop.run_until_complete(engine.start())  # the engine lives on this loop: every call runs there
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--naive-samples", type=int, default=12,
                        help="boundaries the naive scorer is timed on (0 = all of them)")
    parser.add_argument("--vllm", action="store_true", help="also score through a vLLM engine (CPU)")
    parser.add_argument("--vllm-parts", action="store_true",
                        help="with --vllm: also time the longest boundary, the others, and a plain prefill")
    args = parser.parse_args()
    path = ensure_default_model()
    chat = ChatFormat.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trajectories = make_trajectories(chat, args.turns)
    warm_up(model, chat, trajectories[0])
    loop = asyncio.new_event_loop()
    longest = max(len(t.segments[0].flat_ids()) for t in trajectories)
    engine = vllm_engine(path, longest, loop) if args.vllm else None
    print(f"torch threads: {torch.get_num_threads()}; model: {path.name} (fp32, "
          f"{model.config._attn_implementation})")  # noqa: SLF001 - what from_pretrained chose
    print("turns  context L  R   cached s  naive s (timed/extrapolated)  speed-up  token ratio  FLOP ratio  "
          "of FLOP limit  max |diff|" + ("   vLLM s  vLLM speed-up  of limit  vLLM max |diff|" if engine else ""))
    for trajectory in trajectories:
        row = bench(model, chat, trajectory, args.naive_samples, engine, loop, args.vllm_parts)
        naive_note = ("all" if row["sampled"] == row["turns"] else f"{row['sampled']:.0f} timed")
        speedup = row["naive_s"] / row["cached_s"]
        line = (f"{row['turns']:5.0f}  {row['context']:9.0f}  {row['R']:.0f}  {row['cached_s']:8.1f}  "
                f"{row['naive_s']:8.1f} ({naive_note:>9})            {speedup:7.1f}  "
                f"{row['naive_tokens'] / row['cached_tokens']:11.1f}  {row['flop_limit']:10.1f}  "
                f"{speedup / row['flop_limit']:13.2f}  {row['worst']:.1e}")
        if engine is not None:
            vllm_speedup = row["naive_s"] / row["vllm_s"]
            line += (f"  {row['vllm_s']:7.1f}  {vllm_speedup:13.1f}  {vllm_speedup / row['flop_limit']:8.2f}  "
                     f"{row['vllm_worst']:.1e}")
        print(line, flush=True)
        if "vllm_longest_s" in row:
            others = row["turns"] - 1
            both = row["vllm_longest_s"] + row["vllm_others_s"]
            print(f"       vLLM parts: longest boundary alone {row['vllm_longest_s']:.1f} s = "
                  f"{row['vllm_longest_s'] / row['vllm_prefill_s']:.2f}x a plain prefill of its context "
                  f"({row['vllm_prefill_s']:.1f} s, no prompt log-probs); the {others:.0f} others after it "
                  f"{row['vllm_others_s']:.1f} s ({row['vllm_others_s'] / others * 1000:.0f} ms each) = "
                  f"{row['vllm_others_s'] / both:.0%} of the path, "
                  f"{row['vllm_others_s'] / row['cached_s']:.2f}x the cached scorer's whole time", flush=True)
    if engine is not None:
        loop.run_until_complete(engine.aclose())


if __name__ == "__main__":
    main()
