"""The bundled Hydra configs, installed as ``compile_trainer.conf``: a project of its own composes them with
``hydra.searchpath: [pkg://compile_trainer.conf]`` (``python src/train.py compile=regional``).

Hydra imports this package when it reads the search path (and reads a package without an ``__init__.py`` as
unavailable); the import registers the schemas that the bundled policy and telemetry files' defaults lists name
(``compile/schema``, ``telemetry/schema``), so such a project needs no code of its own for them.
"""

from compile_trainer.runs.hydra_configs import register_group_schemas

register_group_schemas()
