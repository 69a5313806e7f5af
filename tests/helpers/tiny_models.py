"""Tiny random Hugging Face checkpoints written offline, for tests that need a model directory."""

from __future__ import annotations

import contextlib
import os

import numpy as np

# XLA_FLAGS for a subprocess that serves only tiny models: nearly all its time is compiling, and LLVM's
# optimizations nearly all of a compile. At XLA's backend optimization level 0 such a process takes ~30%
# less CPU (the fake-mesh worker's cases: 661 -> 432 s, stop 45), and what the tests compare (tokens,
# logprobs, collectives) does not depend on it. Engines on SmolLM2, whose steps dominate, keep XLA's
# default: at level 0 its modules took ~30% more CPU. helpers/tp_worker.py sets the same level.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0"
# For a process of its own (a server, an engine's start) on a tiny model, whose results are compared
# with a reference computed apart (Hugging Face's, a scripted text) or in processes compiling alike:
# XLA:CPU's elemental emitters for fusions too, not its newer fusion emitters, which were most of such
# a compile (a tiny VLM server's warm-up of 17 programs: 16.5 -> 6.3 s). The fake-mesh worker does the
# same per program (helpers/tp_worker.py). Not for the suite's own processes: their bitwise tests
# (batch invariance, pipeline stages against one device) hold for the emitters users run.
TINY_PROCESS_XLA_FLAGS = f"{FAST_COMPILE_XLA_FLAGS} --xla_cpu_use_fusion_emitters=false"
TINY_PROCESS_ENV = {"XLA_FLAGS": TINY_PROCESS_XLA_FLAGS}  # ServerProcess(env=...)
# A tiny DeepSeek-V3 (latent attention, a dense layer then grouped-routing experts): save_tiny_model's
# overrides for "DeepseekV3", shared by the MLA kernel, tensor- and context-parallel tests.
TINY_DEEPSEEK_V3 = {
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_key_value_heads": 4,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 12,
    "q_lora_rank": 32,
}
# The suite's processes' gc thresholds (tests/conftest.py and helpers/tp_worker.py set them).
GC_THRESHOLDS = (20_000, 50, 100)
# TINY_PROCESS_XLA_FLAGS' emitters for one engine's programs (its compiler options), where a process also
# builds engines that must keep XLA's default ones (pipeline stages compared with one device bit for bit).
ELEMENTAL_EMITTERS = {"xla_cpu_use_fusion_emitters": False}


def compile_with_elemental_emitters_when(is_on) -> None:
    """Add ELEMENTAL_EMITTERS to the compiler options of every engine's programs (CompilationConfig
    .compiler_options, read as each program is compiled) while `is_on()` is true."""
    from xlaserve.config import CompilationConfig

    engine_options = CompilationConfig.compiler_options

    def compiler_options(self) -> dict | None:
        options = engine_options(self)
        return {**(options or {}), **ELEMENTAL_EMITTERS} if is_on() else options

    CompilationConfig.compiler_options = compiler_options


def warm_up_what_the_cases_run() -> None:
    """The guarded engines' warm-up (the strict compile guard's) compiles only programs the cases' steps
    can call: `warm_up_plain_sampling_only` (config/compilation.py), set for every engine this process
    builds. Not the sampler and verify variants with penalties or a grammar's bitmask, nor the prompt
    logprobs programs, which no case asks for. Each is a program over the vocabulary, ~1.6 s of CPU a
    sampler variant: of a guarded PP=2 x TP=2 engine's 14.5 s of CPU, 7.1 s. The guard still proves that
    every step a case runs finds its program compiled at warm-up; tests/worker/test_warm_up.py runs every
    variant after a whole warm-up. Called by the fake-mesh worker (tp_worker.py) and by the scripts of
    two processes (helpers/two_processes.py), whose guarded engines warm up in both processes."""
    os.environ["XLASERVE_WARM_UP_PLAIN_SAMPLING_ONLY"] = "1"


@contextlib.contextmanager
def elemental_emitters():
    """Engines built inside compile with ELEMENTAL_EMITTERS: in the suite's process, the references of
    processes under TINY_PROCESS_XLA_FLAGS, compiled as they are, and tiny-model engines whose tests
    compare them only with references computed apart (Hugging Face's, peft's, torch's), never bit for
    bit with another engine: their compiles take ~60% less time. The bitwise tests (batch invariance,
    an engine against another) keep XLA's default emitters, the ones users run."""
    from xlaserve.config import CompilationConfig

    engine_options = CompilationConfig.compiler_options
    CompilationConfig.compiler_options = lambda self: {**(engine_options(self) or {}), **ELEMENTAL_EMITTERS}
    try:
        yield
    finally:
        CompilationConfig.compiler_options = engine_options


def save_tiny_llama(directory: str, *, seed: int = 0, **overrides) -> str:
    """A random LlamaForCausalLM (float32 safetensors) with the SmolLM2 tokenizer, in `directory`."""
    return save_tiny_model(directory, "Llama", seed=seed, **overrides)


