"""Compile telemetry: graph breaks, recompiles and the recompile limit, read from Dynamo's own records."""

import functools
import logging

import pytest
import torch

from compile_trainer import apply_policy, compat, to_policy
from compile_trainer.telemetry.compile_events import CompileTelemetry
from tests import telemetry_models as models


def run_regional(model, *inputs, backend="eager", **policy):
    applied = apply_policy(
        model, to_policy({"rules": [{"name": "blocks", "action": "regional"}], "backend": backend, **policy})
    )
    telemetry = CompileTelemetry(applied).install()
    try:
        for x in inputs:
            model(x).sum().backward() if x.requires_grad else model(x)
        telemetry.collect()
    finally:
        telemetry.uninstall()
    return telemetry


@pytest.mark.parametrize(
    "block, reason, marker",
    [
        (models.ItemBreakBlock, "Tensor.item()", "graph break: item"),
        (models.PrintBreakBlock, "builtin operator `print`", "graph break: print"),
    ],
)
def test_graph_break_reported_with_reason_location_and_module(block, reason, marker, capsys):
    telemetry = run_regional(models.Net(block), torch.randn(4, models.WIDTH), torch.randn(4, models.WIDTH))
    breaks = telemetry.graph_breaks()
    assert len(breaks) == 1, [b.location for b in breaks]
    found = breaks[0]
    assert reason in found.reason
    assert found.location == f"{models.__file__}:{models.line_of(marker)}"
    assert found.function == "forward" and found.region == "blocks" and not found.declared
    assert found.count >= 1 and found.step is None
    assert telemetry.owner(found.location) == f"blocks.0 and 1 more ({block.__name__})"
    assert telemetry.totals()["graph_breaks"] == 1
    events = [e for e in telemetry.events if e.kind == "graph_break"]
    assert len(events) == 1 and events[0].location == found.location
    report = telemetry.format_report()
    assert found.location in report and "fix:" in report


def test_eager_rule_break_is_declared_and_not_counted_as_a_graph_break():
    model = torch.nn.Sequential(models.Net())
    policy = to_policy({"rules": [{"name": "0"}, {"name": "0.blocks.1", "action": "eager"}], "backend": "eager"})
    telemetry = CompileTelemetry(apply_policy(model, policy)).install()
    model(torch.randn(4, models.WIDTH))
    telemetry.collect()
    telemetry.uninstall()
    breaks = telemetry.graph_breaks()
    assert len(breaks) == 1 and breaks[0].declared and breaks[0].region == "0"
    assert breaks[0].location == f"{models.__file__}:{models.line_of('calls each block')}"
    assert telemetry.totals()["graph_breaks"] == 0 and telemetry.totals()["declared_graph_breaks"] == 1
    # The break sits in a loop, so Dynamo cannot resume: Net.forward falls back to eager, and says so (torch 2.9
    # records such a frame as one without tensor code: nothing is reported there, rather than a guess)
    fallbacks = [e for e in telemetry.events if e.kind == "eager_fallback"]
    reported = compat.reports_frames_run_eagerly_at_a_loop_break()
    assert [e.region for e in fallbacks] == (["0"] if reported else [])


def test_shape_change_is_reported_as_a_recompile_with_its_guard():
    telemetry = run_regional(models.Net(), torch.randn(4, models.WIDTH), torch.randn(6, models.WIDTH), dynamic=False)
    recompiles = [e for e in telemetry.events if e.kind == "recompile"]
    assert len(recompiles) == 1
    event = recompiles[0]
    assert event.region == "blocks" and event.compile_id.endswith("/1")
    assert "size mismatch at index 0. expected 4, actual 6" in event.reason
    assert "batch size changed" in event.fix and "drop_last" in event.fix, "index 0: the fix for a batch dimension"
    stats = telemetry.regions["blocks"]
    assert (stats.compiles, stats.recompiles, stats.graphs) == (2, 1, 2)
    assert stats.modules == ["blocks.0", "blocks.1"]


