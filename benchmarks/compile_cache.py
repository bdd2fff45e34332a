"""Compile cache: time to the first step cold, on the same machine, and on a new machine that loads a bundle.

Per model (the recipe's ``gpt2_small``, the HF Llama; 8 x 1024 tokens, bf16, fused AdamW) and policy (``regional``,
``full`` with reduce-overhead), phases each in a fresh process: ``cold`` (empty Inductor/Triton caches; compiles,
captures the precompiled artifacts, writes the bundle after step 3, trains 2 more steps), ``cold_no_cache`` (the cache
off: the base of ``vs_full_cold``), ``same_machine`` (the cold phase's Inductor/Triton caches, the cache off),
``new_machine_mega`` (empty caches, the bundle's mega-cache only), ``new_machine_traced`` (mega-cache and cache
directories, no precompiled artifacts), ``new_machine`` (the whole bundle) and ``eager``.

    python benchmarks/compile_cache.py --models gpt2_small --phases cold cold_no_cache same_machine new_machine
    python benchmarks/compile_cache.py --smoke --models gpt2_small --policies regional --out /tmp/x  # CPU, Inductor
"""

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

STARTED = time.perf_counter()

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from compile_trainer import apply_policy, to_policy  # noqa: E402
from compile_trainer.cache.session import CompileCache  # noqa: E402
from compile_trainer.telemetry.compile_events import CompileTelemetry  # noqa: E402
from compile_trainer_recipes.gpt import GPT, GPTConfig  # noqa: E402

MODELS = ("gpt2_small", "llama")
POLICIES = ("regional", "full")
PHASES = ("cold", "cold_no_cache", "same_machine", "new_machine_mega", "new_machine_traced", "new_machine", "eager")
LAYERS = {"new_machine_mega": ["mega_cache"], "new_machine_traced": ["mega_cache", "cache_dirs"]}  # else all
CACHE_MODES = {"cold": "read-write", "same_machine": "off", "cold_no_cache": "off"}  # else read-only
SMOKE = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
POLICY_OVERRIDES = {"full": {"mode": "reduce-overhead"}}
# the bundle is written after the third step (forward, backward and optimizer all compiled), its captures run then;
# two more steps follow, so the losses show whether training goes on as before after a capture (CUDA graphs too)
STEPS = 3
COLUMNS = """model policy phase first_step_s vs_cold vs_full_cold load_s compile_s dynamo_s backend_s run_s cache
fx_graph_hit_miss precompiled_hit_miss capture_s bundle_mb save_s startup_s compiler_import_s
loss_rel_diff_vs_cold error""".split()


def build(name: str, smoke: bool, device: torch.device) -> nn.Module:
    """The model (random weights, dropout off) whose ``forward(tokens)`` returns the loss."""
    with device:
        model = models.build_model("llama", smoke)[0] if name == "llama" else GPT(SMOKE if smoke else models.GPT2_SMALL)
    return models.TokenLoss(model, hf=name == "llama")


def run_phase(args: argparse.Namespace) -> Dict[str, Any]:
    """One phase, in this (fresh) process."""
    device = common.device_for(args.smoke)
    torch.manual_seed(0)
    holder = nn.ModuleDict({"model": build(args.model, args.smoke, device)})
    holder.to(device).train()
    vocab, length, batch = (256, 32, 2) if args.smoke else (32000 if args.model == "llama" else 50304, 1024, 8)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(vocab, (batch, length + 1), generator=generator).to(device) for _ in range(STEPS + 2)]
    optimizer = torch.optim.AdamW(holder.parameters(), lr=1e-4, fused=device.type == "cuda")
    cache_settings = {"dir": args.cache_dir, "mode": CACHE_MODES.get(args.phase, "read-only")}
    cache_settings |= {"layers": LAYERS[args.phase]} if args.phase in LAYERS else {}
    policy = to_policy(args.policy, cache=cache_settings, **POLICY_OVERRIDES.get(args.policy, {}))
    if args.phase == "eager":
        policy = to_policy(policy, enabled=False, cache={"mode": "off"})
    compiler_import_s = import_compiler(device)
    startup = time.perf_counter() - STARTED

    common.synchronize(device)
    started = time.perf_counter()
    cache = CompileCache(policy.cache)
    cache.load(holder, policy, device)
    applied = apply_policy(holder, policy)
    cache.attach(applied)
    telemetry = CompileTelemetry(applied).install()
    train = common.training_step(optimizer, holder["model"], device, applied)
    losses = []
    for index, tokens in enumerate(batches):
        if index == STEPS:  # the bundle written, captures included; the steps after: training goes on after them
            telemetry.collect()
            compile_s, compiles = telemetry.compile_time_s, telemetry.totals()["compiles"]
            cache.save([item.region.name for item in applied.compiled], compile_s, final=True)
        losses.append(float(train(tokens)))
        if index == 0:
            common.synchronize(device)
            first_step = time.perf_counter() - started
            first_load_s = cache.precompiled.load_s if cache.precompiled is not None else 0.0  # within the step
    telemetry.uninstall()
    summary = cache.summary(compile_s)
    dynamo_s, backend_s = compile_phases()
    load_s = (summary.get("cache_load_s") or 0) + first_load_s
    precompiled = f"{summary.get('cache_precompiled_hits')}/{summary.get('cache_precompiled_misses')}"
    precompiled = precompiled if "cache_precompiled_hits" in summary else summary.get("cache_precompiled_off")
    return {
        "first_step_s": first_step,
        "load_s": load_s,
        "compile_s": compile_s,
        "compiles": compiles,  # the frames Dynamo compiled (not a column: the count the CPU smoke test checks)
        "dynamo_s": dynamo_s,
        "backend_s": backend_s,
        "run_s": first_step - load_s - compile_s,
        "capture_s": summary.get("cache_precompiled_capture_s") or None,
        "compiler_import_s": compiler_import_s,
        "cache": summary["cache_status"] + (f" ({summary['cache_reason']})" if summary.get("cache_reason") else ""),
        "fx_graph_hit_miss": f"{summary.get('cache_fx_graph_hits', 0)}/{summary.get('cache_fx_graph_misses', 0)}",
        "precompiled_hit_miss": precompiled,
        "precompiled_skipped": summary.get("cache_precompiled_skipped"),  # region -> why it was not captured
        "bundle_mb": (cache.outcome.bundle_bytes or cache.outcome.saved_bytes) / 1e6 or None,
        "save_s": summary.get("cache_save_s") or None,
        "startup_s": startup,
        "losses": losses,
    }


