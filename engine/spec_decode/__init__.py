"""Speculative decoding: draft tokens proposed for a running request are verified by the
target model in one forward pass, and as many as it would have produced itself are kept.

`ngram_proposer` proposes (prompt lookup), `verify` decides what a verified step emits,
`speculation` is the scheduler's part (who gets drafts, what rejected drafts give back) and
`metrics` counts drafts and acceptance under vLLM's names.
"""
