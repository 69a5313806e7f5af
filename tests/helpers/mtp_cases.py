"""A tiny Qwen3.5 (or Qwen3-Next, DeepSeek V3, GLM-4.5) with a multi-token prediction layer (Qwen's
`mtp.*` tensors, DeepSeek's and GLM's decoder layer `num_hidden_layers`, beside the decoder's, as the
releases ship them), and the drafts that layer proposes, computed with Hugging Face's own layer classes
(transformers has the decoder layer, not the MTP wiring, which is vLLM's: models/mtp.py)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

import torch
import transformers
from safetensors.torch import load_file, save_file

from helpers.family_cases import QWEN3_5_TEXT, randomize_weights, save_hf_model

_FULL_LAYER = QWEN3_5_TEXT["layer_types"].index("full_attention")
# Qwen3-Next's (and Qwen3.5-MoE's) experts over Qwen3.5's sizes (`family="Qwen3Next"`).
QWEN3_NEXT_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
)
# Two decoder layers (dense, then MoE: two stacks) and the MTP layer, MoE as in the releases; MLA with a
# query LoRA; sigmoid routing over two groups with a score bias and shared experts.
DEEPSEEK_V3 = dict(
    vocab_size=101,
    hidden_size=48,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,  # HF's eager MLA needs kv heads == heads; ours has one latent "head"
    intermediate_size=64,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# GLM-4.5's layout of the same (`family="Glm4Moe"`): GQA with q/k/v biases, half-rotary heads, q/k norm.
GLM4_MOE = {
    **{k: v for k, v in DEEPSEEK_V3.items() if "lora" not in k and "head_dim" not in k},
    "num_key_value_heads": 2,
    "head_dim": 12,
    "attention_bias": True,
    "use_qk_norm": True,
    "partial_rotary_factor": 0.5,
}


@dataclasses.dataclass(frozen=True)
class MTPWiring:
    """The MTP layer's tensors around its decoder layer, for the reference (`_mtp_outputs`)."""

    fc: torch.Tensor  # [D, 2D]
    norm_embedding: torch.Tensor
    norm_hidden: torch.Tensor
    norm: torch.Tensor
    norm_offset: float  # Qwen's 1 + w; DeepSeek's plain w: 0
    eps: float
    zero_first_embedding: bool = False  # vLLM's DeepSeek MTP zeroes the embedding read at position 0


def _save_with_mtp(hf, directory: str, mtp: dict, count_key: str) -> str:
    """`hf` saved with the MTP tensors beside its own, and config.json declaring one MTP layer."""
    path = save_hf_model(hf, directory)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file({**tensors, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**hf_config, count_key: 1}, f)
    return path


def save_qwen3_5_with_mtp(
    directory: str, *, oracle: bool = False, seed: int = 0, family: str = "Qwen3_5", **overrides
):
    """A random Qwen3_5ForCausalLM (QWEN3_5_TEXT's sizes, `overrides` over them) and an MTP layer ->
    (path, hf model, the MTP's decoder layer, its wiring). `oracle`: every layer's output projections
    zeroed, so the target predicts each token from the one before it (logits = head(norm(embed(token)))),
    and an MTP layer that computes the same from the token it reads (fc passes the embedding through, its
    layer adds nothing, its norm is the target's): its drafts are the target's own next tokens."""
    fields = QWEN3_5_TEXT if family == "Qwen3_5" else {**QWEN3_5_TEXT, **QWEN3_NEXT_MOE}
    fields = {**fields, **overrides}
    config = getattr(transformers, f"{family}TextConfig" if family == "Qwen3_5" else f"{family}Config")(
        **fields
    )
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(seed)
    hf = randomize_weights(getattr(transformers, f"{family}ForCausalLM")(config).eval(), norm_center=0.0)
    layer, mtp, wiring = _qwen_mtp_layer(hf, config, family, _FULL_LAYER, seed + 1, oracle)
    return _save_with_mtp(hf, directory, mtp, "mtp_num_hidden_layers"), hf, layer, wiring


