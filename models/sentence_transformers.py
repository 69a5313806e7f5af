"""A sentence-transformers directory's pooling defaults, read as vLLM reads them.

`modules.json` lists the pipeline (Transformer, Pooling, Normalize, ...); the Pooling module's
`config.json` (usually `1_Pooling/config.json`) says how token states become one vector, and a
`Normalize` module says that vector is L2-normalized. A pooling engine starts from these defaults,
under whatever the user's `pooler_config` sets (worker/pooler.py).
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

# sentence-transformers' pooling switches -> our pooling types (others, e.g. max, are not supported).
_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


def read_pooling_defaults(path: str) -> dict:
    """{"pooling_type": "CLS" | "MEAN" | "LAST", "normalize": bool}, either key absent when the
    directory does not say; {} for anything that is not a sentence-transformers directory."""
    modules_path = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_path):
        return {}
    with open(modules_path) as f:
        modules = json.load(f)
    defaults = {"normalize": any(m.get("type", "").endswith("Normalize") for m in modules)}
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return defaults
    config_path = os.path.join(path, pooling.get("path", ""), "config.json")
    if not os.path.isfile(config_path):
        return defaults
    with open(config_path) as f:
        config = json.load(f)
    modes = [ours for key, ours in _MODES.items() if config.get(key)]
    if len(modes) == 1:
        defaults["pooling_type"] = modes[0]
    else:
        logger.warning(
            "%s: pooling modes %s not supported; the model's default pooling applies", config_path, config
        )
    return defaults
