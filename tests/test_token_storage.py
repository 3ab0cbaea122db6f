"""Token ids and positions live in arrays whose elements the GC never walks; outputs stay lists.

A full GC pass visits every element of every live list; with lists, 1,024 sequences of 16K tokens
made each pass 1.8 s, stalling decode. These tests pin the storage (int64 arrays at every stage
of a request's life, forks included), the output side (a list made only when read, pickled compact)
and the refusal of bad positions.
"""

from __future__ import annotations

import gc
import pickle
from array import array

import numpy as np
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.outputs import CompletionOutput, RequestOutput
from tests.conftest import assert_pool_empty


@pytest.fixture
def llm(tiny_config_path) -> LLM:
    return LLM(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        attention="cascade",
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        progress=False,
    )


def _opaque(store: object) -> bool:
    """An int64 array: the GC's visit of it is its type alone, never its elements."""
    return type(store) is array and store.typecode == "q" and gc.get_referents(store) == [array]


def _array_stores(engine) -> int:
    """Checks every live request's and sequence's id and position stores; returns how many."""
    seen = 0
    for req in engine.requests.values():
        for store in (req.prompt_token_ids, req.prompt_positions):
            assert _opaque(store)
            seen += 1
        for seq in req.sequences:
            for store in (seq.token_ids, seq.positions):
                assert _opaque(store)
                seen += 1
    return seen


def test_stores_stay_arrays_through_prefill_decode_and_forks(llm: LLM) -> None:
    engine = llm.engine
    shared = list(range(100, 180))
    engine.add_request(
        "a", prompt_token_ids=[*shared, 7, 8], params=SamplingParams(temperature=0, max_tokens=6)
    )
    engine.add_request(
        "b", prompt_token_ids=[*shared, 9], params=SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5)
    )
    checked, outs = 0, []
    while engine.has_unfinished():
        checked += _array_stores(engine)
        outs += engine.step()
    assert checked > 20  # prefill chunks, decode steps and the forked samples were all seen
    finals = {o.request_id: o for o in outs if o.finished}
    assert finals["a"].prompt_token_ids == [*shared, 7, 8]
    assert [len(c.token_ids) for c in finals["b"].outputs] == [5, 5, 5]
    assert all(type(c.token_ids) is list for o in finals.values() for c in o.outputs)
    assert_pool_empty(llm)


def test_output_prompt_ids_are_made_on_read_and_pickle_compact() -> None:
    ids = array("q", [3, 1, 4, 1, 5])
    out = RequestOutput("r", None, ids, [CompletionOutput(0, "x", [9])], True)
    assert out.num_prompt_tokens == 5 and out._prompt_ids is ids  # nothing made yet
    wire = pickle.loads(pickle.dumps(out))
    assert type(wire._prompt_ids) is array and wire == out
    got = out.prompt_token_ids
    assert got == [3, 1, 4, 1, 5] and type(got) is list and out.prompt_token_ids is got
    got.append(2)  # a caller's list is its own
    assert list(ids) == [3, 1, 4, 1, 5] and wire.prompt_token_ids == [3, 1, 4, 1, 5]
    assert out != wire  # values compared, list or array


@pytest.mark.parametrize(
    "positions, message",
    [
        ([0, 1, 2.5], "prompt_positions must be integers"),
        ([0, 1], "one position per prompt token"),
        (b"\x00" * 24, "prompt_positions must be a sequence of integers, not bytes"),
        (3, "prompt_positions must be a sequence of integers, not int"),
        ([0, 1, 2**63], "prompt_positions must be integers"),
    ],
)
def test_bad_positions_are_refused_and_the_engine_serves_on(llm: LLM, positions, message) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt_token_ids=[5, 6, 7], prompt_positions=positions)
    numpy_positions = {"prompt_token_ids": [5, 6, 7], "positions": np.arange(3)}
    assert llm.generate(numpy_positions, SamplingParams(temperature=0, max_tokens=3))[0].finished
    good = llm.generate(
        {"prompt_token_ids": [5, 6, 7], "positions": [0, 1, 2]}, SamplingParams(temperature=0, max_tokens=3)
    )
    plain = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))
    assert good[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert_pool_empty(llm)


def test_prompt_ids_as_text_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids must be a sequence of integers, not str"):
        llm.engine.add_request("bad", prompt_token_ids="123")
    assert_pool_empty(llm)


def test_output_repr_and_assignment_show_lists() -> None:
    out = RequestOutput("r", None, array("q", [4, 2]), [], False)
    assert "prompt_token_ids=[4, 2]" in repr(out) and type(out._prompt_ids) is array  # repr keeps none
    out.prompt_token_ids = [1]
    assert out.prompt_token_ids == [1] and out.num_prompt_tokens == 1


def test_engine_process_wire_carries_the_array(llm: LLM) -> None:
    """The server's engine process sends the prompt's array once (pickled compact); the server side's
    outputs share it and each makes its list when read."""
    from prefixserve.serving.engine_process import OutputDecoder, OutputEncoder

    engine = llm.engine
    engine.add_request(
        "s", prompt_token_ids=[9, 8, 7], params=SamplingParams(temperature=0, max_tokens=3), stream=True
    )
    encoder, decoder, got = OutputEncoder(), OutputDecoder(), []
    while engine.has_unfinished():
        for out in engine.step():
            assert type(out.stored_prompt_token_ids) is array
            got.append(decoder.decode(pickle.loads(pickle.dumps(encoder.encode(out)))))
    assert len(got) >= 2 and all(type(o.stored_prompt_token_ids) is array for o in got)
    assert got[0].stored_prompt_token_ids is got[-1].stored_prompt_token_ids
    assert got[-1].prompt_token_ids == [9, 8, 7] and len(got[-1].outputs[0].token_ids) == 3
    assert_pool_empty(llm)


def test_prompts_given_as_arrays_or_tuples_run_like_lists(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate({"prompt_token_ids": [11, 12, 13, 14]}, params)[0].outputs[0].token_ids
    for given in (
        array("q", [11, 12, 13, 14]),
        array("i", [11, 12, 13, 14]),
        (11, 12, 13, 14),
        np.array([11, 12, 13, 14], dtype=np.int32),
        torch.tensor([11, 12, 13, 14]),
    ):
        out = llm.generate({"prompt_token_ids": given}, params)[0]
        assert out.outputs[0].token_ids == want and out.prompt_token_ids == [11, 12, 13, 14]
    assert_pool_empty(llm)


def test_counting_positions_are_fresh_copies_of_0_to_n() -> None:
    from prefixserve.sequence import counting_positions

    for n in (0, 1, 5, 3000, 7, 10_000):  # grows past its length, then serves shorter ones
        got = counting_positions(n)
        assert type(got) is array and got.typecode == "q" and got.tolist() == list(range(n))
    mine = counting_positions(4)
    mine.append(99)  # a request's own array: changing it changes no other request's
    assert counting_positions(5).tolist() == [0, 1, 2, 3, 4]
