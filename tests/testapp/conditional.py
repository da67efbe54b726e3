"""Views of a Document updated with If-Match: DRF and plain, by version and by content."""

from __future__ import annotations

import itertools
import json
import time

from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics, serializers, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import BaseParser

from django_idempotency.conditional import etag_for_content
from django_idempotency.decorators import conditional, idempotent
from django_idempotency.drf import ConditionalMixin, IdempotentMixin
from tests.testapp.models import Document


class DocumentSerializer(serializers.ModelSerializer):
    class Meta:
        model = Document
        fields = ["id", "title", "body", "version"]
        read_only_fields = ["version"]

    def update(self, instance, validated_data):
        # X-Hold keeps the row (and its lock) held, so that a race is easy to arrange.
        if hold := self.context["request"].headers.get("X-Hold"):
            time.sleep(float(hold))
        return super().update(instance, validated_data)


class ContentSerializer(DocumentSerializer):
    class Meta(DocumentSerializer.Meta):
        fields = ["id", "title", "body"]


class VersionedDocument(ConditionalMixin, generics.RetrieveUpdateDestroyAPIView):
    queryset = Document.objects.all()
    serializer_class = DocumentSerializer
    etag_version_field = "version"


class ContentDocument(ConditionalMixin, generics.RetrieveUpdateDestroyAPIView):
    queryset = Document.objects.all()
    serializer_class = ContentSerializer


class StrictDocument(VersionedDocument):
    precondition_required = True


class IdempotentDocument(IdempotentMixin, ConditionalMixin, generics.RetrieveUpdateAPIView):
    queryset = Document.objects.all()
    serializer_class = DocumentSerializer
    etag_version_field = "version"
    idempotency_methods = ("PATCH", "PUT")


class StreamingJSONParser(BaseParser):
    """Parses JSON as it streams in, as parsers built on other JSON libraries do: the body cannot
    be read again afterwards."""

    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        return json.load(stream)


class ProjectMixin:
    """A project's own mixin over DRF's hooks: it refuses a body before DRF's checks run, and
    stamps every answer."""

    def initial(self, request, *args, **kwargs):
        if "version" in request.data:
            raise ValidationError({"version": "This field is read-only."})
        super().initial(request, *args, **kwargs)

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        response["X-Project"] = "seen"
        return response


class CountedUpdates:
    runs: list[str] = []  # each run of a view's update, for the tests to count

    def update(self, request, *args, **kwargs):
        self.runs.append(type(self).__name__)
        return super().update(request, *args, **kwargs)


class ComposedDocument(CountedUpdates, generics.RetrieveUpdateAPIView):
    """A detail view that each composition of the mixins goes in front of."""

    queryset = Document.objects.all()
    serializer_class = DocumentSerializer
    parser_classes = [StreamingJSONParser]


class ComposedDocumentSet(CountedUpdates, viewsets.ModelViewSet):
    """The same as a viewset."""

    queryset = Document.objects.all()
    serializer_class = DocumentSerializer
    parser_classes = [StreamingJSONParser]


def _compositions():
    mixins = (IdempotentMixin, ConditionalMixin)
    yield from itertools.permutations(mixins)
    yield from itertools.permutations((*mixins, ProjectMixin))


def composed(bases, mode, view=ComposedDocument):
    """``class V(*bases, view)``: a keyed, conditional PATCH in ``mode``."""
    name = "".join(base.__name__.removesuffix("Mixin") for base in bases) + view.__name__
    options = {"etag_version_field": "version", "idempotency_methods": ("PATCH",)}
    return type(name + mode.title(), (*bases, view), {**options, "idempotency_mode": mode})


# Every order of the two mixins, alone and with a project's own mixin in each position.
COMPOSITIONS = list(_compositions())


def _document(request, pk):
    document = Document.objects.get(pk=pk)
    if request.method in {"PATCH", "PUT"}:
        changes = json.loads(request.body)
        if "title" not in changes:
            return JsonResponse({"title": "required"}, status=400)
        document.title = changes["title"]
        document.save(update_fields=["title"])
    if request.method == "DELETE":
        document.delete()
        return HttpResponse(status=204)
    document.refresh_from_db()
    return JsonResponse({"id": document.pk, "title": document.title, "version": document.version})


@csrf_exempt
@conditional(Document.objects.all(), version_field="version")
def plain_versioned(request, pk):
    return _document(request, pk)


@csrf_exempt
@conditional(
    Document.objects.all(),
    etag=lambda document: etag_for_content(document.title.encode()),
    required=True,
)
def plain_by_content(request, pk):
    return _document(request, pk)


@csrf_exempt
@idempotent(methods=("PATCH",), required=False)
@conditional(Document.objects.all(), version_field="version")
def plain_idempotent(request, pk):
    return _document(request, pk)
