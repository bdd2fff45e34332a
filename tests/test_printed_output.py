"""What a fit prints, read as a user reads it: the plan at the start and the compile report at the end, for the
README's example and three LightningModules written as a newcomer would (an MLP, a CNN of Conv-BN-ReLU blocks, a
tiny Hugging Face GPT-2), trained for a few steps on the CPU under the default policy. No two notes about one module
contradict each other and each agrees with the plan's rows; nothing is said of a mode the user did not choose, of a
mode an eager backend does not take, or of a cache that is off; every count is a noun's right plural; the report's
total row, its graph-break count and ``summary()`` are the sums of its region rows."""

import logging
import re
from typing import Dict, List

import lightning.pytorch as pl
import pytest
import torch
import transformers
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from compile_trainer import CompileCallback, apply_policy, format_plan_table, to_policy
from compile_trainer.telemetry.compile_events import CompileTelemetry
from compile_trainer.telemetry.compile_report import format_compile_report
from compile_trainer_recipes.gpt import LanguageModel

STEPS = 2
NOUNS = r"regions|compiled entries|entries|graphs|graph breaks|breaks|compiles|recompiles|modules|blocks|frames|rules"
COUNT_COLUMNS = ("modules", "compiles", "recompiles", "grad-mode variants", "graphs", "breaks")


class MLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def data(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 16), torch.randint(0, 4, (16,))), batch_size=8)


class CNN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(*(self.block(3 if i == 0 else 8, 8) for i in range(3)))
        self.head = nn.Linear(8, 10)

    @staticmethod
    def block(channels_in: int, channels_out: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.BatchNorm2d(channels_out), nn.ReLU()
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.features(x).mean((2, 3))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def data(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))), batch_size=8)


class TinyGPT2(pl.LightningModule):
    def __init__(self):
        super().__init__()
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def data(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(0, 64, (16, 16))), batch_size=8)


def readme_example():
    """The README's "In your own Lightning project" model and data, smaller."""
    model = LanguageModel({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16})
    tokens = torch.randint(0, 256, (16, 17))
    return model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


MODELS = {
    "readme_gpt": readme_example,
    "mlp": lambda: (lambda m: (m, m.data()))(MLP()),
    "cnn": lambda: (lambda m: (m, m.data()))(CNN()),
    "hf_gpt2": lambda: (lambda m: (m, m.data()))(TinyGPT2()),
}