def import_compiler(device: torch.device) -> float:
    """Seconds to import the compiler stack (Dynamo, AOTAutograd, Inductor, Triton): a process pays it at its
    first compile whatever its caches hold, so it is timed apart, before the first step's clock starts."""
    started = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    if device.type == "cuda":
        import triton  # noqa: F401
    return time.perf_counter() - started


def compile_phases() -> Tuple[float, float]:
    """Dynamo's own seconds (tracing, guards: a frame's compile less its backend's) and the backend's (AOTAutograd
    and Inductor, their caches' loads included, backward compiles too), from Dynamo's compilation metrics."""
    from torch._dynamo.utils import get_compilation_metrics

    dynamo = backend = 0.0
    for metric in get_compilation_metrics():
        frame = (getattr(metric, "dynamo_cumulative_compile_time_us", None) or 0) / 1e6
        aot = (getattr(metric, "aot_autograd_cumulative_compile_time_us", None) or 0) / 1e6
        backward = (getattr(metric, "backward_cumulative_compile_time_us", None) or 0) / 1e6
        dynamo += max(frame - aot, 0.0)
        backend += aot + backward
    return dynamo, backend


def finish(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``vs_cold`` against the same model and policy's cold phase; ``vs_full_cold``: the first step over the ``full``
    cold compile of its model without the cache (``cold_no_cache``)."""
    cold = {(r["model"], r["policy"]): r for r in rows if r["phase"] == "cold" and "first_step_s" in r}
    for row in rows:
        base = cold.get((row["model"], row["policy"]))
        if base and "first_step_s" in row:
            row["vs_cold"] = row["first_step_s"] / base["first_step_s"]
            row["loss_rel_diff_vs_cold"] = common.rel_diff(row["losses"], base["losses"])
    full_without_cache = lambda row: (row["policy"], row["phase"]) == ("full", "cold_no_cache")  # noqa: E731
    return common.add_ratio(rows, "vs_full_cold", "first_step_s", full_without_cache, group=lambda row: row["model"])


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Each model and policy's phases, cold first; a phase's Inductor and Triton caches are its machine's (the
    cold phase's for same_machine), the bundles in one folder."""
    return [
        {"model": model, "policy": policy, "phase": phase, "_cache_dir": str(args.scratch / "bundles")}
        | {"_caches": args.scratch / f"{model}_{policy}_{'cold' if phase == 'same_machine' else phase}"}
        for model, policy in itertools.product(args.models, args.policies)
        for phase in ["cold", *(p for p in args.phases if p != "cold")]
    ]


BENCHMARK = common.Benchmark(
    name="compile_cache",
    title="Compile cache: cold vs same machine vs new machine",
    columns=COLUMNS,
    runs=runs,
    measure=run_phase,
    shared=dict(timeout=240),
    options={
        "--models": dict(nargs="+", choices=MODELS, default=list(MODELS)),
        "--policies": dict(nargs="+", choices=POLICIES, default=list(POLICIES)),
        "--phases": dict(nargs="+", choices=PHASES, default=list(PHASES), help="cold always runs first"),
    },
    finish=finish,
    notes=lambda args, rows: [
        "Each phase a fresh process; first_step_s counts the bundle's load, the compile and the first step "
        "(forward, backward, optimizer); startup_s (imports, model construction) is not counted.",
        "new_machine*: empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, the bundle the cold phase wrote; "
        "new_machine_mega loads only its mega-cache (torch.compiler.load_cache_artifacts).",
        "full runs with mode reduce-overhead (CUDA graphs), like regional.",
        "precompiled_hit_miss: region calls served by a precompiled artifact / calls that compiled; capture_s: the "
        "cold phase's captures after its steps (aot_compile of each region call that compiled; not in first_step_s).",
    ],
    key=("model", "policy", "phase"),
    baseline="cold (vs_cold), full's cold compile (vs_full_cold)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
