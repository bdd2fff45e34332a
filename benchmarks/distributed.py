"""Compile policies under DDP and FSDP2: 1 vs N GPUs, ``regional`` vs ``full``, the recipe's GPT-2 small and an HF
Llama; global samples/s, each rank's first step, recompiles, peak memory and diverging ranks (docs/distributed.md).
Weak scaling: each rank trains ``--batch`` samples a step (a list: each batch a row). FSDP2 as
``compile_trainer_recipes.gpt.compile_and_shard`` does it (torchtitan's order, a ``MixedPrecisionPolicy``), its
settings measured side by side (``--fsdp-param-dtypes``, ``--fsdp-reshard``, ``--fsdp-prefetch``).

Each row on N GPUs also measures the link in its own job, after training: all-reduce, all-gather and reduce-scatter
bus bandwidth at the message sizes its step moves, in bf16 and fp32 (``compile_trainer.telemetry.link``); from them
its communication a step (``comm_mb``) and the time the link makes of it (``comm_ms``, of it ``serial_ms`` with
nothing to overlap), and, from a profile of 3 steps on rank 0 (GPU), where the step's GPU time went
(``gpu_timeline_ms_a_step``: busy kernels, NCCL's, the overlap, idle), where its host time went, from a profile of
3 steps before (``host_ms_a_step``: wall, FSDP2's hooks, the ops with the most self time; on the CPU too), and how
far the step is from the link's limit
(``vs_limit``: the step against the larger of compute + the serial messages and the whole communication).
``--experiments`` adds ``collectives`` (ranks of different first lengths, ``distributed.consistent_dynamic_shapes``
off and on) and ``cache`` (each strategy's ``regional`` row writes a bundle, a run with empty local caches loads
it). Each run a fresh Lightning job of N processes with empty Inductor/Triton caches:

    python benchmarks/distributed.py --models gpt2 --experiments scaling,cache --policies regional --strategies ddp

CPU smoke run (2 gloo processes, tiny models, aot_eager; no collectives: gloo refuses compiler collectives):

    python benchmarks/distributed.py --smoke --out /tmp/distributed.json
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from benchmarks.host_profile import HOST_STEPS, HostProfiledSteps  # noqa: E402
from compile_trainer import CompileCallback  # noqa: E402
from compile_trainer.lightning.strategies import model_shape, strategy_kind  # noqa: E402
from compile_trainer.telemetry.communication import LinkPlan, step_communication  # noqa: E402
from compile_trainer.telemetry.link import COLLECTIVES, gpu_topology, grid, probe_link  # noqa: E402
from compile_trainer_recipes.gpt import GPT, GPTConfig, compile_and_shard  # noqa: E402

SMOKE_GPT2 = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
SEQUENCE, SMOKE_SEQUENCE = 1024, 16  # tokens a sample (the Llama: real_models.py's, use_cache=False)
LENGTHS = (512, 768, 1024)  # the collectives experiment's lengths (a quarter of them with --smoke)
CACHE_FIELDS = "status precompiled_hits precompiled_misses precompiled_captures precompiled_load_s precompiled_skipped"
PROFILED_STEPS = 3  # profiled on rank 0 near the end of each run on GPUs (gpu_timeline_ms_a_step)


class Benchmarked(pl.LightningModule):
    """The model's LightningModule; under FSDP2 its ``configure_model`` applies the callback's policy, then shards
    each block and the root (torchtitan's order)."""

    def __init__(self, args: argparse.Namespace, callback: Any) -> None:
        super().__init__()
        self.args, self.policy = args, callback.policy
        if args.model == "gpt2":
            config = GPTConfig(**SMOKE_GPT2) if args.smoke else models.GPT2_SMALL
            self.model, self.vocab = GPT(config), config.vocab_size
        else:
            self.model, _, self.vocab = models.build_model("llama", args.smoke)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        if self.args.model == "gpt2":
            return self.model(inputs, targets)[1]
        return self.model(input_ids=inputs, labels=targets).loss

    def configure_optimizers(self):
        # fused on a GPU, as users configure it: under FSDP2 the default foreach update dispatches each op once per
        # DTensor parameter, which left the GPU idle for most of a step (2 x H200, 2026-11-28)
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=torch.cuda.is_available())

    def configure_model(self) -> None:
        if self.args.strategy != "fsdp2":
            return
        args = self.args
        mixed = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.param_dtype == "bf16" else {}
        compile_and_shard(
            self, self.model, self.policy if self.policy.compiles_modules else None, self.device_mesh["data_parallel"],
            mp_policy=MixedPrecisionPolicy(**mixed), reshard_after_forward=args.reshard, forward_prefetch=args.prefetch,
            blocks=self.model.blocks if args.model == "gpt2" else self.model.model.layers,
        )  # fmt: skip

    def train_dataloader(self):
        pin = torch.cuda.is_available() and not self.args.smoke  # as a GPU user's loader does
        data = batches(self.args, self.vocab, self.global_rank)
        return torch.utils.data.DataLoader(data, batch_size=None, pin_memory=pin)


