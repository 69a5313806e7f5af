"""The model shapes .ci/gpu-check runs with --load-format dummy (random weights drawn where they run):
config.json + SmolLM2's tokenizer (49152 tokens, a chat template; no download) in DIR/llama-1b-shape and
DIR/qwen3_5-shape. `python3 .ci/gpu-models.py DIR [--cpu-scale]`: .ci/gpu-prepare writes the GPU's;
gpu-check's dry run writes the same architectures at a toy width (--cpu-scale), whose head_dim (64) the
GPU kernels take too."""

import argparse
import json
import os

import transformers

from xlaserve.models.gguf_tokenizer import load_gguf_tokenizer
from xlaserve.models.loader import resolve_embedded_model_path

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--cpu-scale", action="store_true", help="2 and 4 layers of width 128")
args = parser.parse_args()

tokenizer = load_gguf_tokenizer(resolve_embedded_model_path())
special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)

# Llama-3.2-1B's layer shapes (GQA 4, head_dim 64) over SmolLM2's vocabulary.
llama = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
)
# engine/PERFORMANCE.md's 616M CPU shape of Qwen3.5: 18 Gated DeltaNet + 6 attention layers.
hybrid = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
if args.cpu_scale:  # one width for both, head_dim 64
    toy = dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    llama.update(toy, num_hidden_layers=2)
    hybrid.update(toy, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2)
    hybrid.update(linear_key_head_dim=64, linear_value_head_dim=64)

directory = os.path.join(args.dir, "llama-1b-shape")
os.makedirs(directory, exist_ok=True)
config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": len(tokenizer),
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    **special,
    **llama,
}
with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
tokenizer.save_pretrained(directory)

directory = os.path.join(args.dir, "qwen3_5-shape")
config = transformers.Qwen3_5TextConfig(
    vocab_size=len(tokenizer), tie_word_embeddings=True, **special, **hybrid
)
config.architectures = ["Qwen3_5ForCausalLM"]
config.save_pretrained(directory)
tokenizer.save_pretrained(directory)
