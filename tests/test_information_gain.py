"""Information-gain values (docs/algorithms.md §4) on real trajectories of the scripted expert.

Trajectories come from the episode loop with the real search tool over the synthetic world and the
in-memory visit tool of ``tests/test_episode.py``. The reference for every value is
:class:`~turnstile.rewards.information_gain.scorers.PerPrefixScorer` (a full forward per boundary); the KV-cached
scorer and the engine scorers must equal it within 1e-4. The vLLM comparison is an integration test (one vLLM
engine for the module): ``pytest -m integration tests/test_information_gain.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.test_episode import BASE, chain, episode, smallest_aggregate
from tests.tools_for_tests import memory_toolbox
from turnstile.envs.protocol import render_answer, render_tool_call
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.learner.credit import IgpoOptions, build_estimator
from turnstile.learner.credit.assign import assign_credit
from turnstile.rewards.information_gain.scorers import HFInformationGainScorer, PerPrefixScorer
from turnstile.rewards.information_gain.values import (
    EngineGoldScorer,
    GoldScorer,
    SegmentBoundaries,
    information_gain_values,
    segment_boundaries,
)
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.base import SamplingParams
from turnstile.rollout.engines.config import EngineConfig, VllmEngineConfig
from turnstile.rollout.engines.hf import HFEngine
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.engines.vllm import VllmEngine
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.probes import LEAD_TEXT, TAIL_TEXT, PseudoResponse, pseudo_response
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn

ATOL = 1e-4  # docs/algorithms.md §4: equal to the naive per-prefix computation within 1e-4
MAX_MODEL_LEN = 8192  # the longest trajectory here (a 3-hop mono chain) is about 4k tokens


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return generate_tasks(generate_world(WorldConfig(seed=0)), QuestionConfig(), BASE)


@pytest.fixture(scope="module")
def toolbox() -> Toolbox:
    documents = world_documents(generate_world(WorldConfig(seed=0)), BASE)
    return memory_toolbox(documents)


@pytest_asyncio.fixture(scope="module")
async def trajectories(chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> dict[str, Trajectory]:
    """One trajectory per context manager; discard_all answers an aggregation question in a small
    budget, so its history is discarded several times."""
    return {
        "mono": await episode(chain(tasks), ScriptedEngine(chat, tasks=tasks), toolbox, chat),
        "iter_research": await episode(chain(tasks, hops=4),
                                       ScriptedEngine(chat, tasks=tasks, report=True), toolbox,
                                       chat, kind="iter_research"),
        "discard_all": await episode(smallest_aggregate(tasks), ScriptedEngine(chat, tasks=tasks),
                                     toolbox, chat, kind="discard_all", context_budget=3000,
                                     max_new_tokens=256, max_turns=24),
    }


@pytest.fixture(scope="module")
def mono(trajectories: dict[str, Trajectory]) -> Trajectory:
    return trajectories["mono"]


def boundaries(trajectory: Trajectory, chat: ChatFormat) -> list[SegmentBoundaries]:
    grouped = segment_boundaries(trajectory, chat, trajectory.answers[0])
    assert grouped is not None
    return grouped


def worst_gap(left: Sequence[Sequence[float]], right: Sequence[Sequence[float]]) -> float:
    assert [len(row) for row in left] == [len(row) for row in right]
    return max(abs(a - b) for l_row, r_row in zip(left, right, strict=True)
               for a, b in zip(l_row, r_row, strict=True))


class CountingScorer:
    """Wraps a scorer and counts its calls (to show a disabled trajectory is never scored)."""

    def __init__(self, inner: GoldScorer) -> None:
        self.inner, self.calls = inner, 0

    async def gold_logprobs(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]:
        self.calls += 1
        return await self.inner.gold_logprobs(segments)


class TokenCounter:
    """Counts the input ids of every forward of a model (a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: torch.nn.Module, args: tuple[object, ...],
               kwargs: dict[str, object]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        assert isinstance(ids, torch.Tensor)
        self.tokens += ids.numel()


# ---- the values ----------------------------------------------------------------------------------

async def test_cached_values_equal_per_prefix_on_a_real_trajectory(
        mono: Trajectory, chat: ChatFormat, model: PreTrainedModel) -> None:
    assert len(mono.segments) == 1 and len(mono.turns) >= 7
    values = await information_gain_values(mono, chat, HFInformationGainScorer(model))
    assert values is not None and len(values) == len(mono.turns)
    assert [turn.ig_value for turn in mono.turns] == values
    assert all(value < 0 for value in values)
    grouped = boundaries(mono, chat)
    cached = await HFInformationGainScorer(model).gold_logprobs(grouped)
    naive = await PerPrefixScorer(model).gold_logprobs(grouped)
    assert worst_gap(cached, naive) <= ATOL
    gold_len = len(chat.encode(mono.answers[0]))
    assert all(len(row) == gold_len for row in cached)
    for value, row in zip(values, naive, strict=True):  # v_s is the mean over the gold tokens only
        assert value == pytest.approx(sum(row) / len(row), abs=ATOL)


@pytest.mark.parametrize("kind", ["iter_research", "discard_all"])
async def test_each_boundary_uses_its_own_segments_context(
        kind: str, trajectories: dict[str, Trajectory], chat: ChatFormat,
        model: PreTrainedModel) -> None:
    trajectory = trajectories[kind]
    assert len(trajectory.segments) >= 3, [len(s.turns) for s in trajectory.segments]
    grouped = boundaries(trajectory, chat)
    assert [len(g.prefix_lens) for g in grouped] == [len(s.turns) for s in trajectory.segments]
    for segment, group in zip(trajectory.segments, grouped, strict=True):
        flat = segment.flat_ids()
        for boundary, turn in enumerate(segment.turns):
            sequence = group.sequence(boundary)
            assert sequence[:turn.context_len] == flat[:turn.context_len]
            assert group.turns[boundary] == turn.index
        assert group.sequence(0)[:group.prefix_lens[0]] == segment.prompt_ids
    cached = await HFInformationGainScorer(model).gold_logprobs(grouped)
    naive = await PerPrefixScorer(model).gold_logprobs(grouped)
    assert worst_gap(cached, naive) <= ATOL
    values = await information_gain_values(trajectory, chat, HFInformationGainScorer(model))
    assert values is not None and values == [turn.ig_value for turn in trajectory.turns]


async def test_v0_is_the_question_only_baseline(mono: Trajectory, chat: ChatFormat,
                                                model: PreTrainedModel) -> None:
    prompt = mono.segments[0].prompt_ids
    gold = chat.encode(mono.answers[0])
    lead = chat.encode("<think>\n" + LEAD_TEXT)
    sequence = [*prompt, *lead, *gold, *chat.encode(TAIL_TEXT), chat.turn_end_id]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([sequence])).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) + len(lead)
    expected = sum(float(logprobs[start + i - 1, token]) for i, token in enumerate(gold)) / len(gold)
    values = await information_gain_values(mono, chat, HFInformationGainScorer(model))
    assert values is not None and values[0] == pytest.approx(expected, abs=ATOL)
    # the later turns do not move it: the first turn alone gives the same v_0
    first_only = replace(mono, segments=[Segment(prompt_ids=list(prompt),
                                                 turns=[replace(mono.turns[0])])])
    alone = await information_gain_values(first_only, chat, HFInformationGainScorer(model))
    assert alone == [pytest.approx(values[0], abs=ATOL)]


