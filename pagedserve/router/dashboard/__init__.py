"""The admin dashboard: a page at /dashboard and its JSON API under /admin/api/, on the API's port.

Access needs the admin token (``--admin-token`` / ``$PAGEDSERVE_ADMIN_TOKEN``, else one generated
and printed at start-up). The API takes ``Authorization: Bearer <token>``; a browser logs in once
through the form at /dashboard/login and then holds an HttpOnly, SameSite=Strict session cookie
(an HMAC of the token, not the token). A cookie-authenticated request that changes something must
also carry ``X-Pagedserve-Admin: 1``, which a cross-site form cannot send. Tokens are compared in
constant time. The page is static (HTML, JS, CSS in ``static/``, no CDN, no build step) and polls
the API; the data and actions are ``service.DashboardService``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from pagedserve.router.dashboard.service import DashboardService
from pagedserve.router.protocol import OpenAIError

__all__ = ["DashboardService", "install_dashboard", "new_admin_token"]

COOKIE = "pagedserve_admin"
CSRF_HEADER = "x-pagedserve-admin"
MAX_LOGIN_BODY = 4096
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def new_admin_token() -> str:
    return secrets.token_urlsafe(24)


def _static(name: str) -> bytes | None:
    if not re.fullmatch(r"[A-Za-z0-9_-]+\.[a-z]+", name):
        return None
    path = resources.files(__package__).joinpath("static", name)
    return path.read_bytes() if path.is_file() else None


class AdminAuth:
    """The admin token check: a bearer token, or the browser session's cookie."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self.session = hmac.new(self.token, b"pagedserve dashboard session", hashlib.sha256).hexdigest()

    def bearer_ok(self, request: Request) -> bool:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token)

    def cookie_ok(self, request: Request) -> bool:
        return hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), self.session.encode())

    def token_ok(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode(), self.token)

    def require(self, request: Request) -> None:
        """FastAPI dependency of every /admin/api route: 401 (403 for a cross-site write) else."""
        if self.bearer_ok(request):
            return
        if self.cookie_ok(request):
            if request.method not in ("GET", "HEAD") and request.headers.get(CSRF_HEADER) != "1":
                raise OpenAIError(403, f"a cookie-authenticated change needs the {CSRF_HEADER} header",
                                  code="csrf_check_failed")  # fmt: skip
            return
        raise OpenAIError(401, "missing or incorrect admin token (send Authorization: Bearer <admin token>)",
                          code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


def _login_page(error: str = "", status: int = 200) -> HTMLResponse:
    page = (_static("login.html") or b"<form method=post><input type=password name=token>{{error}}</form>")
    html = page.decode().replace("{{error}}", error)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def install_dashboard(app: FastAPI, service: DashboardService, token: str) -> None:
    """Add the dashboard's page, login and API routes to ``app``."""
    auth = AdminAuth(token)

    @app.get("/dashboard", include_in_schema=False)
    @app.get("/dashboard/", include_in_schema=False)
    async def page(request: Request) -> Response:
        if not (auth.cookie_ok(request) or auth.bearer_ok(request)):
            return RedirectResponse("/dashboard/login", status_code=303,
                                    headers={"Cache-Control": "no-store"})  # fmt: skip
        service.start()
        return HTMLResponse(_static("index.html") or b"", headers=SECURITY_HEADERS)

    @app.get("/dashboard/login", include_in_schema=False)
    async def login_form() -> Response:
        return _login_page()

    @app.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        body = await request.body()
        fields = parse_qs(body[:MAX_LOGIN_BODY].decode(errors="replace"))
        if not auth.token_ok((fields.get("token") or [""])[0]):
            return _login_page("invalid token", status=401)
        reply = RedirectResponse("/dashboard", status_code=303, headers={"Cache-Control": "no-store"})
        reply.set_cookie(COOKIE, auth.session, httponly=True, samesite="strict", path="/",
                         secure=request.url.scheme == "https")  # fmt: skip
        return reply

    @app.post("/dashboard/logout", include_in_schema=False)
    async def logout() -> Response:
        reply = RedirectResponse("/dashboard/login", status_code=303)
        reply.delete_cookie(COOKIE, path="/")
        return reply

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        data = _static(name)
        suffix = name[name.rfind(".") :]
        if data is None or suffix not in STATIC_TYPES:
            raise OpenAIError(404, f"no dashboard file {name!r}", code="not_found")
        return Response(data, media_type=STATIC_TYPES[suffix], headers={"Cache-Control": "no-cache"})

    api = APIRouter(prefix="/admin/api", dependencies=[Depends(auth.require)], include_in_schema=False)

    @api.get("/overview")
    async def overview() -> Response:
        service.start()
        return _json(await service.overview())

    @api.get("/history")
    async def history() -> Response:
        service.start()
        return _json(service.history())

    @api.get("/nodes")
    async def nodes() -> Response:
        return _json(await service.nodes())

    @api.get("/replicas")
    async def replicas() -> Response:
        listed = await service.replicas()
        for r in listed:
            r.pop("requests")
        return _json(listed)

    @api.get("/requests")
    async def requests() -> Response:
        return _json((await service.overview())["requests"])

    @api.get("/router")
    async def router() -> Response:
        return _json(service.router())

    @api.post("/replicas/{replica_id}/reset_prefix_cache")
    async def reset(replica_id: str) -> Response:
        return _json(await service.reset_prefix_cache(replica_id))

    @api.post("/replicas/{replica_id}/drain")
    async def drain(replica_id: str) -> Response:
        return _json(await service.set_draining(replica_id, True))

    @api.post("/replicas/{replica_id}/undrain")
    async def undrain(replica_id: str) -> Response:
        return _json(await service.set_draining(replica_id, False))

    @api.post("/requests/{request_id}/abort")
    async def abort(request_id: str) -> Response:
        return _json(await service.abort(request_id))

    app.include_router(api)


def _json(data: Any) -> Response:
    from fastapi.responses import JSONResponse

    return JSONResponse(data, headers={"Cache-Control": "no-store"})
