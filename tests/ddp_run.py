"""Training runs of a tiny GPT under a compile policy, on 1 process or under Lightning's DDP on N CPU processes
(gloo). Writes rank 0's results as JSON: per-step global losses, the final weights, checkpoint keys, the summary.

    python tests/ddp_run.py OUT.json --policy regional --devices 2 --batch 2 [--backend eager] [--optimizer true]
        [--clip 0.05]
    python tests/ddp_run.py --runs RUNS.json

``--runs``: a JSON list of such argument lists (the same ``--devices`` and ``--strategy`` in each), trained one
after the other in the same processes, as a new process would train each (Dynamo reset, the policy removed): the
start-up (imports, the process group) is paid once. Each run's output goes to ``OUT.json.log.rank<N>``.

Every global batch holds samples of one length (lengths change between steps), and a rank's samples are its share
of the global batch (Lightning's DistributedSampler, no shuffle): N ranks of ``batch`` equal 1 process of
``N * batch``.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
from pathlib import Path
from typing import List, Optional, Sequence

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.callback import callback_handler  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

from compile_trainer import CompileCallback  # noqa: E402
from compile_trainer.compiling.plan_table import plan_rows  # noqa: E402
from compile_trainer_recipes.data import TokenBatch  # noqa: E402
from compile_trainer_recipes.gpt import GPTConfig, LanguageModel, compile_and_shard  # noqa: E402

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
BACKEND_COMPILES = [0]  # graphs handed to the eager_counted backend in this process (DDPOptimizer's splits: each)


@torch._dynamo.register_backend(name="eager_counted")
def eager_counted(graph_module, example_inputs):
    BACKEND_COMPILES[0] += 1
    return graph_module.forward


LENGTHS = [16, 12, 16, 8]  # one per global batch, cycling
BACKGROUND_THREAD = "compile_trainer-background"


class VarLengthTokens(Dataset):
    def __init__(self, global_batch: int, steps: int, skew: bool = False, lengths: Sequence[int] = LENGTHS):
        self.global_batch, self.count, self.skew, self.lengths = global_batch, global_batch * steps, skew, lengths

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> TokenBatch:
        length = self.lengths[(index // self.global_batch) % len(self.lengths)]
        if self.skew and index % 2 == 0:  # rank 0 sees one length, rank 1 several: rank 1 alone recompiles
            length = LENGTHS[0]
        tokens = torch.randint(1, CONFIG.vocab_size, (length + 1,), generator=torch.Generator().manual_seed(index))
        return TokenBatch(tokens[:-1], tokens[1:])


class HeldBackgroundCompile:
    """Holds the background thread inside its first Dynamo compile until released: the steps run meanwhile run
    eagerly while the thread is certainly compiling."""

    def __init__(self):
        self.inside, self.released = threading.Event(), threading.Event()
        callback_handler.register_start_callback(self._hold)

    def _hold(self, *args) -> None:
        if threading.current_thread().name == BACKGROUND_THREAD and not self.released.is_set():
            self.inside.set()
            self.released.wait(timeout=120)

    @property
    def compiling(self) -> bool:
        return self.inside.is_set() and not self.released.is_set()


class RecordingLM(LanguageModel):
    """Records each step's loss averaged over the ranks (the loss of the global batch)."""

    def __init__(self, global_batch: int, batch: int, steps: int, skew: bool = False, width: Optional[int] = None):
        torch.manual_seed(0)
        config = dataclasses.replace(CONFIG, n_embd=width) if width else CONFIG
        super().__init__(config, lr=1e-2, warmup_steps=0, decay_steps=10_000, weight_decay=0.0)
        self.global_batch, self.batch, self.steps, self.skew = global_batch, batch, steps, skew
        self.lengths: Sequence[int] = LENGTHS
        self.losses_by_step = {}  # a warm-up batch (shapes.warmup) runs before the step's real one: overwritten
        self.sync_grads = False  # gather the loss as a user's contrastive loss would: all_gather(sync_grads=True)
        self.compile_callback: Optional[CompileCallback] = None
        self.compiled_from: List[int] = []  # per rank: the first step of the held background compile's regions
        self.held: Optional[HeldBackgroundCompile] = None
        self.gathered_while_compiling = []  # steps whose all_gather ran while the background thread compiled

    def on_train_start(self) -> None:
        if self.compiled_from and self.compile_callback.background is not None:
            self.held = HeldBackgroundCompile()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.held is not None and self.compile_callback.background.state == "compiling":
            assert self.held.inside.wait(timeout=120), "the background thread never started compiling"
        gathered = self.all_gather(loss if self.sync_grads else loss.detach(), sync_grads=self.sync_grads)
        if self.held is not None and self.held.compiling:
            self.gathered_while_compiling.append(batch_idx)
        self.losses_by_step[self.global_step] = float(gathered.detach().mean())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.held is not None and batch_idx + 1 == self.compiled_from[self.global_rank]:
            self.held.released.set()
            self.compile_callback.background.wait()  # installed: the compiled regions run from the next step

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    def train_dataloader(self):
        data = VarLengthTokens(self.global_batch, self.steps, self.skew, self.lengths)
        sampler = DistributedSampler(data, self.trainer.world_size, self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=self.batch, sampler=sampler)