def test_pseudo_response_reads_as_the_start_of_the_policys_turn(mono: Trajectory,
                                                                 chat: ChatFormat) -> None:
    (group,) = boundaries(mono, chat)
    gold = mono.answers[0]
    start, end = group.gold_span(2)
    sequence = group.sequence(2)
    assert chat.decode(sequence[start:end]) == gold
    appended = chat.decode(sequence[group.prefix_lens[2]:])
    assert chat.decode(sequence[:group.prefix_lens[2]]).endswith("<|im_start|>assistant\n")
    assert appended == f"<think>\n{LEAD_TEXT}{gold}{TAIL_TEXT}<|im_end|>"
    # a template whose generation prompt opens the think block: the lead starts inside it
    thinking = Trajectory(uid="u", sample=0, task_id="t", question="q", answers=[gold],
                          segments=[replace(mono.segments[0], prompt_ids=[
                              *mono.segments[0].prompt_ids, *chat.encode("<think>\n")],
                              turns=[replace(mono.turns[0], context_len=len(
                                  mono.segments[0].prompt_ids) + 2)])])
    (opened,) = boundaries(thinking, chat)
    assert chat.decode(opened.sequence(0)[opened.prefix_lens[0]:]) == \
        f"{LEAD_TEXT}{gold}{TAIL_TEXT}<|im_end|>"
    assert pseudo_response(chat, "  ", think_open=False) is None


