"""The compile policy: global compile settings and an ordered list of rules, as typed dataclasses.

A policy has global compile settings and an ordered list of rules. Each rule selects submodules (by
qualified-name glob and/or class name) and says what to do with them: ``full`` (compile the module whole),
``regional`` (compile each repeated block under it in place, so identical blocks share one compiled graph)
or ``eager`` (never compile it). Later rules refine earlier ones. Registered with Hydra's ConfigStore as
``compile/schema`` (``compile_trainer.runs.hydra_configs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from compile_trainer.schema.cache import CacheSettings
from compile_trainer.schema.distributed import DistributedSettings
from compile_trainer.schema.settings import CompileSettings, SettingsOverrides, settings_of
from compile_trainer.schema.shapes import ShapesPolicy

ACTIONS = ("full", "regional", "eager")
REST_ACTIONS = ("eager", "compile", "background", "outer", "nested", "auto")
BACKGROUND_LOWERINGS = ("auto", "subprocess", "thread")
OPTIMIZER_COMPILE = ("true", "false", "auto")
OPTIMIZER_KERNELS = ("auto", "triton", "inductor")
OPTIMIZER_CANDIDATES = ("fused", "foreach", "compiled")


@dataclass
class Rule(SettingsOverrides):
    """Select submodules and say how to compile them.

    ``name`` is a glob over qualified module names relative to the LightningModule
    (``*`` matches one name segment, ``**`` any number, e.g. ``model.blocks.*``);
    ``class_name`` matches the module's class name (a glob too, e.g. ``Block``).
    A module must match every field given. The compile settings (``backend``, ``mode``, ...) override the
    policy's where given.
    """

    name: Optional[str] = None
    class_name: Optional[str] = None
    action: str = "full"
    # For ``regional``: what to do with the parts under the module that are not repeated blocks
    # (embedding, final norm, head, the loss in the module's forward...): ``compile`` each part with
    # parameters as its own region; ``outer``: compile the module whole around its block stack, which runs
    # eagerly between (a graph break at the stack, or at the module that loops over it), its remaining
    # parts as regions (``compile`` where the module loops over its blocks itself); leave them ``eager``;
    # or ``nested``: compile the module whole, with each repeated block marked as a nested compile region
    # (``torch.compiler.nested_compile_region``) so that it is traced and compiled once and reused.
    # ``background``: the parts of ``compile``, compiled on a background thread after the first step (which
    # compiles only the blocks) while they run eagerly (``compiling.background``).
    # ``auto``: ``outer`` where the module's parameters and buffers outside its blocks are at least
    # ``CompilePolicy.regional_outer_min_share`` of its own, else ``background`` on a GPU where nothing else
    # decides when compiles happen (no compile cache, no shapes.warmup), else ``eager``.
    rest: str = "eager"

    def describe(self) -> str:
        parts = [
            f"name={self.name!r}" if self.name else "",
            f"class_name={self.class_name!r}" if self.class_name else "",
        ]
        return f"Rule({', '.join(p for p in parts if p)}, action={self.action!r})"


@dataclass
class OptimizerPolicy(SettingsOverrides):
    """How each optimizer's ``step`` runs (see ``compile_trainer.optimizer``).

    ``compile``: ``true`` replaces the step with a compiled update whose hyperparameters are tensors
    (LR schedules never recompile); ``auto`` times ``auto_candidates`` on the real parameters during
    the first steps and keeps the fastest; ``false`` leaves the optimizer alone. Independent of the
    policy's ``enabled`` and ``rules``. Compile settings not given here: the policy's ``backend``,
    ``fullgraph: true``, the default mode, no options (``optimizer_settings``).
    """

    compile: str = "false"
    # How the compiled update runs: ``triton``, one multi-tensor Triton kernel per flat segment that reads each
    # gradient where backward left it (CUDA; Adam, AdamW, SGD); ``inductor``, ``torch.compile`` of the update over
    # flat gradient buffers that backward's hooks fill (any device; the mode and options below apply); ``auto``,
    # ``triton`` where it can run and no ``mode`` is set here, else ``inductor``.
    kernel: str = "auto"
    auto_candidates: List[str] = field(default_factory=lambda: list(OPTIMIZER_CANDIDATES))
    # Timed steps per candidate for ``auto``, after one untimed warm-up step each (which compiles).
    auto_steps: int = 3
    # Gradient clipping inside the step (as ``clip_grad_norm_`` / ``clip_grad_value_``), at most one of the two.
    # Under Lightning, the Trainer's ``gradient_clip_val`` is taken over the same way.
    clip_grad_norm: Optional[float] = None
    clip_grad_value: Optional[float] = None


# The name of a policy given without one (a dict of its fields); messages call such a policy unnamed.
UNNAMED = "custom"


@dataclass
class CompilePolicy(CompileSettings):
    """A whole compile policy: global compile settings plus ordered rules.

    ``enabled: false`` (the ``none`` policy) trains eagerly but keeps the telemetry.
    """

    name: str = UNNAMED
    enabled: bool = True
    # Dynamo's per-frame recompile limit; past it a frame silently runs eagerly.
    recompile_limit: int = 8
    # A regional rule compiles a matched module whole instead (as ``full``) when its repeated blocks come in
    # several structures and average fewer than this many blocks per graph compiled at the first step (every
    # structure's, or the shared ones' where the others compile on the background thread: ``planning.reuse``;
    # ResNet-50 with all 8 of its structures at the first step: 2.0): compiling that many graphs takes about as long
    # as the whole model, and the breaks between them cost throughput. 0 compiles the blocks regionally whatever
    # their reuse.
    regional_min_reuse: float = 3.0
    # ``rest: auto`` compiles a matched module whole around its blocks (``outer``) when at least this share of
    # its parameters and buffers (by element count) lies outside the blocks, else leaves the code around them
    # eager. Measured on an H100: HF Llama and GPT-2 (~26-32% outside: embeddings, head, and a loss on large
    # logits) gained from ``outer``; timm ViT-B/16 (1.7% outside) lost cold start to its outer graphs, one prefix
    # and resume per frame down to the break, and to its parts compiled as regions. 0: always ``outer``.
    regional_outer_min_share: float = 0.10
    # Compile on a background thread while the first steps run eagerly (compile_trainer.compiling.background).
    background: bool = False
    # Where a background compile's Inductor lowering runs: ``subprocess`` (Inductor's compile subprocess; the
    # thread waits for it without holding the GIL, so the eager steps keep their speed), ``thread`` (on the
    # background thread itself, sharing the interpreter with the eager steps) or ``auto`` (``lowering``).
    background_lowering: str = "auto"
    rules: List[Rule] = field(default_factory=list)
    # Variable-length batches: mark_dynamic axes, padding buckets, warm-up, strict recompiles.
    shapes: ShapesPolicy = field(default_factory=ShapesPolicy)
    optimizer: OptimizerPolicy = field(default_factory=OptimizerPolicy)
    # A compile cache kept between runs and machines (compile_trainer.cache).
    cache: CacheSettings = field(default_factory=CacheSettings)
    # Under DDP/FSDP2: compiler collectives, per-rank telemetry (compile_trainer.schema.distributed).
    distributed: DistributedSettings = field(default_factory=DistributedSettings)

    @property
    def settings(self) -> CompileSettings:
        return settings_of(self)

    @property
    def label(self) -> str:
        """How messages name the policy: ``compile policy 'regional'``, or as unnamed where it was given no name."""
        return "unnamed compile policy" if self.name == UNNAMED else f"compile policy {self.name!r}"

    @property
    def compiles_modules(self) -> bool:
        return self.enabled and bool(self.rules)

    @property
    def lowering(self) -> str:
        """``background_lowering`` with ``auto`` resolved: ``subprocess`` where every region compiles in the
        background (``background: true``: many graphs beside eager steps that would wait for the GIL), ``thread``
        where only the parts around the blocks do (``rest: background``): a few small graphs, which the subprocess
        compiled far slower (the recipe's GPT-2 small on an H200: 1 of its 2 parts in 13.6-21.1 s against both in
        3.5-3.8 s on the thread, the steps beside it 73-86 ms against 19 ms once compiled)."""
        if self.background_lowering != "auto":
            return self.background_lowering
        return "subprocess" if self.background else "thread"

    def regional_rules_with_rest(self, rest: str) -> List[int]:
        """The indices of the regional rules whose ``rest`` is ``rest``."""
        return [i for i, rule in enumerate(self.rules) if rule.action == "regional" and rule.rest == rest]


def optimizer_settings(optimizer: OptimizerPolicy, policy_backend: str = "inductor") -> CompileSettings:
    """The settings the optimizer's update is compiled with: its own, else the policy's backend, fullgraph."""
    return CompileSettings(backend=policy_backend, fullgraph=True, dynamic=False).overridden_by(optimizer)
