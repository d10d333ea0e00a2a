"""Speculative decoding counters, under vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Since start: steps that verified drafts, draft tokens verified, drafts accepted, and
    accepted drafts by their position in the draft (index 0: the first draft token). With a
    draft model, the known tokens it was fed before drafting (`num_catch_up_tokens`): a
    prompt whose draft KV did not come with its handoff, a request after a preemption, the
    last draft of a fully accepted step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_catch_up_tokens: int = 0

    @classmethod
    def new(cls, num_speculative_tokens: int) -> SpecDecodingStats:
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts between `earlier` (a snapshot of these) and now."""
        return SpecDecodingStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [
                now - then
                for now, then in zip(
                    self.num_accepted_tokens_per_pos, earlier.num_accepted_tokens_per_pos
                )
            ],
            self.num_catch_up_tokens - earlier.num_catch_up_tokens,
        )

    def snapshot(self, num_catch_up_tokens: int = 0) -> SpecDecodingStats:
        """A copy, with the drafter's catch-up count (the runner keeps it, not these)."""
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
            num_catch_up_tokens,
        )
