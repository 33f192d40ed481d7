"""Information gain measured on the policy engines while episodes run (rollout/probes.py).

The episodes are the scripted expert's, through the real episode loop with the real search tool
over the synthetic world (``tests/test_episode.py``); its turns are probed on the tiny model served
by the ``hf`` engine, so every value can be checked against the KV-cached transformers scorer on the
same fp32 weights (docs/algorithms.md §4: within 1e-4). Engines that delay, fail or change their
weights are small wrappers, so the timing and fault cases are exact. The vLLM engine's probes are
in ``tests/test_information_gain.py`` (its vLLM engine is built there once).
"""

from __future__ import annotations

import asyncio
import copy
import math
import time
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence

import pytest
import torch
from ray.exceptions import RayActorError
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.test_episode import chain, smallest_aggregate
from turnstile.cluster.jobs.metrics import probe_metrics
from turnstile.cluster.jobs.run import TrainJob, needs_archive, placed_rewards, probing
from turnstile.envs.env import EnvConfig
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.learner.credit import IgpoOptions, build_estimator
from turnstile.learner.credit.assign import assign_credit
from turnstile.rewards.base import RewardError, build_reward
from turnstile.rewards.information_gain.plugin import InformationGain
from turnstile.rewards.information_gain.scorers import HFInformationGainScorer
from turnstile.rewards.information_gain.values import information_gain_values
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.engines.base import Generation, PolicyEngine, Probe, ProbeUnsupported, SamplingParams
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.hf import HFEngine
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.episode import Checkpointing, EpisodeConfig, EpisodeState, run_episode
from turnstile.rollout.fleet import EngineRouter
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.probes import COST_KEY, LEAD_TEXT, MISSING_KEY, IgProbeConfig, pseudo_response
from turnstile.rollout.trajectory import StopReason, Trajectory

ATOL = 1e-4  # docs/algorithms.md §4


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf(model: PreTrainedModel) -> HFEngine:
    return HFEngine(model, EngineConfig(kind="hf", dtype="float32", max_model_len=16384))


class Composite:
    """Turns from one engine, probes from another (the expert's turns, the tiny model's belief)."""

    def __init__(self, turns: PolicyEngine, scorer: PolicyEngine) -> None:
        self.turns, self.scorer = turns, scorer
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        self.prompts.append(list(prompt_ids))
        return await self.turns.generate(prompt_ids, sampling, affinity)

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        return await self.scorer.score(sequences, spans)

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        return await self.scorer.probe(context, continuation, span, affinity)

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    async def weights_version(self) -> int:
        return 0

    async def aclose(self) -> None:
        return None


class Staged(Composite):
    """The expert's turns; probes that take ``delay_s``, fail on one boundary, and read a weights
    version that a test changes between turns. Values are a function of the probed context."""

    def __init__(self, turns: PolicyEngine, delay_s: float = 0.0, fail_at: int | None = None,
                 update_before_turn: int | None = None) -> None:
        super().__init__(turns, turns)
        self.delay_s, self.fail_at, self.update_before_turn = delay_s, fail_at, update_before_turn
        self.version = 0
        self.events: list[tuple[str, int, float]] = []  # (what, turn or probed context length, when)
        self.probed: list[tuple[int, list[int], list[int]]] = []  # (context length, context, continuation)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        turn = len(self.prompts)
        if turn == self.update_before_turn:
            self.version += 1  # a publish lands between turns
        self.events.append(("generate", turn, time.monotonic()))
        generation = await super().generate(prompt_ids, sampling, affinity)
        return Generation(generation.token_ids, generation.logprobs, generation.finish_reason, self.version)

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        version, boundary = self.version, len(self.probed)
        self.probed.append((len(context), list(context), list(continuation)))
        await asyncio.sleep(self.delay_s)
        self.events.append(("probed", len(context), time.monotonic()))
        if boundary == self.fail_at:
            raise RuntimeError("engine replica 3 is unreachable")
        return Probe(logprobs=(value_of(context),) * (span[1] - span[0]), weights_version=version,
                     prefill_tokens=len(continuation))


