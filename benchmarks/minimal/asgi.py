"""The minimal project under an ASGI server (``python -m benchmarks.minimal --asgi``)."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.minimal.settings")
os.environ["BENCH_ASGI"] = "1"
application = get_asgi_application()