def batches(args: argparse.Namespace, vocab: int, rank: int) -> List[Any]:
    """``args.steps`` batches of random tokens for this rank (its own: no distributed sampler). The collectives
    experiment gives each rank lengths of its own, the first ones different on every rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    lengths = [SMOKE_SEQUENCE if args.smoke else SEQUENCE] * args.steps
    if args.experiment.startswith("collectives"):
        choices = [n // 64 if args.smoke else n for n in LENGTHS]
        lengths = [choices[(rank + step) % len(choices)] for step in range(args.steps)]
    tokens = [torch.randint(0, vocab, (args.batch, n + 1), generator=generator) for n in lengths]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def measure(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """One training job (every rank runs this); rank 0's row."""
    on_gpu = torch.cuda.is_available() and not args.smoke
    overrides: Dict[str, Any] = {"backend": "aot_eager"} if args.smoke else {}
    overrides |= {"distributed": {"consistent_dynamic_shapes": True}} if args.collectives else {}
    overrides |= {"cache": {"dir": args.cache_dir}} if args.cache_dir else {}
    telemetry = {"measure_flops": False, "link_probe": False}  # the row probes the link itself, at more sizes
    callback = CompileCallback(args.policy, print_plan=False, telemetry=telemetry, **overrides)
    torch.manual_seed(0)
    module = Benchmarked(args, callback)
    strategies = {"ddp": DDPStrategy, "fsdp2": lambda: ModelParallelStrategy(args.gpus, tensor_parallel_size=1)}
    strategy = strategies.get(args.strategy, lambda: "auto")()
    profiled = ProfiledSteps(args.steps - PROFILED_STEPS - 1, args.profile_dir) if on_gpu else None
    host = HostProfiledSteps(args.steps - PROFILED_STEPS - 1 - HOST_STEPS)  # before the GPU's window
    link = LinkAtTrainEnd() if args.gpus > 1 else None
    trainer = common.quiet_trainer(
        torch.device("cuda" if on_gpu else "cpu"), devices=args.gpus, strategy=strategy,
        max_steps=args.steps, callbacks=[callback, *filter(None, [profiled, host, link])],
        precision="bf16-mixed" if on_gpu else "32-true", use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module)
    row = result_row(args, callback.summary()) if trainer.global_rank == 0 else None
    timeline = profiled.timeline if profiled else None
    if row is not None:
        row |= {"gpu_timeline_ms_a_step": timeline, "compute_ms": timeline["busy"] if timeline else None}
        row |= {"host_ms_a_step": host.breakdown}
    if row is not None and link is not None:
        row |= link_columns(link.plan, row["compute_ms"])
    if torch.distributed.is_initialized():
        # Every rank leaves the group before exiting: left to interpreter teardown, gloo's threads have aborted
        # a rank ("terminate called without an active exception", once in a CI rehearsal).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return row


