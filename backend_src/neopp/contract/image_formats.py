"""The picture formats a file name asks for, by its suffix: what the CLI and the replay tools write."""

from __future__ import annotations

FORMAT_OF_SUFFIX = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
