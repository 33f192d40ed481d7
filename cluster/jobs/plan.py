"""A training run planned before it starts: where each role goes, the GPU and host memory it needs,
whether it all fits, and what a step costs. Arithmetic on the config and the models' config.json;
it starts nothing.

``turnstile plan`` prints it (:func:`render`); ``turnstile train`` runs the same check before its
first actor (:func:`check_fit`): on a Ray it started itself a misfit is refused, on a joined cluster
(which may grow) it is a warning. Either way the message names a setting and a value that fits.

The cluster is a list of nodes (:class:`Node`): GPUs with their memory, CPUs and host memory. It
comes from a spec (:func:`parse_cluster`, e.g. ``2x8xh100``), from the Ray cluster this process is
connected to, or from this machine.

Memory per role (docs/benchmarks/plan.md compares the figures with measured peaks):

- an engine replica: on GPUs vLLM takes ``gpu_memory_utilization`` of each of its GPUs, which must
  hold the weights, :data:`ENGINE_GPU_OVERHEAD` (activations, CUDA graphs) and the KV cache of at
  least one sequence of ``max_model_len``; the rest of the share is KV cache, and the plan says how
  many of the replica's concurrent episodes it holds at full context. On CPU the weights and the KV
  cache (:func:`~turnstile.rollout.engines.shape.kv_cache_bytes`) are host memory;
- a policy rank and a reference rank: :mod:`turnstile.learner.memory`. veRL places each worker
  group in one placement group (STRICT_PACK): all of a group's ranks on one node;
- reward workers: the process, and the scoring model where information gain is scored after the
  fact (``scorer: kv_cache`` or ``per_prefix``) rather than on the engines;
- rollout workers: the process, and a headless Chromium where pages are rendered;
- the driver (with the corpus server) and the store.

The per-step estimate (:func:`step_work`) counts the tokens each role handles in a step from the
run's sizes and an assumed episode shape (:class:`Assumptions`: turns, and tokens generated and
observed per turn), turns them into FLOPs (2 x parameters a token forward, 3 times that for forward
and backward, once more for recomputed activations) and bytes read (a decode step reads the
weights and the batch's KV cache once), and divides by declared device rates and utilisations.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from turnstile.cluster.jobs.run import TrainJob, placed_rewards
from turnstile.learner.memory import policy_memory, reference_memory, tokens_per_rank
from turnstile.learner.trainer import LearnerConfig
from turnstile.rollout.engines.shape import DTYPE_BYTES, ModelShape, kv_cache_bytes, model_shape

GB = 1e9

# Host memory of each process at rest, before its model: measured on this machine kind (the soak of
# docs/benchmarks/memory.md, per process; docs/benchmarks/plan.md).
DRIVER_HOST = 1.05 * GB  # the driver with the corpus server and the console
ENGINE_HOST_CPU = 1.6 * GB  # a vLLM-CPU replica: its actor and the engine core, before weights and KV
ENGINE_HOST_GPU = 4.0 * GB  # a vLLM replica on GPUs: CUDA libraries, the tokenizer, pinned buffers (assumed)
HF_ENGINE_HOST = 0.9 * GB  # an hf engine's actor before weights
SCRIPTED_ENGINE_HOST = 0.3 * GB
WORKER_HOST = 0.58 * GB  # a rollout worker: the episode loop, tools, the tool cache
CHROMIUM_HOST = 0.35 * GB  # a worker's headless Chromium with one page open (assumed)
REWARD_HOST = 0.65 * GB  # a reward worker before any scoring model
STORE_HOST = 0.15 * GB  # the memory store's actor (Redis runs outside the run)
RAY_HOST = 0.7 * GB  # Ray's own processes on a node (raylet, GCS on the head, agents)
ENGINE_GPU_OVERHEAD = 2.0 * GB  # vLLM's activations and CUDA graphs beside weights and KV (assumed)
# A learner rank on a GPU, in host memory: CUDA libraries and the process (assumed), and the model
# loaded in fp32 before FSDP shards it (4 bytes a parameter, added where it is used).
RANK_HOST_GPU = 3.0 * GB


@dataclass(frozen=True)
class GpuKind:
    name: str
    memory: float  # bytes
    tflops: float  # dense bf16, per GPU
    bandwidth: float  # memory bytes/s


GPUS = {"h100": GpuKind("H100 80GB", 80 * GB, 989.0, 3.35e12),
        "h200": GpuKind("H200 141GB", 141 * GB, 989.0, 4.8e12)}
# A preset node: 8 GPUs, 24 CPUs and 256 GB of host memory per GPU (a p5-class machine).
PRESET_GPUS, CPUS_PER_GPU, HOST_PER_GPU = 8, 24, 256 * GB
CPU_GFLOPS = 50.0  # what one core gives the learner and the engine in fp32 (assumed; this machine kind)
CPU_BANDWIDTH = 10e9  # bytes/s of host memory one engine reads (assumed)


@dataclass(frozen=True)
class Node:
    gpus: int
    gpu: GpuKind | None
    cpus: float
    host: float  # bytes

    def describe(self) -> str:
        gpus = f"{self.gpus} x {self.gpu.name}, " if self.gpus and self.gpu else ""
        return f"{gpus}{self.cpus:g} CPUs, {self.host / GB:.3g} GB"


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    source: str  # where the figures came from

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for node in self.nodes:
            kinds[node.describe()] = kinds.get(node.describe(), 0) + 1
        return "; ".join(f"{count} x ({kind})" for kind, count in kinds.items()) + f" [{self.source}]"


class PlanError(ValueError):
    """A plan that cannot be made (a bad spec, a model without config.json) or a run that does not fit."""


SPEC = re.compile(r"^(?:(\d+)x)?(?:(\d+)x)?([a-z0-9.]+)((?:,[a-z]+=[0-9.]+)*)$")


def parse_cluster(spec: str) -> Cluster:
    """``[NODES x][GPUS x]KIND[,cpus=C][,mem=GB]``: KIND is a preset (h100, h200), ``NNgb`` for GPUs
    of NN GB (H100 rates), or ``cpu`` for nodes without GPUs (then the one number is the node
    count and cpus/mem are required). GPUS defaults to 8; a preset node has 24 CPUs and 256 GB of
    host memory per GPU. ``2x8xh100``, ``1x1xh200``, ``h100``, ``4x8x80gb,cpus=96,mem=1024``,
    ``1xcpu,cpus=2,mem=24``."""
    text = spec.strip().lower().replace(" ", "").replace("×", "x")
    match = SPEC.match(text)
    usage = "use [NODES x][GPUS x]KIND[,cpus=C][,mem=GB], KIND h100, h200, NNgb or cpu (e.g. 2x8xh100)"
    if not match:
        raise PlanError(f"--cluster {spec!r}: cannot read it; {usage}")
    first, second, kind, extra = match.groups()
    nodes, gpus = (int(first), int(second)) if second else (int(first or 1), None)
    options = dict(item.split("=") for item in extra.split(",")[1:])
    unknown = set(options) - {"cpus", "mem"}
    if unknown:
        raise PlanError(f"--cluster {spec!r}: unknown {', '.join(sorted(unknown))}; {usage}")
    if kind == "cpu":
        if gpus is not None or not {"cpus", "mem"} <= set(options):
            raise PlanError(f"--cluster {spec!r}: a CPU node takes NODESxcpu,cpus=C,mem=GB")
        gpu, gpus = None, 0
    elif kind in GPUS:
        gpu = GPUS[kind]
    elif (size := re.fullmatch(r"(\d+(?:\.\d+)?)gb", kind)) and float(size.group(1)) > 0:
        gpu = replace(GPUS["h100"], name=f"{size.group(1)} GB GPU", memory=float(size.group(1)) * GB)
    else:
        raise PlanError(f"--cluster {spec!r}: unknown kind {kind!r}; {usage}")
    gpus = PRESET_GPUS if gpus is None else gpus
    if nodes < 1 or (gpu is not None and gpus < 1):
        raise PlanError(f"--cluster {spec!r}: a cluster has at least one node, a GPU node at least one GPU")
    cpus = float(options.get("cpus", CPUS_PER_GPU * gpus))
    host = float(options["mem"]) * GB if "mem" in options else HOST_PER_GPU * gpus
    if cpus <= 0 or host <= 0:
        raise PlanError(f"--cluster {spec!r}: cpus and mem must be > 0")
    return Cluster(tuple(Node(gpus, gpu, cpus, host) for _ in range(nodes)), f"--cluster {spec}")


def this_machine(cpus: float | None = None) -> Cluster:
    """This machine as one node: its CPUs (``cpus``: the logical CPUs a local Ray is given,
    ``rollout.ray.num_cpus``), memory and CUDA GPUs."""
    import psutil
    import torch

    gpus, gpu = 0, None
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        known = _known_gpu(props.name) or GPUS["h100"]
        gpu = GpuKind(props.name, float(props.total_memory), known.tflops, known.bandwidth)
    cpus = float(cpus or os.cpu_count() or 1)
    return Cluster((Node(gpus, gpu, cpus, float(psutil.virtual_memory().total)),), "this machine")


def default_cluster(job: TrainJob) -> Cluster:
    """The Ray cluster this process is connected to (or that ``rollout.ray.address`` or
    ``RAY_ADDRESS`` names: joined, not started), else this machine as a local Ray would see it."""
    import ray

    if ray.is_initialized() and not _local_ray():
        return ray_cluster()
    address = job.rollout.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise PlanError(f"rollout.ray.address={address}: cannot join it ({error}); "
                            "give --cluster to plan without it") from None
        return ray_cluster()
    return this_machine(job.rollout.ray.num_cpus)


def _local_ray() -> bool:
    from turnstile.cluster.fleet.room import started_here

    return started_here()


def ray_cluster() -> Cluster:
    """The nodes of the Ray cluster this process is connected to. Ray reports GPU counts, not their
    memory: a node's ``accelerator_type`` names the kind where it is H100 or H200, otherwise 80 GB
    is assumed (said in the source). A local Ray started here is this machine, with Ray's CPUs."""
    import ray

    if _local_ray():
        local = this_machine(ray.cluster_resources().get("CPU"))
        return replace(local, source="the local Ray")

    nodes, assumed = [], False
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        resources = info["Resources"]
        gpus = int(resources.get("GPU", 0))
        kind = next((key.split(":", 1)[1].lower() for key in resources if key.startswith("accelerator_type:")), "")
        gpu = _known_gpu(kind) if gpus else None
        if gpus and gpu is None:
            gpu, assumed = GPUS["h100"], True
        nodes.append(Node(gpus, gpu, float(resources.get("CPU", 0)), float(resources.get("memory", 0))
                          + float(resources.get("object_store_memory", 0))))
    return Cluster(tuple(nodes), "the Ray cluster" + (" (GPU memory assumed 80 GB)" if assumed else ""))