class ProfiledSteps(pl.Callback):
    """Rank 0's GPU kernels over ``PROFILED_STEPS`` steps from step ``first`` (torch.profiler), read into
    ``timeline`` (``gpu_timeline``); the trace is kept in ``folder`` when given."""

    def __init__(self, first: int, folder: Optional[str]) -> None:
        self.first, self.folder = max(first, 1), folder
        self.profiler: Any = None
        self.timeline: Optional[Dict[str, Any]] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.first and trainer.global_rank == 0:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.profiler is None or batch_idx != self.first + PROFILED_STEPS - 1:
            return
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(self.folder or scratch)
            folder.mkdir(parents=True, exist_ok=True)
            trace = folder / f"rank0-{trainer.strategy.__class__.__name__}-{trainer.world_size}gpu.trace.json"
            self.profiler.export_chrome_trace(str(trace))
            self.timeline = gpu_timeline(json.loads(trace.read_text())["traceEvents"], PROFILED_STEPS)
        self.profiler = None


def gpu_timeline(events: List[Dict[str, Any]], steps: int) -> Dict[str, Any]:
    """A profiled step's GPU time in ms from a Chrome trace's events: ``busy`` (kernels, copies and sets other than
    NCCL's), ``nccl`` (NCCL's kernels, waiting for the peer included; ``nccl_by_collective``), ``overlapped`` (NCCL's
    beside other kernels), ``exposed`` (NCCL's alone) and ``idle`` (no kernel), over the ``span`` from the first
    kernel to the last."""
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        return {}
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in kernels]
    nccl = union([(start, end) for start, end, name in spans if "nccl" in name.lower()])
    busy = union([(start, end) for start, end, name in spans if "nccl" not in name.lower()])
    both = union(nccl + busy)
    overlapped = length(nccl) + length(busy) - length(both)
    span = both[-1][1] - both[0][0]
    per_step = dict(span=span, busy=length(busy), nccl=length(nccl), overlapped=overlapped)
    per_step |= dict(exposed=length(nccl) - overlapped, idle=span - length(both))
    timeline: Dict[str, Any] = {key: round(us / 1e3 / steps, 4) for key, us in per_step.items()}
    names = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "all_reduce": "allreduce"}
    timeline["nccl_by_collective"] = {
        collective: round(length(union([(a, b) for a, b, name in spans if key in name.lower()])) / 1e3 / steps, 4)
        for collective, key in names.items()
    }
    return timeline


