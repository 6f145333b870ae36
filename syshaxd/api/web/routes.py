"""The web page for the people who run the daemon: GET / (live status and a chat playground), and its files.

The page is four static files in api/web/, served as they are: no template, nothing of the daemon's
state or config is written into them, so they hold no secret. It reads the JSON the daemon serves
(/v1/syshax/status, /v1/models) and streams from /v1/chat/completions, with the API key the person
types in, when keys are configured. A content-security policy keeps it to itself: its own scripts
and styles, requests to this daemon only, no frames. `web_ui = false` in the config turns it off.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from aiohttp import web

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}
FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css", "icon.svg": "image/svg+xml"}

routes = web.RouteTableDef()


@cache
def _file(name: str) -> bytes:
    return files("syshaxd.api").joinpath("web", name).read_bytes()  # read once: the files ship with the package


def _page(name: str) -> web.Response:
    return web.Response(body=_file(name), content_type=FILES[name], charset="utf-8", headers=HEADERS)


@routes.get("/favicon.ico")
async def favicon(request: web.Request) -> web.Response:
    return _page("icon.svg")  # what a browser asks for before it reads the page's own icon link


@routes.get("/")
async def index(request: web.Request) -> web.Response:
    return _page("index.html")


@routes.get("/ui/{name}")
async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in FILES or name == "index.html":
        raise web.HTTPNotFound()
    return _page(name)