@pytest.mark.parametrize("answers", [[""], ["  \n "], []])
async def test_a_gold_answer_without_tokens_disables_ig(
        answers: list[str], mono: Trajectory, chat: ChatFormat, model: PreTrainedModel,
        caplog: pytest.LogCaptureFixture) -> None:
    trajectory = replace(mono, answers=answers, segments=[
        replace(segment, turns=[replace(turn, ig_value=-1.0) for turn in segment.turns])
        for segment in mono.segments])
    scorer = CountingScorer(HFInformationGainScorer(model))
    with caplog.at_level(logging.WARNING, logger="turnstile.rewards.information_gain.values"):
        assert await information_gain_values(trajectory, chat, scorer) is None
    assert scorer.calls == 0
    assert all(turn.ig_value is None for turn in trajectory.turns)
    assert "no tokens" in caplog.text and "outcome reward only" in caplog.text


async def test_inconsistent_context_len_is_rejected(mono: Trajectory, chat: ChatFormat) -> None:
    broken = replace(mono, segments=[replace(mono.segments[0], turns=[
        *mono.turns[:3], replace(mono.turns[3], context_len=mono.turns[3].context_len + 1),
        *mono.turns[4:]])])
    with pytest.raises(ValueError, match="turn 3 records context_len"):
        segment_boundaries(broken, chat, "x")



# ---- every turn boundary, malformed turns included (ig_tools = []) -------------------------------

class TableScorer:
    """A :class:`GoldScorer` stub: every gold token of the boundary before turn ``s`` gets log-prob
    ``table[s]``, so ``v_s = table[s]``; it records which turns it was asked to score."""

    def __init__(self, table: dict[int, float]) -> None:
        self.table, self.scored = table, []

    async def gold_logprobs(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]:
        rows = []
        for segment in segments:
            for turn, pseudo in zip(segment.turns, segment.pseudo, strict=True):
                self.scored.append(turn)
                rows.append([self.table[turn]] * (pseudo.gold_end - pseudo.gold_start))
        return rows


def search_malformed_visit_answer(chat: ChatFormat) -> Trajectory:
    """A mono trajectory: t0 search, t1 malformed, t2 visit, t3 answer; context lengths consistent."""
    prompt = chat.prompt_ids([{"role": "user", "content": "Who founded Quill?"}])
    actions = [
        ("tool_call", "search", True, render_tool_call("search", {"query": ["Quill"]}, "Search it.")),
        ("malformed", None, False, "<think>Now visit it.</think> no call here"),
        ("tool_call", "visit", True, render_tool_call("visit", {"url": "http://w/q", "goal": "g"}, "Read.")),
        ("answer", None, True, render_answer("Ada", "It says Ada.")),
    ]
    turns, length = [], len(prompt)
    for index, (action, tool, format_ok, text) in enumerate(actions):
        response = chat.encode(text)
        observation = [] if action == "answer" else chat.delta_ids("<tool_response>\nok\n</tool_response>",
                                                                     response)
        turns.append(Turn(index=index, response_ids=response, response_logprobs=[0.0] * len(response),
                          weights_version=0, context_len=length, finish_reason="stop",
                          response_text=text, action=action, tool=tool, format_ok=format_ok,
                          observation_ids=observation))
        length += len(response) + len(observation)
    return Trajectory(uid="u", sample=0, task_id="t", question="Who founded Quill?", answers=["Ada"],
                      segments=[Segment(prompt_ids=prompt, turns=turns)],
                      stop_reason=StopReason.ANSWERED, answer="Ada", outcome=1.0)


