"""scripts/qlinear_rows_probe.py's integer peak loops: the loop it times does the multiplies it counts, on registers.

The truth is the compiler's own output for the probe's C source (`cc -O2 -S`, as the probe builds it): each
INT_PEAKS function's loop must hold one multiply instruction per chain it counts (a product computed once for two
accumulators halves the real rate) and read no operand from memory (an accumulator kept in memory times the
store-to-load forwarding instead of the multiplies).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import qlinear_rows_probe as probe  # noqa: E402

MULTIPLIES = ("vpmaddubsw", "vpdpbusd")


def _timed_loop(asm: str, function: str) -> list[str]:
    """The instructions of `function`'s timed loop (a label to a jump back to it): of its loops, the one with the most
    multiplies."""
    text = asm[asm.index(f"\n{function}:"):]
    text = text[: text.index(f".size\t{function}")]
    lines = [re.sub(r"^\{\w+\}\s*", "", line.strip()) for line in text.splitlines()]  # AVX-VNNI's {vex} prefix
    loops = []
    for end, line in enumerate(lines):
        jump = re.match(r"j\w+\s+(\.L\w+)$", line)
        if jump and f"{jump.group(1)}:" in lines[:end]:
            start = lines.index(f"{jump.group(1)}:")
            loops.append([x for x in lines[start + 1 : end] if x and not x.startswith(".")])
    assert loops, f"{function}: no loop found"
    return max(loops, key=lambda body: sum(x.split()[0].startswith(MULTIPLIES) for x in body))


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc), as the probe does")
def test_integer_peak_loops_multiply_as_counted_on_registers(tmp_path):
    src = tmp_path / "peak.c"
    src.write_text(probe.PEAK_SOURCE)
    asm = subprocess.run(["cc", "-O2", "-S", "-o", "-", str(src)], check=True, capture_output=True,
                         text=True).stdout
    for peak in probe.INT_PEAKS.values():
        name, chains = peak[0], peak[4] if len(peak) > 4 else 8  # (before the fix: 8 chains, no count)
        body = _timed_loop(asm, name)
        multiplies = [line for line in body if line.split()[0].startswith(MULTIPLIES)]
        assert len(multiplies) == chains, (name, body)
        for line in body:
            operands = line.split(None, 1)[1] if " " in line or "\t" in line else ""
            memory = [i for i, op in enumerate(re.split(r",\s*(?![^()]*\))", operands)) if "(" in op]
            # a store (the memory operand last, AT&T order) is harmless; a read would chain the loop through memory
            assert not memory or (line.startswith("vmov") and memory == [operands.count(",")]), (name, line, body)
