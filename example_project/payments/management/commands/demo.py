"""``manage.py demo``: play retry stories against the payments API and check what they did.

The stories are in ``payments.management.stories``; each prints what was sent, what came back
and every row it created, as the admin then lists them. The command exits non-zero when a check
fails, so it doubles as a smoke test. ``--serve`` (or ``--port``) then serves the project.
"""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.handlers.wsgi import WSGIHandler
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.db import connection
from django.test import override_settings

from payments.management.stories import STORIES
from payments.management.storytelling import PASSWORD, Story, quiet

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.core.management.base import CommandParser

ADDRESS = "127.0.0.1"
DEFAULT_PORT = 8000
# Column widths of the table: story, what was sent, what came back, effect in the database.
WIDTHS = (22, 38, 36, 20)


def ensure_free(port: int) -> None:
    """Fail with a message that says what to do when ``port`` is taken, not with a traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the development server binds: a port left in TIME_WAIT by a stopped server is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ADDRESS, port))
        except OSError as exc:
            msg = (
                f"Cannot serve on {ADDRESS}:{port}: {exc.strerror or exc}. Another server (an "
                "earlier demo?) may be using it: stop it, or choose another port with --port."
            )
            raise CommandError(msg) from exc


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class Command(BaseCommand):
    help = "Play idempotency stories against the payments API and check their effect."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--serve",
            action="store_true",
            help=f"Then run the development server on {ADDRESS}:{DEFAULT_PORT}.",
        )
        parser.add_argument(
            "--port",
            type=int,
            default=None,
            help=f"The port to serve on (default {DEFAULT_PORT}); implies --serve.",
        )

    def handle(
        self, *args: Any, serve: bool = False, port: int | None = None, **options: Any
    ) -> None:
        serve = serve or port is not None
        port = DEFAULT_PORT if port is None else port
        if serve:
            ensure_free(port)  # before the stories: they take seconds, and change the database
        host = f"{ADDRESS}:{port}"
        for database in settings.DATABASES:  # the project's, and the provider's own on SQLite
            call_command("migrate", database=database, verbosity=0)
        self.ensure_users()
        database = connection.settings_dict["NAME"]
        name = Path(database).name if connection.vendor == "sqlite" else database
        self.stdout.write(f"Idempotency stories against {connection.vendor} database {name}\n")
        self.row(("story", "what was sent", "what came back", "database"), "")
        self.row(tuple("-" * width for width in WIDTHS), "")
        failed = []
        with quiet("django.request", "django_idempotency"), self.payment_events_served():
            for play in STORIES:
                story = play(host)
                self.show(story)
                if story.failures:
                    failed.append(story.title)
        if failed:
            msg = f"{len(failed)} of {len(STORIES)} stories failed: {', '.join(failed)}."
            raise CommandError(msg)
        self.stdout.write(self.style.SUCCESS(f"All {len(STORIES)} stories behaved as promised."))
        if serve:
            self.serve(port)

    @contextmanager
    def payment_events_served(self) -> Iterator[None]:
        """Serve this project over HTTP on loopback, for the outbox to deliver to."""
        server = ThreadedWSGIServer(("127.0.0.1", 0), QuietHandler)
        server.set_app(WSGIHandler())
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}/webhooks/payments/"
        try:
            with override_settings(PAYMENT_EVENTS_URL=url):
                yield
        finally:
            server.shutdown()
            server.server_close()
            thread.join()

    def ensure_users(self) -> None:
        users = get_user_model().objects
        for username in ("alice", "bob"):
            if not users.filter(username=username).exists():
                users.create_user(username=username, password=PASSWORD)
        if not users.filter(username="admin").exists():
            users.create_superuser(username="admin", email="", password="admin")

    def row(self, cells: tuple[str, ...], mark: str) -> None:
        padded = [cell.ljust(width) for cell, width in zip(cells, WIDTHS, strict=True)]
        self.stdout.write(f"{'  '.join(padded)}  {mark}".rstrip())

    def show(self, story: Story) -> None:
        mark = self.style.SUCCESS("✔") if not story.failures else self.style.ERROR("✘")
        height = max(len(story.sent), len(story.back), len(story.effect))
        for line in range(height):
            cells = tuple(
                column[line] if line < len(column) else ""
                for column in ([story.title], story.sent, story.back, story.effect)
            )
            self.row(cells, mark if line == 0 else "")
        for failure in story.failures:
            self.stdout.write(self.style.ERROR(f"{'':{WIDTHS[0]}}  ✘ {failure}"))
        self.stdout.write("")

    def serve(self, port: int) -> None:
        ensure_free(port)  # again: something may have taken it while the stories played
        site = f"http://{ADDRESS}:{port}"
        self.stdout.write(
            f"\nThe API:   {site}/api/payments/ and /api/refunds/"
            f" (alice or bob, password {PASSWORD!r})\n"
            f"The admin: {site}/admin/ (admin, password 'admin')\n"
            f"OpenAPI:   {site}/api/schema/\n"
            f"Metrics:   {site}/metrics/ (log in at /admin/ first in the same browser; or start\n"
            "           with METRICS_TOKEN=... and send 'Authorization: Bearer ...'; not -u)\n"
            "Try it:\n"
            "  curl -i -u alice:password -H 'Idempotency-Key: my-first-key' \\\n"
            "       -H 'Content-Type: application/json' \\\n"
            f'       -d \'{{"amount": 1000, "currency": "eur"}}\' {site}/api/payments/\n'
        )
        # Without the autoreloader: it would start this command, stories and all, a second time.
        call_command("runserver", f"{ADDRESS}:{port}", use_reloader=False)
