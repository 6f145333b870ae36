"""TextStream: stop strings that span tokens, and UTF-8 characters split across tokens; SequenceOutput: why a
sequence ends (end of generation, stop string, max_tokens), as every engine decides it."""

from syshaxd.sdk.output import SequenceOutput, TextStream


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


# a tiny vocabulary: token 0 ends generation, the others are these pieces ("é" split over tokens 4 and 5)
PIECES = {0: b"", 1: b"Hel", 2: b"lo", 3: b" STOP", 4: "é".encode()[:1], 5: "é".encode()[1:]}


def output(max_tokens=10, stop=(), ignore_eos=False, resume=()):
    return SequenceOutput(stop=stop, ignore_eos=ignore_eos, max_tokens=max_tokens, is_eog=lambda t: t == 0,
                          piece_bytes=PIECES.__getitem__, resume_tokens=resume)


def test_end_of_generation_stops_and_releases_held_text():
    out = output(stop=("o!",))
    assert out.token(1) == ("Hel", None)
    assert out.token(2) == ("l", None)  # "o" could begin the stop string
    assert out.token(0) == ("o", "stop")


def test_ignore_eos_goes_on_to_max_tokens():
    out = output(max_tokens=2, ignore_eos=True)
    assert out.token(0) == ("", None)
    assert out.token(1) == ("Hel", "length")
    assert out.n_generated == 2


def test_max_tokens_ends_with_length_and_flushes():
    out = output(max_tokens=2)
    assert out.token(1) == ("Hel", None)
    assert out.token(4) == ("\ufffd", "length")  # the half character is flushed, not lost


def test_stop_string_ends_with_stop_and_cuts_it():
    out = output(stop=(" ST",))
    assert out.token(1) == ("Hel", None)
    assert out.token(3) == ("", "stop")


def test_resumed_tokens_are_not_sent_again_and_not_counted():
    out = output(max_tokens=1, resume=(1, 4))
    assert out.token(5) == ("é", "length")  # the character begun before the move completes here
