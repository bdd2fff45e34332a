"""The compile cache's ``precompiled`` layer: regions' Dynamo traces serialized with aot_compile, served after a load.

Each test is two runs in one process: the first writes a bundle, ``torch._dynamo.reset()`` empties Dynamo's
caches, and the second loads the bundle into a fresh model. The library is used without Lightning
(``CompileCache`` + ``apply_policy``), as the callback wires it; a real Lightning run on a new machine, with
Inductor, is in test_compile_cache.py.
"""

import ast
import importlib
import sys
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from compile_trainer import CompileCallback, compat
from compile_trainer.cache import precompiled
from compile_trainer.cache.session import CompileCache, CompileCacheWarning
from compile_trainer.compiling.regions import apply_policy
from compile_trainer.schema import to_policy
from tests.telemetry_models import WIDTH, ItemBreakBlock, Net, TinyRegression
from tests.user_models import VOCAB, tiny_llama

pytestmark = pytest.mark.skipif(
    compat.aot_compile_problem() is not None, reason=str(compat.aot_compile_problem())
)  # CI's torch (2.13) has it: these run there


def _run(model, tmp_path, policy="regional", **overrides):
    """A run under the cache: the bundle loaded, the policy applied, the precompiled layer attached."""
    torch._dynamo.reset()
    policy = to_policy(policy, **{"backend": "aot_eager", "cache": {"dir": str(tmp_path)}, **overrides})
    cache = CompileCache(policy.cache, rank=0)
    cache.load(model, policy, torch.device("cpu"))
    applied = apply_policy(model, policy)
    cache.attach(applied)
    return cache, applied


def _net(block=None):
    torch.manual_seed(0)
    return Net(block) if block else Net(n_blocks=3)


