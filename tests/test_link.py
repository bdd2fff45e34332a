"""The link engine: bus bandwidth and its interpolation, the communication a step moves under DDP and FSDP2 against
hand-computed numbers, the faster settings named, ``nvidia-smi topo -m`` parsed; the probe, ``fsdp2_units`` and
``compile_and_shard``'s record in a real 2-process gloo group."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from compile_trainer.telemetry.communication import (
    Fsdp2Settings,
    LinkPlan,
    ModelShape,
    ddp_step,
    format_link_plan,
    fsdp2_step,
    probe_requests,
)
from compile_trainer.telemetry.link import LinkProbe, Measurement, bus_factor, parse_topology

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def flat_probe(world: int, **busbw: float) -> LinkProbe:
    """A probe whose collectives run at one bus bandwidth each (GB/s) at every size."""
    return LinkProbe(world, "test", [Measurement(c, "float32", 10**6, 1.0, rate * GB) for c, rate in busbw.items()])


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 0.75


def test_bus_bandwidth_is_interpolated_on_the_size_and_held_beyond_the_sizes_measured():
    points = [Measurement("all_gather", "bfloat16", size, 1.0, rate * GB) for size, rate in ((10**6, 10), (10**8, 100))]
    probe = LinkProbe(2, "test", points)
    assert probe.busbw("all_gather", 10**7) == pytest.approx(55 * GB)  # halfway on a log scale
    assert probe.busbw("all_gather", 10**5) == 10 * GB and probe.busbw("all_gather", 10**9) == 100 * GB
    assert probe.busbw("all_gather", 10**7, "float32") == pytest.approx(55 * GB)  # no float32: every dtype's
    # 2 ranks: an all-gather puts half of the message through each link
    assert probe.seconds("all_gather", 10**8) == pytest.approx(0.5 * 10**8 / (100 * GB))
    assert probe.busbw("all_reduce", 10**7) is None and probe.seconds("all_reduce", 10**7) is None


def test_ddp_step_all_reduces_the_gradients_in_buckets_filled_from_the_last_parameter():
    # fp32, registration order a, b, c, d; backward fills from d: d (0.8 MB) < 1 MiB, + c (32 MB) closes the first
    # bucket at 32.8 MB; then b + a = 1.6 MB, under 25 MiB, the last bucket: the first parameters', nothing to overlap
    shape = ModelShape([300_000, 100_000, 8_000_000, 200_000], "float32", world_size=4)
    step = ddp_step(shape)
    assert [(m.collective, m.bytes, m.serial) for m in step.messages] == [
        ("all_reduce", 32_800_000, False),
        ("all_reduce", 1_600_000, True),
    ]
    assert step.bytes == 4 * 8_600_000 and step.link_bytes() == pytest.approx(1.5 * 34_400_000)
    probe = flat_probe(4, all_reduce=100)
    assert step.seconds(probe) == pytest.approx(34_400_000 * 1.5 / (100 * GB))  # 0.516 ms
    assert step.seconds(probe, serial_only=True) == pytest.approx(1_600_000 * 1.5 / (100 * GB))


def test_fsdp2_step_gathers_each_unit_twice_unless_it_stays_gathered_and_reduce_scatters_once():
    settings = Fsdp2Settings("bfloat16", "float32", reshard_after_forward=True, reshard_last_block=False)
    shape = ModelShape([1000, 900], "float32", world_size=4, units=[1000, 300, 300, 300], fsdp2=settings)
    step = fsdp2_step(shape)
    # the root: gathered once (2000 B), reduced (4000 B), both serial; blocks 0 and 1 gathered twice; the last once
    assert step.bytes_by_collective() == {"all_gather": 2000 + 600 * 5, "reduce_scatter": 4000 + 1200 * 3}
    assert [m.bytes for m in step.messages if m.serial] == [2000, 4000]
    probe = flat_probe(4, all_gather=50, reduce_scatter=25)
    assert step.seconds(probe) == pytest.approx(5000 * 0.75 / (50 * GB) + 7600 * 0.75 / (25 * GB))  # 303 ns
    assert step.seconds(probe, serial_only=True) == pytest.approx(2000 * 0.75 / (50 * GB) + 4000 * 0.75 / (25 * GB))
    kept = fsdp2_step(shape, Fsdp2Settings("bfloat16", "float32", reshard_after_forward=False))
    assert kept.bytes_by_collective()["all_gather"] == 2000 + 600 * 3


def test_an_all_reduce_is_a_reduce_scatter_and_an_all_gather_on_the_link():
    """DDP's fp32 all-reduce and FSDP2 gathering bf16 (twice) and reducing fp32 put the same bytes through the link;
    FSDP2 without a mixed-precision policy 1.5 times as many, without resharding 0.75 times (a root with no
    parameters of its own: every unit resharded)."""
    blocks = [3000, 3000, 4000]
    ddp = ddp_step(ModelShape(blocks, "float32", 4)).link_bytes()
    for settings, ratio in [
        (Fsdp2Settings("bfloat16", "float32"), 1.0),
        (Fsdp2Settings("float32", "float32"), 1.5),
        (Fsdp2Settings("bfloat16", "float32", reshard_after_forward=False), 0.75),
    ]:
        shape = ModelShape(blocks, "float32", 4, units=[0, *blocks], fsdp2=settings)
        assert fsdp2_step(shape).link_bytes() == pytest.approx(ratio * ddp)


def plan(settings, memory=None, compute_s=None) -> LinkPlan:
    numels = [40_000_000] + [7_000_000] * 12  # GPT-2 small's shape: the root, 12 blocks
    shape = ModelShape(numels, "float32", 2, units=numels, fsdp2=settings, device_memory_bytes=memory)
    probe = flat_probe(2, all_reduce=200, all_gather=200, reduce_scatter=200)
    return LinkPlan("fsdp2", shape, probe, "NV18", compute_s)


def test_fsdp2_plan_names_mixed_precision_ddp_and_no_reshard_fastest_first():
    # FSDP2's defaults on GPT-2 small, 2 ranks, 200 GB/s: fp32 gathers 496 + 336 MB, reduces 496 MB: 3.32 ms
    current = plan(Fsdp2Settings("float32", "float32", assumed=True), memory=141 * GB)
    assert current.current.seconds(current.probe) == pytest.approx(1328e6 * 0.5 / (200 * GB))
    faster = current.faster()
    assert [s.setting for s in faster] == [MIXED, "DDP (trainer=gpu_ddp)", "reshard_after_forward=False"]
    # bf16 gathers 248 + 168 MB: 2.28 ms; DDP's fp32 all-reduce of 496 MB and no reshard's 496 + 496 MB: 2.48 ms
    assert [s.seconds for s in faster] == pytest.approx([912e6 * 0.5 / (200 * GB), 2.48e-3, 2.48e-3])
    assert "16 B a parameter: 1.98 GB) fits" in faster[1].why
    # the 12 blocks' 336 MB gathered again in the backward stay gathered instead, less this rank's half
    assert "for 168 MB more memory a rank" in faster[2].why


MIXED = "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)"


def test_ddp_is_not_named_where_its_state_does_not_fit_and_a_larger_batch_where_the_link_dominates():
    settings = Fsdp2Settings("bfloat16", "float32", reshard_last_block=False)
    small = plan(settings, memory=2 * GB).faster()  # 1.98 GB of state in half of 2 GB: no
    assert [s.setting for s in small] == ["reshard_after_forward=False"]
    link_bound = plan(settings, memory=2 * GB, compute_s=0.5e-3)
    seconds = link_bound.current.seconds(link_bound.probe)
    assert seconds == pytest.approx((124e6 * 2 + 84e6 * 2 - 7e6 * 2 + 124e6 * 4) * 0.5 / (200 * GB))
    batch = [s for s in link_bound.faster() if s.setting.startswith("a batch")]
    assert batch and batch[0].setting == f"a batch {-(-seconds // 0.5e-3):.0f}x larger a rank"
    text = format_link_plan(link_bound)
    assert text.startswith("link: 2 ranks over test (NV18): all-reduce 200 GB/s, all-gather 200 GB/s")
    assert "fsdp2 (bf16 parameters, fp32 reduction, reshard after forward (not the last block))" in text
    assert "898 MB a step (all-gather 402 MB, reduce-scatter 496 MB), 2.25 ms at these rates" in text
    assert "0.6 ms of it with nothing to overlap (the root's all-gather and reduce-scatter)" in text
    assert "faster: reshard_after_forward=False" in text
    assert json.dumps(link_bound.as_dict())  # the summary's entry: plain JSON


def test_probe_requests_take_the_sizes_that_carry_the_most_bytes_capped():
    settings = Fsdp2Settings("bfloat16", "float32")
    shape = ModelShape([1], "float32", 2, units=[5_000_000, 1_000_000, 1_000_000, 1_000_000], fsdp2=settings)
    requests = probe_requests([fsdp2_step(shape)], max_bytes=8_000_000, sizes_per_collective=2)
    assert requests == [
        ("all_gather", "bfloat16", 2_000_000),  # a block's 2 MB, gathered 6 times
        ("all_gather", "bfloat16", 8_000_000),  # the root's 10 MB, capped
        ("reduce_scatter", "float32", 4_000_000),
        ("reduce_scatter", "float32", 8_000_000),
    ]


TOPOLOGY = """\x1b[4m\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tSYS\tPXB\t0-63\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tSYS\t0-63\t0\t\tN/A
GPU2\tSYS\tNV18\t X \tSYS\t64-127\t1\t\tN/A
NIC0\tPXB\tSYS\tSYS\t X

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_topology_matrix_parsed_into_gpu_pairs():
    topology = parse_topology(TOPOLOGY)
    assert topology["gpus"] == 3
    assert topology["links"] == {"GPU0-GPU1": "NV18", "GPU0-GPU2": "SYS", "GPU1-GPU2": "NV18"}
    assert topology["summary"] == "GPU0-GPU1 NV18, GPU0-GPU2 SYS, GPU1-GPU2 NV18"
    assert "Legend" not in topology["matrix"] and "NIC0" in topology["matrix"]
    two = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-63\nGPU1\tNV18\t X \t0-63\n"
    assert parse_topology(two)["summary"] == "NV18 between every pair of 2 GPUs"
    assert parse_topology("No devices were found") is None


GLOO_RUN = r"""
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from compile_trainer.telemetry.communication import FSDP2_SETTINGS_ATTR, fsdp2_units
from compile_trainer.telemetry.link import grid, probe_link
from compile_trainer_recipes.gpt import GPT, GPTConfig, compile_and_shard

rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=rank, world_size=2)
probe = probe_link(grid(["all_reduce", "all_gather", "reduce_scatter"], ["bfloat16", "float32"], [4096, 65536]))
torch.manual_seed(0)
holder = nn.Module()
holder.model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16))
sizes = [sum(p.numel() for p in block.parameters()) for block in holder.model.blocks]
total = holder.model.num_params()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
compile_and_shard(holder, holder.model, None, init_device_mesh("cpu", (2,)), mp_policy=mp, forward_prefetch=1)
out = dict(probe=probe.as_dict(), units=fsdp2_units(holder), blocks=sizes, total=total)
out["settings"] = vars(getattr(holder, FSDP2_SETTINGS_ATTR))
with open(f"{sys.argv[3]}.rank{rank}", "w") as file:
    json.dump(out, file)
dist.destroy_process_group()
"""


def test_probe_link_and_fsdp2_units_in_a_2_process_gloo_group(tmp_path):
    """Every rank gets the same figures (the slowest rank's times); fully_shard's units are the blocks and the rest;
    compile_and_shard records what it did (the last block kept gathered)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", GLOO_RUN, str(port)]
    ranks = [subprocess.Popen([*command, str(r), str(tmp_path / "out")], env=env, cwd=ROOT) for r in (0, 1)]
    assert [rank.wait(timeout=240) for rank in ranks] == [0, 0]
    results = [json.loads((tmp_path / f"out.rank{rank}").read_text()) for rank in (0, 1)]
    assert results[0]["probe"] == results[1]["probe"]
    measurements = results[0]["probe"]["measurements"]
    assert len(measurements) == 12 and all(m["seconds"] > 0 and m["busbw"] > 0 for m in measurements)
    assert {m["bytes"] for m in measurements} == {4096, 65536}  # divisible by 2 ranks in both dtypes
    assert results[0]["units"] == [results[0]["total"] - sum(results[0]["blocks"]), *results[0]["blocks"]]
    assert results[0]["settings"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "reshard_after_forward": True,
        "reshard_last_block": False,
        "forward_prefetch": 1,
        "assumed": False,
    }


ONE_RANK_CANNOT_PROBE = r"""
import json, os, sys
import lightning.pytorch as pl
import torch
from torch import nn
from compile_trainer import CompileCallback
from compile_trainer.lightning import strategies

if os.environ.get("LOCAL_RANK") == "1":  # a fault on rank 1 alone, while it prepares the probe
    def cannot_read_the_model(*args, **kwargs):
        raise RuntimeError("rank 1 cannot read the model")
    strategies.model_shape = cannot_read_the_model


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
        return torch.utils.data.DataLoader(data, batch_size=4)


callback = CompileCallback("full", backend="eager", print_plan=False)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, callbacks=[callback])
trainer.fit(Regression())
with open(f"{sys.argv[1]}.rank{trainer.global_rank}", "w") as file:
    json.dump({"link": callback.link is not None, "steps": trainer.global_step}, file)
"""


def test_probe_link_skipped_on_every_rank_when_one_cannot_prepare_it_gloo_group(tmp_path):
    """A rank that fails before the probe's collectives makes every rank skip them, with a warning on each: none
    waits alone in a collective, and the fit goes on."""
    script = tmp_path / "fit.py"
    script.write_text(ONE_RANK_CANNOT_PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads((tmp_path / f"out.rank{rank}").read_text()) for rank in (0, 1)]
    assert results == [{"link": False, "steps": 2}] * 2
    output = run.stdout + run.stderr
    assert "rank 1: link probe skipped (RuntimeError: rank 1 cannot read the model)" in output
    assert "link probe skipped (another rank could not prepare it: its log says why)" in output
