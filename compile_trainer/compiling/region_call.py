"""One owner of what a compiled region's call does: an ordered chain of interceptors, then the compiled code.

``apply_policy`` installs one ``RegionCall`` per region as the module's compiled call. Behaviours that must
act on every call of a region (mark its inputs dynamic, make a recompile an error, record its inputs and run
it eagerly while a background thread compiles it) are ``Interceptor`` objects added to the policy's
``InterceptorChain``; nothing else wraps a region's call. The order is declared here, outermost first:

========================  ==========================================================================
``EAGER_REFERENCE``       eager reference steps: the first training steps run the original code (telemetry)
``SYNC_VALUES``           per-block values: refill the buffers the compiled code reads them from (drop-path rates)
``PROMOTE_INPUTS``        dtypes: upcast a block's lower-precision inputs where it promotes them anyway
``MARK_INPUTS``           shapes: mark the region's inputs dynamic like the batch (before anything records them)
``STRICT_RECOMPILES``     shapes: after warm-up, a recompile is an error naming the region and the guard
``BUCKET_WARMUP``         shapes: record a call that compiled, to compile it for every other bucket
``BACKGROUND``            background compile: record the first training call, run eagerly until compiled
``PRECOMPILED``           compile cache: serve the call from a loaded precompiled artifact, capture new compiles
========================  ==========================================================================

An interceptor is called as ``interceptor(item, proceed, args, kwargs)`` (``item``: the region's
``CompiledRegion``) and either returns
``proceed(*args, **kwargs)`` (the rest of the chain, then the compiled code) or runs something else instead
(then it sets ``replaces_compiled``, so that step marks for CUDA graphs are left out meanwhile).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

EAGER_REFERENCE = 2
SYNC_VALUES = 5
PROMOTE_INPUTS = 7
MARK_INPUTS = 10
STRICT_RECOMPILES = 20
BUCKET_WARMUP = 25
BACKGROUND = 30
PRECOMPILED = 40


class Interceptor(Protocol):
    position: int  # one of the positions above
    replaces_compiled: bool  # runs something else instead of the compiled code (for now)

    def __call__(
        self, item: Any, proceed: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any: ...


class InterceptorChain:
    """The interceptors of every region of one applied policy, in the order of their ``position``."""

    def __init__(self) -> None:
        self.interceptors: List[Interceptor] = []

    def add(self, interceptor: Interceptor) -> None:
        taken = [i for i in self.interceptors if i.position == interceptor.position]
        if taken:
            raise ValueError(f"a {type(taken[0]).__name__} already sits at position {interceptor.position}")
        self.interceptors = sorted([*self.interceptors, interceptor], key=lambda i: i.position)

    def remove(self, interceptor: Interceptor) -> None:
        self.interceptors = [i for i in self.interceptors if i is not interceptor]

    @property
    def replaces_compiled(self) -> bool:
        return any(i.replaces_compiled for i in self.interceptors)


class RegionCall:
    """Installed as a region module's compiled call: the chain's interceptors, then ``compiled``.

    ``route(args, kwargs)``, where given, may name another compiled function for a call, which then runs without
    the interceptors (a block called with a KV cache runs an entry of its own: evaluation and generation only).
    """

    def __init__(
        self,
        item: Any,
        compiled: Callable[..., Any],
        chain: InterceptorChain,
        route: Optional[Callable[[Tuple[Any, ...], Dict[str, Any]], Optional[Callable[..., Any]]]] = None,
    ):
        self.item, self.compiled, self.chain, self.route = item, compiled, chain, route

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        routed = self.route(args, kwargs) if self.route is not None else None
        if routed is not None:
            self.item.calls += 1
            return routed(*args, **kwargs)
        if not self.chain.interceptors:
            return self._run_compiled(*args, **kwargs)
        return self._proceed(tuple(self.chain.interceptors), 0, *args, **kwargs)

    def _proceed(self, interceptors: Tuple[Interceptor, ...], index: int, *args: Any, **kwargs: Any) -> Any:
        if index == len(interceptors):
            return self._run_compiled(*args, **kwargs)
        proceed = functools.partial(self._proceed, interceptors, index + 1)
        return interceptors[index](self.item, proceed, args, kwargs)

    def _run_compiled(self, *args: Any, **kwargs: Any) -> Any:
        self.item.calls += 1
        return self.compiled(*args, **kwargs)
