"""``CompileCallback`` configured where Lightning users configure training: a LightningCLI YAML.

Each test writes a config file with ``trainer.callbacks: [{class_path: compile_trainer.CompileCallback, ...}]``
and runs ``LightningCLI(...)`` on it (``fit``, a few steps of a tiny GPT on the CPU). The callback's policy
overrides are ``**overrides``: jsonargparse accepts them under ``dict_kwargs`` (next to ``init_args``), not under
``init_args``, whose keys must be named parameters of ``__init__``.
"""

import re
import sys
import textwrap
from pathlib import Path

import jsonargparse  # noqa: F401  LightningCLI's parser; a dev dependency: missing, this module fails, never skips
import pytest
import yaml
from lightning.pytorch.cli import LightningCLI

from compile_trainer import CompileCallback, PolicyError
from compile_trainer.schema import bundled_policy_names
from compile_trainer.schema.policy import optimizer_settings
from compile_trainer_recipes.data import StdlibTextDataModule
from compile_trainer_recipes.gpt import LanguageModel

STEPS = 3


class CountingLanguageModel(LanguageModel):
    """``LanguageModel`` (same init args) that counts its ``training_step`` calls, across instances (the
    telemetry's FLOP count calls it too, outside the steps): 0 means training never started."""

    training_steps = 0

    def training_step(self, batch, batch_idx):
        CountingLanguageModel.training_steps += 1
        return super().training_step(batch, batch_idx)


@pytest.fixture(autouse=True)
def cli_argv(monkeypatch):
    """LightningCLI reads ``args=`` only; pytest's own ``sys.argv`` would only make it warn."""
    monkeypatch.setattr(sys, "argv", ["lightning-cli"])
    CountingLanguageModel.training_steps = 0


def write_config(tmp_path: Path, callback: str) -> Path:
    """A LightningCLI config for a short quiet CPU fit, with ``callback`` (YAML) as ``trainer.callbacks``."""
    config = textwrap.dedent(
        """\
        seed_everything: 0
        trainer:
          accelerator: cpu
          max_steps: {steps}
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          limit_val_batches: 0
          default_root_dir: {root}
          callbacks:
        {callback}
        model:
          model: {{vocab_size: 256, block_size: 32, n_layer: 2, n_head: 2, n_embd: 16}}
          warmup_steps: 1
          decay_steps: {steps}
        data:
          block_size: 32
          batch_size: 4
          max_bytes: 100000
        """
    ).format(steps=STEPS, root=tmp_path, callback=textwrap.indent(textwrap.dedent(callback).strip(), "  "))
    path = tmp_path / "config.yaml"
    path.write_text(config)
    return path


def run_cli(config: Path, *args: str, **cli_kwargs) -> LightningCLI:
    return LightningCLI(
        CountingLanguageModel, StdlibTextDataModule, args=[*args, "--config", str(config)], **cli_kwargs
    )


def compile_callback(cli: LightningCLI) -> CompileCallback:
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, CompileCallback)]
    return callback


def cause_chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def test_bundled_policy_with_overrides_from_yaml_compiles_and_trains(tmp_path):
    config = write_config(
        tmp_path,
        """
        - class_path: compile_trainer.CompileCallback
          init_args: {policy: regional, print_plan: true}
          dict_kwargs: {backend: eager, recompile_limit: 4}
        """,
    )
    cli = run_cli(config, "fit", save_config_kwargs={"config_filename": "cli_config.yaml"})

    callback = compile_callback(cli)
    assert (callback.policy.name, callback.policy.backend, callback.policy.recompile_limit) == ("regional", "eager", 4)
    assert callback.policy.rules[0].action == "regional", "the bundled policy's rules, under the YAML's overrides"
    regions = {c.region.name for c in callback.applied.compiled}
    assert {"model.embed", "model.blocks.0", "model.blocks.1", "model.head"} <= regions
    assert {c.compile_kwargs["backend"] for c in callback.applied.compiled} == {"eager"}
    assert all(c.calls == STEPS for c in callback.applied.compiled), "every region ran compiled each step"
    assert cli.trainer.global_step == STEPS
    assert callback.summary()["compiles"] > 0
    assert callback.optimizer_steps == [], "the bundled policy leaves the optimizer alone"

    # The config LightningCLI saved for the run keeps the overrides: run again from it, the same policy.
    saved = tmp_path / "cli_config.yaml"
    (entry,) = yaml.safe_load(saved.read_text())["trainer"]["callbacks"]
    assert entry["dict_kwargs"] == {"backend": "eager", "recompile_limit": 4}
    rerun = compile_callback(run_cli(saved, "fit", save_config_callback=None))
    assert rerun.policy == callback.policy
    assert [c.compile_kwargs for c in rerun.applied.compiled] == [c.compile_kwargs for c in callback.applied.compiled]