def union(spans: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Intervals merged where they overlap, in order."""
    merged: List[Tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(spans: List[Tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


class LinkAtTrainEnd(pl.Callback):
    """The row's link, probed in its own job when training ends (every rank; before Lightning's teardown moves the
    model off its device): the three collectives in bf16 and fp32 at each message size the row's step moves (sizes
    within 10% of another probed once), and the GPU topology; ``plan``."""

    plan: Optional[LinkPlan] = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kind = strategy_kind(trainer.strategy)
        shape = model_shape(trainer, pl_module, kind)
        sizes: List[int] = []
        for size in sorted({m.bytes for m in step_communication(kind, shape).messages}):
            sizes += [size] if not sizes or size > 1.1 * sizes[-1] else []
        requests = grid(COLLECTIVES, ["bfloat16", "float32"], sizes)
        probe = probe_link(requests, trainer.strategy.root_device, warmup=3, iterations=10)
        topology = gpu_topology() if trainer.global_rank == 0 else None
        self.plan = LinkPlan(kind, shape, probe, topology["summary"] if topology else None)


def link_columns(plan: LinkPlan, compute_ms: Optional[float]) -> Dict[str, Any]:
    """The row's communication a step, the time the measured link makes of it, and the settings the link model names
    faster at the row's compute (the profile's busy time; ``vs_limit`` is set in ``compare_to_one``)."""
    step = plan.current
    plan.compute_s = compute_ms / 1e3 if compute_ms else None
    comm, serial = step.seconds(plan.probe), step.seconds(plan.probe, serial_only=True)
    heaviest = {m.collective: m for m in sorted(step.messages, key=lambda m: m.bytes)}
    return {
        "comm_mb": round(step.bytes / 1e6, 1),
        "comm_ms": round(comm * 1e3, 4) if comm is not None else None,
        "serial_ms": round(serial * 1e3, 4) if serial is not None else None,
        "busbw_gbps": {c: round(plan.probe.busbw(c, m.bytes, m.dtype) / 1e9, 1) for c, m in heaviest.items()},
        "faster": [suggestion.setting for suggestion in plan.faster()],
        "link": plan.as_dict(),
    }


def result_row(args: argparse.Namespace, summary: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0's row: throughput over all ranks (from the slowest rank's median steady step, and from the mean),
    and each rank's median step, first step, recompiles, graphs and peak memory."""
    ranks = summary.get("ranks") or {}  # several ranks: each one's figures (one device: the summary's own)

    def by_rank(key: str, single: Optional[str] = None) -> Optional[List[Any]]:
        return ranks.get(f"{key}_by_rank") if ranks else [summary.get(single or key)]

    medians = by_rank("steady_step_time_median_s") or [None]
    per_rank = summary.get("steady_samples_per_s")
    return {
        # every rank steps together: the slowest rank's median step sets the pace
        "samples_per_s": args.batch * args.gpus / max(medians) if None not in medians else None,
        "samples_per_s_mean": per_rank * args.gpus if per_rank else None,
        "step_ms_median_by_rank": [round(m * 1e3, 2) if m else None for m in medians],
        "first_step_s_by_rank": by_rank("first_step_time_s"),
        "recompiles_by_rank": by_rank("recompiles"),
        "divergent_ranks": ranks.get("divergent_recompile_ranks", []),
        "graphs_by_rank": by_rank("graphs", "unique_graphs"),
        "peak_memory_gb_by_rank": [round(m / 2**30, 2) if m else None for m in by_rank("peak_memory_bytes") or []],
        "compile_s_max": ranks.get("compile_time_s_max", summary.get("compile_time_s")),
        "cache": {key: summary.get(f"cache_{key}") for key in CACHE_FIELDS.split()} if args.cache_dir else None,
        "error": None,
    }


