"""The CPU decode kernel's prefetch requests chosen by timing (csrc/cpu/decode_tune.c): the choice from rounds of
times, the arms each kind of call goes through, the switches timed, and the bits, which no arm may change."""

import threading

import pytest
import torch

import attn_backends as ab
from attn_backends import _C
from attn_backends._testing import decode_amx_rows, decode_bf16_products, decode_tiles

KEYS_NEXT, VALUES_AHEAD, PAGES_AHEAD, PV_KEYS, SCORES_BY_HEAD = 1, 2, 4, 8, 16
ROUNDS, KEEP_CALLS = 4, 512  # csrc/cpu/decode_tune.h AB_TUNE_ROUNDS, AB_TUNE_KEEP_CALLS
SWITCHES = ("KEYS_NEXT", "VALUES_AHEAD", "PAGES_AHEAD", "PV_KEYS", "SCORES_BY_HEAD")


def by_head(dtype, G, D=64, Sq=1):
    """SCORES_BY_HEAD where the kernel can take step 1 head by head (bfloat16 products, G a multiple of four,
    D <= 128), else 0."""
    return SCORES_BY_HEAD if decode_bf16_products(dtype, Sq * G) and G % 4 == 0 and D <= 128 else 0



@pytest.fixture
def unforced(monkeypatch):
    # no prefetch switch forced by the caller's environment (a forced switch is not timed)
    for s in SWITCHES:
        monkeypatch.delenv("ATTN_BACKENDS_DECODE_" + s, raising=False)


@pytest.fixture
def tuner(monkeypatch, unforced):
    # every call timed (the rule times only calls whose caches come from DRAM), no switch forced, and no kind
    # left from an earlier test
    # the rule's own set follows decode's working set (the last 64 calls' caches): 64 calls of a small one
    # first, so that an earlier test's large caches do not leave it in the middle of this one
    monkeypatch.setenv("ATTN_BACKENDS_DECODE_TUNE", "0")
    small = decode_call(torch.Generator().manual_seed(0), B=1, Hq=1, Hkv=1, S=16, D=16)
    for _ in range(64):
        small()
    monkeypatch.setenv("ATTN_BACKENDS_DECODE_TUNE", "1")
    _C.decode_tune_reset()
    yield
    _C.decode_tune_reset()


def decode_call(gen, dtype=torch.float32, Hq=8, Hkv=2, block=None, B=2, S=300, D=64, Sq=1):
    q = torch.randn(B, Sq, Hq, D, generator=gen).to(dtype)
    if block:
        nb = B * -(-S // block)
        k, v = (torch.randn(nb, block, Hkv, D, generator=gen).to(dtype) for _ in range(2))
        table = torch.randperm(nb, generator=gen).view(B, -1).to(torch.int32)
    else:
        k, v = (torch.randn(B, S, Hkv, D, generator=gen).to(dtype) for _ in range(2))
        table = None
    seqlens = torch.tensor([S - 7, S], dtype=torch.int32)[:B]

    def call():
        return ab.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, backend="paged_attention",
                                         strict=True, return_softmax_lse=True)

    return call


def only_kind():
    state = _C.decode_tune_state()
    assert len(state) == 1, state
    return state[0]


# ---- the choice ------------------------------------------------------------------------------------


def test_the_rule_is_kept_when_no_arm_is_faster_by_the_margin():
    assert _C.decode_tune_choose([[1.0, 1.0, 1.0]] * 4, 0.04) == 0
    assert _C.decode_tune_choose([[1.0, 0.97, 1.02]] * 4, 0.04) == 0  # 3% faster: within the margin
    assert _C.decode_tune_choose([[1.0]] * 4, 0.04) == 0  # one arm: nothing to choose


def test_the_arm_faster_in_most_rounds_is_kept():
    assert _C.decode_tune_choose([[1.0, 0.9]] * 4, 0.04) == 1
    # the fastest of several, by the median of its per-round ratios
    assert _C.decode_tune_choose([[1.0, 0.9, 0.8, 0.95]] * 3, 0.04) == 2
    # the rounds compare calls next to each other: a slower memory in round 2 moves every arm alike
    assert _C.decode_tune_choose([[1.0, 0.9], [2.0, 1.8], [1.0, 0.9], [3.0, 2.7]], 0.04) == 1


