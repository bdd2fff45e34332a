"""Compile policies under Lightning's DDP: 2 CPU processes over gloo (tests/ddp_run.py), against one process of
the same global batch; checkpoints both ways; the strategies refused and why. Shared by the other distributed
tests (test_fsdp2, test_distributed_telemetry, test_distributed_cache)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    XLAStrategy,
)

from compile_trainer import apply_policy, to_policy
from compile_trainer.lightning.strategies import refuse_before_launch, strategy_kind
from compile_trainer.schema import PolicyError

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "ddp_run.py"
DDP_TIMEOUT = 240


def start(out: Path, *args: str, env: Optional[dict] = None) -> subprocess.Popen:
    """``python tests/ddp_run.py out args...``, started (every rank's output in one stream); ``env``: more variables."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, str(RUN), str(out), *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, out: Path) -> dict:
    output, _ = process.communicate(timeout=DDP_TIMEOUT)
    assert process.returncode == 0, output[-4000:]
    return json.loads(out.read_text()) | {"output": output}


SINGLE, TWO_RANKS = ["--devices", "1", "--batch", "4"], ["--devices", "2", "--batch", "2"]


def start_runs(directory: Path, runs: Dict[str, List[str]], *ranks: str) -> subprocess.Popen:
    """``tests/ddp_run.py --runs``: each of ``runs`` (name -> arguments) trained in turn in one process group on
    ``ranks``; its results in ``directory / <name>.json``."""
    argvs = [[str(directory / f"{name}.json"), *args, *ranks] for name, args in runs.items()]
    listed = directory / "runs.json"
    listed.write_text(json.dumps(argvs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(RUN), "--runs", str(listed)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_runs(process: subprocess.Popen, directory: Path, names: List[str]) -> Dict[str, dict]:
    """Each run's results, with its ranks' output; every run must have finished."""
    output, _ = process.communicate(timeout=DDP_TIMEOUT + 60 * len(names))
    results = {}
    for name in names:
        out = directory / f"{name}.json"
        logs = sorted(directory.glob(f"{name}.json.log.rank*"))
        run_output = "".join(log.read_text() for log in logs)
        assert process.returncode == 0 and out.exists(), f"{name}:\n{run_output[-3000:]}\n{output[-3000:]}"
        results[name] = json.loads(out.read_text()) | {"output": run_output}
    return results


def single_and_ddp(directory: Path, runs: Dict[str, List[str]]) -> Dict[str, tuple]:
    """Each run's training on 1 process of batch 4 and on 2 DDP processes of batch 2 each: one process and one
    process group, side by side, each training every run in turn."""
    single = start_runs(directory / "single", runs, *SINGLE)
    ddp = start_runs(directory / "ddp", runs, *TWO_RANKS)
    singles, ddps = (
        finish_runs(single, directory / "single", list(runs)),
        finish_runs(ddp, directory / "ddp", list(runs)),
    )
    return {name: (singles[name], ddps[name]) for name in runs}


def assert_same_training(single: dict, ddp: dict) -> None:
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert len(ddp["losses"]) == len(single["losses"]) >= 4
    assert ddp["losses"] == pytest.approx(single["losses"], abs=1e-5)
    for name, weight in single["weights"].items():
        # AdamW divides by the gradients' root mean square: float sums in another order move a weight by up to
        # 2.5e-5 after 4 steps of lr 1e-2 (a wrong gradient moves it by about lr)
        assert torch.allclose(torch.tensor(ddp["weights"][name]), torch.tensor(weight), atol=1e-4), name


BACKGROUND_ARGS = ["--sync-grads", "--compiled-from", "2,3"]
CLIP = ["--clip", "0.05"]
POLICIES = [
    ("regional", ["--backend", "eager"]),
    ("full", ["--backend", "aot_eager"]),
    ("dynamic", ["--backend", "eager"]),
    ("buckets", ["--backend", "eager"]),
    ("regional", ["--backend", "aot_eager", "--optimizer", "true", "--clip", "0.05"]),
    # auto: 1 + 3 warm-ups + 3 timed steps of trial, each rank timing its own
    ("regional", ["--backend", "aot_eager", "--optimizer", "auto", "--auto-steps", "1", "--steps", "8", *CLIP]),
    # the other bundled policies (on the CPU, the CUDA-graph and autotuning modes are the default mode)
    ("regional_split", ["--backend", "eager"]),
    ("regional_nested", ["--backend", "aot_eager"]),
    ("reduce_overhead", ["--backend", "eager"]),
    ("max_autotune", ["--backend", "eager"]),
    ("buckets_auto", ["--backend", "eager"]),
    # background: the thread held inside its compile until each rank's step (rank 0: 2, rank 1: 3), while the
    # eager steps gather the loss with all_gather(sync_grads=True), which refuses to run under torch.compile
    ("regional_background", ["--backend", "eager", *BACKGROUND_ARGS]),
    ("full_background", ["--backend", "aot_eager", *BACKGROUND_ARGS]),
]
# Blocks of 3 MB under 1 MB buckets (DDP's smallest: DDPOptimizer wants the first bucket no larger than the rest)
BUCKETED = ["--backend", "eager_counted", "--width", "256", "--bucket-cap-mb", "1"]
SPLITS = [("regional", BUCKETED), ("regional", [*BUCKETED, "--split-at-buckets"])]
# rest: background (what regional's rest: auto takes on a GPU for the recipe's GPT): the blocks compiled at the first
# step, the embeddings and head on the thread, held until each rank's step as above. One length: a recompile of the
# blocks on the training thread at step 1 would overlap the thread's first compile, and Dynamo runs its start
# callbacks (the hold) only when no other compile is under way
REST_BACKGROUND = ("regional", ["--backend", "eager", "--rest", "background", "--fixed-length", *BACKGROUND_ARGS])
POLICY_IDS = ["regional", "full", "dynamic", "buckets", "optimizer", "optimizer_auto"] + [p for p, _ in POLICIES[6:]]
POLICY_IDS += ["regional_rest_background"]
RUNS = dict(zip(POLICY_IDS, [*POLICIES, REST_BACKGROUND])) | dict(zip(["buckets_unsplit", "buckets_split"], SPLITS))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Dict[str, tuple]:
    """Every policy of ``POLICIES`` trained on 1 process and under DDP (``single_and_ddp``), by its id."""
    directory = tmp_path_factory.mktemp("ddp")
    for side in ("single", "ddp"):
        (directory / side).mkdir()
    runs = {name: ["--policy", policy, *args] for name, (policy, args) in RUNS.items()}
    return single_and_ddp(directory, runs) | {"directory": directory}


@pytest.mark.parametrize("name", POLICY_IDS)
def test_ddp_trains_like_one_process(trained, name):
    policy, args = RUNS[name]
    single, ddp = trained[name]
    tmp_path = trained["directory"] / "ddp"
    assert_same_training(single, ddp)
    # Compiled in place inside the DDP wrapper: the graphs and recompiles of one process
    assert "regions compiled in place inside DistributedDataParallel" in ddp["output"]
    assert ddp["summary"]["unique_graphs"] == single["summary"]["unique_graphs"] > 0
    assert ddp["summary"]["recompiles"] == single["summary"]["recompiles"]
    # FLOPs counted during each rank's first step (its half of the batch), with no extra compile or call
    assert ddp["summary"]["flops_per_step"] == single["summary"]["flops_per_step"] / 2 > 0
    ranks = ddp["summary"]["ranks"]
    assert ranks["ranks"] == 2 and ranks["divergent_recompile_ranks"] == []
    assert ranks["recompiles_by_rank"] == [single["summary"]["recompiles"]] * 2
    assert 0 < ranks["compile_time_s_min"] <= ranks["compile_time_s_max"]
    assert ddp["output"].count("recompiles by rank") == 1  # printed once, by rank 0
    # No _orig_mod anywhere in the distributed run's checkpoint, model or optimizer state
    assert not [k for k in ddp["state_dict_keys"] if "_orig_mod" in k]
    assert ddp["optimizer_keys"] and not [k for k in ddp["optimizer_keys"] if "_orig_mod" in k]
    if "auto" in args:
        # every rank chose the same candidate, by the same (slowest over the ranks) times: replicas updated by
        # different kernels would drift apart
        choices = [json.loads((tmp_path / f"{name}.json.optimizer_choices.rank{rank}").read_text()) for rank in (0, 1)]
        assert len(choices[0]) == 1 and choices[0] == choices[1], choices
        assert set(choices[0][0]["step_ms"]) == {"fused", "foreach", "compiled"}
    elif "--optimizer" in args:
        # the compiled step chosen and installed, its gradients those DDP's reducer averaged (same weights above),
        assert "optimizer AdamW: compiled" in ddp["output"]
    if "--clip" in args:
        # clipping by norm inside it, of the gradients the reducer averaged: the one process's total norm
        assert ddp["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5) and single["grad_norms"][0] > 0
    if policy == "buckets":
        assert ddp["summary"]["buckets"] == [8, 16] and ddp["summary"]["padding_overhead"] > 0  # 12 padded to 16
    if "--compiled-from" in args:
        assert_ranks_switched_to_compiled_at_different_steps(tmp_path / f"{name}.json", ddp, "--rest" in args)


def test_graphs_are_split_at_ddp_buckets_only_when_the_policy_asks(trained):
    """Dynamo's DDPOptimizer sees the regions run inside DDP's forward: left on, it splits each block's graph at the
    bucket boundaries (more graphs handed to the backend than one process compiles); the policy turns it off."""
    single, ddp = trained["buckets_unsplit"]
    assert ddp["backend_compiles"] == single["backend_compiles"] > 0
    # (weights not compared: on this wider model AdamW turns float-order noise of near-zero gradients into 1e-3)
    assert ddp["losses"] == pytest.approx(single["losses"], abs=1e-5) == trained["buckets_split"][1]["losses"]
    single_split, ddp_split = trained["buckets_split"]
    assert single_split["backend_compiles"] == single["backend_compiles"], "one process has no DDP to split for"
    assert ddp_split["backend_compiles"] > 2 * single["backend_compiles"]


def assert_ranks_switched_to_compiled_at_different_steps(out: Path, ddp: dict, rest_only: bool) -> None:
    """Background under DDP: the eager steps ran beside the compile, each rank switched at its own step."""
    if rest_only:  # the parts around the blocks on the thread, the blocks compiled at the first step
        deferred = [row["module"] for row in ddp["plan"] if row["action"] == "regional rest (background)"]
        assert len(deferred) >= 2 and not [row for row in ddp["plan"] if row["action"] == "regional block (background)"]
        said = f"{', '.join(deferred)}: compiled on a background thread after the first step, eager until then"
        assert said in ddp["output"]
    else:
        assert "compiled on a background thread while the first steps run eagerly" in ddp["output"]
    assert ddp["gathered_while_compiling"] == [1], "the step's all_gather(sync_grads=True) ran inside the compile"
    by_rank = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(2)]
    assert [summary["background_eager_steps"] for summary in by_rank] == [2, 3]


def test_ddp_checkpoint_loads_into_eager_model_and_back(trained):
    sys.path.insert(0, str(ROOT / "tests"))
    from ddp_run import RecordingLM

    _, ddp = trained["regional"]  # the regional policy's DDP run saved its checkpoint
    checkpoint = torch.load(trained["directory"] / "ddp" / "regional.ckpt", weights_only=False)
    eager = RecordingLM(4, 4, 4)
    eager.load_state_dict(checkpoint["state_dict"])  # strict: every key matches an eager model's
    for name, param in eager.named_parameters():
        assert torch.allclose(param, torch.tensor(ddp["weights"][name])), name
    compiled = RecordingLM(4, 4, 4)
    applied = apply_policy(compiled, to_policy("regional", backend="eager"))
    compiled.load_state_dict(eager.state_dict())  # and back, into a compiled model
    assert list(compiled.state_dict()) == list(eager.state_dict())
    applied.remove()


def test_strategies_supported_and_refused():
    assert strategy_kind(DDPStrategy()) == "ddp"
    assert strategy_kind(ModelParallelStrategy()) == "fsdp2"
    assert strategy_kind(SingleDeviceStrategy(torch.device("cpu"))) == "single"
    refused = r"does not support FSDPStrategy \(FSDP1: .*FSDP2 takes the compiled blocks.*supported: .*'ddp'"
    with pytest.raises(PolicyError, match=refused):
        strategy_kind(FSDPStrategy())
    # DeepSpeed and XLA are DDPStrategy's subclasses in Lightning: refused all the same, by name before any rank starts
    for name, strategy in [("deepspeed", DeepSpeedStrategy), ("xla", XLAStrategy)]:
        with pytest.raises(PolicyError, match=f"does not support {strategy.__name__}; supported"):
            refuse_before_launch(name, to_policy("regional"))
    assert refuse_before_launch("ddp_spawn", to_policy("full")) is None


def test_callback_adopts_a_policy_applied_in_configure_model_and_refuses_another():
    from compile_trainer import CompileCallback
    from tests.conftest import quiet_cpu_trainer
    from tests.telemetry_models import TinyRegression

    class AppliesItself(TinyRegression):
        policy = None

        def configure_model(self):
            if getattr(self, "_compile_trainer_applied", None) is None:
                apply_policy(self, self.policy)

    callback = CompileCallback("regional", backend="eager", print_plan=False, telemetry=False)
    module = AppliesItself(n_batches=2)
    module.policy = callback.policy
    quiet_cpu_trainer(max_steps=2, callbacks=[callback]).fit(module)
    assert callback.applied is module._compile_trainer_applied  # adopted, not applied twice

    other = AppliesItself(n_batches=2)
    other.policy = to_policy("full", backend="eager")
    callback = CompileCallback("regional", backend="eager", print_plan=False, telemetry=False)
    with pytest.raises(PolicyError, match="configure_model applied policy 'full', but the CompileCallback holds"):
        quiet_cpu_trainer(max_steps=2, callbacks=[callback]).fit(other)
