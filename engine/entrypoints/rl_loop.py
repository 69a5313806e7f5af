"""An on-policy RL loop (GRPO) on the research stack: the engine samples, a plain JAX + optax trainer learns,
and the new weights go back into the running engine, with nothing recompiled (issue 30).

    python -m xlaserve.entrypoints.rl_loop --model DIR --steps N [--group-size G] [--max-tokens T] ...

Each iteration: for each prompt (token ids) the engine samples a group of G completions
(`SamplingParams(n=G, temperature=1.0, seed=..., max_tokens=T, ignore_eos=True, logprobs=0)`); a toy reward
scores each one (the fraction of its tokens in a target set); advantages are the rewards normalized within
their group (GRPO: no value model); the trainer takes one Adam step on the policy-gradient loss, computed
with its own forward of the policy (`llama_logprobs`: a pure-JAX Llama on the Hugging Face tensor names,
checked against transformers in the test); and `LLM.update_weights` pushes every tensor back. Each iteration
reports its mean reward and the largest gap between the engine's logprob of a sampled token and the
trainer's: the engine and the trainer must agree on the policy for the gradient to be on-policy (float32
engine: a few 1e-6; bfloat16 engine: a few 1e-2).

The trainer holds the policy as Hugging Face names -> float32 jax arrays, the checkpoint's own names and
shapes, so what it pushes is what a checkpoint holds. Its step is compiled once, up front, for the
batch's fixed shape; after the first iteration nothing compiles, in the engine or the trainer. With
`sleep_level`, the engine hands its KV cache (level 2: its weights too) back while the trainer steps and
wakes before taking the new weights (an update while asleep is refused).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import load_file

from xlaserve.entrypoints.arg_utils import add_engine_args, engine_kwargs
from xlaserve.entrypoints.llm import LLM
from xlaserve.sampling_params import SamplingParams
from xlaserve.worker.compile_guard import num_compiles

logger = logging.getLogger(__name__)

Params = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """What the trainer's forward needs of a Llama's config.json (hashable: a static argument of jit)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: dict) -> LlamaShape:
        if config.get("architectures") != ["LlamaForCausalLM"]:
            raise ValueError(
                f"the trainer's forward is a Llama's; this model is {config.get('architectures')}"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"the trainer's forward has the default rotary embedding only, not {rope_type!r}"
            )
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError("the trainer's forward has no attention or MLP biases")
        num_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
        )


def load_policy(model_dir: str) -> tuple[LlamaShape, Params]:
    """A Hugging Face Llama directory (safetensors) -> its shape and its tensors, float32 on the device."""
    directory = Path(model_dir)
    shape = LlamaShape.from_hf_config(json.loads((directory / "config.json").read_text()))
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    if not tensors:
        raise ValueError(f"{model_dir} has no *.safetensors checkpoint")
    return shape, {name: jnp.asarray(array, jnp.float32) for name, array in tensors.items()}


# -- the trainer's forward: a Llama that reads like the paper ----------------------------------------


def _rms_norm(x_btd: jax.Array, weight_d: jax.Array, eps: float) -> jax.Array:
    return x_btd * jax.lax.rsqrt(jnp.mean(x_btd * x_btd, axis=-1, keepdims=True) + eps) * weight_d


def _rotate(x_btnh: jax.Array, cos_th: jax.Array, sin_th: jax.Array) -> jax.Array:
    """Rotary embedding, Hugging Face's half-split form (rotate_half)."""
    half = x_btnh.shape[-1] // 2
    rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
    return x_btnh * cos_th[None, :, None, :] + rotated * sin_th[None, :, None, :]