async def test_without_a_tool_filter_the_gain_after_a_malformed_turn_starts_from_it(
        chat: ChatFormat) -> None:
    """docs/algorithms.md §4: ``ig_tools = []`` keeps every turn boundary, malformed turns included; the
    malformed turn's reward is the format penalty (§5) and the visit's gain is measured from the
    boundary after the malformed turn, not from the one after the search."""
    trajectory = search_malformed_visit_answer(chat)
    scorer = TableScorer({0: -3.0, 1: -2.5, 2: -2.25, 3: -1.0})
    values = await information_gain_values(trajectory, chat, scorer)
    assert scorer.scored == [0, 1, 2, 3]  # the boundary before every turn, the malformed one too
    assert values == [-3.0, -2.5, -2.25, -1.0]

    assign_credit([trajectory], build_estimator("igpo", IgpoOptions(ig_tools=[])))
    turns = trajectory.turns
    assert [turn.ig for turn in turns] == [0.5, 0.25, 1.25, None]  # v1−v0, v2−v1, v3−v2
    assert [turn.reward for turn in turns] == [0.5, -1.0, 1.25, 1.0]  # penalty in place of the IG
    assert sum(turn.ig for turn in turns[:-1]) == values[-1] - values[0]  # telescoping

    # Browse-aware (the default): the malformed turn is no boundary of IG and moves no baseline.
    assign_credit([trajectory], build_estimator("igpo"))
    assert [turn.ig for turn in turns] == [None, None, 2.0, None]  # v3 − v0
    assert [turn.reward for turn in turns] == [None, -1.0, 2.0, 1.0]

# ---- the cost ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mono", "discard_all"])
def test_cost_is_linear_in_tokens_forwarded(kind: str, trajectories: dict[str, Trajectory],
                                            chat: ChatFormat, model: PreTrainedModel) -> None:
    trajectory = trajectories[kind]
    grouped = boundaries(trajectory, chat)
    length = sum(len(group.context_ids) for group in grouped)  # L: the contexts, each once
    assert length <= sum(len(segment) for segment in trajectory.segments)
    pseudo_len = max(len(p.ids) for group in grouped for p in group.pseudo)  # R
    turns = len(trajectory.turns)  # T
    counter = TokenCounter(model)
    try:
        HFInformationGainScorer(model).gold_logprobs_now(grouped)
        cached = counter.tokens
        counter.tokens = 0
        PerPrefixScorer(model).gold_logprobs_now(grouped)
        naive = counter.tokens
    finally:
        counter.handle.remove()
    assert cached <= length + turns * pseudo_len
    assert naive == sum(len(group.sequence(b)) for group in grouped
                        for b in range(len(group.prefix_lens)))
    if kind == "mono":
        assert naive > 3 * cached  # Σ prefixes ~ T·L/2 against L + T·R


class ForwardCounter:
    """Counts the forwards of a model (a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.handle = model.register_forward_pre_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.calls += 1


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_boundaries_go_packed_in_chunks_that_bound_the_mask_and_change_no_value(
        attention: str, trajectories: dict[str, Trajectory], chat: ChatFormat) -> None:
    """All boundaries but the last in one packed forward, or in chunks when the mask would be
    larger than allowed: the same gold log-probs as one forward per boundary (1e-5), with SDPA's
    boolean mask and eager attention's additive one."""
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32,
                                                 attn_implementation=attention).eval()
    grouped = boundaries(trajectories["discard_all"], chat) + boundaries(trajectories["mono"], chat)
    naive = PerPrefixScorer(model).gold_logprobs_now(grouped)
    counter = ForwardCounter(model)
    try:
        whole = HFInformationGainScorer(model).gold_logprobs_now(grouped)
        assert counter.calls == sum(1 + (len(group.prefix_lens) > 1) for group in grouped)
        counter.calls = 0
        longest = max(len(group.context_ids) for group in grouped)
        pseudo = max(len(p.ids) for group in grouped for p in group.pseudo)
        small = HFInformationGainScorer(model, max_mask_elements=3 * pseudo * (longest + 3 * pseudo))
        chunked = small.gold_logprobs_now(grouped)
        mono = grouped[-1]
        assert counter.calls > len(grouped) + (len(mono.prefix_lens) - 1) // 3  # chunks of <= 3 boundaries
    finally:
        counter.handle.remove()
    assert worst_gap(whole, naive) <= 1e-5
    assert worst_gap(chunked, naive) <= 1e-5


