"""`xlaserve bench throughput|latency`: a fixed synthetic chat workload, modelled on `vllm bench`.

`--input-len N` swaps the chat prompts for random token ids of length N (vLLM's random dataset,
seeded): long contexts, where the attention kernels matter.

`--backend hf` also runs Hugging Face transformers' `generate` on the same prompts, in the same
process, so every report carries a side-by-side ratio measured under the same conditions
(bench/hf_peer.py): both backends first run one untimed request (the first prompt,
WARM_UP_OUTPUT_LEN tokens), reported as `warm_up_s`.

Every xlaserve run reports, per step, the host's idle time (blocked on the device's results) and
the device's (done with a step, waiting for the host to dispatch the next one). `--compare-async`
runs the workload twice on the same engine, synchronous then with async scheduling, for a paired
ratio; `-dp N --compare-data-parallel` alternates N data-parallel ranks with one (bench/data_parallel.py).
`--runner pooling` times a pooling engine's sequences/s instead, beside Hugging Face's `AutoModel` with
`--backend hf` (bench/pooling.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from xlaserve.entrypoints.arg_utils import engine_kwargs
from xlaserve.entrypoints.bench import data_parallel, hf_peer, pooling, roofline, speculative
from xlaserve.entrypoints.bench.lora import bench_lora, is_lora_bench, parse_ranks, print_lora
from xlaserve.entrypoints.bench.report import WARM_UP_OUTPUT_LEN, run_report

logger = logging.getLogger(__name__)

_TOPICS = [
    "the history of the printing press",
    "how volcanoes form",
    "a recipe for lentil soup",
    "the rules of chess",
    "why the sky is blue",
    "how a bicycle stays upright",
    "the water cycle",
    "the life of honeybees",
    "how compilers work",
    "the first moon landing",
    "training for a marathon",
    "the causes of inflation",
    "how vaccines work",
    "the architecture of Gothic cathedrals",
    "learning a second language",
    "the physics of rainbows",
]
_ASKS = [
    "Explain {t} to a child.",
    "Write a short essay about {t}.",
    "Give five facts about {t}.",
    "Describe {t} in detail.",
]


def workload(num_prompts: int) -> list[list[dict]]:
    """N chat conversations, the same for every run and backend."""
    return [
        [{"role": "user", "content": _ASKS[i % len(_ASKS)].format(t=_TOPICS[i % len(_TOPICS)])}]
        for i in range(num_prompts)
    ]


# -- xlaserve --------------------------------------------------------------------------------------


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, excluded_ids, seed: int = 0
) -> list[dict]:
    """`num_prompts` prompts of `input_len` token ids drawn uniformly from the vocabulary, special
    tokens (EOS among them) excluded; the same for every run with the same seed."""
    import numpy as np

    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(sorted(excluded_ids), np.int64))
    rows = np.random.default_rng(seed).choice(allowed, size=(num_prompts, input_len))
    return [{"prompt_token_ids": row.tolist()} for row in rows]


def _prompts(tokenizer, conversations) -> list[dict]:
    out = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        out.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return out


def run_xlaserve(
    llm, prompts, output_len: int, batch: bool, lora_requests=None, async_scheduling: bool | None = None
) -> dict:
    """One run of the workload. `lora_requests`: one LoRARequest (or None) per prompt, or None: the base
    model for all. `async_scheduling`: set the engine's mode first (None: as configured)."""
    from xlaserve.sampling_params import SamplingParams

    cores = getattr(llm.engine_core, "ranks", [llm.engine_core])
    if async_scheduling is not None:
        for core in cores:
            core.set_async_scheduling(async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    loras = lora_requests or [None] * len(prompts)
    warm_up = SamplingParams(temperature=0.0, max_tokens=WARM_UP_OUTPUT_LEN)
    warm_up_start = time.perf_counter()
    llm.generate(prompts[:1], warm_up, use_tqdm=False, lora_request=loras[:1])  # untimed
    warm_up_s = time.perf_counter() - warm_up_start
    runners = [core.runner for core in cores]
    for r in runners:
        r.timing.watch = True  # see when each step's results are ready, even when read a step later
    steps0, wait0 = sum(r.num_steps for r in runners), sum(r.device_wait_s for r in runners)
    idle0 = sum(r.timing.device_idle_s for r in runners)
    spec0 = speculative.spec_counters(llm)
    start = time.perf_counter()
    if batch:
        outputs = llm.generate(prompts, params, lora_request=loras)
    else:
        outputs = [
            llm.generate(p, params, use_tqdm=False, lora_request=lo)[0] for p, lo in zip(prompts, loras)
        ]
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outputs
        if len(o.outputs[0].token_ids) > 1
    ]
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    report = run_report("xlaserve", len(outputs), num_in, num_out, elapsed, ttft, tpot)
    steps = sum(r.num_steps for r in runners) - steps0
    waited = sum(r.device_wait_s for r in runners) - wait0
    device_idle = sum(r.timing.device_idle_s for r in runners) - idle0
    # Host time per step; with synchronous steps the device idles through all of it, with async
    # scheduling only through what the device's own step time does not cover (device_idle).
    report |= {
        "warm_up_s": warm_up_s,
        "async_scheduling": all(core.async_scheduling for core in cores),
        "num_steps": steps,
        "host_ms_per_step": (elapsed - waited) / max(steps, 1) * 1e3,
        "host_idle_ms_per_step": waited / max(steps, 1) * 1e3,
        "device_idle_ms_per_step": device_idle / max(steps, 1) * 1e3,
    }
    if spec := speculative.acceptance(spec0, speculative.spec_counters(llm)):
        report["speculative"] = spec
    return report


