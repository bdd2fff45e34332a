"""Every error names its real cause and what is valid: misspelt keys, two policies meeting on one model, rules that
would compile a region inside another, and the README's own example policy."""

import re
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from compile_trainer import CompileCallback, PolicyError, apply_policy, to_policy
from compile_trainer.compiling.plan_table import plan_rows
from compile_trainer.runs.hydra_configs import register_configs, unknown_override_keys
from compile_trainer_recipes.gpt import LanguageModel
from tests.conftest import TINY_GPT, quiet_cpu_trainer
from tests.telemetry_models import TinyRegression

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
register_configs()


@pytest.mark.parametrize(
    "spec, overrides, message",
    [
        ("regional", {"bakend": "eager"}, r"unknown key 'bakend' \(did you mean 'backend'\?\); valid keys at the top "),
        ("buckets", {"shapes": {"pad": {"bukets": [64]}}}, r"'shapes.pad.bukets' \(did you mean 'buckets'\?\)"),
        (
            {"rules": [{"name": "m"}, {"name": "m", "acton": "full"}]},
            {},
            r"'rules.1.acton' \(did you mean 'action'\?\)",
        ),
        (
            {"rules": [{"name": "m"}], "shapes": {"dynamic": [{"entry": "x", "dimm": 1}]}},
            {},
            r"'shapes.dynamic.0.dimm'",
        ),
    ],
)
def test_a_misspelt_key_names_the_near_match_and_the_valid_keys_of_its_section(spec, overrides, message):
    with pytest.raises(PolicyError, match=message) as error:
        CompileCallback(spec, **overrides)
    section = re.search(r"valid keys (of ([\w.]+)|at the top level): (.*)\.$", str(error.value))
    assert section, str(error.value)
    valid = section.group(3).split(", ")
    if "pad" in message:
        assert valid == ["dim", "buckets", "multiple_of", "max", "powers_of_two", "auto", "values", "overflow"]
    elif "acton" in message:
        assert {"name", "class_name", "action", "rest", "backend", "mode"} <= set(valid) and "shapes" not in valid
    elif "dimm" in message:
        assert valid == ["entry", "dim", "min", "max"]
    else:
        assert {"backend", "rules", "shapes", "optimizer", "cache"} <= set(valid) and "action" not in valid