def save_tiny_model(
    directory: str,
    family: str,
    *,
    seed: int = 0,
    added_tokens: list[str] = (),
    chat_template: str | None = None,
    tokenizer=None,
    **overrides,
) -> str:
    """A random `{family}ForCausalLM` from transformers (e.g. "Llama", "Qwen3", "Qwen3Moe"), float32
    safetensors plus the SmolLM2 tokenizer, in `directory`. `added_tokens` join the vocabulary (as
    tokens that decode as text, like Qwen3's <think>); `chat_template` replaces SmolLM2's."""
    import torch
    import transformers

    from xlaserve.models.gguf_tokenizer import load_gguf_tokenizer
    from xlaserve.models.loader import resolve_embedded_model_path

    if tokenizer is None:  # `tokenizer`: another (e.g. `small_byte_tokenizer()`: cheap programs)
        tokenizer = load_gguf_tokenizer(resolve_embedded_model_path())
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config.update(overrides)
    torch.manual_seed(seed)
    config_class = getattr(transformers, f"{family}Config")
    model = getattr(transformers, f"{family}ForCausalLM")(config_class(**config)).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all near-ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def save_repeating_llama(directory: str, *, seed: int = 0, **overrides) -> str:
    """A tiny Llama whose greedy answer repeats the prompt's last token, over and over: its attention
    and MLP outputs are zero, so the last position's hidden state is that token's embedding, and the
    tied LM head scores the token itself far above any other (a random vector's square against its
    dot products with the others). Where a test needs n-gram drafts to happen, and be accepted, this
    model guarantees them; a random one may answer without repeating any token. `overrides` go to
    save_tiny_model (another `tokenizer`, a `chat_template`)."""
    from safetensors.numpy import load_file, save_file

    save_tiny_llama(directory, seed=seed, **{**overrides, "tie_word_embeddings": True})
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(value)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


def save_bigram_llama(directory: str, next_token: dict[int, int], *, tokenizer) -> str:
    """A tiny Llama whose greedy next token depends on the last token alone: `next_token[t]` after t
    (token 0 after any other). Its attention and MLP outputs are zero, so the last position's hidden
    state is the token's embedding, here a one-hot row (hidden size >= vocabulary), and the LM head
    maps that row to the chosen token. As a draft model, it proposes what the target did after the same
    token: accepted where the target repeats its transitions, rejected elsewhere."""
    from safetensors.numpy import load_file, save_file

    vocab = len(tokenizer)
    hidden = 16 * -(-vocab // 16)
    heads = hidden // 16
    save_tiny_llama(
        directory,
        tokenizer=tokenizer,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(value)
        elif name.endswith("norm.weight"):
            tensors[name] = np.ones_like(value)
    tensors["model.embed_tokens.weight"] = np.eye(vocab, hidden, dtype=np.float32)
    head = np.zeros((vocab, hidden), np.float32)
    for token, after in next_token.items():
        head[after, token] = 10.0
    tensors["lm_head.weight"] = head
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


# A template that opens the thinking in the prompt (as DeepSeek-R1's and Qwen3 Thinking's do), or
# closes it at once when chat_template_kwargs say {"enable_thinking": false} (as Qwen3's does).
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def save_tiny_thinking_model(directory: str, *, seed: int = 0) -> str:
    """A tiny random Qwen3 whose vocabulary has <think> and </think> and whose template emits them."""
    return save_tiny_model(
        directory, "Qwen3", seed=seed, added_tokens=["<think>", "</think>"], chat_template=THINKING_TEMPLATE,
        head_dim=8,
    )  # fmt: skip


def max_rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def small_byte_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer of `vocab_size` tokens (the 256 bytes, <|endoftext|> as EOS and BOS,
    merges trained on a few lines of JSON and words), as a transformers fast tokenizer: for tests that
    need real text and grammars (llguidance) but not SmolLM2's 49,152-token vocabulary, whose logits
    make every sampler program ~150x wider."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [
        '{"tags": ["red", "green", "blue"], "size": 12, "name": "Ann", "age": 7}',
        "ab cd ef ab cd. Codes: more tags, then again and yes no true false null",
        "The quick brown fox jumps over the lazy dog 0123456789 []{},:.",
    ] * 4
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


# Our (HF) tensor names -> llama.cpp's, as its converter writes them for llama, qwen2 and qwen3
# (test_loaders.py's, test_weight_formats.py's and test_gguf_architectures.py's synthetic GGUF files).
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_writer(path: str, config, arch: str):
    """A GGUFWriter for `arch` with the shape keys every architecture's file carries, from an HF config."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    return writer


def write_tokenizer_gguf(path, arch: str, num_tokens: int, add_tokenizer) -> None:
    """A GGUF file of `arch` for its tokenizer: the keys `add_tokenizer(writer)` writes, beside a
    one-layer, eight-wide model's shape keys and a zero token table of `num_tokens` rows."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(writer)
    writer.add_tensor("token_embd.weight", np.zeros((num_tokens, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_word_tokenizer(writer, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of whole words `w3`, `w4`, ... after <pad>, <s> and </s> (ids 0-2)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["<pad>", "<s>", "</s>", *(f"w{i}" for i in range(3, vocab_size))])
    writer.add_token_types([3, 3, 3] + [1] * (vocab_size - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
