"""Disaggregated prefill (issue 35) on a tiny random Llama, three engines in one process over loopback
ZMQ: a producer runs the prompt and serves its blocks, a consumer fetches them and decodes with the
same tokens (and logprobs, bit for bit) as one engine alone; a producer that stops answering mid-
transfer, a request it never held and a prompt that differs leave the consumer computing the prompt
itself, nothing lost; bad settings and params are refused naming the field."""

from __future__ import annotations

import dataclasses
import socket
import threading

import numpy as np
import pytest
import zmq

from helpers.family_cases import make_hf_model, save_hf_model
from helpers.mtp_cases import record_drafts, save_deepseek_v3_with_mtp
from xlaserve import LLM, SamplingParams
from xlaserve.config import EngineConfig
from xlaserve.core.kv_transfer import decode_header, encode_header

BLOCK = 8
ENGINE_ARGS = {
    "max_model_len": 96,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,  # prompts prefill in chunks of 16: no 32-token bucket to compile
    "block_size": BLOCK,
    "num_gpu_blocks_override": 40,
    "enforce_eager": True,
}
_DTYPE = ["float32"]  # the engines' dtype now (the module's fixture is parametrized by it)
DECODE = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transfer(role: str, port: int, **extra) -> dict:
    config = {"kv_connector": "JaxConnector", "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": port}
    if extra:
        config["kv_connector_extra_config"] = extra
    return {"kv_transfer_config": config}


def _with_params(params: dict | None, base: SamplingParams = DECODE) -> SamplingParams:
    fields = {k: getattr(base, k) for k in ("max_tokens", "temperature", "logprobs")}
    return SamplingParams(**fields, extra_args=None if params is None else {"kv_transfer_params": params})


def _prompts(seed: int, lengths=(70, 21, 9)) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 101, n).tolist()} for n in lengths]


def _assert_all_free(llm: LLM) -> None:
    manager = llm.engine_core.kv_cache_manager
    assert not manager.req_to_blocks
    assert manager.num_free_blocks == manager.num_usable_blocks


def _metrics(llm: LLM) -> dict:
    llm._step()  # records the engine's stats into its metrics
    return {(m.name, tuple(m.labels.values())): getattr(m, "value", None) for m in llm.get_metrics()}


def _acceptance(llm: LLM) -> list[int]:
    """[draft tokens accepted, proposed] so far."""
    m = _metrics(llm)
    return [m[(f"xlaserve:spec_decode_num_{n}_tokens", ())] for n in ("accepted", "draft")]


