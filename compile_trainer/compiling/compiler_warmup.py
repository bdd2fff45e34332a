"""Hash the compiler's installation in a background thread, before the first compile asks for it.

Every process pays at its first Inductor compile, whatever its caches hold, for the hashes that key Inductor's and
AOTAutograd's caches: torch's sources and Triton's sources and library (the library alone is about half a
gigabyte). In a fresh process on the H100 image (torch 2.11, 2026-11-24) they took 0.28 s and 0.88 s: a third of
a first step that loads everything else from a bundle. They depend only on the installation and torch keeps them
per process, so computing them early changes when they are computed, never what they are. The work is mostly
file reads and SHA-256 over large buffers, which release the GIL: the thread runs beside Lightning's setup, the
bundle's load and Dynamo's tracing. ``CompileCallback`` starts it at setup; without Lightning, call
``start_compiler_warmup()`` as early as you like.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional

from compile_trainer import compat


class CompilerWarmup:
    """One background computation of the compiler's key hashes; ``summary()`` says how long it took."""

    def __init__(self) -> None:
        self.seconds: Optional[float] = None
        self.error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="compile_trainer-compiler-warmup", daemon=True)

    def start(self) -> CompilerWarmup:
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            for compute in compat.compiler_key_functions():
                compute()
        except Exception as error:  # only a head start: the first compile computes whatever is missing itself
            self.error = f"{type(error).__name__}: {error}"
        self.seconds = time.perf_counter() - started

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> bool:
        self._thread.join(timeout)
        return self.done

    def summary(self) -> Dict[str, Any]:
        return {"compiler_warmup_s": self.seconds, "compiler_warmup_error": self.error}


_warmup: Optional[CompilerWarmup] = None
_lock = threading.Lock()


def start_compiler_warmup() -> CompilerWarmup:
    """The process's warm-up, started on the first call (later calls return the same one)."""
    global _warmup
    with _lock:
        if _warmup is None:
            _warmup = CompilerWarmup().start()
        return _warmup
