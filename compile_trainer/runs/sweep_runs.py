"""The runs of a sweep for ``compile-trainer report``: every run's ``result.json``, the Hydra job directories that
left none (still running, killed), each run labelled by its policy and the overrides that differ between them; which
run is an eager baseline, and a run's compile time without a compile-cache bundle."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from compile_trainer.runs.results import RESULT_FILE, read_result


def cold_compile_time(result: Dict[str, Any]) -> Optional[float]:
    """The compile time without a compile-cache bundle: the bundle's cold compile for a run that loaded one, the
    run's own compile time for a run that had none (its compile s is then its cold compile)."""
    summary = result.get("summary") or {}
    if summary.get("cache_status") == "hit":
        return summary.get("cache_cold_compile_s")
    return summary.get("compile_time_s") if summary.get("cache_status") in ("miss", "unusable") else None


class ReportError(ValueError):
    """A directory that holds no runs to report on."""


@dataclass
class Run:
    """One run of the sweep: its result, or ``None`` where it left no result file."""

    directory: Path
    overrides: List[str]
    result: Optional[Dict[str, Any]] = None
    label: str = ""
    flags: List[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.result["status"] if self.result is not None else "no result"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def job(self) -> float:
        sweep = (self.result or {}).get("sweep") or {}
        if sweep.get("job") is not None:
            return sweep["job"]
        return int(self.directory.name) if self.directory.name.isdigit() else math.inf

    @property
    def policy(self) -> str:
        if self.result is not None:
            return str(self.result.get("policy"))
        return dict(_split(o) for o in self.overrides).get("compile", "?")

    @property
    def seed(self) -> Any:
        if self.result is not None:
            return self.result.get("seed")
        return dict(_split(o) for o in self.overrides).get("seed")

    @property
    def setting(self) -> str:
        """The label without the seed: the runs of one setting are repeats."""
        return " ".join(word for word in self.label.split(" ") if not word.startswith(("seed=", "#")))

    def summary(self, key: str) -> Optional[float]:
        return ((self.result or {}).get("summary") or {}).get(key)


def _split(override: str) -> Tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _read_overrides(path: Path) -> List[str]:
    import yaml

    return [str(override) for override in yaml.safe_load(path.read_text()) or []]


def find_runs(directory: Path) -> List[Run]:
    """Every run under ``directory``: those with a result file, and Hydra job directories without one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReportError(f"{directory} is not a directory; give a multirun directory (multirun/<sweep name>)")
    runs = []
    for path in sorted(directory.rglob(RESULT_FILE)):
        result = read_result(path)
        runs.append(Run(path.parent, list(result.get("overrides") or []), result))
    reported = {run.directory for run in runs}
    for overrides in sorted(directory.rglob(".hydra/overrides.yaml")):
        job_dir = overrides.parent.parent
        if job_dir not in reported:
            runs.append(Run(job_dir, _read_overrides(overrides)))
    if not runs:
        raise ReportError(
            f"no runs under {directory}: expected {RESULT_FILE} files written by `python train.py -m ...`"
        )
    runs.sort(key=lambda run: (run.job, str(run.directory)))
    _label(runs)
    return runs


def _label(runs: List[Run]) -> None:
    """Name each run by its policy and the overrides that differ between the runs."""
    settings = [dict(_split(o) for o in run.overrides) for run in runs]
    keys = sorted({key for s in settings for key in s})
    varying = [k for k in keys if k != "compile" and len({s.get(k) for s in settings}) > 1]
    for run, values in zip(runs, settings):
        extra = [f"{key.removeprefix('compile.')}={values[key]}" for key in varying if key in values]
        run.label = " ".join([run.policy, *extra])
    seen: Dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:
            run.label += f" #{run.directory.name}"


def is_baseline(result: Dict[str, Any]) -> bool:
    """Nothing compiled: the policy is off and so is the optimizer's compilation."""
    settings = result.get("policy_settings") or {}
    optimizer = str((settings.get("optimizer") or {}).get("compile", "false")).lower()
    return result.get("status") == "ok" and settings.get("enabled") is False and optimizer == "false"