def compare_to_one(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Each scaling row's throughput and slowest first step against the same (model, policy, batch) on one device
    (the goal: >= 1.9x on two GPUs, first step <= 1.1x); a warm cache row's first steps against its cold row's; each
    row on N GPUs against the link's limit (``link_columns``)."""
    ok = [r for r in rows if not r.get("error")]
    single = {(r["model"], r["policy"], r["batch"]): r for r in ok if r["gpus"] == 1}
    cold = {
        (r["model"], r["strategy"], r["policy"], r["batch"]): r
        for r in ok
        if r["experiment"] == "scaling" and r.get("cache")
    }
    for row in rows:
        if row["experiment"] not in ("scaling", "cache") or row.get("error"):
            continue
        one = single.get((row["model"], row["policy"], row["batch"]))
        base = (
            cold.get((row["model"], row["strategy"], row["policy"], row["batch"]))
            if row["experiment"] == "cache"
            else one
        )
        throughput = base and row.get("samples_per_s") and base.get("samples_per_s")
        row["scaling_vs_1"] = row["samples_per_s"] / base["samples_per_s"] if throughput else None
        first = base and row.get("first_step_s_by_rank") and base.get("first_step_s_by_rank")
        row["first_step_vs_1"] = max(row["first_step_s_by_rank"]) / max(base["first_step_s_by_rank"]) if first else None
        compute = row.get("compute_ms") or (max(one["step_ms_median_by_rank"]) if one else None)
        if row["gpus"] > 1 and row.get("comm_ms") is not None and compute and None not in row["step_ms_median_by_rank"]:
            row["limit_ms"] = round(max(compute + (row["serial_ms"] or 0), row["comm_ms"]), 3)
            row["vs_limit"] = max(row["step_ms_median_by_rank"]) / row["limit_ms"]
    return rows


def fsdp_settings(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The FSDP2 settings each FSDP2 row runs: every parameter dtype, reshard and prefetch asked for."""
    settings = []
    for dtype in args.fsdp_param_dtypes.split(","):
        for reshard in args.fsdp_reshard.split(","):
            for prefetch in map(int, str(args.fsdp_prefetch).split(",")):
                label = (
                    f"{dtype}/fp32"
                    + ("" if reshard == "true" else " no-reshard")
                    + (f" prefetch {prefetch}" * bool(prefetch))
                )
                settings.append(
                    {"fsdp": label, "_param_dtype": dtype, "_reshard": reshard == "true", "_prefetch": prefetch}
                )
    return settings


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Per model and batch: each policy on one device and under each strategy on N (FSDP2 under each of its
    settings), the cache's warm run for each strategy, the collectives'."""
    n = args.gpus or (2 if args.smoke else torch.cuda.device_count())
    if n < 1:
        raise SystemExit("needs a GPU (one: the one-device rows alone); --smoke runs 2 CPU processes")
    if set(args.strategies.split(",")) - {"ddp", "fsdp2"}:
        raise SystemExit(f"unknown strategies in {args.strategies!r}: ddp or fsdp2")
    if set(args.fsdp_param_dtypes.split(",")) - {"bf16", "fp32"} or set(args.fsdp_reshard.split(",")) - {
        "true",
        "false",
    }:
        raise SystemExit("--fsdp-param-dtypes takes bf16 and/or fp32, --fsdp-reshard true and/or false")
    topology = gpu_topology()
    args.topology = topology["summary"] if topology else None
    variants = {"ddp": [{"fsdp": "-"}], "fsdp2": fsdp_settings(args)}
    strategies = args.strategies.split(",") if n > 1 else []  # one GPU: its rows alone, to --append elsewhere
    planned: List[Dict[str, Any]] = []
    for model in args.models.split(","):
        for batch in map(int, str(args.batch).split(",")):
            one = dict(model=model, experiment="scaling", strategy="-", fsdp="-", gpus=1, batch=batch)
            for policy in args.policies.split(",") if "scaling" in args.experiments else []:
                planned.append(one | {"policy": policy})
                for strategy in strategies:
                    bundle = f"{args.scratch}/bundles/{model}-{strategy}-{batch}"
                    for index, variant in enumerate(variants[strategy]):
                        cached = "cache" in args.experiments and policy == "regional" and index == 0
                        run = one | dict(strategy=strategy, policy=policy, gpus=n) | variant
                        planned.append(run | ({"_cache_dir": bundle} if cached else {}))
            for strategy in strategies if "cache" in args.experiments else []:
                run = (
                    one | dict(experiment="cache", strategy=strategy, policy="regional", gpus=n) | variants[strategy][0]
                )
                planned.append(run | {"_cache_dir": f"{args.scratch}/bundles/{model}-{strategy}-{batch}"})
            if (
                "collectives" in args.experiments
                and model == args.models.split(",")[0]
                and strategies
                and not args.smoke
            ):
                for collectives in (False, True):
                    experiment = "collectives" + "+collectives" * collectives
                    run = one | dict(experiment=experiment, strategy="ddp", policy="regional", gpus=n)
                    planned.append(run | {"_collectives": collectives})
    defaults = {"_collectives": False, "_cache_dir": None, "_param_dtype": "bf16", "_reshard": True, "_prefetch": 0}
    return [defaults | run | {"_caches": args.scratch / f"run{i}"} for i, run in enumerate(planned)]


BENCHMARK = common.Benchmark(
    name="distributed",
    title="Compile policies under DDP and FSDP2",
    columns="""model experiment strategy fsdp policy gpus batch samples_per_s scaling_vs_1 samples_per_s_mean
    step_ms_median_by_rank first_step_s_by_rank first_step_vs_1 recompiles_by_rank divergent_ranks graphs_by_rank
    peak_memory_gb_by_rank comm_mb comm_ms serial_ms busbw_gbps compute_ms limit_ms vs_limit gpu_timeline_ms_a_step
    faster cache error""".split(),
    runs=runs,
    measure=measure,
    shared=dict(steps=30, timeout=600),
    options={
        "--models": dict(default="gpt2,llama", help="gpt2 (the recipe's GPT-2 small), llama (HF, 16 layers, d 1024)"),
        "--experiments": dict(default="scaling,collectives,cache"),
        "--strategies": dict(default="ddp,fsdp2"),
        "--policies": dict(default="regional,full"),
        "--gpus": dict(type=int, help="N (default: every visible GPU; 2 with --smoke; 1: the one-device rows alone)"),
        "--batch": dict(default="8", help="samples per rank a step; a list (8,16): each batch its rows"),
        "--fsdp-param-dtypes": dict(default="bf16", help="FSDP2's param_dtype (reduce_dtype fp32): bf16, fp32"),
        "--fsdp-reshard": dict(default="true", help="FSDP2's reshard_after_forward: true, false (a list)"),
        "--fsdp-prefetch": dict(default="0", help="FSDP2's explicit forward prefetch, in blocks (a list: 0,1)"),
        "--profile-dir": dict(help="keep rank 0's profile of 3 steps of each GPU run (Chrome traces) there"),
    },
    smoke=dict(steps=4, batch="2"),
    finish=compare_to_one,
    notes=lambda args, rows: [
        "Weak scaling: each rank trains the same batch a step; samples/s counts every rank's samples, from the "
        "slowest rank's median steady step (samples_per_s_mean: from rank 0's mean, the telemetry summary's).",
        "first_step_vs_1: the slowest rank's first step (compiles included) against one device's; for a cache "
        "row, against the cold regional row of its strategy that wrote the bundle.",
        "Every run starts with empty Inductor and Triton caches; the ranks of one run share them (one host).",
        "fsdp2: ModelParallelStrategy, compile_trainer_recipes.gpt.compile_and_shard in configure_model (the policy "
        "applied, then fully_shard on each block, the last one never resharded, and on the root); fsdp: "
        "param_dtype/reduce_dtype "
        "of its MixedPrecisionPolicy, no-reshard (reshard_after_forward=False), prefetch k (each block's forward "
        "issues the next k blocks' all-gathers).",
        "Link (rows on N GPUs, probed in the row's own job after training): comm_mb, the bytes a step's collectives "
        "move (NCCL tests' message sizes); comm_ms, their time at the bus bandwidth measured at those sizes "
        "(busbw_gbps: at the largest message of each collective), serial_ms of it with nothing to overlap (DDP's "
        "last bucket; FSDP2's root all-gather and reduce-scatter); compute_ms, rank 0's busy GPU time a step (from "
        "gpu_timeline_ms_a_step, a profile of 3 steps: busy, nccl, overlapped, exposed, idle, span in ms a step), "
        "else the one-device row's median step; limit_ms = max(compute_ms + serial_ms, comm_ms); vs_limit, the "
        "slowest rank's median step over it; faster, the settings the link model names (telemetry.communication). "
        "host_ms_a_step, rank 0's host time a step over 3 steps before the GPU profile's (torch.profiler's CPU "
        "events): wall, fsdp_hooks (FSDP2's FSDP:: ranges), top_self (the ops with the most self time; "
        "PythonSubclass: DTensor's Python dispatch).",
        f"GPU topology (nvidia-smi topo -m): {getattr(args, 'topology', None) or 'not available'}.",
        "collectives: each rank's lengths cycle through 512/768/1024 from a different start; "
        "+collectives turns on distributed.consistent_dynamic_shapes.",
    ],
    key=("model", "experiment", "strategy", "fsdp", "policy", "gpus", "batch"),
    baseline="one device of the same model, policy and batch (*_vs_1; cache: the cold row of its strategy)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
