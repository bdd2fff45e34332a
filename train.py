"""Train a bundled recipe under a compile policy: ``python train.py compile=regional trainer.max_steps=50``."""

import hydra
from omegaconf import DictConfig

from compile_trainer.runs.hydra_configs import register_configs
from compile_trainer.runs.recorder import sweeper_value
from compile_trainer.runs.training import train

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return sweeper_value(train(cfg))  # the objective, for Hydra's sweepers (Optuna)


if __name__ == "__main__":
    main()