def _fetches(llm: LLM) -> tuple[int, int]:
    """(loaded, recomputed): the consumer's fetches so far, by outcome."""
    m = _metrics(llm)
    return tuple(m[("xlaserve:kv_transfer_fetches", (o,))] for o in ("loaded", "recomputed"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("LlamaForCausalLM", seed=7), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request, model_dir):
    """(reference, producer, consumer) of one dtype; the consumer gives up on a chunk after 1 s."""
    args = dict(ENGINE_ARGS, dtype=request.param)
    _DTYPE[0] = request.param
    port = _free_port()
    reference = LLM(model_dir, **args)
    # chunk_blocks=2: the 70-token prompt's 8 blocks travel in four chunks.
    producer = LLM(model_dir, **args, **_transfer("kv_producer", port, chunk_blocks=2))
    consumer = LLM(model_dir, **args, **_transfer("kv_consumer", _free_port(), timeout_s=1.0))
    yield reference, producer, consumer
    for llm in (reference, producer, consumer):
        llm.shutdown()


def _completion(out):
    """Token ids, and in bfloat16 (batch invariance's dtype: README "Batch invariance") every logprob;
    a float32 run's reductions are not batch-invariant, and the consumer's batches differ from the
    reference's (its requests join as their fetches end)."""
    c = out.outputs[0]
    if _DTYPE[0] != "bfloat16":
        return c.token_ids
    return c.token_ids, [{k: v.logprob for k, v in step.items()} for step in c.logprobs]


def test_consumer_decodes_from_the_producers_blocks_like_one_engine(engines):
    reference, producer, consumer = engines
    prompts = _prompts(seed=1)
    expected = [_completion(o) for o in reference.generate(prompts, DECODE, use_tqdm=False)]
    prefilled = producer.generate(
        prompts,
        _with_params({"do_remote_decode": True}, SamplingParams(max_tokens=1, temperature=0.0)),
        use_tqdm=False,
    )
    assert producer.engine_core.runner.kv_connector.server is not None
    params = [o.kv_transfer_params for o in prefilled]
    port = producer.engine_core.config.cache.kv_transfer.kv_port
    for p, o in zip(params, prefilled):
        assert p["do_remote_prefill"] is True and p["remote_request_id"] == o.request_id
        assert p["remote_host"] == "127.0.0.1" and p["remote_port"] == port
    outs = consumer.generate(prompts, [_with_params(p) for p in params], use_tqdm=False)
    got = [_completion(o) for o in outs]
    assert got == expected  # token for token (and in bfloat16 every logprob, bit for bit)
    # Every full block before the last prompt token came from the producer.
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [(n - 1) // BLOCK * BLOCK for n in lengths]
    assert _fetches(consumer) == (3, 0)
    num_bytes = sum((n - 1) // BLOCK for n in lengths) * consumer.engine_core.executor.kv_bytes_per_block
    sent, got = _metrics(producer), _metrics(consumer)
    assert got[("xlaserve:external_prefix_cache_hits", ())] == sum(o.num_cached_tokens for o in outs)
    assert got[("xlaserve:kv_transfer_total_bytes", ("fetched",))] == num_bytes
    assert got[("xlaserve:kv_transfer_total_bytes", ("loaded",))] == num_bytes
    assert sent[("xlaserve:kv_transfer_total_bytes", ("sent",))] == num_bytes
    assert len(producer.engine_core.runner.kv_connector.server) == 0  # fetched: the copies are freed
    for llm in engines:
        _assert_all_free(llm)


def _assert_the_consumer_decodes(producer, consumer, prompts, greedy, expected) -> None:
    """The producer prefills `prompts` (60 and 33 tokens) for the consumer, which fetches their whole
    blocks (7 and 4) and decodes the `expected` token ids."""
    prefilled = producer.generate(
        prompts, _with_params({"do_remote_decode": True}, SamplingParams(max_tokens=1)), use_tqdm=False
    )
    params = [_with_params(o.kv_transfer_params, greedy) for o in prefilled]
    outs = consumer.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [56, 32]
    assert _fetches(consumer) == (2, 0)


def test_a_draft_models_cache_crosses_with_the_blocks(model_dir):
    """Producer and consumer with a draft model (the target as its own): a block crosses with the draft
    cache's rows too (worker/kv_plumbing.py `moved_kv_cache`), so the consumer decodes the tokens one
    engine with the draft does, accepting every greedy draft as it does. A consumer whose draft rows
    of the fetched blocks stayed empty would reject some, without changing the tokens."""
    args = dict(
        ENGINE_ARGS,
        dtype="float32",
        speculative_config={"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3},
    )
    port = _free_port()
    reference = LLM(model_dir, **args)
    producer = LLM(model_dir, **args, **_transfer("kv_producer", port))
    consumer = LLM(model_dir, **args, **_transfer("kv_consumer", _free_port()))
    prompts = _prompts(seed=2, lengths=(60, 33))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    _assert_the_consumer_decodes(producer, consumer, prompts, greedy, expected)
    acceptance = [_acceptance(llm) for llm in (reference, consumer)]
    assert acceptance[0] == acceptance[1] and acceptance[1][0] == acceptance[1][1] > 0, acceptance
    for llm in (reference, producer, consumer):
        _assert_all_free(llm)
        llm.shutdown()


def test_an_mtp_layers_cache_crosses_with_the_blocks(tmp_path):
    """The same for an MTP layer (a tiny random DeepSeek-V3's, its drafts rejected: the drafts
    themselves are compared too). In bfloat16 (batch invariance) the consumer decodes the tokens, and
    proposes every draft, the producer did computing the prompts alone (before its prefix cache was
    reset and it prefilled them for the consumer); MTP rows of the fetched blocks left empty would
    change the drafts."""
    path, *_ = save_deepseek_v3_with_mtp(str(tmp_path))
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    args = dict(ENGINE_ARGS, dtype="bfloat16", speculative_config=spec)
    producer = LLM(path, **args, **_transfer("kv_producer", _free_port()))
    consumer = LLM(path, **args, **_transfer("kv_consumer", _free_port()))
    drafts = [record_drafts(llm) for llm in (producer, consumer)]
    prompts = _prompts(seed=3, lengths=(60, 33))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in producer.generate(prompts, greedy, use_tqdm=False)]
    expected_drafts, expected_acceptance = sorted(drafts[0].values()), _acceptance(producer)
    assert producer.reset_prefix_cache()
    _assert_the_consumer_decodes(producer, consumer, prompts, greedy, expected)
    assert len(expected_drafts) == 2 and sorted(drafts[1].values()) == expected_drafts
    assert _acceptance(consumer) == expected_acceptance and expected_acceptance[1] > 0
    for llm in (producer, consumer):
        _assert_all_free(llm)
        llm.shutdown()


class _StallingProducer:
    """A producer's socket that answers the first chunk of anything, then never again."""

    def __init__(self, port: int, block_bytes: list[int], num_blocks: int):
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.block_bytes, self.num_blocks = block_bytes, num_blocks
        self.asked: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.stop = threading.Event()
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            if not self.socket.poll(50):
                continue
            ident, _, _, _, chunk = self.socket.recv_multipart()
            self.asked.append(int(chunk))
            if int(chunk) == 0:
                header = encode_header(status="ok", num_blocks=self.num_blocks, num_chunks=4,
                                       block_size=BLOCK, block_bytes=self.block_bytes)  # fmt: skip
                rows = [np.zeros((2, n), np.uint8).tobytes() for n in self.block_bytes]
                self.socket.send_multipart([ident, header, *rows])

    def close(self):
        self.stop.set()
        self.thread.join()
        self.socket.close()


def test_a_producer_gone_mid_transfer_leaves_the_consumer_computing(engines):
    reference, producer, consumer = engines
    prompt = _prompts(seed=2, lengths=(70,))[0]
    expected = _completion(reference.generate([prompt], DECODE, use_tqdm=False)[0])
    bytes_per_block = consumer.engine_core.executor.kv_bytes_per_block
    port = _free_port()
    stalling = _StallingProducer(port, [bytes_per_block // 2, bytes_per_block // 2], num_blocks=8)
    try:
        params = {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_request_id": "gone",
        }
        out = consumer.generate([prompt], _with_params(params), use_tqdm=False)[0]
    finally:
        stalling.close()
    assert stalling.asked == [0, 1]  # one chunk at a time: the second was asked for, never answered
    assert _completion(out) == expected
    assert out.num_cached_tokens == 0
    assert _fetches(consumer) == (3, 1)  # the first test's three, and this one
    _assert_all_free(consumer)


def test_unknown_requests_and_other_prompts_are_computed_locally(engines):
    reference, producer, consumer = engines
    first, other = _prompts(seed=3, lengths=(40, 40))
    prefilled = producer.generate(
        [first], _with_params({"do_remote_decode": True}, SamplingParams(max_tokens=1)), use_tqdm=False
    )[0]
    params = prefilled.kv_transfer_params
    unknown = dict(params, remote_request_id="never-prefilled")
    expected = [_completion(o) for o in reference.generate([other, first], DECODE, use_tqdm=False)]
    # Another prompt under the first's id: the digest differs, the producer refuses it.
    outs = consumer.generate([other, first], [_with_params(params), _with_params(unknown)], use_tqdm=False)
    assert [_completion(o) for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert _fetches(consumer) == (3, 3)
    # Malformed requests to the block server are answered as errors; it keeps serving.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{params['remote_port']}")
    for frames in (
        [b"get", b"x"],
        [b"put", b"a", b"b", b"0"],
        [b"get", b"a", b"b", b"zero"],
        [b"get", b"\xff", b"b", b"0"],
        [b"get", b"a", b"b", b"0", b"-1"],  # a first block (the blocks the consumer holds) below 0
    ):
        dealer.send_multipart(frames)
        assert dealer.poll(5000)
        header = decode_header(dealer.recv_multipart()[0])
        assert header["status"] == "error" and header["error"].startswith("malformed request")
    dealer.close()
    # The producer still holds the first prompt's blocks (a mismatch frees nothing): asked for them now,
    # it answers (a fetch of a freed copy would fail, and count as recomputed). The consumer computed
    # that prompt just before, so it holds all 4 blocks: it fetches none, and the copy is released.
    out = consumer.generate([first], _with_params(params), use_tqdm=False)[0]
    assert _completion(out) == expected[1] and out.num_cached_tokens == 32
    assert _fetches(consumer) == (3, 3)
    assert _metrics(consumer)[("xlaserve:kv_transfer_fetches", ("cached",))] == 1
    assert len(producer.engine_core.runner.kv_connector.server) == 0
    _assert_all_free(consumer)


def test_n_samples_share_one_fetch(engines):
    """An n > 1 request's samples share its prompt's one fetch: the first child fetches the blocks, its
    siblings follow it into the scheduler and hit them in the prefix cache (a producer serves a prompt's
    blocks once: a second fetch would find none and compute the prompt again)."""
    reference, producer, consumer = engines
    (prompt,) = _prompts(seed=4, lengths=(50,))
    expected = _completion(reference.generate([prompt], DECODE, use_tqdm=False)[0])
    prefilled = producer.generate(
        [prompt], _with_params({"do_remote_decode": True}, SamplingParams(max_tokens=1)), use_tqdm=False
    )[0]
    before = _fetches(consumer)
    params = SamplingParams(
        n=3,
        max_tokens=6,
        top_k=1,  # greedy, but sampled: n > 1 at temperature 0 is refused (vLLM's)
        logprobs=2,
        extra_args={"kv_transfer_params": prefilled.kv_transfer_params},
    )
    out = consumer.generate([prompt], params, use_tqdm=False)[0]
    samples = [(c.token_ids, [{k: v.logprob for k, v in s.items()} for s in c.logprobs]) for c in out.outputs]
    assert [s if _DTYPE[0] == "bfloat16" else s[0] for s in samples] == [expected] * 3
    assert out.num_cached_tokens == (50 - 1) // BLOCK * BLOCK
    loaded, recomputed = _fetches(consumer)
    assert (loaded - before[0], recomputed - before[1]) == (1, 0)  # one fetch, none failed
    assert len(producer.engine_core.runner.kv_connector.server) == 0
    assert not consumer.engine_core.remote_prefills._siblings
    _assert_all_free(consumer)


def test_settings_and_params_are_checked(model_dir):
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role must be one of"):
        EngineConfig.from_kwargs(kv_transfer_config={"kv_role": "kv_sender"})
    with pytest.raises(ValueError, match=r"kv_transfer_config: unknown field\(s\) \['kv_buffer'\]"):
        EngineConfig.from_kwargs(kv_transfer_config={"kv_role": "kv_both", "kv_buffer": 1})
    with pytest.raises(ValueError, match="kv_transfer_config.kv_port must be in"):
        EngineConfig.from_kwargs(kv_transfer_config='{"kv_role": "kv_both", "kv_port": 70000}')
    with pytest.raises(ValueError, match="kv_connector_extra_config.timeout_s must be in"):
        EngineConfig.from_kwargs(
            kv_transfer_config={"kv_role": "kv_both", "kv_connector_extra_config": {"timeout_s": 0}}
        )
    # Data-parallel ranks: rank r's producer serves on kv_port + r; the ports must fit below 65536.
    dp = EngineConfig.from_kwargs(
        kv_transfer_config={"kv_role": "kv_both", "kv_port": 65533}, data_parallel_size=3
    )
    rank2 = dataclasses.replace(dp, parallel=dataclasses.replace(dp.parallel, data_parallel_rank=2))
    assert (dp.kv_transfer.kv_port, rank2.kv_transfer.kv_port) == (65533, 65535)
    with pytest.raises(
        ValueError, match="kv_port=65535: a producer with data_parallel_size=2 .* at most 65534"
    ):
        EngineConfig.from_kwargs(
            kv_transfer_config={"kv_role": "kv_producer", "kv_port": 65535}, data_parallel_size=2
        )
    consumer = EngineConfig.from_kwargs(  # serves nothing: no range to fit
        kv_transfer_config={"kv_role": "kv_consumer", "kv_port": 65535}, data_parallel_size=2
    )
    assert consumer.kv_transfer.kv_port == 65535
    # With host offload (tests/engine/test_disagg_offload.py): what either refuses still names its field.
    both = {"kv_transfer_config": {"kv_role": "kv_both"}, "kv_offloading_size": 1}
    assert EngineConfig.from_kwargs(**both).cache.kv_offloading_size == 1
    with pytest.raises(ValueError, match="kv_offloading_size needs enable_prefix_caching"):
        EngineConfig.from_kwargs(**both, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size runs on one host"):
        EngineConfig.from_kwargs(**both, nnodes=2, master_addr="127.0.0.1")
    with pytest.raises(ValueError, match="kv_transfer_params.remote_port must be in"):
        _with_params(
            {"do_remote_prefill": True, "remote_host": "h", "remote_port": 0, "remote_request_id": "r"}
        )
    with pytest.raises(ValueError, match="kv_transfer_params.remote_host must be"):
        _with_params({"do_remote_prefill": True, "remote_port": 1, "remote_request_id": "r"})
    with pytest.raises(ValueError, match="do_remote_decode needs n=1"):
        SamplingParams(n=2, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(ValueError, match="kv_transfer_params.do_remote_decode must be a bool"):
        SamplingParams(extra_args={"kv_transfer_params": {"do_remote_decode": "yes"}})
    # A port another producer holds: refused at start, naming the fields.
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    port = _free_port()
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(
            ValueError, match=r"cannot serve KV blocks on tcp://127.0.0.1:\d+ \(kv_ip, kv_port\)"
        ):
            LLM(model_dir, **dict(ENGINE_ARGS, dtype="float32"), **_transfer("kv_producer", port))
    finally:
        holder.close(linger=0)
    assert decode_header(encode_header(status="ok")) == {"status": "ok"}
