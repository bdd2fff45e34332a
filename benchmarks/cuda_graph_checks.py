"""CUDA-graph policies where gradients outlive a step: a small GPT trained with 1 and 2 micro-batches per optimizer
step under ``regional`` (CUDA graphs), in a plain loop with and without ``copy_cuda_graph_gradients`` and in a
Lightning Trainer with ``CompileCallback`` (which installs the copies itself), its losses and weights against the
same loop run eagerly. ``--smoke``: the same on the CPU (no CUDA graphs there: the plumbing only).

    python benchmarks/cuda_graph_checks.py --out benchmarks/results/cuda_graph_checks.json
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from recipes.gpt import GPTConfig, LanguageModel  # noqa: E402

MODEL = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128)
SMOKE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
CHECKS = {  # how: the loop and its arguments
    "raw loop, no gradient copies": ("raw", {}),
    "raw loop, copy_cuda_graph_gradients": ("raw", {"copies": True}),
    "Lightning + CompileCallback": ("lightning", {}),
}
EAGER: Dict[Any, Dict[str, Any]] = {}  # (loop, accumulate): eager training's losses and weights


def start(config: GPTConfig, device: torch.device, count: int):
    """The module (seeded) and ``count`` batches of 4 random token rows."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (count, 4, config.block_size + 1), generator=generator)
    torch.manual_seed(0)
    return LanguageModel(model=asdict(config), lr=1e-3, warmup_steps=1).to(device), list(tokens.to(device))


def trained(module: LanguageModel, losses: List[float]) -> Dict[str, Any]:
    return {"losses": losses, "weights": [p.detach().float().cpu() for p in module.parameters()]}


def train_raw(config, device, policy, accumulate, steps, copies=False) -> Dict[str, Any]:
    """A hand-written loop: ``accumulate`` micro-batches per optimizer step."""
    from compile_trainer.compiling.cuda_graph_grads import copy_cuda_graph_gradients
    from compile_trainer.compiling.regions import apply_policy

    module, batches = start(config, device, steps * accumulate)
    applied = apply_policy(module, policy) if policy is not None else None
    if copies:
        copy_cuda_graph_gradients(applied)
    optimizer, losses = torch.optim.AdamW(module.parameters(), lr=1e-3), []
    for index, batch in enumerate(batches):
        if applied is not None:
            applied.begin_step()
        loss = module.model(batch[:, :-1], batch[:, 1:])[1]
        (loss / accumulate).backward()
        losses.append(float(loss))
        if (index + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return trained(module, losses)


def train_lightning(config, device, policy, accumulate, steps) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from compile_trainer.lightning.callback import CompileCallback

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]) * accumulate)  # Lightning divides by the accumulation

    module, batches = start(config, device, steps * accumulate)
    losses: List[float] = []
    callbacks = [Losses()] + ([CompileCallback(policy, print_plan=False, telemetry=False)] if policy else [])
    trainer = common.quiet_trainer(device, max_steps=steps, accumulate_grad_batches=accumulate, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=DataLoader([(b[:, :-1], b[:, 1:]) for b in batches], batch_size=None))
    return trained(module, losses)


def measure(args) -> Dict[str, Any]:
    """The run's loop under ``regional`` against the same loop eagerly."""
    from compile_trainer.schema import to_policy

    device, (loop, extra) = common.device_for(args.smoke), CHECKS[args.how]
    train = train_raw if loop == "raw" else train_lightning
    settings = dict(config=SMOKE if args.smoke else MODEL, device=device, steps=args.steps, accumulate=args.accumulate)
    if (loop, args.accumulate) not in EAGER:
        EAGER[loop, args.accumulate] = train(policy=None, **settings)
        torch._dynamo.reset()
    policy = to_policy("regional", backend="aot_eager" if args.smoke else "inductor")
    try:
        result = train(policy=policy, **settings, **extra)
    except Exception as error:  # a refusal is a finding: PyTorch raises on an overwritten CUDA-graph output
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}", "ok": False}
    eager = EAGER[loop, args.accumulate]
    losses = common.rel_diff(result["losses"], eager["losses"])
    weights = max(float((a - b).norm() / b.norm()) for a, b in zip(result["weights"], eager["weights"]))
    return {"max_loss_rel_diff": losses, "max_weight_rel_diff": weights, "ok": losses < 1e-3 and weights < 1e-3}


BENCHMARK = common.Benchmark(
    name="cuda_graph_checks",
    title="CUDA graphs with gradient accumulation vs eager",
    columns=["how", "accumulate", "max_loss_rel_diff", "max_weight_rel_diff", "ok", "error"],
    runs=lambda args: [{"how": how, "accumulate": accumulate} for accumulate in (1, 2) for how in CHECKS],
    measure=measure,
    shared=dict(steps=4),
    smoke_help="tiny model on the CPU",
    notes=lambda args, rows: [f"{SMOKE if args.smoke else MODEL}; {args.steps} optimizer steps; fp32"],
    in_process=True,
    key=("how", "accumulate"),
    baseline="eager (max_*_rel_diff)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
