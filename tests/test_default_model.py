"""The bundled default model through our engine: it must answer and model English well."""

from __future__ import annotations

import math

import pytest
import torch

from mooncaked.engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed \"La dame de fer\", it was constructed as the centerpiece "
    "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution. "
    "Although initially criticised by some of France's leading artists and intellectuals for its "
    "design, it has since become a global cultural icon of France and one of the most recognisable "
    "structures in the world."
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.from_pretrained("default", cache_dir=tmp_path_factory.mktemp("cache"), block_size=16,
                                  kv_cache_bytes=256 << 20)


def test_answers_the_capital_of_france(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([ids], SamplingParams(max_tokens=32))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"  # it ends its turn with <|im_end|>


def test_perplexity_on_english_is_low(engine):
    ids = engine.tokenizer.encode(PARAGRAPH)
    logits = engine.score(ids, chunk_size=48)  # chunked through the paged cache
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    ppl = math.exp(nll.item())
    assert ppl < 40, ppl


def test_default_model_matches_transformers(engine):
    """Our runner on the converted weights against transformers on the same folder (the exact path)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32).eval()
    engine = Engine.from_pretrained(engine.model_dir, dtype="float32", block_size=16, kv_cache_bytes=64 << 20)
    ids = engine.tokenizer.encode(PARAGRAPH)[:60]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.score(ids), ref, atol=2e-3, rtol=1e-3)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    got = engine.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    assert got == want
