"""The package's layout: no module imports itself back nor any module of a floor above its own,
none is too long to read, and each optional framework stays in the modules built on it.

grimp reads every import statement, those inside functions too, so a circle that a lazy import
hides is still a circle here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import django_idempotency
from tests import layers

PACKAGE = "django_idempotency"


@pytest.fixture(scope="module")
def graph():
    return layers.build_graph()


def test_no_module_imports_itself_back(graph):
    modules = {PACKAGE, *graph.find_descendants(PACKAGE)}
    cycles = [
        (importer, *graph.find_shortest_chain(importer=imported, imported=importer))
        for importer in sorted(modules)
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & modules)
        if graph.chain_exists(importer=imported, imported=importer)
    ]
    assert cycles == []


def test_no_import_runs_back_up_a_floor(graph):
    # The floors of tests/layers.py, lowest first: a module imports its own floor or below.
    # `python -m tests.layers` prints the whole picture.
    assert [(arrow.importer, arrow.imported) for arrow in layers.back_up(graph)] == []


def test_every_module_is_on_a_floor_and_in_a_room(graph):
    assert all(layers.room_of(module) for module in layers.modules(graph))


def test_a_registry_look_up_counts_as_an_arrow_to_the_models(graph, monkeypatch):
    monkeypatch.setattr(layers, "registry_lookups", lambda: [f"{PACKAGE}.core.engine"])
    assert layers.Arrow(f"{PACKAGE}.core.engine", f"{PACKAGE}.models") in layers.back_up(graph)


def test_the_picture_prints_its_totals(graph):
    assert "arrows back up" in layers.picture(graph).splitlines()[-1]


def test_celery_is_imported_by_the_two_modules_built_on_it(graph):
    # core.task_sending sends the package's own tasks; celery is the idempotent tasks' adapter,
    # which nothing in the package imports: the core works without Celery.
    adapter = f"{PACKAGE}.celery"
    assert graph.find_modules_that_directly_import("celery") == {
        f"{PACKAGE}.core.task_sending",
        adapter,
    }
    assert graph.find_downstream_modules(adapter) == set()


def test_the_tasks_framework_s_adapter_is_imported_by_its_own_modules_alone(graph):
    # The framework is optional before Django 6.0: the adapter imports it (by name), and only
    # the periodic tasks built on the adapter, and the command that enqueues them, import it.
    adapter = f"{PACKAGE}.django_tasks"
    assert graph.find_modules_that_directly_import(adapter) == {f"{adapter}.lifecycle"}
    assert graph.find_modules_that_directly_import(f"{adapter}.lifecycle") == {
        f"{PACKAGE}.management.commands.idempotency_enqueue"
    }


def test_the_openapi_contract_imports_neither_framework(graph):
    # The DRF and Ninja schemas both render it, and each framework is an optional extra.
    imported = graph.find_upstream_modules(f"{PACKAGE}.core.openapi_contract")
    assert imported.isdisjoint({"rest_framework", "drf_spectacular", "ninja"})
    assert f"{PACKAGE}.conf" in imported  # the graph does see what it imports


def test_the_models_import_only_their_managers_and_column_lengths(graph):
    # The managers (purges, the lease sweep) work on the model they manage: the store, the
    # statements and the sweeper under them never import the models back.
    imported = graph.find_modules_directly_imported_by(f"{PACKAGE}.models")
    assert {module for module in imported if module.startswith(PACKAGE)} == {
        f"{PACKAGE}.managers",
        f"{PACKAGE}.core.tables",
    }
    assert f"{PACKAGE}.models" not in graph.find_upstream_modules(f"{PACKAGE}.managers")


def test_no_module_looks_the_package_s_models_up_by_name():
    # A look-up in the app registry is an import the graph cannot see: it could hide a circle.
    # Migrations are the exception Django makes: they must use the historical models.
    package = Path(django_idempotency.__file__).parent
    lookups = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "migrations" not in path.parts
        and re.search(r"get_(model|app_config)\(\s*['\"]django_idempotency", path.read_text())
    ]
    assert lookups == []


def test_no_module_is_over_500_lines():
    package = Path(django_idempotency.__file__).parent
    lengths = {
        str(path.relative_to(package)): len(path.read_text().splitlines())
        for path in package.rglob("*.py")
    }
    assert {name: lines for name, lines in lengths.items() if lines > 500} == {}
