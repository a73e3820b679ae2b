"""The demo's streamers (:mod:`specfx.demo.stream`): marks from ``put_round``, and the printing
streamer writes exactly the decoded answer, as it comes, with runs of accepted tokens marked."""

import io

import torch

import specfx
from specfx.demo.pair import load_demo_pair
from specfx.demo.stream import PLAIN_OFF, PLAIN_ON, PrintingMarkingStreamer, render_marked


def unmarked(text: str) -> str:
    return text.replace(PLAIN_ON, "").replace(PLAIN_OFF, "")


def test_printing_streamer_writes_the_answer_as_it_comes():
    _, _, tok = load_demo_pair()
    text = "def f(x):\n    return x + 1  # é ü 😀\n"
    ids = tok(text, add_special_tokens=False).input_ids
    out = io.StringIO()
    s = PrintingMarkingStreamer(tok, color=False, file=out)
    s.put(torch.tensor([[5, 6, 7]]))  # the prompt: not written
    assert out.getvalue() == ""
    s.put_round([1])
    s.put(torch.tensor([ids[0]]))  # prefill's token
    assert out.getvalue() == tok.decode(ids[:1])  # written at once, not at the end
    rounds = [ids[i : i + 3] for i in range(1, len(ids), 3)]
    for r in rounds:
        s.put_round([len(r)])
        for t in r:
            s.put(torch.tensor([t]))
            assert "\ufffd" not in out.getvalue()  # half a character waits for the rest of it
    s.end()
    written = out.getvalue()
    assert unmarked(written) == tok.decode(ids) + "\n"
    expected_marks = [False] + [m for r in rounds for m in [True] * (len(r) - 1) + [False]]
    assert [m for _, m in s.tokens] == expected_marks
    # a run of accepted tokens is marked once; text completed by an unmarked token (the end of a
    # character split across tokens) is written unmarked, so a run may lose its marks
    assert written.count(PLAIN_ON) == written.count(PLAIN_OFF) <= sum(len(r) > 1 for r in rounds)
    assert written.count(PLAIN_ON) >= sum(len(r) > 1 for r in rounds) - 2  # two rounds end inside a character here


def test_printing_streamer_on_a_generation_matches_render_marked():
    from tests.conftest import pair, prompt

    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)

    class Ids:  # a tokenizer stand-in: token ids as space-separated numbers
        def decode(self, ids, skip_special_tokens=False):
            return "".join(f" {t}" for t in ids)

    out = io.StringIO()
    s = PrintingMarkingStreamer(Ids(), color=False, file=out)
    result = spec.generate(prompt(6), max_new_tokens=12, streamer=s)
    assert [t for t, _ in s.tokens] == result[0, 6:].tolist()
    assert out.getvalue() == render_marked(Ids(), s.tokens, color=False) + "\n"
