"""Weight publishing: after an update, the rollout engines serve the learner's weights under a new version.

Two ways, chosen by the engines' ``weight_sync`` setting (``engine.vllm.weight_sync``):

- ``inplace`` (default; the CPU path and single-node runs): rank 0 of the learner gathers the full
  parameters, one copy goes into Ray's object store, and every replica loads it in place
  (:meth:`turnstile.rollout.fleet.EngineRouter.update_weights`). No restart; running requests are recomputed
  on the new weights.
- ``checkpoint`` (the GPU cluster default in ``examples/``): the weights are written as safetensors
  into a shared directory (``engine.vllm.checkpoint_dir``, a path every engine node can read), then
  every replica is told to load it. We chose the directory over NCCL for clusters because it needs no
  collective group spanning the learner ranks and the vLLM replicas (the fleet grows and shrinks
  freely), a restarted replica can reload the newest version from it, and it is the same code this
  machine tests end to end. vLLM's NCCL weight-transfer path (``weight_sync=nccl``) exists in the
  engine for large models where the disk round trip dominates; it is untested here (no GPU).

Either way the engines report the version they serve (``weights_version()``), and every turn a
rollout generates records the version that produced it. Every replica's update has a time-out
(``rollout.fleet.publish_timeout_s``): a replica that does not serve the new version in time, or
whose update raises, is left behind (:class:`Published`), and the fleet replaces it
(:meth:`turnstile.cluster.fleet.elastic.ElasticFleet.publish`); a publish no replica completes raises.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from turnstile.envs.files import atomic_directory, atomic_path
from turnstile.rollout.engines.base import PolicyEngine
from turnstile.rollout.fleet import EngineRouter
from turnstile.rollout.model_store import BUILD_INFO, kept_versions

MODES = ("inplace", "checkpoint")


class PublishError(RuntimeError):
    """Publishing failed; the engines keep serving the previous version."""


@dataclass(frozen=True)
class Published:
    """What a publish did: the version the engines serve, and the replicas it left behind (id ->
    why), which the fleet replaces."""

    version: int
    behind: Mapping[int, str] = field(default_factory=dict)


async def publish(engine: PolicyEngine | EngineRouter, weights: Mapping[str, torch.Tensor], version: int, *,
                  mode: str = "inplace", checkpoint_dir: str | Path | None = None,
                  timeout_s: float | None = None) -> Published:
    """Make ``engine`` (one engine or an :class:`~turnstile.rollout.fleet.EngineRouter`) serve ``weights``.

    Each replica's update has ``timeout_s`` (None: no limit). A router's replica that does not serve
    the new version in time, or whose update raises, is left behind (and leaves the router); a
    publish that no replica completes, or one engine's that does not, raises :class:`PublishError`:
    never a hang.
    """
    if mode not in MODES:
        raise PublishError(f"unknown publish mode {mode!r}: use one of {', '.join(MODES)}")
    if mode == "checkpoint":
        if not checkpoint_dir:
            raise PublishError("publishing through a checkpoint needs engine.vllm.checkpoint_dir: a "
                               "directory every engine node can read")
        write_checkpoint(weights, checkpoint_dir)
        weights = {}
    if isinstance(engine, EngineRouter):  # each replica checked on its own, with its own deadline
        try:
            return Published(version, await engine.update_replicas(version, weights, timeout_s))
        except RuntimeError as error:  # no replica took it
            raise PublishError(str(error)) from None
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            await engine.update_weights(version, weights)
            served = await engine.weights_version()
    except TimeoutError:
        if deadline.expired():
            raise PublishError(f"the engine did not take version {version} within {timeout_s:g} s") from None
        raise
    if served != version:
        raise PublishError(f"the engines serve version {served} after publishing version {version}")
    return Published(served)


def write_checkpoint(weights: Mapping[str, torch.Tensor], directory: str | Path) -> Path:
    """Write ``weights`` as one safetensors file, replacing the directory's previous weights atomically.

    The file is written beside the target and renamed into place, so a reader sees the old or the
    new weights, never half of them. Tied tensors (shared storage) are written once each.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in weights.items()}
    with atomic_path(directory / "model.safetensors") as temporary:
        save_file(tensors, str(temporary))
    return directory


def save_hf_model(weights: Mapping[str, torch.Tensor], base_model: str | Path, out: str | Path,
                  about: Mapping[str, object] | None = None) -> Path:
    """A loadable Hugging Face model directory: ``base_model``'s config and tokenizer, these weights.
    ``about``: what the model is, written as its ``turnstile-model.json`` with the base's own
    description under ``base`` (without it, the base's file is copied as it is)."""
    base, out = Path(base_model), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        base_weights = item.name.endswith((".safetensors", ".bin")) or item.name == "model.safetensors.index.json"
        if item.is_file() and not base_weights:
            shutil.copy2(item, out / item.name)
    write_checkpoint(weights, out)
    if about is not None:
        described = base / BUILD_INFO
        info = {**about, "base": json.loads(described.read_text()) if described.is_file() else str(base)}
        (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return out


def replace_model(weights: Mapping[str, torch.Tensor], base_model: str | Path, target: str | Path,
                  about: Mapping[str, object] | None = None) -> Path:
    """:func:`save_hf_model` into ``target``, written beside it and swapped in whole: a reader
    finds the previous model or this one, never a mix."""
    target = Path(target)
    with atomic_directory(target, force=True) as staging:
        save_hf_model(weights, base_model, staging, about)
    return target


# ---- past versions, for scoring trajectories by the weights that generated them --------------------

class WeightsArchive:
    """Recent weights versions as loadable model directories ``<root>/v<N>``, the newest ``keep``.

    The training loop adds every published version (before the engines serve it); version 0 is a
    link to the base model. What reads it (the ``information_gain`` reward) scores a trajectory with
    the version that generated it, or the closest one still kept
    (:func:`turnstile.rollout.model_store.closest_version`). With the
    async loop's staleness bound η, ``keep = η + 2`` keeps every version a sample can still come from.
    """

    def __init__(self, root: str | Path, base_model: str | Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"a weights archive keeps at least 1 version, got keep={keep}")
        self.root, self.base, self.keep = Path(root), Path(base_model), keep
        self.root.mkdir(parents=True, exist_ok=True)
        zero = self.root / "v0"
        if not zero.exists():
            zero.symlink_to(self.base.resolve(), target_is_directory=True)

    def add(self, version: int, weights: Mapping[str, torch.Tensor]) -> Path:
        """Write ``version`` (atomically: a reader sees the whole directory or none) and prune."""
        target = replace_model(weights, self.base, self.root / f"v{version}")
        for old in sorted(kept_versions(self.root))[:-self.keep]:
            _remove(self.root / f"v{old}")
        return target


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
