"""RouterPolicy (routing/policy.py): which E, P and D (or mixed) instance serves a request. No Ray."""

from __future__ import annotations

import pytest

from pdcluster.routing.policy import Load, Plan, RouterConfig, RouterPolicy, block_hashes

BLOCK = 4  # tokens per block in these tests: prompts stay short


def make_policy(
    num_prefill: int = 2,
    num_decode: int = 2,
    num_mixed: int = 0,
    num_encoder: int = 0,
    **config,
) -> RouterPolicy:
    """Instances are named P0.., D0.., M0.., E0..; config overrides RouterConfig fields."""
    roles = {}
    for prefix, role, count in (
        ("E", "encoder", num_encoder),
        ("P", "prefill", num_prefill),
        ("D", "decode", num_decode),
        ("M", "mixed", num_mixed),
    ):
        roles.update({f"{prefix}{i}": role for i in range(count)})
    return RouterPolicy(roles, RouterConfig(block_size=BLOCK, **config))


def prompt(num_tokens: int, first: int = 1000) -> list[int]:
    """A prompt no other test prompt shares a block with unless `first` is shared."""
    return list(range(first, first + num_tokens))


def image(offset: int, end: int, mm_hash: str) -> tuple[int, int, str]:
    return (offset, end, mm_hash)


# ---- least loaded ------------------------------------------------------------------------


def test_prefill_goes_to_least_queued_prefill_tokens():
    policy = make_policy()
    policy.on_prefill_start("P0", prompt(100, first=0), images=())
    assert policy.plan(prompt(20)).prefill_id == "P1"

    policy.on_prefill_start("P1", prompt(300, first=5000))
    assert policy.plan(prompt(20)).prefill_id == "P0"

    policy.on_prefill_end("P1", 300)
    policy.on_prefill_end("P0", 100)
    assert policy.instances["P0"].queued_prefill_tokens == 0
    assert policy.instances["P1"].num_active == 0


def test_decode_goes_to_least_kv_tokens():
    policy = make_policy()
    policy.on_decode_start("D0", prompt(10, first=0), max_tokens=100)
    assert policy.plan(prompt(20)).decode_id == "D1"

    policy.on_decode_start("D1", prompt(10, first=5000), max_tokens=500)
    assert policy.plan(prompt(20)).decode_id == "D0"

    policy.on_decode_end("D1", 510)
    assert policy.plan(prompt(20)).decode_id == "D1"
    assert policy.instances["D1"].kv_tokens == 0


def test_plan_alone_changes_no_load():
    policy = make_policy()
    plans = {policy.plan(prompt(64)) for _ in range(3)}
    assert plans == {Plan(None, "P0", "D0")}


# ---- prefix-aware prefill choice ---------------------------------------------------------


def test_prefill_prefers_instance_with_prefix_within_slack():
    policy = make_policy(prefix_slack_tokens=100)
    shared = prompt(32)
    policy.on_prefill_start("P0", shared)  # P0 now caches the prefix and queues 32 tokens
    assert policy.plan(shared + prompt(8, first=9000)).prefill_id == "P0"


def test_least_loaded_wins_beyond_prefix_slack():
    policy = make_policy(prefix_slack_tokens=16)
    shared = prompt(32)
    policy.on_prefill_start("P0", shared)  # 32 queued tokens > 16 of slack
    assert policy.plan(shared + prompt(8, first=9000)).prefill_id == "P1"

    policy.on_prefill_end("P0", 32)  # queue drained, prefix still cached
    assert policy.plan(shared + prompt(8, first=9000)).prefill_id == "P0"


def test_longer_cached_prefix_is_preferred():
    policy = make_policy(num_prefill=3)
    policy.on_prefill_start("P0", prompt(8))
    policy.on_prefill_start("P1", prompt(24))
    assert policy.plan(prompt(32)).prefill_id == "P1"


def test_equal_prefixes_go_to_the_less_loaded():
    policy = make_policy()
    system = prompt(16)
    policy.on_prefill_start("P0", system + prompt(40, first=7000))
    policy.on_prefill_start("P1", system)
    assert policy.plan(system + prompt(8, first=9000)).prefill_id == "P1"


def test_prefix_unaware_routing_ignores_cache():
    policy = make_policy(prefix_aware=False)
    policy.on_prefill_start("P0", prompt(32))
    assert policy.plan(prompt(32)).prefill_id == "P1"


def test_partial_block_is_no_prefix():
    policy = make_policy()
    policy.on_prefill_start("P0", prompt(BLOCK - 1))
    assert policy.plan(prompt(BLOCK - 1)).prefill_id == "P1"


# ---- images ------------------------------------------------------------------------------


def test_same_tokens_different_image_is_no_prefix_match():
    policy = make_policy()
    tokens = prompt(32)
    policy.on_prefill_start("P0", tokens, [image(0, 16, "cat")])
    assert policy.plan(tokens, [image(0, 16, "dog")]).prefill_id == "P1"
    assert policy.plan(tokens, [image(0, 16, "cat")]).prefill_id == "P0"
    assert policy.plan(tokens).prefill_id == "P1"


