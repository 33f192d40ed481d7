"""The warm start: the tiny model fine-tuned on the scripted expert (and on a hasty agent), for
reinforcement learning.

Two models are built here, each by its recipe in :data:`RECIPES`: ``tiny-qwen3-sft`` (described
below) and ``tiny-qwen3-mixed``, the warm start of ``turnstile train``: ``tiny-qwen3-sft`` after 100
SFT steps on the expert's trajectories of the first 800 training tasks, half of them answered by a
hasty agent that answers from the search listing without opening a page
(``ExpertConfig.hasty_fraction``). From ``tiny-qwen3-sft`` reinforcement learning had only
token-level errors to fix, below the gradient noise of the default's budget; the mixed model has
one decision every episode shares (open the page or guess), which the reward alone can teach
(docs/benchmarks/learning.md).

A random-weight policy writes no well-formed turn, so every sample of a group gets the same reward
and reinforcement learning has nothing to work with. ``tiny-qwen3-sft`` is the tiny model
(:mod:`turnstile.rollout.model_store`) after supervised fine-tuning on the scripted expert's trajectories of
the default training tasks, through the real tools.

The recipe (:class:`WarmStartRecipe`, one command: ``turnstile build-model tiny-qwen3-sft --out DIR``):

1. the expert (``engine.kind=scripted``) runs every training task of 5,000 questions of the
   default mix (the name one relation away) once through the Ray fleet with the default episode
   settings, the corpus served on a fixed port
   (:data:`~turnstile.cluster.jobs.defaults.WARM_CORPUS_PORT`: the same URLs on every machine, and where
   ``turnstile train`` serves it); its correct trajectories are the data. Its
   thoughts are written to be copied from: it cites the result it opens as the search listed it
   (``[X](url)``) and quotes the fact the page gave (``Publisher: Y``), and pages live at
   Wikipedia-style addresses (``/wiki/Kratro_Labyrinth``), so an address is the name's own tokens;
2. copying (:class:`RepeatedRuns`): the random tiny model learns to predict the second copy of a
   random token run. Every question needs copying (the entity into the search, a URL from the
   results, the name from the page into the answer), and the expert's data alone did not teach
   it: after 600 SFT steps the model predicted the query's second token 2 times in 40 held-out
   turns, teacher-forced;
3. SFT: cross-entropy on the policy's own tokens, plus the tool results' tokens at
   ``observation_weight`` (they repeat the query and the page names: more copying to learn from),
   plus the copying loss (so it is kept while SFT puts it to use); AdamW, warm-up then cosine
   decay, one sequence per forward (no padding), logits only where the loss is, a fixed seed.

Why not veRL's trainer (the learner every RL step uses, and ``turnstile sft``): on 2 CPU cores it
runs at about half the arithmetic's speed (``benchmarks/learner_overhead.py``), and the build is
the longest thing here: about 90 minutes on 2 cores (14 of expert data, 72 of training), longer
than a first run may take, so the result is committed (``rollout/models/tiny-qwen3-sft``, 7.4 MB)
with the CI-sized rebuild check :func:`rebuild_record` records. A killed build continues where it
stopped (:func:`build_warm_model`).

Why this mix (docs/benchmarks/learning.md): the tiny model copies a name it has read (rare tokens)
but not a value (a year, a colour: frequent tokens with a strong prior), so questions whose answer
is a value were answered 0.9% of the time by the previous recipe; and it writes a port from memory
rather than copying it, so the data uses the one port the default serves on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnstile.cluster.jobs.defaults import (
    DEFAULT_TASKS,
    MULTIHOP_TASKS,
    MULTIHOP_TURNS,
    WARM_CORPUS_PORT,
    default_episode,
)
from turnstile.cluster.jobs.rollout import run_rollout
from turnstile.cluster.jobs.session import RolloutJob
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.envs.files import atomic_directory, atomic_path
from turnstile.envs.synthetic.expert import ExpertConfig
from turnstile.rollout.context import ContextConfig
from turnstile.rollout.model_store import (
    BUILD_INFO,
    ITER_MODEL,
    MULTIHOP_MODEL,
    RANDOM_MODEL,
    SFT_MODEL,
    WARM_MODEL,
    resolve_model,
)
from turnstile.rollout.trajectory import Trajectory, load_trajectories, save_trajectories

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

@dataclass(frozen=True)
class WarmStartRecipe:
    """Everything that decides a model this module builds (recorded in its ``turnstile-model.json``):
    by default ``tiny-qwen3-sft``'s; :data:`RECIPES` has both."""

    base: str = RANDOM_MODEL  # the model the recipe starts from (a name or a directory)
    # The expert's data: the training split of 5,000 questions of the default mix (the split depends
    # only on a question's id, so none of the default's held-out questions is among them).
    tasks: dict[str, Any] = field(default_factory=lambda: {**DEFAULT_TASKS, "count": 5000})
    # The corpus is served on each of these ports for an equal share of the tasks: fixed, so every
    # machine's trajectories hold the same URLs. With 8 or 32 ports the model still wrote a port it
    # was trained on rather than copying it, so the recipe uses one, where the default serves.
    corpus_ports: tuple[int, ...] = (WARM_CORPUS_PORT,)
    limit: int | None = None  # only the first tasks of the training split (of each port's share)
    # The share of tasks the expert answers hastily: from the first search listing, without opening
    # a page (a guess, nearly always wrong). Those trajectories are kept whatever their outcome; the
    # others only when correct (:func:`expert_trajectories`).
    hasty_fraction: float = 0.0
    # The share of multi-hop tasks the expert stops early, answering with a bridge entity
    # (ExpertConfig.early_fraction); kept whatever their outcome, as the hasty ones.
    early_fraction: float = 0.0
    max_turns: int = 6  # the expert's episodes (the default's, unless the questions need more hops)
    context_budget: int = 3072
    # The context manager the expert's episodes run in: with iter_research every turn also writes
    # the <report> that protocol carries from one round to the next (engine.scripted.report).
    context: str = "mono"
    induction_steps: int = 500  # stage 1: copying random token runs, before any expert data
    induction_batch: int = 32  # runs per step, each 32 tokens written twice
    induction_weight: float = 1.0  # the same copying loss added to every SFT step, so it stays
    steps: int = 800
    batch: int = 8  # sequences per optimiser step
    lr: float = 2e-3
    warmup_steps: int = 30
    observation_weight: float = 0.2  # loss on the tool results' tokens, relative to the policy's
    # Tokens of one training sequence: at least the context budget, so that no episode the recipe
    # runs is cut (a cut sequence loses its last turns, the answer among them)
    max_length: int = 3072
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_length < self.context_budget:
            raise ValueError(f"max_length={self.max_length} is below context_budget={self.context_budget}: "
                             "the longest episodes would be cut before their last turns")


