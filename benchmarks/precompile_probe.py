"""Probe: can a region's Dynamo trace travel in a bundle? ``torch.compile(...).aot_compile`` on a region entry.

A new machine's first step is mostly Dynamo tracing every frame again (docs/compile_cache.md); ``aot_compile``
(Dynamo's bytecode, guards and compiled code, serialized) would skip it. The probe compiles 12 of the recipe's GPT-2
small blocks through one entry shaped like ``apply_policy``'s, trains a step under bf16 autocast, serializes, and
loads it in a fresh process with empty Inductor caches. Each line in its own process (``--mode reduce-overhead``:
CUDA graphs):

    python benchmarks/precompile_probe.py cold --mode default --out /tmp/probe
    python benchmarks/precompile_probe.py load --mode default --out /tmp/probe
    python benchmarks/precompile_probe.py load --mode default --load-under-autocast --out /tmp/probe
    python benchmarks/precompile_probe.py normal_cold --mode default --out /tmp/probe   # torch.compile, cold
    python benchmarks/precompile_probe.py normal_warm --mode default --out /tmp/probe   # on normal_cold's cache

``first_step_s`` of the normal phases includes their compile (Dynamo and the backend, at the first call).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import GPT2_SMALL  # noqa: E402
from recipes.gpt import Block  # noqa: E402


def _call_region(module: nn.Module, *args, **kwargs):
    return module._call_impl(*args, **kwargs)


ENTRY = types.FunctionType(
    _call_region.__code__.replace(co_name="compiled_region__Block", co_qualname="compiled_region__Block"),
    _call_region.__globals__,
    "compiled_region__Block",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", choices=["cold", "load", "normal_cold", "normal_warm"])
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--load-under-autocast", action="store_true", help="deserialize inside the step's autocast")
    args = parser.parse_args()
    # normal_warm: the normal compile on normal_cold's Inductor cache (what a bundle hit costs today)
    directory = "normal_cold" if args.phase == "normal_warm" else args.phase
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"/tmp/precompile_probe_{directory}_{args.mode}"
    if args.phase != "normal_warm":
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    started = time.perf_counter()  # the compiler stack's import, which any first compile pays: timed apart
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import triton  # noqa: F401
    from torch._dynamo.aot_compile import AOTCompiledFunction

    compiler_import_s = time.perf_counter() - started

    if hasattr(torch._dynamo.config, "enable_aot_compile"):  # torch 2.11 hides .aot_compile behind it
        torch._dynamo.config.enable_aot_compile = True
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block(GPT2_SMALL) for _ in range(12)]).cuda()
    x = torch.randn(8, 1024, 768, device="cuda", requires_grad=True)

    def step(run) -> torch.Tensor:
        if args.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = x
            for block in blocks:
                h = run(block, h)
            loss = h.float().pow(2).mean()
        loss.backward()
        return loss

    result = {"torch": torch.__version__, "phase": args.phase, "mode": args.mode}
    result["load_under_autocast"] = args.load_under_autocast if args.phase == "load" else None
    result["compiler_import_s"] = compiler_import_s
    path = args.out / f"region_{args.mode}.bin"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        if args.phase == "cold":
            kwargs = {} if args.mode == "default" else {"mode": args.mode}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                compiled = torch.compile(ENTRY, fullgraph=True, **kwargs).aot_compile(((blocks[0], x), {}))
            result["compile_s"] = time.perf_counter() - started
            path.write_bytes(type(compiled).serialize(compiled).serialized_data)
            result["bytes"] = path.stat().st_size
        elif args.phase.startswith("normal"):
            kwargs = {} if args.mode == "default" else {"mode": args.mode}
            compiled_calls = {}

            def compiled(block: nn.Module, h: torch.Tensor) -> torch.Tensor:  # apply_policy's shape: one entry
                if block not in compiled_calls:
                    compiled_calls[block] = torch.compile(types.MethodType(ENTRY, block), **kwargs)
                return compiled_calls[block](h)

        else:
            autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.load_under_autocast)
            with autocast:  # the guards are rebuilt at load, under the state of that moment
                compiled = AOTCompiledFunction.deserialize(path.read_bytes(), f_globals=ENTRY.__globals__)
            result["load_s"] = time.perf_counter() - started
        started = time.perf_counter()
        result["loss"] = float(step(compiled))
        torch.cuda.synchronize()
        result["first_step_s"] = time.perf_counter() - started
        result["outcome"] = "ok"
    except Exception as error:  # the finding is the error: recorded, the probe goes on to write its row
        result["outcome"] = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
    print(json.dumps(result))
    suffix = "_autocast" if args.load_under_autocast else ""
    (args.out / f"{args.phase}_{args.mode}{suffix}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
