"""Prompt Cache end to end: schemas registered, modules encoded once, reused by PML prompts.

The approximation (a module encoded alone) is measured in benchmarks/promptcache.py; here the
exact parts are checked: a schema that is a pure prefix gives the plain prompt's greedy output,
the shared-segment path equals the reference path with modules in any order and any batch, blocks
never leak, bad input is refused, and the host and disk tiers give back the very same KV.
"""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.kv.kvfile import parse_header
from prefixserve.promptcache.pml import PMLError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

SCHEMA = """<schema name="travel">You plan trips. Facts follow.
<module name="tokyo">Tokyo is the capital of Japan; it is known for sushi, temples and trains.</module>
<module name="paris">Paris is the capital of France; it is known for the Eiffel Tower and the Louvre.</module>
<module name="rome">Rome is the capital of Italy; it is known for the Colosseum and pasta.</module>
<union><module name="short">The trip is short.</module><module name="long">The trip is a long one
that lasts weeks and covers many places.</module></union>
<module name="plan">Plan a trip of <param name="days" len="8"/> days.</module>
</schema>"""

PROMPTS = [
    '<prompt schema="travel"><tokyo/><paris/> Which city has sushi?</prompt>',
    '<prompt schema="travel"><paris/><tokyo/><long/> Which city has the Louvre?</prompt>',
    '<prompt schema="travel"><rome/><plan days="three"/><short/> Where do I start?</prompt>',
    '<prompt schema="travel"><tokyo/><rome/> Compare them.</prompt>',
]


def tiny(tiny_config_path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("module_recompute", "none")  # Prompt Cache as the paper has it (recovery: its own tests)
    kw.setdefault("dtype", "float32")
    return LLM(f"dummy:{tiny_config_path}", device="cpu", progress=False, **kw)


def assert_only_modules_held(llm: LLM) -> None:
    engine = llm.engine
    engine.pool.check_integrity()
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_used == engine.modules.gpu_blocks


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_pure_prefix_schema_equals_plain_prefix_caching(default_llm: LLM) -> None:
    """One module at the start, then free text: nothing is approximated, so greedy output is the
    plain prompt's (same tokens, same positions), on the default model."""
    llm = LLM(dtype="float32", device="cpu", num_kv_blocks=512, progress=False)
    doc = "The museum opens at nine and closes at five. Tickets cost twelve euros; children enter free."
    llm.register_schema(f'<schema name="doc"><module name="m">{doc}</module></schema>')
    question = " When does the museum close?"
    tok = llm.get_tokenizer()
    ids = tok.encode(doc, add_special_tokens=False) + tok.encode(question, add_special_tokens=False)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    cached = llm.generate(f'<prompt schema="doc"><m/>{question}</prompt>', params)[0]
    plain = default_llm.generate({"prompt_token_ids": ids}, params)[0]
    assert cached.outputs[0].token_ids == plain.outputs[0].token_ids
    assert cached.prompt_token_ids == ids  # the placeholders of the module's last block are not shown
    assert cached.num_cached_tokens == len(tok.encode(doc, add_special_tokens=False))
    assert_only_modules_held(llm)


@pytest.mark.parametrize("attention", ["auto", "cascade"])
def test_shared_path_equals_reference_in_any_order_and_batch(tiny_config_path, attention: str) -> None:
    ref = tiny(tiny_config_path, attention="reference")
    fast = tiny(tiny_config_path, attention=attention)
    for llm in (ref, fast):
        llm.register_schema(SCHEMA)
    want = [token_ids(ref.generate(p, GREEDY))[0] for p in PROMPTS]  # one at a time, per sequence
    assert token_ids(fast.generate(PROMPTS, GREEDY)) == want  # together: modules read once per step
    assert fast.metrics()["shared_segments_total"] > 0
    assert token_ids(fast.generate(PROMPTS[::-1], GREEDY)) == want[::-1]
    assert_only_modules_held(fast)


def test_modules_are_encoded_once_and_counted(tiny_config_path) -> None:
    llm = tiny(tiny_config_path)
    llm.register_schema(SCHEMA)
    encoded = llm.metrics()["module_encodes_total"]
    outs = llm.generate(PROMPTS * 2, GREEDY)
    assert llm.metrics()["module_encodes_total"] == encoded  # nothing encoded again
    assert all(o.num_cached_tokens > 0 for o in outs)
    # cached tokens are the module rows plus any prefix-cache hit after them (a repeated prompt's own
    # full blocks: with a byte-level tokenizer the own text fills one)
    assert llm.metrics()["module_tokens_reused_total"] == sum(o.module_rows_shared for o in outs)
    assert all(o.num_cached_tokens >= o.module_rows_shared > 0 for o in outs)
    assert token_ids(outs[:4]) == token_ids(outs[4:])
    assert_only_modules_held(llm)
    llm.unregister_schema("travel")
    assert llm.engine.pool.num_used == 0


def test_samples_preemption_and_batch_schedule(tiny_config_path) -> None:
    """n > 1 forks, preemption under a small pool, and offline batches keep module prompts exact."""
    want = None
    for blocks, schedule in ((256, "online"), (40, "online"), (256, "batch")):
        llm = tiny(tiny_config_path, num_kv_blocks=blocks, max_num_seqs=8)
        llm.register_schema(SCHEMA)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=2)
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, schedule=schedule)]
        want = want or got
        assert got == want, (blocks, schedule)
        assert_only_modules_held(llm)


