"""Quick start: a limiter deciding against a real Redis.

    python examples/quickstart.py                      # starts an embedded redis-server
    python examples/quickstart.py redis://host:6379/0  # or use yours
"""

from __future__ import annotations

import sys

from geolimit import Limiter, Rule
from geolimit.store.embedded import EmbeddedRedis


def main(url: str) -> None:
    rules = [Rule("api", limit=5, window=10), Rule.from_string("burst", "2/1s")]
    with Limiter.from_url(url, region="local", rules=rules) as limiter:
        for i in range(7):
            d = limiter.hit("api", "user:42")
            verdict = "allowed" if d.allowed else f"denied, retry in {d.retry_after:.2f}s"
            print(f"hit {i + 1}: {verdict:28} remaining={d.remaining}")
        both = [limiter.hit(["api", "burst"], "user:7").allowed for _ in range(3)]
        print("api+burst for user:7:", both)
        print("usage:", limiter.usage("api", "user:42").as_dict())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with EmbeddedRedis() as server:
            main(server.url)