def test_a_misspelt_key_in_a_policy_file_names_the_file(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text(
        "defaults: [schema, _self_]\nrules: [{name: m}]\nshapes: {pad: {bukets: [8]}}\n"
    )
    monkeypatch.setattr("compile_trainer.schema.load.bundled_policy_dir", lambda: tmp_path)
    with pytest.raises(PolicyError, match=r"compile policy 'mine' \(.*mine.yaml\): unknown key 'shapes.pad.bukets'"):
        to_policy("mine")


def test_a_misspelt_key_on_the_command_line_or_in_a_selected_policy_file(tmp_path):
    """What train.py checks before Hydra composes (Hydra's own message names neither the near key nor the valid
    ones): dotted overrides, whole values, and the policy files a `compile=...` choice selects, sweeps included."""
    (tmp_path / "compile").mkdir()
    (tmp_path / "compile" / "mine.yaml").write_text("defaults: [schema, _self_]\nbakend: eager\nrules: [{name: m}]\n")
    overrides = [
        "compile.rules.0.acton=full",
        "compile.optimizer={compile: true, clip_grad: 1.0}",
        "trainer.max_stepz=3",
        "compile=full,mine",
        "compile.shapes.pad.values.input_ids=0",  # a dict's keys are the user's own
        "~compile.cache",
    ]
    problems = unknown_override_keys(overrides, [tmp_path, CONF])
    assert problems == [
        "unknown key 'compile.rules.0.acton' (did you mean 'action'?); valid keys of compile.rules.0: backend, mode, "
        "fullgraph, dynamic, options, name, class_name, action, rest",
        "unknown key 'compile.optimizer.clip_grad' (did you mean 'clip_grad_norm'?); valid keys of compile.optimizer: "
        "backend, mode, fullgraph, dynamic, options, compile, kernel, auto_candidates, auto_steps, clip_grad_norm, "
        "clip_grad_value",
        problems[2],
        f"{tmp_path / 'compile' / 'mine.yaml'}: unknown key 'compile.bakend' (did you mean 'backend'?); valid keys "
        f"of compile: {problems[3].split('valid keys of compile: ')[1]}",
    ]
    assert problems[2].startswith("unknown key 'trainer.max_stepz' (did you mean 'max_steps'?)")
    assert unknown_override_keys(["compile=regional", "compile.backend=eager", "trainer.max_steps=3"], [CONF]) == []
    # Hydra itself still refuses them: the check above only words the message
    with initialize_config_dir(str(CONF), version_base="1.3"), pytest.raises(Exception, match="acton"):
        compose("config", overrides=["compile.rules.0.acton=full"])


def _fit(module, *callbacks):
    quiet_cpu_trainer(max_steps=1, callbacks=list(callbacks)).fit(module)


def _callback(policy: str) -> CompileCallback:
    return CompileCallback(policy, backend="eager", print_plan=False, telemetry=False)


def test_two_compile_callbacks_in_one_trainer_are_refused_naming_both():
    module = TinyRegression(n_batches=1)
    with pytest.raises(PolicyError, match=r"this Trainer has 2 CompileCallbacks \(policies 'regional', 'full'\)"):
        _fit(module, _callback("regional"), _callback("full"))
    assert getattr(module, "_compile_trainer_applied", None) is None, "refused before anything was compiled"


def test_a_second_fit_under_another_policy_names_the_policy_left_from_the_first_and_how_to_remove_it():
    module = TinyRegression(n_batches=1)
    first = _callback("regional")
    _fit(module, first)
    second = _callback("full")
    expected = (
        r"still carries compile policy 'regional', applied before this fit began by the CompileCallback of an "
        r"earlier fit, but this CompileCallback holds 'full'.*`earlier_callback.applied.remove\(\)`"
    )
    with pytest.raises(PolicyError, match=expected):
        _fit(module, second)
    first.applied.remove()  # the fix the message gives
    _fit(module, second)
    assert [item.region.name for item in second.applied.compiled] == ["net"]

    by_hand = TinyRegression(n_batches=1)
    applied = apply_policy(by_hand, to_policy("full", backend="eager"))
    with pytest.raises(PolicyError, match=r"applied before this fit began by apply_policy.*`.remove\(\)` on what"):
        _fit(by_hand, _callback("regional"))
    applied.remove()


def _readme_policy_yaml() -> str:
    """The custom policy of README.md, exactly as printed there."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(# configs/compile/my_policy\.yaml[^\n]*\n.*?)```", readme, flags=re.S)
    assert len(blocks) == 1, "README.md shows one configs/compile/my_policy.yaml"
    return blocks[0]


def test_the_readme_custom_policy_composes_and_applies_to_the_recipe_gpt(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "compile" / "my_policy.yaml").write_text(_readme_policy_yaml())
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["compile=my_policy", "compile.backend=eager"])
    policy = to_policy(OmegaConf.to_container(cfg.compile, resolve=True))
    assert policy.name == "my_policy" and len(policy.rules) == 3

    torch.manual_seed(0)
    module = LanguageModel(TINY_GPT)
    eager = LanguageModel(TINY_GPT)
    eager.load_state_dict(module.state_dict())
    applied = apply_policy(module, policy)
    rows = {row["module"]: row for row in plan_rows(applied)}
    assert rows["model.blocks.0"]["action"] == "eager"
    assert rows["model.blocks.0.mlp"]["action"] == "full" and rows["model.blocks.0.mlp"]["rule"] == 2
    mlp = next(region for region in applied.plan.regions if region.name == "model.blocks.0.mlp")
    assert mlp.settings.mode == "max-autotune-no-cudagraphs"  # the rule's own (the eager backend takes no mode)
    blocks = [f"model.blocks.{i}" for i in range(1, TINY_GPT.n_layer)]
    assert all(rows[b]["action"] == "regional block" for b in blocks)
    assert rows["model.embed"]["action"] == rows["model.head"]["action"] == "regional rest"

    batch = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size))
    loss = module.model(batch, batch)[1]
    loss.backward()
    assert torch.allclose(loss, eager.model(batch, batch)[1])
    assert {item.region.name: item.calls for item in applied.compiled} == {
        "model.embed": 1,
        "model.blocks.0.mlp": 1,
        **{b: 1 for b in blocks},
        "model.head": 1,
    }
    applied.remove()


@pytest.mark.parametrize(
    "rules, message",
    [
        (  # the README's example before 2026-11-26: every MLP, also those inside the compiled blocks
            [{"name": "model", "action": "regional", "rest": "compile"}, {"class_name": "MLP", "action": "full"}],
            r"would compile 'model.blocks.0.mlp' inside 'model.blocks.0', a repeated block that rule 0 "
            r"Rule\(name='model', action='regional'\) compiles whole .*Valid: select the whole block in rule 1",
        ),
        (
            [{"name": "model", "action": "regional", "rest": "compile"}, {"name": "model.head.ln_f"}],
            r"inside 'model.head', a part that rule 0 .* compiles whole as one region \(rest: compile\)\. "
            r"Valid: select 'model.head' itself in rule 1",
        ),
        (
            [{"name": "model", "action": "full"}, {"name": "model.head", "action": "full"}],
            r"inside 'model', which rule 0 Rule\(name='model', action='full'\) compiles whole\. Valid: make rule 0 "
            r"'regional'",
        ),
    ],
)
def test_a_region_inside_another_names_what_compiles_the_outer_one_and_the_valid_fixes(rules, message):
    with pytest.raises(PolicyError, match=message):
        apply_policy(LanguageModel(TINY_GPT), to_policy({"backend": "eager", "rules": rules}))
