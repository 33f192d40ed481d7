"""The default policy model: a tiny Qwen3 with random weights and a tokenizer trained here.

Model weights cannot be downloaded on the machines this project runs its demo and tests on, so the
embedded default is built locally, in seconds, into a cache directory: a byte-level BPE tokenizer
trained on the synthetic world's pages and on turns of the agent protocol (so the protocol tags are
single tokens), a ChatML chat template, and a Qwen3 architecture small enough for a 2-core CPU.
Any Hugging Face model directory (or hub name on a real cluster) works in its place:
``engine.model=/path/to/Qwen3-8B``.

Build it explicitly with ``turnstile build-model``; :func:`ensure_default_model` builds it on first
use, under a file lock so concurrent workers don't race.

Models known by name (:func:`resolve_model`): ``tiny-qwen3``, the random-weight model above (also
what an empty ``model`` means); ``tiny-qwen3-sft``, the same model after SFT on the scripted expert;
``tiny-qwen3-mixed``, the warm start of the embedded default ``turnstile train`` —
``tiny-qwen3-sft`` after SFT on the trajectories of two agents, the expert and a hasty one that
answers without opening a page (:mod:`turnstile.cluster.recipes.warm_start`); the last two are committed under
``rollout/models/``: their recipes take longer than a first run may. And the pretrained models
packages ship (:mod:`turnstile.rollout.model_packages`: ``smollm2-135m-instruct``), converted into the cache
on first use like ``tiny-qwen3``.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from turnstile.envs.files import atomic_directory
from turnstile.rollout.model_packages import BUILD_INFO, PACKAGED_MODELS, build_packaged_model

if TYPE_CHECKING:
    from turnstile.envs.tools.base import JsonObject

PROTOCOL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                   "</tool_response>", "<answer>", "</answer>", "<report>", "</report>")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
RUN_MODEL = "model"  # the policy a train or sft run saved last, in its output directory
RANDOM_MODEL = "tiny-qwen3"  # the random-weight tiny model, built on first use
SFT_MODEL = "tiny-qwen3-sft"  # the tiny model after SFT on the scripted expert, committed
WARM_MODEL = "tiny-qwen3-mixed"  # the warm start of `turnstile train`: SFT_MODEL after SFT on two
# agents' data (the expert and a hasty one), committed (both made by cluster.recipes.warm_start)
COMMITTED_MODELS = (SFT_MODEL, WARM_MODEL)
ITER_MODEL = "tiny-qwen3-iter"  # WARM_MODEL after SFT on iter_research turns (they carry a <report>):
# the start of the mono vs iter_research ablation, built by `turnstile build-model`, not committed
MULTIHOP_MODEL = "tiny-qwen3-multihop"  # WARM_MODEL after SFT on two- and three-hop chains, some of
# them stopped early: the start of the multi-hop credit comparison (issue 36), built, not committed
RECIPE_MODELS = (*COMMITTED_MODELS, ITER_MODEL, MULTIHOP_MODEL)  # the models cluster.recipes.warm_start builds
COMMITTED = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the default model. Changing any field changes the cache directory name."""

    name: str = "tiny-qwen3"
    version: int = 3  # 2: names and numbers tokenized alike wherever they stand; 3: pages at
    # Wikipedia-style addresses (/wiki/Kratro_Labyrinth), the names' own tokens
    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 131072
    rope_theta: float = 1_000_000.0
    seed: int = 0
    tokenizer_world_seed: int = 0
    tokenizer_world_entities: int = 3000

    @property
    def dirname(self) -> str:
        return f"{self.name}-v{self.version}-h{self.hidden_size}-l{self.num_hidden_layers}-s{self.seed}"


def cache_root() -> Path:
    """Where built models live: $TURNSTILE_CACHE, else ~/.cache/turnstile."""
    return Path(os.environ.get("TURNSTILE_CACHE", Path.home() / ".cache" / "turnstile"))


def default_model_path(spec: TinyModelSpec | None = None) -> Path:
    return cache_root() / "models" / (spec or TinyModelSpec()).dirname


def ensure_default_model(spec: TinyModelSpec | None = None) -> Path:
    """The default model's directory, built first if it is missing (safe across processes)."""
    spec = spec or TinyModelSpec()
    return _ensure_built(default_model_path(spec), lambda target: build_tiny_model(target, spec))


def packaged_model_path(name: str) -> Path:
    """Where a packaged model is converted to in the cache."""
    spec = PACKAGED_MODELS[name]
    return cache_root() / "models" / f"{spec.name}-{spec.package}-{spec.version}"


def ensure_packaged_model(name: str) -> Path:
    """A packaged model's directory in the cache, converted first if it is missing (raises
    :class:`turnstile.rollout.model_packages.PackageMissing` when its package is not installed)."""
    return _ensure_built(packaged_model_path(name), lambda target: build_packaged_model(target, name))


def _ensure_built(target: Path, build: Callable[[Path], Path]) -> Path:
    if (target / BUILD_INFO).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / BUILD_INFO).is_file():
            build(target)
    return target