def _known_gpu(name: str) -> GpuKind | None:
    """The preset whose key (h100, h200) the device or accelerator name contains."""
    lowered = name.lower()
    return next((gpu for key, gpu in GPUS.items() if key in lowered), None)


@dataclass(frozen=True)
class Assumptions:
    """The shape of an average episode and the rates of the devices: the per-step estimate's inputs.
    Defaults: the 200-turn expert trajectory's 91 generated and 359 observed tokens a turn
    (docs/benchmarks/learner.md), every episode to ``max_turns``."""

    turns: int = 0  # mean turns per episode; 0 = env.max_turns (an upper bound)
    generated: int = 91  # tokens the policy writes a turn
    observed: int = 359  # tokens a tool's result adds a turn
    prompt: int = 400
    learner_mfu: float = 0.35  # share of peak FLOPs the learner reaches (GPU)
    prefill_utilisation: float = 0.5  # of peak FLOPs while an engine prefills
    env_cpu_s: float = 0.1  # CPU-seconds of a turn outside the model (tools, rendering; issue 52)
    publish_gbps: float = 2.0  # GB/s of a weight update's write and load (checkpoint dir or object store)


@dataclass
class Role:
    """``count`` instances of one kind of process, each needing ``gpus`` GPUs (a fraction shares one),
    ``gpu_bytes`` of each of its GPUs, ``host_bytes`` and ``cpus``."""

    name: str
    setting: str  # the config key that sizes or places it
    count: int
    cpus: float
    gpus: float
    gpu_bytes: float
    host_bytes: float
    parts: dict[str, float] = field(default_factory=dict)  # the memory's parts, for the table
    note: str = ""
    group: bool = False  # all instances on one node (a veRL worker group)
    each: str = ""  # the settings of what one instance asks for
    placed: list[str] = field(default_factory=list)  # where each instance went


