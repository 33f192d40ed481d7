"""The veRL side of the learner: our training worker and the SFT loss, both run inside veRL workers.

This module imports veRL, so a process must have its environment set first (``learner.verl_cpu``
on CPU); :mod:`turnstile.learner.trainer` imports it only after doing so.

``PolicyWorker`` is veRL's :class:`~verl.workers.engine_workers.TrainingWorker` (FSDP2 engine, loss
set by the controller) plus two calls veRL's worker lacks: ``full_weights`` gathers the full
(unsharded) parameters under their Hugging Face names, which is what our policy engines load, and
``use_chunked_head`` gives the model :mod:`turnstile.learner.head`'s LM head (log-probs only where trained).
Everything else — updates, log-probs, checkpoints — is veRL's own.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from turnstile.learner.batch import ratio_metrics


class PolicyWorker(TrainingWorker):
    """veRL's training worker with a full-weights export for publishing to the rollout engines."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # veRL registers it at import
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Every rank takes part in gathering the shards; rank 0 returns the tensors (on CPU)."""
        params, _ = self.engine.get_per_tensor_param()
        gathered = {name: tensor.detach().to("cpu", copy=True) for name, tensor in params}
        return gathered if self.rank == 0 else None


    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]
    def use_chunked_head(self, chunk: int) -> None:
        """Project only trained positions onto the vocabulary, ``chunk`` at a time (:mod:`turnstile.learner.head`)."""
        from turnstile.learner.head import install

        install(self.engine, chunk)


def weighted_sft_loss(config: Any, model_output: TensorDict, data: TensorDict,  # noqa: ANN401, ARG001
                      dp_group: object = None) -> tuple[torch.Tensor, dict[str, Any]]:  # noqa: ARG001 - veRL's API
    """Token-mean cross-entropy over policy tokens, each token weighted by ``loss_weights``.

    Observation and padding tokens have ``response_mask`` 0 and do not count; ABC-SFT's per-turn
    weights w(r) (docs/algorithms.md §6) arrive as ``loss_weights`` (1.0 for plain SFT). The mean is over the
    whole global batch, as veRL's losses do: the sum on this rank is divided by the batch's policy
    token count and multiplied by the data-parallel size (the gradients are averaged over ranks).
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    fields = data.select("response_mask", "loss_weights").to_padded_tensor()
    mask = fields["response_mask"].to(log_prob.dtype)
    weights = fields["loss_weights"].to(log_prob.dtype)
    batch_num_tokens = data["batch_num_tokens"]
    dp_size = data["dp_size"]
    scale = dp_size / max(float(batch_num_tokens), 1.0)
    loss = -(log_prob * weights * mask).sum() * scale
    # Partial sums like the loss: veRL sums them over micro-batches and averages over ranks, which
    # gives the mean over the batch's policy tokens.
    metrics = {"sft/nll": Metric(value=(-(log_prob * mask).sum() * scale).item(), aggregation=AggregationType.SUM),
               "sft/weight_mean": Metric(value=((weights * mask).sum() * scale).item(),
                                         aggregation=AggregationType.SUM)}
    return loss, metrics


def ppo_loss_with_mismatch(config: Any, model_output: TensorDict, data: TensorDict,  # noqa: ANN401
                           dp_group: object = None, *, bypass: bool = True) -> tuple[torch.Tensor, dict[str, Any]]:
    """veRL's ``ppo_loss``, plus the importance ratio between the learner's log-probs and the old
    policy's on the same response tokens: ``mismatch/ratio_mean``, ``mismatch/ratio_max`` and
    ``mismatch/clipped`` (the share outside the clip range): per token, or per sequence for GSPO,
    whose ratio is each sequence's geometric mean.

    With the rollout's own log-probs as the old policy (``recompute_old_log_probs=false``, the
    vanilla loss's default), the ratio of a step's first mini-batch is the train/inference mismatch
    the seeds' systems watch: the same weights, two implementations. Later mini-batches add the
    step's own updates. With recomputed old log-probs (GSPO's default) the learner overwrites these
    three with the rollout's log-probs against the recomputed ones, the same mismatch
    (:meth:`turnstile.learner.trainer.Learner._train`).

    In ``bypass`` mode (the engines' log-probs are the old policy) it also reports veRL's off-policy
    metrics of the current policy against the engines' (``rollout_corr/kl``, ``k3_kl`` ...): veRL's
    bypass-mode loss measures them itself when the rollout correction is on, and
    :func:`turnstile.learner.correction.mismatch_metrics` when it is off; with the
    correction's :func:`~turnstile.learner.correction.summary`. In decoupled mode the learner
    measures them once per step, before the update.
    """
    from verl.workers.utils.losses import ppo_loss

    from turnstile.learner.correction import mismatch_metrics, summary

    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    log_prob = no_padding_2_padding(model_output["log_probs"], data).detach()
    fields = data.select("response_mask", "old_log_probs").to_padded_tensor()
    if bypass:
        measured = {key: metric.aggregate() if isinstance(metric, Metric) else metric
                    for key, metric in metrics.items() if key.startswith("rollout_corr/")}
        measured = measured or mismatch_metrics(log_prob, fields["old_log_probs"], fields["response_mask"])
        for key, value in {**measured, **summary(measured)}.items():
            metrics[key] = Metric(value=float(value), aggregation=AggregationType.MAX if key.endswith("max")
                                  else AggregationType.MEAN)
    ratios = ratio_metrics(log_prob, fields["old_log_probs"], fields["response_mask"],
                           per_sequence=config.policy_loss.get("loss_mode") == "gspo",
                           clip_low=config.clip_ratio_low, clip_high=config.clip_ratio_high)
    for key, value in ratios.items():
        metrics[key] = Metric(value=value, aggregation=AggregationType.MAX if key.endswith("max")
                              else AggregationType.MEAN)
    return loss, metrics


def shared_gpu_pool(ranks: int, share: int) -> Any:  # noqa: ANN401 - veRL's RayResourcePool
    """veRL's resource pool for ``ranks`` workers on one node, each reserving ``1/share`` of a GPU
    (``learner.gpu_share``): veRL asks ``1/max_colocate_count`` GPU for each worker, and its own
    bundles would reserve whole GPUs, so the placement group is made here with bundles of that share."""
    import ray
    from ray.util.placement_group import placement_group
    from verl.single_controller.ray import RayResourcePool

    pool = RayResourcePool(process_on_nodes=[ranks], use_gpu=True, max_colocate_count=share)
    group = placement_group([{"CPU": 1, "GPU": 1 / share} for _ in range(ranks)], strategy="STRICT_PACK")
    ray.get(group.ready())
    pool.pgs = [group]  # type: ignore[assignment]  # veRL declares it None until it makes them
    return pool
