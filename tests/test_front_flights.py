"""Flights and their load accounting (actors/front/flights.py, accounting.py): planning,
the P -> D handoff as the client sees it, moves off lost instances and aborts, with fake
instances. No Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdcluster.actors.front.bridge import Sink
from pdcluster.actors.front.flight import Flight
from pdcluster.actors.front.flights import Flights
from pdcluster.actors.messages import Route, StageTimes
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.routing.policy import Load, Plan, RouterConfig, RouterPolicy

PROMPT = list(range(100, 112))  # 12 tokens, 3 blocks of 4
MAX_TOKENS = 8


@dataclass
class FakeInstances:
    """Records the calls flights make to instances."""

    encoded: list[tuple[str, str]] = field(default_factory=list)
    submitted: list[tuple[str, Request, Route]] = field(default_factory=list)
    aborted: list[tuple[str, list[str]]] = field(default_factory=list)

    def encode(self, instance_id: str, request: Request) -> list[str]:
        self.encoded.append((instance_id, request.request_id))
        return [f"ec-{request.request_id}"]

    def submit(self, instance_id: str, request: Request, route: Route) -> None:
        self.submitted.append((instance_id, request, route))

    def abort(self, instance_id: str, request_ids: list[str]) -> None:
        self.aborted.append((instance_id, list(request_ids)))


@dataclass
class Harness:
    flights: Flights
    instances: FakeInstances
    policy: RouterPolicy
    sent: list[tuple[int, str, list[EngineCoreOutput]]]  # (sink index, client id, batch)
    finished: list[Flight]

    def tokens(self, client_id: str) -> list[int]:
        return [t for _, cid, batch in self.sent if cid == client_id for o in batch
                for t in o.new_token_ids]  # fmt: skip

    def last(self, client_id: str) -> EngineCoreOutput:
        return [o for _, cid, batch in self.sent if cid == client_id for o in batch][-1]


def make(roles: dict[str, str] | None = None, migration_limit: int = 2) -> Harness:
    roles = roles or {"P0": "prefill", "D0": "decode"}
    config = RouterConfig(block_size=4, max_model_len=64, migration_limit=migration_limit)
    policy = RouterPolicy(roles, config)
    instances, sent, finished = FakeInstances(), [], []

    def send(sink: Sink, client_id: str, batch: list[EngineCoreOutput]) -> None:
        sent.append((sink.index, client_id, batch))

    flights = Flights("front-test", policy, config, instances, send, finished.append)
    return Harness(flights, instances, policy, sent, finished)


def request(request_id: str = "r", max_tokens: int = MAX_TOKENS) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, PROMPT, params)


def sink(index: int = 0) -> Sink:
    return Sink(None, None, index)  # the harness's `send` reads only the index


def out(rid: str, *tokens: int, finish: str | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(tokens), new_text="".join(f"<{t}>" for t in tokens),
                            finish_reason=finish, **kw)  # fmt: skip


def own(h: Harness, instance_id: str) -> Load:
    return h.policy.instances[instance_id].own


def assert_unloaded(h: Harness) -> None:
    for iid, load in h.policy.instances.items():
        assert load.own == Load(), iid
    assert all(n == 0 for n in h.flights.accounting.promised.values())


# ---- planning and accounting --------------------------------------------------------------


def test_a_disaggregated_request_goes_to_p_with_its_d_and_counts_on_both():
    h = make()
    h.flights.start([request()], [sink()])
    ((iid, req, route),) = h.instances.submitted
    assert (iid, req.request_id, route) == ("P0", "r", Route("front-test", None, "D0"))
    assert own(h, "P0") == Load(1, len(PROMPT), 0)
    assert own(h, "D0") == Load(1, 0, len(PROMPT) + MAX_TOKENS)  # D's KV is spoken for
    assert h.flights.accounting.num_promised("D0") == 1
    assert len(h.flights) == 1 and h.flights.num_started == 1


def test_a_one_token_request_ends_on_p():
    h = make()
    h.flights.start([request(max_tokens=1)], [sink()])
    ((iid, _, route),) = h.instances.submitted
    assert iid == "P0" and route.decode_id is None
    assert own(h, "P0").kv_tokens == len(PROMPT) + 1 and own(h, "D0") == Load()
    h.flights.dispatch("P0", [out("r", 7, finish="length")])
    assert h.tokens("r") == [7] and len(h.flights) == 0
    assert_unloaded(h)


def test_p_token_then_d_tokens_reach_the_client_and_release_the_accounting():
    h = make()
    h.flights.start([request()], [sink()])
    h.flights.dispatch("P0", [out("r", 1)])
    assert own(h, "P0") == Load() and h.flights.accounting.num_promised("D0") == 0
    assert h.policy.instances["D0"].cached_blocks  # D now holds the prompt
    h.flights.dispatch("P0", [out("r", 99)])  # P is no source any more
    h.flights.dispatch("D0", [out("r", 2, 3), out("r", 4, finish="stop")])
    assert h.tokens("r") == [1, 2, 3, 4] and h.last("r").finish_reason == "stop"
    assert [f.client_id for f in h.finished] == ["r"]
    assert h.finished[0].clock.num_tokens == 4
    assert len(h.flights) == 0
    assert_unloaded(h)


def test_d_outputs_before_p_token_wait_for_it():
    h = make()
    h.flights.start([request()], [sink()])
    h.flights.dispatch("D0", [out("r", 2)])  # D's pull loop outran P's
    assert h.sent == []
    h.flights.dispatch("P0", [out("r", 1)])
    assert h.tokens("r") == [1, 2]


def test_a_group_shares_one_plan_and_a_used_id_is_refused():
    h = make({"P0": "prefill", "P1": "prefill", "D0": "decode", "D1": "decode"})
    h.flights.start([request("a"), request("b")], [sink(0), sink(1)])
    plans = {(i, r.decode_id) for i, _, r in h.instances.submitted}
    assert len(h.instances.submitted) == 2 and len(plans) == 1
    h.flights.start([request("a")], [sink(5)])
    ((index, cid, (error,)),) = h.sent
    assert (index, cid, error.finish_reason) == (5, "a", "error")
    assert "already in use" in error.error and h.flights.num_started == 2


def test_no_live_instance_ends_the_request_unavailable():
    h = make({"D0": "decode"})
    h.policy.mark_dead("D0")
    h.flights.start([request()], [sink()])
    error = h.last("r")
    assert error.finish_reason == "error" and error.unavailable
    assert len(h.flights) == 0 and h.instances.submitted == []


def test_an_encoder_plan_encodes_first_and_releases_e_with_p():
    h = make({"E0": "encoder", "P0": "prefill", "D0": "decode"})
    charge = h.flights.accounting.start(request(), Plan("E0", "P0", "D0"))
    assert charge.encode_on == "E0" and own(h, "E0").num_active == 1
    h.flights.accounting.prefill_ended(charge)
    assert own(h, "E0").num_active == 0 and charge.encode_on is None
    h.flights.accounting.release(charge)
    assert_unloaded(h)


# ---- moves and aborts ---------------------------------------------------------------------


def test_p_lost_before_its_token_replans_the_request_under_a_new_id():
    h = make({"P0": "prefill", "P1": "prefill", "D0": "decode"})
    h.flights.start([request()], [sink()])
    first_p = h.instances.submitted[0][0]
    h.flights.instance_lost(first_p, "died")
    assert sorted(h.instances.aborted) == sorted([(first_p, ["r"]), ("D0", ["r"])])
    assert h.flights.num_moves == 1
    iid, req, _ = h.instances.submitted[-1]
    assert iid != first_p and req.request_id == "r~2" and req.prompt_token_ids == PROMPT
    assert own(h, first_p) == Load()  # the lost attempt's accounting is undone
    assert h.flights.accounting.num_promised("D0") == 1  # the new attempt's only
    h.flights.dispatch(first_p, [out("r", 5)])  # the given-up attempt's: dropped
    h.flights.dispatch(iid, [out("r~2", 1)])
    h.flights.dispatch("D0", [out("r~2", 2, finish="length")])
    assert h.tokens("r") == [1, 2] and h.last("r").request_id == "r"
    assert h.finished[0].attempts == 2
    assert_unloaded(h)


def test_d_lost_mid_stream_resumes_after_what_the_client_got():
    h = make({"P0": "prefill", "D0": "decode", "D1": "decode"})
    h.flights.start([request()], [sink()])
    d = h.instances.submitted[0][2].decode_id
    h.flights.dispatch("P0", [out("r", 1)])
    h.flights.dispatch(d, [out("r", 2, 3)])
    h.flights.instance_lost(d, "died")
    assert (d, ["r"]) in h.instances.aborted
    iid, req, route = h.instances.submitted[-1]
    assert req.request_id == "r~2" and req.prompt_token_ids == [*PROMPT, 1, 2, 3]
    assert req.num_prior_output_tokens == 3 and req.prior_output_text == "<1><2><3>"
    assert route.decode_id not in (None, d)
    h.flights.dispatch(iid, [out("r~2", 4)])  # P's token of the new attempt
    h.flights.dispatch(route.decode_id, [out("r~2", 5, num_cached_tokens=14)])
    relabelled = h.last("r")
    assert relabelled.request_id == "r" and relabelled.num_cached_tokens == len(PROMPT)
    assert h.tokens("r") == [1, 2, 3, 4, 5]


def test_an_unavailable_output_delivers_its_tokens_then_moves():
    h = make({"M0": "mixed", "M1": "mixed"})
    h.flights.start([request()], [sink()])
    first = h.instances.submitted[0][0]
    h.flights.dispatch(first, [out("r", 1, finish="error", error="oom", unavailable=True)])
    assert h.tokens("r") == [1] and h.last("r").finish_reason is None
    assert h.flights.num_moves == 1 and h.instances.submitted[-1][1].request_id == "r~2"


@pytest.mark.parametrize("limit", [0, 1])
def test_a_request_moved_migration_limit_times_fails_unavailable(limit):
    h = make({"M0": "mixed", "M1": "mixed"}, migration_limit=limit)
    h.flights.start([request()], [sink()])
    for _ in range(limit):
        on = h.instances.submitted[-1][0]
        h.flights.instance_lost(on, "restarted")
        h.policy.mark_alive(on)
    assert h.flights.num_moves == limit and len(h.flights) == 1
    h.flights.instance_lost(h.instances.submitted[-1][0], "died")
    error = h.last("r")
    assert error.finish_reason == "error" and error.unavailable
    assert f"moved {limit} times" in error.error and len(h.flights) == 0
    assert_unloaded(h)


def test_abort_tells_each_instance_once_and_releases():
    h = make()
    h.flights.start([request("a"), request("b")], [sink(0), sink(1)])
    h.flights.abort(["a", "b", "unknown"])
    assert sorted(h.instances.aborted) == [("D0", ["a", "b"]), ("P0", ["a", "b"])]
    assert len(h.flights) == 0 and h.finished == []
    assert_unloaded(h)


def test_stage_times_join_their_flight_before_its_last_output():
    h = make({"M0": "mixed"})
    h.flights.start([request()], [sink()])
    times = StageTimes("r", "M0", "mixed", received_s=1.0)
    h.flights.add_stage_times([times, StageTimes("gone", "M0", "mixed", received_s=1.0)])
    h.flights.dispatch("M0", [out("r", 1, finish="stop")])
    assert h.finished[0].stage_times == [times]
