"""FSDP2 through Lightning's ModelParallelStrategy on 2 CPU processes over gloo (tests/ddp_run.py --strategy fsdp2)."""

import sys

import pytest
import torch

from tests.test_distributed import DDP_TIMEOUT, ROOT, assert_same_training, finish, start

AOT = ("full", "regional_nested", "full_background")  # compiled with aot_eager (nested regions need an AOT backend)
# every bundled policy; the background ones compile in the foreground under FSDP2 (lightning/strategies.py)
POLICIES = ["regional", "full", "dynamic", "buckets", "regional_split", "regional_nested", "reduce_overhead"]
POLICIES += ["max_autotune", "buckets_auto", "regional_background", "full_background"]


@pytest.mark.parametrize("policy", POLICIES)
def test_fsdp2_model_parallel_strategy_trains_like_one_process(tmp_path, policy):
    """FSDP2 through Lightning's ModelParallelStrategy on 2 CPU processes (gloo): the policy applied in
    configure_model before fully_shard, the callback adopting it; a sharded (distributed) checkpoint."""
    args = ["--policy", policy, "--backend", "aot_eager" if policy in AOT else "eager"]
    single = start(tmp_path / "single.json", "--devices", "1", "--batch", "4", *args)
    fsdp = start(tmp_path / "fsdp.json", "--devices", "2", "--batch", "2", "--strategy", "fsdp2", *args)
    single, fsdp = finish(single, tmp_path / "single.json"), finish(fsdp, tmp_path / "fsdp.json")
    assert_same_training(single, fsdp)
    assert "regions compiled in configure_model before fully_shard" in fsdp["output"]
    assert fsdp["summary"]["ranks"]["divergent_recompile_ranks"] == []
    # FSDP2's hooks are skipped by Dynamo: they run eagerly, one distinct break where a compiled frame calls them
    assert fsdp["summary"]["graph_breaks"] == single["summary"]["graph_breaks"] + 1
    if policy.endswith("_background"):  # no thread: a copy of an FSDP2 block cannot be made, its hooks are collectives
        assert "background: true, compiled in the foreground: under FSDP2" in fsdp["output"]
        assert "background_eager_steps" not in fsdp["summary"] and single["summary"]["background_eager_steps"] >= 1
    if policy == "buckets":  # static graphs per bucket: no recompile on any rank
        assert fsdp["summary"]["ranks"]["recompiles_by_rank"] == [0, 0]
    assert (tmp_path / "fsdp.ckpt").is_dir()  # a shard per rank
    assert not [k for k in fsdp["state_dict_keys"] + fsdp["optimizer_keys"] if "_orig_mod" in k]
    sys.path.insert(0, str(ROOT / "tests"))
    from ddp_run import RecordingLM

    eager = RecordingLM(4, 4, 4)  # the sharded checkpoint, gathered into one file, loads into an eager model
    eager.load_state_dict(torch.load(tmp_path / "fsdp.pt", weights_only=False)["state_dict"])
    for name, param in eager.named_parameters():
        assert torch.allclose(param, torch.tensor(fsdp["weights"][name])), name


def test_fsdp2_without_the_policy_applied_in_configure_model_is_refused(tmp_path):
    out = tmp_path / "fsdp.json"
    process = start(out, "--devices", "2", "--batch", "2", "--strategy", "fsdp2", "--no-apply")
    output, _ = process.communicate(timeout=DDP_TIMEOUT)
    assert process.returncode != 0 and not out.exists()
    assert "policy 'regional' was not applied before sharding" in output
    assert "call compile_trainer.apply_policy(self, policy) first, then fully_shard" in output


def test_fsdp2_compiled_optimizer_step_refuses_dtensor_parameters_with_the_fix(tmp_path):
    """The flat-buffer optimizer step cannot take FSDP2's DTensor shards: a clear error, not a wrong update."""
    out = tmp_path / "fsdp.json"
    process = start(out, "--devices", "2", "--batch", "2", "--strategy", "fsdp2", "--optimizer", "true")
    output, _ = process.communicate(timeout=DDP_TIMEOUT)
    assert process.returncode != 0 and not out.exists()
    assert "parameters of tensor subclasses (DTensor" in output and "optimizer.compile=false" in output
