"""``python -m compile_trainer explain ...``."""

import sys

from compile_trainer.cli.main import main

sys.exit(main())
