"""``CompileCache``: one run's use of a bundle — loaded before the first compile, saved after warm-up.

Safe by construction: anything wrong with a bundle (missing, truncated, corrupt, written for another torch,
device, policy or model, a storage error) is a warning that names why and a cold compile, never an error;
torch's own caches check every entry's key again, so a bundle changes compile time, never results. In a
distributed run every rank reads and only rank 0 writes.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.cache import precompiled
from compile_trainer.cache.artifacts import load_sections, save_sections
from compile_trainer.cache.bundle import BundleError, CompileCacheWarning, decode, encode
from compile_trainer.cache.key import bundle_name, cache_key, key_fields, mismatch
from compile_trainer.cache.storage import BundleStore
from compile_trainer.compiling.regions import AppliedPolicy
from compile_trainer.schema import CacheSettings, CompilePolicy

log = logging.getLogger(__name__)


def process_rank() -> int:
    """This process's rank: torch.distributed's once initialized, else the launcher's ``RANK``, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _date(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


@dataclass
class CacheOutcome:
    """What the cache did in this run (``summary()`` gives it as flat keys)."""

    status: str = "off"  # off, hit, miss, unusable (a bundle was there but not used)
    reason: str = ""
    key: str = ""
    location: str = ""
    bundle_date: Optional[str] = None
    bundle_bytes: int = 0
    cold_compile_s: Optional[float] = None  # the cold compile that wrote the bundle
    flops_record: Optional[Dict[str, Any]] = None  # the FLOPs per step it counted, with the step's signature
    load_s: float = 0.0
    loaded: Dict[str, float] = field(default_factory=dict)
    saves: int = 0
    save_s: float = 0.0
    saved_bytes: int = 0
    precompiled: str = ""  # why the precompiled layer is not in use, when it is asked for and is not