def save_qwen3_5_vl_with_mtp(directory: str, seed: int = 0):
    """A random Qwen3_5ForConditionalGeneration (helpers/tiny_vlm.py: images before a hybrid decoder,
    interleaved M-RoPE) and an MTP layer, text_config declaring it as the releases do -> (path, hf
    model, the MTP's decoder layer, its wiring)."""
    from helpers.tiny_vlm import save_tiny_qwen3_5_vl

    path = save_tiny_qwen3_5_vl(directory, seed=seed)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    text = hf.config.text_config
    layer, mtp, wiring = _qwen_mtp_layer(
        hf, text, "Qwen3_5", text.layer_types.index("full_attention"), seed + 1
    )
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file({**tensors, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    hf_config["text_config"]["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return path, hf, layer, wiring


def _qwen_mtp_layer(hf, config, family: str, full_layer: int, seed: int, oracle: bool = False):
    """A random Qwen MTP layer over `hf`'s decoder (`config`: its text config) -> (the decoder layer, the
    `mtp.*` tensors, their wiring); `oracle`: `save_qwen3_5_with_mtp`'s."""
    name = {"Qwen3_5": "qwen3_5", "Qwen3Next": "qwen3_next"}[family]
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    layer = getattr(modeling, f"{family}DecoderLayer")(config, full_layer).eval()
    d = config.hidden_size
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mtp = {
            "mtp.fc.weight": torch.randn(d, 2 * d) * 0.3,
            **{
                f"mtp.{n}.weight": torch.randn(d) * 0.2
                for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")
            },
            "mtp.norm.weight": torch.randn(d) * 0.2,
        }
        if oracle:
            for name, p in [*hf.named_parameters(), *layer.named_parameters()]:
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                    p.zero_()
            mtp["mtp.fc.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
            mtp["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(d)
            mtp["mtp.norm.weight"] = hf.model.norm.weight.detach().clone()
    mtp |= {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    wiring = MTPWiring(
        mtp["mtp.fc.weight"],
        mtp["mtp.pre_fc_norm_embedding.weight"],
        mtp["mtp.pre_fc_norm_hidden.weight"],
        mtp["mtp.norm.weight"],
        norm_offset=1.0,
        eps=1e-6,
    )
    return layer, mtp, wiring


def save_deepseek_v3_with_mtp(directory: str, seed: int = 0, family: str = "DeepseekV3", **overrides):
    """A random DeepseekV3ForCausalLM (DEEPSEEK_V3; `family="Glm4Moe"`: a Glm4MoeForCausalLM, GLM4_MOE)
    and its MTP layer stored as the releases store it: decoder layer `num_hidden_layers` (per-expert
    tensors) with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the embedding and LM
    head (`embed_tokens`, `shared_head.head`), `num_nextn_predict_layers: 1` in config.json -> (path, hf
    model, the MTP's decoder layer, its wiring); `overrides`: config fields."""
    fields, module = {"DeepseekV3": (DEEPSEEK_V3, "deepseek_v3"), "Glm4Moe": (GLM4_MOE, "glm4_moe")}[family]
    fields = {**fields, **overrides}
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(transformers, f"{family}Config")(**fields, attn_implementation="eager")
    config.architectures = [f"{family}ForCausalLM"]
    n, d = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(seed)
    hf = randomize_weights(getattr(transformers, f"{family}ForCausalLM")(config).eval())
    layer = randomize_weights(getattr(modeling, f"{family}DecoderLayer")(config, layer_idx=n).eval())  # MoE
    with torch.no_grad():
        for name, buffer in [*hf.named_buffers(), *layer.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    p = f"model.layers.{n}."
    mtp = {
        f"{p}eh_proj.weight": torch.randn(d, 2 * d) * 0.3,
        **{
            f"{p}{name}.weight": 1.0 + 0.2 * torch.randn(d) for name in ("enorm", "hnorm", "shared_head.norm")
        },
        f"{p}embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
        f"{p}shared_head.head.weight": hf.lm_head.weight.detach().clone(),
    }
    for name, t in layer.state_dict().items():
        block = p + name.rsplit(".", 1)[0]  # transformers' fused experts -> the releases' per expert
        if name.endswith("experts.gate_up_proj"):  # [E, 2F, D]: gate, then up
            for e, expert in enumerate(t):
                gate, up = expert.chunk(2, dim=0)
                mtp |= {
                    f"{block}.{e}.gate_proj.weight": gate.clone(),
                    f"{block}.{e}.up_proj.weight": up.clone(),
                }
        elif name.endswith("experts.down_proj"):
            mtp |= {f"{block}.{e}.down_proj.weight": down.clone() for e, down in enumerate(t)}
        else:
            mtp[p + name] = t.detach().clone()
    path = _save_with_mtp(hf, directory, mtp, "num_nextn_predict_layers")
    wiring = MTPWiring(
        mtp[f"{p}eh_proj.weight"],
        mtp[f"{p}enorm.weight"],
        mtp[f"{p}hnorm.weight"],
        mtp[f"{p}shared_head.norm.weight"],
        norm_offset=0.0,
        eps=config.rms_norm_eps,
        zero_first_embedding=True,
    )
    return path, hf, layer, wiring


def _norm(weight, x, offset: float, eps: float):
    """RMSNorm scaled by offset + w (Qwen3.5's zero-centred 1 + w, DeepSeek's plain w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())


@torch.no_grad()
def _mtp_outputs(hf, layer, mtp: MTPWiring, next_ids: list[int], hidden, positions, mask):
    """The MTP layer's final-norm outputs of rows reading token next_ids[i] and hidden[i] at positions[i]
    ([n], or M-RoPE's [3, n]), row i attending to the rows `mask` [n, n] (bool) allows."""
    text = getattr(hf.model, "language_model", hf.model)  # a vision-language model's decoder
    embeds = text.embed_tokens(torch.tensor(next_ids))
    positions = torch.as_tensor(positions)
    if mtp.zero_first_embedding:
        embeds[positions == 0] = 0.0
    x = torch.cat(
        [
            _norm(mtp.norm_embedding, embeds, mtp.norm_offset, mtp.eps),
            _norm(mtp.norm_hidden, hidden, mtp.norm_offset, mtp.eps),
        ],
        dim=-1,
    )
    x = x @ mtp.fc.T
    positions = positions[..., None, :]  # [1, n], or [3, 1, n]
    out = layer(
        x[None],
        position_embeddings=text.rotary_emb(x[None], positions),
        attention_mask=torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None],
        position_ids=positions,
    )
    return _norm(mtp.norm, (out[0] if isinstance(out, tuple) else out)[0], mtp.norm_offset, mtp.eps)


@torch.no_grad()
def hf_drafts(
    hf, layer, mtp: MTPWiring, seq: list[int], steps: list[int], k: int, images: dict | None = None
) -> list[list[int]]:
    """For each p of `steps`, the k greedy drafts proposed once the token at position p of `seq` is
    emitted: the MTP layer over positions 0..p-1 (the token after each, the target's final-norm hidden
    state there) gives the first, then it reads its own draft and output at p, p + 1... for the next.
    All steps at once, one layer call per draft: what positions 0..p-1 compute is the same for every
    step (causal), so one pass over the whole sequence gives every step's first draft (its output at
    p - 1), and each further draft adds per step a row at its next position that attends to positions
    0..p-1 and to that step's own added rows. `images`: a vision-language model's image inputs
    (pixel_values, image_grid_thw) and its image_token_id: the rows rotate by get_rope_index's M-RoPE
    positions, a draft's three by its position plus the sequence's delta."""
    n = len(seq) - 1
    input_ids = torch.tensor([seq])
    if images is None:
        hidden = hf.model(input_ids=input_ids).last_hidden_state[0, :n]
        positions, delta = torch.arange(n), 0
    else:
        pixels = {name: images[name] for name in ("pixel_values", "image_grid_thw")}
        types = (input_ids == images["image_token_id"]).long()
        hidden = hf.model(input_ids=input_ids, mm_token_type_ids=types, **pixels).last_hidden_state[0, :n]
        mrope, delta = hf.model.get_rope_index(input_ids, types, image_grid_thw=pixels["image_grid_thw"])
        positions, delta = mrope[:, 0, :n], int(delta[0, 0])

    def run(ids, rows, positions, mask):
        out = _mtp_outputs(hf, layer, mtp, ids, rows, positions, mask)
        return hf.lm_head(out).argmax(-1).tolist(), out

    return chain_drafts(run, list(seq[1:]), hidden, positions, steps, k, delta)


def chain_drafts(run, ids: list[int], rows, positions, steps: list[int], k: int, delta: int = 0):
    """`hf_drafts`' chain for any drafting network: `run(ids, rows, positions, mask) -> (the greedy
    draft each row gives, the hidden state each row hands the next draft)`, over rows reading token
    ids[i] and hidden state rows[i] at positions[i] ([n], or M-RoPE's [3, n]), row i attending to the
    rows `mask` [n, n] allows. The sequence's own n rows first; each step p of `steps` adds one row per
    further draft at its next position (plus `delta`), attending to positions 0..p-1 and its own rows."""
    n = len(ids)
    owner = [-1] * n  # the step each row was added for (-1: the sequence's own)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    last = [p - 1 for p in steps]  # each step's row whose output gives its next draft
    drafts: list[list[int]] = [[] for _ in steps]
    for i in range(k):
        tokens, carried = run(ids, rows, positions, mask)
        for j, row in enumerate(last):
            drafts[j].append(int(tokens[row]))
        if i == k - 1:
            return drafts
        m = len(ids)
        ids = ids + [d[-1] for d in drafts]
        rows = torch.cat([rows, carried[last]])
        added = torch.tensor([p + i + delta for p in steps])
        positions = torch.cat([positions, added if positions.ndim == 1 else added.expand(3, -1)], dim=-1)
        owner += list(range(len(steps)))
        last = list(range(m, m + len(steps)))
        grown = torch.zeros(len(ids), len(ids), dtype=torch.bool)
        grown[:m, :m] = mask
        for j, p in enumerate(steps):  # the step's new row: positions 0..p-1 and its own rows
            grown[m + j, :p] = True
            grown[m + j, [r for r in range(n, len(ids)) if owner[r] == j]] = True
        mask = grown
    return drafts


def record_drafts(llm) -> dict[str, list[tuple[int, list[int]]]]:
    """Per request, each step's drafts with the position of the token emitted before them (filled as
    the engine runs: the scheduler's update wrapped)."""
    scheduler, seen = llm.engine_core.scheduler, {}
    update = scheduler.update_from_output

    def recording(scheduler_output, runner_output):
        outputs = update(scheduler_output, runner_output)
        for s in scheduler_output.scheduled:
            drafts = runner_output.draft_token_ids.get(s.request.request_id)
            if drafts is not None:
                seen.setdefault(s.request.request_id, []).append((s.request.num_tokens - 1, list(drafts)))
        return outputs

    scheduler.update_from_output = recording
    return seen
