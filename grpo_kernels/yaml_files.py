"""YAML as the project reads it (config files, presets, run configs): `yaml.safe_load` without anchors and aliases.

`safe_load` never runs code (`!!python/...` tags are refused), but it keeps aliases shared: a few hundred bytes of
nested `*alias` lists stand for billions of items, which any code that walks or prints the value expands. Nothing
the project reads needs them, so an anchor (`&name`) or alias (`*name`) is refused while parsing. Every failure
(malformed YAML, an unknown tag, an anchor, nesting too deep, bytes that are not UTF-8) is a ValueError of one line
that names the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class _NoAliasLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses anchors and aliases where it meets them."""

    def compose_node(self, parent, index):  # noqa: ANN001 - yaml's signature
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases (&name, *name) are not allowed", event.start_mark
            )
        return super().compose_node(parent, index)


def load_yaml(text: str, where: str) -> Any:
    """The data of YAML `text`; a ValueError of one line naming `where` (a file, a flag) when it cannot be read."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as error:
        reason = " ".join(str(error).replace('in "<unicode string>", ', "").split())
        raise ValueError(f"{where}: not valid YAML ({reason})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid YAML (nested too deeply)") from None


def read_yaml(path: str | Path) -> Any:
    """The data of the YAML file `path`; a ValueError naming it when it is not UTF-8 or not valid YAML."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None
    return load_yaml(text, str(path))
