from __future__ import annotations

from django.db import models


class Payment(models.Model):
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    description = models.CharField(max_length=200, blank=True)

    class Meta:
        app_label = "minimal"

    def __str__(self) -> str:
        return f"{self.amount} {self.currency}"