def test_policy_as_a_dict_in_init_args(tmp_path):
    config = write_config(
        tmp_path,
        """
        - class_path: compile_trainer.CompileCallback
          init_args:
            policy:
              name: blocks_only
              backend: eager
              rules:
                - {name: "*", action: regional, rest: eager}
            telemetry: {enabled: true}
        """,
    )
    cli = run_cli(config, "fit", save_config_callback=None)

    callback = compile_callback(cli)
    assert (callback.policy.name, callback.policy.backend) == ("blocks_only", "eager")
    assert {c.region.name for c in callback.applied.compiled} == {"model.blocks.0", "model.blocks.1"}
    assert cli.trainer.global_step == STEPS
    assert callback.summary()["compiles"] > 0


def test_optimizer_only_policy_from_yaml_compiles_the_optimizer_step_and_no_module(tmp_path):
    config = write_config(
        tmp_path,
        """
        - class_path: compile_trainer.CompileCallback
          init_args:
            policy: {optimizer: {compile: true, backend: eager}}
        """,
    )
    cli = run_cli(config, "fit", save_config_callback=None)

    callback = compile_callback(cli)
    assert callback.policy.optimizer.compile == "true" and not callback.policy.compiles_modules
    assert callback.applied.compiled == []
    (step,) = callback.optimizer_steps
    assert cli.trainer.optimizers[0].step is step, "the optimizer's step was replaced"
    assert optimizer_settings(step.policy, callback.policy.backend).backend == "eager"
    assert (step.eager_steps, step.compiled_steps) == (1, STEPS - 1), "the first step creates the optimizer state"
    assert cli.trainer.global_step == STEPS
    assert callback.summary()["compiles"] > 0, "the optimizer's compile is counted"


def test_unknown_policy_name_in_yaml_fails_before_training_and_lists_the_bundled_policies(tmp_path):
    config = write_config(
        tmp_path,
        """
        - class_path: compile_trainer.CompileCallback
          init_args: {policy: regionl}
        """,
    )
    bundled = ", ".join(bundled_policy_names())
    # jsonargparse wraps the callback's error (a ValueError naming every type it tried), the message kept.
    message = f"unknown compile policy 'regionl' (did you mean 'regional'?): a name is a bundled policy ({bundled})"
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        run_cli(config, "fit", save_config_callback=None)
    assert any(isinstance(e, PolicyError) for e in cause_chain(error.value))
    assert CountingLanguageModel.training_steps == 0


def test_policy_field_directly_under_init_args_is_refused_before_training(tmp_path, capsys):
    """``**overrides`` are not parameters jsonargparse can see: under ``init_args`` they are a parse error
    (use ``dict_kwargs``, as above). If ``CompileCallback`` gains an explicit ``backend`` argument, this changes."""
    config = write_config(
        tmp_path,
        """
        - class_path: compile_trainer.CompileCallback
          init_args: {policy: regional, backend: eager}
        """,
    )
    with pytest.raises(SystemExit):
        run_cli(config, "fit", save_config_callback=None)
    assert "Option 'backend' is not accepted" in capsys.readouterr().err
    assert CountingLanguageModel.training_steps == 0