def test_bad_prompts_are_refused_and_the_engine_goes_on(tiny_config_path) -> None:
    llm = tiny(tiny_config_path)
    llm.register_schema(SCHEMA)
    bad = {
        '<prompt schema="nope"><tokyo/> x</prompt>': "unknown schema",
        '<prompt schema="travel"><berlin/> x</prompt>': "unknown module",
        '<prompt schema="travel"><short/><long/> x</prompt>': "one union",
        '<prompt schema="travel"><plan days="1 2 3 4 5 6 7 8 9 10"/></prompt>': "over",
        '<prompt schema="travel"><tokyo> x</prompt>': "PML",
    }
    for prompt, problem in bad.items():
        with pytest.raises(PMLError, match=problem):
            llm.generate(prompt, GREEDY)
    with pytest.raises(PMLError, match="already registered"):
        llm.register_schema(SCHEMA)
    assert_only_modules_held(llm)
    assert len(llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids) == 8


def test_cache_salt_keeps_tenants_apart(tiny_config_path) -> None:
    llm = tiny(tiny_config_path)
    llm.register_schema(SCHEMA)
    before = llm.metrics()["module_encodes_total"]
    a = llm.generate({"prompt": PROMPTS[0], "cache_salt": "a"}, GREEDY)[0]
    held_a = llm.engine.modules.gpu_blocks
    b = llm.generate({"prompt": PROMPTS[0], "cache_salt": "b"}, GREEDY)[0]
    assert llm.metrics()["module_encodes_total"] > before  # each tenant's modules are its own
    assert llm.engine.modules.gpu_blocks > held_a
    assert a.outputs[0].token_ids == b.outputs[0].token_ids  # same KV values, never the same blocks
    assert_only_modules_held(llm)


def test_host_tier_gives_back_the_same_kv(tiny_config_path) -> None:
    """A GPU-tier budget too small for two schemas moves the older one's modules to host memory."""
    llm = tiny(tiny_config_path, module_gpu_fraction=0.06)  # 15 of 256 blocks; a schema takes 10
    llm.register_schema(SCHEMA)
    want = token_ids(llm.generate(PROMPTS, GREEDY))
    other = SCHEMA.replace('name="travel"', 'name="other"').replace("known for", "famous for")
    llm.register_schema(other)
    assert llm.metrics()["module_evictions_gpu_total"] > 0
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
    assert llm.metrics()["module_loads_host_total"] > 0
    assert_only_modules_held(llm)


def test_a_sequence_that_needs_the_modules_blocks_gets_them_and_the_modules_come_back(
    tiny_config_path,
) -> None:
    """A registered schema's modules sit in the pool; a plain prompt that fits the context only
    without them takes their blocks once nothing runs (they move to host memory), and a later PML
    prompt brings them back: the same greedy answers as with room for both."""
    room = tiny(tiny_config_path)
    room.register_schema(SCHEMA)
    long = {"prompt_token_ids": list(range(1000, 1000 + 16 * 15 - 4))}  # the whole pool with its answer
    want = token_ids(room.generate([long, PROMPTS[0]], GREEDY))
    llm = tiny(tiny_config_path, num_kv_blocks=16)  # a schema takes 10 of them
    llm.register_schema(SCHEMA)
    got = [token_ids(llm.generate(p, GREEDY))[0] for p in (long, PROMPTS[0])]  # had waited forever
    assert got == want
    assert llm.metrics()["module_evictions_gpu_total"] > 0 and llm.metrics()["module_loads_host_total"] > 0
    assert_only_modules_held(llm)


def test_disk_store_survives_restart_and_corruption_is_recomputed(tiny_config_path, tmp_path) -> None:
    store = tmp_path / "modules"
    first = tiny(tiny_config_path, module_store=str(store))
    first.register_schema(SCHEMA)
    want = token_ids(first.generate(PROMPTS, GREEDY))
    files = sorted(store.glob("*.kv"))
    assert len(files) == first.metrics()["module_encodes_total"] > 0

    second = tiny(tiny_config_path, module_store=str(store))  # a restart: modules come from disk
    second.register_schema(SCHEMA)
    assert second.metrics()["module_encodes_total"] == 0
    assert second.metrics()["module_loads_disk_total"] == len(files)
    assert token_ids(second.generate(PROMPTS, GREEDY)) == want

    data = bytearray(files[0].read_bytes())  # flip a byte of the tensor data, truncate another file
    data[parse_header(bytes(data)).data_offset + 3] ^= 0xFF
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:100])
    third = tiny(tiny_config_path, module_store=str(store))
    third.register_schema(SCHEMA)
    assert third.metrics()["module_store_corrupt_total"] == 2
    assert third.metrics()["module_encodes_total"] == 2  # recomputed, never served
    assert token_ids(third.generate(PROMPTS, GREEDY)) == want


