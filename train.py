"""Train a bundled recipe under a compile policy: ``python train.py compile=regional trainer.max_steps=50``."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from compile_trainer.runs.hydra_configs import exit_on_unknown_keys, register_configs
from compile_trainer.runs.recorder import sweeper_value
from compile_trainer.runs.training import train

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return sweeper_value(train(cfg))  # the objective, for Hydra's sweepers (Optuna)


if __name__ == "__main__":
    exit_on_unknown_keys(sys.argv[1:], Path(__file__).resolve().parent / "conf")
    main()