def _attention(params: Params, prefix: str, x_btd: jax.Array, cos_th, sin_th, shape: LlamaShape) -> jax.Array:
    b, t, _ = x_btd.shape
    q_btnh = (x_btd @ params[f"{prefix}.q_proj.weight"].T).reshape(b, t, shape.num_heads, shape.head_dim)
    k_btkh = (x_btd @ params[f"{prefix}.k_proj.weight"].T).reshape(b, t, shape.num_kv_heads, shape.head_dim)
    v_btkh = (x_btd @ params[f"{prefix}.v_proj.weight"].T).reshape(b, t, shape.num_kv_heads, shape.head_dim)
    q_btnh, k_btkh = _rotate(q_btnh, cos_th, sin_th), _rotate(k_btkh, cos_th, sin_th)
    # Grouped-query attention: query head n reads KV head n // (num_heads / num_kv_heads).
    q_btkgh = q_btnh.reshape(b, t, shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim)
    scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_btkh) / np.sqrt(shape.head_dim)
    causal_ts = jnp.tril(jnp.ones((t, t), bool))
    scores_bkgts = jnp.where(causal_ts, scores_bkgts, -jnp.inf)
    out_btkgh = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(scores_bkgts, axis=-1), v_btkh)
    return out_btkgh.reshape(b, t, -1) @ params[f"{prefix}.o_proj.weight"].T


def _mlp(params: Params, prefix: str, x_btd: jax.Array) -> jax.Array:
    gate_btf = x_btd @ params[f"{prefix}.gate_proj.weight"].T
    up_btf = x_btd @ params[f"{prefix}.up_proj.weight"].T
    return (jax.nn.silu(gate_btf) * up_btf) @ params[f"{prefix}.down_proj.weight"].T


def llama_logits(params: Params, tokens_bt: jax.Array, shape: LlamaShape) -> jax.Array:
    """The logits of every position, [B, T, V], of sequences starting at position 0 (right padding
    changes nothing before it: attention is causal)."""
    t = tokens_bt.shape[1]
    inv_freq_h = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)
    angles_th = np.arange(t)[:, None] * inv_freq_h[None, :]
    angles_th = np.concatenate([angles_th, angles_th], axis=-1)
    cos_th, sin_th = jnp.asarray(np.cos(angles_th), jnp.float32), jnp.asarray(np.sin(angles_th), jnp.float32)
    h_btd = params["model.embed_tokens.weight"][tokens_bt]
    for i in range(shape.num_layers):
        layer = f"model.layers.{i}"
        x_btd = _rms_norm(h_btd, params[f"{layer}.input_layernorm.weight"], shape.rms_norm_eps)
        h_btd = h_btd + _attention(params, f"{layer}.self_attn", x_btd, cos_th, sin_th, shape)
        x_btd = _rms_norm(h_btd, params[f"{layer}.post_attention_layernorm.weight"], shape.rms_norm_eps)
        h_btd = h_btd + _mlp(params, f"{layer}.mlp", x_btd)
    h_btd = _rms_norm(h_btd, params["model.norm.weight"], shape.rms_norm_eps)
    head = "model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"
    return h_btd @ params[head].T


def llama_logprobs(params: Params, tokens_bt: jax.Array, shape: LlamaShape) -> jax.Array:
    """[B, T-1]: log p(tokens[:, t+1] | tokens[:, :t+1]) under the policy."""
    logprobs_btv = jax.nn.log_softmax(llama_logits(params, tokens_bt[:, :-1], shape), axis=-1)
    return jnp.take_along_axis(logprobs_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]


# -- GRPO -------------------------------------------------------------------------------------------


def target_fraction_reward(token_ids: list[int], targets: frozenset[int]) -> float:
    """The toy reward: the fraction of a completion's tokens in `targets`."""
    return sum(t in targets for t in token_ids) / max(len(token_ids), 1)


