"""EventHandle and EventOverlap: DeepEP's stream-event wrappers over torch.cuda events.

epd.deep_ep runs every op on torch.cuda.current_stream(), so an op's results are already
ordered before later work on that stream; these events serve code that waits on other
streams. Without CUDA (epd's host backend) ops are synchronous and events are no-ops.
"""

from typing import Any, Optional, Tuple

import torch

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """A CUDA event recorded on the current stream at construction (a no-op without CUDA)."""

    def __init__(self) -> None:
        self._event = None
        if torch.cuda.is_available():
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (no CPU wait)."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def synchronize(self) -> None:
        """Blocks the CPU until the event completed."""
        if self._event is not None:
            self._event.synchronize()


class EventOverlap:
    """An optional EventHandle plus tensors to keep alive until it is waited for.

    `with overlap:` runs the block, then makes the current stream wait for the event.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event; ValueError when there is none (the op
        was not run with async_finish=True)."""
        if self.event is None:
            raise ValueError("EventOverlap has no event: pass async_finish=True to the op")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
