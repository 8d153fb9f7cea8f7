"""The portal's page and assets, built from portal/ into `DIST` (served by `router`)."""

from pathlib import Path

DIST = Path(__file__).parent / "dist"