def resolve_model(model: str) -> str:
    """A config's ``model`` value as a path or hub name: "" and ``tiny-qwen3`` mean the random tiny
    model (built on first use), ``tiny-qwen3-sft`` and ``tiny-qwen3-mixed`` (the warm start) the
    committed models, ``smollm2-135m-instruct`` the packaged model (converted on first use); the
    output directory of a ``turnstile train`` or ``turnstile sft`` run means the policy it saved
    last (its ``model/``, written with each checkpoint); anything else is a model directory or hub
    name, returned as given."""
    if model in ("", RANDOM_MODEL):
        return str(ensure_default_model())
    if model in COMMITTED_MODELS:
        return str(committed_model_path(model))
    if model in PACKAGED_MODELS:
        return str(ensure_packaged_model(model))
    run = Path(model)
    if not (run / "config.json").is_file() and (run / RUN_MODEL / "config.json").is_file():
        return str(run / RUN_MODEL)
    return model


def committed_model_path(name: str = WARM_MODEL) -> Path:
    """A committed model's directory (a complete Hugging Face model directory)."""
    path = COMMITTED / name
    if not (path / BUILD_INFO).is_file():
        raise FileNotFoundError(f"{path} holds no {BUILD_INFO}: the model {name} is missing from this "
                                f"checkout; rebuild it with `turnstile build-model {name} --out {path}`")
    return path


def build_tiny_model(target: Path, spec: TinyModelSpec | None = None, force: bool = False) -> Path:
    """Train the tokenizer, initialise the model, and save both to ``target`` (atomically)."""
    spec = spec or TinyModelSpec()
    with atomic_directory(target, force=force) as staging:
        tokenizer = train_tokenizer(spec)
        tokenizer.save_pretrained(staging)
        model = _init_model(spec, tokenizer)
        model.save_pretrained(staging, safe_serialization=True)
        (staging / BUILD_INFO).write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return target


def train_tokenizer(spec: TinyModelSpec):  # noqa: ANN201 - transformers' PreTrainedTokenizerFast
    """Byte-level BPE over the synthetic world's text and protocol turns, with a ChatML template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    # The space before a capital or a digit is a token of its own, so a name or a number is the same
    # tokens wherever it stands (after a space, a quote, a bracket or a newline): the policy copies
    # names and values from the question and the pages into its queries and answers, and a small
    # model copies by matching tokens.
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" (?=[A-Z0-9])"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(PROTOCOL_TOKENS), min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(_training_text(spec), trainer=trainer)
    # Protocol tags are single tokens, decoded as written (not special: they are part of the text).
    core.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in PROTOCOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, bos_token=None, model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _training_text(spec: TinyModelSpec) -> Iterator[str]:
    from turnstile.envs.protocol import render_answer, render_tool_call, render_tool_response, system_prompt
    from turnstile.envs.synthetic.render import world_documents
    from turnstile.envs.synthetic.world import WorldConfig, generate_world

    world = generate_world(WorldConfig(seed=spec.tokenizer_world_seed,
                                       entities=spec.tokenizer_world_entities))
    schemas: list[JsonObject] = [{"type": "function", "function": {"name": name, "description": f"the {name} tool"}}
                                 for name in ("search", "visit")]
    yield system_prompt(schemas)
    for doc in world_documents(world, base_url="http://127.0.0.1:8765"):
        yield doc.text
        yield render_tool_call("search", {"query": [doc.title]}, f"I need to find {doc.title}.")
        yield render_tool_call("visit", {"url": doc.url, "goal": f"facts about {doc.title}"},
                               f"The page of {doc.title} should say.")
        yield render_tool_response(f"Content of {doc.url}:\n{doc.text[:400]}")
        yield render_answer(doc.title, "I have enough information to answer.", report=doc.title)


def _init_model(spec: TinyModelSpec, tokenizer):  # noqa: ANN001, ANN202 - transformers types
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, tie_word_embeddings=True, eos_token_id=end_of_turn,
        pad_token_id=pad, bos_token_id=None, torch_dtype="float32",
    )  # type: ignore[call-arg]  # rope_theta and torch_dtype: transformers still reads the old names
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but vocab_size is {spec.vocab_size}")
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' wrapped to()
    model.generation_config = GenerationConfig(eos_token_id=[end_of_turn, pad], pad_token_id=pad)
    return model


# ---- a training run's kept weights versions (written by learner.publish.WeightsArchive) ----------

def kept_versions(root: str | Path) -> dict[int, Path]:
    """The versions under an archive directory, by number."""
    found: dict[int, Path] = {}
    for entry in Path(root).glob("v*"):
        if entry.name[1:].isdigit() and (entry / "config.json").is_file():
            found[int(entry.name[1:])] = entry
    return found


def closest_version(root: str | Path, wanted: int) -> tuple[int, Path]:
    """The kept version nearest ``wanted`` (ties: the newer); raises when the archive is empty."""
    kept = kept_versions(root)
    if not kept:
        raise FileNotFoundError(f"the weights archive {root} holds no version: is it the training "
                                "run's out/weights directory?")
    version = min(kept, key=lambda v: (abs(v - wanted), -v))
    return version, kept[version]
