"""``igpo``: turn-level credit from information gain, format penalties and the outcome
(docs/algorithms.md §4–5, the DR-Venus variant of IGPO).

A trajectory's *boundaries* are the turns that carry a reward: the turns that receive an
information gain (browse-aware: by default only visits), the malformed non-final turns (format
penalty) and the last turn (the outcome). Rewards are normalised within the group, turn rewards
scaled against outcomes over the batch (IG-Scale), then accumulated backwards over boundaries.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from turnstile.learner.credit.estimators import check_format_penalty, check_gamma, outcome_reward
from turnstile.learner.credit.normalize import (
    Norm,
    Rewards,
    discount_over_boundaries,
    ig_scale,
    join_separate,
    member,
    normalize_pooled,
    normalize_separately,
)
from turnstile.learner.credit.records import Group, GroupCredit, TurnCredit, origin, turn_numbers
from turnstile.learner.credit.registry import CreditResult, Estimator, register
from turnstile.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

Stats = dict[str, float]


class IgType(StrEnum):
    log_prob_diff = "log_prob_diff"  # IG = v_s − v_prev (v is a mean log-probability)
    prob_diff = "prob_diff"  # IG = exp(v_s) − exp(v_prev)


@dataclass
class IgpoOptions:
    norm: Norm = Norm.scaled_separate
    gamma: float = 0.95  # discount between consecutive boundaries
    eta: float = 0.3  # IG-Scale floor of the mean |normalised outcome|
    s_max: float = 10.0  # IG-Scale cap
    format_penalty: float = 1.0  # λ_fmt; 0 turns the format penalty off (turn and outcome)
    penalise_unanswered: bool = True  # false: only a malformed answer pays λ_fmt; a cut episode scores 0
    ig_tools: list[str] = field(default_factory=lambda: ["visit"])  # [] = every turn boundary
    # false: a tool call that failed (a page that does not exist, a refused call: tool_ok false) read
    # nothing and is no boundary; the gain since the last one goes to the next call that succeeds
    credit_failed_calls: bool = True
    ig_type: IgType = IgType.log_prob_diff

    def __post_init__(self) -> None:
        self.norm = member(Norm, self.norm, "norm")
        self.ig_type = member(IgType, self.ig_type, "ig_type")
        check_gamma(self.gamma)
        check_format_penalty(self.format_penalty)
        if not (math.isfinite(self.eta) and self.eta >= 0):
            raise ValueError(f"eta={self.eta}: must be a finite number >= 0")
        if not (math.isfinite(self.s_max) and self.s_max > 0):
            raise ValueError(f"s_max={self.s_max}: must be a finite number > 0")
        if any(not tool for tool in self.ig_tools):
            raise ValueError(f"ig_tools={self.ig_tools}: tool names must be non-empty "
                             f"(write ig_tools=[] for every turn boundary)")


def assign_information_gain(values: Sequence[float], tools: Sequence[str | None],
                            ig_tools: Collection[str] = ("visit",),
                            ig_type: IgType = IgType.log_prob_diff) -> list[float | None]:
    """Browse-aware information gain of each turn (§4).

    ``values[s]`` is ``v_s``, measured before turn ``s`` (``v_0``: the question alone); ``tools[s]``
    is the tool turn ``s`` called, ``None`` for an answer or a malformed turn. Step ``s ≥ 1`` is kept
    iff ``tools[s−1]`` is in ``ig_tools``; with ``ig_tools`` empty every step is kept, malformed turns
    included (DR-Venus without a tool filter: each turn boundary is measured, and the next gain
    starts from it; the estimator then puts the format penalty in place of a malformed turn's gain).
    A kept step's gain over the previous kept step (initially ``v_0``) goes to turn ``s−1``. Other
    turns, and always the last turn, get ``None``. Searches thus pay off through the visit that
    reads what they found, and the gains telescope to ``v_last_kept − v_0``.
    """
    if len(values) != len(tools):
        raise ValueError(f"{len(values)} values for {len(tools)} turns; give one v per turn")
    measure = math.exp if IgType(ig_type) is IgType.prob_diff else float
    gains: list[float | None] = [None] * len(tools)
    previous = measure(values[0]) if values else 0.0
    for turn in range(len(tools) - 1):
        if ig_tools and tools[turn] not in ig_tools:  # None (answer, malformed) is never listed
            continue
        current = measure(values[turn + 1])
        gains[turn] = current - previous
        previous = current
    return gains


@register
class Igpo(Estimator):
    """Information-gain policy optimisation with browse-aware assignment, format penalty and IG-Scale.

    Writes per turn: ``ig`` (the assigned information gain or null), ``reward`` (IG, ``−λ_fmt`` or the
    outcome on boundaries, null elsewhere) and ``advantage``. ``stats["ig_scale"]`` is IG-Scale's ``s``.
    """

    name = "igpo"
    Options = IgpoOptions

    def __init__(self, options: IgpoOptions) -> None:
        self.options = options

    def assign(self, batch: Sequence[Group]) -> CreditResult:
        gains = [[self._information_gain(t) for t in group.trajectories] for group in batch]
        rewards = [[self._boundary_rewards(t, g) for t, g in zip(group.trajectories, gains_g, strict=True)]
                   for group, gains_g in zip(batch, gains, strict=True)]
        normalized, stats = self._normalize(rewards)
        credit: list[GroupCredit] = []
        for rewards_g, normalized_g, gains_g in zip(rewards, normalized, gains, strict=True):
            group_credit: GroupCredit = []
            for row, normalized_row, gain_row in zip(rewards_g, normalized_g, gains_g, strict=True):
                advantages = discount_over_boundaries(normalized_row, self.options.gamma)
                turns = zip(row, advantages, gain_row, strict=True)
                group_credit.append([TurnCredit(advantage=advantage, reward=reward, extras={"ig": gain})
                                     for reward, advantage, gain in turns])
            credit.append(group_credit)
        return CreditResult(groups=credit, stats=stats)

    def _normalize(self, rewards: Sequence[Sequence[Rewards]]) -> tuple[list[list[Rewards]], Stats]:
        """The boundary rewards normalised within each group as ``norm`` says; batch statistics."""
        if self.options.norm is Norm.joint:
            return [normalize_pooled(group) for group in rewards], {}
        split = [normalize_separately(group) for group in rewards]
        turns, outcomes = [turns for turns, _ in split], [outcomes for _, outcomes in split]
        stats: Stats = {}
        if self.options.norm is Norm.scaled_separate:
            scale = ig_scale(_present(outcomes), _present(turns), self.options.eta, self.options.s_max)
            turns = [[[None if r is None else r * scale for r in row] for row in group] for group in turns]
            stats["ig_scale"] = scale
        return [join_separate(group_turns, group_outcomes)
                for group_turns, group_outcomes in zip(turns, outcomes, strict=True)], stats

    def _information_gain(self, trajectory: Trajectory) -> list[float | None]:
        values = turn_numbers(
            trajectory, "ig_value", why="igpo needs the information-gain value measured before every turn; run the "
                     "information-gain reward first, or use grpo")
        if values[0] is None:  # then every value is: the gold answer had no tokens (§4)
            log.warning("%s: v is null on every turn; information gain is off for this "
                        "trajectory (outcome and format penalties only)", origin(trajectory))
            return [None] * len(values)
        tools = [turn.called_tool if turn.format_ok and (self.options.credit_failed_calls or turn.tool_ok is not False)
                 else None for turn in trajectory.turns]
        return assign_information_gain([float(v) for v in values if v is not None], tools,
                                       self.options.ig_tools, self.options.ig_type)

    def _boundary_rewards(self, trajectory: Trajectory, gains: Sequence[float | None]) -> Rewards:
        """Per turn: the format penalty in place of IG on a malformed non-final turn, else the IG;
        the outcome (with the §3 format rule) on the last turn."""
        penalty = self.options.format_penalty
        rewards: Rewards = []
        for turn, gain in zip(trajectory.turns[:-1], gains, strict=False):
            rewards.append(-penalty if penalty > 0 and not turn.format_ok else gain)
        rewards.append(outcome_reward(trajectory, penalty, self.options.penalise_unanswered))
        return rewards


def _present(groups: Sequence[Sequence[Rewards]]) -> list[float]:
    return [r for group in groups for row in group for r in row if r is not None]
