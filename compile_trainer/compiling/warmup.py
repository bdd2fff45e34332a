"""Inductor's per-process start-up, begun when a policy is declared rather than at the first compile.

Two things Inductor does once per process, at its first compile or compile-cache load, on the critical path of
the first step: hash torch's and Triton's installation for its cache keys (about 0.6 s on an H100 machine, torch
2.11), and start its pool of Triton compile workers, which took 20-23 s there to be ready. Until the pool is
ready, Triton kernels compile one by one in the compiling thread: a cold regional compile of the HF Llama, whose
first graphs are lowered seconds after its first step starts, compiled for 4.7 s there and waited 3.1 s.
``start_compiler_warmup`` begins both as soon as a policy that compiles with Inductor is declared, so that the
user's model building and the Trainer's set-up overlap them, and has the workers forked from this process, which
has torch imported already: the pool is then ready in under a second (``compat.fork_compile_workers``;
``TORCHINDUCTOR_WORKER_START=subprocess`` keeps Inductor's default).
"""

from __future__ import annotations

import torch

from compile_trainer import compat
from compile_trainer.schema import CompilePolicy


def uses_inductor(policy: CompilePolicy) -> bool:
    """Whether anything ``policy`` compiles goes through Inductor (its backend or a rule's, or its optimizer's)."""
    backends = [policy.backend, *(rule.backend for rule in policy.rules), policy.optimizer.backend]
    compiles = policy.compiles_modules or policy.optimizer.compile != "false"
    return compiles and "inductor" in {backend or policy.backend for backend in backends}


def start_compiler_warmup(policy: CompilePolicy) -> None:
    """On a GPU, prefetch Inductor's cache keys and start its compile-worker pool (both once per process). With a
    compile cache the pool is left to Inductor: a run the cache serves compiles nothing and needs no workers. Neither
    changes what is compiled or how: Inductor would do both at its first compile."""
    if not uses_inductor(policy) or not torch.cuda.is_available():  # measured on GPUs; on a CPU both are noise
        return
    compat.prefetch_compiler_keys()
    if not policy.cache.active:
        compat.fork_compile_workers()
        compat.warm_compile_workers()