class CompileCache:
    """The bundle of one (model, policy, device, versions, salt) in a cache directory or URL."""

    def __init__(self, settings: CacheSettings, rank: Optional[int] = None):
        self.settings = settings
        self.rank = process_rank() if rank is None else rank
        self.outcome = CacheOutcome(location=str(settings.dir or ""))
        self.fields: Dict[str, Any] = {}
        self._started = time.time()
        self._counters_at_load = compat.cache_counters()
        self._misses_at_save = 0
        self._manifest: Dict[str, Any] = {}
        self._artifacts: List[precompiled.Artifact] = []  # the bundle's precompiled section, until attach()
        self._uncapturable: Dict[str, str] = {}
        self.precompiled: Optional[precompiled.PrecompiledRegions] = None

    @property
    def name(self) -> str:
        return bundle_name(self.outcome.key)

    def _store(self) -> BundleStore:
        return BundleStore(str(self.settings.dir))

    def load(self, model: nn.Module, policy: CompilePolicy, device: torch.device) -> CacheOutcome:
        """Compute the key and load the matching bundle into torch's caches; call before anything compiles."""
        self._started, self._counters_at_load = time.time(), compat.cache_counters()
        self._misses_at_save = 0
        if not self.settings.active:
            return self.outcome
        self.fields = key_fields(model, policy, device)
        self.outcome.key = cache_key(self.fields)
        started = time.perf_counter()
        try:
            data = self._store().read(self.name)
            if data is None:
                self.outcome.status, self.outcome.reason = "miss", "no bundle for this key yet"
                return self.outcome
            bundle = decode(data)
            if bundle.manifest.get("key") != self.outcome.key:
                raise BundleError(
                    f"written for other settings: {mismatch(self.fields, bundle.manifest.get('fields', {}))}"
                )
            self.outcome.loaded = load_sections({k: v for k, v in bundle.sections.items() if k in self.settings.layers})
            if precompiled.SECTION in self.settings.layers and precompiled.SECTION in bundle.sections:
                self._artifacts, self._uncapturable = precompiled.decode_section(bundle.sections[precompiled.SECTION])
        except Exception as error:  # never fail a run for its cache: compile cold instead
            self.outcome.status, self.outcome.reason = "unusable", f"{type(error).__name__}: {error}"
            warnings.warn(
                f"compile cache: bundle {self.name} in {self.settings.dir} not used ({self.outcome.reason}); "
                "compiling cold",
                CompileCacheWarning,
                stacklevel=2,
            )
            return self.outcome
        finally:
            self.outcome.load_s = time.perf_counter() - started
        self._manifest = bundle.manifest
        self.outcome.status, self.outcome.reason = "hit", ""
        self.outcome.bundle_date = bundle.manifest.get("date")
        self.outcome.bundle_bytes = len(data)
        self.outcome.cold_compile_s = bundle.manifest.get("cold_compile_s")
        self.outcome.flops_record = bundle.manifest.get("flops_record")
        return self.outcome

    def attach(self, applied: AppliedPolicy) -> None:
        """Serve ``applied``'s regions from the bundle's precompiled artifacts and capture what they compile
        (when ``precompiled`` is among the layers); call after ``apply_policy``, before the first step."""
        if not self.settings.active or precompiled.SECTION not in self.settings.layers or not applied.policy.enabled:
            return
        problem = compat.aot_compile_problem()
        if problem is None and applied.policy.background:
            problem = "background compiles are not captured (background: true)"
        if problem is not None:
            self.outcome.precompiled = problem
            return
        capture = self.settings.writes  # every rank its own device's calls; rank 0 gathers them and writes
        if self._artifacts or self._uncapturable or capture:
            self.precompiled = precompiled.PrecompiledRegions(self._artifacts, capture, self._uncapturable)
            applied.interceptors.add(self.precompiled)
            self.precompiled.load_in_background(applied.compiled)

    def _gather_captures(self) -> None:
        """Every rank's captures to rank 0 (a collective: every writing rank runs it at its final save)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        mine = ([replace(a, function=None) for a in self.precompiled.captured], self.precompiled.uncapturable)
        gathered: List[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        if self.rank == 0:
            for artifacts, uncapturable in gathered[1:]:
                self.precompiled.add_captured(artifacts, uncapturable)

    def layer_counts(self) -> Dict[str, Dict[str, int]]:
        """Hits and misses per cache layer (FX graph, AOTAutograd) since the load."""
        now = compat.cache_counters()
        return {
            layer: {
                "hits": hits - self._counters_at_load[layer][0],
                "misses": misses - self._counters_at_load[layer][1],
            }
            for layer, (hits, misses) in now.items()
        }

    @property
    def precompiled_loads(self) -> int:
        """How many times the precompiled layer has loaded artifacts (each a pause in the step that asked)."""
        return self.precompiled.loads if self.precompiled is not None else 0

    @property
    def pending_captures(self) -> int:
        """Region calls that compiled and that a ``final`` save will capture (on every rank of a writing cache;
        rank 0 gathers the other ranks' captures into its bundle)."""
        return len(self.precompiled.pending) if self.precompiled is not None else 0

    def save(
        self,
        regions: List[str],
        compile_time_s: Optional[float],
        final: bool = False,
        flops_record: Optional[Dict[str, Any]] = None,
    ) -> bool:
        """Write the bundle if this rank writes and something was compiled (a cache miss) since the last save.

        ``compile_time_s``: this run's compile time so far; kept in the bundle as its cold compile time (a bundle
        updated by a run that hit keeps the cold time it had). ``final``: training is over, so the precompiled
        layer captures the region calls that compiled (``PrecompiledRegions.capture_pending``) into this save.
        ``flops_record``: the telemetry's FLOPs per step and the step's signature (``FitTelemetry.flops_record``),
        kept so that a run with the same step takes them instead of counting them during its first step.
        Returns whether a bundle was written.
        """
        if final and self.precompiled is not None and self.settings.writes:
            self.precompiled.capture_pending()
            self._gather_captures()
        counts = self.layer_counts().values()
        misses, used = sum(c["misses"] for c in counts), sum(c["hits"] + c["misses"] for c in counts)
        # The first bundle as soon as anything went through torch's caches (a warm local cache hits), then again
        # whenever something new was compiled.
        first = self.outcome.saves == 0 and self.outcome.status != "hit" and used > 0
        if not self.settings.writes or not self.outcome.key or self.rank != 0:
            return False
        captured = self.precompiled is not None and self.precompiled.changed_since_save
        if not (first or misses > self._misses_at_save or captured):
            return False
        started = time.perf_counter()
        try:
            sections, counts = save_sections(list(self.settings.layers), self._started)
            section = self.precompiled.section() if self.precompiled is not None else None
            if section is not None:
                sections[precompiled.SECTION] = section
                counts["precompiled_artifacts"] = len(self.precompiled.artifacts)
            cold = self._manifest.get("cold_compile_s") if self.outcome.status == "hit" else compile_time_s
            manifest = {
                "key": self.outcome.key,
                "fields": self.fields,
                "date": _date(time.time()),
                "regions": list(regions),
                "cold_compile_s": cold,
                "counts": counts,
                "flops_record": flops_record or self.outcome.flops_record,
            }
            data = encode(manifest, sections)
            self._store().write(self.name, data)
        except Exception as error:
            warnings.warn(
                f"compile cache: bundle {self.name} not written to {self.settings.dir} ({type(error).__name__}: "
                f"{error}); the next run compiles cold",
                CompileCacheWarning,
                stacklevel=2,
            )
            return False
        self._misses_at_save = misses
        self.outcome.saves += 1
        self.outcome.save_s += time.perf_counter() - started
        self.outcome.saved_bytes = len(data)
        log.info("compile cache: wrote %s (%.1f MB) to %s", self.name, len(data) / 1e6, self.settings.dir)
        return True

    def seconds_saved(self, compile_time_s: Optional[float]) -> Optional[float]:
        """The bundle's cold compile time less this run's compile and load time (a hit only)."""
        if self.outcome.status != "hit" or self.outcome.cold_compile_s is None or compile_time_s is None:
            return None
        loaded_later = self.precompiled.load_s if self.precompiled is not None else 0.0
        return self.outcome.cold_compile_s - compile_time_s - self.outcome.load_s - loaded_later

    def summary(self, compile_time_s: Optional[float] = None) -> Dict[str, Any]:
        """Flat keys for result.json, the loggers and the W&B summary (docs/telemetry.md)."""
        if not self.settings.active:
            return {"cache_status": "off"}
        values: Dict[str, Any] = {
            "cache_status": self.outcome.status,
            "cache_reason": self.outcome.reason or None,
            "cache_key": self.outcome.key,
            "cache_bundle_date": self.outcome.bundle_date,
            "cache_bundle_bytes": self.outcome.bundle_bytes or None,
            "cache_load_s": self.outcome.load_s,
            "cache_cold_compile_s": self.outcome.cold_compile_s,
            "cache_seconds_saved": self.seconds_saved(compile_time_s),
            "cache_saves": self.outcome.saves,
            "cache_save_s": self.outcome.save_s,
        }
        values |= {f"cache_{name}": value for name, value in self.outcome.loaded.items()}  # per bundle layer
        for layer, counts in self.layer_counts().items():
            values[f"cache_{layer}_hits"], values[f"cache_{layer}_misses"] = counts["hits"], counts["misses"]
        if self.precompiled is not None:
            values |= self.precompiled.summary()
        elif self.outcome.precompiled:
            values["cache_precompiled_off"] = self.outcome.precompiled
        return values

    def describe(self) -> str:
        """Lines for the plan table and the fit's end: ``cache: hit, bundle of <date> ...``, then the precompiled
        layer's."""
        outcome = self.outcome
        if not self.settings.active:
            return "cache: off"
        if outcome.status == "hit":
            cold = f", cold compile {outcome.cold_compile_s:.1f} s" if outcome.cold_compile_s is not None else ""
            line = (
                f"cache: hit, bundle of {outcome.bundle_date} ({outcome.bundle_bytes / 1e6:.1f} MB{cold}), "
                f"loaded in {outcome.load_s:.2f} s from {outcome.location}"
            )
        else:
            writes = "; the bundle is written after warm-up" if self.settings.writes and self.rank == 0 else ""
            line = f"cache: {outcome.status} ({outcome.reason}) in {outcome.location}{writes}"
        if precompiled.SECTION not in self.settings.layers:
            return line
        return f"{line}\n{self._describe_precompiled()}"

    def _describe_precompiled(self) -> str:
        if self.precompiled is None:
            return f"cache precompiled: off ({self.outcome.precompiled or 'nothing to serve, nothing captured'})"
        summary = self.precompiled.summary()
        line = (
            f"cache precompiled: {summary['cache_precompiled_artifacts']} artifact(s), "
            f"{summary['cache_precompiled_hits']} call(s) served, {summary['cache_precompiled_misses']} compiled"
        )
        if self.precompiled.captured:
            line += f", {len(self.precompiled.captured)} captured in {self.precompiled.capture_s:.1f} s"
        skipped = summary["cache_precompiled_skipped"] or {}
        return line + "".join(f"\n  not precompiled: {name}: {why}" for name, why in skipped.items())
