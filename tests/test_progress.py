"""The progress bar: one line redrawn on a terminal, few lines in a log, rate and ETA."""

import io

from speed.progress import ProgressBar, format_duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_it_prints_the_first_and_last_update_only():
    log = io.StringIO()
    bar = ProgressBar(100, "evaluate speed", "examples", stream=log, interval_s=3600)
    for _ in range(50):
        bar.update(2, "80 tokens/s")
    lines = log.getvalue().splitlines()
    assert [line.split(" [#")[0].split(" [-")[0] for line in lines] == [
        "[evaluate speed] 2/100 examples",
        "[evaluate speed] 100/100 examples",
    ]
    assert lines[-1].startswith("[evaluate speed] 100/100 examples [####################] 100% | ")
    assert " examples/s | ETA 0s | 80 tokens/s" in lines[-1]


def test_on_a_terminal_it_redraws_one_line():
    screen = Terminal()
    bar = ProgressBar(4, "evaluate", "examples", stream=screen)
    for _ in range(4):
        bar.update(1)
    text = screen.getvalue()
    assert text.count("\r") == 4 and text.count("\n") == 1 and text.endswith("\n")


def test_rate_and_eta():
    bar = ProgressBar(10, "x", "items")
    bar.done = 4
    assert bar.line(2.0) == "[x] 4/10 items [########------------] 40% | 2.0 items/s | ETA 3s"
    assert (format_duration(3725), format_duration(65), format_duration(7.2)) == ("1h02m05s", "1m05s", "7s")