def value_of(context: Sequence[int]) -> float:
    return -(zlib.crc32(bytes(str(list(context)), "ascii")) % 1000) / 100


async def probed_episode(task: Task, engine: object, toolbox: Toolbox, chat: ChatFormat, *,
                         kind: str = "mono", timeout_s: float = 600.0, sample: int = 0,
                         checkpointing: Checkpointing | None = None, **limits: int) -> Trajectory:
    env = EnvConfig(max_turns=limits.pop("max_turns", 200))
    config = EpisodeConfig(env=env, context_budget=limits.pop("context_budget", 262144),
                           max_new_tokens=limits.pop("max_new_tokens", 1024),
                           ig_probe=IgProbeConfig(enabled=True, timeout_s=timeout_s))
    return await run_episode(task, task.id, sample, engine, toolbox, chat,  # type: ignore[arg-type]
                             build_context_manager(ContextConfig(kind=kind, **limits)), config,
                             checkpointing=checkpointing)


# ---- values equal the after-the-fact scorer ----------------------------------------------------

@pytest.mark.parametrize(("kind", "pick", "limits"), [
    ("mono", "chain", {}),
    ("iter_research", "chain4", {}),
    ("discard_all", "aggregate", {"context_budget": 3000, "max_new_tokens": 256, "max_turns": 24}),
])
async def test_values_measured_during_rollout_equal_the_kv_cached_scorer(
        kind: str, pick: str, limits: dict[str, int], chat: ChatFormat, tasks: list[Task],
        toolbox: Toolbox, hf: HFEngine, model: PreTrainedModel) -> None:
    task = {"chain": lambda: chain(tasks), "chain4": lambda: chain(tasks, hops=4),
            "aggregate": lambda: smallest_aggregate(tasks)}[pick]()
    expert = ScriptedEngine(chat, tasks=tasks, report=kind == "iter_research")
    trajectory = await probed_episode(task, Composite(expert, hf), toolbox, chat, kind=kind, **limits)
    online = [turn.ig_value for turn in trajectory.turns]
    assert len(online) >= 5 and None not in online and MISSING_KEY not in trajectory.metadata
    assert {turn.ig_version for turn in trajectory.turns} == {0}
    if kind == "discard_all":
        assert len(trajectory.segments) >= 2  # boundaries of later segments are their own contexts
    after = copy.deepcopy(trajectory)
    reference = await information_gain_values(after, chat, HFInformationGainScorer(model))
    assert reference is not None
    assert online == pytest.approx(reference, abs=ATOL)
    cost = trajectory.metadata[COST_KEY]
    assert cost["boundaries"] == len(online)  # type: ignore[index]
    # no prefix cache on the hf engine: every probe forwards its whole context and R
    assert cost["prefill_tokens"] == sum(t.context_len for t in trajectory.turns) + cost["pseudo_tokens"]  # type: ignore[index]