def test_flash_attention_is_refused_with_a_way_out() -> None:
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    model.config._attn_implementation = "flash_attention_2"  # what from_pretrained sets
    with pytest.raises(ValueError, match="PerPrefixScorer"):
        HFInformationGainScorer(model)


def test_a_cache_that_cannot_be_cut_back_is_refused() -> None:
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         use_sliding_window=True, sliding_window=4, max_window_layers=0)
    torch.manual_seed(0)
    windowed = Qwen3ForCausalLM(config)
    group = boundaries_of_ids(list(range(3, 20)), prefixes=(6, 17))
    with pytest.raises(ValueError, match="PerPrefixScorer"):
        HFInformationGainScorer(windowed).gold_logprobs_now([group])


def boundaries_of_ids(context: list[int], prefixes: tuple[int, ...]) -> SegmentBoundaries:
    pseudo = PseudoResponse(ids=(30, 31, 32, 33), gold_start=1, gold_end=3)
    return SegmentBoundaries(context_ids=tuple(context[:max(prefixes)]), prefix_lens=prefixes,
                             pseudo=(pseudo,) * len(prefixes), turns=tuple(range(len(prefixes))))


# ---- engine paths --------------------------------------------------------------------------------

async def test_engine_scorer_on_the_hf_engine_agrees(mono: Trajectory, chat: ChatFormat,
                                                     model: PreTrainedModel) -> None:
    engine = HFEngine(model, EngineConfig(kind="hf", model="", dtype="float32",
                                          max_model_len=MAX_MODEL_LEN))
    grouped = boundaries(mono, chat)
    through_engine = await EngineGoldScorer(engine).gold_logprobs(grouped)
    cached = await HFInformationGainScorer(model).gold_logprobs(grouped)
    assert worst_gap(through_engine, cached) <= ATOL


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_engine() -> AsyncIterator[VllmEngine]:
    engine = VllmEngine.from_config(EngineConfig(
        kind="vllm", model="", dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
        vllm=VllmEngineConfig(kv_cache_memory_bytes=128 << 20, max_num_seqs=32)))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.aclose()


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_and_hf_paths_agree(vllm_engine: VllmEngine,
                                       trajectories: dict[str, Trajectory], chat: ChatFormat,
                                       model: PreTrainedModel) -> None:
    for trajectory in trajectories.values():
        grouped = boundaries(trajectory, chat)
        through_vllm = await EngineGoldScorer(vllm_engine).gold_logprobs(grouped)
        cached = await HFInformationGainScorer(model).gold_logprobs(grouped)
        assert worst_gap(through_vllm, cached) <= ATOL
        on_vllm = await information_gain_values(trajectory, chat, EngineGoldScorer(vllm_engine))
        on_hf = await information_gain_values(trajectory, chat, HFInformationGainScorer(model))
        assert on_vllm == pytest.approx(on_hf, abs=ATOL)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_path_reads_the_segment_context_from_the_prefix_cache(
        vllm_engine: VllmEngine, trajectories: dict[str, Trajectory], chat: ChatFormat,
        model: PreTrainedModel) -> None:
    grouped = boundaries(trajectories["mono"], chat)
    before = vllm_engine.reused_prompt_tokens
    through_vllm = await EngineGoldScorer(vllm_engine).gold_logprobs(grouped)
    reused = vllm_engine.reused_prompt_tokens - before
    assert worst_gap(through_vllm, await HFInformationGainScorer(model).gold_logprobs(grouped)) <= ATOL
    block = 128  # the most a boundary can miss: its prefix is cached in whole blocks
    shorter = [length for segment in grouped for length in sorted(segment.prefix_lens)[:-1]]
    assert len(shorter) >= 5
    assert reused >= sum(max(length - block, 0) for length in shorter)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_probes_read_the_context_the_turn_just_prefilled(
        vllm_engine: VllmEngine, trajectories: dict[str, Trajectory], chat: ChatFormat,
        model: PreTrainedModel) -> None:
    """A rollout's probe on vLLM (rollout/probes.py): sent once the turn's request has prefilled the
    context, it forwards only the context's last, partly filled cache block and the pseudo-response,
    and equals the KV-cached transformers scorer. An evicted prefix gives the same value, forwards
    the whole sequence and is counted; an identical probe is answered from memory."""
    await vllm_engine.reset_prefix_cache()
    grouped = boundaries(trajectories["mono"], chat)
    (segment,) = grouped
    reference = await HFInformationGainScorer(model).gold_logprobs(grouped)
    block = 128  # vLLM's block on CPU (engine.vllm.block_size 0)
    *warm, cold = range(len(segment.prefix_lens))
    for boundary in warm:
        context, pseudo = list(segment.context_ids[:segment.prefix_lens[boundary]]), segment.pseudo[boundary]
        await vllm_engine.generate(context, SamplingParams(max_new_tokens=4, temperature=0.0))  # the turn
        probe = await vllm_engine.probe(context, pseudo.ids, (pseudo.gold_start, pseudo.gold_end), "e/0")
        assert list(probe.logprobs) == pytest.approx(reference[boundary], abs=ATOL)
        assert not probe.cache_miss and probe.weights_version == 0
        assert probe.prefill_tokens == len(context) % block + len(pseudo.ids)
    await vllm_engine.reset_prefix_cache()  # evicted
    context, pseudo = list(segment.context_ids[:segment.prefix_lens[cold]]), segment.pseudo[cold]
    probe = await vllm_engine.probe(context, pseudo.ids, (pseudo.gold_start, pseudo.gold_end), "e/0")
    assert list(probe.logprobs) == pytest.approx(reference[cold], abs=ATOL)
    assert probe.cache_miss and probe.prefill_tokens == len(context) + len(pseudo.ids)
    again = await vllm_engine.probe(context, pseudo.ids, (pseudo.gold_start, pseudo.gold_end), "e/1")
    assert again.logprobs == probe.logprobs and again.prefill_tokens == 0


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_a_reset_prefix_cache_makes_the_next_request_cold(
        vllm_engine: VllmEngine, trajectories: dict[str, Trajectory], chat: ChatFormat) -> None:
    """What benchmarks/ig_scoring.py does before each measurement."""
    (segment, *_) = boundaries(trajectories["mono"], chat)
    longest = max(range(len(segment.prefix_lens)), key=lambda b: segment.prefix_lens[b])
    request = ([segment.sequence(longest)], [segment.gold_span(longest)])
    await vllm_engine.reset_prefix_cache()  # cold, whatever the tests before left cached
    first = await vllm_engine.score(*request)
    before = vllm_engine.reused_prompt_tokens
    # warm and cold differ only by float rounding (the prefill is cut into other chunks)
    assert worst_gap(await vllm_engine.score(*request), first) <= ATOL
    assert vllm_engine.reused_prompt_tokens > before  # warm: the prefix came from the cache
    await vllm_engine.reset_prefix_cache()
    before = vllm_engine.reused_prompt_tokens
    assert await vllm_engine.score(*request) == first  # cold again: the same computation
    assert vllm_engine.reused_prompt_tokens == before  # cold: nothing was cached


