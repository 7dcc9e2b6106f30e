"""Reading the RLS descriptor files (``[region] rls_config``).

``rls_config`` names a YAML file, a directory (every ``*.yaml`` / ``*.yml`` in it,
in name order, as envoyproxy/ratelimit loads its runtime directory) or a list of
either. A file may hold several documents (``---``), one domain each. Scalars are
read as written (YAML's BaseLoader): ``value: 0123`` is the string ``"0123"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from geolimit.errors import ConfigError
from geolimit.server.rls.descriptors import RlsConfig, parse_rls

__all__ = ["load_rls"]


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
        if not found:
            raise ConfigError(f"{path}: the directory holds no *.yaml or *.yml file")
        return found
    return [path]


def load_rls(paths: Sequence[Path], reserved: Sequence[str] = ()) -> RlsConfig:
    """Parse every domain of ``paths``; ``reserved`` are rule names already in use."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with the rls extra
        raise ConfigError("the rate limit service needs PyYAML and grpcio: pip install 'geolimit[rls]'") from None
    documents: list[tuple[str, object]] = []
    for file in (f for p in paths for f in _files(p)):
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{file}: the rate limit descriptor file does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: cannot read: {exc}") from None
        try:
            docs = [d for d in yaml.load_all(text, Loader=yaml.BaseLoader) if d not in (None, "")]
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: invalid YAML: {exc}") from None
        if not docs:
            raise ConfigError(f"{file}: holds no domain (expected 'domain:' and 'descriptors:')")
        for n, doc in enumerate(docs, 1):
            documents.append((str(file) if len(docs) == 1 else f"{file} (document {n})", doc))
    return parse_rls(documents, reserved)
