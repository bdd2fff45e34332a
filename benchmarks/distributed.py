"""Compile policies under DDP and FSDP2: 1 vs N GPUs, ``regional`` vs ``full``, the recipe's GPT-2 small and an HF
Llama; global samples/s, each rank's first step, recompiles, peak memory and diverging ranks (docs/distributed.md).
Weak scaling: each rank trains ``--batch`` samples a step. ``--experiments`` adds ``collectives`` (ranks of different
first lengths, ``distributed.consistent_dynamic_shapes`` off and on), ``cache`` (the DDP ``regional`` row writes a
bundle, a run with empty local caches loads it) and ``ddp-options``. Each run a fresh Lightning job of N processes
with empty Inductor/Triton caches:

    python benchmarks/distributed.py --models gpt2 --out benchmarks/results/distributed_gpt2.json

CPU smoke run (2 gloo processes, tiny models, aot_eager; no collectives: gloo refuses compiler collectives):

    python benchmarks/distributed.py --smoke --out /tmp/distributed.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

COLUMNS = [
    "model", "experiment", "strategy", "policy", "options", "gpus", "samples_per_s", "scaling_vs_1",
    "samples_per_s_mean", "step_ms_median_by_rank", "first_step_s_by_rank",
    "first_step_vs_1", "recompiles_by_rank", "divergent_ranks", "graphs_by_rank", "peak_memory_gb_by_rank",
    "cache", "error",
]  # fmt: skip
SMOKE_GPT2 = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
SEQUENCE, SMOKE_SEQUENCE = 1024, 16  # tokens a sample (the Llama: real_models.py's, use_cache=False)
LENGTHS = (512, 768, 1024)  # the collectives experiment's lengths (a quarter of them with --smoke)
# The ddp-options experiment's variants: the strategy's and optimizer's settings a user of DDP can choose, each
# a comma-separated list of these names.
OPTIONS = {
    "bucket_view": "DDPStrategy(gradient_as_bucket_view=True): gradients are views of the all-reduce buckets",
    "static_graph": "DDPStrategy(static_graph=True)",
    "bf16_grads": "DDPStrategy(ddp_comm_hook=bf16_compress_hook): gradients all-reduced in bf16",
    "no_ddp_optimizer": "torch._dynamo.config.optimize_ddp = False: no graph split at bucket boundaries",
    "fused": "AdamW(fused=True)",
    "big_buckets": "DDPStrategy(bucket_cap_mb=100): fewer, larger all-reduces (default 25 MB)",
    "nccl_4_channels": "NCCL_MAX_NCHANNELS=4: NCCL's kernels take fewer SMs from the compute beside them",
    "ddp_on_one_gpu": "DDPStrategy on one GPU: DDP's reducer, hooks and bucket copies with no peer to wait for",
}
OPTION_RUNS = [  # (strategy, policy, options, gpus)
    ("ddp", "regional", "", 1), ("ddp", "regional", "", 2), ("ddp", "regional", "no_ddp_optimizer", 2),
    ("ddp", "regional", "no_ddp_optimizer,bucket_view", 2),
    ("ddp", "regional", "no_ddp_optimizer,bucket_view,static_graph", 2),
    ("ddp", "regional", "no_ddp_optimizer,bucket_view,bf16_grads", 2),
    ("ddp", "full", "", 1), ("ddp", "full", "", 2), ("ddp", "full", "no_ddp_optimizer", 2),
    ("ddp", "regional", "fused", 1), ("fsdp2", "regional", "fused", 2),
    ("ddp", "regional", "big_buckets", 2), ("ddp", "regional", "nccl_4_channels", 2),
    ("ddp", "regional", "ddp_on_one_gpu", 1),
]  # fmt: skip


def chosen_options(names: str, flag: str) -> List[str]:
    """The ``OPTIONS`` named in a comma-separated list."""
    chosen = [name for name in names.split(",") if name]
    unknown = sorted(set(chosen) - set(OPTIONS))
    if unknown:
        raise SystemExit(f"unknown {flag} {unknown}: choose from {sorted(OPTIONS)}")
    return chosen


def option_runs(names: str) -> List[Tuple[str, str, str, int]]:
    """``OPTION_RUNS``, or with ``--ddp-options A,B`` the DDP ``regional`` runs on one and on every GPU and one run
    per named option."""
    if not names:
        return OPTION_RUNS
    chosen = chosen_options(names, "--ddp-options")
    baseline = [("ddp", "regional", "", 1), ("ddp", "regional", "", 2)]
    return baseline + [("ddp", "regional", name, 1 if name == "ddp_on_one_gpu" else 2) for name in chosen]


def strategy_name(strategy: str, gpus: int, chosen: str) -> str:
    """The row's strategy: ``-`` for one device without a wrapper."""
    return strategy if gpus > 1 or "ddp_on_one_gpu" in chosen else "-"


