"""``turnstile sft``: supervised fine-tuning on veRL's trainer, with before/after evaluation.

The job: load samples (:mod:`turnstile.learner.sft`), measure the policy (rollouts on held-out tasks: the share
of well-formed turns, answer rate, accuracy), train ``steps`` mini-batches with the weighted SFT loss
(:class:`turnstile.learner.trainer.Learner`), evaluate every ``eval.every`` steps and at the end, and write a
Hugging Face model directory (``out/model``) that any engine loads, plus the learner checkpoint
(``out/checkpoint``) that ``resume=true`` continues from: at the end, and every ``checkpoint_every``
steps (a long run killed loses at most that many). A resumed run takes the batches the run would
have taken next: the sample order is a function of ``learner.seed`` and the step.

Every evaluation runs on one fleet session (:mod:`turnstile.cluster.jobs.session`), started with the base model
beside the learner: before training it measures the base model, later the learner's weights, which
are published to it first (its engines never reload ``out/model``). The cluster needs room for both
(the learner's ranks and the fleet's engine and worker), which is checked before either starts.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from turnstile.cluster.jobs.defaults import sft_eval_rollout
from turnstile.cluster.jobs.session import RayConfig, RolloutJob, fleet_session, init_ray, learner_demand
from turnstile.learner.batch import Sample
from turnstile.learner.publish import replace_model
from turnstile.learner.sft import load_sft_samples
from turnstile.learner.trainer import Learner, LearnerConfig
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.model_store import RUN_MODEL, resolve_model


@dataclass
class SftDataConfig:
    # `turnstile rollout --out` trajectories or `turnstile data clean --out` rows; several files
    # comma-separated (each read in its own format), their samples together
    path: str = ""
    format: str = "auto"  # auto | trajectories | chat
    weighting: str = "unit"  # unit | abc (ABC-SFT per-turn weights)
    resample: str = ""  # turn-aware resampling of trajectories, e.g. "50:1,100:2,inf:5" ("" = none)


@dataclass
class SftEvalConfig:
    every: int = 0  # evaluate every N steps as well; 0 = only before and after training
    before: bool = True
    rollout: RolloutJob = field(default_factory=sft_eval_rollout)


@dataclass
class SftJob:
    data: SftDataConfig = field(default_factory=SftDataConfig)
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(
        mini_batch=8, micro_batch=4, lr=1e-3, total_steps=300, warmup_steps=10, max_length=1024))
    steps: int = 300
    log_every: int = 10
    checkpoint_every: int = 0  # also save the checkpoint and out/model every N steps; 0 = at the end only
    out: str = "runs/sft"
    resume: bool = False
    eval: SftEvalConfig = field(default_factory=SftEvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass
class Evaluation:
    step: int
    well_formed: float
    turns: int
    answer_rate: float
    accuracy: float

    def render(self) -> str:
        return (f"eval @ step {self.step}: well-formed turns {self.well_formed:.1%} of {self.turns}, "
                f"answered {self.answer_rate:.1%}, correct {self.accuracy:.1%}")


def run_sft(job: SftJob, *, progress: bool = True) -> list[Evaluation]:
    """The whole job (see the module doc); returns the evaluations in order."""
    if not job.data.path:
        raise ValueError("data.path is empty: pass the SFT data, e.g. data.path=runs/expert.jsonl "
                         "(`turnstile rollout --out`) or the output of `turnstile data clean`")
    if job.steps < 1:
        raise ValueError("steps must be >= 1")
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    init_ray(job.ray)
    base = resolve_model(job.learner.model)
    chat = ChatFormat.from_pretrained(base)
    samples = [sample for path in job.data.path.split(",") if path.strip()
               for sample in load_sft_samples(path.strip(), chat, fmt=job.data.format,
                                              weighting=job.data.weighting, resample=job.data.resample)]
    print(f"sft: {len(samples)} samples from {job.data.path} ({sum(s.num_tokens for s in samples):,} "
          f"tokens before truncation to {job.learner.max_length}), {job.steps} steps of "
          f"{job.learner.mini_batch}, model {base}")
    learner = Learner(replace(job.learner, model=base))
    rollout = job.eval.rollout
    evaluations: list[Evaluation] = []
    try:
        # One fleet for every evaluation, on the base model first; each later one is on the
        # learner's weights, published to it (the learner starts beside the fleet).
        with fleet_session(rollout, [rollout.data], name=f"turnstile-sft-{uuid.uuid4().hex[:8]}", model=base,
                           events=out / "fleet.jsonl", beside=[learner_demand(learner)],
                           alongside=learner.start) as session:

            def evaluate(step: int) -> None:
                if step:
                    asyncio.run(session.publish(learner.full_weights(), step))
                metrics = session.evaluate(session.tasks[0], rollout.group_size, out / f"eval-step{step}.jsonl",
                                           label=f"eval{step}")
                evaluations.append(Evaluation(step=step, well_formed=metrics["eval/format_rate"],
                                              turns=int(metrics["eval/turns"]), answer_rate=metrics["eval/answer_rate"],
                                              accuracy=metrics["eval/accuracy"]))
                tqdm.write(evaluations[-1].render())

            if job.eval.before and not job.resume:
                evaluate(0)
            if session.beside is not None:
                session.beside.result()
            model = train(job, learner, samples, out, evaluate, progress)
            evaluate(job.steps)
    finally:
        learner.close()
    (out / "evaluations.json").write_text(json.dumps([vars(e) for e in evaluations], indent=1))
    print(f"model: {model}  (load it with engine.model={model})")
    return evaluations


def train(job: SftJob, learner: Learner, samples: list[Sample], out: Path, evaluate: Callable[[int], None],
          progress: bool) -> Path:
    """The training steps from where the learner is (its checkpoint, when resumed), with a checkpoint
    every ``checkpoint_every`` steps and an evaluation every ``eval.every``; the final checkpoint and
    ``out/model``, whose path it returns."""
    base = learner.config.model
    if job.resume and (out / "checkpoint" / "learner.json").is_file():
        learner.load(out / "checkpoint")
        print(f"resumed at step {learner.step}")
    batches = sample_batches(samples, job.learner.mini_batch, job.learner.seed)
    for _ in range(learner.step):  # the batches the checkpointed steps took
        next(batches)
    bar = tqdm(total=job.steps, initial=learner.step, disable=not progress, desc="sft", unit="step")
    losses: list[float] = []
    started = time.monotonic()
    while learner.step < job.steps:
        report = learner.train_sft(next(batches))
        losses.append(report.metrics.get("loss", float("nan")))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if learner.step % job.log_every == 0:
            recent = losses[-job.log_every:]
            bar.write(f"step {learner.step}: loss {sum(recent) / len(recent):.4f}, grad norm "
                      f"{report.metrics.get('grad_norm', float('nan')):.3f}, "
                      f"{report.tokens} tokens, {time.monotonic() - started:.0f} s")
        if job.checkpoint_every and learner.step % job.checkpoint_every == 0 and learner.step < job.steps:
            learner.save(out / "checkpoint")
            replace_model(learner.full_weights(), base, out / RUN_MODEL, about=made(job, out, learner.step))
            bar.write(f"step {learner.step}: checkpoint and {out / RUN_MODEL} written")
        if job.eval.every and learner.step % job.eval.every == 0 and learner.step < job.steps:
            evaluate(learner.step)
    bar.close()
    learner.save(out / "checkpoint")
    return replace_model(learner.full_weights(), base, out / RUN_MODEL, about=made(job, out, learner.step))


def sample_batches(samples: list[Sample], size: int, seed: int) -> Iterator[list[Sample]]:
    """Mini-batches of ``size`` for ever: each pass over the samples in a new seeded order."""
    rng = random.Random(seed)
    order: list[Sample] = []
    while True:
        if len(order) < size:
            refill = list(samples)
            rng.shuffle(refill)
            order.extend(refill)
        batch, order = order[:size], order[size:]
        yield batch


def made(job: SftJob, out: Path, step: int) -> dict[str, object]:
    """What ``OUT/model`` is, for its ``turnstile-model.json``."""
    return {"name": f"{out.name}@step{step}", "step": step,
            "what": f"{job.learner.model or 'the tiny model'} after {step} steps of SFT on {job.data.path}",
            "made_by": "turnstile sft"}
