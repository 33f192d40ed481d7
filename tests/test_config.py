"""Configuration: YAML + key=value overrides into dataclasses; unknown keys name their path."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from turnstile.cluster.cli.config import ConfigError, dump_config, load_config
from turnstile.envs.env import EnvConfig
from turnstile.envs.tools.toolbox import ToolboxConfig


@dataclass
class Experiment:
    name: str = "demo"
    env: EnvConfig = field(default_factory=EnvConfig)
    toolbox: ToolboxConfig = field(default_factory=ToolboxConfig)


def test_defaults_yaml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("name: x\nenv:\n  max_turns: 50\ntoolbox:\n  cache:\n    backend: redis\n")
    config = load_config(Experiment, path, ["env.max_turns=7", "toolbox.timeout_s=2.5"])
    assert isinstance(config, Experiment) and isinstance(config.env, EnvConfig)
    assert (config.name, config.env.max_turns, config.toolbox.timeout_s) == ("x", 7, 2.5)
    assert config.toolbox.cache.backend == "redis"
    assert "max_turns: 7" in dump_config(config)


def test_unknown_key_in_yaml_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("env:\n  max_turn: 50\n")
    with pytest.raises(ConfigError, match=r"unknown key 'env\.max_turn'"):
        load_config(Experiment, path)


def test_unknown_override_and_bad_value() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'toolbox\.cache\.ttl'"):
        load_config(Experiment, None, ["toolbox.cache.ttl=3"])
    with pytest.raises(ConfigError, match=r"bad value for 'env\.max_turns'"):
        load_config(Experiment, None, ["env.max_turns=many"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(Experiment, None, ["env.max_turns"])


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Experiment, tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("env: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Experiment, broken)


def test_options_follow_the_kind_they_were_given_for(tmp_path: Path) -> None:
    # The embedded default's data options are the synthetic loader's; another kind starts afresh,
    # whether the file or an override changes it, and the same kind keeps and merges them.
    from turnstile.cluster.jobs.run import TrainJob

    default = load_config(TrainJob)
    assert default.rollout.data.options["min_hops"] == 1
    changed = load_config(TrainJob, None, ["rollout.data.kind=arithmetic", "eval_data.kind=arithmetic"])
    assert changed.rollout.data.options == {} and changed.eval_data.options == {}
    file = tmp_path / "job.yaml"
    file.write_text("rollout:\n  data: {kind: arithmetic, path: '', options: {operands: 2}}\n")
    assert load_config(TrainJob, file).rollout.data.options == {"operands": 2}
    same = load_config(TrainJob, None, ["rollout.data.kind=synthetic", "rollout.data.options.count=10"])
    assert same.rollout.data.options["min_hops"] == 1 and same.rollout.data.options["count"] == 10
    estimator = load_config(TrainJob, None, ["estimator.options.eps=0.1", "estimator.kind=igpo"])
    assert estimator.estimator.options == {"eps": 0.1}  # the user's own options stay, in any order


def test_a_renamed_key_says_what_it_is_now(tmp_path: Path) -> None:
    from turnstile.cluster.jobs.run import TrainJob

    with pytest.raises(ConfigError, match=r"override 'estimator.name=igpo': 'estimator.name' is now "
                                          r"'estimator.kind'.*estimator: \{kind: grpo\}"):
        load_config(TrainJob, None, ["estimator.name=igpo"])
    file = tmp_path / "old.yaml"
    file.write_text("estimator:\n  name: igpo\n  options: {gamma: 0.9}\n")
    with pytest.raises(ConfigError, match=rf"{file}: 'estimator.name' is now 'estimator.kind'"):
        load_config(TrainJob, file)
    assert load_config(TrainJob, None, ["estimator.kind=igpo"]).estimator.kind == "igpo"
