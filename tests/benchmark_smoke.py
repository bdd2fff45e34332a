"""Run a benchmark script's CPU smoke mode as on the GPU image: without hydra, omegaconf or wandb."""

import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
WITHOUT_CONFIG_PACKAGES = (
    "import runpy, sys\n"
    "for name in ('hydra', 'omegaconf', 'wandb'):\n"
    "    sys.modules[name] = None  # importing them now fails, as where they are not installed\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run_without_config_packages(script: List[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """``python script...`` from the repository root, with hydra/omegaconf/wandb unimportable; must succeed."""
    command = [sys.executable, "-c", WITHOUT_CONFIG_PACKAGES, *script]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result
