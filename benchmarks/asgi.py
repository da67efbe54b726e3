"""The benchmark's ASGI application: the example's, with the benchmark's settings and URLs."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")
os.environ["BENCH_ASGI"] = "1"
application = get_asgi_application()
