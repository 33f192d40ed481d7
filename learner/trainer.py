"""The learner: samples in, a veRL update out, full weights for the rollout fleet.

``Learner`` drives a group of veRL training workers (:class:`turnstile.learner.verl_workers.PolicyWorker`, the
FSDP2 engine) over a ``RayWorkerGroup`` with ``dp`` ranks. The same code runs on GPUs and on CPU; on
CPU the workers and this process load the platform plugin in :mod:`turnstile.learner.verl_cpu`.

One RL step (:meth:`Learner.rl_step`): trajectories with per-turn advantages → one sample per segment
(:mod:`turnstile.learner.batch`) → minimal-loss downsampling to a multiple of lcm(dp, mini_batch) with group
statistics recomputed over the survivors (:mod:`turnstile.learner.downsample`) → mini-batches laid out so each
rank's share of every mini-batch has about the same number of tokens → veRL's ``ppo_loss`` (PPO-clip
``vanilla`` or ``gspo``) with an optional KL to the reference model (``low_var_kl``). An SFT step uses
the same layout with :func:`turnstile.learner.verl_workers.weighted_sft_loss`.

veRL splits a batch into ``dp`` equal contiguous parts and each rank walks its part in mini-batches
of ``mini_batch / dp``. :func:`rank_major_layout` orders the rows so that the k-th mini-batch of every
rank together is exactly the k-th global mini-batch we chose: the update is the same for any ``dp``.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from turnstile.envs.files import atomic_write
from turnstile.learner.batch import Sample, balance_for_ranks, collate, ratio_metrics, samples_from_trajectories
from turnstile.learner.correction import CorrectionConfig, correct
from turnstile.learner.credit.registry import Estimator
from turnstile.learner.downsample import downsample, renormalise
from turnstile.rollout.trajectory import Trajectory

LOSSES = ("vanilla", "gspo")


@dataclass(frozen=True)
class LossSettings:
    """What a policy loss takes when its ``learner.*`` setting is left empty (None)."""

    clip_ratio_low: float
    clip_ratio_high: float
    loss_agg_mode: str
    recompute_old_log_probs: bool


# How veRL aggregates the token losses of a mini-batch: over all tokens (a sample weighs by its
# length), per sample then over samples (each weighs the same), or token sums (over the batch, per sample, or
# per sample over the batch normalised by the longest response).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# PPO's clip range acts per token; GSPO's ratio is a sequence's geometric mean, which moves far less,
# so it has its own range (the GSPO paper's 3e-4 / 4e-4), averages over sequences, and recomputes the
# old log-probs with the learner: a rollout engine's own differ by more than that range (the
# train/inference mismatch), which would clip most sequences before any update.
LOSS_DEFAULTS = {
    "vanilla": LossSettings(0.2, 0.28, "token-mean", False),
    "gspo": LossSettings(3e-4, 4e-4, "seq-mean-token-mean", True),
}
KL_TYPES = ("low_var_kl", "kl", "abs", "mse")


class LearnerError(ValueError):
    """A learner setting or input that cannot work; the message names the fix."""


@dataclass
class LearnerConfig:
    """The learner's settings (``learner.*`` in an experiment's YAML)."""

    model: str = ""  # a local Hugging Face model directory; "" = the built-in tiny model
    dp: int = 1  # data-parallel ranks (one training worker each)
    mini_batch: int = 8  # samples per optimiser step, over all ranks
    micro_batch: int = 2  # samples per forward/backward on one rank
    epochs: int = 1  # passes over a batch (PPO epochs)
    lr: float = 1e-5
    weight_decay: float = 0.0
    optimizer: str = "AdamW"  # a class of torch.optim
    optimizer_options: dict[str, Any] = field(default_factory=dict)  # its other arguments, e.g. {eps: 1e-6}
    grad_clip: float = 1.0
    total_steps: int = 1000  # for the learning-rate schedule
    warmup_steps: int = 0
    loss: str = "vanilla"  # vanilla (PPO-clip) | gspo (sequence-level ratio, docs/algorithms.md §7)
    # None: the loss's own (LOSS_DEFAULTS): vanilla 0.2 / 0.28 / token-mean, gspo 3e-4 / 4e-4 /
    # seq-mean-token-mean, with the old log-probs recomputed
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    loss_agg_mode: str | None = None
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0  # > 0 adds KL to a frozen reference copy of the initial model
    kl_type: str = "low_var_kl"
    recompute_old_log_probs: bool | None = None  # False: the rollout's own log-probs are the old policy
    # veRL's rollout correction of the engines' log-probs against the learner's (learner/correction.py):
    # decoupled when the old log-probs are recomputed, bypass otherwise; and the mismatch guard
    rollout_correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    max_length: int = 8192  # prompt + response tokens per sample; longer responses are cut (counted)
    seed: int = 0
    gradient_checkpointing: bool = False
    # Positions per chunk of the LM head: only the positions whose next token the policy generated
    # are projected onto the vocabulary, this many at a time (learner/head.py); 0 = veRL's path,
    # which projects every position of a micro-batch at once.
    head_chunk: int = 1024
    # Token-budget batching (veRL's use_dynamic_bsz): each forward/backward takes as many samples as
    # fit in this many tokens per GPU, instead of micro_batch samples; a sample split over
    # sequence_parallel GPUs counts its tokens / sequence_parallel. 0 = micro_batch samples at a time.
    max_tokens_per_gpu: int = 0
    # GPUs that share one sample's sequence (Ulysses sequence parallelism; GPUs only): the learner
    # takes dp x sequence_parallel GPUs. The model's attention heads must divide by it.
    sequence_parallel: int = 1
    num_cpus_per_worker: int = 1  # CPU only; on GPUs each rank takes one GPU (or gpu_share of one)
    # GPUs only: the share of a GPU each rank reserves in Ray, 1/k (0.5, 0.25, ...). Below 1 the
    # ranks leave room on their GPU for an engine replica with rollout.fleet.engine_gpus of it (and a
    # gpu_memory_utilization that leaves the learner its memory): one GPU for both.
    gpu_share: float = 1.0
    # CPU only: torch threads per rank; 0 = num_cpus_per_worker (Ray's rule). More than the CPUs
    # reserved is right where the rollout fleet idles while the learner trains (sync steps).
    threads: int = 0
    gpu: bool | None = None  # None: use GPUs when the Ray cluster has them

    def __post_init__(self) -> None:
        if self.dp < 1 or self.mini_batch < 1 or self.micro_batch < 1 or self.epochs < 1:
            raise LearnerError("learner.dp, mini_batch, micro_batch and epochs must be at least 1")
        if self.mini_batch % self.dp:
            raise LearnerError(f"learner.mini_batch={self.mini_batch} must be a multiple of learner.dp="
                               f"{self.dp}: every rank takes the same share of each mini-batch")
        if (self.mini_batch // self.dp) % self.micro_batch:
            raise LearnerError(f"learner.micro_batch={self.micro_batch} must divide the per-rank "
                               f"mini-batch {self.mini_batch // self.dp} (mini_batch / dp)")
        if self.loss not in LOSSES:
            raise LearnerError(f"learner.loss={self.loss!r} is not one of {', '.join(LOSSES)}")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise LearnerError(f"learner.{name}={value} must be a number > 0 (or empty: the loss's own)")
        if self.loss_agg_mode is not None and self.loss_agg_mode not in LOSS_AGG_MODES:
            raise LearnerError(f"learner.loss_agg_mode={self.loss_agg_mode!r} is not one of "
                               f"{', '.join(LOSS_AGG_MODES)} (or empty: the loss's own)")
        if self.kl_type not in KL_TYPES:
            raise LearnerError(f"learner.kl_type={self.kl_type!r} is not one of {', '.join(KL_TYPES)}")
        if self.kl_coef < 0:
            raise LearnerError("learner.kl_coef must be >= 0")
        if self.head_chunk < 0:
            raise LearnerError("learner.head_chunk must be >= 0 (0 = project every position at once)")
        if self.sequence_parallel < 1:
            raise LearnerError("learner.sequence_parallel must be at least 1 (1 = each GPU holds whole samples)")
        if not (0 < self.gpu_share <= 1 and abs(1 / self.gpu_share - round(1 / self.gpu_share)) < 1e-6):
            raise LearnerError(f"learner.gpu_share={self.gpu_share} must be 1/k of a GPU: 1, 0.5, 0.25 ...")
        if self.sequence_parallel > 1 and self.gpu is False:
            raise LearnerError("learner.sequence_parallel > 1 splits a sample across GPUs: it needs learner.gpu "
                               "true (or empty, on a cluster with GPUs)")
        if self.max_tokens_per_gpu < 0:
            raise LearnerError("learner.max_tokens_per_gpu must be >= 0 (0 = micro_batch samples per forward)")
        if self.max_tokens_per_gpu and self.max_tokens_per_gpu * self.sequence_parallel < self.max_length:
            raise LearnerError(f"learner.max_tokens_per_gpu={self.max_tokens_per_gpu} cannot hold a sample of "
                               f"learner.max_length={self.max_length} tokens over sequence_parallel="
                               f"{self.sequence_parallel} GPUs: raise it to at least "
                               f"{-(-self.max_length // self.sequence_parallel)} or raise sequence_parallel")
        if self.threads < 0:
            raise LearnerError("learner.threads must be >= 0 (0 = learner.num_cpus_per_worker)")
        self.rollout_correction.check_mode(recompute=self.loss_settings().recompute_old_log_probs, loss=self.loss)
        known = getattr(torch.optim, self.optimizer, None)
        if not (isinstance(known, type) and issubclass(known, torch.optim.Optimizer)):
            raise LearnerError(f"learner.optimizer={self.optimizer!r} is not an optimiser of torch.optim "
                               "(AdamW, Adam, SGD, ...)")
        accepted = set(inspect.signature(known).parameters) - {"self", "params"}
        unknown = sorted(set(self.optimizer_options) - accepted)
        if unknown:
            raise LearnerError(f"learner.optimizer_options: {', '.join(unknown)} is not an argument of "
                               f"torch.optim.{self.optimizer} ({', '.join(sorted(accepted))})")
        reserved = sorted({"lr", "weight_decay"} & set(self.optimizer_options))
        if reserved:
            raise LearnerError(f"learner.optimizer_options: set {', '.join(reserved)} with learner.{reserved[0]}, "
                               "not in the options")

    def loss_settings(self) -> LossSettings:
        """The clip range, aggregation and old log-probs in force: each setting, or the loss's own."""
        own = LOSS_DEFAULTS[self.loss]
        return LossSettings(
            own.clip_ratio_low if self.clip_ratio_low is None else self.clip_ratio_low,
            own.clip_ratio_high if self.clip_ratio_high is None else self.clip_ratio_high,
            own.loss_agg_mode if self.loss_agg_mode is None else self.loss_agg_mode,
            own.recompute_old_log_probs if self.recompute_old_log_probs is None else self.recompute_old_log_probs)

    @property
    def processes(self) -> int:
        """Worker processes of the policy (and again of a KL reference): dp x sequence_parallel."""
        return self.dp * self.sequence_parallel


