"""``turnstile serve-corpus``: serve the synthetic world or a JSONL corpus as web pages on loopback.

Useful to look at the pages an agent reads (open the printed URL in a browser) and to point a
visit tool of another process at them. Serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import threading

from turnstile.envs.corpus import read_corpus
from turnstile.envs.corpus_server import CorpusServer, CorpusServerConfig
from turnstile.envs.search.base import Document
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world

NAME = "serve-corpus"
HELP = "Serve the synthetic world (default) or a JSONL corpus as HTML pages over HTTP."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--world", choices=["synthetic"], default="synthetic",
                        help="generate and serve a synthetic world (default)")
    source.add_argument("--corpus", metavar="FILE.jsonl",
                        help='serve a JSONL corpus of {"id", "title", "text"[, "html"]} lines')
    parser.add_argument("--seed", type=int, default=0, help="synthetic world seed (default 0)")
    parser.add_argument("--entities", type=int, default=WorldConfig().entities,
                        help=f"synthetic world size (default {WorldConfig().entities})")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 = any free port)")


def documents_for(args: argparse.Namespace) -> list[Document]:
    if args.corpus:
        return read_corpus(args.corpus)
    return world_documents(generate_world(WorldConfig(seed=args.seed, entities=args.entities)))


def wait_until_interrupted() -> None:
    """Block the main thread until Ctrl-C (KeyboardInterrupt)."""
    threading.Event().wait()


def run(args: argparse.Namespace) -> int:
    try:
        documents = documents_for(args)
    except ValueError as error:
        print(f"turnstile serve-corpus: {error}")
        return 2
    server = CorpusServer(documents, CorpusServerConfig(host=args.host, port=args.port))
    try:
        url = server.start()
    except OSError as error:
        print(f"turnstile serve-corpus: {error}")
        return 1
    print(f"serving {len(documents)} pages at {url}/ (pages at {url}/wiki/<id>); Ctrl-C to stop",
          flush=True)
    try:
        wait_until_interrupted()
    except KeyboardInterrupt:
        print("stopped")
    finally:
        server.stop()
    return 0