# ---- scoring with the weights version that generated the trajectory ------------------------------

def _perturbed(scale: float) -> dict[str, torch.Tensor]:
    base = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    generator = torch.Generator().manual_seed(int(scale * 1000))
    return {name: tensor + scale * torch.randn(tensor.shape, generator=generator)
            for name, tensor in base.state_dict().items()}


async def test_ig_scores_with_the_generating_version_or_the_closest_kept(mono: Trajectory,
                                                                          tmp_path: Path) -> None:
    from turnstile.learner.publish import WeightsArchive
    from turnstile.rewards.information_gain.plugin import InformationGain, InformationGainConfig
    from turnstile.rollout.model_store import closest_version, kept_versions

    archive = WeightsArchive(tmp_path / "weights", ensure_default_model(), keep=3)
    assert sorted(kept_versions(archive.root)) == [0]  # version 0 is the base model
    for version in (1, 2, 3):
        archive.add(version, _perturbed(0.02 * version))
    assert sorted(kept_versions(archive.root)) == [1, 2, 3]  # the oldest (0) was pruned
    assert closest_version(archive.root, 0)[0] == 1 and closest_version(archive.root, 9)[0] == 3
    with pytest.raises(FileNotFoundError, match="holds no version"):
        closest_version(tmp_path / "empty", 1)

    plugin = InformationGain(InformationGainConfig(versions_dir=str(archive.root)))
    values: dict[int, list[float | None]] = {}
    for version in (2, 3, 0):
        trajectory = Trajectory.from_json(mono.to_json())
        for index, turn in enumerate(trajectory.turns):  # mostly `version`, one turn a version newer
            turn.weights_version = version + 1 if index == 0 else version
        await plugin.score(trajectory, Task(id=trajectory.task_id, question=trajectory.question,
                                            answers=tuple(trajectory.answers)))
        values[version] = [turn.ig_value for turn in trajectory.turns]
        expected = 1 if version == 0 else version  # 0 is no longer kept: the closest is 1
        assert trajectory.metadata["ig_weights_version"] == expected
    assert values[2] != values[3]  # different weights, different values
    # The same version scores the same: version 2 again, from the plugin's loaded models.
    again = Trajectory.from_json(mono.to_json())
    for turn in again.turns:
        turn.weights_version = 2
    await plugin.score(again, Task(id=again.task_id, question=again.question, answers=tuple(again.answers)))
    assert [turn.ig_value for turn in again.turns] == pytest.approx(values[2], abs=1e-5)


