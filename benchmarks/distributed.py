"""Compile policies under DDP and FSDP2 on several GPUs: 1 vs N GPUs, ``regional`` vs ``full``; global throughput
(samples/s of all ranks), each rank's first step, recompiles by rank and the ranks whose recompiles diverge.

On a machine with N GPUs (one command; every run a fresh Lightning job of N processes):

    python benchmarks/distributed.py --out benchmarks/results/distributed.json

CPU smoke run (2 gloo processes, a tiny GPT, backend aot_eager), as the tests run it:

    python benchmarks/distributed.py --smoke --out /tmp/distributed.json

Each run is a worker (``--worker``) started as its own process; Lightning's ``ddp`` launcher starts the other
ranks. Weak scaling: each rank trains ``--batch`` samples a step, so N GPUs see N times the samples of one.
Importable without hydra and wandb (the GPU image has neither).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import write_result  # noqa: E402

COLUMNS = [
    "strategy", "policy", "gpus", "samples_per_s", "scaling_vs_1", "first_step_s_min", "first_step_s_max",
    "first_step_vs_1", "compile_s_max", "recompiles_by_rank", "divergent_ranks", "error",
]  # fmt: skip
FULL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)  # GPT-2 small
SMOKE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


def worker(args: argparse.Namespace) -> None:
    """One training job (every rank runs this); rank 0 writes its row to ``args.out``."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from compile_trainer import CompileCallback
    from recipes.gpt import GPTConfig, LanguageModel, compile_and_shard

    config = GPTConfig(**(SMOKE if args.smoke else FULL))
    on_gpu = torch.cuda.is_available() and not args.smoke
    policy_args = {"backend": "aot_eager"} if args.smoke else {}
    callback = CompileCallback(args.policy, print_plan=False, telemetry={"measure_flops": False}, **policy_args)

    class Model(LanguageModel):
        def configure_model(self) -> None:
            if args.strategy == "fsdp2" and args.gpus > 1:
                compile_and_shard(self, self.model, callback.policy, self.device_mesh["data_parallel"])

        def train_dataloader(self):
            count = args.batch * args.steps * args.gpus
            tokens = torch.randint(0, config.vocab_size, (count, config.block_size + 1), generator=torch.Generator())
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)

    torch.manual_seed(0)
    module = Model(config, warmup_steps=0)
    strategy: Any = "auto"
    if args.gpus > 1:
        strategy = "ddp" if args.strategy == "ddp" else ModelParallelStrategy(args.gpus, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="gpu" if on_gpu else "cpu", devices=args.gpus, strategy=strategy, max_steps=args.steps,
        callbacks=[callback],
        precision="bf16-mixed" if on_gpu else "32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module)
    summary = callback.summary()
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(result_row(args, summary)))
    if torch.distributed.is_initialized():
        # Every rank leaves the group before exiting: left to interpreter teardown, gloo's threads have aborted
        # a rank ("terminate called without an active exception", once in a CI rehearsal).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def result_row(args: argparse.Namespace, summary: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0's row: throughput over all ranks, and the ranks' first steps, compile times and recompiles."""
    ranks = summary.get("ranks") or {
        "first_step_time_s_min": summary.get("first_step_time_s"),
        "first_step_time_s_max": summary.get("first_step_time_s"),
        "compile_time_s_max": summary.get("compile_time_s"),
        "recompiles_by_rank": [summary.get("recompiles")],
        "divergent_recompile_ranks": [],
    }
    per_rank = summary.get("steady_samples_per_s")
    return {
        "strategy": args.strategy,
        "policy": args.policy,
        "gpus": args.gpus,
        "samples_per_s": per_rank * args.gpus if per_rank else None,  # every rank steps together
        "first_step_s_min": ranks.get("first_step_time_s_min"),
        "first_step_s_max": ranks.get("first_step_time_s_max"),
        "compile_s_max": ranks.get("compile_time_s_max"),
        "recompiles_by_rank": ranks["recompiles_by_rank"],
        "divergent_ranks": ranks["divergent_recompile_ranks"],
        "error": None,
    }


def run_one(args: argparse.Namespace, strategy: str, policy: str, gpus: int, folder: Path) -> Dict[str, Any]:
    out = folder / f"{strategy}-{policy}-{gpus}.json"
    command = [
        sys.executable, __file__, "--worker", "--strategy", strategy, "--policy", policy, "--gpus", str(gpus),
        "--batch", str(args.batch), "--steps", str(args.steps), "--out", str(out), *(["--smoke"] if args.smoke else []),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    if result.returncode != 0 or not out.exists():
        error = (result.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"strategy": strategy, "policy": policy, "gpus": gpus, "error": error}
    return json.loads(out.read_text())


def compare_to_one(rows: List[Dict[str, Any]]) -> None:
    """Each row's throughput and first step against the same policy on one device (the issue's goal: >= 1.9x
    on two GPUs, first step <= 1.1x)."""
    single = {(r["strategy"], r["policy"]): r for r in rows if r["gpus"] == 1 and not r.get("error")}
    for row in rows:
        base = single.get((row["strategy"], row["policy"]))
        ok = base is not None and not row.get("error") and row.get("samples_per_s") and base.get("samples_per_s")
        row["scaling_vs_1"] = row["samples_per_s"] / base["samples_per_s"] if ok else None
        first = ok and row.get("first_step_s_max") and base.get("first_step_s_max")
        row["first_step_vs_1"] = row["first_step_s_max"] / base["first_step_s_max"] if first else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, 2 gloo processes, a tiny GPT, aot_eager")
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--policies", default="regional,full")
    parser.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU; 2 with --smoke)")
    parser.add_argument("--batch", type=int, default=None, help="samples per rank a step (8; 2 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="training steps a run (30; 4 with --smoke)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds a run may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="regional", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.smoke else 8)
    args.steps = args.steps or (4 if args.smoke else 30)
    if args.worker:
        return worker(args)
    n = args.gpus or (2 if args.smoke else torch.cuda.device_count())
    if n < 2:
        parser.error(f"needs at least 2 devices to compare with 1 (found {n}); --smoke runs 2 CPU processes")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for strategy in args.strategies.split(","):
            if strategy not in ("ddp", "fsdp2"):
                parser.error(f"unknown strategy {strategy!r}: ddp or fsdp2")
            for policy in args.policies.split(","):
                for gpus in (1, n):
                    rows.append(run_one(args, strategy, policy, gpus, Path(folder)))
                    print(json.dumps(rows[-1]), flush=True)
    compare_to_one(rows)
    notes = [
        "Weak scaling: each rank trains the same batch a step; samples/s counts every rank's samples.",
        "first_step_vs_1: the slowest rank's first step (compiles included) against one device's.",
        "fsdp2: ModelParallelStrategy, the policy applied in configure_model before fully_shard (recipes.gpt).",
    ]
    write_result(Path(args.out), "distributed", "Compile policies under DDP and FSDP2", COLUMNS, rows, notes)
    from compile_trainer.tables import text_table

    print("\n".join(text_table(COLUMNS, [[_cell(row.get(c)) for c in COLUMNS] for row in rows])))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
