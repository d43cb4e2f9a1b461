"""
One-line errors for bad input, used by every script (and `duration`, the time format of progress lines).

A bad config value, flag, data file or checkpoint stops with one line on stderr (`error: ...`) and exit
code 1: no traceback, and never after touching a checkpoint that is already on disk.
"""
import argparse
import difflib
import sys


def die(msg):
    """The single way to stop on bad input: one line on stderr, exit code 1, no traceback."""
    msg = ' '.join(str(msg).split())  # one line, whatever the message held
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def first_line(e):
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].split('. ')[0][:200]}" if text else type(e).__name__


def duration(seconds):
    """Seconds as a short duration for progress lines: 42s, 4m10s, 3h05m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Parser(argparse.ArgumentParser):
    """argparse for the command-line tools, with a one-line error (and the nearest flag for a typo) instead
    of argparse's usage block. Flags are written --key=value or --key value; no abbreviations."""

    def __init__(self, prog, description):
        super().__init__(prog=prog, description=description, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        if 'unrecognized arguments' in message:
            flags = [o[2:] for a in self._actions for o in a.option_strings if o.startswith('--')]
            bad = message.split(':', 1)[1].split()[0].split('=')[0].lstrip('-')
            near = difflib.get_close_matches(bad, flags, n=1)  # compared without the dashes they all share
            message += f"; did you mean --{near[0]}?" if near else ''
        die(f"{message} (see python {self.prog} --help)")
