"""Compile the attention kernels for a CUDA GPU on a machine without one (a check, not a runtime path).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs Pallas's Triton lowering on CPU and
embeds the kernel as Triton IR in the StableHLO; on a GPU, XLA compiles that IR with its bundled
Triton. The `triton` package (the test extra; jax-triton's dependency) carries the same compiler
pipeline and ptxas, so this module takes the IR out and compiles it to a cubin for a given
architecture: the layout passes, register allocation and shared-memory sizing that would otherwise
first run on the GPU. The Triton kernel of `triton_attention.py` goes through `triton.compile`
directly. Neither checks numerics (the interpreters do) or speed (`xlaserve bench attention` does).

The package's Triton is not the exact build inside jaxlib, so a pass here is strong evidence, not
proof, that XLA will compile the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time

import jax

PALLAS_TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    name: str
    arch: int  # compute capability, e.g. 90
    shared_bytes: int  # static shared memory per program
    num_warps: int
    num_stages: int
    ptx_chars: int


def pallas_triton_modules(lowered: jax.stages.Lowered) -> list[tuple[bytes, int, int]]:
    """(Triton IR bytecode, num_warps, num_stages) of every Pallas Triton kernel in a CUDA lowering."""
    found = []

    def visit(op):
        op = op.operation if hasattr(op, "operation") else op
        if (
            op.name == "stablehlo.custom_call"
            and op.attributes["call_target_name"].value == PALLAS_TRITON_CALL_TARGET
        ):
            config = op.attributes["mhlo.backend_config"]
            found.append((config["ir"].value_bytes, config["num_warps"].value, config["num_stages"].value))
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child)

    visit(lowered.compiler_ir("stablehlo").operation)
    return found


def ttir_text(bytecode: bytes) -> str:
    """Pallas's Triton IR bytecode (jaxlib's MLIR) as text, which the triton package can parse."""
    from jax._src.interpreters import mlir
    from jax._src.lib import triton as jaxlib_triton
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context() as ctx:
        jaxlib_triton.dialect.register_dialect(ctx)
        return ir.Module.parse(bytecode).operation.get_asm()


def _metadata(compiled, arch: int) -> CompiledKernel:
    md = compiled.metadata
    return CompiledKernel(md.name, arch, md.shared, md.num_warps, md.num_stages, len(compiled.asm["ptx"]))


def compile_pallas(fn, *args, arch: int = 90) -> list[CompiledKernel]:
    """Lower `fn(*args)` for CUDA and compile each Pallas Triton kernel in it for `arch`."""
    import triton
    from triton.backends.compiler import GPUTarget

    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    results = []
    for bytecode, num_warps, num_stages in pallas_triton_modules(lowered):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ttir")
            with open(path, "w") as f:
                f.write(ttir_text(bytecode))
            compiled = triton.compile(
                path,
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": num_warps, "num_stages": num_stages},
            )
        results.append(_metadata(compiled, arch))
    return results


def compile_triton(
    kernel, signature: dict, constexprs: dict, *, num_warps: int, num_stages: int, arch: int = 90
):
    """Compile a `triton.jit` kernel for `arch` without a GPU; `signature` maps pointer/scalar args to
    Triton types ("*bf16", "i32"), `constexprs` gives the constexpr args."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # jax-triton tells Triton that every array is 16-byte aligned; so do we (it changes vectorization).
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")
    }
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    return _metadata(compiled, arch)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One step's attention shapes, enough to compile a kernel for it."""

    name: str
    num_tokens: int
    num_padded_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    sliding_window: int | None = None
    soft_cap: float | None = None
    block_size: int = 16
    num_blocks: int = 4096
    max_blocks_per_seq: int = 256
    num_kv_splits: int = 1  # the Pallas kernel's split-KV variant (not in the Triton kernel)
    sinks: bool = False  # a sink logit per query head (gpt-oss)
    attend_ahead: bool = False  # per-token bidirectional spans (Gemma 3's images; the Pallas kernel only)


SHAPES = (
    AttentionShape("llama3-8b decode, bf16", 64, 64, 32, 8, 128, "bfloat16"),
    AttentionShape("llama3-8b decode, 4 KV splits, bf16", 8, 8, 32, 8, 128, "bfloat16", num_kv_splits=4),
    AttentionShape("llama3-8b mixed, bf16", 512, 64, 32, 8, 128, "bfloat16"),
    AttentionShape(
        "smollm2 mixed + window + cap, bf16", 128, 16, 9, 3, 64, "bfloat16", sliding_window=64, soft_cap=30.0
    ),
    AttentionShape("smollm2 mixed, f32", 128, 16, 9, 3, 64, "float32"),  # exact (IEEE) dots: slow to compile
    AttentionShape(
        "gpt-oss-20b mixed, sliding + sinks, bf16",
        128,
        16,
        64,
        8,
        64,
        "bfloat16",
        sliding_window=128,
        sinks=True,
    ),
    AttentionShape(
        "gemma3-4b mixed, image spans + window, bf16",
        512,
        16,
        8,
        4,
        256,
        "bfloat16",
        sliding_window=1024,
        attend_ahead=True,
    ),
)


