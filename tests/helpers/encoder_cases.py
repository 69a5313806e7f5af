"""Tiny random encoder-only models (BERT, XLM-RoBERTa, ModernBERT) saved offline with a WordPiece tokenizer
over [PAD] [UNK] [CLS] [SEP] [MASK] w5 .. w63: the pooling tests' checkpoints."""

from __future__ import annotations

import os

import torch
import transformers

VOCAB = 64
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def bert_tokenizer(directory) -> transformers.PreTrainedTokenizerFast:
    """A WordPiece tokenizer over [PAD] [UNK] [CLS] [SEP] [MASK] w5 .. w63, saved to `directory`."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, VOCAB)]
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=path, do_lower_case=False)
    tokenizer.save_pretrained(directory)
    return tokenizer


def save_encoder(model, directory):
    """`model` with weights large enough to matter (LayerNorm scales around 1), and a tokenizer."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.eval().save_pretrained(directory)
    return model, bert_tokenizer(directory), str(directory)


def make_encoder(tmp_path_factory, name: str, config_class: str, architecture: str, seed: int, **overrides):
    """(the HF model, its tokenizer, the directory) of a random `architecture` on `config_class`."""
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, max_position_embeddings=66, **SIZES, **overrides, attn_implementation="eager"
    )
    config.architectures = [architecture]
    torch.manual_seed(seed)
    return save_encoder(getattr(transformers, architecture)(config), tmp_path_factory.mktemp(name))
