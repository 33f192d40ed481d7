"""veRL on CPU: a platform plugin registered through veRL's own hooks, loaded only where no GPU is.

veRL 0.9.1 has no CPU platform: without a GPU it falls back to "nvidia" and calls CUDA. This module
registers a ``cpu`` platform with :class:`verl.plugin.platform.PlatformRegistry`. veRL imports it when
the process environment names it (see :func:`worker_env`):

- ``VERL_USE_EXTERNAL_MODULES=learner.verl_cpu``: ``import verl`` imports this module, which registers
  the platform;
- ``VERL_PLATFORM=cpu``: veRL's platform detection picks it;
- ``VERL_ENGINE_DEVICE=cuda``: the engine registry has no CPU entry, so the FSDP engine is looked up
  under the device key it is registered with; the tensors still live on ``cpu``.

Two gaps are covered here rather than in veRL: ``torch.cpu`` lacks the memory statistics the worker
reports (``max_memory_allocated`` and friends; here they report 0), and veRL's default process-group
backend string ``cpu:gloo,<device>:<backend>`` becomes ``cpu:gloo,cpu:gloo``, which torch rejects, so
process groups are created with plain ``gloo``. The engine settings that work on CPU are in
:data:`CPU_ENGINE_SETTINGS` (FSDP2, fp32, no remove-padding, sdpa attention); FSDP1 does not run on CPU.
One cost is cut here too: veRL's per-row log-prob loop (see :func:`_whole_tensor_log_probs`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM = "cpu"
MODULE = __name__

# What a training worker needs on CPU; the GPU path uses veRL's defaults instead.
CPU_ENGINE_SETTINGS: dict[str, Any] = {
    "strategy": "fsdp2",
    "param_offload": False,
    "optimizer_offload": False,
    "model_dtype": "fp32",
    "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    # Keep the gathered parameters between forward and backward (the model is small; on gloo
    # each gather of each micro-batch is a round of collectives).
    "reshard_after_forward": False,
}


def platform_env() -> dict[str, str]:
    """Environment variables that make a process load veRL with this platform."""
    return {"VERL_USE_EXTERNAL_MODULES": MODULE, "VERL_PLATFORM": PLATFORM, "VERL_ENGINE_DEVICE": "cuda",
            "VERL_USE_EXTERNAL_PLUGINS": "none"}


def worker_env(threads: int) -> dict[str, str]:
    """A (Ray worker) process's environment: this platform and ``threads`` torch threads (Ray
    would set the CPUs the worker reserved)."""
    return {**platform_env(), "OMP_NUM_THREADS": str(threads)}


def wanted() -> bool:
    """Whether this process should run veRL on CPU: no CUDA device is visible."""
    return not torch.cuda.is_available()


class _CpuDevice(ModuleType):
    """``torch.cpu`` plus the CUDA-style calls veRL makes on its device module."""

    def __init__(self) -> None:
        super().__init__("turnstile_cpu_device")

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - forwards to torch.cpu
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(_device: object) -> None:
        return None

    @staticmethod
    def synchronize(_device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(_device: object = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, _device: object = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def memory_allocated(_device: object = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def get_device_name(_device: object = None) -> str:
        return "CPU"

    @staticmethod
    def reset_peak_memory_stats(_device: object = None) -> None:
        return None

    @staticmethod
    def mem_get_info(_device: object = None) -> tuple[int, int]:
        import psutil

        memory = psutil.virtual_memory()
        return memory.available, memory.total


DEVICE = _CpuDevice()


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """veRL's platform interface on CPU: gloo for collectives, no profiler, no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return wanted()

    def current_device(self) -> str:  # type: ignore[override]
        # veRL passes this straight to ``.to(...)`` and ``torch.device(...)``; an index would mean an
        # accelerator there.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "TURNSTILE_VISIBLE_CPUS"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": max(1, int(num_gpus))}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:  # noqa: ANN401 - the interface's type
        return None


def _gloo_process_groups() -> None:
    """Make veRL's process-group set-up use plain ``gloo`` when the device is the CPU."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "turnstile_cpu", False):
        return

    def initialize(timeout_second: int | None = None, backend: str | None = None) -> None:
        if backend is None or backend.startswith("cpu:gloo,cpu:"):
            backend = "gloo"
        original(timeout_second=timeout_second, backend=backend)

    initialize.turnstile_cpu = True  # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize


def _whole_tensor_log_probs() -> None:
    """Token log-probs from one ``log_softmax`` over the logits, not veRL's row loop.

    Without flash-attention's cross-entropy kernel, veRL 0.9.1 falls back to
    ``logprobs_from_logits_v2``, which for fp32 takes the ``logsumexp`` of one token's row at a time
    in a Python loop (to bound peak memory on big vocabularies): ~1,750 small kernels, and as many
    backward nodes, per sample. On CPU, with the model's small vocabulary, ``log_softmax`` and a
    gather over the whole tensor is the same arithmetic in one kernel
    (``tests/test_learner.py::test_cpu_log_probs_match_verl_row_loop``).
    """
    from verl.utils import torch_functional

    if getattr(torch_functional.logprobs_from_logits_v2, "turnstile_cpu", False):
        return
    row_loop = torch_functional.logprobs_from_logits_v2

    def whole_tensor(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dtype not in (torch.float32, torch.float64):
            return row_loop(logits, labels)  # type: ignore[arg-type]  # veRL says FloatTensor: any float dtype
        return torch_functional.logprobs_from_logits_naive(logits, labels)

    whole_tensor.turnstile_cpu = True  # type: ignore[attr-defined]
    torch_functional.logprobs_from_logits_v2 = whole_tensor


def activate() -> None:
    """Run veRL on CPU in this process (the driver; workers get :func:`worker_env` instead).

    Safe to call more than once. Must run before veRL resolves its platform, i.e. before the first
    worker group or engine is built in this process.
    """
    from verl.plugin.platform import get_platform, platform_manager, set_platform

    os.environ.update(platform_env())
    current = platform_manager._current_platform  # noqa: SLF001 - get_platform() would resolve one
    if current is None:
        get_platform()
    elif not isinstance(current, PlatformCPU):
        set_platform(PlatformCPU())
    _gloo_process_groups()
    _whole_tensor_log_probs()


# A worker process started with worker_env() imports this module through VERL_USE_EXTERNAL_MODULES.
if os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM:
    _gloo_process_groups()
    _whole_tensor_log_probs()
