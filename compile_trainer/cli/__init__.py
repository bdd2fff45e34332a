"""The ``compile-trainer`` command: ``explain`` and ``report``."""
