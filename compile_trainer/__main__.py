"""``python -m compile_trainer explain ...``."""

import sys

from compile_trainer.cli import main

sys.exit(main())