@dataclass
class Plan:
    job: TrainJob
    cluster: Cluster
    roles: list[Role]
    problems: list[str]  # each names the setting to change
    notes: list[str]
    work: list[tuple[str, float, float, float]]  # role, tokens, FLOPs, seconds per step
    assumptions: Assumptions

    @property
    def fits(self) -> bool:
        return not self.problems


def make_plan(job: TrainJob, cluster: Cluster, *, assumptions: Assumptions = Assumptions(),
              model: str | None = None) -> Plan:
    """The plan of ``job`` on ``cluster``; ``model`` is the resolved model directory (default: the
    job's, resolved)."""
    from turnstile.rollout.model_store import resolve_model

    try:
        model = model or resolve_model(job.rollout.engine.model or job.learner.model)
    except (OSError, ValueError) as error:
        raise PlanError(f"learner.model: {error}") from None
    shape = model_shape(model)
    gpu_run = any(node.gpus for node in cluster.nodes)
    roles, notes = _roles(job, shape, model, gpu_run)
    problems = _place(roles, cluster)
    problems += _memory_problems(job, shape, roles, cluster)
    work = step_work(job, shape, cluster, assumptions, gpu_run)
    return Plan(job, cluster, roles, problems, notes, work, assumptions)


def _learner_on_gpu(config: LearnerConfig, gpu_run: bool) -> bool:
    return config.gpu if config.gpu is not None else gpu_run