class ShardedLM(RecordingLM):
    """FSDP2: the policy applied in configure_model, then each block and the model sharded (the recipes' gpt.py)."""

    policy = None  # the callback's policy, set by main()

    def configure_model(self):
        compile_and_shard(self, self.model, self.policy, self.device_mesh["data_parallel"])


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--policy", default="regional")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--batch", type=int, default=2, help="samples per rank")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--optimizer", default="false", help="the policy's optimizer.compile")
    parser.add_argument("--clip", type=float, help="the Trainer's gradient_clip_val (by norm)")
    parser.add_argument("--auto-steps", type=int, default=3, help="optimizer.compile auto: timed steps per candidate")
    parser.add_argument("--consistent-dynamic-shapes", action="store_true")
    parser.add_argument("--bucket-cap-mb", type=float, help="DDPStrategy(bucket_cap_mb=...)")
    parser.add_argument("--width", type=int, help="the GPT's n_embd (default: CONFIG's)")
    parser.add_argument("--split-at-buckets", action="store_true", help="distributed.split_graphs_at_ddp_buckets")
    parser.add_argument("--no-apply", action="store_true", help="fsdp2: configure_model does not apply the policy")
    parser.add_argument("--cache", help="a compile cache directory (read-write)")
    parser.add_argument("--rest", help="one regional rule for every module, with this rest (default: the policy's)")
    parser.add_argument("--skew", action="store_true", help="rank 0 sees one length, rank 1 several")
    parser.add_argument(
        "--fixed-length", action="store_true", help="every batch of LENGTHS[0] tokens: nothing compiles after step 0"
    )
    parser.add_argument("--sync-grads", action="store_true", help="the loss gathered with all_gather(sync_grads=True)")
    parser.add_argument(
        "--compiled-from", help="background policies: per rank, the step from which the compiled regions run (>= 2); "
        "the thread is held inside its compile until then, while the steps run eagerly",
    )  # fmt: skip
    return parser


@contextlib.contextmanager
def output_to(path: str):
    """This process's stdout and stderr (file descriptors 1 and 2: logging's handlers and C code's output too)
    written to ``path`` for the duration."""
    saved = []
    with open(path, "w") as log:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            saved.append(os.dup(stream.fileno()))
            os.dup2(log.fileno(), stream.fileno())
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def main() -> None:
    if sys.argv[1:2] != ["--runs"]:
        train(parser().parse_args())
        return
    runs = [parser().parse_args(argv) for argv in json.loads(Path(sys.argv[2]).read_text())]
    assert len({(args.devices, args.strategy) for args in runs}) == 1, "one process group: the same ranks for all"
    for args in runs:  # LOCAL_RANK: set on the ranks the first Trainer launches, then on rank 0 too
        with output_to(f"{args.out}.log.rank{os.environ.get('LOCAL_RANK', '0')}"):
            callback = train(args)
        if callback.applied is not None:
            callback.applied.remove()  # the process-wide settings it holds (recompile limit...) go with it
        torch._dynamo.reset()  # the next run compiles as a new process would
        torch._dynamo.utils.clear_compilation_metrics()


