from pagedserve.cluster.outputs import IncrementalDetokenizer, find_stop_string
from pagedserve.worker.loader import load_tokenizer


def test_incremental_detokenization_never_emits_half_a_character(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    text = "Grüße, 世界! 🦙🚀 naïve café — ✓ done"
    ids = tok(text, add_special_tokens=False).input_ids
    # byte-level BPE splits the emoji and CJK characters over several tokens
    assert len(ids) > len(text.split())
    detok = IncrementalDetokenizer(tok, tok("Hi").input_ids)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert any(d == "" for d in deltas), "some token must have ended inside a multi-byte character"


def test_special_tokens_are_skipped_or_kept(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    ids = tok("hello", add_special_tokens=False).input_ids + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [1], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [1], skip_special_tokens=False)
    for i in ids:
        skip.add(i)
        keep.add(i)
    assert skip.text == "hello" and keep.text == "hello" + tok.eos_token


def test_find_stop_string_only_in_new_text():
    assert find_stop_string("abc STOP def", 4, ["STOP"]) is None  # ended before the new text
    assert find_stop_string("abc STO", 3, ["STOP"]) is None
    assert find_stop_string("abc STOP", 1, ["STOP"]) == ("STOP", 4)  # completed by the last char
    assert find_stop_string("xx\n\nyy END", 5, ["END", "\n\n"]) == ("END", 7)
    assert find_stop_string("a\n\nEND", 6, ["END", "\n\n"]) == ("\n\n", 1)  # the earliest one wins