def _roles(job: TrainJob, shape: ModelShape, model: str, gpu_run: bool) -> tuple[list[Role], list[str]]:
    """Every role of the run with what one instance needs, and notes for the user."""
    rollout, fleet, engine = job.rollout, job.rollout.fleet, job.rollout.engine
    notes: list[str] = []
    roles = [_engine_role(job, shape, model)]
    render = rollout.tools.visit.render != "never"
    roles.append(Role("rollout worker", "rollout.fleet.workers", fleet.workers, fleet.worker_cpus, 0.0, 0.0,
                      WORKER_HOST + (CHROMIUM_HOST if render else 0.0),
                      {"the worker": WORKER_HOST, **({"Chromium": CHROMIUM_HOST} if render else {})},
                      each="rollout.fleet.worker_cpus"))
    learner = job.learner
    on_gpu = _learner_on_gpu(learner, gpu_run)
    policy = policy_memory(shape, learner, gpu=on_gpu)
    share = learner.gpu_share if on_gpu else 0.0
    cpus = 1.0 if on_gpu else float(learner.num_cpus_per_worker)
    rank_setting = "learner.dp" if learner.sequence_parallel == 1 else "learner.dp x learner.sequence_parallel"
    if on_gpu:
        roles.append(Role("policy rank", rank_setting, learner.processes, cpus, share, sum(policy.values()),
                          RANK_HOST_GPU + 4.0 * shape.params, policy, group=True,
                          note=f"{tokens_per_rank(learner):,} tokens a forward"))
    else:
        roles.append(Role("policy rank", rank_setting, learner.dp, cpus, 0.0, 0.0, sum(policy.values()),
                          policy, group=True, note=f"{tokens_per_rank(learner):,} tokens a forward, CPU"))
    if learner.kl_coef > 0:
        reference = reference_memory(shape, learner, gpu=on_gpu)
        roles.append(Role("reference rank", rank_setting + " (kl_coef > 0)",
                          learner.processes if on_gpu else learner.dp, cpus, share,
                          reference if on_gpu else 0.0, RANK_HOST_GPU if on_gpu else reference,
                          {"forward only": reference}, group=True))
    if job.mode == "async":
        service = job.reward_service
        scoring = _scoring_model(job, shape, gpu=service.worker_gpus > 0)
        roles.append(Role("reward worker", "reward_service.workers", service.workers, service.worker_cpus,
                          service.worker_gpus, scoring if service.worker_gpus else 0.0,
                          REWARD_HOST + (0.0 if service.worker_gpus else scoring),
                          {"the worker": REWARD_HOST, **({"scoring model": scoring} if scoring else {})},
                          each="reward_service.worker_cpus and worker_gpus"))
    elif scoring := _scoring_model(job, shape, gpu=False):
        notes.append(f"sync mode scores rewards in the driver: its scoring model adds {scoring / GB:.1f} GB there")
    if job.store.kind == "memory":  # the episodes' checkpoints (and async's queue) in an actor of the run
        roles.append(Role("store", "store.kind", 1, 0.0, 0.0, 0.0, STORE_HOST))
    roles.append(Role("driver", "(the command)", 1, 0.0, 0.0, 0.0, DRIVER_HOST + (
        _scoring_model(job, shape, gpu=False) if job.mode == "sync" else 0.0)))
    if engine.kind == "vllm" and gpu_run and engine.dtype == "float32":
        notes.append("rollout.engine.dtype=float32 on GPUs doubles the weights and KV of bfloat16")
    return roles, notes


def _engine_role(job: TrainJob, shape: ModelShape, model: str) -> Role:
    from turnstile.rollout.engines.shape import follow_model

    fleet, engine = job.rollout.fleet, job.rollout.engine
    episode = job.rollout.episode
    if not engine.max_model_len:
        engine = follow_model(engine, model, room=episode.context_budget + episode.max_new_tokens)
    setting = "rollout.fleet.engine_replicas"
    if engine.kind == "scripted":
        return Role("engine replica", setting, fleet.engine_replicas, fleet.engine_cpus, 0.0, 0.0,
                    SCRIPTED_ENGINE_HOST, note="scripted: no model", each="rollout.fleet.engine_cpus")
    dtype = 4 if engine.kind == "hf" and engine.dtype not in DTYPE_BYTES else DTYPE_BYTES.get(engine.dtype, 4)
    weights = float(dtype) * shape.params
    if engine.kind == "hf" or fleet.engine_gpus == 0:
        kv = float(kv_cache_bytes(engine, shape, cpu=True) or 0) if engine.kind == "vllm" else 0.0
        base = HF_ENGINE_HOST if engine.kind == "hf" else ENGINE_HOST_CPU
        return Role("engine replica", setting, fleet.engine_replicas, fleet.engine_cpus, fleet.engine_gpus, 0.0,
                    base + weights + kv, {"the process": base, "weights": weights, **({"KV cache": kv} if kv else {})},
                    note=f"{engine.kind} on CPU, max_model_len {engine.max_model_len:,}",
                    each="rollout.fleet.engine_cpus")
    tp = engine.vllm.tensor_parallel_size
    per_gpu_weights = weights / tp
    one = float(shape.kv_bytes_for(engine.max_model_len, engine.dtype, tp, block=16))
    concurrent = min(engine.vllm.max_num_seqs, math.ceil(fleet.workers * fleet.episodes_per_worker
                                                         / fleet.engine_replicas))
    parts = {"weights": per_gpu_weights, "activations, CUDA graphs": ENGINE_GPU_OVERHEAD,
             "KV cache, one sequence of max_model_len": one}
    gpus = fleet.engine_gpus if tp == 1 else max(fleet.engine_gpus, tp)  # a share of one GPU, or tp GPUs
    role = Role("engine replica", setting, fleet.engine_replicas, fleet.engine_cpus, gpus,
                0.0, ENGINE_HOST_GPU, parts, note=f"vLLM, tp {tp}, max_model_len {engine.max_model_len:,}",
                each="rollout.fleet.engine_gpus (or tensor_parallel_size) and engine_cpus")
    role.parts["needed"] = per_gpu_weights + ENGINE_GPU_OVERHEAD + one
    role.parts["concurrent"] = float(concurrent)
    role.parts["utilisation"] = engine.vllm.gpu_memory_utilization
    return role


