"""Which knob fixes a compile event: a policy setting, a rule, or a change in the model's code."""

from __future__ import annotations

import re


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
    return recompile_fix(reason)


# A guard on the region's own module (``L['self']`` / ``L['module']``: its attributes or parameters).
MODULE_GUARD = re.compile(r"L\['(self|module)'\]|_modules\[|_parameters\[|_buffers\[")
INPUT_SIZE = re.compile(r"size mismatch at index (\d+)")


def recompile_fix(guard: str, shared_by: int = 1) -> str:
    """The knob that fixes a recompile whose failed guard is ``guard``, for a region whose entry ``shared_by``
    modules share."""
    text = guard.lower()
    if "layer_idx" in text or "layer_index" in text:
        return (
            "the blocks read their own index: a Hugging Face decoder does where a KV cache reaches them through the "
            "shared entry (a training call passing use_cache=True or a cache); pass use_cache=False there (or set "
            "model.config.use_cache = False) so they share one graph"
        )
    if "problem_type" in text:
        return (
            "a Hugging Face classification head sets config.problem_type at its first loss: set it in the config "
            "(problem_type='single_label_classification', 'multi_label_classification' or 'regression') to compile "
            "once"
        )
    if MODULE_GUARD.search(guard):
        if shared_by > 1:
            return (
                f"the {shared_by} modules sharing this compiled entry differ in what the guard reads; split the "
                "group: give the differing blocks a rule of their own (`action: full`), or make the value a "
                "tensor or a constant"
            )
        return "a value of the module changed between calls: keep it constant during training, or make it a tensor"
    size = INPUT_SIZE.search(guard)
    if size is not None and size.group(1) == "0":
        return (
            "the batch size changed (a smaller last batch, or another batch size in validation): drop_last=True "
            "in the DataLoader, or mark dim 0 dynamic (shapes.dynamic: [{entry: ..., dim: 0}])"
        )
    if "stride mismatch" in text:
        return (
            "an input's memory layout changed between calls (a transposed or channels-last tensor, or a dimension "
            "of size 1 laid out another way): make the input contiguous (.contiguous()) before the region, or "
            "give the module an `eager` rule"
        )
    if size is not None or "<=" in text or ">=" in text:
        return (
            "the sequence length (or another size) varies: compile=dynamic (mark it dynamic from the first "
            "compile) or compile=buckets (pad to a few lengths, one static graph each)"
        )
    if "dtype mismatch" in text:
        return "inputs change dtype: keep one dtype (check autocast/precision settings)"
    if "device mismatch" in text:
        return "inputs change device: move every batch to the model's device before the compiled call"
    return (
        "a Python value the region depends on changed (an int/float argument, an attribute, a branch on data): "
        "pass it as a tensor, or give the module an `eager` rule; if the variants are few and expected, raise "
        "the policy's recompile_limit"
    )
