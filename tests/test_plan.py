"""`turnstile plan` (cluster/jobs/plan.py): the recipes fit their clusters, a misfit names a setting and
a value that fits (planned again, it does), bad input is one line each, and `turnstile train`
refuses a run that does not fit a Ray it started before any actor starts.

The models are config.json files alone, with the architectures' published figures (no weights are
needed to plan)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.plan import GB, PlanError, make_plan, parse_cluster, render
from turnstile.cluster.jobs.run import TrainJob
from turnstile.learner.memory import policy_memory
from turnstile.learner.trainer import LearnerConfig
from turnstile.rollout.engines.shape import model_shape

ROOT = Path(__file__).resolve().parent.parent
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "max_position_embeddings": 40960}
QWEN25_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960,
               "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
               "tie_word_embeddings": True, "max_position_embeddings": 32768}
# recipe, cluster, model: each recipe on the cluster it is written for
RECIPES = [("examples/gpu_one.yaml", "1x1xh100", QWEN25_1_5B), ("examples/gpu_node.yaml", "1x8xh100", QWEN3_8B),
           ("examples/train_gpu.yaml", "2x8xh100", QWEN3_8B)]


def model_dir(tmp_path: Path, config: dict[str, object]) -> str:
    folder = tmp_path / str(config["model_type"])
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def plan_of(path: str, cluster: str, model: str, *overrides: str):  # noqa: ANN201
    job = load_config(TrainJob, str(ROOT / path), [f"rollout.engine.model={model}", *overrides])
    return make_plan(job, parse_cluster(cluster), model=model)


@pytest.mark.parametrize(("path", "cluster", "config"), RECIPES)
def test_each_recipe_fits_its_cluster(tmp_path: Path, path: str, cluster: str, config: dict[str, object]) -> None:
    plan = plan_of(path, cluster, model_dir(tmp_path, config))
    assert plan.fits, plan.problems
    text = "\n".join(render(plan))
    assert "fits: every role" in text and "bottleneck:" in text
    for role in plan.roles:  # every instance placed, GPU roles on GPUs
        assert len(role.placed) == role.count, role
        assert all("GPU" in where for where in role.placed) == bool(role.gpus), role
    by_name = {role.name: role for role in plan.roles}
    ranks = by_name["policy rank"].placed
    assert len({where.split(" GPU")[0] for where in ranks}) == 1  # a veRL worker group: one node


def test_the_one_gpu_recipe_shares_its_gpu(tmp_path: Path) -> None:
    plan = plan_of("examples/gpu_one.yaml", "1x1xh100", model_dir(tmp_path, QWEN25_1_5B))
    by_name = {role.name: role for role in plan.roles}
    assert by_name["engine replica"].placed == by_name["policy rank"].placed == ["node 0 GPU 0"]
    engine_share = 0.35 * 80 * GB
    assert by_name["policy rank"].gpu_bytes <= 80 * GB - engine_share  # the learner in what vLLM leaves
    # too large a share for the engine: the learner no longer fits beside it, and the message says so
    squeezed = plan_of("examples/gpu_one.yaml", "1x1xh100", model_dir(tmp_path, QWEN25_1_5B),
                       "rollout.engine.vllm.gpu_memory_utilization=0.8")
    assert not squeezed.fits
    assert any(p.startswith("a policy rank needs") for p in squeezed.problems), squeezed.problems


def test_todays_gpu_example_needs_two_nodes(tmp_path: Path) -> None:
    model = model_dir(tmp_path, QWEN3_8B)
    plan = plan_of("examples/train_gpu.yaml", "1x8xh100", model)  # 8 engines, 4 policy and 4 reference GPUs
    assert not plan.fits
    engines, reference = plan.problems
    assert engines.startswith("engine replica: 8 x") and engines.endswith("lower rollout.fleet.engine_replicas to 4")
    assert reference.startswith("reference rank: 4 x") and "room for 0" in reference


def test_a_learner_misfit_names_a_token_budget_that_fits(tmp_path: Path) -> None:
    model = model_dir(tmp_path, QWEN3_8B)
    plan = plan_of("examples/train_gpu.yaml", "2x8xh100", model, "learner.max_tokens_per_gpu=131072")
    [problem] = plan.problems
    budget = re.search(r"set learner.max_tokens_per_gpu=(\d+)", problem)
    assert budget, problem
    again = plan_of("examples/train_gpu.yaml", "2x8xh100", model, f"learner.max_tokens_per_gpu={budget[1]}")
    assert again.fits, again.problems
    assert int(budget[1]) > 32768  # not merely the recipe's own value: the largest that fits, to 1,024


def test_an_engine_misfit_names_a_share_that_fits(tmp_path: Path) -> None:
    model = model_dir(tmp_path, QWEN3_8B)
    plan = plan_of("examples/gpu_node.yaml", "1x8xh100", model, "rollout.engine.vllm.gpu_memory_utilization=0.2")
    [problem] = plan.problems
    share = re.search(r"gpu_memory_utilization to (0\.\d+)", problem)
    assert share, problem
    again = plan_of("examples/gpu_node.yaml", "1x8xh100", model,
                    f"rollout.engine.vllm.gpu_memory_utilization={share[1]}")
    assert again.fits, again.problems
    # an engine whose one sequence outgrows any share: a tensor-parallel degree that fits
    long = plan_of("examples/gpu_node.yaml", "1x8xh100", model, "rollout.engine.max_model_len=400000")
    assert any("tensor_parallel_size to 2" in p for p in long.problems), long.problems


def test_a_context_no_node_can_hold_is_one_line(tmp_path: Path) -> None:
    model = model_dir(tmp_path, QWEN3_8B)
    plan = plan_of("examples/gpu_node.yaml", "1x8xh100", model, "learner.max_length=1048576",
                   "learner.max_tokens_per_gpu=1048576", "rollout.engine.max_model_len=1048576",
                   "rollout.episode.context_budget=1000000", "rollout.engine.vllm.tensor_parallel_size=8")
    assert any("does not fit even at learner.sequence_parallel=8" in p for p in plan.problems), plan.problems


def test_a_role_that_fits_on_no_node(tmp_path: Path) -> None:
    plan = plan_of("examples/gpu_node.yaml", "2x8xh100", model_dir(tmp_path, QWEN3_8B), "rollout.fleet.engine_gpus=16")
    assert any(p.startswith("engine replica: one asks for 4 CPU, 16 GPU") and "rollout.fleet.engine_gpus" in p
               for p in plan.problems), plan.problems


@pytest.mark.parametrize(("spec", "nodes", "gpus", "memory", "cpus"), [
    ("2x8xh100", 2, 8, 80, 192), ("h200", 1, 8, 141, 192), ("1x1xh100", 1, 1, 80, 24),
    ("3x4x40gb,cpus=32,mem=512", 3, 4, 40, 32), ("1xcpu,cpus=2,mem=24", 1, 0, 0, 2)])
def test_cluster_specs(spec: str, nodes: int, gpus: int, memory: int, cpus: int) -> None:
    cluster = parse_cluster(spec)
    assert len(cluster.nodes) == nodes
    node = cluster.nodes[0]
    assert (node.gpus, node.cpus) == (gpus, cpus)
    assert (node.gpu.memory if node.gpu else 0) == memory * GB


@pytest.mark.parametrize("spec", ["", "2x8", "2x8xa100", "0x8xh100", "2x0xh100", "1x8xh100,gpus=3", "1xcpu",
                                  "8xh100xfast", "1x1x0gb"])
def test_bad_cluster_specs_are_one_line(spec: str) -> None:
    with pytest.raises(PlanError) as error:
        parse_cluster(spec)
    assert "\n" not in str(error.value) and "--cluster" in str(error.value)


def test_the_learner_memory_by_hand() -> None:
    """Qwen3-8B's parameters, and each part of a policy rank at 32k tokens by hand."""
    shape = model_shape(model_dir_static(QWEN3_8B))
    # Qwen3-8B's weights hold 8,190,735,360 numbers; the shape leaves out Qwen3's q/k norms (2 x 128 a layer)
    assert shape.params == 8_190_735_360 - 36 * 256
    config = LearnerConfig(dp=2, sequence_parallel=2, max_tokens_per_gpu=32768, max_length=65536,
                           gradient_checkpointing=True, mini_batch=64)
    parts = policy_memory(shape, config, gpu=True)
    assert parts["weights+grads+AdamW (fp32, sharded)"] == 16 * shape.params / 4
    assert parts["activations: layer inputs"] == 2 * 32768 * 4096 * 36
    assert parts["LM head: logits, their grad, fp32 softmax"] == 1024 * 151936 * 8
    cpu = policy_memory(shape, LearnerConfig(mini_batch=8, micro_batch=2, max_length=4096), gpu=False)
    # fp32 (twice bf16), every layer and one more layer's worth of gradients in backward
    assert cpu["activations: every layer"] == 2 * shape.layer_activations(2 * 4096, 2) * 37