RECIPES: dict[str, WarmStartRecipe] = {
    SFT_MODEL: WarmStartRecipe(),
    # The warm start: tiny-qwen3-sft after a short SFT on the first 800 training tasks, the expert
    # answering half of them hastily. It opens the page about half the time, and which half pays
    # is what the reward alone can teach (docs/benchmarks/learning.md).
    WARM_MODEL: WarmStartRecipe(base=SFT_MODEL, limit=800, hasty_fraction=0.5, induction_steps=0,
                                steps=100, lr=5e-4, warmup_steps=10),
    # The start of the mono vs iter_research ablation: the warm start after the same kind of data,
    # each turn in its own round with a <report> (the warm start never writes one: every
    # iter_research turn of it is malformed). Its data are 2,156 rounds of 712 episodes: 150 steps
    # (0.6 epoch) left it at 28% well-formed turns and 0% of 110 held-out episodes answered right,
    # so it takes 500 (1.9 epochs). Not committed; benchmarks/learning.py builds it.
    ITER_MODEL: WarmStartRecipe(base=WARM_MODEL, limit=800, hasty_fraction=0.5, context="iter_research",
                                induction_steps=0, steps=500, lr=5e-4, warmup_steps=10),
    # The start of the multi-hop comparison (issue 36): the warm start after SFT on two- and
    # three-hop chains (up to seven turns), a quarter of them stopped early at a bridge entity (a
    # wrong answer), so that it sometimes finishes a chain and most groups of its samples are all
    # wrong. A first build (800 tasks, half stopped early, 150 steps) answered 1.0% of 195 held-out
    # questions (2 of 78 two-hop, 0 of 117 three-hop): it stopped after one hop in 37% of episodes
    # and, when it read the last page, miscopied the name at the longer contexts (median 2,678 tokens
    # before the answer, against 1,622 for the default's one-hop questions); hence fewer early stops
    # and more data and steps. The second build (5.6% of 195, three-hop 0%) trained on sequences cut
    # at 3,072 tokens while its episodes ran to 4,096: it never saw a turn written past ~3,000 tokens
    # of context, and writes almost none well formed there (11% of turns at 3,000-3,500 tokens, 6%
    # beyond, against 98% under 1,000), so a three-hop chain (seven turns, ~3,400 tokens) breaks
    # before its end; hence sequences as long as the episodes' budget plus one turn.
    MULTIHOP_MODEL: WarmStartRecipe(base=WARM_MODEL, tasks={**MULTIHOP_TASKS, "count": 5000}, limit=1600,
                                    early_fraction=0.25, max_turns=MULTIHOP_TURNS, context_budget=4096,
                                    max_length=4096 + 256, induction_steps=0, steps=400, lr=5e-4,
                                    warmup_steps=10),
}
"""The recipe of each model this module builds, by name (``turnstile build-model NAME --out DIR``)."""

