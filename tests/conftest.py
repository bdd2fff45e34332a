import fnmatch
import os
from typing import Optional

# Under `pytest -n N` (README: -n 2 on two cores) the workers share the cores: one thread each, inherited by the
# processes the tests start. Two workers with two OpenMP threads each spin against each other: a file run twice at
# once took 47 s a copy, 33 s with one thread (2026-11-26).
ONE_THREAD = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if ONE_THREAD:
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if ONE_THREAD:
    torch.set_num_threads(1)

# Without a GPU, the optimizer's Triton kernel runs through Triton's interpreter (tests/test_optimizer_triton.py).
# Set before lightning imports triton: triton.jit reads it when it decorates (triton's own library included).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
from torch import nn  # noqa: E402

from compile_trainer_recipes.gpt import GPT, GPTConfig  # noqa: E402

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")


# Test files that take a minute or more on two cores (measured 2026-11-25, longest first). Under `-n 2 --dist loadfile`
# a worker takes a whole file whenever it is free: these go out first, so that no worker ends up alone on one of them
# at the end while the other has finished.
LONG_FILES = (
    "test_shapes_hf.py", "test_train_distributed.py", "test_fsdp2.py", "test_distributed.py", "test_user_code_once.py",
    "test_distributed_cache.py", "test_compile_cache.py",
    "test_optimizer.py", "test_train_script.py", "test_shapes_training.py", "test_compile_cache_benchmark.py",
    "test_real_models.py", "test_distributed_benchmark.py", "test_train_step_benchmark.py", "test_sweep.py",
    "test_hf_varlen_benchmark.py", "test_lightning_dropin_benchmark.py", "test_block_values.py",
    "test_runnable_examples.py",
)  # fmt: skip


# Three tiers of their own, which the README's library suite leaves out
# (``-m "not benchmarks and not distributed and not vision"``): the GPU benchmark scripts' tests (their CPU smoke
# modes, the harness they share) and the tests that start several processes over gloo (DDP, FSDP2), which CI runs after
# it (``-m "benchmarks or distributed"``); together about half of the whole suite's time on 2 cores, which took 709 s to
# 1,555 s there depending on the machine's load (2026-11-27). And timm's vision models as their recipes train them
# (the vision benchmark's smoke mode with them), which need timm, and timm torchvision: PyPI's torchvision does not
# import beside the CPU torch 2.13, so CI runs them in .ci/torch_versions.sh's torch 2.14.1 environment. A tier's test
# is marked by the first tier whose pattern its file or name matches (vision before benchmarks). The vision files import
# timm inside their tests, not at collection: the README's suite collects every file before it deselects a tier.
TIERS = {
    "vision": ("test_vision_*.py",),
    "benchmarks": ("*_benchmark.py", "test_benchmark_harness.py",
                   "test_optimizer.py::test_benchmark_smoke_runs_without_config_packages"),
    "distributed": ("test_distributed.py", "test_distributed_cache.py", "test_distributed_telemetry.py",
                    "test_fsdp2.py", "test_train_distributed.py", "test_link.py::test_probe_link_*gloo_group"),
}  # fmt: skip


def tier_of(item: pytest.Item) -> Optional[str]:
    names = (item.path.name, f"{item.path.name}::{item.name}")
    for tier, patterns in TIERS.items():
        if any(fnmatch.fnmatch(name, pattern) for name in names for pattern in patterns):
            return tier
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "benchmarks: a test of a GPU benchmark script (its CPU smoke mode)")
    config.addinivalue_line("markers", "distributed: a test that starts several processes (DDP, FSDP2 over gloo)")
    config.addinivalue_line("markers", "vision: timm's vision models (needs timm and torchvision)")


def pytest_collection_modifyitems(items):
    """Each item of a tier marked (``TIERS``); the long files first (``LONG_FILES``), the others after them in their
    own order."""
    for item in items:
        tier = tier_of(item)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
    rank = {name: index for index, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty Dynamo caches, no compilation metrics of earlier tests (they are process-wide, and
    reset() keeps them) and its default recompile limit."""
    torch._dynamo.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    limit = torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = limit


TINY_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16)


@pytest.fixture
def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY_GPT)


class Wrapper(nn.Module):
    """A LightningModule-like root: the model under ``model`` plus a head without blocks."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.head = nn.Linear(4, 4)


def quiet_cpu_trainer(**trainer_args) -> pl.Trainer:
    """A real Trainer on the CPU without logging, checkpoints, progress bar or validation, unless asked for."""
    defaults = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        accelerator="cpu",
    )
    return pl.Trainer(**(defaults | trainer_args))
