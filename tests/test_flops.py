"""FLOPs and MFU in a real fit of Hugging Face models (tiny configs, random weights): counted while Lightning runs the
first training step (eager code op by op, compiled graphs from their FX graphs), equal to an independent
FlopCounterMode count of an eager step, and leaving no trace on the training."""

import lightning.pytorch as pl
import pytest
import torch
import transformers
from torch._dynamo.backends.common import aot_autograd
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from compile_trainer import CompileCallback, compat
from compile_trainer.telemetry.flops import StepFlopCount
from compile_trainer.telemetry.throughput import device_peak_flops, table_peak_flops
from tests.conftest import quiet_cpu_trainer

BATCH, SEQ, VOCAB, IMAGE, LABELS = 2, 8, 64, 16, 3
STEPS = 3


def text_batches(labels: str):
    """Token ids with an attention mask (the second sequence padded at its end), as a tokenizer gives them:
    the masks send Hugging Face models through data-dependent checks that no meta tensor can answer."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        target = (
            ids.masked_fill(mask == 0, -100)
            if labels == "tokens"
            else torch.randint(0, LABELS, (BATCH,), generator=generator)
        )
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": target})
    return batches


def image_batches():
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator),
            "labels": torch.randint(0, LABELS, (BATCH,), generator=generator),
        }
        for _ in range(STEPS)
    ]


TINY = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
MODELS = {
    "llama": (
        lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=1, max_position_embeddings=SEQ, **TINY)
        ),
        lambda: text_batches("tokens"),
    ),
    # dropout 0.1 (embeddings, attention, residuals): the count must leave the RNG streams as they were
    "gpt2_dropout": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2)
        ),
        lambda: text_batches("tokens"),
    ),
    "bert_dropout": (
        lambda: transformers.BertForSequenceClassification(
            transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=LABELS, **TINY)
        ),
        lambda: text_batches("classes"),
    ),
    "vit": (
        lambda: transformers.ViTForImageClassification(
            transformers.ViTConfig(image_size=IMAGE, patch_size=8, num_labels=LABELS, **TINY)
        ),
        image_batches,
    ),
    # BatchNorm: the count must leave the running statistics as they were
    "resnet_batchnorm": (
        lambda: transformers.ResNetForImageClassification(
            transformers.ResNetConfig(
                embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=LABELS
            )
        ),
        image_batches,
    ),
}


class HFModule(pl.LightningModule):
    """A Hugging Face model whose forward computes its own loss from the batch's labels."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)  # muted during the count
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ManualHFModule(HFModule):
    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.model(**batch).loss)
        optimizer.step()