SCORED_POSITIONS = 1024  # logits a scorer holds at once: the pseudo-responses of a chunk of boundaries


def _scoring_model(job: TrainJob, shape: ModelShape, *, gpu: bool) -> float:
    """Bytes of the model a reward scores with after the fact (information gain off the engines):
    its weights (bf16 on a GPU, fp32 on CPU), one layer's activations over a whole context (forward
    only, no gradients) and fp32 logits for :data:`SCORED_POSITIONS` positions."""
    for spec, on_engines in placed_rewards(job):
        if spec.kind == "information_gain" and not on_engines:
            dtype = 2 if gpu else 4
            context = job.rollout.episode.context_budget
            return (float(dtype) * shape.params + shape.layer_activations(context, dtype)
                    + 4.0 * SCORED_POSITIONS * shape.vocab)
    return 0.0


def _place(roles: list[Role], cluster: Cluster) -> list[str]:
    """First fit of every instance on the nodes by GPUs (a share of a GPU leaves the rest of it to
    others), CPUs and host memory: GPU roles first, whole GPUs before shares, a worker group's
    instances on one node. Returns what could not be placed, each naming the setting to lower and
    a value that fits. (GPU memory is :func:`_memory_problems`'.)"""
    free_gpu = [[1.0] * node.gpus for node in cluster.nodes]  # share of each GPU still free
    free_cpu = [node.cpus for node in cluster.nodes]
    free_host = [node.host - (RAY_HOST if i == 0 else 0.0) for i, node in enumerate(cluster.nodes)]
    problems: list[str] = []

    def take(role: Role, n: int) -> bool:
        if free_cpu[n] + 1e-9 < role.cpus or free_host[n] + 1 < role.host_bytes:
            return False
        whole = role.gpus >= 1
        share = 1.0 if whole else role.gpus
        need = math.ceil(role.gpus) if whole else (1 if role.gpus else 0)
        chosen = [g for g, free in enumerate(free_gpu[n]) if free + 1e-9 >= share][:need]
        if len(chosen) < need:
            return False
        for g in chosen:
            free_gpu[n][g] -= share
        free_cpu[n] -= role.cpus
        free_host[n] -= role.host_bytes
        role.placed.append(f"node {n}" + (f" GPU {','.join(map(str, chosen))}" if chosen else ""))
        return True

    def state() -> tuple[list[list[float]], list[float], list[float]]:
        return [row[:] for row in free_gpu], free_cpu[:], free_host[:]

    order = sorted(roles, key=lambda r: (-(r.gpus >= 1), -(r.gpus > 0), -r.host_bytes))
    for role in order:
        if not role.group:
            for _ in range(role.count):
                if not any(take(role, n) for n in range(len(cluster.nodes))):
                    problems.append(_unplaced(role, cluster, len(role.placed), together=False))
                    break
            continue
        most = 0  # a worker group: all on one node, or none
        for n in range(len(cluster.nodes)):
            saved = state()
            taken = 0
            while taken < role.count and take(role, n):
                taken += 1
            if taken == role.count:
                break
            most = max(most, taken)
            free_gpu[:], free_cpu[:], free_host[:] = saved
            role.placed.clear()
        else:
            problems.append(_unplaced(role, cluster, most, together=True))
    return problems


