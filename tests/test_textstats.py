from trainer.textstats import ends_in_loop, ngram_repetition


def test_loop_detection():
    assert ends_in_loop([5] * 16)
    assert not ends_in_loop([5] * 15)  # too short to call a loop
    assert ends_in_loop(list(range(40)) + [1, 2, 3] * 6)
    assert not ends_in_loop(list(range(64)))
    cycle = list(range(100, 120))  # period 20: needs two full periods
    assert ends_in_loop([1, 2] + cycle * 2)
    assert not ends_in_loop(list(range(30)) + cycle + cycle[:19])
    assert not ends_in_loop([1, 2, 3] * 6 + [9])  # a loop that was left is not a loop


def test_ngram_repetition():
    assert ngram_repetition([1, 2, 3, 4]) == 0.0
    assert ngram_repetition([1, 2, 3]) == 0.0
    assert ngram_repetition([1, 2, 3, 4, 1, 2, 3, 4]) == 1 - 4 / 5
    assert ngram_repetition([7] * 10) == 1 - 1 / 7