def test_one_fast_round_does_not_decide():
    # faster in one round of four (a disturbed call of arm 0): the median ratio is 1
    assert _C.decode_tune_choose([[2.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], 0.04) == 0
    # slower in one round of four, faster in the others: kept
    assert _C.decode_tune_choose([[1.0, 2.0], [1.0, 0.9], [1.0, 0.9], [1.0, 0.9]], 0.04) == 1


def test_a_missing_time_skips_its_round():
    assert _C.decode_tune_choose([[1.0, 0.0], [1.0, 0.9], [1.0, 0.9], [0.0, 0.5]], 0.04) == 1
    assert _C.decode_tune_choose([[1.0, 0.0]] * 4, 0.04) == 0  # never timed: never kept


@pytest.mark.parametrize("times", [[], [[1.0, 2.0], [1.0]], [[1.0] * 17], ["x"], 3])
def test_choose_refuses_malformed_times(times):
    with pytest.raises((ValueError, TypeError)):
        _C.decode_tune_choose(times, 0.04)


# ---- the arms a kind of call goes through ------------------------------------------------------------


@pytest.mark.parametrize("dtype,Hq,Hkv,block,free", [
    (torch.float32, 8, 2, None, KEYS_NEXT | PAGES_AHEAD),  # GQA: the values are always asked for
    (torch.float32, 8, 2, 16, KEYS_NEXT | PAGES_AHEAD),
    (torch.bfloat16, 8, 2, None, KEYS_NEXT | PAGES_AHEAD),
    (torch.bfloat16, 8, 2, 16, KEYS_NEXT | PAGES_AHEAD),
    # MHA of one token over float32: every switch, step 3's order too
    (torch.float32, 4, 4, None, KEYS_NEXT | VALUES_AHEAD | PAGES_AHEAD | PV_KEYS),
    # MHA over a 2-byte cache: the next keys are always asked for; step 3's order (with bfloat16 products too)
    (torch.bfloat16, 4, 4, 32, PAGES_AHEAD | PV_KEYS),
])
def test_every_arm_is_timed_then_one_is_kept_with_the_same_bits(dtype, Hq, Hkv, block, free, isa, tuner, gen):
    if dtype == torch.bfloat16 and isa == "avx2":
        free &= ~PV_KEYS  # step 3 takes a bfloat16 cache's value columns by pairs there, head by head
    free |= by_head(dtype, Hq // Hkv)  # step 1's order, with bfloat16 products
    if decode_tiles(dtype, Hq // Hkv, 64):
        free = PAGES_AHEAD  # on tiles only the pages ahead change what a call does (decode_cpu.c tunable)
    call = decode_call(gen, dtype, Hq, Hkv, block)
    want = call()
    arms = 1 << bin(free).count("1")
    for _ in range(arms * ROUNDS + 5):
        out, lse = call()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    kind = only_kind()
    assert kind["free"] == free and kind["arms"] == arms
    assert kind["group"] == Hq // Hkv and kind["block_size"] == (block or 0) and kind["one_token"] == 1
    assert kind["timings"] == 1 and not kind["timing"] and kind["chosen"] in range(arms)
    # the kept set differs from the rule's only in timed switches, and only when an arm other than 0 was kept
    assert (kind["kept"] ^ kind["rule"]) & ~free == 0
    assert (kind["kept"] == kind["rule"]) == (kind["chosen"] == 0)
    assert kind["calls"] == arms * ROUNDS + 6
    # each arm ROUNDS times while timed; the kept one the calls after
    assert [n - (6 if a == kind["chosen"] else 0) for a, n in enumerate(kind["arm_calls"])] == [ROUNDS] * arms


def test_the_arms_are_timed_again_after_the_kept_calls(tuner, gen):
    call = decode_call(gen, B=1, Hq=2, Hkv=1, S=32, D=16)
    for _ in range(2 * ROUNDS):  # GQA float32: two switches, four arms
        call()
    kind = only_kind()
    assert kind["arms"] == 4 and kind["timing"] and kind["timings"] == 0
    for _ in range(2 * ROUNDS + KEEP_CALLS):
        call()
    kind = only_kind()
    assert kind["timings"] == 1 and kind["timing"], "the kept arm's calls are over: timing again"
    for _ in range(4 * ROUNDS):
        call()
    assert only_kind()["timings"] == 2


def test_a_forced_switch_is_not_timed(tuner, monkeypatch, gen):
    monkeypatch.setenv("ATTN_BACKENDS_DECODE_KEYS_NEXT", "1")
    call = decode_call(gen)
    call()
    kind = only_kind()
    assert kind["free"] == PAGES_AHEAD and kind["arms"] == 2 and kind["rule"] & KEYS_NEXT
    monkeypatch.setenv("ATTN_BACKENDS_DECODE_PAGES_AHEAD", "0")
    _C.decode_tune_reset()
    call()
    assert _C.decode_tune_state() == []  # nothing left to time


@pytest.mark.parametrize("dtype,Hq,Hkv,Sq,free", [
    # sixteen query heads per KV head: every tile takes the tiled products, which ask for the next keys
    # whatever the switch says and for no pages: nothing to time (with bfloat16 products the row path)
    (torch.float32, 16, 1, 1, 0),
    (torch.bfloat16, 16, 1, 1, "row path"),
    # four tokens of four heads per KV head: 16 rows a tile, tiled; three tokens: 12 rows, the row path
    (torch.float32, 8, 2, 4, 0),
    (torch.float32, 8, 2, 3, KEYS_NEXT | PAGES_AHEAD),
    # several tokens of float32 MHA: the values are always asked for
    (torch.float32, 4, 4, 2, KEYS_NEXT | PAGES_AHEAD),
    # four tokens of four heads per KV head in bfloat16: where the tiles take them (decode_cpu.c amx_rows), every
    # tile goes through the tiled products on tiles, which switch nothing: nothing to time
    (torch.bfloat16, 8, 2, 4, "tiles of many rows"),
])
def test_only_switches_that_change_the_call_are_timed(dtype, Hq, Hkv, Sq, free, tuner, gen):
    if free == "tiles of many rows":  # else the row path with bfloat16 products, or the tiled products
        bf = decode_bf16_products(dtype, Sq * Hq // Hkv)
        free = 0 if decode_amx_rows(dtype, Hq // Hkv, 64, Sq, positions=200) or not bf else (
            KEYS_NEXT | PAGES_AHEAD | by_head(dtype, Hq // Hkv, Sq=Sq))
    if free == "row path":  # the row path with bfloat16 products, else tiled
        free = (KEYS_NEXT | PAGES_AHEAD | by_head(dtype, Hq // Hkv)) if decode_bf16_products(dtype, Hq // Hkv) else 0
        if decode_tiles(dtype, Hq // Hkv, 64, Sq):
            free = PAGES_AHEAD  # on tiles only the pages ahead change what a call does (decode_cpu.c tunable)
    call = decode_call(gen, dtype, Hq, Hkv, B=1, S=200, Sq=Sq)
    call()
    state = _C.decode_tune_state()
    assert (state[0]["free"] if state else 0) == free


def test_the_least_recently_used_kind_makes_room(tuner, gen):
    # 32 kinds are kept: a 33rd (here 33 block sizes) replaces the one called longest ago
    calls = [decode_call(gen, B=1, S=64, D=16, Hq=2, Hkv=1, block=16 * (i + 1)) for i in range(33)]
    for call in calls[:32]:
        call()
    calls[0]()  # the first block size is now the most recent, the second the least
    calls[32]()
    sizes = sorted(k["block_size"] for k in _C.decode_tune_state())
    assert len(sizes) == 32 and 32 not in sizes and 16 in sizes and 16 * 33 in sizes


def test_kinds_are_kept_apart(tuner, gen):
    calls = [decode_call(gen), decode_call(gen, block=16), decode_call(gen, block=32), decode_call(gen, Hq=4, Hkv=4),
             decode_call(gen, torch.bfloat16)]
    for call in calls:
        call()
    state = _C.decode_tune_state()
    assert len(state) == 5 and all(k["calls"] == 1 for k in state)


def test_off_times_nothing(monkeypatch, unforced, gen):
    monkeypatch.setenv("ATTN_BACKENDS_DECODE_TUNE", "0")
    _C.decode_tune_reset()
    call = decode_call(gen)
    for _ in range(10):
        call()
    assert _C.decode_tune_state() == []


def test_the_rule_times_calls_from_dram(monkeypatch, unforced, gen):
    # without the variable a call is timed when decode's working set passes half the L3 (decode_cpu.c
    # from_dram): caches of more than the L3 together
    monkeypatch.delenv("ATTN_BACKENDS_DECODE_TUNE", raising=False)
    l3 = _C.cpu_features()["l3_bytes"] or 32 << 20
    if l3 > 256 << 20:
        pytest.skip(f"an L3 of {l3 >> 20} MiB: the caches that pass it are too large for a test")
    S = 2048
    per_cache = 2 * 2 * S * 8 * 128 * 4  # B=2, K and V, Hkv=8, D=128, float32
    calls = [decode_call(gen, B=2, Hq=16, Hkv=8, S=S, D=128) for _ in range(-(-l3 // per_cache) + 1)]
    _C.decode_tune_reset()
    for call in calls:
        call()
    assert _C.decode_tune_state() != [], "calls from DRAM are timed"
    monkeypatch.setenv("ATTN_BACKENDS_DECODE_TUNE", "0")
    _C.decode_tune_reset()
    calls[0]()
    assert _C.decode_tune_state() == []


def test_threads_share_the_timings_safely(tuner, gen):
    call = decode_call(gen, B=2, S=200)
    want = call()
    bad = []

    def worker():
        for _ in range(60):
            out, lse = call()
            if not (torch.equal(out, want[0]) and torch.equal(lse, want[1])):
                bad.append(1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    kind = only_kind()
    assert kind["calls"] == 241
    # the first timing gives every arm its ROUNDS calls before any other call (however the threads end)
    assert min(kind["arm_calls"]) >= ROUNDS
