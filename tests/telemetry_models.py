"""Small models with known graph breaks, for the telemetry and ``explain`` tests (importable by path)."""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 8


class CleanBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class ItemBreakBlock(CleanBlock):
    def forward(self, x):
        x = self.lin(x)
        if x.sum().item() > 0:  # graph break: item
            x = x * 2
        return x


class PrintBreakBlock(CleanBlock):
    def forward(self, x):
        x = self.lin(x)
        print("x", tuple(x.shape))  # graph break: print
        return x


class Net(nn.Module):
    def __init__(self, block: type = CleanBlock, n_blocks: int = 2):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(n_blocks))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)  # calls each block
        return self.head(x)


def line_of(marker: str) -> int:
    """The line of this file holding ``marker`` in a comment."""
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, 1) if line.rstrip().endswith(f"# {marker}"))


def items_in_batch(batch) -> int:
    """An ``items_fn`` for the telemetry: every input value counts as an item."""
    return batch[0].numel()


class TinyRegression(pl.LightningModule):
    """A LightningModule that brings its own random data, as ``explain --module`` expects."""

    block: type = CleanBlock

    def __init__(self, n_batches: int = 8, batch_size: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(self.block)
        self.n_batches, self.batch_size = n_batches, batch_size

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        count = self.n_batches * self.batch_size
        data = TensorDataset(torch.randn(count, WIDTH, generator=generator), torch.randn(count, 1, generator=generator))
        return DataLoader(data, batch_size=self.batch_size)


class BrokenRegression(TinyRegression):
    block = ItemBreakBlock


def clean_regression() -> TinyRegression:
    return TinyRegression()
