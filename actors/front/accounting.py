"""Optimistic load accounting: what one replica's requests add to each instance's load from
the moment it plans them, until the instance's own reports include them (routing/policy.py
keeps the figures; this module says when a request starts and stops counting where)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdcluster.engine.kv_cache_manager import request_root
from pdcluster.engine.request import Request
from pdcluster.routing.handoff import max_new_tokens
from pdcluster.routing.policy import Plan, RouterPolicy


@dataclass
class Charge:
    """Where one attempt of a request counts now; each is None once it stopped counting."""

    request: Request  # the attempt's
    encode_on: str | None = None
    prefill_on: str | None = None  # set while P has not produced the first token
    decode_on: str | None = None  # with `prefill_on`: the D promised the request


class Accounting:
    """Starts and ends the charges of one replica's requests on its routing policy."""

    def __init__(self, policy: RouterPolicy, max_model_len: int) -> None:
        self.policy = policy
        self.max_model_len = max_model_len
        # D instance id -> requests planned onto it that are still on their P
        self.promised: Counter[str] = Counter()

    def start(self, request: Request, plan: Plan) -> Charge:
        """Count a planned attempt: on its E, and on its P and D when P hands it off (a
        one-token request ends on P), else on the one instance that runs it."""
        charge = Charge(request)
        if plan.encoder_id is not None:
            charge.encode_on = plan.encoder_id
            self.policy.on_encode_start(plan.encoder_id)
        if plan.disaggregated and self._max_tokens(request) > 1:
            charge.prefill_on = plan.prefill_id
            self.promised[plan.decode_id] += 1
            self.policy.on_prefill_start(
                plan.prefill_id, request.prompt_token_ids, images(request), request_root(request)
            )
            self._decode_started(charge, plan.decode_id, cached=False)  # D's KV is spoken for
        else:
            self._decode_started(charge, plan.prefill_id or plan.decode_id)
        return charge

    def prefill_ended(self, charge: Charge) -> None:
        """P is done with the request (and so is E: P used or gave up its outputs)."""
        if charge.prefill_on is not None:
            self.policy.on_prefill_end(charge.prefill_on, charge.request.num_prompt_tokens)
            self.promised[charge.decode_on] -= 1
            charge.prefill_on = None
        if charge.encode_on is not None:
            self.policy.on_encode_end(charge.encode_on)
            charge.encode_on = None

    def prompt_cached(self, charge: Charge) -> None:
        """The prompt's KV reached the request's D (P handed it off)."""
        request = charge.request
        self.policy.on_prompt_cached(
            charge.decode_on, request.prompt_token_ids, images(request), request_root(request)
        )

    def release(self, charge: Charge) -> None:
        """Undo the attempt's accounting: its outputs are over, by end or failure."""
        self.prefill_ended(charge)
        if charge.decode_on is not None:
            request = charge.request
            num_tokens = request.num_prompt_tokens + self._max_tokens(request)
            self.policy.on_decode_end(charge.decode_on, num_tokens)
            charge.decode_on = None

    def num_promised(self, instance_id: str) -> int:
        """Requests planned onto D `instance_id` that are still on their P."""
        return self.promised.get(instance_id, 0)

    def forget(self, instance_id: str) -> None:
        """The instance left the pool."""
        self.promised.pop(instance_id, None)

    def _decode_started(self, charge: Charge, instance_id: str, cached: bool = True) -> None:
        request = charge.request
        charge.decode_on = instance_id
        self.policy.on_decode_start(
            instance_id,
            request.prompt_token_ids,
            self._max_tokens(request),
            images(request),
            cached,
            request_root(request),
        )

    def _max_tokens(self, request: Request) -> int:
        return max_new_tokens(request, self.max_model_len)


def images(request: Request) -> list[tuple[int, int, str]]:
    """The request's images as routing hashes them: (offset, end, mm_hash)."""
    return [(f.offset, f.end, f.mm_hash) for f in request.mm_features]