def _step(model, x):
    """Loss and gradients of one forward and backward."""
    model.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same(step, reference):
    assert torch.allclose(step[0], reference[0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(step[1], reference[1]))


def test_a_loaded_bundle_serves_every_region_without_tracing_and_compiles_what_its_guards_reject(tmp_path):
    x = torch.randn(4, WIDTH + 1)[:, :WIDTH]  # a slice: its strides are guarded, so the capture must keep them
    reference = _step(_net(), x)

    cache, applied = _run(_net(), tmp_path)
    _assert_same(_step(applied.root, x), reference)
    assert len(cache.precompiled.pending) == len(applied.shared_counts())  # one per compiled entry, kept
    assert cache.save([item.region.name for item in applied.compiled], 1.0, final=True)  # captured, then saved
    assert len(cache.precompiled.captured) == len(applied.shared_counts()) and not cache.precompiled.pending

    cache, applied = _run(_net(), tmp_path)
    assert cache.outcome.status == "hit"
    graphs = compat.unique_graphs()
    _assert_same(_step(applied.root, x), reference)
    assert compat.unique_graphs() == graphs, "Dynamo traced a region the bundle had"
    summary = cache.summary(0.0)
    served = sum(item.calls for item in applied.compiled)
    assert summary["cache_precompiled_hits"] == served == 5  # embed, 3 blocks, head
    assert summary["cache_precompiled_misses"] == 0 and summary["cache_precompiled_load_s"] > 0
    assert summary["cache_precompiled_background_load_s"] > 0, "loaded on the thread from attach on"
    assert all(artifact.function is not None for artifact in cache.precompiled.loaded)
    assert "5 call(s) served, 0 compiled" in cache.describe()

    evaluated = _net().eval()
    with torch.no_grad():  # evaluation: no artifact of this grad mode, compiled as without the layer
        assert torch.allclose(applied.root.eval()(x), evaluated(x), atol=1e-6)
    applied.root.train()  # captured after training: under the grad mode and training flags of the call
    other = torch.randn(6, WIDTH)  # the loaded guards reject another batch size
    assert torch.allclose(applied.root(other), _net()(other), atol=1e-6)
    assert compat.unique_graphs() > graphs and cache.summary(0.0)["cache_precompiled_misses"] > 0
    assert cache.precompiled.pending  # the new graphs are captured for the next bundle, after training
    assert cache.save([], 1.0, final=True)

    cache, applied = _run(_net(), tmp_path)
    assert len(cache.precompiled.artifacts) > len(applied.shared_counts())
    graphs = compat.unique_graphs()
    with torch.no_grad():
        assert torch.allclose(applied.root.eval()(x), evaluated(x), atol=1e-6)
    assert compat.unique_graphs() == graphs and cache.summary(0.0)["cache_precompiled_hits"] == 5


MODEL_V1 = """
import torch
from torch import nn

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * 2
"""


def test_an_artifact_of_changed_model_code_is_never_used(tmp_path, monkeypatch):
    """Same structure (same bundle key), other code in forward: the traced sources' checksums tell them apart."""
    source = tmp_path / "precompiled_user_model.py"
    source.write_text(MODEL_V1)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("precompiled_user_model")
    x = torch.ones(2, 4)
    cache, applied = _run(torch.nn.Sequential(module.Scaled()), tmp_path / "bundles", policy="full")
    applied.root(x)
    assert cache.save(["0"], 1.0, final=True)

    source.write_text(MODEL_V1.replace("* 2", "* 3"))
    module = importlib.reload(module)
    torch.manual_seed(0)
    model = torch.nn.Sequential(module.Scaled())  # "full": its top-level submodule is the region
    expected = model(x)
    cache, applied = _run(model, tmp_path / "bundles", policy="full")
    assert cache.outcome.status == "hit"
    with pytest.warns(CompileCacheWarning, match=r"model's code changed .*precompiled_user_model \(lines"):
        assert torch.equal(applied.root(x), expected)
    assert cache.summary(0.0)["cache_precompiled_hits"] == 0
    # the stale artifact is dropped (never written again); the new code's compile is kept for capture
    assert not cache.precompiled.loaded and len(cache.precompiled.pending) == 1
    sys.modules.pop("precompiled_user_model")


def test_a_region_with_a_graph_break_is_named_and_compiles_as_usual(tmp_path):
    x = torch.randn(4, WIDTH)
    reference = _step(_net(ItemBreakBlock), x)
    model = torch.nn.Sequential(_net(ItemBreakBlock))  # "full": the Net is the one region
    cache, applied = _run(model, tmp_path, policy="full")
    _assert_same(_step(applied.root, x), reference)
    cache.save(["0"], 1.0, final=True)
    skipped = cache.summary(1.0)["cache_precompiled_skipped"]
    assert list(skipped) == ["0"], skipped
    assert " at telemetry_models.py:23 `if x.sum().item() > 0:" in skipped["0"]  # the line that broke it
    assert "not precompiled: 0: " in cache.describe()

    # the bundle remembers it: the next run that compiles the region keeps no inputs, tries no capture again
    cache, applied = _run(torch.nn.Sequential(_net(ItemBreakBlock)), tmp_path, policy="full")
    _assert_same(_step(applied.root, x), reference)
    assert not cache.precompiled.pending and cache.precompiled.misses["0"] == 1
    assert cache.summary(1.0)["cache_precompiled_skipped"]["0"] == f"{skipped['0']} (an earlier capture)"


def test_a_hugging_face_llama_compiled_whole_is_captured_and_served(tmp_path):
    """HF's decorated forwards put a code object in a closure, which Dynamo guards with a CONSTANT_MATCH that is an
    ID_MATCH underneath: torch's default filter kept it and the capture failed ("ID_MATCH guard cannot be
    serialized"). compat.aot_compile leaves it out."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))

    def llama():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"llama": tiny_llama()})  # "full": the Llama is the region

    def step(root):
        root.zero_grad()
        loss = root["llama"](input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in root.parameters()]

    reference = step(llama())
    cache, applied = _run(llama(), tmp_path, policy="full")
    _assert_same(step(applied.root), reference)
    cache.save(["llama"], 1.0, final=True)
    assert cache.summary(1.0)["cache_precompiled_skipped"] is None and len(cache.precompiled.captured) == 1

    cache, applied = _run(llama(), tmp_path, policy="full")
    graphs = compat.unique_graphs()
    _assert_same(step(applied.root), reference)
    assert compat.unique_graphs() == graphs, "Dynamo traced the Llama the bundle had"
    assert cache.summary(0.0)["cache_precompiled_hits"] == 1


def test_the_layer_says_why_it_is_off(tmp_path):
    cache, applied = _run(torch.nn.Sequential(_net()), tmp_path, policy="full", background=True)
    assert cache.precompiled is None
    assert "background compiles are not captured" in cache.summary()["cache_precompiled_off"]
    assert "cache precompiled: off (background compiles" in cache.describe()
    cache, applied = _run(_net(), tmp_path, cache={"dir": str(tmp_path), "layers": ["mega_cache"]})
    assert cache.precompiled is None and "precompiled" not in cache.describe()


class _TeardownMovesTheModel(SingleDeviceStrategy):
    """Lightning's teardown moves a GPU module to the CPU before ``on_fit_end``; on the CPU it leaves it. This
    strategy changes the module at teardown as that move does (to float64 here), so that a capture after
    teardown fails on the CPU as it did on the GPU ("RuntimeError when making fake tensor call")."""

    def teardown(self) -> None:
        super().teardown()
        self.lightning_module.double()


def _fit_under_cache(cache_dir, precision):
    torch._dynamo.reset()
    callback = CompileCallback(
        "regional", backend="aot_eager", cache={"dir": str(cache_dir)}, telemetry={"measure_flops": False}
    )
    module = TinyRegression(n_batches=3)
    trainer = pl.Trainer(
        max_steps=3, precision=precision, strategy=_TeardownMovesTheModel(torch.device("cpu")), logger=False,
        callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return callback.summary()


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])  # 16-mixed: bf16 on a CPU (Lightning)
def test_lightning_captures_under_its_precision_plugin_and_the_next_run_is_served(tmp_path, precision):
    """The captures run while the module is still where it trained, under the autocast state its regions ran
    with, and are neither compiles nor breaks nor fallbacks of the run; the next run is served without tracing."""
    first = _fit_under_cache(tmp_path, precision)
    assert first["cache_precompiled_captures"] == 3 and first["cache_precompiled_skipped"] is None  # 3 entries
    assert (first["compiles"], first["graph_breaks"], first["eager_fallbacks"]) == (3, 0, 0)  # the run's alone

    second = _fit_under_cache(tmp_path, precision)
    assert second["cache_precompiled_hits"] >= 3 and second["cache_precompiled_misses"] == 0
    # loaded on a thread, under the autocast state of their capture: its guards accept the training thread's calls
    assert second["cache_precompiled_background_load_s"] > 0
    assert (second["compiles"], second["eager_fallbacks"]) == (0, 0)
    # nothing compiled, but the first step loaded the artifacts: a warm-up step, kept out of steady state
    assert (second["compile_steps"], second["warmup_steps"], second["steady_steps"]) == (0, 1, 2)


def test_regions_compiled_for_cuda_graphs_load_with_cuda_graphs(tmp_path):
    """Loading an artifact takes CUDA graphs from the Inductor config of the moment, not from the options it was
    compiled with (torch 2.11-2.14): the layer sets them per region. On the CPU, Inductor considers CUDA graphs for
    a graph that asks for them and skips them (a counted skip); a graph loaded without them counts none."""
    x = torch.randn(4, WIDTH)
    reference = _step(_net(), x)
    graphs = {"backend": "inductor", "options": {"triton.cudagraphs": True}}
    cache, applied = _run(_net(), tmp_path, **graphs)
    skips = compat.cudagraph_skips()
    _step(applied.root, x)
    compiled_skips = compat.cudagraph_skips() - skips
    assert compiled_skips > 0, "Inductor considered CUDA graphs for the compiled regions"
    assert cache.save([item.region.name for item in applied.compiled], 1.0, final=True)

    skips = compat.cudagraph_skips()  # before the loading thread starts: it counts the loaded graphs' skips
    cache, applied = _run(_net(), tmp_path, **graphs)
    traced = compat.unique_graphs()
    step = _step(applied.root, x)
    assert compat.unique_graphs() == traced and cache.summary(0.0)["cache_precompiled_hits"] == 5
    assert compat.cudagraph_skips() - skips == compiled_skips, "the loaded graphs asked for CUDA graphs too"
    _assert_same(step, reference)


def _fit_counting_flops(cache_dir, batch_size=4):
    torch._dynamo.reset()
    callback = CompileCallback("regional", backend="aot_eager", cache={"dir": str(cache_dir)})
    trainer = pl.Trainer(
        max_steps=3, logger=False, callbacks=[callback], accelerator="cpu", enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(TinyRegression(n_batches=3, batch_size=batch_size))
    return callback.summary()


def test_a_run_the_bundle_serves_takes_its_flops_and_a_different_step_counts_its_own(tmp_path):
    """The cold run's count travels in the bundle with its step's signature (batch shapes, training_step's code):
    the next run of the same step takes it and counts nothing during its first step; another batch size counts."""
    cold = _fit_counting_flops(tmp_path)
    assert cold["flops_source"] == "counted" and cold["flops_per_step"] > 0
    served = _fit_counting_flops(tmp_path)
    assert served["cache_precompiled_hits"] >= 3
    assert (served["flops_source"], served["flops_per_step"]) == ("compile cache", cold["flops_per_step"])
    other = _fit_counting_flops(tmp_path, batch_size=8)
    assert other["flops_source"] == "counted" and other["flops_per_step"] == pytest.approx(2 * cold["flops_per_step"])


def test_the_thread_loads_only_the_artifacts_of_this_processs_device(tmp_path):
    """A bundle holds every rank's captures; loading another rank's would set up that GPU in this process (or fail
    where it cannot see it): the thread leaves them to the calls (which never ask for them)."""
    x = torch.randn(4, WIDTH)
    cache, applied = _run(_net(), tmp_path)
    _step(applied.root, x)
    assert cache.save([item.region.name for item in applied.compiled], 1.0, final=True)
    cache, applied = _run(_net(), tmp_path)
    cache.precompiled.section()  # waits for the thread that attach started
    own = [replace(artifact, function=None) for artifact in cache.precompiled.loaded]
    state = ast.literal_eval(own[0].state)
    foreign = replace(own[0], state=repr((*state[:-1], "cuda:7")))  # another rank's capture of the same entry

    regions = precompiled.PrecompiledRegions([foreign, *own], capture=False)
    regions.load_in_background(applied.compiled)
    regions.section()
    assert all(artifact.function is not None for artifact in own) and foreign.function is None