def test_image_changes_only_the_blocks_it_overlaps():
    tokens = prompt(16)
    cat = block_hashes(tokens, BLOCK, [image(8, 12, "cat")])
    dog = block_hashes(tokens, BLOCK, [image(8, 12, "dog")])
    assert cat[:2] == dog[:2]  # blocks before the image are shared
    assert all(c != d for c, d in zip(cat[2:], dog[2:]))  # the image's block and all after


# ---- conditional disaggregation ----------------------------------------------------------


def test_short_prompts_are_prefilled_on_decode():
    policy = make_policy(disagg_min_prompt_tokens=32)
    short, long = policy.plan(prompt(31)), policy.plan(prompt(32))
    assert short == Plan(None, None, "D0") and not short.disaggregated
    assert long == Plan(None, "P0", "D0") and long.disaggregated


def test_zero_min_prompt_tokens_always_disaggregates():
    assert make_policy().plan(prompt(1)).disaggregated


@pytest.mark.parametrize(
    ("fraction", "num_new_tokens", "on_decode"),
    [
        (0.8, 8, True),  # 32 of 40 tokens cached on D: 0.8
        (0.8, 12, False),  # 32 of 44: below 0.8
        (1.0, 0, False),  # 1.0: never, even for a fully cached prompt
    ],
)
def test_prompt_mostly_cached_on_decode_is_prefilled_there(fraction, num_new_tokens, on_decode):
    policy = make_policy(num_decode=1, decode_prefix_fraction=fraction)
    history = prompt(32)
    policy.on_decode_start("D0", history, max_tokens=16)
    plan = policy.plan(history + prompt(num_new_tokens, first=9000))
    assert plan.decode_id == "D0"
    assert plan.disaggregated is not on_decode


# ---- fallbacks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topology", "serving"),
    [
        ({"num_decode": 0, "num_mixed": 1}, "M0"),  # no D: mixed
        ({"num_prefill": 0, "num_mixed": 1}, "M0"),  # no P: mixed
        ({"num_decode": 0}, "P0"),  # no D, no mixed: P serves colocated
        ({"num_prefill": 0}, "D0"),  # no P, no mixed: D serves colocated
        ({"num_prefill": 0, "num_decode": 0, "num_mixed": 2}, "M0"),
    ],
)
def test_missing_role_falls_back_to_colocated(topology, serving):
    plan = make_policy(**topology).plan(prompt(32))
    assert plan == Plan(None, None, serving)


def test_colocated_fallback_balances_by_kv_tokens():
    policy = make_policy(num_prefill=0, num_decode=0, num_mixed=2)
    policy.on_decode_start("M0", prompt(32, first=0), max_tokens=64)
    assert policy.plan(prompt(32)).decode_id == "M1"


def test_dead_decode_role_falls_back_to_mixed():
    policy = make_policy(num_decode=1, num_mixed=1)
    policy.mark_dead("D0")
    assert policy.plan(prompt(32)) == Plan(None, None, "M0")


def test_no_live_instance_raises():
    policy = make_policy(num_prefill=1, num_decode=1, num_encoder=1)
    policy.mark_dead("P0")
    policy.mark_dead("D0")
    with pytest.raises(RuntimeError, match="no live instance"):
        policy.plan(prompt(32))


# ---- encoder -----------------------------------------------------------------------------


def test_encoder_only_for_image_requests():
    policy = make_policy(num_encoder=1)
    assert policy.plan(prompt(32)).encoder_id is None
    assert policy.plan(prompt(32), [image(4, 20, "cat")]).encoder_id == "E0"


def test_no_encoder_without_live_encoder():
    assert make_policy().plan(prompt(32), [image(4, 20, "cat")]).encoder_id is None

    policy = make_policy(num_encoder=1)
    policy.mark_dead("E0")
    plan = policy.plan(prompt(32), [image(4, 20, "cat")])
    assert plan.encoder_id is None and plan.prefill_id == "P0"


@pytest.mark.parametrize(
    "topology",
    [
        {"disagg_min_prompt_tokens": 64},  # prefilled on D
        {"num_prefill": 0, "num_decode": 0, "num_mixed": 1},  # colocated on mixed
    ],
)
def test_encoder_serves_colocated_image_requests(topology):
    plan = make_policy(num_encoder=1, **topology).plan(prompt(32), [image(4, 20, "cat")])
    assert plan.encoder_id == "E0" and not plan.disaggregated


# ---- health ------------------------------------------------------------------------------


def test_dead_instance_is_never_chosen():
    policy = make_policy()
    policy.on_prefill_start("P1", prompt(500, first=0))
    policy.on_decode_start("D1", prompt(500, first=0), max_tokens=500)
    policy.on_prefill_start("P0", prompt(32))  # P0 also caches the next prompt's prefix
    policy.mark_dead("P0")
    policy.mark_dead("D0")
    assert policy.plan(prompt(32)) == Plan(None, "P1", "D1")

    policy.mark_alive("P0")
    policy.mark_alive("D0")
    assert policy.plan(prompt(40, first=50_000)) == Plan(None, "P0", "D0")


