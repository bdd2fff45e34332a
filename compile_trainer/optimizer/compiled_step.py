"""Compiled optimizer steps: one compiled update of every parameter, tensor hyperparameters, standard state.

``compile_optimizer(optimizer, policy)`` replaces ``optimizer.step`` with a ``CompiledOptimizerStep``:

- the closure Lightning passes (forward, backward, clipping) runs eagerly under ``enable_grad``, then one
  compiled function updates every parameter that has a gradient;
- learning rate, betas/momentum, eps and weight decay of every group are copied each step from the
  param groups (plain Python floats, so schedulers, ``state_dict`` and loggers see the usual values) into
  one float64 tensor that the compiled function reads: a scheduler changing them never recompiles;
- the optimizer state is the optimizer's own (``exp_avg``, ``exp_avg_sq``, ``step``, ``momentum_buffer``),
  created by the optimizer's own eager step the first time a parameter gets a gradient, so checkpoints load
  into an eager optimizer and back. Step counts live on the parameters' device (as ``capturable=True`` and
  ``fused=True`` keep them), which on a GPU also marks the groups ``capturable``;
- the update itself (``compile_trainer.optimizer.algorithms``) is written per parameter; see docs/optimizer.md.

``compile: auto`` times the candidates (``fused``, ``foreach``, ``compiled``) on the real parameters during
the first steps, keeps the fastest, and reports an ``OptimizerChoice``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from compile_trainer import compat
from compile_trainer.compiling.regions import ENTRY_PREFIX, compile_kwargs, renamed_function
from compile_trainer.optimizer.algorithms import ADAM, TensorLists, algorithm_for
from compile_trainer.schema import OptimizerPolicy, optimizer_settings, validate_optimizer_policy

log = logging.getLogger(__name__)


@dataclass
class OptimizerChoice:
    """What ``compile: auto`` measured and chose."""

    chosen: str
    step_ms: Dict[str, float]  # fastest timed step per candidate
    skipped: Dict[str, str] = field(default_factory=dict)  # candidate -> why it was not timed
    device: str = "cpu"
    timed_steps: int = 0

    def describe(self) -> str:
        others = ", ".join(f"{n} {ms:.3f} ms" for n, ms in self.step_ms.items() if n != self.chosen)
        text = f"auto chose {self.chosen} ({self.step_ms[self.chosen]:.3f} ms per step"
        text += f"{' vs ' + others if others else ''}; best of {self.timed_steps} timed steps each on {self.device})"
        return text + "".join(f"; {name} skipped: {why}" for name, why in self.skipped.items())


def _optimizer_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _entry_function(update: Callable[..., None], optimizer: torch.optim.Optimizer) -> types.FunctionType:
    """``update`` under its own code object, named like the regions' entries
    (``compiled_region__optimizer_step_AdamW``): its own Dynamo cache, and the compile telemetry attributes
    its compiles and recompiles to an ``optimizer_step_AdamW`` row."""
    return renamed_function(update, f"{ENTRY_PREFIX}optimizer_step_{type(optimizer).__name__}")


class CompiledOptimizerStep:
    """Stands in for ``optimizer.step(closure=None)``; ``remove()`` gives the optimizer its own step back."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        policy: OptimizerPolicy,
        backend: str = "inductor",
        on_choice: Optional[Callable[[OptimizerChoice], None]] = None,
    ):
        self.optimizer = optimizer
        self.algorithm = algorithm_for(optimizer)
        self.policy = policy
        self.device = _optimizer_device(optimizer)
        self.compile_kwargs, self.notes = compile_kwargs(optimizer_settings(policy, backend), self.device)
        entry = _entry_function(self.algorithm.update, optimizer)
        self.entry_name = entry.__name__  # the code name Dynamo's compilation metrics report
        self._compiled = torch.compile(entry, **self.compile_kwargs)
        # float64 keeps bias corrections as exact as torch's Python-float path; MPS has no float64.
        self._hyper_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.hyper = torch.zeros(0, device=self.device, dtype=self._hyper_dtype)
        self._hyper_values: Optional[List[List[float]]] = None
        self._prepared: Optional[Tuple[List[List[int]], List[List[List[Optional[Tensor]]]]]] = None
        self.compiled_steps = 0
        self.eager_steps = 0
        self.on_choice = on_choice
        self.choice: Optional[OptimizerChoice] = None
        self._trial: Optional[_AutoTrial] = _AutoTrial(self) if policy.compile == "auto" else None
        self._user_flags = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
        self._original_step = optimizer.__dict__.get("step")  # an LR scheduler's wrapper, usually
        setattr(self, compat.LR_SCHEDULER_WRAPPED, True)  # this step marks the optimizer stepped, as that wrapper does
        self._keep_steps_on_device()
        compat.set_step_handles_amp_scaling(optimizer, False)  # a GradScaler unscales and skips inf steps for us
        optimizer.step = self
        self._load_hook = optimizer.register_load_state_dict_post_hook(lambda _: self._state_replaced())

    def __call__(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        compat.mark_optimizer_stepped(self.optimizer)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self._prepare()
        if groups is None:
            self.eager_step()  # some parameter's first step: the optimizer creates its state itself
        elif self._trial is not None:
            self._trial.step(groups)
        else:
            self.compiled_update(groups)
        return loss

    def eager_step(self) -> None:
        type(self.optimizer).step(self.optimizer)
        self.eager_steps += 1
        self._prepared = None

    def compiled_update(self, groups: List[TensorLists]) -> None:
        if not any(group[0] for group in groups):
            return
        optimizer = self.optimizer
        pre_hooks, post_hooks = compat.optimizer_step_hooks(optimizer)
        for hook in pre_hooks:
            hook(optimizer, (), {})
        flags = self._write_hyper()
        with torch.no_grad():
            self._compiled(groups, self.hyper, flags)
        self.compiled_steps += 1
        for hook in post_hooks:
            hook(optimizer, (), {})

    def remove(self) -> None:
        """Restore the optimizer's own step (state and flags stay as they are)."""
        optimizer = self.optimizer
        if self._original_step is None:
            optimizer.__dict__.pop("step", None)
        else:
            optimizer.step = self._original_step
        compat.set_step_handles_amp_scaling(optimizer, any(g.get("fused") for g in optimizer.param_groups))
        self._load_hook.remove()

    def _write_hyper(self) -> Tuple[Tuple[bool, ...], ...]:
        groups = self.optimizer.param_groups
        values = [self.algorithm.hyper(group) for group in groups]
        if values != self._hyper_values:
            if self.hyper.shape[0] != len(values):
                self.hyper = torch.zeros(len(values), len(values[0]), device=self.device, dtype=self._hyper_dtype)
                compat.mark_static_address(self.hyper)
            self.hyper.copy_(torch.tensor(values, dtype=self._hyper_dtype), non_blocking=True)
            self._hyper_values = values
        return tuple(self.algorithm.flags(self.optimizer, group) for group in groups)

    def _prepare(self) -> Optional[List[TensorLists]]:
        """Per group: [params, grads, *state lists] of the parameters that have gradients; None if state is missing."""
        active = [[p for p in group["params"] if p.grad is not None] for group in self.optimizer.param_groups]
        key = [[id(p) for p in params] for params in active]
        if self._prepared is None or self._prepared[0] != key:
            state = self._state_lists(active)
            if state is None:
                return None
            self._prepared = (key, state)
        return [[params, [p.grad for p in params], *lists] for params, lists in zip(active, self._prepared[1])]

    def _state_lists(self, active: List[List[Tensor]]) -> Optional[List[List[List[Optional[Tensor]]]]]:
        result = []
        for group, params in zip(self.optimizer.param_groups, active):
            flags = self.algorithm.flags(self.optimizer, group)
            lists: List[List[Optional[Tensor]]] = [[] for _ in range(self.algorithm.state_lists)]
            for param in params:
                if param.grad.is_sparse:
                    raise RuntimeError(f"compiled optimizer step: sparse gradients are not supported ({param.shape})")
                tensors = self.algorithm.state(self.optimizer.state[param], flags)
                if tensors is None:
                    return None
                for target, tensor in zip(lists, tensors):
                    if tensor is not None:
                        compat.mark_static_address(tensor)  # CUDA graphs need not copy them
                        target.append(tensor)
            result.append(lists)
        return result

    def _keep_steps_on_device(self) -> None:
        """Adam's step counts on the parameters' device, where the compiled update reads them."""
        if self.algorithm is not ADAM:
            return
        for group in self.optimizer.param_groups:
            if self.device.type != "cpu":
                group["capturable"] = True  # so an eager step (auto's candidates, a resumed run) keeps them there
            for param in group["params"]:
                state = self.optimizer.state.get(param)
                if state and state["step"].device != param.device:
                    state["step"] = state["step"].to(param.device)

    def _state_replaced(self) -> None:
        self._prepared = None
        self._keep_steps_on_device()

    def set_eager_flags(self, name: str) -> None:
        """Make the optimizer's own step run torch's ``fused`` or ``foreach`` implementation."""
        for group in self.optimizer.param_groups:
            group["fused"] = name == "fused"
            group["foreach"] = name == "foreach"

    def choose(self, choice: OptimizerChoice) -> None:
        """Keep ``choice.chosen`` from now on; an eager winner gets the optimizer's own step back."""
        self.choice = choice
        self._trial = None
        if choice.chosen == "compiled":
            for group, (fused, foreach) in zip(self.optimizer.param_groups, self._user_flags):
                group["fused"], group["foreach"] = fused, foreach
        else:
            self.set_eager_flags(choice.chosen)
            self.remove()
        log.info("optimizer %s: %s", type(self.optimizer).__name__, choice.describe())
        if self.on_choice is not None:
            self.on_choice(choice)


class _AutoTrial:
    """Runs real training steps with each candidate in turn: one warm-up step (it compiles), then timed steps."""

    def __init__(self, step: CompiledOptimizerStep):
        self.owner = step
        self.skipped: Dict[str, str] = {}
        candidates = list(step.policy.auto_candidates)
        reason = compat.fused_unsupported_reason(step.optimizer) if "fused" in candidates else None
        if reason:
            candidates.remove("fused")
            self.skipped["fused"] = reason
        self.schedule = [(name, timed) for name in candidates for timed in [False] + [True] * step.policy.auto_steps]
        self.seconds: Dict[str, List[float]] = {name: [] for name in candidates}

    def step(self, groups: List[TensorLists]) -> None:
        name, timed = self.schedule.pop(0)
        owner = self.owner
        _synchronize(owner.device)
        start = time.perf_counter()
        try:
            if name == "compiled":
                owner.compiled_update(groups)
            else:
                owner.set_eager_flags(name)
                type(owner.optimizer).step(owner.optimizer)
        except Exception as error:  # a compile that fails leaves the other candidates to choose from
            if name != "compiled" or timed or len(self.seconds) == 1:
                raise
            self._drop_compiled(error)
            owner.eager_step()
        else:
            _synchronize(owner.device)
            if timed:
                self.seconds[name].append(time.perf_counter() - start)
        if not self.schedule:
            # The best, not the median: noise (another process, a late autotune or CUDA-graph recording) only adds.
            step_ms = {name: 1000 * min(times) for name, times in self.seconds.items()}
            chosen = min(step_ms, key=step_ms.__getitem__)
            owner.choose(OptimizerChoice(chosen, step_ms, self.skipped, str(owner.device), owner.policy.auto_steps))

    def _drop_compiled(self, error: Exception) -> None:
        message = " ".join(str(error).split())[:300]
        self.skipped["compiled"] = f"compile failed: {type(error).__name__}: {message}"
        log.warning("optimizer %s: auto: %s", type(self.owner.optimizer).__name__, self.skipped["compiled"])
        del self.seconds["compiled"]
        self.schedule = [entry for entry in self.schedule if entry[0] != "compiled"]


def compile_optimizer(
    optimizer: torch.optim.Optimizer,
    policy: Union[OptimizerPolicy, Mapping[str, Any], None] = None,
    backend: str = "inductor",
    on_choice: Optional[Callable[[OptimizerChoice], None]] = None,
) -> Optional[CompiledOptimizerStep]:
    """Replace ``optimizer.step`` as ``policy`` says; ``None`` when it says ``compile: false``.

    ``policy`` defaults to ``compile: true``; ``backend`` is used where the policy gives none.
    """
    if policy is None:
        policy = OptimizerPolicy(compile="true")
    elif not isinstance(policy, OptimizerPolicy):
        policy = OptimizerPolicy(**policy)
    policy = validate_optimizer_policy(dataclasses.replace(policy))
    if policy.compile == "false":
        return None
    if isinstance(optimizer.step, CompiledOptimizerStep):
        return optimizer.step
    return CompiledOptimizerStep(optimizer, policy, backend, on_choice)


def compile_optimizers(
    optimizers: Sequence[torch.optim.Optimizer],
    policy: OptimizerPolicy,
    backend: str = "inductor",
    on_choice: Optional[Callable[[OptimizerChoice], None]] = None,
) -> List[CompiledOptimizerStep]:
    """``compile_optimizer`` for each optimizer; every one is checked before any is changed."""
    if policy.compile != "false":
        for optimizer in optimizers:
            algorithm_for(optimizer)
    steps = [compile_optimizer(optimizer, policy, backend, on_choice) for optimizer in optimizers]
    return [step for step in steps if step is not None]


def describe_steps(steps: Sequence[CompiledOptimizerStep]) -> str:
    """One line per compiled optimizer step, for the plan printed at fit start."""
    lines = []
    for step in steps:
        kwargs = step.compile_kwargs
        params = sum(len(g["params"]) for g in step.optimizer.param_groups)
        mode = "auto: timing " + ", ".join(step.policy.auto_candidates) if step._trial else "compiled"
        lines.append(
            f"optimizer {type(step.optimizer).__name__}: {mode} ({params} params, "
            f"{len(step.optimizer.param_groups)} groups; backend={kwargs['backend']} "
            f"mode={kwargs['mode'] or 'default'})"
        )
        lines += [f"note: {note}" for note in step.notes]
    return "\n".join(lines)
