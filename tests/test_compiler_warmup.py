"""The compiler warm-up: torch's and Triton's key hashes computed in a background thread, once per process."""

from compile_trainer import compat
from compile_trainer.compiling.compiler_warmup import CompilerWarmup, start_compiler_warmup


def test_warmup_computes_the_keys_the_compile_reads_once_per_process():
    warmup = start_compiler_warmup()
    assert start_compiler_warmup() is warmup, "one warm-up per process"
    assert warmup.join(timeout=300), "the thread finishes"
    assert warmup.error is None and warmup.seconds is not None and warmup.seconds >= 0
    assert warmup.summary() == {"compiler_warmup_s": warmup.seconds, "compiler_warmup_error": None}
    functions = compat.compiler_key_functions()
    assert len(functions) == 2, "torch's key and Triton's (triton is installed with the dev extra)"
    keys = [function() for function in functions]
    assert all(keys) and keys == [function() for function in functions], "cached values, the same on every call"


def test_a_failing_hash_is_recorded_never_raised(monkeypatch):
    def broken():
        raise OSError("libtriton.so: permission denied")

    monkeypatch.setattr(compat, "compiler_key_functions", lambda: [broken])
    warmup = CompilerWarmup().start()
    assert warmup.join(timeout=60)
    assert warmup.error == "OSError: libtriton.so: permission denied" and warmup.seconds is not None
