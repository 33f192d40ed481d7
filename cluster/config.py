"""Experiment configuration: one YAML per experiment merged into typed dataclasses.

OmegaConf's structured configs do the type checks; this module adds what a user needs around them:
``key=value`` overrides from the command line, and errors that name the offending key path and say
what to do (an unknown key is always an error: a typo must not silently fall back to a default).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, worded for the person who wrote the config."""


def load_config(schema: type[T], path: str | Path | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Build ``schema`` from its defaults, then the YAML at ``path``, then ``key=value`` overrides."""
    base = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {file} does not exist")
        try:
            layers.append((str(file), OmegaConf.load(file)))
        except Exception as error:  # yaml errors come in several types
            raise ConfigError(f"{file}: not valid YAML ({error})") from error
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (example: env.max_turns=50)")
        try:
            layers.append((f"override {item!r}", OmegaConf.from_dotlist([item])))
        except OmegaConfBaseException as error:
            raise ConfigError(f"override {item!r}: {error}") from error
    merged = base
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except (ConfigKeyError, ConfigAttributeError) as error:
            key = _full_key(error)
            raise ConfigError(f"{source}: unknown key '{key}'. Check the spelling; the known keys "
                              f"are the fields of {schema.__name__}.") from None
        except ValidationError as error:
            key = _full_key(error)
            raise ConfigError(f"{source}: bad value for '{key}': {error.msg}") from None
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def dump_config(config: object) -> str:
    """The config as YAML, for logs and checkpoints."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _full_key(error: OmegaConfBaseException) -> str:
    return str(getattr(error, "full_key", None) or getattr(error, "key", None) or "?")