def _unplaced(role: Role, cluster: Cluster, room: int, *, together: bool) -> str:
    """Why ``role`` could not be placed, with a count that fits (``room``: as many as were placed)."""
    each = (f"{role.cpus:g} CPU" + (f", {role.gpus:g} GPU" if role.gpus else "")
            + f", {role.host_bytes / GB:.1f} GB host")
    largest = max(cluster.nodes, key=lambda node: (node.gpus, node.cpus, node.host))
    fits_alone = any(node.cpus >= role.cpus and node.host >= role.host_bytes
                     and (not role.gpus or node.gpus >= math.ceil(role.gpus)) for node in cluster.nodes)
    if not fits_alone:
        return (f"{role.name}: one asks for {each}, more than any node has ({largest.describe()}): "
                f"lower {role.each or 'what each asks for'}, or use larger nodes")
    where = "on one node (a veRL worker group), beside the other roles" if together else "beside the other roles"
    fix = (f"lower {role.setting} to {room}" if room else
           "add nodes, or lower what the roles placed before them take" if together else
           "add memory, CPUs or nodes, or lower what the roles placed before it take")
    return f"{role.name}: {role.count} x ({each}) do not fit {where}; room for {room}: {fix}"


def _memory_problems(job: TrainJob, shape: ModelShape, roles: list[Role], cluster: Cluster) -> list[str]:
    """The GPU roles' memory against their GPUs: an engine's weights, overhead and one sequence
    within its ``gpu_memory_utilization``; a policy rank within its GPU (less the engine's share where
    they share one)."""
    problems: list[str] = []
    gpu = next((node.gpu for node in cluster.nodes if node.gpu), None)
    if gpu is None:
        return problems
    by_name = {role.name: role for role in roles}
    engine = by_name["engine replica"]
    if "needed" in engine.parts:
        util = engine.parts["utilisation"]
        share = util * gpu.memory
        if engine.parts["needed"] > share:
            fit = math.ceil(engine.parts["needed"] / gpu.memory * 100) / 100
            tp = job.rollout.engine.vllm.tensor_parallel_size
            split = engine.parts["needed"] - engine.parts["activations, CUDA graphs"]  # weights and KV divide by tp
            wider = next((k * tp for k in (2, 4, 8) if k * tp <= max(node.gpus for node in cluster.nodes)
                          and split / k + engine.parts["activations, CUDA graphs"] <= share), None)
            fix = (f"raise rollout.engine.vllm.gpu_memory_utilization to {fit:.2f}" if fit <= 0.95 else
                   f"raise rollout.engine.vllm.tensor_parallel_size to {wider}" if wider else
                   "lower rollout.engine.max_model_len (and the episodes' context_budget)")
            problems.append(f"engine replica: weights, activations and one max_model_len sequence need "
                            f"{engine.parts['needed'] / GB:.1f} GB of its GPU, its share (gpu_memory_utilization "
                            f"{util:g} x {gpu.memory / GB:.0f} GB) is {share / GB:.1f} GB: {fix}")
    policy = by_name["policy rank"]
    if policy.gpu_bytes and policy.gpus:
        room = gpu.memory - (engine.parts.get("utilisation", 0.0) * gpu.memory if policy.gpus < 1 else 0.0)
        if policy.gpu_bytes > room:
            problems.append(_learner_fix(job.learner, shape, room, max(node.gpus for node in cluster.nodes)))
    return problems