def test_requests_needing_one_stored_module_at_once_read_it_once(tiny_config_path, tmp_path) -> None:
    """Two requests in one batch import the same modules from disk: each module is read and copied
    once; the second request holds the blocks the first one's load filled."""
    llm = tiny(tiny_config_path, module_store=str(tmp_path))
    llm.register_schema(SCHEMA)
    same = [PROMPTS[0], PROMPTS[0].replace("sushi", "temples")]  # tokyo + paris, twice
    want = token_ids(llm.generate(same, GREEDY))
    llm.engine.modules.move_out(drop_host=True)
    disk = llm.engine.modules.disk
    assert disk is not None
    reads, loads = disk.reads, llm.metrics()["module_loads_disk_total"]
    encodes = llm.metrics()["module_encodes_total"]
    assert token_ids(llm.generate(same, GREEDY)) == want
    pieces = 3  # the schema's leading text, tokyo, paris
    assert disk.reads - reads == pieces
    assert llm.metrics()["module_loads_disk_total"] - loads == pieces
    assert llm.metrics()["module_encodes_total"] == encodes  # nothing recomputed
    assert_only_modules_held(llm)


@pytest.mark.gpu
def test_gpu_triton_path_and_graphs_equal_reference(tiny_config_path) -> None:
    """On CUDA (fp32): module prompts through the Triton kernels and the decode graphs give the
    reference path's greedy tokens."""
    outs = []
    for attention in ("reference", "auto"):
        llm = LLM(
            f"dummy:{tiny_config_path}",
            dtype="float32",
            device="cuda",
            attention=attention,
            num_kv_blocks=256,
            progress=False,
            enforce_eager=attention == "reference",
        )
        if llm.get_tokenizer() is None:
            pytest.skip("the default model (its tokenizer) is not installed")
        llm.register_schema(SCHEMA)
        outs.append(token_ids(llm.generate(PROMPTS * 3, GREEDY)))
        assert_only_modules_held(llm)
    assert outs[0] == outs[1]


def test_piece_keys_and_stand_in_digests_are_remembered_exactly(tiny_config_path) -> None:
    """The per-schema key cache gives ``key_of``'s keys, is gone with a re-registration (new text,
    new keys), and the inlined stand-in digests are ``block_digest``'s chain."""
    import hashlib

    from prefixserve.kv.block_pool import block_digest
    from prefixserve.promptcache.digests import stand_in_digests
    from prefixserve.promptcache.recompute import NONE

    llm = tiny(tiny_config_path)
    modules = llm.engine.modules
    llm.register_schema(SCHEMA)
    llm.generate({"prompt": PROMPTS[0], "cache_salt": "s"}, GREEDY)
    reg = modules.schemas["travel"]
    assert reg.keys
    for (name, salt), key in reg.keys.items():
        assert key == modules.key_of(reg.pieces[name], salt)
    entries = [e for e in modules.entries.values() if e.blocks is not None]
    h = hashlib.blake2b(b"prompt-modules", digest_size=16)
    want = []
    for entry in entries:
        h.update(entry.key.encode())
        parent = h.digest()
        for i in range(len(entry.blocks)):
            parent = block_digest(parent, [i], [], "s")
            want.append(parent)
    pieces = [(e.key, len(e.blocks)) for e in entries]
    assert stand_in_digests(pieces, NONE, "s") == want
    got = modules._digests(pieces, NONE, "s")  # remembered per set of pieces, handed out as copies
    got.clear()
    assert modules._digests(pieces, NONE, "s") == want
    tokyo = modules.key_of(reg.pieces["tokyo"], None)
    llm.engine.modules.unregister("travel")
    llm.register_schema(SCHEMA.replace("sushi", "ramen"))
    llm.generate(PROMPTS[0], GREEDY)
    reg = modules.schemas["travel"]
    assert ("tokyo", "s") not in reg.keys and reg.keys[("tokyo", None)] != tokyo
    assert reg.keys[("tokyo", None)] == modules.key_of(reg.pieces["tokyo"], None)
    assert_only_modules_held(llm)


def test_a_batch_file_row_keeps_its_module_recompute(tiny_config_path, tmp_path) -> None:
    """A batch row's ``module_recompute`` is the request's, as on the server: "none" is answered as
    ``generate`` answers it, and a bad value is that row's 400."""
    import json

    llm = tiny(tiny_config_path, module_recompute="link:64")
    llm.register_schema(SCHEMA)
    body = {"model": "default", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    rows = [
        {"custom_id": custom_id, "url": "/v1/completions", "body": {**body, "module_recompute": value}}
        for custom_id, value in (("none", "none"), ("bad", "foo"))
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    llm.batch(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), progress=False)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    answers = {r["custom_id"]: r["response"] for r in map(json.loads, lines)}
    want = llm.generate({"prompt": PROMPTS[1], "module_recompute": "none"}, GREEDY)[0].outputs[0].token_ids
    assert want != llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids  # the setting matters here
    text = llm.get_tokenizer().decode(want)
    assert answers["none"]["body"]["choices"][0]["text"] == text
    assert answers["bad"]["status_code"] == 400
    assert_only_modules_held(llm)
