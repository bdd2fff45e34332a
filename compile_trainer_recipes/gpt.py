"""A nanoGPT-style decoder-only language model and its LightningModule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, length, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embeddings(nn.Module):
    """Token + position embedding."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))


class LMHead(nn.Module):
    """Final LayerNorm, the (tied) output projection and the cross-entropy loss, in one module so that a
    compiler can fuse them: the logits of a large vocabulary are the largest tensor of the model."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(
        self, x: torch.Tensor, targets: Optional[torch.Tensor] = None, ignore_index: int = -100
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)
        return logits, loss


class GPT(nn.Module):
    """Embeddings, ``n_layer`` Blocks, and the LM head with its loss."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = LMHead(config)
        self.head.lm_head.weight = self.embed.wte.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, ignore_index: int = -100
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets, ignore_index)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class LanguageModel(pl.LightningModule):
    """Trains a ``GPT`` on ``(inputs, targets)`` batches of token ids with AdamW and a warm-up + cosine schedule.

    ``train/loss`` is the mean training loss over each logging interval (``Trainer(log_every_n_steps=...)``),
    logged on the steps the logger writes: a step adds its loss on the device, and Lightning's logging
    machinery, which costs host time on every call, runs once an interval. ``log_loss_every_step`` logs each
    step's loss instead. ``fsdp_reshard_after_forward`` and ``fsdp_forward_prefetch``: FSDP2's settings under
    ``ModelParallelStrategy`` (``compile_and_shard``).
    """

    def __init__(
        self,
        model: GPTConfig | dict,
        lr: float = 1e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 20,
        decay_steps: int = 1000,
        weight_decay: float = 0.1,
        betas: Tuple[float, float] = (0.9, 0.95),
        fused: Optional[bool] = None,
        log_loss_every_step: bool = False,
        fsdp_reshard_after_forward: bool = True,
        fsdp_forward_prefetch: int = 0,
    ):
        super().__init__()
        config = model if isinstance(model, GPTConfig) else GPTConfig(**model)
        self.save_hyperparameters(ignore=["model"])
        self.hparams["model"] = vars(config)  # a plain dict, whether a GPTConfig or a dict was given
        self.model = GPT(config)
        self._interval_loss: Optional[torch.Tensor] = None  # summed since the last logged step
        self._interval_steps = 0

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        return self.model(idx, targets)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2, ``trainer=gpu_fsdp2``): the ``CompileCallback``'s policy applied,
        then the blocks and the model sharded (``compile_and_shard``, ``fsdp_*`` settings); nothing otherwise."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        from compile_trainer import CompileCallback

        if self._trainer is None or not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return  # load_from_checkpoint also calls it, with no trainer
        policies = [c.policy for c in self.trainer.callbacks if isinstance(c, CompileCallback)]
        policy = policies[0] if policies and policies[0].compiles_modules else None
        hparams = self.hparams
        compile_and_shard(
            self, self.model, policy, self.device_mesh["data_parallel"],
            reshard_after_forward=hparams.fsdp_reshard_after_forward, forward_prefetch=hparams.fsdp_forward_prefetch,
        )  # fmt: skip

    def _loss(self, batch) -> torch.Tensor:
        inputs, targets = batch
        return self.model(inputs, targets)[1]

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._log_train_loss(loss.detach(), batch_idx, batch_size=len(batch[0]))
        return loss

    def _log_train_loss(self, loss: torch.Tensor, batch_idx: int, batch_size: int) -> None:
        # Not on the progress bar: showing it reads the value back every step, a device sync that
        # starves the GPU (28.9 vs 20.9 ms a step for GPT-2 small on an H100, docs/BENCHMARKS.md).
        # The batch size given, Lightning does not search the batch for it (host time).
        trainer = self._trainer
        if trainer is None:  # a step outside fit (a FLOP count, a test): nothing to log to
            return
        if self.hparams.log_loss_every_step:
            self.log("train/loss", loss, batch_size=batch_size)
            return
        # A new tensor, not the loss itself: a CUDA-graph output is overwritten by the next step.
        self._interval_loss = loss.clone() if self._interval_loss is None else self._interval_loss + loss
        self._interval_steps += 1
        steps = (batch_idx + 1) % trainer.accumulate_grad_batches == 0  # the batch that steps the optimizer
        if steps and ((self.global_step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop):
            self.log("train/loss", self._interval_loss / self._interval_steps, batch_size=batch_size)
            self._interval_loss, self._interval_steps = None, 0

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas), fused=self.hparams.fused
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_factor(self, step: int) -> float:
        hparams = self.hparams
        return warmup_cosine_factor(step, hparams.warmup_steps, hparams.decay_steps, hparams.min_lr_ratio)


def warmup_cosine_factor(step: int, warmup: int, decay: int, min_ratio: float = 0.1) -> float:
    """The learning rate's factor at ``step``: linear warm-up over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at step ``decay``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def compile_and_shard(
    module: pl.LightningModule,
    model: nn.Module,
    policy,
    mesh,
    mp_policy=None,
    reshard_after_forward: bool = True,
    forward_prefetch: int = 0,
    blocks: Optional[Sequence[nn.Module]] = None,
) -> None:
    """FSDP2 in torchtitan's order, for a LightningModule's ``configure_model`` under ``ModelParallelStrategy``:
    the compile policy applied first (each block compiled in place; ``policy`` None: eager), then ``fully_shard``
    on each block (``model.blocks``, or ``blocks``) and on the model (the root: the embeddings and the head).
    ``CompileCallback(policy)`` adopts the policy applied here.

    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``; by default bf16 parameters with fp32 gradient reduction when
    the trainer runs bf16 (``bf16-mixed``, ``bf16-true``): the all-gathers move half the bytes, the reduction stays
    exact; no casting otherwise. ``reshard_after_forward``: free each block's gathered parameters after its forward
    and gather them again in the backward (False: one all-gather a step instead of two, for the blocks' parameters
    held from forward to backward); the last block is never resharded, as its backward starts at once (torchtitan).
    ``forward_prefetch``: each block's forward also issues the all-gathers of the next ``forward_prefetch`` blocks
    (FSDP2's explicit prefetch; 0: its implicit one). The settings are recorded for the callback's link plan."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from compile_trainer import apply_policy
    from compile_trainer.compiling.regions import APPLIED_ATTR
    from compile_trainer.telemetry.communication import FSDP2_SETTINGS_ATTR, Fsdp2Settings

    if isinstance(model, FSDPModule):  # configure_model runs again (a second fit): sharded already
        return
    if policy is not None and getattr(module, APPLIED_ATTR, None) is None:
        apply_policy(module, policy)
    if mp_policy is None:
        precision = str(module.trainer.precision) if module._trainer is not None else ""
        bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision.startswith("bf16") else {}
        mp_policy = MixedPrecisionPolicy(**bf16)
    blocks = list(model.blocks if blocks is None else blocks)
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # FSDP2 never reshards the root after its forward
    for index, block in enumerate(blocks[:-1] if forward_prefetch else []):
        block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 1 + forward_prefetch])
    stored = next(model.parameters()).dtype
    settings = Fsdp2Settings(
        param_dtype=str(mp_policy.param_dtype or stored).removeprefix("torch."),
        reduce_dtype=str(mp_policy.reduce_dtype or mp_policy.param_dtype or stored).removeprefix("torch."),
        reshard_after_forward=reshard_after_forward,
        reshard_last_block=False,
        forward_prefetch=forward_prefetch,
    )
    setattr(module, FSDP2_SETTINGS_ATTR, settings)