@dataclasses.dataclass(frozen=True)
class MLAShape:
    name: str
    num_tokens: int
    num_padded_seqs: int
    num_heads: int  # per device
    kv_lora_rank: int = 512
    rope_dim: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16
    num_blocks: int = 4096
    max_blocks_per_seq: int = 256


MLA_SHAPES = (
    MLAShape("deepseek-v3 mla decode, 16 heads (TP 8), bf16", 64, 64, 16),
    MLAShape("deepseek-v3 mla mixed, 16 heads (TP 8), bf16", 512, 64, 16),
)


def compile_mla(shape: MLAShape, arch: int = 90) -> CompiledKernel:
    """Compile the Pallas MLA kernel (kernels/ragged_paged_mla.py) for `shape` and `arch`."""
    import functools

    import jax.numpy as jnp

    from xlaserve.kernels.ragged_paged_mla import ragged_paged_mla

    s, sd = shape, jax.ShapeDtypeStruct
    args = (
        sd((s.num_tokens, s.num_heads, s.kv_lora_rank), s.dtype),
        sd((s.num_tokens, s.num_heads, s.rope_dim), s.dtype),
        sd((s.num_blocks, s.block_size, 1, s.kv_lora_rank + s.rope_dim), s.dtype),
        sd((s.num_padded_seqs,), jnp.int32),
        sd((s.num_padded_seqs, s.max_blocks_per_seq), jnp.int32),
        sd((s.num_padded_seqs + 1,), jnp.int32),
        sd((), jnp.int32),
    )
    sm_scale = 192**-0.5  # DeepSeek-V3: 1 / sqrt(qk_nope_head_dim 128 + rope_dim 64)
    [compiled] = compile_pallas(functools.partial(ragged_paged_mla, sm_scale=sm_scale), *args, arch=arch)
    return compiled


@dataclasses.dataclass(frozen=True)
class MatmulShape:
    """One dot of a step: [num_rows, in_dim] x [in_dim, out_dim]."""

    name: str
    num_rows: int
    in_dim: int
    out_dim: int
    dtype: str = "bfloat16"


MATMUL_SHAPES = (
    MatmulShape("llama-3.2-1b gate/up, 64 rows, bf16", 64, 2048, 16384),
    MatmulShape("llama-3.2-1b lm head, 16 rows, bf16", 16, 2048, 128256),
)


def compile_matmul(shape: MatmulShape, arch: int = 90) -> CompiledKernel:
    """Compile the batch-invariant matmul (kernels/invariant_matmul.py) for `shape` and `arch`."""
    from xlaserve.kernels.invariant_matmul import invariant_matmul

    s, sd = shape, jax.ShapeDtypeStruct
    args = (sd((s.num_rows, s.in_dim), s.dtype), sd((s.in_dim, s.out_dim), s.dtype))
    [compiled] = compile_pallas(invariant_matmul, *args, arch=arch)
    return compiled