WHAT = {
    SFT_MODEL: "the tiny Qwen3 after SFT on the scripted expert's correct trajectories of the "
               "embedded default's training tasks",
    WARM_MODEL: "tiny-qwen3-sft after SFT on two agents' trajectories of the embedded default's "
                "training tasks: the scripted expert's correct ones and, for half of the tasks, a "
                "hasty agent's, which answers from the search listing without opening a page (the "
                "warm start of `turnstile train`)",
    ITER_MODEL: "tiny-qwen3-mixed after SFT on the same two agents' trajectories in the iter_research "
                "context, every turn with its <report> (the start of the mono vs iter_research ablation)",
    MULTIHOP_MODEL: "tiny-qwen3-mixed after SFT on the expert's two- and three-hop chains, a quarter of "
                    "them stopped early at a bridge entity (the start of the multi-hop credit comparison)",
}


def build_warm_model(target: Path, recipe: WarmStartRecipe | None = None, *, name: str = WARM_MODEL,
                     force: bool = False, progress: bool = True) -> Path:
    """Run ``recipe`` (by default :data:`RECIPES` ``[name]``) and write the model directory
    ``target`` (atomically), its record naming it ``name``; returns it.

    Resumable: the expert's data and a training checkpoint every :data:`CHECKPOINT_EVERY` steps are
    kept in ``.<target>.work`` beside it while it builds (for this recipe only: its digest names
    them), so a killed build continues where it stopped; the directory goes once the model is built."""
    recipe = recipe or RECIPES[name]
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists; pass --force to rebuild it")
    work = work_dir(target, recipe)
    work.mkdir(parents=True, exist_ok=True)
    data, timing = work / "expert.jsonl", work / "expert.seconds"
    if data.is_file() and timing.is_file():
        trajectories, data_s = load_trajectories(data), float(timing.read_text())
    else:
        started = time.monotonic()
        trajectories = expert_trajectories(recipe, work / "expert-run.jsonl", progress=progress)
        data_s = time.monotonic() - started
        timing.write_text(f"{data_s:.1f}\n")
        save_trajectories(trajectories, data)  # the data last: with it, both files are there
    built = train_warm_model(target, trajectories, recipe, name=name, data_seconds=data_s,
                             progress=progress, checkpoint=work / "train.pt")
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        work.parent.rmdir()  # unless another recipe's build is under way
    return built


CHECKPOINT_EVERY = 50  # SFT steps between the build's resume checkpoints


def work_dir(target: Path, recipe: WarmStartRecipe) -> Path:
    """Where a build of ``recipe`` into ``target`` keeps its data and checkpoints until it is done."""
    digest = hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True).encode()).hexdigest()[:12]
    return target.parent / f".{target.name}.work" / digest


