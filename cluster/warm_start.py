"""The warm start: the tiny model fine-tuned on the scripted expert, for reinforcement learning.

A random-weight policy writes no well-formed turn, so every sample of a group gets the same reward
and reinforcement learning has nothing to work with. ``tiny-qwen3-sft`` is the tiny model
(:mod:`rollout.model_store`) after supervised fine-tuning on the scripted expert's trajectories of
the default training tasks, through the real tools.

The recipe (:class:`WarmStartRecipe`, one command: ``turnstile build-model tiny-qwen3-sft --out DIR``):

1. the expert (``engine.kind=scripted``) runs every training task once through the Ray fleet with
   the default episode settings, the corpus served on a fixed port so the pages' URLs — and so the
   token ids — are the same on every machine; its correct trajectories, sorted by task, are the data;
2. plain PyTorch SFT from the random tiny model: token-mean cross-entropy on the policy's own
   tokens (observations and prompt masked), AdamW, warm-up then cosine decay, one sequence per
   forward (no padding), a fixed seed.

Why not veRL's trainer (the learner every RL step uses, and ``turnstile sft``): on 2 CPU cores it
runs at about half the arithmetic's speed (``benchmarks/learner_overhead.py``), and the build is
already the longest thing a newcomer runs.

Measured (600 steps, 47 minutes on 2 cores): loss 0.46-0.62 on the policy tokens, 64.5% well-formed
turns on 64 held-out episodes at temperature 1, but 0 correct answers: the model writes the
protocol and never copies the question's entity into its search. The default ``turnstile train``
does not use it yet (see docs/benchmarks/learning.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from cluster.rollout import RolloutConfig, run_rollout
from envs.datasets.registry import DatasetConfig
from envs.env import EnvConfig
from rollout.episode import EpisodeConfig
from rollout.model_store import BUILD_INFO, WARM_MODEL, ensure_default_model
from rollout.trajectory import Trajectory, load_trajectories

DEFAULT_TASKS: dict[str, Any] = {"min_hops": 0, "max_hops": 1, "aggregation_fraction": 0.0, "count": 1200}
"""The embedded default's question mix: questions answered on one page (an attribute of the start, or
the name one relation away) or two (an attribute one relation away); 1,200 questions, ~1,080 for
training and ~120 held out."""


def default_episode() -> EpisodeConfig:
    """The embedded default's episode settings (training, evaluation and the expert's data)."""
    return EpisodeConfig(max_new_tokens=160, context_budget=3072, env=EnvConfig(max_turns=6))


@dataclass(frozen=True)
class WarmStartRecipe:
    """Everything that decides the warm start (recorded in its ``turnstile-model.json``)."""

    tasks: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_TASKS))
    corpus_port: int = 18765  # fixed, so every machine's trajectories hold the same URLs
    steps: int = 600
    batch: int = 8  # sequences per optimiser step
    lr: float = 3e-3
    warmup_steps: int = 30
    max_length: int = 3072
    seed: int = 0


def build_warm_model(target: Path, recipe: WarmStartRecipe | None = None, *, force: bool = False,
                     progress: bool = True) -> Path:
    """Run the recipe and write the model directory ``target`` (atomically); returns it."""
    recipe = recipe or WarmStartRecipe()
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists; pass --force to rebuild it")
    base = ensure_default_model()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        started = time.monotonic()
        trajectories = expert_trajectories(recipe, staging / "expert.jsonl", progress=progress)
        data_s = time.monotonic() - started
        sequences = training_sequences(trajectories, recipe.max_length)
        report = train_sft(base, sequences, recipe, staging, progress=progress)
        (staging / "expert.jsonl").unlink()
        info = {
            "name": WARM_MODEL,
            "what": "the tiny Qwen3 after SFT on the scripted expert's correct trajectories of the "
                    "embedded default's training tasks (the warm start of `turnstile train`)",
            "made_by": f"turnstile build-model {WARM_MODEL} --out DIR",
            "base": json.loads((base / BUILD_INFO).read_text()),
            "recipe": asdict(recipe),
            "data": {"episodes": len(trajectories), "sequences": len(sequences),
                     "tokens": sum(len(ids) for ids, _ in sequences),
                     "policy_tokens": sum(sum(mask) for _, mask in sequences),
                     "sha256": sequences_digest(sequences), "seconds": round(data_s, 1)},
            "train": {key: report[key] for key in ("final_loss", "seconds", "tokens_per_s")},
        }
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        staging.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def expert_trajectories(recipe: WarmStartRecipe, out: Path, *, progress: bool = True,
                        split: str = "train") -> list[Trajectory]:
    """The scripted expert once on every task of ``split``; its correct trajectories, by task id."""
    from envs.answers import answer_matches

    rollout = RolloutConfig()
    rollout.data = DatasetConfig(kind="synthetic", path="", split=split, options=dict(recipe.tasks))
    rollout.group_size = 1
    rollout.engine.kind = "scripted"  # told the question mix by the data (cluster.rollout.expert_engine)
    rollout.episode = default_episode()
    rollout.fleet.workers = 2
    rollout.fleet.episodes_per_worker = 8
    rollout.corpus = replace(rollout.corpus, port=recipe.corpus_port)
    run_rollout(rollout, out, progress=progress)
    kept = [t for t in load_trajectories(out) if t.answered and answer_matches(t.answer, t.answers)]
    return sorted(kept, key=lambda t: t.task_id)


def training_sequences(trajectories: list[Trajectory], max_length: int) -> list[tuple[list[int], list[int]]]:
    """Each segment as (token ids, loss mask): prompt and observations 0, the policy's tokens 1."""
    from learner.batch import samples_from_trajectories

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
              out: Path, *, progress: bool = True) -> dict[str, Any]:
    """Plain PyTorch SFT of ``base`` on ``sequences`` (see the module doc); saves to ``out``."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)

    def schedule(step: int) -> float:
        warm = min(1.0, (step + 1) / max(recipe.warmup_steps, 1))
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, recipe.steps) / recipe.steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, schedule)
    rng = random.Random(recipe.seed)
    order: list[int] = []
    started, tokens, loss_value = time.monotonic(), 0, float("nan")
    bar = tqdm(range(recipe.steps), desc=f"sft {WARM_MODEL}", unit="step", disable=not progress)
    for _ in bar:
        if len(order) < recipe.batch:
            order += rng.sample(range(len(sequences)), len(sequences))
        batch, order = [sequences[i] for i in order[:recipe.batch]], order[recipe.batch:]
        policy_tokens = max(sum(sum(mask) for _, mask in batch), 1)
        loss_value = 0.0
        for ids, mask in batch:
            inputs = torch.tensor([ids])
            labels = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)][1:])
            logits = model(input_ids=inputs).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100,
                                                     reduction="sum") / policy_tokens
            loss.backward()
            loss_value += float(loss)
            tokens += len(ids)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        scheduler.step()
        optimiser.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss_value:.3f}")
    seconds = time.monotonic() - started
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    for name in ("generation_config.json",):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    return {"final_loss": round(loss_value, 4), "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9))}