async def test_a_real_pretrained_model_gains_from_the_page_that_holds_the_answer(shared_data: Path) -> None:
    """The scorer on a pretrained Llama with tied embeddings and a 49k vocabulary, in its own
    template (SmolLM2-135M-Instruct, from its package), on HotpotQA: the cached values equal one
    forward per prefix, and reading the supporting paragraph that holds the answer makes the gold
    answer likelier (v rises) on most questions: the signal IGPO rewards, from a real model."""
    import json

    from turnstile.learner.sft import chat_trajectories
    from turnstile.rollout.model_store import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    real_chat = ChatFormat.from_pretrained(path)
    real_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with (shared_data / "multihop/hotpotqa_dev500.jsonl").open() as lines:
        for line in lines:
            record = json.loads(line)
            answer = record["answers"][0]
            page = next((p for p in record["paragraphs"] if p["is_supporting"] and answer in p["text"]), None)
            if page is None or answer.lower() in ("yes", "no"):
                continue
            rows.append((len(rows) + 1, {"answer": answer, "messages": [
                {"role": "user", "content": record["question"]},
                {"role": "assistant", "content": render_tool_call("search", {"query": [page["title"]]},
                                                                  f"I search for {page['title']}.")},
                {"role": "user", "content": f"<tool_response>\n{page['title']}\n{page['text']}\n</tool_response>"},
                {"role": "assistant", "content": render_answer(answer, "The page says it.")}]}))
            if len(rows) == 12:
                break
    rose = 0
    for trajectory in chat_trajectories(rows, real_chat):
        values = await information_gain_values(trajectory, real_chat, HFInformationGainScorer(real_model))
        assert values is not None and len(values) == 2 and all(value < 0 for value in values)
        rose += values[1] > values[0] + 0.5  # before the search turn, then after reading the page
        grouped = boundaries(trajectory, real_chat)
        cached = await HFInformationGainScorer(real_model).gold_logprobs(grouped)
        assert worst_gap(cached, await PerPrefixScorer(real_model).gold_logprobs(grouped)) <= 1e-3
    assert rose >= 9, f"the page raised v on only {rose} of 12 questions"