def train_warm_model(target: Path, trajectories: list[Trajectory], recipe: WarmStartRecipe, *,
                     name: str = WARM_MODEL, data_seconds: float = 0.0, progress: bool = True,
                     monitor: Callable[[int, Any], None] | None = None,
                     checkpoint: Path | None = None) -> Path:
    """Stage the SFT of the recipe's base model on the expert's ``trajectories`` and its record,
    then move the directory to ``target`` (replacing it)."""
    base = Path(resolve_model(recipe.base))
    with atomic_directory(target, force=True) as staging:
        sequences = training_sequences(trajectories, recipe.max_length)
        report = train_sft(base, sequences, recipe, staging, progress=progress, monitor=monitor,
                           checkpoint=checkpoint)
        info = {
            "name": name,
            "what": WHAT.get(name, "a model built by cluster.recipes.warm_start"),
            "made_by": f"turnstile build-model {name} --out DIR",
            "base": json.loads((base / BUILD_INFO).read_text()),
            "recipe": asdict(recipe),
            "data": {"episodes": len(trajectories), "sequences": len(sequences),
                     "tokens": sum(len(ids) for ids, _ in sequences),
                     "policy_tokens": sum(sum(mask) for _, mask in sequences),
                     "sha256": sequences_digest(sequences), "seconds": round(data_seconds, 1)},
            "train": {key: report[key] for key in ("final_loss", "seconds", "tokens_per_s")},
            "check": rebuild_record(base, sequences, recipe),
        }
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return target


CHECK_SEQUENCES = 32  # the rebuild check's share of the data: the first port's first sequences


def rebuild_record(base: Path, sequences: list[tuple[list[int], list[int]]],
                   recipe: WarmStartRecipe) -> dict[str, Any]:
    """What a CI-sized rebuild must reproduce: the digest of the first :data:`CHECK_SEQUENCES`
    sequences and the losses of :data:`TRACE_STEPS` steps of both stages trained on them alone.
    The full rebuild (about an hour on 2 cores) is the one command in ``made_by``."""
    head = sequences[:CHECK_SEQUENCES]
    with tempfile.TemporaryDirectory(prefix=".turnstile-check.") as scratch:
        report = train_sft(base, head, replace(recipe, induction_steps=min(recipe.induction_steps, TRACE_STEPS),
                                               steps=TRACE_STEPS),
                           Path(scratch), progress=False)
    return {"sequences": len(head), "sha256": sequences_digest(head), "trace": report["trace"]}


def expert_trajectories(recipe: WarmStartRecipe, out: Path, *, progress: bool = True,
                        split: str = "train", limit: int | None = None,
                        shards: int | None = None) -> list[Trajectory]:
    """The scripted expert once on every task of ``split``, an equal share on each of the recipe's
    corpus ports (only the first ``shards`` shares if given; of each, the first ``limit`` tasks, by
    default the recipe's); its correct trajectories and those it answered hastily (the recipe's
    ``hasty_fraction``) or stopped early (``early_fraction``), by port and then by task id."""
    from turnstile.envs.answers import answer_matches

    expert = ExpertConfig(hasty_fraction=recipe.hasty_fraction, early_fraction=recipe.early_fraction)
    limit = recipe.limit if limit is None else limit
    rollout = RolloutJob()
    rollout.group_size = 1
    rollout.engine.kind = "scripted"  # told the question mix by the data (cluster.jobs.rollout.expert_engine)
    rollout.engine.scripted.hasty_fraction = recipe.hasty_fraction
    rollout.engine.scripted.early_fraction = recipe.early_fraction
    rollout.engine.scripted.report = recipe.context == "iter_research"
    rollout.context = ContextConfig(kind=recipe.context)
    rollout.episode = replace(default_episode(), context_budget=recipe.context_budget,
                              env=replace(default_episode().env, max_turns=recipe.max_turns))
    rollout.fleet.workers = 2
    rollout.fleet.episodes_per_worker = 8
    kept = []
    for shard, port in enumerate(recipe.corpus_ports[:shards]):
        data = DatasetConfig(kind="synthetic", path="", split=split, limit=limit,
                             shards=len(recipe.corpus_ports), shard=shard, options=dict(recipe.tasks))
        part = out.with_name(f"{out.stem}.{shard}{out.suffix}")
        run_rollout(replace(rollout, data=data, corpus=replace(rollout.corpus, port=port)), part,
                    progress=progress)
        hops = {task.id: _hop_count(task.metadata.get("path")) for task in load_tasks(data)}
        done = [t for t in load_trajectories(part) if deliberate_mistake(expert, t, hops.get(t.task_id, 0))
                or (t.answered and answer_matches(t.answer, t.answers))]
        kept += sorted(done, key=lambda t: t.task_id)
    return kept


