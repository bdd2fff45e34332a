"""Train a bundled recipe under a compile policy: ``python train.py compile=regional trainer.max_steps=50``."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from compile_trainer.runs.hydra_configs import exit_on_bad_command_line, input_errors_exit, register_configs


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    # Imported once the command line is checked: Lightning and W&B take seconds to import.
    from compile_trainer.runs.recorder import sweeper_value
    from compile_trainer.runs.training import train

    with input_errors_exit(cfg):  # a bad policy or setting: one screen and status 2, before the run starts
        return sweeper_value(train(cfg))  # the objective, for Hydra's sweepers (Optuna)


if __name__ == "__main__":
    exit_on_bad_command_line(sys.argv[1:], Path(__file__).resolve().parent / "conf")
    register_configs()  # after the command line's check: the Trainer's schema imports Lightning (seconds)
    main()
