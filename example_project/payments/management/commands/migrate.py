"""``manage.py migrate``, which also migrates the stand-in provider's database where it has one."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.commands import migrate
from django.db import DEFAULT_DB_ALIAS

from payments import provider


class Command(migrate.Command):
    def handle(self, *args: Any, **options: Any) -> None:
        super().handle(*args, **options)
        # Django's test runner migrates each test database itself, through call_command.
        if (
            self._called_from_command_line
            and options["database"] == DEFAULT_DB_ALIAS
            and provider.DATABASE in settings.DATABASES
        ):
            super().handle(*args, **{**options, "database": provider.DATABASE})