def decorate(function):
    """A decorator as transformers' ``can_return_tuple``: one wrapper code object for every function it wraps."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


def test_a_wrapper_serving_two_functions_compiles_once_for_each_and_still_reports_its_recompiles():
    """A graph break inside a decorated function called from another makes Dynamo compile the wrappers as frames of
    their own: the inner function's wrapper is Dynamo's second compile of that code object, the first of its
    function (no recompile). Called again with its arguments passed otherwise, a wrapper recompiles."""

    @decorate
    def inner(x):
        torch._dynamo.graph_break()
        return x * 2

    @decorate
    def outer(x, scale=1.0):
        return inner(x + 1) * scale

    compiled = torch.compile(outer, backend="eager")
    telemetry = CompileTelemetry(None).install()
    try:
        for _ in range(2):
            torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 4.0))
        telemetry.collect()
        assert telemetry.totals()["recompiles"] == 0, telemetry.events
        compiled(torch.ones(2), scale=2.0)  # outer's wrapper (its kwargs) and the code after the break (scale)
        telemetry.collect()
    finally:
        telemetry.uninstall()
    assert telemetry.totals()["recompiles"] == 2, telemetry.events


def test_recompile_limit_warns_before_and_errors_with_the_fix_when_hit(caplog):
    inputs = [torch.randn(n, models.WIDTH) for n in (2, 3, 4, 5, 6)]
    with caplog.at_level(logging.WARNING, logger="compile_trainer.telemetry"):
        telemetry = run_regional(models.Net(), *inputs, dynamic=False, recompile_limit=3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("region blocks has recompiled 1 times (recompile_limit=3" in w for w in warnings), warnings
    assert len(errors) == 1, errors
    assert "region blocks hit recompile_limit=3" in errors[0] and "EAGERLY" in errors[0]
    assert "size mismatch at index 0" in errors[0] and "drop_last" in errors[0] and "dim 0 dynamic" in errors[0]
    assert telemetry.totals()["recompile_limit_hits"] == 1
    assert telemetry.regions["blocks"].recompiles == 2


def test_lazy_backward_compiles_count_for_their_region_and_reset_is_survived():
    model = models.Net()
    applied = apply_policy(
        model, to_policy({"rules": [{"name": "blocks", "action": "regional"}], "backend": "aot_eager"})
    )
    telemetry = CompileTelemetry(applied).install()
    model(torch.randn(4, models.WIDTH, requires_grad=True)).sum().backward()
    assert telemetry.compile_count == 2, "the forward frame and its lazy backward"
    torch._dynamo.reset()  # clears Dynamo's callbacks; the telemetry registers again
    telemetry.ensure_installed()
    model(torch.randn(4, models.WIDTH, requires_grad=True)).sum().backward()
    telemetry.collect()
    telemetry.uninstall()
    assert telemetry.compile_count == 4
    stats = telemetry.regions["blocks"]
    assert stats.compiles == 2 and stats.recompiles == 0, "after a reset compile ids restart at 0/0"
    assert stats.compile_time_s == pytest.approx(telemetry.compile_time_s)
    assert set(telemetry.regions) == {"blocks"}


def test_a_graph_that_runs_without_the_cuda_graphs_asked_for_is_reported(caplog):
    """Inductor compiles a CPU graph with ``triton.cudagraphs`` but runs it without them: a skip per graph."""
    torch.manual_seed(0)
    cudagraphs = run_regional(
        models.Net(), torch.randn(4, models.WIDTH, requires_grad=True), backend="inductor",
        options={"triton.cudagraphs": True},
    )  # fmt: skip
    skips = [e for e in cudagraphs.events if e.kind == "cudagraph_skip"]
    assert skips and all(e.region == "blocks" for e in skips)
    assert cudagraphs.totals()["cudagraph_skips"] == cudagraphs.regions["blocks"].cudagraph_skips >= 1
    assert "mutated inputs" in skips[0].fix and "runs without CUDA graphs" in caplog.text
    assert cudagraphs.runtime_cudagraph_skips == 0, "skips seen during compiles are not counted again"
    plain = run_regional(models.Net(), torch.randn(4, models.WIDTH, requires_grad=True), backend="inductor")
    assert plain.totals()["cudagraph_skips"] == 0


def test_cuda_graph_skips_outside_compiles_are_counted_once():
    """CUDA graph trees give up on a graph when it runs (GPU only) and only bump Inductor's counter."""
    from torch._dynamo.utils import counters

    telemetry = run_regional(models.Net(), torch.randn(4, models.WIDTH))
    counters["inductor"]["cudagraph_skips"] += 2  # what two run-time skips leave behind
    telemetry.collect()
    telemetry.collect()
    assert telemetry.runtime_cudagraph_skips == telemetry.totals()["cudagraph_skips"] == 2
    (event,) = [e for e in telemetry.events if e.kind == "cudagraph_skip"]
    assert "at run time" in event.reason and "TORCH_LOGS=cudagraphs" in event.reason


