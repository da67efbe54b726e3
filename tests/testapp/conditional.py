"""Views of a Document updated with If-Match: DRF and plain, by version and by content."""

from __future__ import annotations

import json
import time

from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics, serializers

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
