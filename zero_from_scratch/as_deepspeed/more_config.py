"""deepspeed.runtime.config's get_gradient_clipping and deepspeed.runtime.constants' default, under the runner.

    from deepspeed.runtime.config import get_gradient_clipping      (under the runner)
    get_gradient_clipping({})                  # 1.0, DeepSpeed's GRADIENT_CLIPPING_DEFAULT
    get_gradient_clipping({"gradient_clipping": 0.0})   # 0.0: clipping off

The value the engine itself applies when the key is absent (engine/auto.py DEFAULTS, which
engine/config.py reads), so the helper and the engine cannot disagree. Cost: a dict lookup.
"""
from __future__ import annotations

from zero_from_scratch.engine.auto import DEFAULTS

GRADIENT_CLIPPING_DEFAULT = DEFAULTS["gradient_clipping"][0]


def get_gradient_clipping(param_dict: dict) -> float:
    return param_dict.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
