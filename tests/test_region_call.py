"""The one owner of a compiled region's call: interceptors run in their declared order, then the compiled code."""

import pytest
import torch

from compile_trainer import apply_policy, to_policy
from compile_trainer.compiling import region_call
from compile_trainer.shapes.batch import BatchShaper
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors


class Recording:
    def __init__(self, position, log, replaces=False):
        self.position, self.log, self.replaces_compiled = position, log, replaces

    def __call__(self, item, proceed, args, kwargs):
        self.log.append((self.position, item.region.name))
        if self.replaces_compiled:
            return torch.zeros_like(args[0])
        return proceed(*args, **kwargs)


def test_interceptors_run_outermost_first_whatever_the_order_they_were_added(tiny_gpt):
    applied = apply_policy(tiny_gpt, to_policy({"rules": [{"name": "blocks.0"}]}, backend="eager"))
    log = []
    inner, outer = Recording(region_call.BACKGROUND, log), Recording(region_call.MARK_INPUTS, log)
    applied.interceptors.add(inner)
    applied.interceptors.add(outer)
    tiny_gpt(torch.zeros(2, 8, dtype=torch.long))
    assert log == [(region_call.MARK_INPUTS, "blocks.0"), (region_call.BACKGROUND, "blocks.0")]
    assert applied.compiled[0].calls == 1, "the compiled code ran once, after both"
    with pytest.raises(ValueError, match="already sits at position"):
        applied.interceptors.add(Recording(region_call.BACKGROUND, log))

    applied.interceptors.remove(inner)
    replacing = Recording(region_call.BACKGROUND, log, replaces=True)
    applied.interceptors.add(replacing)
    assert applied.interceptors.replaces_compiled
    tiny_gpt(torch.zeros(2, 8, dtype=torch.long))
    assert applied.compiled[0].calls == 1, "an interceptor that replaces the compiled code keeps it from running"


def test_shape_interceptors_join_the_chain_and_leave_it(tiny_gpt):
    policy = to_policy(
        "regional",
        backend="eager",
        shapes={"dynamic": [{"entry": "0", "dim": 1}], "warmup": True, "strict_recompiles": True},
    )
    applied = apply_policy(tiny_gpt, policy)
    hooks = RegionShapeInterceptors(applied, BatchShaper(policy.shapes))
    positions = [i.position for i in applied.interceptors.interceptors]
    # the blocks' shared entry decides about lower-precision inputs first (compiling.promoted_inputs)
    assert positions == [region_call.PROMOTE_INPUTS, region_call.MARK_INPUTS, region_call.STRICT_RECOMPILES]
    hooks.remove()
    assert [i.position for i in applied.interceptors.interceptors] == [region_call.PROMOTE_INPUTS]
