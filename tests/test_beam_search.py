"""The beam search itself (no cluster): expansion, stop rules, min_tokens and ranking."""

from __future__ import annotations

from pdcluster.cluster.api.beam_search import Beam, BeamSearch, BeamSearchParams, beam_score
from pdcluster.engine.outputs import TopLogprobs

EOS = 0


def params(**fields) -> BeamSearchParams:
    base = {"beam_width": 2, "max_tokens": 3, "num_prompt_tokens": 4}
    return BeamSearchParams(eos_token_ids=frozenset({EOS}), **{**base, **fields})


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


def top(*pairs: tuple[int, float]) -> TopLogprobs:
    return TopLogprobs(tuple(t for t, _ in pairs), tuple(lp for _, lp in pairs))


def test_keeps_the_best_candidates_of_all_beams():
    search = BeamSearch(params(), decode)
    search.step([top((1, -0.1), (2, -0.5), (3, -2.0), (4, -3.0))])
    assert [b.token_ids for b in search.live] == [[1], [2]]
    # beam [2] expands better than beam [1]: both of the next live beams start with 2
    search.step(
        [top((5, -2.0), (6, -2.1), (7, -3), (8, -4)), top((5, -0.2), (6, -0.3), (7, -5), (8, -6))]
    )
    assert [b.token_ids for b in search.live] == [[2, 5], [2, 6]]
    assert search.live[0].cumulative_logprob == -0.5 + -0.2
    search.step([top((1, -1.0), (2, -1.5), (3, -4), (4, -5))] * 2)
    assert search.done
    best = search.best()
    assert [b.token_ids for b in best] == [[2, 5, 1], [2, 6, 1]]
    assert [b.finish_reason for b in best] == ["length", "length"]
    assert best[0].text == "cfb"


def test_only_2x_width_candidates_per_beam():
    search = BeamSearch(params(beam_width=1), decode)
    search.step([top((1, -1.0), (2, -2.0), (3, -0.1))])  # a third alternative is not a candidate
    assert search.live[0].token_ids == [1]


def test_eos_finishes_a_beam_and_length_penalty_ranks():
    p = params(length_penalty=0.0)
    search = BeamSearch(p, decode)
    search.step([top((EOS, -0.3), (1, -0.2), (2, -0.4), (3, -5))])
    assert [b.token_ids for b in search.finished] == [[EOS]]
    search.step([top((4, -0.1), (5, -0.2), (6, -5), (7, -5))] * 2)
    search.step([top((4, -0.1), (5, -0.2), (6, -5), (7, -5))] * 2)
    by_logprob = search.best()
    assert by_logprob[0].token_ids == [EOS] and by_logprob[0].text == ""  # EOS not in text
    assert by_logprob[0].finish_reason == "stop"
    long = Beam([1, 4, 4], cumulative_logprob=-0.4)
    short = Beam([EOS], cumulative_logprob=-0.3)
    # seq_len: prompt + tokens, less a final EOS: 7 vs 4
    assert beam_score(long, params(length_penalty=1.0)) == -0.4 / 7
    assert beam_score(short, params(length_penalty=1.0)) == -0.3 / 4
    assert beam_score(long, params(length_penalty=1.0)) > beam_score(
        short, params(length_penalty=1.0)
    )


def test_stop_strings_and_stop_token_ids_and_min_tokens():
    p = params(stop=("c",), stop_token_ids=frozenset({9}), min_tokens=2)
    search = BeamSearch(p, decode)
    search.step([top((EOS, -0.1), (9, -0.2), (1, -0.3), (2, -0.4))])
    assert search.finished == [] and [b.token_ids for b in search.live] == [[1], [2]]  # "c" too
    search.step([top((2, -0.1), (9, -0.2), (3, -1), (4, -1))] * 2)
    stopped = {tuple(b.token_ids): b for b in search.finished}
    assert stopped[(1, 2)].text == "b" and stopped[(1, 2)].stop_reason == "c"
    assert stopped[(2, 2)].text == "" and (1, 9) not in stopped
    assert [b.token_ids for b in search.live] == [[1, 3], [1, 4]]
    search.step([top((9, -0.1), (5, -0.2), (6, -1), (7, -1))] * 2)
    stopped = {tuple(b.token_ids): b for b in search.finished}
    assert stopped[(1, 3, 9)].stop_reason == 9 and stopped[(1, 3, 9)].finish_reason == "stop"
    best = search.best()  # texts cut at their stop string stay cut
    assert [(b.token_ids, b.text) for b in best] == [([1, 2], "b"), ([2, 2], "")]


def test_include_stop_str_in_output():
    search = BeamSearch(params(stop=("b",), include_stop_str_in_output=True), decode)
    search.step([top((1, -0.1), (2, -0.2), (3, -1), (4, -1))])
    assert search.finished[0].text == "b"
