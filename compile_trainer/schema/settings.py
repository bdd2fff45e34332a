"""The ``torch.compile`` settings, declared once.

``CompileSettings`` holds the five arguments a region is compiled with. ``SettingsOverrides`` is the same
fields, each optional (``None``: keep the value from the level above); rules and the optimizer section
inherit it, the policy inherits ``CompileSettings`` itself. A new setting is added here and nowhere else.

No ``from __future__ import annotations`` here: ``SettingsOverrides`` is built from the field types.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileSettings:
    """The ``torch.compile`` arguments that a region is compiled with."""

    backend: str = "inductor"
    mode: Optional[str] = None
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    options: Dict[str, Any] = field(default_factory=dict)

    def overridden_by(self, overrides: Any) -> "CompileSettings":
        """These settings with every setting that ``overrides`` gives (not ``None``) replaced."""
        changes = {name: getattr(overrides, name) for name in SETTING_FIELDS if getattr(overrides, name) is not None}
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        text = f"backend={self.backend} mode={self.mode or 'default'} fullgraph={self.fullgraph}"
        text += f" dynamic={self.dynamic}"
        if self.options:
            text += f" options={dict(self.options)}"
        return text


SETTING_FIELDS = tuple(f.name for f in dataclasses.fields(CompileSettings))


def _optional_fields(cls: type) -> list:
    return [(f.name, Optional[f.type], dataclasses.field(default=None)) for f in dataclasses.fields(cls)]


# Every field of CompileSettings, optional: what a rule or the optimizer section may override.
SettingsOverrides = dataclasses.make_dataclass(
    "SettingsOverrides", _optional_fields(CompileSettings), namespace={"__module__": __name__}
)
SettingsOverrides.__doc__ = "The fields of ``CompileSettings``, each ``None`` (inherit) unless given."


def settings_of(owner: Any) -> CompileSettings:
    """The ``CompileSettings`` part of a dataclass that inherits it (a ``CompilePolicy``)."""
    return CompileSettings(**{name: getattr(owner, name) for name in SETTING_FIELDS})
