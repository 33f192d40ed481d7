"""The estimator contract and the registry that finds estimators by name.

Code that runs credit assignment (the learner, ``turnstile credit``) names an estimator in config
and looks it up here; it never lists the estimators itself. A new estimator is a subclass of
:class:`Estimator`: decorated with :func:`register` in a module that ``learner.credit`` imports,
declared under the entry-point group ``turnstile.estimators``, or named as ``package.module:Class``
(``estimator.kind=mypkg.credit:Mine``, ``turnstile credit --estimator mypkg.credit:Mine``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from turnstile.envs.plugins import Registry, typed_options
from turnstile.learner.credit.records import Group, GroupCredit


@dataclass(frozen=True)
class CreditResult:
    """One estimator's output for a batch: per group, per trajectory, per turn; and batch statistics
    worth logging (e.g. ``ig_scale``)."""

    groups: list[GroupCredit]
    stats: dict[str, float] = field(default_factory=dict)


class Estimator(ABC):
    """Turns groups of trajectories with per-turn rewards into per-turn advantages.

    Contract:

    - ``Options`` is a dataclass whose fields are the estimator's options and whose defaults are
      those of docs/algorithms.md; ``__init__`` takes one instance of it (validated on construction).
    - :meth:`assign` receives the whole batch: estimators with batch-wide statistics (IG-Scale)
      compute them over it. It returns one :class:`~turnstile.learner.credit.records.TurnCredit` per turn of
      every trajectory, in the order given, with a finite advantage; it does not modify its input.
    - A trajectory lacking a field the estimator reads raises
      :class:`~turnstile.learner.credit.records.CreditInputError` naming the line and field.
    - Permuting the trajectories of a group permutes their credit and changes nothing else.
    """

    name: ClassVar[str]
    Options: ClassVar[type]

    @abstractmethod
    def assign(self, batch: Sequence[Group]) -> CreditResult:
        """Credit for every turn of every trajectory of ``batch``."""


E = TypeVar("E", bound=type[Estimator])
ESTIMATORS: Registry[type[Estimator]] = Registry(
    "estimator", "turnstile.estimators", error=KeyError, expected="an Estimator class",
    accepts=lambda found: isinstance(found, type) and issubclass(found, Estimator))


def register(cls: E) -> E:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    ESTIMATORS.add(cls.name, cls)
    return cls


def estimator_class(name: str) -> type[Estimator]:
    """The estimator ``name`` (registered, or ``package.module:Class``); a KeyError listing the
    known names otherwise."""
    return ESTIMATORS.load(name)


def option_names(name: str) -> list[str]:
    """The option keys estimator ``name`` accepts, in declaration order."""
    return [option.name for option in fields(estimator_class(name).Options)]


def build_estimator(name: str, options: object | None = None) -> Estimator:
    """Estimator ``name`` with ``options`` (an instance of its ``Options``; ``None`` = defaults)."""
    cls = estimator_class(name)
    if options is None:
        options = cls.Options()
    if not isinstance(options, cls.Options):
        raise TypeError(f"estimator {name!r} takes {cls.Options.__name__}, got {type(options).__name__}")
    return cls(options)  # type: ignore[call-arg]  # each subclass's __init__ takes its Options


def estimator_from_options(name: str, options: Mapping[str, Any]) -> Estimator:
    """Estimator ``name`` with its options read from a config mapping (:func:`typed_options`: an
    unknown or ill-typed option is refused by name)."""
    return build_estimator(name, typed_options(estimator_class(name).Options, options, f"estimator {name!r}"))
