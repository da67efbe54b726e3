"""The test project's URLconf with two views whose options are wrong.

Their own URLconf, because the system checks refuse them (E033): only the tests that show what
such a view does at request time load it.
"""

from __future__ import annotations

from django.urls import path

from tests.testapp import urls, views

urlpatterns = [
    *urls.urlpatterns,
    path("misconfigured/", views.MisconfiguredPaymentView.as_view()),
    path("unimportable-scope/", views.UnimportableScopePaymentView.as_view()),
]
