"""Telemetry across ranks under DDP (a divergent rank named) and the compiler-collectives option."""

import pytest

from compile_trainer import apply_policy, to_policy
from compile_trainer.compiling.runtime_checks import check_distributed_runtime
from compile_trainer.schema import PolicyError
from compile_trainer.telemetry.ranks import describe_rank_report, divergent_ranks, rank_report
from tests.test_distributed import DDP_TIMEOUT, finish, start


def test_ddp_names_the_rank_whose_recompiles_diverge(tmp_path):
    out = tmp_path / "skew.json"
    ddp = finish(start(out, "--devices", "2", "--batch", "2", "--policy", "regional", "--skew"), out)
    ranks = ddp["summary"]["ranks"]
    assert ranks["recompiles_by_rank"][0] == 0 < ranks["recompiles_by_rank"][1]
    assert ranks["divergent_recompile_ranks"] == [1]
    assert "divergent recompiles: rank 1" in ddp["output"]


def test_compiler_collectives_refused_on_the_cpu_with_the_reason(tmp_path):
    out = tmp_path / "collectives.json"
    process = start(out, "--devices", "2", "--batch", "2", "--consistent-dynamic-shapes")
    output, _ = process.communicate(timeout=DDP_TIMEOUT)
    assert process.returncode != 0 and not out.exists()
    assert "consistent_dynamic_shapes (Dynamo's compiler collectives) needs an accelerator" in output


def test_compiler_collectives_option_sets_and_restores_dynamo_config():
    from torch import nn

    from compile_trainer import compat

    before = compat.compiler_collectives()
    model = nn.Sequential(nn.Linear(2, 2))
    applied = apply_policy(model, to_policy("full", backend="eager", distributed={"consistent_dynamic_shapes": True}))
    assert compat.compiler_collectives() is True
    assert any("compiler collectives on" in note for note in applied.notes)
    applied.remove()
    assert compat.compiler_collectives() is before


def test_under_compiler_collectives_inductor_adds_no_size_guard_of_its_own():
    """A size guard checked against one rank's sizes recompiles that rank alone, which then waits in the compile's
    collective: the regions get the options that keep Inductor's own size checks from guarding (where this torch
    has them), as under declared dynamic sizes."""
    from torch import nn

    from compile_trainer.compat import inductor_options_without_size_guards

    def applied_options(**distributed):
        policy = to_policy("regional", backend="inductor", distributed=distributed)
        applied = apply_policy(nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)]), policy)
        options = [item.region.settings.options for item in applied.compiled]
        applied.remove()
        assert len(options) == 3, "every block compiled"
        return options

    without = inductor_options_without_size_guards()
    assert all(without.items() <= options.items() for options in applied_options(consistent_dynamic_shapes=True))
    if without:  # torch >= 2.10
        assert not any(without.items() <= options.items() for options in applied_options())


def test_rank_report_names_divergent_ranks():
    summaries = [
        {"compile_time_s": 1.0, "recompiles": 2, "first_step_time_s": 0.5, "unique_graphs": 4},
        {"compile_time_s": 3.0, "recompiles": 2, "first_step_time_s": 0.7, "unique_graphs": 4},
        {"compile_time_s": 2.0, "recompiles": 5, "first_step_time_s": 0.6, "unique_graphs": 7},
    ]
    summaries = [s | {"steady_step_time_median_s": m} for s, m in zip(summaries, (0.02, 0.03, 0.025))]
    report = rank_report(summaries)
    assert report["steady_step_time_median_s_by_rank"] == [0.02, 0.03, 0.025]
    assert (report["compile_time_s_min"], report["compile_time_s_max"]) == (1.0, 3.0)
    assert report["recompiles_by_rank"] == [2, 2, 5] and report["divergent_recompile_ranks"] == [2]
    assert "rank 2 (5)" in describe_rank_report(report)
    assert divergent_ranks([1, 1]) == [] and divergent_ranks([0, 3]) == [1]


def test_distributed_check_passes_without_the_option():
    check_distributed_runtime(to_policy("regional"))  # nothing to refuse: no exception
    check_distributed_runtime(to_policy("regional_background"))  # accepted (tests/test_distributed.py runs it)
    with pytest.raises(PolicyError, match="needs an accelerator"):
        check_distributed_runtime(to_policy("regional", distributed={"consistent_dynamic_shapes": True}))
