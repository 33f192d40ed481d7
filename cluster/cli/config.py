"""Experiment configuration: one YAML per experiment merged into typed dataclasses.

OmegaConf's structured configs do the type checks; this module adds what a user needs around them:
``key=value`` overrides from the command line, and errors that name the offending key path and say
what to do (an unknown key is always an error: a typo must not silently fall back to a default).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from turnstile.rollout.store.base import without_password

T = TypeVar("T")
_NAMES_A_FIELD = re.compile(r"[A-Za-z_]\w*=")


class ConfigError(ValueError):
    """A configuration problem, worded for the person who wrote the config."""


def load_config(schema: type[T], path: str | Path | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Build ``schema`` from its defaults, then the YAML at ``path``, then ``key=value`` overrides.

    A plugin's ``options`` belong to its kind: where the file and overrides choose another ``kind``
    than the schema's default, that section starts from no options instead
    of the default kind's (``data.kind=arithmetic`` does not inherit the synthetic ``min_hops``);
    options the file or overrides give are kept."""
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
            override = OmegaConf.from_dotlist([item])
        except Exception as error:  # noqa: BLE001 - OmegaConf and yaml raise several types
            reason = str(error).strip().splitlines()[0]
            raise ConfigError(f"override {item!r} cannot be read ({reason}); write key=value, and "
                              f"quote the whole override when the value holds spaces") from None
        _refuse_glued_colons(override, item)
        layers.append((f"override {item!r}", override))
    for at in range(1, len(layers)):  # a layer that cannot merge with those before it, named
        try:
            OmegaConf.merge(*(layer for _, layer in layers[:at + 1]))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{layers[at][0]} does not fit the config before it ({error}); a list "
                              "is set whole (key=[...]), not item by item") from None
    for source, layer in layers:
        _refuse_renamed(layer, source)
    if layers:
        _options_follow_kind(base, OmegaConf.merge(*(layer for _, layer in layers)))
    merged = base
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except TypeError as error:
            raise ConfigError(f"{source} does not fit the config ({error}); a list is set whole "
                              "(key=[...]), not item by item") from None
        except (ConfigKeyError, ConfigAttributeError) as error:
            key = _full_key(error)
            raise ConfigError(f"{source}: unknown key '{key}'. Check the spelling; the known keys "
                              f"are the fields of {schema.__name__}.") from None
        except ValidationError as error:
            key = _full_key(error)
            reason = str(error.msg).strip().splitlines()[0]
            raise ConfigError(f"{source}: bad value for '{key}': {reason}") from None
    return _to_object(merged)


# Keys that were renamed (issue 38: one word for each concept), with what to write instead.
RENAMED = {"estimator.name": ("estimator.kind", "estimator: {kind: grpo}")}


def _refuse_renamed(layer: object, source: str) -> None:
    for old, (new, example) in RENAMED.items():
        if isinstance(layer, DictConfig) and OmegaConf.select(layer, old, default=None) is not None:
            raise ConfigError(f"{source}: '{old}' is now '{new}' (a plugin is chosen by its kind "
                              f"everywhere); write {example}")


def _options_follow_kind(merged: DictConfig, layer: object) -> None:
    """Clear ``merged``'s options wherever ``layer`` names another kind than it (see :func:`load_config`)."""
    if not isinstance(layer, DictConfig) or not isinstance(merged, DictConfig):
        return
    if "kind" in layer and "options" in merged and "kind" in merged and layer.kind != merged.kind:
        merged.options = {}
    for key in layer:
        if key in merged and isinstance(merged._get_node(key), DictConfig):  # noqa: SLF001
            _options_follow_kind(merged[key], layer._get_node(key))  # noqa: SLF001


def _refuse_glued_colons(node: object, item: str) -> None:
    """``key={a:b}`` is YAML for the key "a:b" with no value (YAML wants a space after ':');
    say so instead of letting it fail later as an odd key or a missing value."""
    if isinstance(node, DictConfig):
        for key in node:
            # The raw value, no interpolation; the node is there, its key was just listed.
            value = node._get_node(key)._value()  # type: ignore[union-attr]  # noqa: SLF001
            if isinstance(key, str) and ":" in key and value is None:
                name, _, rest = key.partition(":")
                raise ConfigError(f"override {item!r}: '{{{key}}}' is read as the key {key!r} with no "
                                  f"value, because YAML needs a space after ':'; write "
                                  f"'{{{name}: {rest}}}' (quote the whole override)")
            _refuse_glued_colons(node[key], item)
    elif isinstance(node, ListConfig):
        for child in node:
            _refuse_glued_colons(child, item)


def _to_object(merged: DictConfig) -> T:  # type: ignore[type-var]
    """Instantiate the dataclasses; a value their ``__post_init__`` refuses becomes a ConfigError
    that names the section it sits in (found by instantiating the sections one by one)."""
    try:
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except MissingMandatoryValue as error:
        raise ConfigError(f"'{_full_key(error)}' has no value; set it in the YAML or as "
                          f"{_full_key(error)}=...") from None
    except (ValueError, TypeError) as error:
        section, message = _failing_section(merged, ""), str(error)
        if section:  # "max_turns=0 must be >= 1" in rollout.episode.env reads rollout.episode.env.max_turns=0
            message = f"{section}.{message}" if _NAMES_A_FIELD.match(message) else f"{section}: {message}"
        raise ConfigError(message) from None


def _failing_section(node: DictConfig | ListConfig, path: str) -> str:
    """The deepest dataclass section under ``node`` whose own values are refused."""
    items = enumerate(node) if isinstance(node, ListConfig) else ((key, node[key]) for key in node)
    for key, child in items:
        if not isinstance(child, (DictConfig, ListConfig)):
            continue
        where = f"{path}[{key!s}]" if isinstance(node, ListConfig) else f"{path}.{key!s}" if path else str(key)
        try:
            OmegaConf.to_object(child)
        except (ValueError, TypeError):
            return _failing_section(child, where)
    return path


def dump_config(config: object) -> str:
    """The config as YAML, for logs and checkpoints. A password in any URL is masked
    (``redis://:***@host``): a written config holds no secret (``resume`` reads the user's YAML
    again, never this copy)."""
    return OmegaConf.to_yaml(_masked(OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)))


def _masked(node: object) -> object:
    if isinstance(node, dict):
        return {key: _masked(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_masked(value) for value in node]
    return without_password(node) if isinstance(node, str) else node


def _full_key(error: OmegaConfBaseException) -> str:
    return str(getattr(error, "full_key", None) or getattr(error, "key", None) or "?")
