"""BERT and (XLM-)RoBERTa encoders: their config.json, their checkpoint names, their position ids,
and their sequence-classification heads (cross-encoders), which a pooling engine applies on the host.

The backbone is models/encoder.py's. BERT counts positions from 0; RoBERTa and XLM-RoBERTa (bge-m3)
from `pad_token_id + 1`, skipping pad tokens, as Hugging Face's `create_position_ids_from_input_ids`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from xlaserve.models.config import TransformerConfig
from xlaserve.models.encoder import EncoderOnlyLM


@dataclass(frozen=True)
class BertConfig(TransformerConfig):
    num_position_embeddings: int = 512  # rows of the position table (RoBERTa: usable + pad + 1)
    type_vocab_size: int = 2
    sep_token_id: int | None = None  # the pair separator: token types 1 after the first one
    pad_token_id: int | None = None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        num_heads = hf["num_attention_heads"]
        num_positions = hf.get("max_position_embeddings", 512)
        return dict(
            architecture=(hf.get("architectures") or [""])[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("layer_norm_eps", 1e-12),
            rope_theta=10000.0,
            rope_scaling=None,
            max_position_embeddings=num_positions - cls.position_offset(hf),
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            attention_out_bias=True,
            hidden_act=hf.get("hidden_act") or "gelu",
            num_position_embeddings=num_positions,
            type_vocab_size=hf.get("type_vocab_size", 2),
            sep_token_id=hf.get("sep_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    @classmethod
    def position_offset(cls, hf: dict[str, Any]) -> int:
        """Position table rows before the first token's (RoBERTa: pad_token_id + 1)."""
        return 0


class RobertaConfig(BertConfig):
    @classmethod
    def position_offset(cls, hf: dict[str, Any]) -> int:
        return hf.get("pad_token_id", 1) + 1


# Hugging Face's names (after the `bert.` / `roberta.` prefix) -> ours (models/weights.py maps ours
# to `model.<path>`, layers as `model.layers.<i>.<path>`).
_EMBEDDINGS = {
    "embeddings.word_embeddings": "embed_tokens",
    "embeddings.position_embeddings": "embed_positions",
    "embeddings.token_type_embeddings": "embed_types",
    "embeddings.LayerNorm": "embed_norm",
}
_LAYER = {
    "attention.self.query": "q_proj",
    "attention.self.key": "k_proj",
    "attention.self.value": "v_proj",
    "attention.output.dense": "o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up_proj",
    "output.dense": "down_proj",
    "output.LayerNorm": "mlp_norm",
}
_LEAVES = {"gamma": "weight", "beta": "bias"}  # old TensorFlow-era spellings
_LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(\w+)$")
# Buffers and heads a backbone does not read (an embedding model's unused BERT pooler among them).
_UNUSED = re.compile(r"^(pooler\.|embeddings\.position_ids|embeddings\.token_type_ids|cls\.|lm_head\.)")


def _strip_prefix(name: str) -> str:
    for prefix in ("bert.", "roberta.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


class BertModel(EncoderOnlyLM):
    config_class = BertConfig

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Checkpoint names -> ours; names we do not know are kept (the loader reports them)."""
        out = {}
        for name, tensor in tensors.items():
            short = _strip_prefix(name)
            if _UNUSED.match(short):
                continue
            module, _, leaf = short.rpartition(".")
            leaf = _LEAVES.get(leaf, leaf)
            if module in _EMBEDDINGS:
                out[f"model.{_EMBEDDINGS[module]}.{leaf}"] = tensor
            elif (m := _LAYER_NAME.match(short)) and m.group(2) in _LAYER:
                out[f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{_LEAVES.get(leaf, leaf)}"] = tensor
            else:
                out[name] = tensor
        return out


class RobertaModel(BertModel):
    config_class = RobertaConfig

    def position_ids(self, input_ids, positions, seq_start):
        """pad_token_id + the count of non-pad tokens up to each one (pad tokens: pad_token_id)."""
        pad = self.cfg.pad_token_id
        is_token = (input_ids != pad).astype(jnp.int32)
        counts = jnp.cumsum(is_token)  # flat, inclusive
        before_seq = counts[seq_start] - is_token[seq_start]
        return (counts - before_seq) * is_token + pad


# A *ForSequenceClassification encoder: its backbone, and where its head's two layers are stored
# (dense -> tanh -> out on the pooled, by default first, token's hidden state).
_CLASSIFIERS = {
    "BertForSequenceClassification": ("BertModel", "bert.pooler.dense", "classifier"),
    "RobertaForSequenceClassification": ("RobertaModel", "classifier.dense", "classifier.out_proj"),
    "XLMRobertaForSequenceClassification": ("XLMRobertaModel", "classifier.dense", "classifier.out_proj"),
}


# A *ForTokenClassification encoder: one linear layer, `classifier`, on every token's hidden state
# (its backbone built without the pooler).
_TOKEN_CLASSIFIERS = {
    "BertForTokenClassification": "BertModel",
    "RobertaForTokenClassification": "RobertaModel",
    "XLMRobertaForTokenClassification": "XLMRobertaModel",
}


def is_encoder_classifier(architecture: str) -> bool:
    return architecture in _CLASSIFIERS or architecture in _TOKEN_CLASSIFIERS


def split_classifier(hf_config: dict, tensors: dict) -> tuple[dict, dict, dict[str, np.ndarray]]:
    """(hf_config naming the backbone, the backbone's tensors, the head as float32 arrays
    `dense_weight` [D, D], `dense_bias` [D] (a sequence classifier's), `out_weight` [num_labels, D],
    `out_bias` [num_labels])."""
    architecture = hf_config["architectures"][0]
    if architecture in _TOKEN_CLASSIFIERS:
        backbone, dense, out = _TOKEN_CLASSIFIERS[architecture], None, "classifier"
    else:
        backbone, dense, out = _CLASSIFIERS[architecture]
    names = {"out_weight": f"{out}.weight", "out_bias": f"{out}.bias"}
    if dense is not None:
        names |= {"dense_weight": f"{dense}.weight", "dense_bias": f"{dense}.bias"}
    missing = [n for n in names.values() if n not in tensors]
    if missing:
        raise ValueError(f"{architecture}: the checkpoint lacks its classifier head's {missing}")
    tensors = dict(tensors)
    head = {key: np.asarray(tensors.pop(name), np.float32) for key, name in names.items()}
    return {**hf_config, "architectures": [backbone]}, tensors, head
