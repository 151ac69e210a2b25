"""trtpaged.errors: the renaming of the fields a message names, outside the values it quotes."""

from __future__ import annotations

import time

from trtpaged.errors import mentions_renamed


def test_mentions_are_renamed_in_linear_time_whatever_the_quotes_and_backslashes():
    """Text with a backslash before each quote (a raw value, not repr's) opened a quoted value at every escaped quote,
    each scanned to the message's end: 64 KB took 17-24 s here (was); a quote after a backslash opens none."""
    names = {"max_tokens": "max_completion_tokens"}
    for unit in ("' x\\", '" x\\', "'a\\' b"):
        raw = unit * 16000
        message = f"max_tokens: {raw} (max_tokens) {'max_tokens'!r}"
        start = time.monotonic()
        renamed = mentions_renamed(message, names)
        assert time.monotonic() - start < 2.0, unit
        # no value is closed in `raw`: the names outside it are renamed, the one repr quotes is not
        assert renamed.startswith("max_completion_tokens: "), renamed[:80]
        assert renamed.endswith(" (max_completion_tokens) 'max_tokens'"), renamed[-80:]
