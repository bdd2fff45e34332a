"""Runs of the bundled recipes: ``train.py``'s job, Hydra's schemas, each run's result file, sweeps and the
report comparing them, and reading back a W&B offline run."""
