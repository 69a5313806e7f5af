"""KV cache offload to host memory and disk (issue 35) on a tiny random Llama: a prefix the device cache
evicted comes back from the host tier (or, evicted from there too, from the disk tier) with the same
tokens (and logprobs, bit for bit), counted in num_cached_tokens; cache salts keep tenants apart; no
block leaks; bad sizes and paths are refused."""

from __future__ import annotations

import argparse
import itertools
import os
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import vllm_kv_events
from helpers.eagle3_cases import save_random_eagle3
from helpers.family_cases import make_hf_model, save_hf_model
from helpers.mtp_cases import record_drafts, save_deepseek_v3_with_mtp
from xlaserve import LLM, SamplingParams
from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_manager import PrefixCacheStats
from xlaserve.core.kv_connector import KVTransferStats
from xlaserve.core.kv_offload import OffloadingConnectorScheduler, persistent_tier_dir
from xlaserve.core.outputs import SchedulerStats
from xlaserve.core.request import Request
from xlaserve.engine.metrics import EngineMetrics
from xlaserve.entrypoints.arg_utils import add_engine_args, engine_kwargs
from xlaserve.entrypoints.serving.metrics import make_registry, render

BLOCK = 8
# 11 usable blocks of 8 tokens: three 40-token prompts (6 blocks each with their outputs) cannot all
# stay cached, so the third evicts the first.
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 64,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 16,
    "block_size": BLOCK,
    "num_gpu_blocks_override": 12,
    "enforce_eager": True,
}
OFFLOAD_GIB = 2**-10  # 1 MiB: 227 blocks of this model's 4608 bytes
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("LlamaForCausalLM", seed=5), tmp_path_factory.mktemp("llama"))


def _prompts(seed: int, num: int = 3, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 101, length).tolist() for _ in range(num)]


def _run(llm: LLM, prompt: list[int], salt: str | None = None, logprobs: int | None = None):
    """One greedy request alone through the engine core: (token ids, logprobs, num_cached_tokens)."""
    core = llm.engine_core
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=logprobs)
    core.add_request(Request(f"r{next(_request_ids)}", prompt, params, cache_salt=salt))
    ids, lps, cached = [], [], 0
    while core.has_unfinished_requests():
        for out in core.step():
            ids += out.new_token_ids
            lps += out.new_logprobs or []
            cached = max(cached, out.num_cached_tokens)
    while core._in_flight:  # the last step's outputs (async scheduling)
        core.step()
    return ids, lps, cached


