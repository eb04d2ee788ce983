"""Named ranges of a training step (data, forward, backward, optimizer, loss, vision) for a step profile.

Here, below every layer, so that the model's loss (launcher/model) and the loop (launcher/train) can both
mark their ranges; launcher/train/profile.py turns them on while it records and reads them back. Off, a
scope is a null context: the loop pays nothing for them.
"""

from __future__ import annotations

import contextlib
from typing import Any

PREFIX = "launcher/"

_recording = False  # a profile is recording: scopes are entered


def scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named range of the loop while a profile records (torch.profiler.record_function), else nothing."""
    if not _recording:
        return contextlib.nullcontext()
    import torch

    return torch.profiler.record_function(PREFIX + name)


def record_scopes(on: bool) -> None:
    """Turn the scopes on (a profile starts) or off (it stops)."""
    global _recording
    _recording = on