async def test_values_on_the_policys_own_rollouts_equal_the_kv_cached_scorer(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    """The engine that writes the turns probes them (the warm start on the hf engine)."""
    engine = HFEngine.from_config(EngineConfig(kind="hf", model="tiny-qwen3-mixed", dtype="float32",
                                               max_model_len=4096))
    scorer = HFInformationGainScorer(engine._model)  # type: ignore[arg-type]  # the same weights
    trajectories = [await probed_episode(task, engine, toolbox, chat, max_turns=4, max_new_tokens=160,
                                         context_budget=3072, sample=sample)
                    for sample, task in enumerate(tasks[:3])]
    assert sum(len(t.turns) for t in trajectories) >= 3
    for trajectory in trajectories:
        online = [turn.ig_value for turn in trajectory.turns]
        reference = await information_gain_values(copy.deepcopy(trajectory), chat, scorer)
        assert online == pytest.approx(reference, abs=ATOL)


# ---- the probe is never in the policy's way ----------------------------------------------------

async def test_probes_run_beside_the_next_turns_and_the_gold_never_enters_the_context(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    task = chain(tasks)
    delay = 2.0
    engine = Staged(ScriptedEngine(chat, tasks=tasks), delay_s=delay)
    trajectory = await probed_episode(task, engine, toolbox, chat)
    turns = trajectory.turns
    assert len(turns) >= 5 and trajectory.stop_reason is StopReason.ANSWERED
    # One probe of `delay` seconds per turn, yet the episode took less than one: no turn waited.
    assert trajectory.wall_s < delay
    generated = {turn: at for what, turn, at in engine.events if what == "generate"}
    probed = {length: at for what, length, at in engine.events if what == "probed"}
    for turn in turns[:-1]:  # the next turn was asked for before this boundary's probe came back
        assert generated[turn.index + 1] < probed[turn.context_len]
    # The policy saw exactly its recorded contexts, never the pseudo-response with the gold.
    (segment,) = trajectory.segments
    ids = segment.flat_ids()
    assert engine.prompts == [ids[:turn.context_len] for turn in turns]
    lead = chat.encode(LEAD_TEXT)
    assert not any(_contains(prompt, lead) for prompt in engine.prompts)
    pseudo = pseudo_response(chat, task.answers[0], think_open=False)
    assert pseudo is not None
    assert [(length, context, continuation) for length, context, continuation in engine.probed] == [
        (turn.context_len, ids[:turn.context_len], list(pseudo.ids)) for turn in turns]
    assert [turn.ig_value for turn in turns] == pytest.approx([value_of(ids[:t.context_len]) for t in turns])
    assert trajectory.metadata[COST_KEY]["wait_s"] <= delay + 1.0  # type: ignore[index]


def _contains(sequence: Sequence[int], part: Sequence[int]) -> bool:
    return any(list(sequence[i:i + len(part)]) == list(part) for i in range(len(sequence) - len(part) + 1))


async def test_each_boundary_records_the_weights_version_that_measured_it(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    engine = Staged(ScriptedEngine(chat, tasks=tasks), delay_s=0.05, update_before_turn=3)
    trajectory = await probed_episode(chain(tasks), engine, toolbox, chat)
    turns = trajectory.turns
    assert [turn.weights_version for turn in turns] == [0, 0, 0] + [1] * (len(turns) - 3)
    # the weights serving when the turn had just been generated: the turn's own
    assert [turn.ig_version for turn in turns] == [turn.weights_version for turn in turns]


# ---- faults ------------------------------------------------------------------------------------

async def test_a_failed_probe_leaves_the_information_gain_missing_not_zero(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    task = chain(tasks)
    clean = await probed_episode(task, Staged(ScriptedEngine(chat, tasks=tasks)), toolbox, chat)
    failed = await probed_episode(task, Staged(ScriptedEngine(chat, tasks=tasks), fail_at=2), toolbox, chat)
    # the episode itself is the same
    assert failed.stop_reason is clean.stop_reason is StopReason.ANSWERED
    assert [t.response_ids for t in failed.turns] == [t.response_ids for t in clean.turns]
    assert all(turn.ig_value is None and turn.ig_version is None for turn in failed.turns)
    why = failed.metadata[MISSING_KEY]
    assert isinstance(why, str) and "boundary 2" in why and "unreachable" in why
    assert probe_metrics([clean, failed])["ig/missing"] == 1.0


async def test_a_probe_past_the_timeout_leaves_the_information_gain_missing(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    engine = Staged(ScriptedEngine(chat, tasks=tasks), delay_s=30.0)
    started = time.monotonic()
    trajectory = await probed_episode(chain(tasks), engine, toolbox, chat, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert trajectory.stop_reason is StopReason.ANSWERED
    assert "not measured within 0.5 s" in str(trajectory.metadata[MISSING_KEY])
    assert all(turn.ig_value is None for turn in trajectory.turns)


async def test_the_estimator_trains_a_trajectory_with_missing_ig_on_outcome_and_format_only(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    task = chain(tasks)
    group = [await probed_episode(task, Staged(ScriptedEngine(chat, tasks=tasks), fail_at=fail), toolbox, chat,
                                  sample=sample) for sample, fail in enumerate((None, 1, None))]
    for trajectory, outcome in zip(group, (1.0, 1.0, 0.0), strict=True):
        trajectory.outcome = outcome
    assign_credit(group, build_estimator("igpo", IgpoOptions(ig_tools=[])))
    measured, missing, _ = group
    assert all(turn.ig is not None for turn in measured.turns[:-1])
    assert all(turn.ig is None for turn in missing.turns)  # no gain invented for it, no 0 either
    assert [turn.reward for turn in missing.turns[:-1]] == [None] * (len(missing.turns) - 1)
    assert missing.turns[-1].reward is not None  # its outcome still counts
    assert all(turn.advantage is not None and math.isfinite(turn.advantage) for turn in missing.turns)


async def test_a_resumed_episode_probes_only_the_boundaries_without_a_value(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    task = chain(tasks, hops=4)
    states: list[dict] = []

    async def save(state: EpisodeState) -> None:
        states.append(copy.deepcopy(state.to_json()))

    whole = await probed_episode(task, Staged(ScriptedEngine(chat, tasks=tasks)), toolbox, chat,
                                 checkpointing=Checkpointing(save=save, every=2))
    assert len(states) >= 2
    saved = EpisodeState.from_json(states[1])
    for turn in saved.trajectory.turns[-2:]:  # as if their probes had not come back before the save
        turn.ig_value = turn.ig_version = None
    known = {turn.context_len for turn in saved.trajectory.turns if turn.ig_value is not None}
    assert known
    resumed_engine = Staged(ScriptedEngine(chat, tasks=tasks))
    resumed = await probed_episode(task, resumed_engine, toolbox, chat,
                                   checkpointing=Checkpointing(resume=saved, every=2))
    probed = [length for length, _, _ in resumed_engine.probed]
    assert sorted(probed) == sorted({turn.context_len for turn in whole.turns} - known)  # none twice
    assert [turn.ig_value for turn in resumed.turns] == [turn.ig_value for turn in whole.turns]
    assert None not in [turn.ig_value for turn in resumed.turns]


class _Replica:
    """A replica handle as the router sees it (``probe.remote``), answering or dead."""

    def __init__(self, index: int, dead: bool) -> None:
        self.index, self.dead, self.calls = index, dead, 0
        self.probe = self

    def remote(self, context: list[int], continuation: list[int], span: tuple[int, int],
               affinity: str | None) -> asyncio.Future[Probe]:
        self.calls += 1
        future: asyncio.Future[Probe] = asyncio.get_running_loop().create_future()
        if self.dead:
            future.set_exception(RayActorError())
        else:
            future.set_result(Probe(logprobs=(-1.0,), weights_version=self.index, prefill_tokens=len(context)))
        return future


async def test_a_probe_whose_replica_died_is_measured_on_the_replica_that_takes_over() -> None:
    replicas = {0: _Replica(0, dead=True), 1: _Replica(1, dead=False)}
    router = EngineRouter(replicas)  # type: ignore[arg-type]
    router._affinity["t/0"] = 0  # the episode ran on replica 0
    probe = await router.probe([1, 2, 3], [4, 5], (0, 2), affinity="t/0")
    assert probe.weights_version == 1 and probe.prefill_tokens == 3  # cold there: the whole context
    assert (replicas[0].calls, replicas[1].calls) == (1, 1)  # once where it died, once where it moved
    assert router.choose("t/0") == 1  # the episode's later turns and probes follow it


# ---- which engine measures, and the plugin -----------------------------------------------------

async def test_the_scripted_engine_refuses_to_be_probed(chat: ChatFormat, tasks: list[Task]) -> None:
    with pytest.raises(ProbeUnsupported, match="scorer=kv_cache"):
        await ScriptedEngine(chat, tasks=tasks).probe([1, 2], [3], (0, 1))


def test_a_training_run_measures_on_the_engines_where_they_can_be_probed() -> None:
    ig = PluginSpec("information_gain")
    job = TrainJob(rewards=[PluginSpec("exact_match"), ig])  # the default engine: vllm
    assert [on for _, on in placed_rewards(job)] == [False, True]
    assert probing(job).rollout.episode.ig_probe.enabled and not job.rollout.episode.ig_probe.enabled
    assert not needs_archive(job)
    scripted = TrainJob(rewards=[ig])
    scripted.rollout.engine.kind = "scripted"
    assert [on for _, on in placed_rewards(scripted)] == [False]  # after the fact, on archived weights
    assert needs_archive(scripted) and not probing(scripted).rollout.episode.ig_probe.enabled
    scripted.rewards = [PluginSpec("information_gain", {"scorer": "engine"})]
    with pytest.raises(RewardError, match="cannot be probed"):
        placed_rewards(scripted)
    fixed = TrainJob(rewards=[PluginSpec("information_gain", {"model": "tiny-qwen3"})])
    assert [on for _, on in placed_rewards(fixed)] == [False]  # a model of its own: after the fact


async def test_the_plugin_keeps_the_rollouts_values_and_refuses_trajectories_never_probed(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    task = chain(tasks)
    probed = await probed_episode(task, Staged(ScriptedEngine(chat, tasks=tasks)), toolbox, chat)
    values = [turn.ig_value for turn in probed.turns]
    for scorer in ("engine", "auto"):
        await build_reward(PluginSpec("information_gain", {"scorer": scorer})).score(probed, task)
        assert [turn.ig_value for turn in probed.turns] == values
    plain = copy.deepcopy(probed)
    plain.metadata.clear()
    for turn in plain.turns:
        turn.ig_value = turn.ig_version = None
    with pytest.raises(RewardError, match="scorer=kv_cache"):
        await build_reward(PluginSpec("information_gain", {"scorer": "engine"})).score(plain, task)
    plugin = build_reward(PluginSpec("information_gain", {"scorer": "auto"}))
    assert isinstance(plugin, InformationGain)
    await plugin.score(plain, task)  # never probed: scored after the fact, on the default model
    assert None not in [turn.ig_value for turn in plain.turns]
    assert InformationGain.engine_options({"scorer": "kv_cache"}, engine_probes=True) is None


def test_the_after_the_fact_scorer_loads_where_and_as_asked() -> None:
    """``device: auto`` is the GPU Ray gave the process (a reward worker with worker_gpus), else the
    CPU; ``dtype`` is what it loads in."""
    plugin = build_reward(PluginSpec("information_gain", {"scorer": "kv_cache", "dtype": "bfloat16"}))
    assert isinstance(plugin, InformationGain)
    _, scorer = plugin._load(ensure_default_model())  # what a reward worker would load
    model = scorer.model  # type: ignore[attr-defined]
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.device.type == expected and model.dtype == torch.bfloat16
    for bad, message in (({"device": "tpu"}, "device='tpu'"), ({"dtype": "int8"}, "dtype='int8'"),
                         ({"scorer": "vllm"}, "scorer='vllm'")):
        with pytest.raises(RewardError, match=message):
            build_reward(PluginSpec("information_gain", bad))


class _Logprob:
    def __init__(self, value: float) -> None:
        self.logprob = value


class _Output:
    def __init__(self, sequence: Sequence[int], cached: int, value: float) -> None:
        self.num_cached_tokens = cached
        self.prompt_logprobs = [None, *({token: _Logprob(value)} for token in sequence[1:])]


class _OverlappedLLM:
    """vLLM's AsyncLLM as the probe sees it, with a weight update landing during the first request."""

    def __init__(self, engine: object) -> None:
        self.engine, self.requests = engine, 0
        self.vllm_config = type("C", (), {"cache_config": type("B", (), {"block_size": 32})()})()

    async def generate(self, prompt: Mapping[str, list[int]], params: object,
                       request_id: str) -> AsyncIterator[_Output]:
        self.requests += 1
        sequence = prompt["prompt_token_ids"]
        if self.requests == 1:
            self.engine._version = 7  # type: ignore[attr-defined]  # a publish overlapped this request
        yield _Output(sequence, cached=96, value=-float(self.requests))


async def test_a_vllm_probe_that_a_weight_update_overlapped_runs_again_on_the_new_version() -> None:
    from turnstile.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(EngineConfig(kind="vllm", max_model_len=1024))
    llm = _OverlappedLLM(engine)
    engine._llm = llm  # type: ignore[assignment]
    probe = await engine.probe(list(range(100)), [5, 6, 7], (1, 3), "e/0")
    assert llm.requests == 2 and probe.weights_version == 7
    assert probe.logprobs == (-2.0, -2.0)  # the second run's: all from version 7
    assert probe.prefill_tokens == 2 * (103 - 96)  # both runs count; the 3 whole 32-token blocks of 100 were cached
    assert not probe.cache_miss


class _Counting(_OverlappedLLM):
    """An AsyncLLM whose requests take a moment and never overlap a weight update."""

    async def generate(self, prompt: Mapping[str, list[int]], params: object,
                       request_id: str) -> AsyncIterator[_Output]:
        self.requests += 1
        await asyncio.sleep(0.05)
        yield _Output(prompt["prompt_token_ids"], cached=0, value=-1.0)


async def test_identical_vllm_probes_in_flight_run_once() -> None:
    """The G samples of a group probe the same first context at about the same time."""
    from turnstile.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(EngineConfig(kind="vllm", max_model_len=1024))
    llm = _Counting(engine)
    engine._llm = llm  # type: ignore[assignment]
    probes = await asyncio.gather(*(engine.probe(list(range(40)), [5, 6, 7], (1, 3), f"g/{i}") for i in range(4)))
    assert llm.requests == 1
    assert sorted(p.prefill_tokens for p in probes) == [0, 0, 0, 43]
    assert {p.logprobs for p in probes} == {(-1.0, -1.0)}
    again = await engine.probe(list(range(40)), [5, 6, 7], (1, 3), "g/4")  # answered: remembered
    assert llm.requests == 1 and again.prefill_tokens == 0


async def test_a_probe_stays_on_its_episodes_busy_replica_where_a_turn_would_move() -> None:
    replicas = {0: _Replica(0, dead=False), 1: _Replica(1, dead=False)}
    router = EngineRouter(replicas)  # type: ignore[arg-type]
    router._affinity["t/0"] = 0
    router.sent(0, EngineRouter.MOVE_AFTER + 3)  # replica 0 is busy
    probe = await router.probe([1, 2, 3], [4, 5], (0, 2), affinity="t/0")
    assert probe.weights_version == 0 and router._affinity["t/0"] == 0  # its cache, and the episode stays
    assert router.choose("t/0") == 1  # a turn would move it


async def test_failed_episodes_and_gold_without_tokens_are_not_missing_ig(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    task = chain(tasks)
    empty = Trajectory(uid="u", sample=0, task_id=task.id, question=task.question, answers=list(task.answers))
    await build_reward(PluginSpec("information_gain", {"scorer": "engine"})).score(empty, task)  # no turn: nothing
    goldless = Task(id=task.id, question=task.question, answers=("  ",), clues=task.clues, metadata=task.metadata)
    trajectory = await probed_episode(goldless, Staged(ScriptedEngine(chat, tasks=tasks)), toolbox, chat)
    assert trajectory.turns and all(turn.ig_value is None for turn in trajectory.turns)
    assert MISSING_KEY not in trajectory.metadata  # IG is off for it, as after the fact: nothing failed
    assert trajectory.metadata[COST_KEY]["boundaries"] == 0  # type: ignore[index]


async def test_auto_with_weights_of_its_own_scores_again_after_the_fact(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    task = chain(tasks)
    probed = await probed_episode(task, Staged(ScriptedEngine(chat, tasks=tasks)), toolbox, chat)
    staged = [turn.ig_value for turn in probed.turns]  # the Staged engine's made-up values
    await build_reward(PluginSpec("information_gain", {"model": "tiny-qwen3"})).score(probed, task)
    assert [turn.ig_value for turn in probed.turns] != staged
    assert InformationGain.engine_options({"versions_dir": "/runs/x/weights"}, engine_probes=True) is None
