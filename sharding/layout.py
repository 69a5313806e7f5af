"""A checkpoint's tensors laid out for a tensor-parallel mesh: every rewrite its weights need before the
rules (sharding/rules.py) can split them evenly, made in one place for every set of weights placed on
a mesh: a model's load (worker/model_loader.py), a drafter's own layer (worker/mtp.py, worker/eagle3.py)
and a weight update (worker/weight_update.py). A new rule added here reaches all of them, and its
inverse (`checkpoint_shape`, by which an update's shapes are checked) goes beside it.
"""

from __future__ import annotations

from xlaserve.sharding.kv_heads import checkpoint_heads_size, replicate_kv_heads
from xlaserve.sharding.vocab import checkpoint_vocab_rows, pad_vocab, padded_vocab_size

_HEAD = "lm_head.weight"


def lay_out_for_mesh(model_config, tensors, tensor_parallel_size: int, head_vocab_size: int | None = None):
    """-> (model_config, tensors, padded_vocab_size) for a mesh of `tensor_parallel_size` ranks:

    - KV heads repeated up to the ranks when fewer (sharding/kv_heads.py: k and v, a fused qkv's k and
      v, a k_norm over all heads);
    - the family's own widening of the config (`for_tensor_parallel`: Mamba2's B and C groups, copied
      by the family's `prepare_hf_tensors` as the model loads);
    - the embedding and LM head padded with zero rows to `padded_vocab_size` (sharding/vocab.py). The
      config keeps the real vocabulary (the input processor's and the sampler's bound): the model is
      built with the padded one.

    `tensors`: as `replicate_kv_heads` and `pad_vocab` take them (HF names, a converted checkpoint's
    paths, `DummyWeights`). `head_vocab_size`: an LM head (`lm_head.weight`) over a vocabulary of its
    own (EAGLE-3's draft vocabulary), padded to split by itself."""
    tp = tensor_parallel_size
    model_config, tensors = replicate_kv_heads(model_config, tensors, tp)
    model_config = model_config.for_tensor_parallel(tp)
    vocab, padded_vocab = model_config.vocab_size, padded_vocab_size(model_config.vocab_size, tp)
    if head_vocab_size is None or not isinstance(tensors, dict) or _HEAD not in tensors:
        return model_config, pad_vocab(tensors, vocab, padded_vocab), padded_vocab
    head = pad_vocab({_HEAD: tensors[_HEAD]}, head_vocab_size, padded_vocab_size(head_vocab_size, tp))
    rest = pad_vocab({name: t for name, t in tensors.items() if name != _HEAD}, vocab, padded_vocab)
    return model_config, rest | head, padded_vocab


def checkpoint_shape(name: str, shape, model_config, checkpoint_config, tensor_parallel_size: int):
    """The inverse of `lay_out_for_mesh` for one tensor: `shape` of Hugging Face tensor `name` (its
    layout, [out, in]; one layer's) as the model on the mesh holds it (`model_config`, as laid out) ->
    as a checkpoint of `checkpoint_config` holds it, for checking an update's shapes against the model's
    (worker/weight_update.py). Every rewrite widens axis 0 (the heads' rows, B and C's copies, the
    vocabulary); each rule's inverse sits beside it."""
    if not shape:
        return tuple(shape)
    rows, *rest = shape
    rows = checkpoint_heads_size(name, rows, model_config, checkpoint_config.num_kv_heads)
    rows = model_config.checkpoint_rows(name, rows, checkpoint_config)
    vocab = checkpoint_config.vocab_size
    rows = checkpoint_vocab_rows(name, rows, vocab, padded_vocab_size(vocab, tensor_parallel_size))
    return (rows, *rest)
