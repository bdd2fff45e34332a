from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from compile_trainer import CompileCallback, apply_policy, format_plan_table
from compile_trainer.compiling.runtime_checks import background_compile_problem
from compile_trainer.runs.hydra_configs import register_configs
from compile_trainer.schema import CompilePolicy, PolicyError, Rule, bundled_policy_names, to_policy

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def test_policy_from_name_dict_and_dataclass_with_overrides():
    by_name = to_policy("regional", backend="aot_eager")
    assert by_name.name == "regional" and by_name.backend == "aot_eager"
    assert by_name.rules[0].action == "regional" and by_name.rules[0].rest == "auto"
    by_dict = to_policy({"rules": [{"class_name": "Block", "action": "full", "mode": "max-autotune"}]})
    assert isinstance(by_dict.rules[0], Rule) and by_dict.rules[0].mode == "max-autotune"
    by_dataclass = to_policy(CompilePolicy(rules=[Rule(name="model")]), fullgraph=True)
    assert by_dataclass.fullgraph is True and by_dataclass.rules[0].name == "model"


def test_unknown_policy_name_lists_bundled_policies():
    with pytest.raises(PolicyError, match="unknown compile policy 'regionl'.*full.*none.*regional"):
        to_policy("regionl")


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"rulez": []}, "rulez"),
        ({"rules": [{"name": "model", "acton": "full"}]}, "acton"),
        (
            {"mode": "fastest", "rules": [{"name": "m"}]},
            "invalid mode 'fastest'. Valid modes: default, reduce-overhead",
        ),
        ({"rules": [{"name": "m", "action": "partial"}]}, "invalid action 'partial'. Valid actions: full, regional"),
        ({"rules": [{"name": "m", "rest": "maybe"}]}, "invalid rest 'maybe'"),
        ({"rules": [{"action": "full"}]}, "give `name`"),
        ({"rules": []}, "no rules and does not compile the optimizer"),
        ({"recompile_limit": 0, "rules": [{"name": "m"}]}, "recompile_limit"),
        ({"fullgraph": "sometimes", "rules": [{"name": "m"}]}, "fullgraph"),
    ],
)
def test_bad_policies_fail_with_what_is_valid(spec, message):
    with pytest.raises(PolicyError, match=message):
        to_policy(spec)


def test_checks_that_need_torch_run_where_the_policy_is_applied(tiny_gpt):
    spec = {"backend": "tensorrtx", "rules": [{"name": "blocks.*"}], "optimizer": {"backend": "nope"}}
    policy = to_policy(spec)  # the schema layer does not ask torch which backends exist
    with pytest.raises(PolicyError, match="unknown backend 'tensorrtx'. Valid backends:.*inductor"):
        apply_policy(tiny_gpt, policy)
    with pytest.raises(PolicyError, match="unknown backend 'tensorrtx'. Valid backends:.*inductor"):
        CompileCallback(spec)
    with pytest.raises(PolicyError, match="optimizer: unknown backend 'nope'"):
        CompileCallback({**spec, "backend": "inductor"})


def test_an_optimizer_only_policy_is_valid_and_compiles_no_module(tiny_gpt):
    callback = CompileCallback({"optimizer": {"compile": True}})
    assert callback.policy.optimizer.compile == "true" and not callback.policy.compiles_modules
    applied = apply_policy(tiny_gpt, callback.policy)
    assert applied.compiled == [] and "no module rules" in format_plan_table(applied)
    with pytest.raises(PolicyError, match="no rules and does not compile the optimizer"):
        to_policy({"rules": []})


@pytest.mark.parametrize("name", bundled_policy_names())
def test_every_bundled_policy_composes_through_hydra(name):
    bundled = {"none", "full", "regional", "regional_background", "full_background", "max_autotune", "reduce_overhead"}
    assert bundled <= set(bundled_policy_names())
    assert not to_policy("full").background and to_policy("regional").mode == "reduce-overhead"
    first_line = (CONF / "compile" / f"{name}.yaml").read_text().splitlines()[0]
    assert first_line.startswith(f"# {name}:"), "each bundled policy starts with a one-line description"
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"compile={name}"])
    if cfg.compile.background and background_compile_problem():  # torch < 2.11: refused, saying why
        with pytest.raises(PolicyError, match="force_non_lazy_backward_lowering"):
            to_policy(OmegaConf.to_container(cfg.compile, resolve=True))
        return
    policy = to_policy(OmegaConf.to_container(cfg.compile, resolve=True))
    assert policy.name == name and policy.background == name.endswith("_background")
    assert policy == to_policy(name)


def test_a_bundled_policy_builds_on_another_through_its_defaults(tmp_path, monkeypatch):
    """dynamic_full lists dynamic in its defaults and keeps only what differs: dynamic's dims (a list it does not
    repeat) come through, its own rules replace dynamic's (lists are replaced, as Hydra does)."""
    assert "- dynamic" in (CONF / "compile" / "dynamic_full.yaml").read_text()
    assert '"@position_ids", dim: 1' not in (CONF / "compile" / "dynamic_full.yaml").read_text()
    dynamic, dynamic_full = to_policy("dynamic"), to_policy("dynamic_full")
    assert dynamic_full.shapes.dynamic == dynamic.shapes.dynamic and len(dynamic.shapes.dynamic) == 10
    assert [r.action for r in dynamic_full.rules] == ["full"] and dynamic_full.name == "dynamic_full"
    assert dynamic.shapes.pad.multiple_of is None and dynamic_full.shapes.pad.multiple_of == 64

    (tmp_path / "a.yaml").write_text("defaults:\n  - schema\n  - b\n  - _self_\nrules: [{name: '*', action: full}]\n")
    (tmp_path / "b.yaml").write_text("defaults:\n  - a\n")
    monkeypatch.setattr("compile_trainer.schema.load.bundled_policy_dir", lambda: tmp_path)
    with pytest.raises(PolicyError, match=r"compile policy 'a' includes itself: a -> b -> a"):
        to_policy("a")


def test_hydra_rejects_a_typo_in_a_policy_key_and_a_trainer_argument():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="backnd"):
            compose("config", overrides=["compile.backnd=eager"])
        with pytest.raises(ConfigCompositionException, match="max_stepz"):
            compose("config", overrides=["trainer.max_stepz=3"])
        cfg = compose("config", overrides=["trainer.gradient_clip_val=0.5", "compile.rules.0.rest=eager"])
    assert cfg.trainer.gradient_clip_val == 0.5 and cfg.compile.rules[0].rest == "eager"
