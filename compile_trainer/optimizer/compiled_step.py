"""Compiled optimizer steps: one compiled update over flat buffers, hyperparameters that never recompile,
standard state, gradient clipping in the same update.

``compile_optimizer(optimizer, policy)`` replaces ``optimizer.step`` with a ``CompiledOptimizerStep``:

- the closure Lightning passes (forward, backward) runs eagerly under ``enable_grad``, then the compiled update
  clips the gradients (by norm or value, when asked) and updates every parameter;
- parameters and state are views into a few flat buffers (``compile_trainer.optimizer.flat``), so the update
  takes a handful of tensors: few kernels, few guards, a short compile;
- the update is one of two (``optimizer.kernel``): a Triton kernel per segment that reads each gradient where
  backward left it (``triton_update.py``; CUDA), or a ``torch.compile``d function over flat gradient buffers
  that backward's hooks fill (``inductor_update.py``; any device, CUDA graphs);
- learning rate, betas/momentum, eps and weight decay of every group are read each step from the param groups
  (plain Python floats, so schedulers, ``state_dict`` and loggers see the usual values) and reach the update as
  kernel arguments or one float64 tensor: a scheduler changing them never recompiles;
- the optimizer state is the optimizer's own (``exp_avg``, ``exp_avg_sq``, ``step``, ``momentum_buffer``),
  created by the optimizer's own eager step the first time a parameter gets a gradient, so checkpoints load
  into an eager optimizer and back. Step counts live on the parameters' device (as ``capturable=True`` and
  ``fused=True`` keep them), which on a GPU also marks the groups ``capturable``;
- clipping by norm takes every gradient's norm at the step (one multi-tensor reduction per segment), from the
  gradients as they are after anything that changed them since backward (a GradScaler's unscaling, DDP's
  averaging);
- a step where some parameter has no gradient, or no state yet, runs the optimizer's own step (after the same
  clipping); see docs/optimizer.md.

``compile: auto`` (``auto.py``) times the candidates and keeps the fastest; a trainer's optimizers get their steps
through ``trainer_steps.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch

from compile_trainer import compat
from compile_trainer.compiling.arguments import compile_kwargs
from compile_trainer.optimizer.algorithms import ADAM, SGD, Clipping, algorithm_for
from compile_trainer.optimizer.auto import AutoTrial, OptimizerChoice
from compile_trainer.optimizer.flat import FlatLayout
from compile_trainer.optimizer.inductor_update import InductorUpdate
from compile_trainer.schema import OptimizerPolicy, PolicyError, optimizer_settings, validate_optimizer_policy

if TYPE_CHECKING:
    from compile_trainer.optimizer.triton_update import TritonUpdate

log = logging.getLogger(__name__)


def _optimizer_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def triton_unavailable_reason(device: torch.device, algorithm) -> Optional[str]:
    """Why the Triton update cannot run here (``None`` when it can)."""
    if algorithm not in (ADAM, SGD):
        return "no Triton kernel for this optimizer"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        from compile_trainer.optimizer import triton_update
    except Exception as error:  # a triton that does not match this torch
        return f"triton does not import: {type(error).__name__}: {error}"
    if device.type != "cuda" and not triton_update.interpreted():
        return f"parameters on {device.type} (the Triton kernel runs on CUDA devices)"
    return None


def _choose_kernel(policy: OptimizerPolicy, algorithm, device: torch.device) -> Tuple[str, Optional[str]]:
    """The update to run (``triton`` or ``inductor``) and, when ``kernel: auto`` passed Triton over, why."""
    if policy.kernel == "inductor":
        return "inductor", None
    if policy.kernel == "triton":
        reason = triton_unavailable_reason(device, algorithm)
        if reason:
            raise PolicyError(f"optimizer.kernel=triton: {reason}. Use kernel: inductor (any device) or auto.")
        return "triton", None
    if device.type != "cuda":
        return "inductor", None  # the Triton kernel is for CUDA devices (its interpreter only for tests)
    reason = triton_unavailable_reason(device, algorithm)
    if reason is None and policy.mode is not None:
        reason = f"the optimizer section asks for mode={policy.mode}, a torch.compile setting"
    if reason:
        return "inductor", f"optimizer update compiled by Inductor, not the Triton kernel: {reason}"
    return "triton", None


class CompiledOptimizerStep:
    """Stands in for ``optimizer.step(closure=None)``; ``remove()`` gives the optimizer its own step back.

    ``grad_norm``: with clipping by norm, a 0-d float32 tensor on the parameters' device holding the last step's
    total gradient norm (before clipping), updated in place without a host sync: log it as any tensor.
    """

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
        kernel, note = _choose_kernel(policy, self.algorithm, self.device)
        self.layout = FlatLayout(optimizer, flat_grads=kernel == "inductor")
        self.update: Union[InductorUpdate, TritonUpdate]
        if kernel == "triton":
            from compile_trainer.optimizer.triton_update import TritonUpdate

            self.update, self.notes = TritonUpdate(optimizer, self.algorithm, self.layout), []
        else:
            kwargs, self.notes = compile_kwargs(optimizer_settings(policy, backend), self.device)
            self.update = InductorUpdate(optimizer, self.algorithm, self.layout, kwargs)
        self.notes += [note] if note else []
        self.clip: Clipping = (None, None)
        self.grad_norm = torch.zeros((), device=self.device, dtype=torch.float32)
        compat.mark_static_address(self.grad_norm)
        self.set_clipping(policy.clip_grad_norm, policy.clip_grad_value)
        self.compiled_steps = 0
        self.eager_steps = 0
        self.eager_reasons: Dict[str, int] = {}  # why steps ran the optimizer's own step, and how often
        self.on_choice = on_choice
        self.choice: Optional[OptimizerChoice] = None
        self.eager_choice: Optional[str] = None  # auto's eager winner, kept behind this step to clip
        self._trial: Optional[AutoTrial] = AutoTrial(self) if policy.compile == "auto" else None
        self._user_flags = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
        self._original_step = optimizer.__dict__.get("step")  # an LR scheduler's wrapper, usually
        setattr(self, compat.LR_SCHEDULER_WRAPPED, True)  # this step marks the optimizer stepped, as that wrapper does
        self._keep_steps_on_device()
        compat.set_step_handles_amp_scaling(optimizer, False)  # a GradScaler unscales and skips inf steps for us
        optimizer.step = self
        self._load_hook = optimizer.register_load_state_dict_post_hook(lambda _: self._state_replaced())

    def set_clipping(self, max_norm: Optional[float] = None, max_value: Optional[float] = None) -> None:
        """Clip gradients by total norm or by value inside the step (at most one; ``None``: not clipped)."""
        if max_norm is not None and max_value is not None:
            raise PolicyError("compiled optimizer step: clip by norm or by value, not both.")
        self.clip = (None if max_norm is None else float(max_norm), None if max_value is None else float(max_value))

    @property
    def in_auto_trial(self) -> bool:
        """Whether ``compile: auto`` is still timing the candidates."""
        return self._trial is not None

    @property
    def clipping(self) -> str:
        norm, value = self.clip
        return f"norm {norm:g}" if norm is not None else f"value {value:g}" if value is not None else "none"

    def __call__(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        compat.mark_optimizer_stepped(self.optimizer)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._trial is not None:
            self._trial.start_timing()  # after backward: the update, gathering gradients included, on the stream
        if self._trial is not None and self._trial.eager_candidate_next():
            self._trial.step()  # reading the gradients where backward left them, as it would in training
            return loss
        reason = self.eager_choice and f"auto chose {self.eager_choice}"
        reason = reason or self._not_ready()
        if reason:
            self.eager_step(reason, self.eager_choice)
        elif self._trial is not None:
            self._trial.step()
        else:
            self.compiled_update()
        return loss

    def _not_ready(self) -> Optional[str]:
        """Why the compiled update cannot run this step (gathering the gradients into the flat buffers if it can)."""
        missing = self.layout.gather_grads()
        if missing:
            return f"gradients: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        if not self.layout.bound:
            flags = [self.algorithm.flags(self.optimizer, group) for group in self.optimizer.param_groups]
            keys = [self.algorithm.state_keys(group_flags) for group_flags in flags]
            return self.layout.bind_state(keys, self.algorithm.has_step)
        return None

    def eager_step(self, reason: str, flags: Optional[str] = None) -> None:
        """The optimizer's own step (torch's ``fused``/``foreach`` as ``flags`` says), after the same clipping."""
        if reason not in self.eager_reasons:
            log.info("optimizer %s: its own step runs: %s", type(self.optimizer).__name__, reason)
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        if flags is not None:
            self.set_eager_flags(flags)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm, max_value = self.clip
        if max_norm is not None:
            self.grad_norm.copy_(torch.nn.utils.clip_grad_norm_(params, max_norm))
        elif max_value is not None:
            torch.nn.utils.clip_grad_value_(params, max_value)
        segments = self.layout.segments
        uniform = self.layout.bound and all(p.grad is not None for segment in segments for p in segment.params)
        type(self.optimizer).step(self.optimizer)
        self.eager_steps += 1
        if uniform:  # every count advanced by one, in place: the buffers still hold the state, no check (sync) needed
            self.update.note_eager_step()
        else:  # state it created, or step counts it left unequal, are checked again
            self.layout.bound = False

    def compiled_update(self) -> None:
        optimizer = self.optimizer
        pre_hooks, post_hooks = compat.optimizer_step_hooks(optimizer)
        for hook in pre_hooks:
            hook(optimizer, (), {})
        with torch.no_grad():
            self.update.run(self.clip, self.grad_norm)
        self.compiled_steps += 1
        for hook in post_hooks:
            hook(optimizer, (), {})

    def remove(self) -> None:
        """Restore the optimizer's own step (state, flags and the flat buffers' views stay as they are)."""
        optimizer = self.optimizer
        if self._original_step is None:
            optimizer.__dict__.pop("step", None)
        else:
            optimizer.step = self._original_step
        compat.set_step_handles_amp_scaling(optimizer, any(g.get("fused") for g in optimizer.param_groups))
        self._load_hook.remove()
        self.layout.remove_hooks()

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
        self.layout.bound = False  # the next step copies the loaded state into the flat buffers
        self._keep_steps_on_device()

    def set_eager_flags(self, name: str) -> None:
        """Make the optimizer's own step run torch's ``fused`` or ``foreach`` implementation."""
        for group in self.optimizer.param_groups:
            group["fused"] = name == "fused"
            group["foreach"] = name == "foreach"

    def choose(self, choice: OptimizerChoice) -> None:
        """Keep ``choice.chosen`` from now on; an eager winner gets the optimizer's own step back, or, while this
        step clips gradients, runs behind it (clipping, then torch's step)."""
        self.choice = choice
        self._trial = None
        if choice.chosen == "compiled":
            for group, (fused, foreach) in zip(self.optimizer.param_groups, self._user_flags):
                group["fused"], group["foreach"] = fused, foreach
            self.layout.install_hooks()
        else:
            self.set_eager_flags(choice.chosen)
            if self.clip == (None, None):
                self.remove()
            else:
                self.eager_choice = choice.chosen
        log.info("optimizer %s: %s", type(self.optimizer).__name__, choice.describe())
        if self.on_choice is not None:
            self.on_choice(choice)


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
