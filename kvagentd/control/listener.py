"""The control socket's accept loop: connections drained from the backlog in batches, each
admitted (or refused) by its peer's uid before a thread is spent on it (`admission`)."""

from __future__ import annotations

import socket
import socketserver
from typing import Any

import structlog

from kvagentd.control.authz import peer_cred
from kvagentd.control.host import ControlHost

log = structlog.get_logger(__name__)

ACCEPT_BATCH = 256  # connections accepted per wake-up of the accept loop


class Listener(socketserver.ThreadingUnixStreamServer):
    """Accepts on the control socket; one thread per admitted connection, served by `handler`
    (`connection.ControlHandler`)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, control: ControlHost,
                 handler: type[socketserver.BaseRequestHandler]) -> None:
        self.control = control
        self.request_queue_size = control.cfg.listen_backlog
        super().__init__(str(control.path), handler, bind_and_activate=False)

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)  # accepts drain the backlog until EAGAIN

    def _handle_request_noblock(self) -> None:
        # NOTE: socketserver accepts one connection per wake-up of its selector; under a flood
        # that lets the backlog fill (connects then fail with EAGAIN). Drain it in batches.
        for _ in range(ACCEPT_BATCH):
            try:
                request, _ = self.socket.accept()
            except OSError:  # EAGAIN: the backlog is empty (or the peer left already)
                return
            try:
                self.process_request(request, None)
            except Exception:
                self.handle_error(request, None)
                self.shutdown_request(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            peer = peer_cred(request)
        except OSError:  # the peer left before we looked
            self.shutdown_request(request)
            return
        if self.control.admission.shedding(peer.uid) and _hung_up(request):
            request.close()  # a flooder's connection its client has closed: nobody to answer
            return
        refusal = self.control.admission.admit(peer)
        if refusal is not None:
            self.control.observe("<rejected>", "-", 503, 0.0)
            self.control.admission.refuse(request, refusal)
            return
        try:
            super().process_request(request, peer)
        except BaseException:
            self.control.admission.release(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.control.admission.release(client_address)

    def service_actions(self) -> None:
        self.control.admission.reap()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.error("control_connection_failed", exc_info=True)


def _hung_up(sock: socket.socket) -> bool:
    """The peer closed its end without sending anything (a connect-and-hang-up loop): one
    non-blocking peek. A client that sent a request and waits gets its 503 as before."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # still open, nothing sent yet: answered like any refusal
    except OSError:
        return True  # reset by the peer
