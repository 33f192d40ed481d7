"""``turnstile sft``: supervised fine-tuning on veRL's trainer, with before/after evaluation.

The job: load samples (:mod:`learner.sft`), measure the policy (rollouts on held-out tasks: the share
of well-formed turns, answer rate, accuracy), train ``steps`` mini-batches with the weighted SFT loss
(:class:`learner.trainer.Learner`), evaluate every ``eval.every`` steps and at the end, and write a
Hugging Face model directory (``out/model``) that any engine loads, plus the learner checkpoint
(``out/checkpoint``) that ``resume=true`` continues from: at the end, and every ``checkpoint_every``
steps (a long run killed loses at most that many). A resumed run takes the batches the run would
have taken next: the sample order is a function of ``learner.seed`` and the step.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from cluster.jobs.defaults import sft_eval_rollout
from cluster.jobs.rollout import RayConfig, RolloutJob, init_ray, run_rollout
from learner.batch import Sample
from learner.publish import replace_model
from learner.sft import load_sft_samples, well_formed_share
from learner.trainer import Learner, LearnerConfig
from rollout.chat import ChatFormat
from rollout.model_store import RUN_MODEL, resolve_model
from rollout.trajectory import load_trajectories


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
    evaluations: list[Evaluation] = []
    if job.eval.before and not job.resume:
        evaluations.append(evaluate(job, base, out, step=0))
        print(evaluations[-1].render())
    learner = Learner(replace(job.learner, model=base)).start()

    def write_model() -> Path:
        """The policy now, as ``out/model`` (any engine loads it)."""
        return replace_model(learner.full_weights(), base, out / RUN_MODEL, about=made(job, out, learner.step))

    try:
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
            saved = None  # out/model of this step, written once whether a checkpoint or an eval wants it
            if job.checkpoint_every and learner.step % job.checkpoint_every == 0 and learner.step < job.steps:
                learner.save(out / "checkpoint")
                saved = write_model()
                bar.write(f"step {learner.step}: checkpoint and {out / RUN_MODEL} written")
            if job.eval.every and learner.step % job.eval.every == 0 and learner.step < job.steps:
                evaluations.append(evaluate(job, str(saved or write_model()), out, step=learner.step))
                bar.write(evaluations[-1].render())
        bar.close()
        learner.save(out / "checkpoint")
        model = write_model()
    finally:
        learner.close()
    evaluations.append(evaluate(job, str(model), out, step=job.steps))
    print(evaluations[-1].render())
    (out / "evaluations.json").write_text(json.dumps([vars(e) for e in evaluations], indent=1))
    print(f"model: {model}  (load it with engine.model={model})")
    return evaluations


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


def evaluate(job: SftJob, model: str, out: Path, *, step: int) -> Evaluation:
    """Rollouts of ``model`` on the held-out tasks; the share of turns it writes well-formed."""
    rollout = replace(job.eval.rollout, engine=replace(job.eval.rollout.engine, model=model))
    path = out / f"eval-step{step}.jsonl"
    summary = run_rollout(rollout, path, progress=False)
    share, turns = well_formed_share(load_trajectories(path))
    return Evaluation(step=step, well_formed=share, turns=turns, answer_rate=summary.answer_rate,
                      accuracy=summary.accuracy)
