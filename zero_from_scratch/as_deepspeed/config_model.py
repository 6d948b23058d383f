"""`deepspeed.runtime.config_utils.DeepSpeedConfigModel`: the pydantic base of DeepSpeed's config sections.

    class MyConf(DeepSpeedConfigModel):
        new: int = 0
        old: str = Field("0", json_schema_extra={"deprecated": True, "new_param": "new", "new_param_fn": int})

What DeepSpeed's (runtime/config_utils.py) does, for scripts that declare their own config sections
on it: unknown keys refused (pydantic's ValidationError), fields reachable by name or alias,
assignments validated; "auto" values dropped unless strict=True (so the field keeps its default);
a deprecated field that was given warns, and with `new_param` moves its value (through
`new_param_fn`) there — asserting the new field was not given too. Needs pydantic (DeepSpeed's
dependency, imported on use). Cost: pydantic's validation, once per object.
"""
from __future__ import annotations

from functools import reduce

from pydantic import BaseModel, ConfigDict

from zero_from_scratch.as_deepspeed.utils import logger


class DeepSpeedConfigModel(BaseModel):
    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict=False, **data):
        if not strict:
            data = {k: v for k, v in data.items() if v != "auto" or k == "replace_method"}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._move_deprecated(name, extra)

    def _move_deprecated(self, old: str, extra: dict) -> None:
        if old not in self.model_fields_set:
            return
        new, msg = extra.get("new_param", ""), extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {old} is deprecated" + (f" use {new} instead" if new else "") +
                       (f". {msg}" if msg else ""))
        if not new or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, old))
        delattr(self, old)
        *path, leaf = new.split(".")
        owner = reduce(getattr, path, self)
        assert leaf not in owner.model_fields_set, \
            f"Cannot provide deprecated parameter '{old}' and replacing parameter '{new}' together"
        setattr(owner, leaf, value)