@dataclass
class StepReport:
    """What one update did; ``trained`` is False when too few samples arrived (they wait)."""

    trained: bool
    samples: int = 0
    dropped: int = 0
    lost_fraction: float = 0.0
    waiting: int = 0
    tokens: int = 0
    truncated_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


def rank_major_layout(mini_batches: Sequence[Sequence[Sample]], dp: int) -> list[Sample]:
    """Order rows so veRL's split gives rank r, mini-batch k, exactly its share of our k-th batch.

    Each mini-batch is first balanced over the ranks by tokens (:func:`turnstile.learner.batch.balance_for_ranks`);
    then rank 0's shares of every mini-batch come first, then rank 1's, and so on.
    """
    shares: list[list[list[Sample]]] = []
    for batch in mini_batches:
        balanced = balance_for_ranks(batch, dp)
        size = len(balanced) // dp
        shares.append([balanced[r * size:(r + 1) * size] for r in range(dp)])
    return [sample for rank in range(dp) for batch in shares for sample in batch[rank]]


def mini_batches(samples: Sequence[Sample], size: int, seed: int) -> list[list[Sample]]:
    """Shuffle (seeded) and cut into mini-batches of ``size``; ``len(samples)`` must be a multiple."""
    if len(samples) % size:
        raise LearnerError(f"{len(samples)} samples do not fill mini-batches of {size}: downsample first")
    order = list(samples)
    random.Random(seed).shuffle(order)
    return [order[i:i + size] for i in range(0, len(order), size)]


