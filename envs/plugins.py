"""Plugins: how turnstile finds the code a config names, and how it reads that code's options.

Every extension point (engines, reward plugins, datasets, estimators, context managers) is a
:class:`Registry`. A config names a plugin in one of three ways, tried in this order:

- ``package.module:Name``: imported from the user's own module, nothing to register;
- a name registered in this process (``@registry.register("name")``, what the built-in plugins do);
- a name an installed package declares under the registry's entry-point group
  (``[project.entry-points."turnstile.rewards"]`` in its ``pyproject.toml``).

A plugin's options are a dataclass; :func:`typed_options` merges the configured values over its
defaults and refuses an unknown key or an ill-typed value, naming it and listing the known ones.
Lookups import nothing until a name is asked for, so naming a registry costs no start-up time.

This module sits in ``envs`` because ``envs`` is the lowest layer: every package may import it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")
ConfigT = TypeVar("ConfigT")


@dataclass
class PluginSpec:
    """One configured plugin, as a config section names it: ``kind`` (a registered name or
    ``package.module:Class``) and its options (JSON values, checked by the plugin's ``Options``).
    A job's ``rewards`` list holds these; so does its ``estimator`` section."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)


class PluginError(ValueError):
    """A plugin cannot be found, loaded or configured; the message names it and what to do."""


class Registry(Generic[T]):
    """The plugins of one extension point.

    ``what`` names the extension point in messages ("reward kind", "estimator"), ``group`` is its
    entry-point group, ``accepts`` says whether a loaded object is a plugin of this kind (``expected``
    describes one, for the message), and ``error`` is the exception type raised (a subclass of
    ``ValueError`` or ``KeyError`` the extension point already documents).
    """

    def __init__(self, what: str, group: str, *, accepts: Callable[[object], bool] = callable,
                 expected: str = "a callable", error: type[Exception] = PluginError) -> None:
        self.what, self.group, self.expected = what, group, expected
        self._accepts, self._error = accepts, error
        self._registered: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the decorated object this registry's plugin ``name``."""

        def decorate(plugin: T) -> T:
            self.add(name, plugin)
            return plugin

        return decorate

    def add(self, name: str, plugin: T) -> None:
        known = self._registered.get(name)
        if known is not None and known is not plugin:
            raise self._error(f"{self.what} {name!r} is already registered by {_where(known)}; "
                              "choose another name")
        self._registered[name] = plugin

    def names(self) -> list[str]:
        """Every name known here: registered in this process and declared by installed packages."""
        return sorted(set(self._registered) | {entry.name for entry in entry_points(group=self.group)})

    def load(self, name: str) -> T:
        """The plugin ``name`` (``package.module:Name``, registered, or an entry point)."""
        if ":" in name:
            module_name, _, attribute = name.partition(":")
            try:
                found = getattr(importlib.import_module(module_name), attribute)
            except (ImportError, AttributeError) as error:
                raise self._error(f"{self.what} {name!r}: cannot load {attribute!r} from {module_name!r} "
                                  f"({error})") from None
            return self._checked(name, found)
        if name in self._registered:
            return self._registered[name]
        for entry in entry_points(group=self.group):
            if entry.name == name:
                plugin = self._checked(name, entry.load())
                self._registered.setdefault(name, plugin)
                return plugin
        raise self._error(f"unknown {self.what} {name!r}; known: {', '.join(self.names())}. Or name one "
                          "as 'package.module:Name' (a plugin an installed package just declared needs "
                          "pip install -e .)")

    def _checked(self, name: str, found: object) -> T:
        if not self._accepts(found):
            raise self._error(f"{self.what} {name!r} names {found!r}, which is not {self.expected}")
        return found  # type: ignore[return-value]


def _where(plugin: object) -> str:
    return f"{getattr(plugin, '__module__', '?')}.{getattr(plugin, '__qualname__', repr(plugin))}"


def typed_options(config_type: type[ConfigT], options: Mapping[str, Any], where: str, *,
                  error: type[Exception] = PluginError) -> ConfigT:
    """``options`` merged over the defaults of the dataclass ``config_type``. An unknown key, an
    ill-typed value or one the dataclass's ``__post_init__`` refuses raises ``error`` naming it
    (``where`` says whose options, e.g. "reward 'format'")."""
    if not dataclasses.is_dataclass(config_type):
        raise error(f"{where}: the options type {config_type!r} must be a dataclass")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(config_type), OmegaConf.create(dict(options)))
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except (ConfigKeyError, ConfigAttributeError) as failure:
        key = getattr(failure, "full_key", None) or getattr(failure, "key", None) or "?"
        known = ", ".join(f.name for f in dataclasses.fields(config_type)) or "none"
        raise error(f"{where}: unknown option '{key}'; the options are: {known}") from None
    except OmegaConfBaseException as failure:
        key = getattr(failure, "full_key", None) or "?"
        reason = str(getattr(failure, "msg", failure)).splitlines()[0]
        raise error(f"{where}: bad value for option '{key}': {reason}") from None
    except (ValueError, TypeError) as failure:  # the dataclass's own checks (__post_init__)
        raise error(f"{where}: {failure}") from None