def group_advantages(rewards_pg: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """[P, G] rewards -> advantages normalized within each prompt's group (GRPO's baseline); a group
    whose completions all scored the same teaches nothing (0)."""
    centered = rewards_pg - rewards_pg.mean(axis=1, keepdims=True)
    return centered / (rewards_pg.std(axis=1, keepdims=True) + eps)


def _policy_loss(params, tokens_bt, is_sampled_bt, advantages_b, shape):
    """The policy gradient's loss, a mean over sampled tokens: -advantage * logprob (one step per
    rollout, so PPO's ratio is 1 and its clip never binds). -> (loss, the logprobs [B, T-1])."""
    logprobs_bt = llama_logprobs(params, tokens_bt, shape)
    weights_bt = is_sampled_bt * advantages_b[:, None]
    return -jnp.sum(weights_bt * logprobs_bt) / jnp.maximum(jnp.sum(is_sampled_bt), 1.0), logprobs_bt


@dataclasses.dataclass
class Rollout:
    """One iteration's samples as the trainer's batch: B = prompts x group rows of prompt + completion,
    right-padded to T = the longest prompt + max_tokens."""

    tokens_bt: np.ndarray  # [B, T] int32
    is_sampled_bt: np.ndarray  # [B, T-1] float32: 1 where position t+1 holds a sampled token
    engine_logprobs_bt: np.ndarray  # [B, T-1] float32: the engine's logprob of that token
    rewards_pg: np.ndarray  # [P, G]


def rollout(llm: LLM, prompts: list[list[int]], params: SamplingParams, targets: frozenset[int]) -> Rollout:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    num_rows, seq_len = len(prompts) * params.n, max(map(len, prompts)) + params.max_tokens
    tokens = np.zeros((num_rows, seq_len), np.int32)
    is_sampled = np.zeros((num_rows, seq_len - 1), np.float32)
    engine_logprobs = np.zeros((num_rows, seq_len - 1), np.float32)
    rewards = np.zeros((len(prompts), params.n), np.float32)
    for p, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for g, completion in enumerate(output.outputs):
            row, ids = p * params.n + g, list(completion.token_ids)
            tokens[row, : len(prompt) + len(ids)] = prompt + ids
            span = slice(len(prompt) - 1, len(prompt) - 1 + len(ids))
            is_sampled[row, span] = 1.0
            engine_logprobs[row, span] = [e[t].logprob for t, e in zip(ids, completion.logprobs, strict=True)]
            rewards[p, g] = target_fraction_reward(ids, targets)
    return Rollout(tokens, is_sampled, engine_logprobs, rewards)


class GRPOTrainer:
    """The policy (Hugging Face names -> float32 arrays), Adam, and one compiled step for a batch of
    `batch_shape` (compiled here, so the loop compiles nothing)."""

    def __init__(self, shape: LlamaShape, params: Params, learning_rate: float, batch_shape: tuple[int, int]):
        self.shape, self.params = shape, params
        optimizer = optax.adam(learning_rate)
        self.opt_state = optimizer.init(params)

        def step(params, opt_state, tokens_bt, is_sampled_bt, advantages_b):
            grad_fn = jax.value_and_grad(_policy_loss, has_aux=True)
            (loss, logprobs_bt), grads = grad_fn(params, tokens_bt, is_sampled_bt, advantages_b, shape)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, logprobs_bt

        b, t = batch_shape
        args = (
            jax.ShapeDtypeStruct((b, t), jnp.int32),
            jax.ShapeDtypeStruct((b, t - 1), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.float32),
        )
        self._step = jax.jit(step).lower(params, self.opt_state, *args).compile()

    def step(self, batch: Rollout, advantages_b: np.ndarray) -> tuple[float, np.ndarray]:
        """One Adam step on `batch`. -> (the loss, the trainer's logprobs [B, T-1] of the batch's
        tokens under the weights that sampled it)."""
        self.params, self.opt_state, loss, logprobs_bt = self._step(
            self.params, self.opt_state, batch.tokens_bt, batch.is_sampled_bt, advantages_b.astype(np.float32)
        )
        return float(loss), np.asarray(logprobs_bt)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    prompts: tuple[tuple[int, ...], ...]
    targets: frozenset[int]
    num_steps: int = 8
    group_size: int = 4
    max_tokens: int = 8
    learning_rate: float = 3e-2
    seed: int = 0
    sleep_level: int = 0  # 1 or 2: the engine sleeps while the trainer steps

    def __post_init__(self):
        if not self.prompts or not self.targets:
            raise ValueError("LoopConfig: give at least one prompt and one target token id")
        if self.group_size < 2:
            raise ValueError(
                f"LoopConfig: group_size must be >= 2 (a group is its own baseline), got {self.group_size}"
            )
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"LoopConfig: sleep_level is 0 (off), 1 or 2, got {self.sleep_level}")


