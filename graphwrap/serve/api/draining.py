"""The server's uvicorn, draining at shutdown (``python -m graphwrap serve``'s, and each HTTP
process's with ``--api-servers``)."""

import logging
import os
from typing import Any, Optional, Sequence

logger = logging.getLogger("graphwrap.serve")

CUT_GRACE = 2.0  # seconds the streams cut at the drain's end get to send their last events


def draining_server():
    """uvicorn's Server, draining on the first SIGTERM or Ctrl-C: new requests get 503 while those
    running (streams included) finish, then it stops, at the latest ``drain`` seconds later. What
    still runs then is cut (:meth:`~.app.Served.cut`): each stream gets an error event and
    ``[DONE]`` within ``CUT_GRACE`` seconds, then the server stops. A second signal cuts them at
    once; a third is uvicorn's own (it stops at once). (uvicorn's own graceful shutdown may cut
    streams short without a word: some of its versions end them at the first signal.)"""
    import signal
    import time

    import uvicorn

    class Draining(uvicorn.Server):
        def __init__(self, config, served, drain: float, followers: Sequence[Any] = ()):
            super().__init__(config)
            self.served, self.drain = served, drain
            self.followers = followers  # the other HTTP processes (--api-servers), told of a SIGTERM too
            self.until: Optional[float] = None
            self.cut_at: Optional[float] = None
            self.signals = 0

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM:  # (Ctrl-C's SIGINT reaches every process of the group itself)
                for p in self.followers:
                    if p.is_alive():
                        os.kill(p.pid, sig)
            self.signals += 1
            if self.signals == 1:
                logger.info("shutting down: no new requests; those running get %.0f s to finish", self.drain)
                self.served.draining = True
                self.until = time.monotonic() + self.drain
            elif self.signals == 2:
                logger.info("a second signal: the requests still running are cut now")
                self.until = time.monotonic()
            else:
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            now = time.monotonic()
            if self.until is not None and not self.should_exit:
                if self.served.active == 0:
                    self.should_exit = True
                elif now >= self.until and self.cut_at is None:
                    cut = self.served.cut("the server is shutting down: its drain ended before this request did")
                    logger.warning("%d requests (%d sequences) were still running at the end of the drain: cut, "
                                   "each with an error", self.served.active, cut)
                    self.cut_at = now
                elif self.cut_at is not None and now > self.cut_at + CUT_GRACE:
                    logger.warning("%d requests did not end %.0f s after their cut: closed", self.served.active,
                                   CUT_GRACE)
                    self.should_exit = True
            return await super().on_tick(counter)

    return Draining
