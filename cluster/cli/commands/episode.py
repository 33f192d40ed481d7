"""``turnstile episode``: run one episode on the embedded default and show every turn.

The smoke test of the environment side: the synthetic world served over loopback HTTP (in process,
or a running ``turnstile serve-corpus``), the real tools (local index, HTTP fetch, trafilatura,
Chromium for JavaScript pages), :class:`~turnstile.envs.env.SearchBrowseEnv`, and the scripted expert as the
policy. Usage::

    turnstile episode                                  # question 0 of the default world
    turnstile episode question=17 env.max_turns=30     # key=value overrides
    turnstile episode --corpus-url http://127.0.0.1:8765   # against a running serve-corpus
"""

from __future__ import annotations

import argparse

NAME = "episode"
HELP = "Run one episode of the scripted expert in the synthetic world and print each turn."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="experiment YAML (default: built-in)")
    parser.add_argument("--corpus-url", metavar="URL",
                        help="use a running `turnstile serve-corpus` instead of serving in process")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. question=3 env.max_turns=50")


def run(args: argparse.Namespace) -> int:
    # imported here: the command line (and --help) starts without them
    import asyncio

    from turnstile.cluster.cli.config import ConfigError, load_config
    from turnstile.cluster.tools.episode import EpisodeJob, EpisodeSetupError, show_episode

    overrides = list(args.overrides) + ([f"corpus_url={args.corpus_url}"] if args.corpus_url else [])
    try:
        job = load_config(EpisodeJob, args.config, overrides)
    except ConfigError as error:
        print(f"turnstile episode: {error}")
        return 2
    try:
        return asyncio.run(show_episode(job))
    except EpisodeSetupError as error:
        print(f"turnstile episode: {error}")
        return 1