def _learner_fix(config: LearnerConfig, shape: ModelShape, room: float, gpus_per_node: int) -> str:
    """The learner's misfit in one line, with a token budget (or sequence-parallel degree) that fits."""
    tokens = tokens_per_rank(config)
    need = sum(policy_memory(shape, config, gpu=True).values())
    per_token = (sum(policy_memory(shape, config, gpu=True, tokens=2 * tokens).values()) - need) / tokens
    budget = int((room - (need - per_token * tokens)) // per_token)
    budget = budget // 1024 * 1024
    one_sample = -(-config.max_length // config.sequence_parallel)
    where = f"a policy rank needs {need / GB:.1f} GB, its GPU has {room / GB:.1f} GB for it"
    if budget >= one_sample:
        return f"{where}: set learner.max_tokens_per_gpu={budget} (a forward of {budget:,} tokens)"
    for sp in range(config.sequence_parallel + 1, gpus_per_node + 1):
        if gpus_per_node % sp == 0 and budget >= -(-config.max_length // sp):
            return (f"{where}, and one {config.max_length:,}-token sample does not fit at sequence_parallel="
                    f"{config.sequence_parallel}: set learner.sequence_parallel={sp} learner.max_tokens_per_gpu="
                    f"{budget}")
    if not config.gradient_checkpointing:
        return f"{where}: set learner.gradient_checkpointing=true"
    return (f"{where}: one {config.max_length:,}-token sample does not fit even at learner.sequence_parallel="
            f"{gpus_per_node} (the GPUs of a node); lower learner.max_length, or use GPUs with more memory")


def step_work(job: TrainJob, shape: ModelShape, cluster: Cluster, a: Assumptions,
              gpu_run: bool) -> list[tuple[str, float, float, float]]:
    """Per step: (role, tokens, FLOPs, seconds) for the engines' decode and prefill, the
    environment, the learner (and its reference) and the weight update."""
    episodes = job.tasks_per_step * job.rollout.group_size
    turns = a.turns or job.rollout.episode.env.max_turns
    generated = min(a.generated, job.rollout.episode.max_new_tokens)
    context = min(job.rollout.episode.context_budget, a.prompt + turns * (generated + a.observed))
    fleet, engine = job.rollout.fleet, job.rollout.engine
    gpu = next((node.gpu for node in cluster.nodes if node.gpu), None)
    params = float(shape.params)
    attention = 4.0 * shape.layers * shape.heads * shape.head_dim * context / 2  # a token's mean, fwd
    decode_tokens = episodes * turns * generated
    prefill_tokens = episodes * (a.prompt + turns * a.observed)
    rows: list[tuple[str, float, float, float]] = []
    if engine.kind != "scripted":
        engines_on_gpu = gpu is not None and fleet.engine_gpus > 0 and engine.kind == "vllm"
        peak = (gpu.tflops * 1e12 if engines_on_gpu and gpu else CPU_GFLOPS * 1e9 * fleet.engine_cpus)
        bandwidth = gpu.bandwidth if engines_on_gpu and gpu else CPU_BANDWIDTH
        dtype = DTYPE_BYTES.get(engine.dtype, 4)
        batch = max(1, min(engine.vllm.max_num_seqs, math.ceil(episodes / fleet.engine_replicas)))
        kv_token = shape.kv_bytes_per_token(engine.dtype, engine.vllm.tensor_parallel_size)
        if engines_on_gpu and gpu:  # as many sequences of the mean context as the KV cache holds
            cache = (engine.vllm.gpu_memory_utilization * gpu.memory - ENGINE_GPU_OVERHEAD
                     - dtype * params / engine.vllm.tensor_parallel_size)
            batch = max(1, min(batch, int(cache // (kv_token * context / 2))))
        read = dtype * params / engine.vllm.tensor_parallel_size + batch * (context / 2) * kv_token
        flops = (2 * params + attention) * decode_tokens
        per_step = max(read / bandwidth, (2 * params + attention) * batch / peak)
        rows.append(("engines: decode", decode_tokens, flops, decode_tokens / batch * per_step / fleet.engine_replicas))
        flops = (2 * params + attention) * prefill_tokens
        rows.append(("engines: prefill", prefill_tokens, flops,
                     flops / (peak * a.prefill_utilisation) / fleet.engine_replicas))
    env_cpus = max(fleet.workers * fleet.worker_cpus, 1e-9)
    rows.append(("environment (tools, pages)", episodes * turns, 0.0, episodes * turns * a.env_cpu_s / env_cpus))
    learner = job.learner
    on_gpu = _learner_on_gpu(learner, gpu_run) and gpu is not None
    trained = float(episodes * context)
    passes = (3 + (1 if learner.gradient_checkpointing else 0)
              + (1 if learner.loss_settings().recompute_old_log_probs else 0))
    flops = (2 * params + attention) * passes * trained
    rate = (gpu.tflops * 1e12 * a.learner_mfu * learner.processes if on_gpu and gpu
            else CPU_GFLOPS * 1e9 * max(learner.threads or learner.num_cpus_per_worker, 1) * learner.dp)
    rows.append(("learner", trained, flops, flops / rate))
    if learner.kl_coef > 0:
        flops = (2 * params + attention) * trained
        rows.append(("reference (KL)", trained, flops, flops / rate))
    rows.append(("weight update", 0.0, 0.0, 2 * 2 * params / (a.publish_gbps * GB)))
    return rows


def step_seconds(plan: Plan) -> tuple[float, str]:
    """The step's time and its bottleneck: in sync mode rollout, then learner, then update add up;
    in async mode the rollout overlaps the learner and the slower of the two sets the pace."""
    rollout = sum(s for name, _, _, s in plan.work if name.startswith(("engines", "environment")))
    rest = sum(s for name, _, _, s in plan.work if not name.startswith(("engines", "environment")))
    slowest = max(plan.work, key=lambda row: row[3])[0]
    total = rollout + rest if plan.job.mode == "sync" else max(rollout, rest)
    return total, slowest


def render(plan: Plan) -> list[str]:
    """The plan as the console prints it: the roles, their placement and memory, the verdict, the
    step's work and time, and the assumptions."""
    job, a = plan.job, plan.assumptions
    lines = [f"cluster: {plan.cluster.describe()}",
             f"run: {job.mode}, {job.tasks_per_step} tasks x {job.rollout.group_size} samples a step, "
             f"engine {job.rollout.engine.kind}, learner dp={job.learner.dp} x sp={job.learner.sequence_parallel}",
             "",
             "| role | setting | count | each: CPUs | GPUs | GPU memory | host memory | placed on |",
             "|---|---|---|---|---|---|---|---|"]
    gpu = next((node.gpu for node in plan.cluster.nodes if node.gpu), None)
    for role in plan.roles:
        gpu_mem = role.gpu_bytes
        if "needed" in role.parts and gpu:
            gpu_mem = role.parts["utilisation"] * gpu.memory
        where = _compress(role.placed) or "-"
        lines.append(f"| {role.name} | {role.setting} | {role.count} | {role.cpus:g} | {role.gpus:g} | "
                     f"{gpu_mem / GB:.1f} GB | {role.host_bytes / GB:.1f} GB | {where} |")
    lines.append("")
    for role in plan.roles:
        parts = {k: v for k, v in role.parts.items() if k not in ("needed", "concurrent", "utilisation")}
        if parts:
            shown = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in parts.items())
            lines.append(f"{role.name}{' (' + role.note + ')' if role.note else ''}: {shown}")
        if "needed" in role.parts and gpu:
            one = role.parts["KV cache, one sequence of max_model_len"]
            held = int(max(role.parts["utilisation"] * gpu.memory - role.parts["needed"] + one, 0) // one)
            concurrent = int(role.parts["concurrent"])
            lines.append(f"  its KV cache holds {held} sequences of max_model_len; {concurrent} episodes run on "
                         f"it at once" + ("" if held >= concurrent else
                                          " (the rest wait or are preempted and recomputed as contexts grow)"))
    lines += [f"note: {note}" for note in plan.notes]
    lines.append("")
    if plan.fits:
        lines.append("fits: every role has its GPUs, CPUs and memory")
    else:
        lines.append("does not fit:")
        lines += [f"  - {problem}" for problem in plan.problems]
    seconds, slowest = step_seconds(plan)
    lines += ["", "| per step | tokens | FLOPs | seconds |", "|---|---|---|---|"]
    for name, tokens, flops, secs in plan.work:
        lines.append(f"| {name} | {tokens:,.0f} | {flops:.3g} | {secs:,.1f} |")
    lines.append(f"step: ~{seconds:,.0f} s ({job.mode}); bottleneck: {slowest}")
    turns = a.turns or job.rollout.episode.env.max_turns
    lines.append(f"assumed: {turns} turns an episode{' (max_turns: an upper bound)' if not a.turns else ''}, "
                 f"{a.generated} tokens generated and {a.observed} observed a turn, a {a.prompt}-token prompt; "
                 f"GPU {f'{gpu.name}: {gpu.tflops:g} TFLOP/s bf16, {gpu.bandwidth / 1e12:g} TB/s' if gpu else 'none'}; "
                 f"learner MFU {a.learner_mfu:g}, prefill {a.prefill_utilisation:g} of peak, CPU "
                 f"{CPU_GFLOPS:g} GFLOP/s a core; {a.env_cpu_s:g} CPU-s a turn in the environment; "
                 f"updates at {a.publish_gbps:g} GB/s")
    return lines


def _compress(places: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for place in places:
        node = place.split(" GPU")[0]
        counts[node] = counts.get(node, 0) + 1
    return ", ".join(f"{node}" + (f" x{count}" if count > 1 else "") for node, count in counts.items())


def check_fit(job: TrainJob, model: str) -> None:
    """Before any actor starts: the plan of ``job`` on the Ray cluster this process is connected to.
    A misfit is refused (:class:`~turnstile.cluster.fleet.room.ClusterTooSmall`) on a Ray this
    command started, and a warning on a joined cluster, which may grow."""
    import logging
    import sys

    from turnstile.cluster.fleet.room import ClusterTooSmall, started_here

    plan = make_plan(job, ray_cluster(), model=model)
    if plan.fits:
        return
    message = "; ".join(plan.problems)
    if started_here():
        raise ClusterTooSmall(f"the run does not fit this machine ({plan.cluster.describe()}): {message}. "
                              "`turnstile plan` prints the whole plan")
    logging.getLogger(__name__).warning(message)
    print(f"turnstile: the plan says the run does not fit the cluster as it is now: {message}", file=sys.stderr)


def plan_payload(plan: Plan) -> dict[str, Any]:
    """The plan as data (for tests and scripts): roles with placement and memory, fit, step time."""
    seconds, slowest = step_seconds(plan)
    return {"fits": plan.fits, "problems": plan.problems, "step_s": seconds, "bottleneck": slowest,
            "roles": [{"name": r.name, "count": r.count, "gpus": r.gpus, "gpu_gb": r.gpu_bytes / GB,
                       "host_gb": r.host_bytes / GB, "placed": r.placed} for r in plan.roles]}