def model_dir_static(config: dict[str, object]) -> str:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="plan-model-"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def run_cli(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from turnstile.cluster.cli import main; main()", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False)


def plan_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``turnstile plan ARGS`` in this process, from the repository root: its exit code and output."""
    from turnstile.cluster.cli import main

    with pytest.raises(SystemExit) as exited, pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        main(["plan", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return int(exited.value.code or 0), captured.out


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = model_dir(tmp_path, QWEN3_8B)
    code, said = plan_cli(capsys, "--config", "examples/gpu_node.yaml", "--cluster", "1x8xh100",
                          f"rollout.engine.model={model}")
    assert code == 0, said
    assert "fits: every role" in said and "| policy rank | learner.dp | 4 |" in said
    code, said = plan_cli(capsys, "--config", "examples/train_gpu.yaml", "--cluster", "1x8xh100",
                          f"rollout.engine.model={model}", "--json")
    assert code == 1
    assert json.loads(said)["fits"] is False
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, expected in [((f"rollout.engine.model={empty}",), "no config.json"),
                           (("--cluster", "2x8xquantum"), "unknown kind 'quantum'"),
                           (("learner.dp=0",), "learner.dp")]:
        code, said = plan_cli(capsys, *args)
        assert code == 2 and expected in said and said.count("\n") == 1, said


@pytest.mark.integration
def test_train_refuses_a_misfit_before_any_actor(tmp_path: Path) -> None:
    """A Ray the command starts itself (not the session's: a joined cluster only warns): forty
    rollout workers' host memory is more than this machine has, and the run stops before the
    corpus server or any actor starts, naming the setting and a count that fits."""
    out = tmp_path / "run"
    result = run_cli("train", "rollout.fleet.worker_cpus=0.01", "rollout.fleet.workers=400",
                     f"out={out}", "--no-progress", timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("turnstile train:")]
    assert "does not fit this machine" in line and "lower rollout.fleet.workers to" in line, line
    assert not (out / "fleet.jsonl").exists()  # the fleet never started


SHARED_GPU = """
import ray
from ray.util.placement_group import placement_group
ray.init(num_cpus=3, num_gpus=1, include_dashboard=False, log_to_driver=False)
from turnstile.learner.verl_workers import shared_gpu_pool
pool = shared_gpu_pool(1, 2)  # the learner's rank: half of the GPU (learner.gpu_share=0.5)
[group] = pool.pgs
print("bundle", group.bundle_specs[0]["GPU"], "worker", 1 / pool.max_colocate_count)

@ray.remote(num_gpus=0.5, num_cpus=1)
class Engine:  # an engine replica with rollout.fleet.engine_gpus=0.5
    def gpus(self):
        return ray.get_gpu_ids()

print("engine", ray.get(Engine.remote().gpus.remote(), timeout=60))
whole = placement_group([{"CPU": 1, "GPU": 1}])  # what veRL's own pool would have asked for
print("whole GPU free", whole.wait(timeout_seconds=3))
"""


@pytest.mark.integration
def test_a_learner_rank_and_an_engine_share_one_gpu() -> None:
    """Ray with one (logical) GPU: the learner's resource pool at learner.gpu_share=0.5 reserves half
    of it, an engine replica asking for the other half starts beside it, and nothing is left for a
    whole-GPU bundle (which veRL's own pool would have reserved). Its own Ray in a subprocess: the
    session's has no GPU."""
    result = subprocess.run([sys.executable, "-c", SHARED_GPU], capture_output=True, text=True, cwd=ROOT,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout.splitlines()
    assert "bundle 0.5 worker 0.5" in said
    assert any(line.startswith("engine [") for line in said), said
    assert "whole GPU free False" in said


@pytest.mark.parametrize("share", [0.0, 0.3, 1.5, -0.5])
def test_a_gpu_share_is_one_kth(share: float) -> None:
    from turnstile.learner.trainer import LearnerError

    with pytest.raises(LearnerError, match=r"learner.gpu_share=.* must be 1/k of a GPU"):
        LearnerConfig(gpu_share=share)
    assert LearnerConfig(gpu_share=0.25).gpu_share == 0.25


@pytest.mark.parametrize("started_here", [True, False])
def test_train_refuses_on_its_own_ray_and_warns_on_a_joined_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], started_here: bool) -> None:
    from turnstile.cluster.fleet import room
    from turnstile.cluster.fleet.room import ClusterTooSmall
    from turnstile.cluster.jobs import plan
    from turnstile.rollout.model_store import ensure_default_model

    small = parse_cluster("1xcpu,cpus=4,mem=4.5")  # the default job needs ~5.5 GB
    monkeypatch.setattr(plan, "ray_cluster", lambda: small)
    monkeypatch.setattr(room, "started_here", lambda: started_here)
    job = load_config(TrainJob, None, [])
    if started_here:
        refused = r"does not fit this machine \(1 x \(4 CPUs, 4.5 GB\).*rollout worker: 1 x .*room for 0"
        with pytest.raises(ClusterTooSmall, match=refused):
            plan.check_fit(job, str(ensure_default_model()))
    else:
        plan.check_fit(job, str(ensure_default_model()))  # the cluster may grow: go on, and say so
        said = capsys.readouterr().err
        assert said.startswith("turnstile: the plan says the run does not fit the cluster as it is now:"), said


def test_a_scoring_model_off_the_engines_is_planned_where_it_runs() -> None:
    """Information gain scored after the fact loads the model in each reward worker (fp32 on CPU);
    scored on the engines during rollout, the workers hold none."""
    from turnstile.cluster.jobs.plan import REWARD_HOST, SCORED_POSITIONS, this_machine
    from turnstile.rollout.model_store import ensure_default_model

    model = str(ensure_default_model())
    shape = model_shape(model)
    after = load_config(TrainJob, None, ["mode=async", "reward_service.workers=2",
                                         "rewards=[{kind: information_gain, options: {scorer: kv_cache}}]"])
    worker = next(r for r in make_plan(after, this_machine(8), model=model).roles if r.name == "reward worker")
    context = after.rollout.episode.context_budget
    scoring = 4.0 * shape.params + shape.layer_activations(context, 4) + 4.0 * SCORED_POSITIONS * shape.vocab
    assert worker.count == 2 and worker.host_bytes == pytest.approx(REWARD_HOST + scoring)
    during = load_config(TrainJob, None, ["mode=async",
                                          "rewards=[{kind: information_gain, options: {scorer: engine}}]"])
    worker = next(r for r in make_plan(during, this_machine(8), model=model).roles if r.name == "reward worker")
    assert worker.host_bytes == REWARD_HOST