def lightning_module(args: argparse.Namespace, callback: Any) -> Any:
    """The model's LightningModule; under FSDP2 on several GPUs its ``configure_model`` applies the callback's
    policy, then shards each block and the root (torchtitan's order)."""
    import lightning.pytorch as pl

    from compile_trainer import apply_policy
    from compile_trainer.compiling.regions import APPLIED_ATTR

    class Benchmarked(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if args.model == "gpt2":
                from benchmarks.models import GPT2_SMALL
                from recipes.gpt import GPT, GPTConfig

                config = GPTConfig(**SMOKE_GPT2) if args.smoke else GPT2_SMALL
                self.model, self.vocab = GPT(config), config.vocab_size
            else:
                from benchmarks.models import build_model

                self.model, _, self.vocab = build_model("llama", args.smoke)

        def training_step(self, batch, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            if args.model == "gpt2":
                return self.model(inputs, targets)[1]
            return self.model(input_ids=inputs, labels=targets).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused="fused" in options(args) or None)

        def configure_model(self) -> None:
            if args.strategy != "fsdp2" or args.gpus < 2:
                return
            from torch.distributed.fsdp import fully_shard

            if callback.policy.compiles_modules and getattr(self, APPLIED_ATTR, None) is None:
                apply_policy(self, callback.policy)
            mesh = self.device_mesh["data_parallel"]
            blocks = self.model.blocks if args.model == "gpt2" else self.model.model.layers
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def train_dataloader(self):
            from torch.utils.data import DataLoader

            pin = torch.cuda.is_available() and not args.smoke  # as a GPU user's loader does
            return DataLoader(batches(args, self.vocab, self.global_rank), batch_size=None, pin_memory=pin)

    return Benchmarked()


def options(args: argparse.Namespace) -> List[str]:
    return chosen_options(args.options or "", "--options")


def ddp_strategy(args: argparse.Namespace) -> Any:
    """Lightning's DDP strategy with the run's ``OPTIONS``."""
    from lightning.pytorch.strategies import DDPStrategy

    chosen = options(args)
    if "no_ddp_optimizer" in chosen:
        torch._dynamo.config.optimize_ddp = False
    kwargs: Dict[str, Any] = {"gradient_as_bucket_view": True} if "bucket_view" in chosen else {}
    kwargs |= {"static_graph": True} if "static_graph" in chosen else {}
    kwargs |= {"bucket_cap_mb": 100} if "big_buckets" in chosen else {}
    if "nccl_4_channels" in chosen:  # before the process group exists; the other ranks inherit it
        os.environ["NCCL_MAX_NCHANNELS"] = "4"
    if "bf16_grads" in chosen:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        kwargs["ddp_comm_hook"] = default_hooks.bf16_compress_hook
    return DDPStrategy(**kwargs)


def batches(args: argparse.Namespace, vocab: int, rank: int) -> List[Any]:
    """``args.steps`` batches of random tokens for this rank (its own: no distributed sampler). The collectives
    experiment gives each rank lengths of its own, the first ones different on every rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    length = SMOKE_SEQUENCE if args.smoke else SEQUENCE
    lengths = [length] * args.steps
    if args.experiment == "collectives":
        choices = [n // 64 if args.smoke else n for n in LENGTHS]
        lengths = [choices[(rank + step) % len(choices)] for step in range(args.steps)]
    tokens = [torch.randint(0, vocab, (args.batch, n + 1), generator=generator) for n in lengths]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def worker(args: argparse.Namespace) -> None:
    """One training job (every rank runs this); rank 0 writes its row to ``args.worker_out``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from compile_trainer import CompileCallback

    on_gpu = torch.cuda.is_available() and not args.smoke
    overrides: Dict[str, Any] = {"backend": "aot_eager"} if args.smoke else {}
    if args.collectives:
        overrides["distributed"] = {"consistent_dynamic_shapes": True}
    if args.cache_dir:
        overrides["cache"] = {"dir": args.cache_dir}
    telemetry = {"measure_flops": False}
    callback = CompileCallback(args.policy, print_plan=False, telemetry=telemetry, **overrides)
    callbacks: List[Any] = [callback]
    if args.profile_dir:
        callbacks.append(profiled_steps(args, first=args.steps - 6, steps=3))
    torch.manual_seed(0)
    module = lightning_module(args, callback)
    strategy: Any = "auto"
    if args.gpus > 1 or "ddp_on_one_gpu" in options(args):
        strategy = (
            ddp_strategy(args) if args.strategy == "ddp" else ModelParallelStrategy(args.gpus, tensor_parallel_size=1)
        )
    trainer = common.quiet_trainer(
        torch.device("cuda" if on_gpu else "cpu"), devices=args.gpus, strategy=strategy, max_steps=args.steps,
        callbacks=callbacks, precision="bf16-mixed" if on_gpu else "32-true", use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module)
    summary = callback.summary()
    if trainer.global_rank == 0:
        args.worker_out.write_text(json.dumps(result_row(args, summary)))
    if torch.distributed.is_initialized():
        # Every rank leaves the group before exiting: left to interpreter teardown, gloo's threads have aborted
        # a rank ("terminate called without an active exception", once in a CI rehearsal).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def profiled_steps(args: argparse.Namespace, first: int, steps: int) -> Any:
    """A Lightning callback profiling ``steps`` steps from step ``first`` on every rank into ``args.profile_dir``:
    each rank's tables of ops by device and host time, and rank 0's Chrome trace."""
    import lightning.pytorch as pl

    class ProfiledSteps(pl.Callback):
        profiler: Any = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
            if batch_idx == first:
                activities = [torch.profiler.ProfilerActivity.CPU]
                activities += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            if batch_idx != first + steps - 1 or self.profiler is None:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            folder = Path(args.profile_dir)
            folder.mkdir(parents=True, exist_ok=True)
            where = strategy_name(args.strategy, args.gpus, args.options or "").replace("-", "single")
            chosen = f"-{args.options.replace(',', '+')}" if args.options else ""
            name = f"{args.model}-{where}-{args.policy}{chosen}-{args.gpus}gpu-rank{trainer.global_rank}"
            averages = self.profiler.key_averages()
            tables = [averages.table(sort_by=key, row_limit=30) for key in ("self_cuda_time_total", "cpu_time_total")]
            (folder / f"{name}.txt").write_text("\n".join(tables))
            if trainer.global_rank == 0:
                trace = folder / f"{name}.trace.json"
                self.profiler.export_chrome_trace(str(trace))
                args.gpu_timeline = gpu_timeline(trace, steps)
            self.profiler = None

    return ProfiledSteps()


def gpu_timeline(trace: Path, steps: int) -> Dict[str, float]:
    """A profiled step's GPU time in ms from a Chrome trace: busy (kernels other than NCCL's), nccl, overlapped (NCCL's
    beside other kernels) and idle (no kernel)."""

    def union(spans: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
        merged: List[Tuple[float, float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def length(spans: List[Tuple[float, float]]) -> float:
        return sum(end - start for start, end in spans)

    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") in kinds and "dur" in e]
    if not kernels:
        return {}
    nccl = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    both = union(nccl + busy)
    span = both[-1][1] - both[0][0]
    per_step = {
        "span": span, "busy": length(busy), "nccl": length(nccl),
        "overlapped": length(nccl) + length(busy) - length(both), "idle": span - length(both),
    }  # fmt: skip
    return {key: round(us / 1e3 / steps, 2) for key, us in per_step.items()}


def result_row(args: argparse.Namespace, summary: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0's row: throughput over all ranks (from the slowest rank's median steady step, and from the mean),
    and each rank's median step, first step, recompiles, graphs and peak memory."""
    ranks = summary.get("ranks") or {
        key: [summary.get(single)]
        for key, single in (
            ("first_step_time_s_by_rank", "first_step_time_s"),
            ("steady_step_time_median_s_by_rank", "steady_step_time_median_s"),
            ("recompiles_by_rank", "recompiles"),
            ("graphs_by_rank", "unique_graphs"),
            ("peak_memory_bytes_by_rank", "peak_memory_bytes"),
        )
    } | {"divergent_recompile_ranks": []}
    per_rank = summary.get("steady_samples_per_s")
    medians = ranks.get("steady_step_time_median_s_by_rank") or [None]
    memory = ranks.get("peak_memory_bytes_by_rank") or []
    cache = None
    if args.cache_dir:
        cache = {key: summary.get(f"cache_{key}") for key in ("status", "precompiled_hits", "precompiled_misses")}
        cache |= {
            key: summary.get(f"cache_{key}")
            for key in ("precompiled_captures", "precompiled_load_s", "precompiled_skipped")
        }
    return {
        "model": args.model,
        "experiment": args.experiment + ("+collectives" if args.collectives else ""),
        "strategy": strategy_name(args.strategy, args.gpus, args.options or ""),
        "policy": args.policy,
        "options": args.options or "",
        "gpus": args.gpus,
        # every rank steps together: the slowest rank's median step sets the pace
        "samples_per_s": args.batch * args.gpus / max(medians) if None not in medians else None,
        "samples_per_s_mean": per_rank * args.gpus if per_rank else None,
        "step_ms_median_by_rank": [round(m * 1e3, 2) if m else None for m in medians],
        "first_step_s_by_rank": ranks.get("first_step_time_s_by_rank"),
        "recompiles_by_rank": ranks.get("recompiles_by_rank"),
        "divergent_ranks": ranks.get("divergent_recompile_ranks"),
        "graphs_by_rank": ranks.get("graphs_by_rank"),
        "peak_memory_gb_by_rank": [round(m / 2**30, 2) if m else None for m in memory],
        "compile_s_max": ranks.get("compile_time_s_max", summary.get("compile_time_s")),
        "cache": cache,
        "gpu_timeline_ms_a_step": getattr(args, "gpu_timeline", None),
        "error": None,
    }


def run_one(args: argparse.Namespace, folder: Path, **run: Any) -> Dict[str, Any]:
    """One fresh job with its own empty Inductor and Triton caches; ``run``: model, experiment, strategy, policy,
    gpus, and optionally collectives and cache_dir."""
    run = {"experiment": "scaling", "collectives": False, "cache_dir": None, "options": None} | run
    name = "-".join(str(v) for v in run.values() if v not in (None, False)).replace("/", "_")
    shared = dict(worker=True, batch=args.batch, steps=args.steps, smoke=args.smoke, profile_dir=args.profile_dir)
    command = common.flags(**shared, **run)
    row = {key: run[key] for key in ("model", "experiment", "policy", "options", "gpus")}
    row |= {"strategy": strategy_name(run["strategy"], run["gpus"], run["options"] or "")}
    row["experiment"] += "+collectives" if run["collectives"] else ""
    caches = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=folder))
    return common.fresh_row(__file__, command, args.timeout, row, caches=caches)


def compare_to_one(rows: List[Dict[str, Any]]) -> None:
    """Each scaling row's throughput and slowest first step against the same (model, policy) on one device (the
    goal: >= 1.9x on two GPUs, first step <= 1.1x); a warm cache row's first steps against its cold row's."""
    ok = [r for r in rows if not r.get("error")]
    single = {
        (r["model"], r["policy"], "fused" in (r.get("options") or "")): r
        for r in ok
        if r["gpus"] == 1 and r["strategy"] == "-"
    }
    cold = {(r["model"], r["policy"]): r for r in ok if r["experiment"] == "scaling" and r.get("cache")}
    for row in rows:
        base = single.get((row["model"], row["policy"], "fused" in (row.get("options") or "")))
        if row["experiment"] == "cache":
            base = cold.get((row["model"], row["policy"]))
        elif row["experiment"] not in ("scaling", "ddp-options"):
            continue
        usable = base is not None and not row.get("error")
        throughput = usable and row.get("samples_per_s") and base.get("samples_per_s")
        row["scaling_vs_1"] = row["samples_per_s"] / base["samples_per_s"] if throughput else None
        first = usable and row.get("first_step_s_by_rank") and base.get("first_step_s_by_rank")
        row["first_step_vs_1"] = max(row["first_step_s_by_rank"]) / max(base["first_step_s_by_rank"]) if first else None


def planned_runs(args: argparse.Namespace, n: int, cache_dir: str) -> List[Dict[str, Any]]:
    runs: List[Dict[str, Any]] = []
    for model in args.models.split(","):
        if "scaling" in args.experiments:
            for policy in args.policies.split(","):
                runs.append(dict(model=model, strategy="ddp", policy=policy, gpus=1))
                for strategy in args.strategies.split(","):
                    cached = "cache" in args.experiments and strategy == "ddp" and policy == "regional"
                    bundle = f"{cache_dir}/{model}" if cached else None
                    runs.append(dict(model=model, strategy=strategy, policy=policy, gpus=n, cache_dir=bundle))
        if "cache" in args.experiments:
            warm = dict(experiment="cache", strategy="ddp", policy="regional", gpus=n, cache_dir=f"{cache_dir}/{model}")
            runs.append(dict(model=model, **warm))
        if "ddp-options" in args.experiments:
            for strategy, policy, chosen, gpus in option_runs(args.ddp_options):
                gpus = n if gpus > 1 else 1
                run = dict(
                    experiment="ddp-options", strategy=strategy, policy=policy, gpus=gpus, options=chosen or None
                )
                runs.append(dict(model=model, **run))
        wanted = [e for e in args.experiments.split(",") if e.startswith("collectives")]
        if wanted and model == args.models.split(",")[0] and not args.smoke:
            for collectives in (False, True) if "collectives" in wanted else (True,):  # collectives-on: one
                collective = dict(experiment="collectives", strategy="ddp", policy="regional", gpus=n)
                runs.append(dict(model=model, **collective, collectives=collectives))
    return runs


def main() -> None:
    smoke = "CPU, 2 gloo processes, tiny models, aot_eager"
    parser = common.arguments(__doc__, "distributed", smoke, steps=None, timeout=600)
    parser.add_argument("--models", default="gpt2,llama", help="gpt2 (the recipe's GPT-2 small), llama (HF)")
    parser.add_argument("--experiments", default="scaling,collectives,cache")
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--policies", default="regional,full")
    parser.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU; 2 with --smoke)")
    parser.add_argument("--batch", type=int, default=None, help="samples per rank a step (8; 2 with --smoke)")
    parser.add_argument(
        "--ddp-options", default="", help=f"ddp-options: only these of {', '.join(OPTIONS)} (default: all runs)"
    )
    parser.add_argument("--profile-dir", help="profile 3 steps near the end of each run (torch.profiler) into it")
    common.hidden(parser, "--model", "--experiment", "--strategy", "--policy", "--cache-dir", "--options")
    common.hidden(parser, "--worker", "--collectives", action="store_true")
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.smoke else 8)
    args.steps = args.steps or (4 if args.smoke else 30)
    if args.worker:
        args.gpus = args.gpus or 1
        return worker(args)
    n = args.gpus or (2 if args.smoke else torch.cuda.device_count())
    if n < 2:
        parser.error(f"needs at least 2 devices to compare with 1 (found {n}); --smoke runs 2 CPU processes")
    for strategy in args.strategies.split(","):
        if strategy not in ("ddp", "fsdp2"):
            parser.error(f"unknown strategy {strategy!r}: ddp or fsdp2")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for run in planned_runs(args, n, f"{folder}/bundles"):
            rows.append(run_one(args, Path(folder), **run))
            print(json.dumps(rows[-1]), flush=True)
    compare_to_one(rows)
    notes = [
        "Weak scaling: each rank trains the same batch a step; samples/s counts every rank's samples, from the "
        "slowest rank's median steady step (samples_per_s_mean: from rank 0's mean, the telemetry summary's).",
        "first_step_vs_1: the slowest rank's first step (compiles included) against one device's; for the cache "
        "row, against the cold DDP regional row that wrote the bundle.",
        "Every run starts with empty Inductor and Triton caches; the ranks of one run share them (one host).",
        "fsdp2: ModelParallelStrategy, the policy applied in configure_model before fully_shard.",
        "collectives: each rank's lengths cycle through 512/768/1024 from a different start; "
        "+collectives turns on distributed.consistent_dynamic_shapes.",
    ]
    common.write_result(args.out, "distributed", "Compile policies under DDP and FSDP2", COLUMNS, rows, notes)
    common.print_table(COLUMNS, rows, baseline="one device of the same model and policy (*_vs_1; cache: the cold row)")


if __name__ == "__main__":
    main()
