"""Compile policies under DDP and FSDP2: 1 vs N GPUs, ``regional`` vs ``full``, the recipe's GPT-2 small and an HF
Llama; global samples/s, each rank's first step, recompiles, peak memory and diverging ranks (docs/distributed.md).
Weak scaling: each rank trains ``--batch`` samples a step. ``--experiments`` adds ``collectives`` (ranks of different
first lengths, ``distributed.consistent_dynamic_shapes`` off and on) and ``cache`` (the DDP ``regional`` row writes a
bundle, a run with empty local caches loads it). Each run a fresh Lightning job of N processes with empty
Inductor/Triton caches:

    python benchmarks/distributed.py --models gpt2 --experiments scaling,cache --policies regional --strategies ddp

CPU smoke run (2 gloo processes, tiny models, aot_eager; no collectives: gloo refuses compiler collectives):

    python benchmarks/distributed.py --smoke --out /tmp/distributed.json
"""

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from compile_trainer import CompileCallback, apply_policy  # noqa: E402
from compile_trainer.compiling.regions import APPLIED_ATTR  # noqa: E402
from compile_trainer_recipes.gpt import GPT, GPTConfig  # noqa: E402

SMOKE_GPT2 = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
SEQUENCE, SMOKE_SEQUENCE = 1024, 16  # tokens a sample (the Llama: real_models.py's, use_cache=False)
LENGTHS = (512, 768, 1024)  # the collectives experiment's lengths (a quarter of them with --smoke)
CACHE_FIELDS = "status precompiled_hits precompiled_misses precompiled_captures precompiled_load_s precompiled_skipped"


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
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def configure_model(self) -> None:
        if self.args.strategy != "fsdp2":
            return
        if self.policy.compiles_modules and getattr(self, APPLIED_ATTR, None) is None:
            apply_policy(self, self.policy)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks if self.args.model == "gpt2" else self.model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

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
    callback = CompileCallback(args.policy, print_plan=False, telemetry={"measure_flops": False}, **overrides)
    torch.manual_seed(0)
    module = Benchmarked(args, callback)
    strategies = {"ddp": DDPStrategy, "fsdp2": lambda: ModelParallelStrategy(args.gpus, tensor_parallel_size=1)}
    strategy = strategies.get(args.strategy, lambda: "auto")()
    trainer = common.quiet_trainer(
        torch.device("cuda" if on_gpu else "cpu"), devices=args.gpus, strategy=strategy,
        max_steps=args.steps, callbacks=[callback], precision="bf16-mixed" if on_gpu else "32-true",
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module)
    row = result_row(args, callback.summary()) if trainer.global_rank == 0 else None
    if torch.distributed.is_initialized():
        # Every rank leaves the group before exiting: left to interpreter teardown, gloo's threads have aborted
        # a rank ("terminate called without an active exception", once in a CI rehearsal).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return row


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
    """Each scaling row's throughput and slowest first step against the same (model, policy) on one device (the
    goal: >= 1.9x on two GPUs, first step <= 1.1x); a warm cache row's first steps against its cold row's."""
    ok = [r for r in rows if not r.get("error")]
    single = {(r["model"], r["policy"]): r for r in ok if r["gpus"] == 1}
    cold = {(r["model"], r["policy"]): r for r in ok if r["experiment"] == "scaling" and r.get("cache")}
    for row in rows:
        base = (cold if row["experiment"] == "cache" else single).get((row["model"], row["policy"]))
        if row["experiment"] not in ("scaling", "cache"):
            continue
        usable = base is not None and not row.get("error")
        throughput = usable and row.get("samples_per_s") and base.get("samples_per_s")
        row["scaling_vs_1"] = row["samples_per_s"] / base["samples_per_s"] if throughput else None
        first = usable and row.get("first_step_s_by_rank") and base.get("first_step_s_by_rank")
        row["first_step_vs_1"] = max(row["first_step_s_by_rank"]) / max(base["first_step_s_by_rank"]) if first else None
    return rows


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Per model: each policy on one device and under each strategy on N, the cache's warm run, the collectives'."""
    n = args.gpus or (2 if args.smoke else torch.cuda.device_count())
    if n < 2:
        raise SystemExit(f"needs at least 2 devices to compare with 1 (found {n}); --smoke runs 2 CPU processes")
    if set(args.strategies.split(",")) - {"ddp", "fsdp2"}:
        raise SystemExit(f"unknown strategies in {args.strategies!r}: ddp or fsdp2")
    planned: List[Dict[str, Any]] = []
    for model in args.models.split(","):
        bundle = f"{args.scratch}/bundles/{model}"
        if "scaling" in args.experiments:
            for policy in args.policies.split(","):
                planned.append(dict(model=model, experiment="scaling", strategy="-", policy=policy, gpus=1))
                for strategy in args.strategies.split(","):
                    cached = "cache" in args.experiments and strategy == "ddp" and policy == "regional"
                    run = dict(model=model, experiment="scaling", strategy=strategy, policy=policy, gpus=n)
                    planned.append(run | ({"_cache_dir": bundle} if cached else {}))
        if "cache" in args.experiments:
            planned.append(dict(model=model, experiment="cache", strategy="ddp", policy="regional", gpus=n))
            planned[-1]["_cache_dir"] = bundle
        if "collectives" in args.experiments and model == args.models.split(",")[0] and not args.smoke:
            for collectives in (False, True):
                experiment = "collectives" + "+collectives" * collectives
                run = dict(model=model, experiment=experiment, strategy="ddp", policy="regional", gpus=n)
                planned.append(run | {"_collectives": collectives})
    defaults = {"_collectives": False, "_cache_dir": None}
    return [defaults | run | {"_caches": args.scratch / f"run{i}"} for i, run in enumerate(planned)]


BENCHMARK = common.Benchmark(
    name="distributed",
    title="Compile policies under DDP and FSDP2",
    columns="""model experiment strategy policy gpus samples_per_s scaling_vs_1 samples_per_s_mean
    step_ms_median_by_rank first_step_s_by_rank first_step_vs_1 recompiles_by_rank divergent_ranks graphs_by_rank
    peak_memory_gb_by_rank cache error""".split(),
    runs=runs,
    measure=measure,
    shared=dict(steps=30, timeout=600),
    options={
        "--models": dict(default="gpt2,llama", help="gpt2 (the recipe's GPT-2 small), llama (HF)"),
        "--experiments": dict(default="scaling,collectives,cache"),
        "--strategies": dict(default="ddp,fsdp2"),
        "--policies": dict(default="regional,full"),
        "--gpus": dict(type=int, help="N (default: every visible GPU; 2 with --smoke)"),
        "--batch": dict(type=int, default=8, help="samples per rank a step"),
    },
    smoke=dict(steps=4, batch=2),
    finish=compare_to_one,
    notes=lambda args, rows: [
        "Weak scaling: each rank trains the same batch a step; samples/s counts every rank's samples, from the "
        "slowest rank's median steady step (samples_per_s_mean: from rank 0's mean, the telemetry summary's).",
        "first_step_vs_1: the slowest rank's first step (compiles included) against one device's; for the cache "
        "row, against the cold DDP regional row that wrote the bundle.",
        "Every run starts with empty Inductor and Triton caches; the ranks of one run share them (one host).",
        "fsdp2: ModelParallelStrategy, the policy applied in configure_model before fully_shard.",
        "collectives: each rank's lengths cycle through 512/768/1024 from a different start; "
        "+collectives turns on distributed.consistent_dynamic_shapes.",
    ],
    key=("model", "experiment", "strategy", "policy", "gpus"),
    baseline="one device of the same model and policy (*_vs_1; cache: the cold row)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