def _run_together(llm: LLM, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Every prompt at once (they share prefixes, evict each other's blocks and preempt)."""
    core = llm.engine_core
    ids = {}
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"t{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0)))
        ids[f"t{i}"] = []
    while core.has_unfinished_requests() or core._in_flight:
        for out in core.step():
            ids[out.request_id] += out.new_token_ids
    return ids


def _sequence(llm: LLM, prompts, salt=None, logprobs=None):
    """A, B, C (C evicts A from the device cache), then A again."""
    return [_run(llm, p, salt, logprobs) for p in [*prompts, prompts[0]]]


def _assert_all_free(llm: LLM) -> None:
    manager = llm.engine_core.kv_cache_manager
    assert not manager.req_to_blocks
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_evicted_prefix_comes_back_from_the_host_tier(model_dir):
    prompts = _prompts(seed=1)
    off = LLM(model_dir, **ENGINE_ARGS)
    baseline = _sequence(off, prompts)
    assert baseline[3][2] == 0, "the device cache should have evicted the first prompt"
    on = LLM(model_dir, kv_offloading_size=OFFLOAD_GIB, **ENGINE_ARGS)
    results = _sequence(on, prompts)
    assert [r[0] for r in results] == [r[0] for r in baseline]
    # Four whole blocks come back (the last prompt token is always computed).
    assert results[3][2] == 32
    _assert_all_free(on)
    on._step()  # records the engine's stats into its metrics
    metrics = _metrics(on)
    assert metrics[("xlaserve:external_prefix_cache_hits", ())] == 32
    assert metrics[("xlaserve:kv_offload_total_bytes", ("host_to_device",))] == 4 * 4608
    assert metrics[("xlaserve:kv_offload_total_bytes", ("device_to_host",))] >= 5 * 4608
    assert metrics[("xlaserve:kv_offload_total_time", ("host_to_device",))] > 0

    # Together: prefixes of the prompts above and new ones, evicting, loading and preempting in flight.
    rng = np.random.default_rng(9)
    mixed = [p[: 16 + 8 * (i % 3)] + rng.integers(3, 101, 9).tolist() for i, p in enumerate(prompts * 2)]
    assert _run_together(on, mixed) == _run_together(off, mixed)
    on._step()
    assert _metrics(on)[("xlaserve:external_prefix_cache_hits", ())] > 32  # loads while others ran
    for llm in (off, on):
        _assert_all_free(llm)
        llm.shutdown()


def test_a_draft_models_cache_moves_with_its_blocks(model_dir):
    """A draft model's cache rides the target's block ids, so its rows of a block leave for the host tier
    and come back with the target's (worker/kv_plumbing.py `moved_kv_cache`). The target as its own
    draft accepts every greedy draft: a reloaded block whose draft rows were left behind (the device
    block since reused by another prompt) would reject some, without changing the tokens."""
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    prompts = _prompts(seed=11)
    off = LLM(model_dir, speculative_config=spec, **ENGINE_ARGS)
    on = LLM(model_dir, speculative_config=spec, kv_offloading_size=OFFLOAD_GIB, **ENGINE_ARGS)
    assert on.engine_core.kv_connector.bytes_per_block == 2 * 4608  # the target's rows and the draft's
    baseline, results = _sequence(off, prompts), _sequence(on, prompts)
    assert [r[0] for r in results] == [r[0] for r in baseline]
    assert baseline[3][2] == 0 and results[3][2] == 32
    acceptance = [_acceptance(llm) for llm in (off, on)]
    assert acceptance[0] == acceptance[1] and acceptance[1][0] == acceptance[1][1] > 0, acceptance
    for llm in (off, on):
        _assert_all_free(llm)
        llm.shutdown()


def test_an_mtp_layers_cache_moves_with_its_blocks(tmp_path):
    """The same for an MTP layer (a tiny DeepSeek-V3's, random: its drafts are rejected, so the drafts
    themselves are compared): in bfloat16 (batch invariance: a token's bits whatever its step) the
    prompt reloaded from the host tier decodes the tokens, proposes every draft and accepts as many as
    an engine that computed it again; MTP rows left behind would change the drafts."""
    path, *_ = save_deepseek_v3_with_mtp(str(tmp_path))
    _assert_drafts_come_back(path, {"method": "mtp", "num_speculative_tokens": 2}, seed=12)


def _assert_drafts_come_back(path: str, spec: dict, seed: int) -> None:
    """bfloat16 engines of `spec` without and with the host tier: A, B, C, then A again from the tier
    decode the same tokens, propose the same drafts (each request's, at each position) and accept as
    many."""
    args = dict(ENGINE_ARGS, dtype="bfloat16", speculative_config=spec)
    prompts = _prompts(seed=seed)
    off, on = LLM(path, **args), LLM(path, kv_offloading_size=OFFLOAD_GIB, **args)
    drafts = [record_drafts(llm) for llm in (off, on)]
    baseline, results = _sequence(off, prompts), _sequence(on, prompts)
    assert [r[0] for r in results] == [r[0] for r in baseline]
    assert baseline[3][2] == 0 and results[3][2] == 32
    expected, got = (list(d.values()) for d in drafts)
    assert len(got) == 4 and len(got[3]) >= 2 and got == expected
    acceptance = [_acceptance(llm) for llm in (off, on)]
    assert acceptance[0] == acceptance[1] and acceptance[1][1] > 0, acceptance
    for llm in (off, on):
        _assert_all_free(llm)
        llm.shutdown()


def test_an_eagle3_drafters_cache_moves_with_its_blocks(model_dir, tmp_path):
    """The same for an EAGLE-3 drafter (a random checkpoint's layer: helpers/eagle3_cases.py), its K/V
    riding the target's blocks: in bfloat16 the prompt reloaded from the host tier decodes the tokens,
    proposes every draft and accepts as many as an engine that computed it again; the drafter's rows
    left behind would change its drafts."""
    path, _ = save_random_eagle3(tmp_path / "eagle3")
    _assert_drafts_come_back(model_dir, {"method": "eagle3", "model": path, "num_speculative_tokens": 2}, 13)


def test_a_persistent_tier_is_kept_apart_from_an_engine_with_another_drafter(model_dir, tmp_path):
    """A tier's blocks hold a drafter's rows too: an engine with a draft model (or another one, or an
    MTP layer) names another directory than one without, so neither reads the other's files (it starts
    with an empty tier, and says so)."""
    args = dict(kv_offloading_size=1, kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_persist=True)
    draft = {"method": "draft_model", "num_speculative_tokens": 2}
    configs = [
        EngineConfig.from_kwargs(model=str(model_dir), **args),
        EngineConfig.from_kwargs(
            model=str(model_dir), speculative_config={**draft, "model": str(model_dir)}, **args
        ),
        EngineConfig.from_kwargs(
            model=str(model_dir), speculative_config={**draft, "model": str(tmp_path)}, **args
        ),
        EngineConfig.from_kwargs(
            model=str(model_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **args
        ),
        EngineConfig.from_kwargs(
            model=str(model_dir), speculative_config={**draft, "method": "ngram"}, **args
        ),
    ]
    dirs = [persistent_tier_dir(c, 4608) for c in configs]
    assert len(set(dirs[:4])) == 4
    assert dirs[4] == dirs[0]  # n-gram drafts from the prompt: no cache of its own


def _recorded_plans(connector) -> list[tuple[int, int, list[bytes], set[bytes]]]:
    """From now on, each step's (blocks evicted, host slots free of its loads, hashes saved, hashes
    loaded from the host), asserting that no plan names a slot twice."""
    plans, build = [], connector.build_connector_meta

    def recorded(scheduled):
        index = connector.index
        num_evicted, room = len(connector._evicted), index.num_blocks - len(index.pinned)
        meta = build(scheduled)
        if meta is not None:
            for targets in (
                meta.save_slots,
                meta.demote_disk_slots,
                meta.load_block_ids,
                meta.disk_load_block_ids,
            ):
                assert len(set(targets.tolist())) == len(targets), meta
            hashes = {slot: block_hash for block_hash, slot in index.slot_of.items()}
            saved = [hashes[slot] for slot in meta.save_slots.tolist()]
            plans.append((num_evicted, room, saved, {hashes[slot] for slot in meta.load_slots.tolist()}))
        return meta

    connector.build_connector_meta = recorded
    return plans


def _metrics(llm: LLM) -> dict:
    return {(m.name, tuple(m.labels.values())): getattr(m, "value", None) for m in llm.get_metrics()}


def _acceptance(llm: LLM) -> list[int]:
    """[draft tokens accepted, proposed] so far (a step first records the engine's stats)."""
    llm._step()
    metrics = _metrics(llm)
    return [metrics[(f"xlaserve:spec_decode_num_{n}_tokens", ())] for n in ("accepted", "draft")]


def test_cache_salt_separates_host_tier_tenants(model_dir):
    prompts = _prompts(seed=2)
    llm = LLM(model_dir, kv_offloading_size=OFFLOAD_GIB, **ENGINE_ARGS)
    first = _sequence(llm, prompts, salt="tenant-a")
    assert first[3][2] == 32  # its own tenant's blocks come back
    other = _run(llm, prompts[0], salt="tenant-b")
    assert other[2] == 0  # same tokens, another salt: nothing from either tier
    assert other[0] == first[0][0]
    _assert_all_free(llm)
    llm.shutdown()


def test_host_tier_is_bounded_least_recently_used_out(model_dir):
    # Room for 4 blocks: the 5 evicted blocks of the first prompt leave its first block out.
    size = 4 * 4608 / 2**30
    sub, kv_events = _subscribed()
    llm = LLM(model_dir, kv_offloading_size=size, kv_events_config=kv_events, **ENGINE_ARGS)
    connector = llm.engine_core.kv_connector
    worker = llm.engine_core.runner.kv_connector
    for prompt in _prompts(seed=3, num=6):
        _run(llm, prompt)
    assert len(connector.index) == 4 and connector.index.num_evicted > 0
    assert worker.host_bytes <= size * 2**30
    held = _replay(vllm_kv_events.receive(sub))
    sub.close()
    assert held == _tiers(llm) and held.keys() == {"GPU", "CPU"}
    _assert_all_free(llm)
    llm.shutdown()


def _subscribed() -> tuple[object, dict]:
    """A subscriber to the KV cache events and the kv_events_config that publishes to it (and answers
    replays on its replay_endpoint)."""
    sub, endpoint = vllm_kv_events.subscribe()
    replay = f"tcp://127.0.0.1:{vllm_kv_events.free_port()}"
    return sub, {
        "enable_kv_cache_events": True,
        "endpoint": endpoint,
        "topic": "kv",
        "replay_endpoint": replay,
    }


def _replay(batches: dict[int, bytes], held: dict[str, set[int]] | None = None) -> dict[str, set[int]]:
    """A router's view from the KV cache events (vLLM's structs), per medium: what each tier holds
    (`held`: the view so far). The disk tier's events say it is local and vLLM's file-system tier
    (vLLM main's locality and ownership), the others neither."""
    held = {} if held is None else held
    for seq in sorted(batches):
        for event in vllm_kv_events.DECODER.decode(batches[seq]).events:
            where = ("LOCAL", "fs") if event.medium == "STORAGE" else (None, None)
            assert (event.locality, event.ownership) == where, event
            tier = held.setdefault(event.medium, set())
            if isinstance(event, vllm_kv_events.BlockStored):
                tier.update(event.block_hashes)
            else:
                assert isinstance(event, vllm_kv_events.BlockRemoved)
                tier.difference_update(event.block_hashes)
    return {medium: hashes for medium, hashes in held.items() if hashes}


def _tiers(llm: LLM) -> dict[str, set[int]]:
    """The hashes (as a router sees them) each tier holds, by medium: the device cache's, the host
    tier's, the disk tier's; an empty tier left out."""
    connector = llm.engine_core.kv_connector
    keys = {
        "GPU": [h for h, _ in llm.engine_core.kv_cache_manager.cached_blocks()],
        "CPU": connector.index.slot_of,
        "STORAGE": connector.disk.slot_of if connector.disk is not None else [],
    }
    return {
        medium: {int.from_bytes(h[-8:], "big") for h in hashes} for medium, hashes in keys.items() if hashes
    }


def test_bfloat16_reloaded_blocks_are_bit_identical(model_dir):
    llm = LLM(model_dir, kv_offloading_size=OFFLOAD_GIB, **dict(ENGINE_ARGS, dtype="bfloat16"))
    results = _sequence(llm, _prompts(seed=4), logprobs=2)
    (ids, lps, cached), (ids_again, lps_again, cached_again) = results[0], results[3]
    assert cached == 0 and cached_again == 32
    assert ids_again == ids
    for a, b in zip(lps, lps_again, strict=True):
        assert a == b  # every logprob, bit for bit
    llm.shutdown()


def test_a_prefix_the_host_tier_evicted_comes_back_from_the_disk_tier(model_dir, tmp_path):
    """A host tier of 2 blocks, a disk tier under tmp_path: the first prompt's blocks, evicted from
    the device and then from the host tier, come back from the disk (and the host) with the same
    tokens and logprobs, bit for bit (bfloat16); the tier's files are unlinked once mapped. A step
    that evicts more blocks than the host tier has slots plans no slot twice, counts those it skipped
    (xlaserve:kv_offload_stores_skipped), and what it saved comes back bit for bit too. The KV cache
    events, replayed per medium, leave each tier's hashes (the disk tier's as "STORAGE")."""
    block_bytes = 4608 // 2  # bfloat16
    sub, kv_events = _subscribed()
    llm = LLM(
        model_dir,
        kv_offloading_size=2 * block_bytes / 2**30,
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=64 * block_bytes / 2**30,
        kv_events_config=kv_events,
        **dict(ENGINE_ARGS, dtype="bfloat16"),
    )
    assert llm.engine_core.kv_connector.bytes_per_block == block_bytes
    prompts = _prompts(seed=6)
    results = _sequence(llm, prompts, logprobs=2)
    (ids, lps, cached), (ids_again, lps_again, cached_again) = results[0], results[3]
    assert cached == 0 and cached_again == 32
    assert ids_again == ids and lps_again == lps
    assert os.listdir(tmp_path) == []
    assert llm.engine_core.runner.kv_connector.disk.nbytes == 64 * block_bytes
    llm._step()
    metrics = _metrics(llm)
    disk_hits = metrics[("xlaserve:kv_offload_hits", ("disk",))]
    assert disk_hits > 0 and disk_hits + metrics[("xlaserve:kv_offload_hits", ("host",))] == 32
    assert (
        metrics[("xlaserve:kv_offload_total_bytes", ("disk_to_device",))] == disk_hits // BLOCK * block_bytes
    )
    assert metrics[("xlaserve:kv_offload_total_bytes", ("host_to_disk",))] >= disk_hits // BLOCK * block_bytes
    other = _run(llm, prompts[0], salt="tenant-b")
    assert other[2] == 0  # another tenant's salt: nothing from any tier
    held = _replay(vllm_kv_events.receive(sub))
    assert held == _tiers(llm) and held.keys() == {"GPU", "CPU", "STORAGE"}
    llm._step()
    num_skipped = _metrics(llm)[("xlaserve:kv_offload_stores_skipped", ())]
    # Over-full: the first prompt's four blocks come back from the disk at once, evicting five cached
    # device blocks into the host tier's two slots; each save gets a slot of its own (the last two
    # evicted), and the next step loads both for the second prompt: tokens and logprobs bit for bit.
    plans = _recorded_plans(llm.engine_core.kv_connector)
    again = [_run(llm, p, logprobs=2) for p in (*prompts, *prompts[:2])]
    assert [r[:2] for r in again] == [r[:2] for r in (*results[:3], *results[:2])]
    (step,) = [i for i, (num_evicted, room, _, _) in enumerate(plans) if num_evicted > room > 0]
    saved = plans[step][2]
    assert len(saved) == 2 and plans[step + 1][3] == set(saved) and again[-1][2] == 16
    llm._step()
    assert plans[step][:2] == (5, 2)
    assert _metrics(llm)[("xlaserve:kv_offload_stores_skipped", ())] == num_skipped + 3
    assert _replay(vllm_kv_events.receive(sub), held) == _tiers(llm)
    sub.close()
    _assert_all_free(llm)
    llm.shutdown()


def test_a_persistent_disk_tier_outlives_the_engine(model_dir, tmp_path):
    """kv_offloading_disk_persist: at shutdown the first engine's cached blocks (the device cache's, the
    host tier's) go to the disk tier and its index beside them; a second engine of the same settings on
    the same path serves every prompt's blocks from the disk, tokens and logprobs bit for bit the
    first's (bfloat16). While it runs no index is on disk (an engine that dies keeps nothing)."""
    block_bytes = 4608 // 2  # bfloat16
    args = dict(
        ENGINE_ARGS,
        dtype="bfloat16",
        kv_offloading_size=2 * block_bytes / 2**30,
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=64 * block_bytes / 2**30,
        kv_offloading_disk_persist=True,
    )
    prompts = _prompts(seed=7)
    sub, kv_events = _subscribed()
    first = LLM(model_dir, kv_events_config=kv_events, **args)
    computed = [_run(first, p, logprobs=2) for p in prompts]
    assert [cached for _, _, cached in computed] == [0, 0, 0]
    first.shutdown()
    # The disk tier's last copies are published before the engine goes: a router's view of the tier is
    # the index kept.
    kept = _replay(vllm_kv_events.receive(sub))["STORAGE"]
    sub.close()
    (tier,) = os.listdir(tmp_path)
    assert tier.startswith("xlaserve-kv-")
    assert sorted(os.listdir(tmp_path / tier)) == ["0.kv", "1.kv", "index.npz", "lock"]

    with np.load(tmp_path / tier / "index.npz") as index:
        assert kept == {int.from_bytes(h[-8:].tobytes(), "big") for h in index["hashes"]}
    sub, kv_events = _subscribed()
    second = LLM(model_dir, kv_events_config=kv_events, **args)
    assert not os.path.exists(tmp_path / tier / "index.npz")
    # What it found is published before any request (the first batch goes out as soon as the warm-up
    # is done): a router that joins later sees a first sequence past 0 and asks the replay endpoint for
    # the batches from 0 (vLLM's replay protocol), the start-up batch first.
    assert list(vllm_kv_events.replay(kv_events["replay_endpoint"], 0)) == [0]  # sent, before any step
    late = vllm_kv_events.subscribe_late(kv_events["endpoint"])
    served = [_run(second, p, logprobs=2) for p in prompts]
    assert [r[:2] for r in served] == [r[:2] for r in computed]
    assert [cached for _, _, cached in served] == [32, 32, 32]
    second._step()
    metrics = _metrics(second)
    assert metrics[("xlaserve:kv_offload_hits", ("disk",))] == 96
    assert metrics[("xlaserve:kv_offload_total_bytes", ("disk_to_device",))] == 12 * block_bytes
    live = vllm_kv_events.receive(late)
    assert live and min(live) > 0  # joined after the start-up batch went out
    recovered = vllm_kv_events.replay(kv_events["replay_endpoint"], 0)
    assert recovered.keys() >= set(range(min(live))) and _replay({0: recovered[0]}) == {"STORAGE": kept}
    assert _replay({**recovered, **live}) == _tiers(second)
    _assert_all_free(second)
    second.shutdown()
    for socket in (sub, late):
        socket.close()


def test_disk_tier_settings_are_checked(model_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_disk_path needs kv_offloading_size"):
        EngineConfig.from_kwargs(kv_offloading_disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="kv_offloading_disk_size needs kv_offloading_disk_path"):
        EngineConfig.from_kwargs(kv_offloading_size=1, kv_offloading_disk_size=2)
    with pytest.raises(ValueError, match="kv_offloading_disk_size must be a number of GiB > 0"):
        EngineConfig.from_kwargs(
            kv_offloading_size=1, kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=-1
        )
    config = EngineConfig.from_kwargs(kv_offloading_size=0.5, kv_offloading_disk_path=str(tmp_path))
    assert config.cache.disk_tier_size == 2.0  # four times the host tier's
    with pytest.raises(ValueError, match="kv_offloading_disk_path .* must be a writable directory"):
        LLM(
            model_dir,
            kv_offloading_size=OFFLOAD_GIB,
            kv_offloading_disk_path=str(tmp_path / "missing"),
            **ENGINE_ARGS,
        )
    with pytest.raises(ValueError, match="kv_offloading_disk_size .* is more than the free space"):
        LLM(
            model_dir,
            kv_offloading_size=OFFLOAD_GIB,
            kv_offloading_disk_path=str(tmp_path),
            kv_offloading_disk_size=2.0**40,
            **ENGINE_ARGS,
        )


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_kv_offloading_size_is_refused(value):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig.from_kwargs(kv_offloading_size=value)


def test_kv_offloading_size_needs_what_it_builds_on():
    with pytest.raises(ValueError, match="kv_offloading_size needs enable_prefix_caching"):
        EngineConfig.from_kwargs(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size runs on one host"):
        EngineConfig.from_kwargs(kv_offloading_size=1, nnodes=2, master_addr="127.0.0.1")


def test_the_flag_reads_gib_and_refuses_what_is_not_a_number(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-offloading-size", "0.5"]))
    assert EngineConfig.from_kwargs(**kwargs).cache.kv_offloading_size == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offloading-size", "lots"])
    assert "--kv-offloading-size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB > 0, got -2.0"):
        EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(["--kv-offloading-size", "-2"])))


def test_metrics_reach_prometheus_by_transfer_type():
    metrics = EngineMetrics()
    for _ in range(2):  # counters add up across snapshots
        transfer = KVTransferStats(
            num_queries=40, num_hits=32, bytes_saved=9216, bytes_loaded=4608, load_seconds=0.25, offloaded=1
        )
        metrics.record_scheduler(SchedulerStats(0, 0, 0.0, 0, PrefixCacheStats(), kv_transfer_stats=transfer))
    engine = SimpleNamespace(metrics=metrics)
    text = render(make_registry(engine, "tiny")).decode()
    assert 'xlaserve:external_prefix_cache_hits_total{model_name="tiny"} 64.0' in text
    assert 'xlaserve:external_prefix_cache_queries_total{model_name="tiny"} 80.0' in text
    series = 'xlaserve:kv_offload_total_bytes_total{model_name="tiny",transfer_type="%s"} %s'
    assert series % ("host_to_device", "9216.0") in text
    assert series % ("device_to_host", "18432.0") in text
    assert (
        'xlaserve:kv_offload_total_time_total{model_name="tiny",transfer_type="host_to_device"} 0.5' in text
    )
    assert "kv_offload" not in render(make_registry(SimpleNamespace(metrics=EngineMetrics()), "m")).decode()


def test_demotions_a_step_has_no_disk_slot_for_are_counted():
    """A disk tier of one slot under a host tier of two, two blocks evicted a step: from the second step
    the host tier evicts two blocks a step, the first takes the disk's slot (pinned for the step), the
    second is dropped; each is counted (xlaserve:kv_offload_demotions_skipped{tier="disk"}), and the
    disk tier holds the last one demoted."""
    connector = OffloadingConnectorScheduler(2, BLOCK, bytes_per_block=4608, num_disk_blocks=1)
    metrics = EngineMetrics()
    for step in range(4):
        for block_id in (1, 2):
            connector.on_block_evicted(bytes([step, block_id]) * 16, block_id)
        assert len(connector.build_connector_meta([None]).demote_disk_slots) == min(step, 1)
        transfer = connector.make_stats()
        metrics.record_scheduler(SchedulerStats(0, 0, 0.0, 0, PrefixCacheStats(), kv_transfer_stats=transfer))
    assert list(connector.disk.slot_of) == [bytes([2, 1]) * 16]
    text = render(make_registry(SimpleNamespace(metrics=metrics), "tiny")).decode()
    assert 'xlaserve:kv_offload_demotions_skipped_total{model_name="tiny",tier="disk"} 3.0' in text
    assert 'xlaserve:kv_offload_stores_skipped_total{model_name="tiny"} 0.0' in text
