"""TextStream: stop strings that span tokens, and UTF-8 characters split across tokens."""

from syshaxd.engine.output import TextStream


def feed_all(stream, pieces):
    return "".join(stream.feed(p) for p in pieces) + stream.flush()


def test_plain_text_passes_through():
    assert feed_all(TextStream(), [b"Hel", b"lo", b" world"]) == "Hello world"


def test_stop_string_across_tokens_is_cut_and_never_emitted():
    s = TextStream(("\n\nQ:",))
    out = [s.feed(p) for p in [b"Paris", b".\n", b"\nQ", b": next"]]
    assert "".join(out) == "Paris." and s.stopped
    assert s.flush() == ""


def test_held_prefix_is_released_when_it_turns_out_not_to_stop():
    s = TextStream(("STOP",))
    assert s.feed(b"a ST") == "a "
    assert s.feed(b"OOL") == "STOOL"


def test_earliest_of_several_stop_strings_wins():
    assert feed_all(TextStream(("world", "lo w")), [b"hello world"]) == "hel"


def test_utf8_split_across_tokens():
    e = "é€😀".encode()
    assert feed_all(TextStream(), [e[:1], e[1:3], e[3:4], e[4:]]) == "é€😀"


def test_invalid_bytes_become_replacement_characters():
    assert feed_all(TextStream(), [b"ok\xff"]) == "ok\ufffd"


def test_a_primed_stream_finishes_what_began_on_another_engine():
    # the decode moved after "Hi E" and half of "é" went out: the new engine neither repeats that text nor
    # misses a stop string or a character that spans the move
    elsewhere = TextStream(("END",))
    sent = elsewhere.feed(b"Hi E") + elsewhere.feed("é".encode()[:1])
    assert sent == "Hi "
    moved = TextStream(("END",)).primed([b"Hi E", "é".encode()[:1]])
    assert moved.feed("é".encode()[1:]) == "Eé"
    moved = TextStream(("END",)).primed([b"Hi E"])
    assert moved.feed(b"ND and more") == "" and moved.stopped