class Learner:
    """A veRL worker group holding the policy (and, with ``kl_coef > 0``, a frozen reference)."""

    def __init__(self, config: LearnerConfig) -> None:
        self.config = config
        self.step = 0
        self.weights_version = 0
        self._actor: Any = None
        self._reference: Any = None
        self._pad_token_id = 0
        self._model_path = ""
        self._pools: list[Any] = []

    # -- set-up --------------------------------------------------------------------------------
    def start(self) -> Learner:
        """Build the worker groups and load the model (tens of seconds on CPU)."""
        import ray

        from turnstile.rollout.model_store import resolve_model

        if not ray.is_initialized():
            raise LearnerError("Ray is not running in this process: call ray.init() (or run through "
                               "`turnstile`) before starting the learner")
        self._model_path = resolve_model(self.config.model)
        self._pad_token_id = _pad_token_id(self._model_path)
        use_gpu = self.uses_gpu()
        if use_gpu:
            _check_gpu_stack()
        else:
            if self.config.sequence_parallel > 1:
                raise LearnerError(f"learner.sequence_parallel={self.config.sequence_parallel} splits samples "
                                   "across GPUs, and this learner runs on CPU (no GPU per rank in the Ray "
                                   "cluster, or learner.gpu=false): set it to 1")
            from turnstile.learner import verl_cpu

            verl_cpu.activate()
        self._actor = self._worker_group("actor", forward_only=False, use_gpu=use_gpu)
        self._actor.set_loss_fn(self._policy_loss())
        if self.config.kl_coef > 0:
            # veRL builds a forward-only engine with a pinned-memory CPU offload policy and bf16
            # weights, neither of which exists on CPU: there the reference is a training engine
            # that is never stepped (same fp32 weights as the policy at the start).
            self._reference = self._worker_group("reference", forward_only=use_gpu, use_gpu=use_gpu)
        return self

    def uses_gpu(self) -> bool:
        """Whether the ranks train on GPUs (``gpu``; by default, where the Ray cluster has one per rank)."""
        import ray

        if self.config.gpu is not None:
            return self.config.gpu
        return ray.cluster_resources().get("GPU", 0) >= self.config.processes * self.config.gpu_share

    def _worker_group(self, name: str, *, forward_only: bool, use_gpu: bool) -> Any:  # noqa: ANN401
        import ray
        from verl.single_controller.ray import (
            RayClassWithInitArgs,
            RayResourcePool,
            RayWorkerGroup,
        )

        from turnstile.learner import verl_cpu, verl_workers
        from turnstile.learner.verl_workers import PolicyWorker

        config = self._worker_config(forward_only=forward_only, use_gpu=use_gpu)
        actor_class = RayClassWithInitArgs(cls=ray.remote(PolicyWorker), config=config)
        if use_gpu:
            # veRL gives each worker 1 / max_colocate_count of its bundle's GPU: k workers' worth
            # of a bundle makes each rank ask for 1/k, and SharedGpuPool's bundles hold only that.
            share = round(1 / self.config.gpu_share)
            pool = (RayResourcePool(process_on_nodes=[self.config.processes], use_gpu=True, max_colocate_count=1)
                    if share == 1 else verl_workers.shared_gpu_pool(self.config.processes, share))
            env: dict[str, str] = {}
        else:
            actor_class.update_options({"num_cpus": self.config.num_cpus_per_worker})
            pool = RayResourcePool(process_on_nodes=[self.config.dp], use_gpu=False,
                                   max_colocate_count=self.config.num_cpus_per_worker)
            env = verl_cpu.worker_env(self.config.threads or self.config.num_cpus_per_worker)
        self._pools.append(pool)
        # The worker's registered methods (reset, use_chunked_head, ...) are bound at run time.
        group: Any = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=actor_class, worker_env=env,
                                    device_name="cuda" if use_gpu else "cpu",
                                    name_prefix=f"turnstile_{name}_{uuid.uuid4().hex[:8]}_")
        group.reset()  # builds the model
        if self.config.head_chunk:
            group.use_chunked_head(self.config.head_chunk)
        return group

    def _worker_config(self, *, forward_only: bool, use_gpu: bool) -> Any:  # noqa: ANN401
        from verl.workers.config import (
            FSDPEngineConfig,
            FSDPOptimizerConfig,
            HFModelConfig,
        )
        from verl.workers.engine_workers import TrainingWorkerConfig

        from turnstile.learner import verl_cpu

        c = self.config
        model = HFModelConfig(path=self._model_path, use_remove_padding=use_gpu,
                              enable_gradient_checkpointing=c.gradient_checkpointing,
                              override_config={} if use_gpu else {"attn_implementation": "sdpa"})
        # On GPUs the gradients are reduce-scattered after every forward: veRL's default defers that to
        # the mini-batch's last forward and holds an unsharded float32 copy of them until then (4 bytes
        # a parameter on every GPU, 33 GB for an 8B model).
        engine_settings: dict[str, Any] = (
            {"strategy": "fsdp2", "use_no_sync_for_gradient_accumulation": False} if use_gpu
            else dict(verl_cpu.CPU_ENGINE_SETTINGS))
        # Token-budget batching, veRL's recommendation for long contexts: the same budget for the
        # update and for log-probs (which hold no activations, so it is the update that must fit).
        budget: dict[str, Any] = {"use_dynamic_bsz": bool(c.max_tokens_per_gpu)}
        if c.max_tokens_per_gpu:
            budget.update(max_token_len_per_gpu=c.max_tokens_per_gpu, infer_max_token_len_per_gpu=c.max_tokens_per_gpu)
        engine = FSDPEngineConfig(forward_only=forward_only, **budget,
                                  micro_batch_size_per_gpu=c.micro_batch,
                                  infer_micro_batch_size_per_gpu=c.micro_batch,
                                  ulysses_sequence_parallel_size=c.sequence_parallel,
                                  use_torch_compile=False, use_remove_padding=use_gpu, seed=c.seed,
                                  **engine_settings)
        optimizer = None if forward_only else FSDPOptimizerConfig(
            lr=c.lr, weight_decay=c.weight_decay, clip_grad=c.grad_clip,
            total_training_steps=c.total_steps, lr_warmup_steps=c.warmup_steps, optimizer=c.optimizer,
            optimizer_impl="torch.optim", override_optimizer_config=dict(c.optimizer_options) or None)
        # veRL's annotations want both; a forward-only worker has no optimiser, and none checkpoints.
        return TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                    optimizer_config=optimizer, checkpoint_config=None)  # type: ignore[arg-type]

    def _policy_loss(self) -> Any:  # noqa: ANN401
        from verl.workers.config import ActorConfig

        from turnstile.learner.verl_workers import ppo_loss_with_mismatch

        c, loss = self.config, self.config.loss_settings()
        policy_loss: dict[str, Any] = {"loss_mode": c.loss}
        if c.rollout_correction.active and not loss.recompute_old_log_probs:  # veRL's bypass mode
            policy_loss = {"loss_mode": "bypass_mode", "rollout_correction": c.rollout_correction.verl()}
        actor = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=c.mini_batch,
                            ppo_micro_batch_size_per_gpu=c.micro_batch, clip_ratio_low=loss.clip_ratio_low,
                            clip_ratio_high=loss.clip_ratio_high, loss_agg_mode=loss.loss_agg_mode,
                            entropy_coeff=c.entropy_coeff, use_kl_loss=c.kl_coef > 0,
                            kl_loss_coef=c.kl_coef, kl_loss_type=c.kl_type,
                            policy_loss=policy_loss)  # type: ignore[arg-type]  # veRL .get()s it
        return partial(ppo_loss_with_mismatch, actor, bypass=not loss.recompute_old_log_probs)

    # -- updates -------------------------------------------------------------------------------
    def rl_step(self, trajectories: Sequence[Trajectory], estimator: Estimator, *,
                seed: int | None = None) -> StepReport:
        """One policy update on credited trajectories (advantages already assigned).

        Samples are downsampled to a multiple of lcm(dp, mini_batch) (docs/algorithms.md §8); the group
        normalisation is then recomputed over the survivors with ``estimator``. Fewer samples than
        one multiple: nothing trains and the report says how many wait.
        """
        seed = self.config.seed + self.step if seed is None else seed
        samples = samples_from_trajectories(trajectories)
        picked = downsample(samples, self.config.dp, self.config.mini_batch, seed)
        if not picked.kept:
            return StepReport(trained=False, waiting=len(picked.waiting))
        survivors = renormalise(trajectories, picked.kept, estimator)
        report = self.train_rl(survivors.samples, seed=seed)
        report.dropped = picked.dropped_count
        report.lost_fraction = picked.lost_fraction
        report.stats = dict(survivors.stats)
        return report

    def train_rl(self, samples: Sequence[Sample], *, seed: int | None = None) -> StepReport:
        """One PPO/GSPO update on ``samples`` (a multiple of ``mini_batch`` of them)."""
        return self._train(samples, sft=False, seed=seed)

    def train_sft(self, samples: Sequence[Sample], *, seed: int | None = None) -> StepReport:
        """One SFT update: weighted token-mean cross-entropy on the policy tokens of ``samples``."""
        from turnstile.learner.verl_workers import weighted_sft_loss

        self._require_started()
        self._actor.set_loss_fn(partial(weighted_sft_loss, None))
        try:
            return self._train(samples, sft=True, seed=seed)
        finally:
            self._actor.set_loss_fn(self._policy_loss())

    def _train(self, samples: Sequence[Sample], *, sft: bool, seed: int | None) -> StepReport:
        from verl.utils import tensordict_utils as tu

        self._require_started()
        c = self.config
        seed = c.seed + self.step if seed is None else seed
        layout = rank_major_layout(mini_batches(samples, c.mini_batch, seed), c.dp)
        data, padded = self._tensordict(layout)
        mismatch: dict[str, float] = {}
        if not sft:
            if c.loss_settings().recompute_old_log_probs:  # decoupled: proximal, behaviour and current policies
                recomputed = self._log_probs(self._actor, layout)
                settings = c.loss_settings()
                mismatch = ratio_metrics(recomputed, padded.tensors["old_log_probs"], padded.tensors["response_mask"],
                                         per_sequence=c.loss == "gspo", clip_low=settings.clip_ratio_low,
                                         clip_high=settings.clip_ratio_high)
                data["old_log_probs"] = recomputed
                mismatch.update(self._correct(data, padded, recomputed))
            if self._reference is not None:
                data["ref_log_prob"] = self._log_probs(self._reference, layout)
        # veRL's loss adds the entropy bonus only when the forward computed the entropy.
        tu.assign_non_tensor(data, global_batch_size=c.mini_batch, mini_batch_size=c.mini_batch,
                             epochs=c.epochs, seed=seed, temperature=1.0,
                             calculate_entropy=not sft and c.entropy_coeff != 0,
                             use_fused_kernels=c.head_chunk > 0)  # veRL's key for "the model gives log-probs"
        output = self._actor.train_mini_batch(data).get()
        # With recomputed old log-probs the loss's ratio starts at 1: the train/inference mismatch is
        # the rollout's log-probs against the recomputed ones, measured before the update.
        metrics = {**_flatten_metrics(tu.get(output, "metrics")), **mismatch}
        self.step += 1
        return StepReport(trained=True, samples=len(layout),
                          tokens=int(padded.tensors["attention_mask"].sum()),
                          truncated_tokens=padded.truncated_tokens, metrics=metrics)

    def _correct(self, data: Any, padded: Any, recomputed: torch.Tensor) -> dict[str, float]:  # noqa: ANN401
        """Decoupled mode: veRL's rollout correction of the recomputed (proximal) log-probs against the
        engines' (:func:`turnstile.learner.correction.correct`): the weights go to veRL's loss as
        ``rollout_is_weights``; rejected tokens leave ``response_mask`` and the loss's token count
        (``loss_mask``). Without weights or masks configured, only the mismatch is measured."""
        behaviour, mask = padded.tensors["old_log_probs"], padded.tensors["response_mask"]
        width = min(behaviour.shape[1], recomputed.shape[1])
        weights, kept, metrics = correct(recomputed[:, :width], behaviour[:, :width], mask[:, :width],
                                         self.config.rollout_correction)
        if weights is not None:
            data["rollout_is_weights"] = torch.nn.functional.pad(weights, (0, mask.shape[1] - width))
        if not torch.equal(kept, mask[:, :width].to(kept.dtype)):
            whole = mask.clone()
            whole[:, :width] = kept.to(mask.dtype)
            data["response_mask"] = data["loss_mask"] = whole
        return metrics

    def log_probs(self, samples: Sequence[Sample]) -> torch.Tensor:
        """Current-policy log-probs of each sample's response tokens (padded, 0 past the end; with
        ``head_chunk`` > 0 also 0 at observation tokens, which are not projected)."""
        self._require_started()
        return self._log_probs(self._actor, list(samples))

    def _log_probs(self, group: Any, samples: Sequence[Sample]) -> torch.Tensor:  # noqa: ANN401
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        rows = list(samples)
        extra = (-len(rows)) % self.config.dp
        # Inference may pad with copies (no gradient flows); their outputs are discarded.
        data, _ = self._tensordict(rows + rows[:extra])
        # One sequence per forward: any count splits evenly, and inference holds no activations.
        tu.assign_non_tensor(data, compute_loss=False, temperature=1.0, micro_batch_size_per_gpu=1,
                             use_fused_kernels=self.config.head_chunk > 0)
        output = group.infer_batch(data).get()
        values = no_padding_2_padding(tu.get(output, "log_probs"), data)
        return values[:len(rows)].float()

    def _tensordict(self, samples: Sequence[Sample]) -> tuple[Any, Any]:
        from verl import DataProto
        from verl.workers.utils.padding import left_right_2_no_padding

        padded = collate(samples, self._pad_token_id, max_length=self.config.max_length)
        data = DataProto.from_single_dict(padded.single_dict()).to_tensordict()
        return left_right_2_no_padding(data), padded

    # -- weights and checkpoints -----------------------------------------------------------------
    def full_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full parameters under their Hugging Face names, on CPU."""
        self._require_started()
        gathered = [w for w in self._actor.full_weights() if w is not None]
        return gathered[0]

    def save(self, directory: str | Path) -> Path:
        """Model, optimiser, scheduler and RNG state (veRL's checkpoint), plus step and version."""
        self._require_started()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._actor.save_checkpoint(str(directory / "actor"), global_step=self.step)
        # The reference never changes: a resumed learner rebuilds it from the model path.
        state = {"step": self.step, "weights_version": self.weights_version, "model": self._model_path,
                 "config": asdict(self.config)}
        with atomic_write(directory / "learner.json") as file:
            file.write(json.dumps(state, indent=1))
        return directory

    def load(self, directory: str | Path) -> None:
        """Resume from :meth:`save`'s directory: the next step continues where that run stopped."""
        self._require_started()
        directory = Path(directory)
        state_file = directory / "learner.json"
        if not state_file.is_file():
            raise LearnerError(f"{directory} is not a learner checkpoint (no learner.json): pass the "
                               "directory a previous run's Learner.save wrote")
        state = json.loads(state_file.read_text())
        self._actor.load_checkpoint(str(directory / "actor"), del_local_after_load=False)
        self.step = int(state["step"])
        self.weights_version = int(state["weights_version"])

    def close(self) -> None:
        """Stop the worker processes."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in (self._actor, self._reference):
            if group is not None:
                for worker in group.workers:
                    ray.kill(worker)
        for pool in self._pools:
            for pg in pool.pgs or []:
                remove_placement_group(pg)
        self._actor = self._reference = None
        self._pools = []

    def _require_started(self) -> None:
        if self._actor is None:
            raise LearnerError("the learner is not started: call Learner.start() first")


def _check_gpu_stack() -> None:
    """The GPU learner packs a micro-batch's samples into one sequence (veRL's remove-padding path),
    whose attention needs flash-attention's variable-length kernel."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        raise LearnerError("the learner on GPUs needs flash-attention (packed samples attend only within "
                           "themselves through its variable-length kernel): `pip install flash-attn "
                           "--no-build-isolation` on every GPU node, or learner.gpu=false")


def _pad_token_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def _flatten_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """veRL returns lists per mini-batch (and Metric objects): the mean of each (the largest for a
    ``*_max`` key), as floats."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        numbers = [float(getattr(v, "value", v))  # type: ignore[arg-type]  # _is_number read it
                   for v in values if _is_number(getattr(v, "value", v))]
        if numbers:
            flat[key] = max(numbers) if key.endswith("_max") else sum(numbers) / len(numbers)
    return flat


def _is_number(value: object) -> bool:
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
