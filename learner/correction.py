"""Rollout correction: veRL's own (``verl.trainer.ppo.rollout_corr_helper``) on turnstile's samples.

The engine that sampled a token (vLLM in bf16, a weights version one or more updates old in async
mode) is not the policy the learner computes: the *behaviour* log-probs each turn carries
(``turn.response_logprobs``, with ``turn.weights_version``) differ from the learner's. veRL corrects
the gap with importance weights π_learner / π_engine, truncated at a bound (TIS) or zeroed outside
two bounds (IcePop), and with rejection masks that drop tokens or whole sequences whose divergence
passes a bound. This module hands turnstile's padded batch to those functions; it computes no
weight or mask of its own. docs/algorithms.md §12 has the equations.

Two modes, as veRL names them:

- **decoupled** (the proximal log-probs recomputed by the learner, ``recompute_old_log_probs``):
  :func:`correct` runs once per step on the controller, proximal against behaviour; the weights go
  to veRL's loss as ``rollout_is_weights`` and the rejection mask replaces ``response_mask``
  (so masked tokens also leave the token count the loss is averaged over, as in veRL's trainer).
- **bypass** (the behaviour log-probs are PPO's old policy): veRL's ``bypass_mode`` loss computes
  the mask inside the loss against the current policy; with its
  ``ppo_clip`` loss the clipped ratio is the correction and the weights are metrics only.

What veRL cannot take is turnstile's *turn*: a sample is a whole segment of up to hundreds of turns,
and a sequence-level weight over all of them is a product of thousands of token ratios. The
thinnest adapter (:func:`turn_rows`) lays each turn's generated tokens out as a row of its own, so
that veRL's sequence-level weight and sequence-level rejection options act per turn
(``rollout_is: turn``, ``rollout_rs: turn_mean_k3`` ...), and puts the result back in place.

The guard (:func:`guard_message`) reads the step's mismatch KL, veRL's ``rollout_corr/kl``
(KL(π_engine ‖ π_learner), per token); its default bound, 0.1, is the one veRL's rollout-correction
guide checks in its health example (``abs(kl) > 0.1``: "significant off-policy gap").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

IS_LEVELS = ("token", "turn", "sequence")
# veRL's rejection options (rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS), and the same
# sequence-level ones per turn.
VERL_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                   "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
TURN_RS_OPTIONS = tuple("turn_" + option.removeprefix("seq_") for option in VERL_RS_OPTIONS
                        if option.startswith("seq_"))
LOSS_TYPES = ("ppo_clip", "reinforce")  # veRL's bypass-mode losses
ON_EXCESS = ("warn", "stop")
KL_BOUND = 0.1  # veRL's rollout-correction guide, its health check: abs(rollout_corr/kl) > 0.1


class CorrectionError(ValueError):
    """A ``learner.rollout_correction`` setting that cannot work; the message names the fix."""


@dataclass(frozen=True)
class CorrectionConfig:
    """``learner.rollout_correction``: veRL's ``algorithm.rollout_correction`` fields, a turn level,
    and the guard. Nothing set: no weights and no mask, the mismatch still measured and guarded."""

    rollout_is: str | None = None  # token | turn | sequence: importance weights at that level
    # TIS: a number, weights truncated there (above 1); IcePop: "lower_upper", zeroed outside them
    # (text, as veRL parses it: a YAML number is taken as its text)
    rollout_is_threshold: str = "2.0"
    rollout_is_batch_normalize: bool = False  # weights scaled to mean 1 over the batch
    # rejection: veRL's options (token_k3, seq_mean_k3, ..., comma-separated) or the same per turn
    # (turn_mean_k3, turn_sum_k1, turn_max_k2, ...)
    rollout_rs: str | None = None
    rollout_rs_threshold: str | None = None
    loss_type: str = "ppo_clip"  # bypass mode only (veRL's): ppo_clip | reinforce
    max_kl: float = KL_BOUND  # the guard: |mismatch KL| per token above this ...
    on_excess: str = "warn"  # ... warns once (warn) or ends the run (stop)

    def __post_init__(self) -> None:
        # (the config loader names the section: "learner.rollout_correction: rollout_is=...")
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise CorrectionError(f"rollout_is={self.rollout_is!r} is not one of {', '.join(IS_LEVELS)} "
                                  "(or empty: no importance weights)")
        lower, upper = self.is_bounds()  # checked when unused too: a typo there is a typo
        if lower is None and upper < 1:
            raise CorrectionError(f"rollout_is_threshold={self.rollout_is_threshold} is below 1: TIS "
                                  "truncates every weight above it, so even tokens the engine and the learner "
                                  "agree on (weight 1) would be scaled down; use a bound above 1 (veRL's "
                                  "guide: 1.5-5 per token, 2-10 per sequence)")
        if lower is not None and not lower <= 1 <= upper:
            raise CorrectionError(f"rollout_is_threshold={self.rollout_is_threshold!r}: IcePop keeps "
                                  "weights between the two bounds, which must enclose 1 (e.g. '0.5_2.0')")
        options = self.rs_options()
        unknown = [o for o in options if o not in VERL_RS_OPTIONS + TURN_RS_OPTIONS]
        if unknown:
            raise CorrectionError(f"rollout_rs: {unknown[0]!r} is not one of "
                                  f"{', '.join(VERL_RS_OPTIONS + TURN_RS_OPTIONS)}")
        if options and len({o.startswith("turn_") for o in options}) > 1:
            raise CorrectionError(f"rollout_rs={self.rollout_rs!r} mixes turn-level options with others: "
                                  "choose one level")
        if options and self.rollout_rs_threshold is None:
            raise CorrectionError(f"rollout_rs={self.rollout_rs!r} needs rollout_rs_threshold (a bound "
                                  "per option, comma-separated; 'lower_upper' ratios for *_k1)")
        if self.loss_type not in LOSS_TYPES:
            raise CorrectionError(f"loss_type={self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.on_excess not in ON_EXCESS:
            raise CorrectionError(f"on_excess={self.on_excess!r} is not one of {', '.join(ON_EXCESS)}")
        if not (math.isfinite(self.max_kl) and self.max_kl > 0):
            raise CorrectionError(f"max_kl={self.max_kl} must be a number > 0")

    @property
    def active(self) -> bool:
        """Whether it weights or masks anything (otherwise the mismatch is only measured)."""
        return self.rollout_is is not None or bool(self.rs_options())

    def is_bounds(self) -> tuple[float | None, float]:
        """(lower, upper) of the importance weights: lower None for TIS."""
        spec = self.rollout_is_threshold
        try:
            if "_" in spec:
                low, high = spec.split("_", 1)
                return float(low), float(high)
            return None, float(spec)
        except ValueError:
            raise CorrectionError(f"rollout_is_threshold={spec!r} is neither a number "
                                  "(TIS) nor 'lower_upper' (IcePop)") from None

    def rs_options(self) -> list[str]:
        return [o.strip() for o in (self.rollout_rs or "").split(",") if o.strip()]

    def check_mode(self, *, recompute: bool, loss: str) -> None:
        """What bypass mode (no recomputed proximal log-probs) cannot do, one line each."""
        if recompute or not self.active:
            return
        fix = "set learner.recompute_old_log_probs=true (decoupled mode)"
        if loss != "vanilla":
            raise CorrectionError(f"rollout_correction with loss={loss} needs the proximal log-probs: "
                                  f"veRL's bypass mode has PPO-clip and REINFORCE losses only; {fix}")
        if self.rollout_is == "turn" or any(o.startswith("turn_") for o in self.rs_options()):
            raise CorrectionError(f"rollout_correction: turn-level weights or masks are computed once per step "
                                  f"against the proximal policy; {fix}")

    def verl(self) -> dict[str, Any]:
        """veRL's ``rollout_correction`` dict (for its bypass-mode loss)."""
        return {key: value for key, value in asdict(self).items() if key not in ("max_kl", "on_excess")}