def _hop_count(path: object) -> int:
    """The hops of a synthetic chain's plan (its ``path``); 0 for other tasks."""
    return len(path) if isinstance(path, list) else 0


def deliberate_mistake(expert: ExpertConfig, trajectory: Trajectory, hops: int) -> bool:
    """Whether the expert answered ``trajectory`` (a task of ``hops`` hops) hastily or stopped its
    chain early, by design."""
    return expert.hasty(trajectory.task_id) or expert.stops_after(trajectory.task_id, hops) is not None


def training_sequences(trajectories: list[Trajectory], max_length: int) -> list[tuple[list[int], list[int]]]:
    """Each segment as (token ids, loss mask): prompt and observations 0, the policy's tokens 1."""
    from turnstile.learner.batch import samples_from_trajectories

    sequences = []
    for sample in samples_from_trajectories(trajectories, require_advantage=False):
        ids = sample.prompt_ids + sample.response_ids
        mask = [0] * len(sample.prompt_ids) + sample.response_mask
        sequences.append((ids[:max_length], mask[:max_length]))
    return sequences


def sequences_digest(sequences: list[tuple[list[int], list[int]]]) -> str:
    digest = hashlib.sha256()
    for ids, mask in sequences:
        digest.update(json.dumps([ids, mask]).encode())
    return digest.hexdigest()


