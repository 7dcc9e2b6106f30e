"""Only a trailing ``*`` is a route wildcard; a ``*`` elsewhere is refused where routes are loaded.

Once, ``path = "/api/**"`` or ``"/v/*.html"`` loaded without a word and matched no request (the
inner ``*`` matched only a literal ``*``), so every request passed unlimited.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geolimit.errors import ConfigError
from geolimit.http.keys import Route
from geolimit.middleware import policy
from geolimit.proxy import load_proxy_config

WHY = "only a trailing * is a wildcard ('/static/*' matches every path under /static/, subfolders too)"


@pytest.mark.parametrize("template", ["/api/**", "/v/*.html", "/*/users", "/a*/b/*", "/{id}/*/x"])
def test_an_inner_star_is_refused(template: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Route(template)
    assert str(caught.value).startswith(f"invalid route {template!r}: {WHY}"), caught.value
    with pytest.raises(ConfigError, match=r"only a trailing \* is a wildcard"):
        policy(template, "api")


@pytest.mark.parametrize(("template", "path", "params"), [
    ("/api/*", "/api/v1/users", {}),
    ("/*", "/", {}),
    ("/static*", "/static.css", {}),
    ("/users/{id}/*", "/users/7/photos/1", {"id": "7"}),
    # A newline (%0A, decoded) is matched by the * as any character: such paths matched no
    # '/*' route, so they went through unlimited.
    ("/*", "/a\nb", {}),
    ("/static/*", "/static/a\n", {}),
    ("/users/{id}/*", "/users/7/x\ny", {"id": "7"}),
])
def test_a_trailing_star_still_matches_the_rest(template: str, path: str, params: dict[str, str]) -> None:
    assert Route(template).match("GET", path) == params


def test_the_proxy_refuses_it_at_load_naming_the_file_and_route(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        '[proxy]\nupstreams = ["http://127.0.0.1:9000"]\nredis_url = "redis://127.0.0.1:6379/0"\nregion = "east"\n'
        '[[rule]]\nname = "api"\nlimit = "5/10s"\n'
        '[[route]]\npath = "/ok/*"\nlimits = [{ rule = "api" }]\n'
        '[[route]]\npath = "/v/*.html"\nlimits = [{ rule = "api" }]\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_proxy_config(config)
    assert str(caught.value).startswith(f"{config}: route[1].path: invalid route '/v/*.html': {WHY}"), caught.value