# -- command ---------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from xlaserve.entrypoints.llm import LLM

    batch = args.bench == "throughput"
    num_prompts = args.num_prompts
    kwargs = engine_kwargs(args)
    llm_kwargs = {k: v for k, v in kwargs.items() if not k.endswith(("lora", "loras", "lora_rank"))}
    llm = LLM(args.model, **llm_kwargs)
    if kwargs.get("runner") == "pooling":
        return _bench_pooling(args, llm, num_prompts)
    if args.input_len is None:
        make_workload = speculative.copy_workload if args.workload == "copy" else workload
        prompts = _prompts(llm.tokenizer, make_workload(num_prompts))
    else:
        from xlaserve.engine.detokenizer import special_token_ids

        vocab = min(len(llm.tokenizer), llm.input_processor.vocab_size)
        prompts = random_prompts(num_prompts, args.input_len, vocab, special_token_ids(llm.tokenizer))
    results = {
        "bench": args.bench,
        "num_prompts": num_prompts,
        "output_len": args.output_len,
        "input_len": args.input_len,
        "enforce_eager": bool(args.enforce_eager),
        "workload": args.workload if args.input_len is None else "random",
    }
    if args.baseline_without_speculation:
        if "speculative_config" not in kwargs:
            raise SystemExit("--baseline-without-speculation needs --speculative-config")
        base = LLM(args.model, **{k: v for k, v in kwargs.items() if k != "speculative_config"})
        results["paired"] = speculative.run_paired(llm, base, prompts, args.output_len)
    if is_lora_bench(args):
        engines = [llm]
        del llm  # bench_lora keeps it and builds the LoRA engine next to it
        results["lora_bench"] = bench_lora(args, kwargs, prompts, run_xlaserve, batch, engines)
        results["xlaserve"] = results["lora_bench"]["lora"]
    elif args.compare_data_parallel:
        if len(getattr(llm.engine_core, "ranks", [])) < 2:
            raise SystemExit("--compare-data-parallel needs --data-parallel-size 2 or more")
        single = LLM(args.model, **{**llm_kwargs, "data_parallel_size": 1})
        results["data_parallel"] = data_parallel.run_paired(
            llm, single, run_xlaserve, prompts, args.output_len, batch, args.data_parallel_rounds
        )
        results["xlaserve"] = results["data_parallel"]["data_parallel"][-1]
    elif args.compare_async:
        results["xlaserve_sync"] = run_xlaserve(llm, prompts, args.output_len, batch, async_scheduling=False)
        results["xlaserve"] = run_xlaserve(llm, prompts, args.output_len, batch, async_scheduling=True)
        sync, asyn = results["xlaserve_sync"], results["xlaserve"]
        results["ratio_async_over_sync_output_throughput"] = (
            asyn["output_tokens_per_s"] / sync["output_tokens_per_s"]
        )
        results["ratio_tpot_sync_over_async"] = sync["tpot_s"]["mean"] / asyn["tpot_s"]["mean"]
    else:
        results["xlaserve"] = run_xlaserve(llm, prompts, args.output_len, batch)
    if args.roofline:
        results["roofline"] = roofline.measure(llm, results["xlaserve"], is_batch_1=not batch)
    if args.backend == "hf":
        hf = hf_peer.load_hf(args.model, args.hf_dtype)
        results["hf_dtype"] = args.hf_dtype
        results["hf"] = hf_peer.run_hf(hf, llm.tokenizer, prompts, args.output_len, batch)
        results |= hf_peer.ratios(results["xlaserve"], results["hf"])
    _print(results)
    if "lora_bench" in results:
        print_lora(results)
    if "roofline" in results:
        roofline.print_roofline(results["roofline"])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _bench_pooling(args: argparse.Namespace, llm, num_prompts: int) -> int:
    """`--runner pooling`: sequences/s of the engine's pooling, and Hugging Face's (bench/pooling.py).
    Without --input-len the prompts are the chat workload's user turns, tokenized as the model's
    tokenizer does (an encoder's [CLS] ... [SEP]; no chat template)."""
    if args.input_len is None:
        texts = [conversation[-1]["content"] for conversation in workload(num_prompts)]
        prompts = [{"prompt_token_ids": llm.tokenizer(t)["input_ids"]} for t in texts]
    else:
        from xlaserve.engine.detokenizer import special_token_ids

        vocab = min(len(llm.tokenizer), llm.input_processor.vocab_size)
        prompts = random_prompts(num_prompts, args.input_len, vocab, special_token_ids(llm.tokenizer))
    batch_size = llm.engine_core.runner.config.scheduler.max_num_seqs
    results = {"bench": args.bench, "num_prompts": num_prompts, "input_len": args.input_len}
    results |= pooling.bench(llm, args.model, prompts, args.backend, batch_size)
    pooling.print_results(results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print(results: dict) -> None:
    prompts = (
        f"{results.get('workload', 'chat')} prompts"
        if results.get("input_len") is None
        else f"random prompts of {results['input_len']} tokens"
    )
    print(
        f"\n== bench {results['bench']}: {results['num_prompts']} {prompts} x {results['output_len']} "
        "output tokens =="
    )
    for backend in ("xlaserve_sync", "xlaserve", "hf"):
        r = results.get(backend)
        if r is None:
            continue
        name = backend
        if backend.startswith("xlaserve"):
            name = "async" if r["async_scheduling"] else "sync"
        print(
            f"{name:>9}: {r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT mean {r['ttft_s']['mean'] * 1e3:.0f} ms, TPOT mean {r['tpot_s']['mean'] * 1e3:.1f} ms"
        )
        if "host_ms_per_step" in r:
            compiles = " (compiles included: --enforce-eager)" if results.get("enforce_eager") else ""
            print(
                f"{'':>9}  {r['num_steps']} steps, per step: host work {r['host_ms_per_step']:.1f} ms, "
                f"host idle {r['host_idle_ms_per_step']:.1f} ms, device idle "
                f"{r['device_idle_ms_per_step']:.1f} ms{compiles}"
            )
        speculative.print_acceptance(r.get("speculative", {}))
    if "paired" in results:
        speculative.print_paired(results["paired"])
    if "data_parallel" in results:
        data_parallel.print_paired(results["data_parallel"])
    if "ratio_async_over_sync_output_throughput" in results:
        print(
            f"async / sync: output throughput {results['ratio_async_over_sync_output_throughput']:.2f}x, "
            f"TPOT sync / async {results['ratio_tpot_sync_over_async']:.2f}x"
        )
    hf_peer.print_ratios(results)


def _count(text: str) -> int:
    """A count flag's value: an integer >= 1 (0 prompts or output tokens measure nothing)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes an integer >= 1, got {text!r}")
    return value


def add_parser(sub, add_engine_args):
    p = sub.add_parser("bench", help="benchmarks: throughput, latency (offline), serve (a running server)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for name, help_text in (
        ("throughput", "all prompts at once: requests/s and output tokens/s"),
        ("latency", "one request at a time: time to first token and time per output token"),
    ):
        b = bench_sub.add_parser(name, help=help_text)
        b.add_argument("--num-prompts", type=_count, default=64 if name == "throughput" else 8)
        b.add_argument("--output-len", type=_count, default=128)
        b.add_argument(
            "--input-len",
            type=int,
            default=None,
            help="random prompts of this many token ids instead of the chat workload",
        )
        b.add_argument(
            "--backend",
            choices=["xlaserve", "hf"],
            default="xlaserve",
            help="hf: also run HF transformers' generate on the same workload, for a ratio",
        )
        b.add_argument(
            "--hf-dtype",
            choices=["float32", "bfloat16"],
            default="float32",
            help="the dtype Hugging Face runs in with --backend hf (compare with its best)",
        )
        b.add_argument(
            "--compare-async",
            action="store_true",
            help="run the workload twice on one engine, synchronous then with async scheduling (paired)",
        )
        b.add_argument(
            "--compare-data-parallel",
            action="store_true",
            help="with --data-parallel-size N: also build a one-rank engine and alternate the two on the "
            "workload (paired rounds), reporting the throughput ratio",
        )
        b.add_argument(
            "--data-parallel-rounds",
            type=int,
            default=2,
            help="with --compare-data-parallel: paired rounds, the order turning each round",
        )
        b.add_argument(
            "--workload",
            choices=["chat", "copy"],
            default="chat",
            help="copy: code to repeat with one change (answers copy the prompt)",
        )
        b.add_argument(
            "--baseline-without-speculation",
            action="store_true",
            help="with --speculative-config: also run each prompt alone on the same engine without it, "
            "paired in this process, and report the TPOT ratio",
        )
        b.add_argument(
            "--roofline",
            action="store_true",
            help="also time the weights' read at the device's copy bandwidth and report TPOT over it "
            "(a decode step's floor; use short prompts, --input-len 16)",
        )
        b.add_argument("--output-json", default=None)
        b.add_argument(
            "--num-random-loras",
            type=int,
            default=0,
            help="also run the workload spread over N random adapters (on every projection) and "
            "report the ratio to the base model; or give --lora-modules",
        )
        b.add_argument(
            "--random-lora-rank",
            type=parse_ranks,
            default="16",
            help="their rank, or ranks taken in turn (8,16); default 16",
        )
        b.add_argument(
            "--lora-rounds",
            type=int,
            default=3,
            help="with LoRA: paired rounds, base and LoRA engines alternated in one process (medians)",
        )
        add_engine_args(b)
        b.set_defaults(func=cmd_bench)
    return bench_sub
