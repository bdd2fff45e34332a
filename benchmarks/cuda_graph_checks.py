"""Correctness of CUDA-graph policies where gradients outlive a step: gradient accumulation, on a GPU.

Trains a small GPT with two micro-batches per optimizer step, eagerly and under the ``regional`` policy (CUDA
graphs), in a plain loop with and without ``copy_cuda_graph_gradients`` and in a Lightning Trainer with
``CompileCallback`` (which installs the copies itself), and compares losses and final weights with eager.

    python benchmarks/cuda_graph_checks.py --out benchmarks/results/cuda_graph_checks.json

``--smoke`` runs the same on the CPU (no CUDA graphs there: the plumbing only).
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
COLUMNS = ["check", "how", "accumulate", "max_loss_rel_diff", "max_weight_rel_diff", "ok", "error"]


def make_batches(config: GPTConfig, count: int, device: torch.device) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (count, 4, config.block_size + 1), generator=generator)
    return list(tokens.to(device))


def make_module(config: GPTConfig, device: torch.device) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(model=asdict(config), lr=1e-3, warmup_steps=1).to(device)


def train_raw(config, device, policy, accumulate, steps, copies=False) -> Dict[str, Any]:
    """A hand-written loop: ``accumulate`` micro-batches per optimizer step."""
    from compile_trainer.compiling.cuda_graph_grads import copy_cuda_graph_gradients
    from compile_trainer.compiling.regions import apply_policy

    module = make_module(config, device)
    applied = apply_policy(module, policy) if policy is not None else None
    if copies:
        copy_cuda_graph_gradients(applied)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    batches, losses = make_batches(config, steps * accumulate, device), []
    for step in range(steps):
        for micro in range(accumulate):
            if applied is not None:
                applied.begin_step()
            batch = batches[step * accumulate + micro]
            loss = module.model(batch[:, :-1], batch[:, 1:])[1]
            (loss / accumulate).backward()
            losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "weights": [p.detach().float().cpu() for p in module.parameters()]}


def train_lightning(config, device, policy, accumulate, steps) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from compile_trainer.lightning.callback import CompileCallback

    class Losses(pl.Callback):
        def __init__(self):
            self.losses: List[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]) * accumulate)  # Lightning divides by the accumulation

    module = make_module(config, device)
    recorder = Losses()
    callbacks = [recorder] + ([CompileCallback(policy, print_plan=False, telemetry=False)] if policy else [])
    data = DataLoader(
        [(b[:, :-1], b[:, 1:]) for b in make_batches(config, steps * accumulate, device)], batch_size=None
    )
    trainer = common.quiet_trainer(device, max_steps=steps, accumulate_grad_batches=accumulate, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=data)
    return {"losses": recorder.losses, "weights": [p.detach().float().cpu() for p in module.parameters()]}


def compare(result: Dict[str, Any], reference: Dict[str, Any]) -> Dict[str, Any]:
    losses = common.rel_diff(result["losses"], reference["losses"])
    weights = max(float((a - b).norm() / b.norm()) for a, b in zip(result["weights"], reference["weights"]))
    return {"max_loss_rel_diff": losses, "max_weight_rel_diff": weights, "ok": losses < 1e-3 and weights < 1e-3}


def run(train, **kwargs) -> Dict[str, Any]:
    torch._dynamo.reset()
    try:
        return train(**kwargs)
    except Exception as error:  # a refusal is a finding: PyTorch raises on an overwritten CUDA-graph output
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}


def main() -> None:
    parser = common.arguments(__doc__, "cuda_graph_checks", "tiny model on the CPU", steps=4)
    args = parser.parse_args()
    from compile_trainer.schema import to_policy

    device = common.device_for(args.smoke)
    config = SMOKE if args.smoke else MODEL
    policy = to_policy("regional", backend="aot_eager" if args.smoke else "inductor")
    checks = [  # how, the loop, its arguments
        ("raw loop, no gradient copies", train_raw, {}),
        ("raw loop, copy_cuda_graph_gradients", train_raw, {"copies": True}),
        ("Lightning + CompileCallback", train_lightning, {}),
    ]
    rows = []
    for accumulate in (1, 2):
        settings = {"config": config, "device": device, "steps": args.steps, "accumulate": accumulate}
        eager = {loop: run(loop, policy=None, **settings) for loop in (train_raw, train_lightning)}
        for how, loop, extra in checks:
            result = run(loop, policy=policy, **settings, **extra)
            row = {"check": "regional (CUDA graphs) vs eager", "how": how, "accumulate": accumulate}
            rows.append(row | (compare(result, eager[loop]) if "error" not in result else result | {"ok": False}))
    notes = [f"{config}; {args.steps} optimizer steps; device {device}; fp32"]
    common.write_result(
        args.out, "cuda_graph_checks", "CUDA graphs with gradient accumulation vs eager", COLUMNS, rows, notes
    )
    common.print_table(COLUMNS, rows, baseline="eager (max_*_rel_diff)")


if __name__ == "__main__":
    main()
