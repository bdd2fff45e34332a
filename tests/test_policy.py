from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from compile_trainer.background import background_compile_problem
from compile_trainer.configs import register_configs
from compile_trainer.policy import CompilePolicy, PolicyError, Rule, bundled_policy_names, to_policy

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def test_policy_from_name_dict_and_dataclass_with_overrides():
    by_name = to_policy("regional", backend="aot_eager")
    assert by_name.name == "regional" and by_name.backend == "aot_eager"
    assert by_name.rules[0].action == "regional" and by_name.rules[0].rest == "compile"
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
        ({"backend": "tensorrtx", "rules": [{"name": "m"}]}, "unknown backend 'tensorrtx'. Valid backends:.*inductor"),
        ({"rules": [{"name": "m", "action": "partial"}]}, "invalid action 'partial'. Valid actions: full, regional"),
        ({"rules": [{"name": "m", "rest": "maybe"}]}, "invalid rest 'maybe'"),
        ({"rules": [{"action": "full"}]}, "give `name`"),
        ({"rules": []}, "no rules"),
        ({"recompile_limit": 0, "rules": [{"name": "m"}]}, "recompile_limit"),
        ({"fullgraph": "sometimes", "rules": [{"name": "m"}]}, "fullgraph"),
    ],
)
def test_bad_policies_fail_with_what_is_valid(spec, message):
    with pytest.raises(PolicyError, match=message):
        to_policy(spec)


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


def test_hydra_rejects_a_typo_in_a_policy_key_and_a_trainer_argument():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="backnd"):
            compose("config", overrides=["compile.backnd=eager"])
        with pytest.raises(ConfigCompositionException, match="max_stepz"):
            compose("config", overrides=["trainer.max_stepz=3"])
        cfg = compose("config", overrides=["trainer.gradient_clip_val=0.5", "compile.rules.0.rest=eager"])
    assert cfg.trainer.gradient_clip_val == 0.5 and cfg.compile.rules[0].rest == "eager"