def train_sft(base: Path, sequences: list[tuple[list[int], list[int]]], recipe: WarmStartRecipe,
              out: Path, *, progress: bool = True,
              monitor: Callable[[int, Any], None] | None = None,
              checkpoint: Path | None = None) -> dict[str, Any]:
    """Plain PyTorch SFT of ``base`` on ``sequences`` (see the module doc); saves to ``out``. The
    report has the final loss, the time, the throughput and ``trace``, the first steps' losses of
    both stages (what the rebuild check compares). ``monitor(step, model)`` is called every 50 SFT
    steps (to watch a held-out measure while it trains). With ``checkpoint``, the training state is
    saved there after the copying stage and every :data:`CHECKPOINT_EVERY` SFT steps, and a run
    that finds it continues from it (the same steps, the same data order)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    added = set(tokenizer.get_added_vocab().values())
    runs = RepeatedRuns(sorted({t for ids, _ in sequences for t in ids} - added), recipe.seed)
    trace: dict[str, list[float]] = {"induction": [], "sft": []}
    tokens, spent = 0, 0.0
    saved = torch.load(checkpoint, weights_only=False) if checkpoint and checkpoint.is_file() else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        runs.rng.setstate(saved["runs_rng"])
        torch.set_rng_state(saved["torch_rng"])
        trace, tokens, spent = saved["trace"], saved["tokens"], saved["seconds"]
    started = time.monotonic()

    def optimise(optimiser: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        scheduler.step()
        optimiser.zero_grad(set_to_none=True)

    # Stage 1: copying. A random-weight model copies nothing, and every question needs it: the
    # entity into the search, a URL from the results, the value from the page into the answer.
    if saved is None:
        optimiser = torch.optim.AdamW(model.parameters(), lr=recipe.lr / 2,  # constant; 1e-3 by default
                                      betas=(0.9, 0.98), weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda _step: 1.0)
        bar = tqdm(range(recipe.induction_steps), desc="copying", unit="step", disable=not progress)
        for _ in bar:
            loss = runs.loss(model, recipe.induction_batch)
            loss.backward()
            optimise(optimiser, scheduler)
            value = loss.detach().item()
            _record(trace["induction"], value)
            bar.set_postfix(loss=f"{value:.3f}")

    # Stage 2: the expert's turns (and, at a lower weight, the tool results they read).
    optimiser = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)

    def schedule(step: int) -> float:
        warm = min(1.0, (step + 1) / max(recipe.warmup_steps, 1))
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, recipe.steps) / recipe.steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, schedule)
    rng = random.Random(recipe.seed)
    order: list[int] = []
    done = 0
    if saved is not None:
        optimiser.load_state_dict(saved["optimiser"])
        scheduler.load_state_dict(saved["scheduler"])
        rng.setstate(saved["rng"])
        order, done = saved["order"], saved["step"]

    def save(step: int) -> None:
        if checkpoint is None:
            return
        state = {"model": model.state_dict(), "optimiser": optimiser.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": rng.getstate(),
                 "runs_rng": runs.rng.getstate(), "torch_rng": torch.get_rng_state(), "order": order,
                 "step": step, "trace": trace, "tokens": tokens,
                 "seconds": spent + time.monotonic() - started}
        with atomic_path(checkpoint) as temporary:
            torch.save(state, temporary)

    if saved is None:
        save(0)
    loss_value = float("nan")
    bar = tqdm(range(done + 1, recipe.steps + 1), desc="sft", unit="step",
               disable=not progress, initial=done, total=recipe.steps)
    for step in bar:
        if len(order) < recipe.batch:
            order += rng.sample(range(len(sequences)), len(sequences))
        batch, order = [sequences[i] for i in order[:recipe.batch]], order[recipe.batch:]
        policy_tokens = max(sum(sum(mask) for _, mask in batch), 1)
        loss_value = 0.0
        for ids, mask in batch:
            weights = loss_weights(mask, recipe.observation_weight)
            # Logits only where the loss is: the LM head over every position costs as much as the
            # four layers on this model (8,192-token vocabulary, 128 wide).
            targets = [i for i in range(1, len(ids)) if weights[i]]
            if not targets:
                continue
            logits = model(input_ids=torch.tensor([ids]),
                           logits_to_keep=torch.tensor([i - 1 for i in targets])).logits[0]
            per_token = torch.nn.functional.cross_entropy(logits, torch.tensor([ids[i] for i in targets]),
                                                          reduction="none")
            loss = (per_token * torch.tensor([weights[i] for i in targets])).sum() / policy_tokens
            loss.backward()
            loss_value += loss.detach().item()
            tokens += len(ids)
        if recipe.induction_weight:
            (runs.loss(model, recipe.induction_batch // 2) * recipe.induction_weight).backward()
        optimise(optimiser, scheduler)
        _record(trace["sft"], loss_value)
        bar.set_postfix(loss=f"{loss_value:.3f}")
        if step % CHECKPOINT_EVERY == 0 and step < recipe.steps:
            save(step)
        if monitor is not None and step % 50 == 0:
            model.eval()
            monitor(step, model)
            model.train()
    seconds = spent + time.monotonic() - started
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for name in ("generation_config.json",):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    return {"final_loss": round(loss_value, 4), "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9)), "trace": trace}


TRACE_STEPS = 5  # losses kept per stage for the rebuild check


def _record(trace: list[float], loss: float) -> None:
    if len(trace) < TRACE_STEPS:
        trace.append(round(loss, 6))


def loss_weights(mask: list[int], observation_weight: float) -> list[float]:
    """Per-token loss weights of a sequence: 0 on the prompt, 1 on the policy's tokens,
    ``observation_weight`` on the tool results (the tokens after the prompt the policy did not
    write). The prompt ends where the policy's first token is."""
    start = mask.index(1) if 1 in mask else len(mask)
    return [0.0] * start + [1.0 if m else observation_weight for m in mask[start:]]


class RepeatedRuns:
    """The copying task: a run of 32 random tokens (drawn from ``pool``) written twice; the loss is
    on the second copy, which only attending back to the first can predict. A small model learns
    it in a few hundred steps (its loss falls from ln(len(pool)) to ~0.03), the expert's data alone
    did not teach it in 600."""

    half = 32

    def __init__(self, pool: list[int], seed: int) -> None:
        if not pool:
            raise ValueError("the copying task needs a non-empty token pool")
        self.pool = pool
        self.rng = random.Random(f"turnstile-copying-{seed}")

    def loss(self, model: PreTrainedModel, batch: int) -> torch.Tensor:
        import torch

        rows = []
        for _ in range(batch):
            run = [self.rng.choice(self.pool) for _ in range(self.half)]
            rows.append(run + run)
        ids = torch.tensor(rows)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, self.half:-1]
        logits = model.get_output_embeddings()(hidden)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 ids[:, self.half + 1:].reshape(-1))