class Losses(pl.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if outputs:  # manual optimization returns none
            self.values.append(outputs["loss"].detach().clone())


def fit(name: str, telemetry: dict, module_class: type = HFModule, **policy):
    make_model, make_batches = MODELS[name]
    torch.manual_seed(0)
    module = module_class(make_model())
    telemetry = {"print_summary": False, **telemetry}
    callback = CompileCallback("regional", print_plan=False, telemetry=telemetry, backend="eager", **policy)
    losses = Losses()
    torch.manual_seed(2)  # the fit's dropout masks
    trainer = quiet_cpu_trainer(max_steps=STEPS, callbacks=[callback, losses])
    trainer.fit(module, train_dataloaders=DataLoader(make_batches(), batch_size=None))
    return callback.summary(), losses.values, module.state_dict()


def reference_flops(name: str) -> int:
    """FlopCounterMode over a plain eager forward + backward of the first batch, on a model of its own."""
    make_model, make_batches = MODELS[name]
    model = make_model().train()
    with FlopCounterMode(display=False) as counter:
        model(**make_batches()[0]).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", list(MODELS))
def test_flops_are_counted_on_real_tensors_and_leave_no_trace(name):
    summary, losses, state = fit(name, {"peak_tflops": 1e-3})
    assert summary["compiles"] > 0, "the regions compiled: the count ran beside them"
    assert summary["flops_per_step"] == reference_flops(name) > 0
    assert summary["steady_tflops"] == pytest.approx(summary["flops_per_step"] / summary["steady_step_time_s"] / 1e12)
    assert summary["peak_tflops"] == 1e-3, "the given peak"
    assert summary["mfu"] == pytest.approx(summary["steady_tflops"] / 1e-3)

    uncounted_summary, uncounted_losses, uncounted_state = fit(name, {"measure_flops": False})
    assert uncounted_summary["flops_per_step"] is None and uncounted_summary["mfu"] is None
    assert len(losses) == STEPS and torch.equal(torch.stack(losses), torch.stack(uncounted_losses))
    assert state.keys() == uncounted_state.keys()
    changed = [key for key in state if not torch.equal(state[key], uncounted_state[key])]
    assert not changed, f"the count changed the training: {changed}"


@torch._dynamo.register_backend(name="hidden_kernels_for_tests")
def hidden_kernels(graph_module, example_inputs):
    """AOTAutograd's forward and backward graphs, run where no dispatch mode sees their ops: like kernels a compiler
    generates itself (Inductor's matmul templates under max-autotune, a CUDA graph's replay)."""

    def hidden(graph, inputs):
        def run(*args):
            with torch.utils._python_dispatch._disable_current_modes():
                return graph(*args)

        return run

    return aot_autograd(fw_compiler=hidden, bw_compiler=hidden)(graph_module, example_inputs)


def test_hidden_kernels_are_hidden_from_a_dispatch_mode():
    """The premise of the next test: an op count at run time (by a mode that torch.compile lets compile) sees nothing
    of what this backend runs."""
    compiled = torch.compile(lambda x, w: x @ w, backend="hidden_kernels_for_tests")
    tally = compat.FlopTally()
    with tally.mode():
        compiled(torch.ones(2, 3), torch.ones(3, 4, requires_grad=True)).sum().backward()
    assert tally.total == 0 and compat.unique_graphs() > 0


@pytest.mark.parametrize(
    "policy, backend",
    [(policy, backend) for policy in ("full", "regional") for backend in ("aot_eager", "hidden_kernels_for_tests")]
    + [("regional", "inductor")],  # one real Inductor compile: minutes on a CPU each
)
def test_compiled_graphs_are_counted_from_their_graphs(policy, backend):
    """Compiled graphs count by their FX graph, forward and AOTAutograd backward, whatever the backend runs."""
    make_model, make_batches = MODELS["llama"]
    torch.manual_seed(0)
    module = HFModule(make_model())
    module.model.config.use_cache = False  # one graph for both layers
    callback = CompileCallback(policy, print_plan=False, telemetry={"print_summary": False}, backend=backend)
    trainer = quiet_cpu_trainer(max_steps=STEPS, callbacks=[callback])
    trainer.fit(module, train_dataloaders=DataLoader(make_batches(), batch_size=None))
    summary = callback.summary()
    assert summary["compiles"] > 0 and summary["recompiles"] == 0
    assert summary["flops_per_step"] == reference_flops("llama")


def test_flops_are_counted_eagerly_beside_warmed_up_strict_regions():
    """Bucket warm-up compiles every region before the first batch and arms strict recompiles (a region's call
    then runs under the stance 'fail_on_recompile'): the count runs the modules' own forward instead."""
    shapes = {
        "pad": {"buckets": [SEQ], "values": {"input_ids": 0, "attention_mask": 0, "labels": -100}},
        "warmup": True,
        "strict_recompiles": True,
    }
    summary, losses, _ = fit("llama", {}, shapes=shapes)
    assert summary["flops_per_step"] == reference_flops("llama")
    assert summary["recompiles"] == 0 and len(losses) == STEPS


def test_given_flops_per_step_are_used_and_nothing_is_counted():
    summary, _, _ = fit("vit", {"flops_per_step": 1234.0})
    assert summary["flops_per_step"] == 1234.0


def test_manual_optimization_is_counted_over_its_training_step():
    """Manual optimization steps its optimizer inside training_step: the count runs to the batch's end (SGD's update
    has no matmul: the count is the forward and backward)."""
    summary, _, _ = fit("vit", {}, module_class=ManualHFModule)
    assert summary["flops_per_step"] == reference_flops("vit") and summary["steps"] == STEPS


@pytest.mark.parametrize(
    "device_name, dtype, tf32, tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4),
        ("NVIDIA H100 80GB HBM3", torch.float16, False, 989.4),
        ("NVIDIA H100 80GB HBM3", torch.float32, True, 494.7),
        ("NVIDIA H100 80GB HBM3", torch.float32, False, 66.9),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756.0),
        ("NVIDIA H100 NVL", torch.bfloat16, False, 835.5),
        ("NVIDIA H200", torch.bfloat16, False, 989.4),
        ("NVIDIA H200", torch.float32, True, 494.7),
        ("NVIDIA H200 NVL", torch.bfloat16, False, 835.5),
        ("NVIDIA GH200 480GB", torch.bfloat16, False, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float32, True, 156.0),
        ("NVIDIA A100-PCIE-40GB", torch.float32, False, 19.5),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", torch.bfloat16, False, None),  # a slice of the GPU
        ("NVIDIA H100 80GB HBM3", torch.float64, False, None),
        ("NVIDIA L4", torch.bfloat16, False, None),  # not in this table (Lightning's has it)
        ("Tesla T4", torch.float16, False, None),
    ],
)
def test_peak_flops_table(device_name, dtype, tf32, tflops):
    peak = table_peak_flops(device_name, dtype, tf32=tf32)
    assert peak == (pytest.approx(tflops * 1e12) if tflops is not None else None)


def test_a_given_peak_always_wins():
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16, 123.5) == 123.5e12
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16, None) is None, "no peak for the CPU"


def test_a_formula_that_fails_stops_the_count_not_the_step():
    """An op whose FLOPs formula raises (torch < 2.13's attention formulas on grouped-query shapes did, inside a
    user's training step) leaves the step's result as it is; the count reports the failure instead of a number."""
    count = StepFlopCount()
    count.tally.flop_registry[torch.ops.aten.mm.default.overloadpacket] = _formula_that_fails
    x, weight = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    count.start()
    product = (x @ weight).relu()
    product.sum().backward()
    with pytest.raises(RuntimeError, match="FLOPs of aten.mm not counted: AssertionError: shapes"):
        count.finish()
    torch.testing.assert_close(product, (x @ weight).relu())
    torch.testing.assert_close(weight.grad, x.t() @ ((x @ weight) > 0).float())


def test_grouped_query_attention_is_counted_as_if_its_keys_and_values_were_repeated():
    """Llama's and Qwen's attention: 8 query heads, 2 key and value heads. The kernels compute what keys and values
    repeated to the query's heads would; a step is counted so (torch < 2.13's own formulas asserted equal heads)."""
    attention = torch.ops.aten._scaled_dot_product_efficient_attention
    query, grouped = torch.empty(2, 8, 16, 32, device="meta"), torch.empty(2, 2, 16, 32, device="meta")
    repeated = flop_registry[attention](query, query, query, None, False, out_val=None)
    counted = StepFlopCount().tally.flop_registry[attention]
    assert counted is not flop_registry[attention], "the step counts with formulas of its own"
    assert counted(query, grouped, grouped, None, False, out_val=None) == repeated > 0


def _formula_that_fails(*args, out_val=None, **kwargs):
    raise AssertionError("shapes")