def turn_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each turn's generated tokens as a row: a turn is a run of ``mask`` 1s (observation tokens,
    0, separate turns). Returns (row, column) of every masked-in token in the turn layout and that
    layout's width; (sample, position) are ``mask.nonzero()`` in the same order."""
    keep = mask.bool()
    flat = keep.flatten()
    starts = flat & ~torch.cat([torch.zeros(1, dtype=torch.bool), flat[:-1]])
    starts.view_as(keep)[:, 0] = keep[:, 0]  # a row's first token starts a turn even after the previous row's
    turn = torch.cumsum(starts.long(), 0) - 1
    row = turn[flat]
    counts = torch.bincount(row) if row.numel() else torch.zeros(0, dtype=torch.long)
    first = torch.cumsum(counts, 0) - counts
    column = torch.arange(row.numel()) - first[row]
    return row, column, torch.tensor(int(counts.max()) if counts.numel() else 0)


def _in_turns(values: torch.Tensor, mask: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              fill: float = 0.0) -> torch.Tensor:
    row, column, width = rows
    out = torch.full((int(row.max()) + 1 if row.numel() else 0, int(width)), fill, dtype=values.dtype)
    out[row, column] = values[mask.bool()]
    return out


def correct(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
            config: CorrectionConfig) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Decoupled mode: veRL's importance weights and rejection mask of ``proximal`` (the learner's
    log-probs before the update) against ``behaviour`` (the engines'), padded (samples, tokens) with
    ``mask`` 1 on generated tokens. Returns (weights or None, the mask with rejected tokens 0,
    veRL's ``rollout_corr/*`` metrics and :func:`summary`'s)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as verl_correct

    proximal, behaviour, mask = proximal.float(), behaviour.float(), mask.float()
    if not mask.any():
        return None, mask, {}
    options = config.rs_options()
    turn_is, turn_rs = config.rollout_is == "turn", bool(options) and options[0].startswith("turn_")
    # the token and sequence levels, and the off-policy metrics (KL, χ², perplexities), on the samples
    weights_proto, kept, metrics = verl_correct(
        proximal, behaviour, mask, rollout_is=None if turn_is else config.rollout_is,
        rollout_is_threshold=config.rollout_is_threshold,
        rollout_is_batch_normalize=config.rollout_is_batch_normalize,
        rollout_rs=None if turn_rs or not options else ",".join(options),
        rollout_rs_threshold=config.rollout_rs_threshold)
    weights = weights_proto.batch["rollout_is_weights"] if weights_proto is not None else None
    if turn_is or turn_rs:  # veRL's sequence level, each turn a sequence
        rows = turn_rows(mask)
        turn_weights, turn_kept, turn_metrics = verl_correct(
            _in_turns(proximal, mask, rows), _in_turns(behaviour, mask, rows), _in_turns(mask, mask, rows),
            rollout_is="sequence" if turn_is else None, rollout_is_threshold=config.rollout_is_threshold,
            rollout_is_batch_normalize=config.rollout_is_batch_normalize,
            rollout_rs=",".join("seq_" + o.removeprefix("turn_") for o in options) if turn_rs else None,
            rollout_rs_threshold=config.rollout_rs_threshold)
        row, column, _ = rows
        if turn_weights is not None:
            weights = torch.zeros_like(mask)
            weights[mask.bool()] = turn_weights.batch["rollout_is_weights"][row, column]
        if turn_rs:
            kept = mask.clone()
            kept[mask.bool()] = turn_kept[row, column].to(kept.dtype)
        metrics.update({key: value for key, value in turn_metrics.items()
                        if "rollout_is" in key or "rollout_rs" in key})
    return weights, kept, {**metrics, **summary(metrics)}


def summary(metrics: dict[str, float]) -> dict[str, float]:
    """The step's correction in four numbers, from veRL's ``rollout_corr/*`` metrics: the applied
    weights' mean and max, the share of tokens whose weight was truncated at the bound (or zeroed
    by IcePop), and the share masked by rejection."""
    out = {}
    if "rollout_corr/rollout_is_mean" in metrics:
        out["correction/is_weight_mean"] = metrics["rollout_corr/rollout_is_mean"]
        out["correction/is_weight_max"] = metrics["rollout_corr/rollout_is_max"]
        # TIS changes the weights above its bound; IcePop zeroes those outside its two (veRL's oob ratio)
        out["correction/truncated"] = metrics.get("rollout_corr/rollout_is_oob_ratio",
                                                  metrics.get("rollout_corr/rollout_is_ratio_fraction_high", 0.0))
    if "rollout_corr/rollout_rs_masked_fraction" in metrics:
        out["correction/masked"] = metrics["rollout_corr/rollout_rs_masked_fraction"]
    return out


def mismatch_metrics(current: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """veRL's off-policy metrics (``rollout_corr/kl``, ``k3_kl``, ``chi2_token`` ...) of the
    learner's log-probs against the engines', without weights or masks."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs

    if not mask.bool().any():
        return {}
    return compute_rollout_corr_metrics_from_logprobs(current.float(), behaviour.float(), mask.float())


def guard_message(metrics: dict[str, float], config: CorrectionConfig, step: int) -> str | None:
    """What to tell the user when the step's mismatch KL (``rollout_corr/kl``, learner metrics)
    passes ``max_kl``; None while it does not (or was not measured)."""
    kl = metrics.get("rollout_corr/kl")
    if kl is None or abs(kl) <= config.max_kl:
        return None
    k3 = metrics.get("rollout_corr/k3_kl", float("nan"))
    advice = ("the correction is on and the gap is this large all the same: look for engines serving other "
              "weights than the learner's (a failed publish), another dtype or quantisation, or sampling "
              "settings the log-probs do not reflect" if config.active else
              "turn on veRL's rollout correction (learner.recompute_old_log_probs=true "
              "learner.rollout_correction.rollout_is=token), or bring the engines closer to the learner "
              "(rollout.engine.dtype=float32, a lower staleness)")
    return (f"step {step}: the engines' log-probs differ from the learner's by KL {kl:.3g} per token "
            f"(k3 {k3:.3g}), above learner.rollout_correction.max_kl={config.max_kl:g}; {advice}")