@pytest.mark.parametrize(
    "guard, shared_by, expected",
    [
        ("L['self']._modules['self_attn'].layer_idx == 3", 16, "use_cache = False"),
        ("tensor 'L['self']._modules['conv1']._parameters['weight']' size mismatch at index 0", 8, "split the group"),
        ("tensor 'L['args'][0]' size mismatch at index 1. expected 16, actual 32", 1, "compile=dynamic"),
        ("tensor 'L['args'][0]' size mismatch at index 0. expected 8, actual 3", 1, "drop_last=True"),
        ("L['scale'] == 0.5", 1, "recompile_limit"),
        ("L['module'].config.problem_type is None", 1, "problem_type='single_label_classification'"),
        ("tensor 'L['args'][0]' stride mismatch at index 2. expected 128, actual 1", 1, ".contiguous()"),
    ],
)
def test_recompile_advice_fits_the_guard_that_failed(guard, shared_by, expected):
    from compile_trainer.telemetry.fixes import recompile_fix

    assert expected in recompile_fix(guard, shared_by)


class RawBatchStack(torch.nn.Module):
    """Identical blocks in an ``nn.Sequential`` fed the batch directly: the first block's input requires no grad, the
    later blocks' (activations) do, so their shared entry gets a second graph."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*(models.CleanBlock() for _ in range(3)))

    def forward(self, x):
        return self.blocks(x).square().mean()


def test_a_stack_whose_first_block_takes_the_batch_compiles_an_expected_variant_not_a_recompile():
    eager, model = RawBatchStack(), RawBatchStack()
    inputs = [torch.randn(4, models.WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    applied = apply_policy(model, to_policy("regional", backend="aot_eager"))
    telemetry = CompileTelemetry(applied).install()
    losses = []
    for network in (eager, model):
        optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
        losses.append([])
        for x in inputs:
            loss = network(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[-1].append(loss.detach())
    model(torch.randn(6, models.WIDTH)).backward()  # a new batch size: real recompiles, still reported
    telemetry.collect()
    telemetry.uninstall()
    torch.testing.assert_close(torch.stack(losses[1]), torch.stack(losses[0]))
    totals = telemetry.totals()
    assert totals["grad_mode_variants"] == 1, "block 0's input requires no grad, the others' do: one extra graph"
    recompiles = [event.compile_id for event in telemetry.events if event.kind == "recompile"]
    assert recompiles == ["0/2", "0/3"], "the new size recompiles each of the two graphs, once the variant is taken"


def test_strict_recompiles_accept_the_first_block_taking_the_batch():
    """Warm-up runs every block, so both graphs of the shared entry exist before strict recompiles are armed."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from compile_trainer import CompileCallback
    from tests.conftest import quiet_cpu_trainer

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = RawBatchStack()

        def training_step(self, batch, batch_idx):
            return self.model(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batches = [torch.randn(4, models.WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    shapes = {"warmup": True, "strict_recompiles": True}
    callback = CompileCallback("regional", backend="aot_eager", shapes=shapes, telemetry={"measure_flops": False})
    quiet_cpu_trainer(max_steps=3, callbacks=[callback]).fit(Module(), DataLoader(batches, batch_size=None))
    summary = callback.summary()
    assert summary["recompiles"] == 0 and summary["grad_mode_variants"] == 1, callback.telemetry.compile.events
