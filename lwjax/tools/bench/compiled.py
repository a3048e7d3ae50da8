"""What a compiled step holds, read from XLA: its memory, its collectives, its attention kernel."""

from __future__ import annotations

import math
import re

from lwjax.tools.bench.profile import COLLECTIVE_KINDS


def compiled_summary(compiled) -> dict:
    """``compiled_bytes_per_device`` (:func:`compiled_bytes`), ``attention`` (``"cudnn"`` where
    the step calls cuDNN's fused attention, else ``"xla"``) and ``collectives``
    (:func:`collectives`) of a compiled step."""
    text = compiled.as_text()
    return dict(
        compiled_bytes_per_device=compiled_bytes(compiled),
        attention="cudnn" if "cudnn$fmha" in text else "xla",
        collectives=collectives(text),
    )


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Per collective kind, ``(instances, result elements)`` in an optimized HLO module's text.

    A tuple-shaped result (combined collectives, ``*-start`` ops) counts all its
    arrays; kinds: ``all-reduce``, ``reduce-scatter``, ``all-gather``.
    """
    hlo_text = re.sub(r"/\*.*?\*/", "", hlo_text)  # XLA's /*index=5*/ notes hold an "="
    out = {}
    for kind in COLLECTIVE_KINDS:
        sizes = []
        for match in re.finditer(rf"= (\(?[^=]*?\)?) {kind}(-start)?\(", hlo_text):
            shapes = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", match[1])
            sizes.append(sum(math.prod(int(d) for d in s.split(",") if d) for s in shapes))
        out[kind] = (len(sizes), sum(sizes))
    return out


def compiled_bytes(compiled) -> int | None:
    """Device memory of a compiled step: arguments + outputs − donated + temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