def compile_attention(kernel: str, shape: AttentionShape, arch: int = 90) -> CompiledKernel:
    """Compile the 'pallas' or 'triton' attention kernel for `shape` and `arch`."""
    import functools

    import jax.numpy as jnp

    from xlaserve.kernels.attention_args import Tiling

    s = shape
    sm_scale = s.head_dim**-0.5
    if kernel == "pallas":
        from xlaserve.kernels import ragged_paged_attention as pallas

        sd = jax.ShapeDtypeStruct
        cache = sd((s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim), s.dtype)
        args = (
            sd((s.num_tokens, s.num_q_heads, s.head_dim), s.dtype),
            cache,
            cache,
            sd((s.num_padded_seqs,), jnp.int32),
            sd((s.num_padded_seqs, s.max_blocks_per_seq), jnp.int32),
            sd((s.num_padded_seqs + 1,), jnp.int32),
            sd((), jnp.int32),
        )
        fn = functools.partial(
            pallas.ragged_paged_attention,
            sm_scale=sm_scale,
            sliding_window=s.sliding_window,
            soft_cap=s.soft_cap,
            num_kv_splits=s.num_kv_splits,
        )
        if s.sinks:  # one more traced operand
            args += (sd((s.num_q_heads,), jnp.float32),)
            fn = functools.partial(lambda f, *a: f(*a[:-1], sinks=a[-1]), fn)
        if s.attend_ahead:  # one more traced operand
            args += (sd((s.num_tokens,), jnp.int32),)
            fn = functools.partial(lambda f, *a: f(*a[:-1], attend_ahead=a[-1]), fn)
        [compiled] = compile_pallas(fn, *args, arch=arch)
        return compiled
    if kernel == "triton":
        import triton

        from xlaserve.kernels import triton_attention

        tiling = Tiling.resolve(s.num_tokens, s.num_padded_seqs, s.num_q_heads // s.num_kv_heads)
        _, params = triton_attention.kernel_params(
            (s.num_tokens, s.num_q_heads, s.head_dim),
            (s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim),
            (s.num_padded_seqs, s.max_blocks_per_seq),
            s.dtype,
            sm_scale=sm_scale,
            has_window=s.sliding_window is not None,
            soft_cap=s.soft_cap,
            tiling=tiling,
            has_sinks=s.sinks,
        )
        element = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[s.dtype]
        # In the kernel's parameter order.
        signature = {"num_seqs_ptr": "*i32", "sliding_window_ptr": "*i32", "sinks_ptr": "*fp32"}
        signature |= {p: "*i32" for p in ("kv_lens_ptr", "query_start_loc_ptr", "block_tables_ptr")}
        signature |= {p: f"*{element}" for p in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        return compile_triton(
            triton.runtime.JITFunction(triton_attention._attention_kernel),
            signature,
            params,
            num_warps=tiling.num_warps,
            num_stages=tiling.num_stages,
            arch=arch,
        )
    raise ValueError(f"kernel must be 'pallas' or 'triton', got {kernel!r}")


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """A recurrent layer's per-chunk kernel: Mamba2's SSD ("ssd") or Qwen3.5's gated delta ("delta")."""

    name: str
    shapes: tuple[tuple[int, ...], ...]  # the kernel's float32 operands


CHUNK_SHAPES = {
    "ssd": (
        ChunkShape(
            "mamba2-130m chunk, f32", ((4, 64, 24, 64), (4, 64, 24), (4, 64, 24, 128), (4, 64, 24, 128))
        ),
    ),
    "delta": (ChunkShape("qwen3.5 chunk, f32", ((4, 64, 16, 128),) * 3 + ((4, 64, 16),) * 2),),
}


def compile_chunk(kernel: str, shape: ChunkShape, arch: int = 90) -> CompiledKernel:
    """Compile the 'ssd' or 'delta' per-chunk Pallas kernel for `shape` and `arch`."""
    import jax.numpy as jnp

    if kernel == "ssd":
        from xlaserve.kernels.ssd_pallas import ssd_chunk_terms as fn
    else:
        from xlaserve.kernels.gated_delta_pallas import delta_chunk_terms as fn
    [compiled] = compile_pallas(fn, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shape.shapes), arch=arch)
    return compiled


def main(argv: list[str] | None = None) -> int:
    """`python -m xlaserve.kernels.cuda_compile [--kernel pallas|triton|mla|matmul|ssd|delta|all] [--arch 90]
    [--shape decode]`: compile the kernels for SHAPES; prints one line per kernel and shape, exits 1
    if any fails."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--kernel", choices=("pallas", "triton", "mla", "matmul", "ssd", "delta", "all"), default="all"
    )
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--shape", action="append", help="only shapes whose name contains this (repeatable)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 makes Triton interpret instead of compile: unset it")
        return 1
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    all_kernels = ("pallas", "triton", "mla", "matmul", "ssd", "delta")
    kernels = all_kernels if args.kernel == "all" else (args.kernel,)
    shapes = {"mla": MLA_SHAPES, "matmul": MATMUL_SHAPES, **CHUNK_SHAPES}
    compile_one = {
        "mla": compile_mla,
        "matmul": compile_matmul,
        **{k: functools.partial(compile_chunk, k) for k in CHUNK_SHAPES},
    }
    failed = 0
    for kernel in kernels:
        for shape in shapes.get(kernel, SHAPES):
            if args.shape and not any(part in shape.name for part in args.shape):
                continue
            if kernel == "triton" and (shape.num_kv_splits > 1 or shape.attend_ahead):
                continue  # split-KV and bidirectional spans are Pallas-only variants
            t0 = time.perf_counter()
            try:
                if kernel in compile_one:
                    c = compile_one[kernel](shape, args.arch)
                else:
                    c = compile_attention(kernel, shape, args.arch)
                print(
                    f"ok   {kernel:6s} sm_{args.arch} {shape.name}: shared {c.shared_bytes} B, "
                    f"{c.num_warps} warps, {c.num_stages} stages, {c.ptx_chars} PTX chars "
                    f"({time.perf_counter() - t0:.1f}s)"
                )
            except Exception as e:  # noqa: BLE001  (report every failure, not just the first)
                failed += 1
                print(f"FAIL {kernel:6s} sm_{args.arch} {shape.name}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