def test_a_late_instance_gets_requests_only_when_every_instance_of_its_role_is_late():
    policy = make_policy()  # P0, P1, D0, D1, all idle
    policy.on_prefill_start("P1", prompt(500, first=0))
    policy.on_decode_start("D1", prompt(500, first=0), max_tokens=500)
    policy.mark_late("P0")
    policy.mark_late("D0")
    assert policy.plan(prompt(32)) == Plan(None, "P1", "D1")  # loaded, but answering

    policy.mark_late("P1")
    policy.mark_late("D1")
    assert policy.plan(prompt(32)) == Plan(None, "P0", "D0")  # all late: still served

    policy.mark_alive("P1")  # a pull answered: in time again
    assert policy.plan(prompt(32)).prefill_id == "P1"


def test_mark_dead_forgets_cached_prefixes():
    policy = make_policy()
    shared = prompt(32)
    policy.on_prefill_start("P0", shared)
    policy.mark_dead("P0")
    policy.mark_alive("P0")  # a restarted instance: its cache is empty
    assert policy.plan(shared).prefill_id == "P1"


# ---- bounded memory ----------------------------------------------------------------------


def test_tracked_blocks_are_bounded_and_keep_the_leading_blocks():
    policy = make_policy(max_tracked_blocks=4)
    long = prompt(6 * BLOCK)
    policy.on_prefill_start("P0", long)
    assert len(policy.instances["P0"].cached_blocks) == 4
    assert policy.plan(long).prefill_id == "P0"  # its first blocks are still known


def test_least_recently_seen_prefix_is_forgotten_first():
    policy = make_policy(max_tracked_blocks=4)
    old, recent, newest = (prompt(2 * BLOCK, first=f) for f in (0, 5000, 9000))
    for seen in (old, recent, old, newest):  # `old` seen again, then `newest` evicts `recent`
        policy.on_prefill_start("P0", seen)
    # P0 is busier than P1 but within the slack: only a cached prefix draws a request to it.
    assert policy.plan(old).prefill_id == "P0"
    assert policy.plan(newest).prefill_id == "P0"
    assert policy.plan(recent).prefill_id == "P1"


def test_encoders_are_balanced_by_active_encodes():
    policy = make_policy(num_prefill=1, num_decode=1, num_encoder=2)
    images = [image(0, 4, "cat")]
    first = policy.plan(prompt(8), images).encoder_id
    policy.on_encode_start(first)
    second = policy.plan(prompt(8), images).encoder_id
    assert second != first
    policy.on_encode_end(first)
    assert policy.instances[first].num_active == 0


def test_min_kv_tokens_is_the_smallest_reported_healthy_pool_of_the_roles():
    policy = make_policy(num_prefill=1)
    assert policy.min_kv_tokens(["decode"]) is None  # nothing reported yet
    policy.apply_report("P0", Load(), num_blocks_total=10)
    policy.apply_report("D0", Load(), num_blocks_total=100)
    policy.apply_report("D1", Load(), num_blocks_total=40)
    assert policy.min_kv_tokens(["decode"]) == 40 * BLOCK
    policy.mark_dead("D1")
    assert policy.min_kv_tokens(["decode"]) == 100 * BLOCK
    assert policy.min_kv_tokens(["prefill", "decode"]) == 10 * BLOCK


# ---- LoRA adapters -----------------------------------------------------------------------


def test_a_request_goes_where_its_adapter_is_resident_within_the_slack():
    policy = make_policy(prefix_slack_tokens=100)
    for iid in ("P0", "D0"):
        policy.apply_report(iid, Load(), adapters=["sql"])
    policy.on_prefill_start("P0", prompt(60, first=0))  # P0 and D0 busier, within the slack
    policy.on_decode_start("D0", prompt(10, first=0), max_tokens=50)
    plan = policy.plan(prompt(20), lora_name="sql")
    assert (plan.prefill_id, plan.decode_id) == ("P0", "D0")
    assert policy.plan(prompt(20)).prefill_id == "P1"  # the base model: least loaded
    assert policy.plan(prompt(20), lora_name="chat").prefill_id == "P1"  # held nowhere

    policy.on_prefill_start("P0", prompt(200, first=5000))  # beyond the slack now
    assert policy.plan(prompt(20), lora_name="sql").prefill_id == "P1"


def test_a_planned_adapter_counts_as_held_until_the_next_report():
    policy = make_policy(num_prefill=0, num_decode=0, num_mixed=2)
    first = policy.plan(prompt(8), lora_name="sql").decode_id
    assert "sql" in policy.instances[first].adapters
    policy.on_decode_start(first, prompt(8), max_tokens=4)  # more loaded, within the slack
    assert policy.plan(prompt(8), lora_name="sql").decode_id == first
    policy.apply_report(first, Load(), adapters=[])  # it evicted the adapter
    assert "sql" not in policy.instances[first].adapters
