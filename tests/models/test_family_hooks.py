"""Each family owns what makes it different: its config mapping and hooks live in its own file.

config.py holds only the mapping every family shares (no architecture names); every registered
class provides the `CausalLM` members; and a new family, registered from outside the package with
its own config class, loads and runs through the engine with nothing else changed.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from helpers.family_cases import (
    ENGINE_ARGS,
    MAX_REL_ERR,
    engine_prefill_logits,
    hf_logits,
    make_hf_model,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prompts,
    rel_err,
    save_hf_model,
)
from xlaserve import LLM
from xlaserve.models import config as config_module
from xlaserve.models import registry
from xlaserve.models.config import TransformerConfig
from xlaserve.models.interfaces import CAUSAL_LM_MEMBERS
from xlaserve.models.llama import LlamaForCausalLM

CAP = 2.0  # small enough that the soft cap changes every logit


@dataclass(frozen=True)
class ToyConfig(TransformerConfig):
    """A family whose config.json spells the final logit soft cap its own way."""

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields_from_hf(hf), "final_logit_softcap": hf["toy_logit_softcap"]}


class ToyForCausalLM(LlamaForCausalLM):
    config_class = ToyConfig


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))  # undone after the test
    registry.register_model("ToyForCausalLM", ToyForCausalLM)


def test_config_py_names_no_architecture():
    source = inspect.getsource(config_module)
    assert "ForCausalLM" not in source
    assert "architecture ==" not in source and "architecture in" not in source


@pytest.mark.parametrize("architecture", registry.supported_architectures())
def test_every_registered_class_is_a_causal_lm(architecture):
    model_class = registry.get_model_class(architecture)
    assert all(hasattr(model_class, name) for name in CAUSAL_LM_MEMBERS)
    assert issubclass(model_class.config_class, TransformerConfig)


def test_register_model_names_the_missing_members(monkeypatch):
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))

    class NotAModel:
        config_class = TransformerConfig

    with pytest.raises(TypeError, match=r"NotAModel does not implement CausalLM: it lacks .*kv_cache_spec"):
        registry.register_model("NotAModel", NotAModel)
    assert "NotAModel" not in registry.supported_architectures()


def test_a_new_family_is_its_own_file_and_a_registry_line(toy_registered, tmp_path):
    """ToyForCausalLM (defined above, registered at run time) reads its own config key; the engine
    loads it through the registry and its logits are Hugging Face Llama's, soft-capped."""
    hf_model = make_hf_model("LlamaForCausalLM", seed=7)
    directory = save_hf_model(hf_model, tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(architectures=["ToyForCausalLM"], toy_logit_softcap=CAP)
    config_path.write_text(json.dumps(config))

    llm = LLM(directory, **ENGINE_ARGS)
    cfg = llm.engine_core.runner.model_config
    assert type(cfg) is ToyConfig and cfg.final_logit_softcap == CAP
    ids = prompts(hf_model.config.vocab_size, seed=3)[1]
    ours = engine_prefill_logits(llm, ids, first_chunk=11)
    expected = CAP * np.tanh(hf_logits(hf_model, ids) / CAP)
    assert rel_err(ours, expected) <= MAX_REL_ERR
