"""ASGI entry point of the example project: ``uvicorn example_project.asgi:application``, or
gunicorn with uvicorn's worker class.

Leave ``CONN_MAX_AGE`` at 0, as these settings do: Django runs each ASGI request's synchronous
code (its queries among it) in a thread of that request's own, so a persistent connection would
outlive the only thread that could use it again.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

application = get_asgi_application()
