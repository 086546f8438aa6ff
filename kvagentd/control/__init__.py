"""The control API: HTTP/1.1 + JSON on a Unix socket.

`server` (lifecycle, draining), `socketfile` (the socket on disk), `listener` (the accept loop)
with `admission` (per-uid shares), `connection` (one connection's requests: deadlines, limits,
responses), `host` (what those two use of the server), `router` (routes, `Request`,
`Response`), `authz` (peer credentials -> read / change access), `errors` (API errors and the
one exception mapping), `deps` (`ControlDeps`: what the handlers use of the daemon),
`handlers/` (one module of routes per area, each with `register(router, deps)`).
"""