def train(args: argparse.Namespace) -> CompileCallback:
    torch.set_num_threads(1)
    overrides = {"backend": args.backend, "optimizer": {"compile": args.optimizer, "auto_steps": args.auto_steps}}
    if args.policy in ("buckets",):
        overrides["shapes"] = {"pad": {"buckets": [8, 16]}}
    if args.policy == "buckets_auto":
        overrides["shapes"] = {"pad": {"auto": {"count": 2, "sample_batches": 8, "multiple_of": 4}}}
    if args.cache:
        overrides["cache"] = {"dir": args.cache, "mode": "read-write"}
    if args.rest:
        overrides["rules"] = [{"name": "*", "action": "regional", "rest": args.rest}]
    overrides["distributed"] = {
        "consistent_dynamic_shapes": args.consistent_dynamic_shapes,
        "split_graphs_at_ddp_buckets": args.split_at_buckets,
    }
    callback = CompileCallback(args.policy, **overrides)
    module = RecordingLM(args.global_batch, args.batch, args.steps, args.skew, args.width)
    strategy = args.strategy if args.devices > 1 else "auto"
    if args.bucket_cap_mb and args.devices > 1:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(bucket_cap_mb=args.bucket_cap_mb)
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        module = ShardedLM(args.global_batch, args.batch, args.steps, args.skew)
        module.policy = None if args.no_apply else callback.policy
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    module.compile_callback, module.sync_grads = callback, args.sync_grads
    module.lengths = LENGTHS[:1] if args.fixed_length else LENGTHS
    module.compiled_from = [int(step) for step in args.compiled_from.split(",")] if args.compiled_from else []
    trainer = pl.Trainer(
        max_steps=args.steps, logger=False, callbacks=[callback], accelerator="cpu", devices=args.devices,
        strategy=strategy, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, gradient_clip_val=args.clip,
    )  # fmt: skip
    compiled_before = BACKEND_COMPILES[0]
    trainer.fit(module)
    checkpoint = Path(args.out).with_suffix(".ckpt")
    trainer.save_checkpoint(checkpoint)
    # FSDP2's parameters are DTensor shards: each gathered whole (a collective, so on every rank)
    weights = {name: getattr(p, "full_tensor", p.detach)().detach().tolist() for name, p in module.named_parameters()}
    summary = callback.summary()  # every rank's own, for the cache: each reads, rank 0 alone writes
    Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(summary, default=str))
    choices = [dataclasses.asdict(step.choice) for step in callback.optimizer_steps if step.choice is not None]
    Path(f"{args.out}.optimizer_choices.rank{trainer.global_rank}").write_text(json.dumps(choices))
    if trainer.global_rank != 0:
        return callback
    if checkpoint.is_dir():  # FSDP2: a distributed checkpoint (a shard per rank), gathered into one file here
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(checkpoint, checkpoint.with_suffix(".pt"))
        saved = torch.load(checkpoint.with_suffix(".pt"), weights_only=False)
        saved = {"state_dict": saved["state_dict"], "optimizer_states": [saved["optimizer_0"]]}
    else:
        saved = torch.load(checkpoint, weights_only=False)
    optimizer_keys = [str(k) for state in saved["optimizer_states"] for k in state.get("state", {})]
    result = {
        "losses": list(module.losses_by_step.values()),
        "weights": weights,
        "state_dict_keys": list(saved["state_dict"]),
        "optimizer_keys": optimizer_keys,
        "summary": summary,
        "plan": plan_rows(callback.applied) if callback.applied is not None else [],
        "world_size": trainer.world_size,
        "gathered_while_compiling": module.gathered_while_compiling,
        "grad_norms": [float(step.grad_norm) for step in callback.optimizer_steps],
        "backend_compiles": BACKEND_COMPILES[0] - compiled_before,
    }
    Path(args.out).write_text(json.dumps(result, default=str))
    return callback


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # Lightning leaves the group to the script; a clean exit on every rank
        torch.distributed.destroy_process_group()
