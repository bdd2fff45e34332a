"""Which knob fixes a compile event: a policy setting, a rule, or a change in the model's code."""

from __future__ import annotations


def suggest_fix(kind: str, reason: str) -> str:
    """Which knob fixes an event: a policy setting, a rule, or a change in the model's code."""
    text = reason.lower()
    if kind == "cudagraph_skip":
        return (
            "CUDA graphs need a graph on the GPU without CPU tensors or mutated inputs; "
            "move what Inductor names out of the region (an `eager` rule), or drop `mode: reduce-overhead` for it"
        )
    if kind == "eager_fallback":
        if "graph break in loop" in text:
            return (
                "Dynamo cannot resume after a graph break inside a loop, so the whole frame runs eagerly: remove the "
                "break, or compile the loop's blocks as regions (action `regional`) so the eager part sits between them"
            )
        return "the whole frame runs eagerly: " + suggest_fix("graph_break", reason)
    if kind == "graph_break":
        if "torch.compiler.disable" in text:
            return (
                "declared by an `eager` rule (or torch.compiler.disable): move the rule to a region boundary or drop it"
            )
        if "item()" in text or "capture_scalar_outputs" in text:
            return (
                "keep the value a tensor (torch.where instead of `if t.item()`), or set "
                "torch._dynamo.config.capture_scalar_outputs=True; or give the module an `eager` rule"
            )
        if "print" in text or "logging" in text or "logger" in text:
            return "remove print/logging from forward, or list it in torch._dynamo.config.reorderable_logging_functions"
        if "data-dependent" in text or "data dependent" in text:
            return "data-dependent control flow: use torch.where/torch.cond, or give the module an `eager` rule"
        return (
            "give the module an `eager` rule so the break sits at a region boundary, or set `fullgraph: true` on "
            "its rule to get the full error at compile time"
        )
    if "size mismatch" in text or "stride mismatch" in text or "<=" in text:
        return (
            "shapes vary: mark the dimension dynamic (a mark_dynamic entry in the policy's shapes.dynamic, or "
            "`dynamic: true`), or pad batches to a few bucket lengths (shapes.pad; see compile=dynamic and "
            "compile=buckets); for a smaller last batch use drop_last=True"
        )
    if "requires_grad" in text or "grad_mode" in text or "global_state" in text:
        return "grad mode changed (e.g. validation runs under no_grad): one extra graph per mode, expected"
    if "dtype mismatch" in text:
        return "inputs change dtype: keep one dtype (check autocast/precision settings)"
    if "device mismatch" in text:
        return "inputs change device: move every batch to the model's device before the compiled call"
    return (
        "a Python value the region depends on changed (an int/float argument, an attribute, a branch on data): "
        "pass it as a tensor, give the module an `eager` rule, or raise `recompile_limit` if the variants are few"
    )