@dataclasses.dataclass(frozen=True)
class IterationReport:
    step: int
    mean_reward: float
    loss: float
    max_logprob_gap: float  # max |engine - trainer| logprob over the sampled tokens
    num_engine_compiles: int  # programs compiled while the engine sampled and took the new weights
    num_sleep_compiles: int  # ... while the engine slept and woke, with the trainer's step between
    num_compiles: int  # ... during the whole iteration
    seconds: float


def run_rl_loop(llm: LLM, shape: LlamaShape, params: Params, config: LoopConfig) -> list[IterationReport]:
    """`config.num_steps` iterations of sample, score, step, push (the module docstring)."""
    prompts = [list(p) for p in config.prompts]
    batch_shape = (len(prompts) * config.group_size, max(map(len, prompts)) + config.max_tokens)
    trainer = GRPOTrainer(shape, params, config.learning_rate, batch_shape)
    reports = []
    for step in range(config.num_steps):
        start, compiles_at_start = time.perf_counter(), num_compiles()
        sampling = SamplingParams(
            n=config.group_size,
            temperature=1.0,
            seed=config.seed + step,
            max_tokens=config.max_tokens,
            logprobs=0,
            ignore_eos=True,
        )
        before = num_compiles()
        batch = rollout(llm, prompts, sampling, config.targets)
        engine_compiles = num_compiles() - before
        before = num_compiles()
        if config.sleep_level:
            llm.sleep(config.sleep_level)
        advantages_b = group_advantages(batch.rewards_pg).reshape(-1)
        loss, logprobs_bt = trainer.step(batch, advantages_b)
        if config.sleep_level:
            # Before the update: a wake-up places back the weights that went to sleep (an update
            # while asleep at level 2 would be overwritten).
            llm.wake_up()
        sleep_compiles = num_compiles() - before
        before = num_compiles()
        llm.update_weights(trainer.params)
        engine_compiles += num_compiles() - before
        gap = np.abs(logprobs_bt - batch.engine_logprobs_bt) * batch.is_sampled_bt
        reports.append(
            IterationReport(
                step=step,
                mean_reward=float(batch.rewards_pg.mean()),
                loss=loss,
                max_logprob_gap=float(gap.max()),
                num_engine_compiles=engine_compiles,
                num_sleep_compiles=sleep_compiles,
                num_compiles=num_compiles() - compiles_at_start,
                seconds=time.perf_counter() - start,
            )
        )
        logger.info("%s", reports[-1])
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xlaserve.entrypoints.rl_loop", description=__doc__.split("\n")[0]
    )
    add_engine_args(parser)
    loop = parser.add_argument_group("loop")
    loop.add_argument("--steps", type=int, default=8)
    loop.add_argument("--group-size", type=int, default=4)
    loop.add_argument("--max-tokens", type=int, default=8)
    loop.add_argument("--learning-rate", type=float, default=3e-2)
    loop.add_argument("--num-prompts", type=int, default=4)
    loop.add_argument("--prompt-len", type=int, default=8)
    loop.add_argument(
        "--targets", type=int, nargs="+", default=None, help="rewarded token ids (default: 3-12)"
    )
    loop.add_argument("--sampling-seed", type=int, default=0)
    loop.add_argument("--sleep-level", type=int, default=0, choices=(0, 1, 2))
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model: a Hugging Face Llama directory (safetensors)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, **engine_kwargs(args)}
    shape, params = load_policy(args.model)
    rng = np.random.default_rng(args.sampling_seed)
    prompts = tuple(
        tuple(rng.integers(3, shape.vocab_size, args.prompt_len).tolist()) for _ in range(args.num_prompts)
    )
    config = LoopConfig(
        prompts=prompts,
        targets=frozenset(args.targets or range(3, 13)),
        num_steps=args.steps,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        learning_rate=args.learning_rate,
        seed=args.sampling_seed,
        sleep_level=args.sleep_level,
    )
    llm = LLM(args.model, **kwargs)
    for r in run_rl_loop(llm, shape, params, config):
        print(
            f"step {r.step}: mean reward {r.mean_reward:.3f}, loss {r.loss:+.4f}, "
            f"max |engine - trainer| logprob {r.max_logprob_gap:.2e}, "
            f"compiles: engine {r.num_engine_compiles}, sleep and wake {r.num_sleep_compiles}, "
            f"all {r.num_compiles}; {r.seconds:.2f}s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
