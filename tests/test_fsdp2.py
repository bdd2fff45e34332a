"""FSDP2 through Lightning's ModelParallelStrategy on 2 CPU processes over gloo (tests/ddp_run.py --strategy fsdp2)."""

import sys

import pytest
import torch

from tests.test_distributed import (
    DDP_TIMEOUT,
    ROOT,
    SINGLE,
    TWO_RANKS,
    assert_same_training,
    finish_runs,
    start,
    start_runs,
)

AOT = ("full", "regional_nested", "full_background")  # compiled with aot_eager (nested regions need an AOT backend)
# every bundled policy; the background ones compile in the foreground under FSDP2 (lightning/strategies.py)
POLICIES = ["regional", "full", "dynamic", "buckets", "regional_split", "regional_nested", "reduce_overhead"]
POLICIES += ["max_autotune", "buckets_auto", "regional_background", "full_background"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Every policy trained on 1 process and under FSDP2 on 2, each side's runs in turn in one process (group),
    side by side."""
    directory = tmp_path_factory.mktemp("fsdp2")
    runs = {policy: ["--policy", policy, "--backend", "aot_eager" if policy in AOT else "eager"] for policy in POLICIES}
    sides = {"single": SINGLE, "fsdp": [*TWO_RANKS, "--strategy", "fsdp2"]}
    for side in sides:
        (directory / side).mkdir()
    started = {side: start_runs(directory / side, runs, *ranks) for side, ranks in sides.items()}
    finished = {side: finish_runs(process, directory / side, list(runs)) for side, process in started.items()}
    return {policy: (finished["single"][policy], finished["fsdp"][policy]) for policy in runs} | {"dir": directory}


@pytest.mark.parametrize("policy", POLICIES)
def test_fsdp2_model_parallel_strategy_trains_like_one_process(trained, policy):
    """FSDP2 through Lightning's ModelParallelStrategy on 2 CPU processes (gloo): the policy applied in
    configure_model before fully_shard, the callback adopting it; a sharded (distributed) checkpoint."""
    single, fsdp = trained[policy]
    tmp_path = trained["dir"] / "fsdp"
    assert_same_training(single, fsdp)
    assert "regions compiled in configure_model before fully_shard" in fsdp["output"]
    assert fsdp["summary"]["ranks"]["divergent_recompile_ranks"] == []
    # FSDP2's hooks are skipped by Dynamo: they run eagerly, one distinct break where a compiled frame calls them
    assert fsdp["summary"]["graph_breaks"] == single["summary"]["graph_breaks"] + 1
    if policy.endswith("_background"):  # no thread: a copy of an FSDP2 block cannot be made, its hooks are collectives
        assert "background: true, compiled in the foreground: under FSDP2" in fsdp["output"]
        assert "background_eager_steps" not in fsdp["summary"] and single["summary"]["background_eager_steps"] >= 1
    if policy.startswith("buckets"):  # warm-up off under FSDP2: each bucket compiles at its first batch, on every rank
        assert "shapes.warmup: off under FSDP2" in fsdp["output"]
        recompiles = fsdp["summary"]["ranks"]["recompiles_by_rank"]
        assert recompiles[0] == recompiles[1] >= 1 and single["summary"]["recompiles"] == 0
    assert (tmp_path / f"{policy}.ckpt").is_dir()  # a shard per rank
    assert not [k for k in fsdp["state_dict_keys"] + fsdp["optimizer_keys"] if "_orig_mod" in k]
    sys.path.insert(0, str(ROOT / "tests"))
    from ddp_run import RecordingLM

    eager = RecordingLM(4, 4, 4)  # the sharded checkpoint, gathered into one file, loads into an eager model
    eager.load_state_dict(torch.load(tmp_path / f"{policy}.pt", weights_only=False)["state_dict"])
    for name, param in eager.named_parameters():
        assert torch.allclose(param, torch.tensor(fsdp["weights"][name])), name


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """Two FSDP2 runs that must be refused before training, side by side: (exit status, output, out written)."""
    directory = tmp_path_factory.mktemp("refused")
    runs = {"no_apply": ["--no-apply"], "optimizer": ["--optimizer", "true"]}
    started = {
        name: start(directory / f"{name}.json", *TWO_RANKS, "--strategy", "fsdp2", *args) for name, args in runs.items()
    }
    results = {}
    for name, process in started.items():
        output, _ = process.communicate(timeout=DDP_TIMEOUT)
        results[name] = (process.returncode, output, (directory / f"{name}.json").exists())
    return results


def test_fsdp2_without_the_policy_applied_in_configure_model_is_refused(refused):
    returncode, output, written = refused["no_apply"]
    assert returncode != 0 and not written
    assert "policy 'regional' was not applied before sharding" in output
    assert "call compile_trainer.apply_policy(self, policy) first, then fully_shard" in output


def test_fsdp2_compiled_optimizer_step_refuses_dtensor_parameters_with_the_fix(refused):
    """The flat-buffer optimizer step cannot take FSDP2's DTensor shards: a clear error, not a wrong update."""
    returncode, output, written = refused["optimizer"]
    assert returncode != 0 and not written
    assert "parameters of tensor subclasses (DTensor" in output and "optimizer.compile=false" in output