class Printed(logging.Handler):
    """The messages of the loggers it is added to, at INFO and above."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def printed():
    """What ``rank_zero_info`` prints (Lightning's logger, which does not propagate) and what the library logs."""
    handler = Printed()
    loggers = [logging.getLogger("lightning.pytorch"), logging.getLogger("compile_trainer")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield lambda: handler.messages
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


def fit(name: str, printed) -> Dict:
    model, data = MODELS[name]()
    callback = CompileCallback(backend="eager")  # the default policy, as the README's example runs it
    trainer = Trainer(max_steps=STEPS, callbacks=[callback], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)  # fmt: skip
    trainer.fit(model, data)
    messages = printed()
    plan = next(m for m in messages if m.startswith("compile policy"))
    report = next(m for m in messages if m.startswith("compile telemetry")).split("\nthroughput\n")[0]
    return {"plan": plan, "report": report, "messages": messages, "summary": callback.summary()}


def cells(line: str) -> List[str]:
    return re.split(r"\s{2,}", line.strip())


def table(lines: List[str], header: str) -> List[List[str]]:
    """The rows of the fixed-width table whose header line starts with ``header``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        row = cells(line)
        if len(row) != len(cells(lines[start])):
            break
        rows.append(row)
    return rows


def assert_notes_agree(plan: str) -> None:
    """One ``rest`` road per module, and the plan's rows take it: an outer region only where a note says outer."""
    roads: Dict[str, set] = {}
    for note in (line for line in plan.splitlines() if line.startswith("note: ")):
        module = note[len("note: ") :].split(" ")[0]
        roads.setdefault(module, set()).update(re.findall(r"\(rest: (\w+)\)", note))
    assert all(len(road) <= 1 for road in roads.values()), f"notes that contradict each other: {roads}\n{plan}"
    rows = {row[0]: row for row in table(plan.splitlines(), "module")}
    for module, road in roads.items():
        if road and module in rows:
            assert (rows[module][2] == "regional outer") == (road == {"outer"}), f"{module}: {road}\n{plan}"
    for cls in re.findall(r"^note: \d+ (\w+) blocks differ in structure", plan, re.M):  # entries per structure...
        blocks = [row for row in rows.values() if row[1] == cls and row[2] == "regional block"]
        assert blocks, f"...of {cls} blocks that no row compiles as blocks:\n{plan}"


def assert_counts_add_up(report: str, summary: Dict) -> None:
    lines = report.splitlines()
    header = cells(lines[1])
    rows = table(lines, "region")
    regions = [row for row in rows if row[0] != "total"]
    column = {title: header.index(title) for title in COUNT_COLUMNS}
    totals = {
        title: sum(int(row[column[title]]) for row in regions if row[column[title]] != "-") for title in COUNT_COLUMNS
    }
    if len(regions) > 1:
        total = rows[-1]
        assert total[0] == "total" and all(int(total[column[t]]) == totals[t] for t in totals), report
    for title, key in [("compiles", "compiles"), ("recompiles", "recompiles"), ("grad-mode variants",
                       "grad_mode_variants"), ("graphs", "unique_graphs"), ("breaks", "graph_breaks")]:  # fmt: skip
        assert totals[title] == summary[key], f"{title}: rows add up to {totals[title]}, summary says {summary[key]}"
    said = re.search(r"^graph breaks: (\d+)(?: \(and (\d+) declared by an eager rule, expected\))?$", report, re.M)
    assert said and int(said.group(1)) == totals["breaks"] == summary["graph_breaks"], report
    assert int(said.group(2) or 0) == summary["declared_graph_breaks"] == report.count("[declared: eager rule]")
    legend = " ".join(lines[len(rows) + 3 : lines.index(said.group(0))])
    said_once = [len(re.findall(rf"(?<![\w-]){title}:", legend)) == 1 for title in COUNT_COLUMNS]
    assert all(said_once), f"what each count counts, said once: {legend}"


@pytest.mark.parametrize("name", list(MODELS))
def test_the_plan_and_the_report_agree_with_themselves(name, printed):
    out = fit(name, printed)
    plan, report = out["plan"], out["report"]
    text = "\n".join(out["messages"])
    assert_notes_agree(plan)
    assert_counts_add_up(report, out["summary"])
    # nothing about a setting the user did not choose (the bundled mode) or that the backend does not take
    assert "needs a GPU" not in text and "does not take them" not in text and " mode=" not in plan, plan
    assert "hit/miss" not in report, "no cache column without a cache"
    for counted in re.findall(rf"\b1 (?:{NOUNS})\b|\b0 \w+ shared\b|shared by [01]\b", f"{plan}\n{report}"):
        pytest.fail(f"{counted!r} in\n{plan}\n{report}")
    shared = [row[-1] for row in table(plan.splitlines(), "module")]
    assert all(cell == "-" or int(cell) > 1 for cell in shared), f"shared by 0 or 1: {shared}"
    if name == "hf_gpt2":  # the eager stack inside the outer region: a declared break, counted as one
        assert "graph breaks: 0 (and 1 declared by an eager rule, expected)" in report
        assert re.search(r"^model\.transformer\s+GPT2Model\s+eager \(graph break\)\s+0\s+-\s+-$", plan, re.M), plan


def tiny_gpt_root() -> nn.Module:
    return readme_example()[0]


@pytest.mark.parametrize(
    "policy, overrides, said",
    [
        ("regional", {}, None),  # the bundled default's CUDA-graph mode on a CPU: dropped without a word
        ("regional", {"mode": "max-autotune"}, "all regions: mode 'max-autotune' needs a GPU; using the default mode"),
        ("regional", {"backend": "eager"}, None),  # the user chose the backend, not the mode it does not take
        ("regional", {"backend": "eager", "mode": "max-autotune"}, "mode/options ignored: backend 'eager' does not"),
        ("reduce_overhead", {}, "all regions: mode 'reduce-overhead' needs a GPU"),  # a policy chosen for its mode
    ],
)
def test_a_note_on_the_mode_only_where_the_user_chose_it(policy, overrides, said):
    applied = apply_policy(tiny_gpt_root(), to_policy(policy, **overrides))
    text = format_plan_table(applied)
    applied.remove()
    if said is None:
        assert "needs a GPU" not in text and "does not take them" not in text, text
    else:
        assert said in text


def test_the_cache_column_is_there_with_a_cache(tmp_path):
    root = tiny_gpt_root()
    applied = apply_policy(root, to_policy("regional", backend="eager", cache={"dir": str(tmp_path)}))
    telemetry = CompileTelemetry(applied).install()
    root(torch.randint(0, 256, (2, 16)))
    telemetry.collect()
    telemetry.uninstall()
    report = format_compile_report(telemetry)
    applied.remove()
    legend = " ".join(report.splitlines()[3:])
    assert "cache hit/miss" in report.splitlines()[1] and "cache hit/miss: lookups in torch's compile caches" in legend
