"""An engine is built on the thread that steps it (engine/engine_thread.py: one OpenMP team per
process; a second thread running torch work made each decode-step linear layer ~4x slower)."""

import threading

import pytest

from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.engine_thread import build_on_engine_thread


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


async def test_an_engine_built_on_its_thread_steps_there_and_answers_as_one_built_here(llama):
    built_on: list[int] = []

    def make(thread):
        built_on.append(threading.get_ident())
        return Engine.from_pretrained(llama[1], block_size=4, kv_cache_bytes=4 << 20, executor=thread)

    engine = build_on_engine_thread(make)
    stepped_on: set[int] = set()
    engine.layer_hook = lambda layer, seqs: stepped_on.add(threading.get_ident())
    plain = Engine.from_pretrained(llama[1], block_size=4, kv_cache_bytes=4 << 20)
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        outs = [o async for o in engine.stream([5, 6, 7, 8, 9], params)]
        called_on = await engine.call(threading.get_ident)
        assert built_on[0] != threading.get_ident()
        assert stepped_on == {built_on[0]} and called_on == built_on[0]
        assert outs[-1].token_ids == plain.generate([[5, 6, 7, 8, 9]], params)[0].token_ids
    finally:
        engine.close()
        plain.close()


def test_a_failed_build_raises_its_error_and_leaves_no_thread_behind(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(Exception, match="config.json|gguf|model"):
        build_on_engine_thread(lambda thread: Engine.from_pretrained(tmp_path, executor=thread))
    for t in threading.enumerate():
        if t.ident not in before and t.name.startswith("engine-step"):
            t.join(timeout=10)
            assert not t.is_alive(), "the engine thread of a failed build is still running"
