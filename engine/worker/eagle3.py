"""Speculative decoding with an EAGLE-3 checkpoint (`{"method": "eagle3", "model": PATH}`, vLLM's
method; the network: models/eagle3.py). The MTP drafter's arrangement (worker/mtp.py: its own K/V cache
on the target's block ids, the whole flat batch first with the token after each position, drafts 1..k-1
in `propose`'s loop fed the layer's own output, q kept for exact rejection), with what EAGLE-3 reads:

- the target's forward also returns its aux hidden states, the residual stream entering three of its
  layers (config.json's `eagle_aux_hidden_state_layer_ids`, else vLLM's (2, L // 2, L - 3)),
  concatenated [T, 3 * H]: this drafter's `aux_layers`, a keyword of the model's forward
  (models/decoder.py picks them inside the layer scan); `fc` brings them to the draft's width;
- the draft's pre-norm output is the next draft's hidden state, its final-norm output gives the logits
  (its own LM head over the draft vocabulary, mapped to the target's ids by `d2t`).

The target must be a plain decoder (models/decoder.py's forward, attention layers only: Llama, Qwen2/3,
Mistral and the others that run it as it is); a hybrid or vision-language backbone is refused by name.
"""

from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.config import EngineConfig
from xlaserve.kernels import cpu_dot
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.eagle3 import AUX_LAYERS_KEY, Eagle3Network, aux_layer_ids
from xlaserve.models.loader import complete_config, read_weights
from xlaserve.models.quantization import weight_bytes
from xlaserve.models.registry import get_model_class
from xlaserve.models.weights import load_params
from xlaserve.sharding import Placement
from xlaserve.sharding.layout import lay_out_for_mesh
from xlaserve.sharding.vocab import padded_vocab_size
from xlaserve.speculative_config import SPECULATORS_KEY, flatten_speculators_eagle3
from xlaserve.worker.model_loader import pack_projections
from xlaserve.worker.mtp import MTPDrafter

logger = logging.getLogger(__name__)

# config.json's `architectures` of a released EAGLE-3 checkpoint (vLLM registers both spellings).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def _refuse(message: str) -> ValueError:
    return ValueError(f"speculative_config.model: {message}")


def _check_target(runner) -> None:
    """The target's forward must be models/decoder.py's, over attention layers only: that is where the
    aux hidden states are picked, and the draft cache rides the target's one block table."""
    target_class = get_model_class(runner.model_config.architecture)
    plain = (
        issubclass(target_class, DecoderOnlyLM)
        and target_class.__call__ is DecoderOnlyLM.__call__
        and target_class.run_layers is DecoderOnlyLM.run_layers
        and runner.kv_spec.layer_kind == "full_attention"
    )
    if not plain:
        raise ValueError(
            f"speculative_config.method 'eagle3': {runner.model_config.architecture} is not supported as an "
            "EAGLE-3 target yet (a plain decoder of attention layers is: Llama, Qwen2/3, Mistral, ...)"
        )


def _read_checkpoint(path: str, target_cfg: TransformerConfig) -> tuple[dict, dict]:
    """(config.json, tensors) of an EAGLE-3 checkpoint directory, refused by name where it is not one
    or does not fit the target."""
    config_path = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_path):
        raise _refuse(f"{path!r} is not an EAGLE-3 checkpoint (a directory with config.json)")
    with open(config_path) as f:
        hf_config = json.load(f)
    speculators = SPECULATORS_KEY in hf_config
    if speculators:
        hf_config = flatten_speculators_eagle3(hf_config)
    architectures = hf_config.get("architectures") or []
    if not set(architectures) & set(EAGLE3_ARCHITECTURES):
        raise _refuse(
            f"{path!r} is not an EAGLE-3 checkpoint: its architectures are {architectures}, not "
            f"{EAGLE3_ARCHITECTURES[0]}"
        )
    hf_config = complete_config(hf_config)
    if hf_config.get("num_hidden_layers") != 1:
        raise _refuse(
            f"an EAGLE-3 checkpoint of {hf_config.get('num_hidden_layers')} layers; one is supported"
        )
    for key in ("norm_before_fc", "fc_norm", "norm_output"):  # the speculators library's later variants
        if hf_config.get(key):
            raise _refuse(f"{key} is not supported yet (an EAGLE-3 layer as vLLM's llama_eagle3 runs it is)")
    if hf_config["vocab_size"] != target_cfg.vocab_size:
        raise _refuse(
            f"the EAGLE-3 checkpoint's vocab_size ({hf_config['vocab_size']}) must equal the target "
            f"model's ({target_cfg.vocab_size})"
        )
    target_hidden = hf_config.get("target_hidden_size") or hf_config["hidden_size"]
    if target_hidden != target_cfg.hidden_size:
        raise _refuse(
            f"the EAGLE-3 checkpoint's target_hidden_size ({target_hidden}) must equal the target model's "
            f"hidden_size ({target_cfg.hidden_size})"
        )
    try:
        tensors = read_weights(os.path.expanduser(path), progress=False)
    except ValueError as e:  # no weights, or a PyTorch file that is not a state dict
        raise _refuse(str(e)) from e
    if speculators:  # its one layer is `layers.0`, a released checkpoint's `midlayer`
        tensors = {
            "midlayer." + n[len("layers.0.") :] if n.startswith("layers.0.") else n: t
            for n, t in tensors.items()
        }
    return hf_config, tensors


