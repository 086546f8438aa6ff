"""The control API: HTTP/1.1 + JSON on a Unix socket.

`server` (transport, limits, draining), `router` (routes, `Request`, `Response`), `authz`
(peer credentials -> read / change access), `errors` (API errors and the one exception mapping),
`handlers/` (one module of routes per area, each with `register(router, daemon)`).
"""