def _draft_to_target(tensors: dict, draft_vocab: int, vocab: int, tp: int, padded_vocab: int) -> np.ndarray:
    """Each draft id's target id, from `d2t` (offsets; none: the vocabularies are the same), for the
    draft vocabulary padded to split over `tp` ranks (sharding/vocab.py): a padding id maps to
    `padded_vocab`, past the target's logits, where `draft_logits`' scatter drops it."""
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # the inverse map, which drafting never reads
    if d2t is None:
        if draft_vocab != vocab:
            raise _refuse(
                f"draft_vocab_size {draft_vocab} differs from vocab_size {vocab}, and there is no d2t"
            )
        d2t = np.zeros(vocab, np.int64)
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab,):
        raise _refuse(f"d2t has shape {list(d2t.shape)}, expected [draft_vocab_size] = [{draft_vocab}]")
    targets = np.arange(draft_vocab) + d2t.astype(np.int64)
    if targets.min() < 0 or targets.max() >= vocab:
        raise _refuse(f"d2t maps draft ids outside the target's vocabulary [0, {vocab})")
    padding = padded_vocab_size(draft_vocab, tp) - draft_vocab
    return np.pad(targets, (0, padding), constant_values=padded_vocab).astype(np.int32)


def _for_mesh(cfg: TransformerConfig, tensors: dict, draft_vocab: int, runner):
    """The network's config and tensors laid out for the target's mesh by the loader's one function
    (sharding/layout.py): KV heads repeated up to the tensor-parallel size, the embedding padded to the
    target's padded vocabulary and the LM head's draft vocabulary to a size that splits evenly, so its
    weights split over the ranks as the target's layers do -> (config, tensors). Its names are the
    loader's first (`model.embed_tokens.weight`: the embedding that padding finds)."""
    try:
        Placement(runner.mesh, cfg)  # its heads and MLP split over the target's ranks
    except ValueError as e:
        raise _refuse(f"the EAGLE-3 layer: {e}") from e
    tensors = Eagle3Network.prepare_hf_tensors(cfg, tensors)
    tp = runner.placement.tensor_parallel_size
    cfg, tensors, padded_vocab = lay_out_for_mesh(cfg, tensors, tp, head_vocab_size=draft_vocab)
    return cfg.replace(vocab_size=padded_vocab), tensors


class Eagle3Drafter(MTPDrafter):
    """The EAGLE-3 network as the drafter (module doc); `runner`: the ModelRunner, whose model it reads
    (its aux hidden states, its embedding where the checkpoint has none)."""

    def __init__(self, config: EngineConfig, runner, vocab_size: int):
        spec = config.speculative
        _check_target(runner)
        target_cfg = runner.model_config
        hf_config, tensors = _read_checkpoint(spec.model, target_cfg)
        num_target_layers = target_cfg.num_layers
        ids = aux_layer_ids(hf_config, num_target_layers)
        if min(ids) < 0 or max(ids) >= num_target_layers:
            raise _refuse(
                f"{AUX_LAYERS_KEY} {list(ids)} must name layers of the target's {num_target_layers}"
            )
        draft_vocab = hf_config.get("draft_vocab_size") or hf_config["vocab_size"]
        tp, padded_vocab = runner.placement.tensor_parallel_size, runner.padded_vocab_size
        targets = _draft_to_target(tensors, draft_vocab, vocab_size, tp, padded_vocab)
        checkpoint_cfg = TransformerConfig.from_hf(hf_config)
        own_embedding = any(name.endswith("embed_tokens.weight") for name in tensors)
        if not own_embedding and checkpoint_cfg.hidden_size != target_cfg.hidden_size:
            raise _refuse(
                f"an EAGLE-3 checkpoint of hidden_size {checkpoint_cfg.hidden_size} without embed_tokens (it "
                f"would read the target's, of {target_cfg.hidden_size})"
            )
        dtype, backend, placement = runner.dtype, runner.backend, runner.placement
        cfg, tensors = _for_mesh(checkpoint_cfg, tensors, draft_vocab, runner)

        def make_model():
            return Eagle3Network(
                cfg,
                backend,
                target_hidden_size=target_cfg.hidden_size,
                num_aux=len(ids),
                draft_vocab_size=len(targets),
                own_embedding=own_embedding,
                norm_before_residual=bool(hf_config.get("norm_before_residual")),
                padded_vocab_size=runner.padded_vocab_size,
                dtype=dtype,
                rngs=nnx.Rngs(0),
            )

        try:
            graphdef, params = load_params(
                Eagle3Network, cfg, tensors, dtype=dtype, make_model=make_model, place=placement.place_param
            )
        except ValueError as e:
            raise _refuse(f"{spec.model!r}: {e}") from e
        if cpu_dot.usable(dtype, runner.mesh.size):  # its LM head packed as the target's is (model_loader)
            graphdef, params = pack_projections(graphdef, params, ())
        self.mtp_params = params
        self.logits_args = (placement.put_replicated(jnp.asarray(targets)),)
        self.weight_bytes = weight_bytes(params)
        self.images = None
        self.hidden_size = len(ids) * target_cfg.hidden_size  # the aux hidden states' width
        self.aux_layers = placement.put_replicated(jnp.asarray(ids, jnp.int32))
        logger.info(
            "EAGLE-3 drafter %s (target layers %s, draft vocabulary %d) proposes %d tokens per step",
            spec.model,
            list(ids),
            draft_vocab,
            config.num_spec_tokens,
        )
        self._set_up_layer(
            config,
            runner,
            Eagle3Network.kv_cache_spec(cfg),
            graphdef,
            vocab_size,
            checkpoint_cfg.num_kv_heads,
        )

    def forward_inputs(self) -> dict:
        return {"aux_layers": self.aux_layers}

    def updated_weights(self, named: dict):
        """The target's weight update names none of the EAGLE-3 checkpoint's tensors (its own
        directory): None, as for a draft model."""
        return None
