"""The request fingerprint: what makes two requests with one key "the same request"."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from django.http.multipartparser import MultiPartParserError

from django_idempotency.core import canonical
from django_idempotency.core.bodies import UnfitJSON, length_unknown, load_json

if TYPE_CHECKING:
    from collections.abc import Iterable

    from django.http import HttpRequest


class _Digest:
    """SHA-256 over length-prefixed parts, so that no two sequences of parts collide."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()

    def add(self, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        self._sha.update(len(data).to_bytes(8, "big"))
        self._sha.update(data)

    def add_chunks(self, size: int, chunks: Iterable[bytes]) -> None:
        self._sha.update(size.to_bytes(8, "big"))
        for chunk in chunks:
            self._sha.update(chunk)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _canonical(body: bytes) -> bytes | None:
    """The canonical form of a JSON body; ``None`` if it is not JSON; raise ``UnfitJSON`` if it
    is JSON that the library does not pass on (too deep, or not standard)."""
    try:
        document = load_json(body)
    except UnfitJSON:
        raise
    except (ValueError, TypeError):
        return None  # not JSON: the raw bytes are then the fingerprint
    return canonical.dumps(document)


def canonical_json(body: bytes) -> bytes | None:
    """Return the canonical form of a JSON body, or ``None`` if it is not JSON the library takes."""
    try:
        return _canonical(body)
    except UnfitJSON:
        return None


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


def _add_form(digest: _Digest, request: HttpRequest) -> None:
    # A multipart body is hashed as its parsed fields and files, never loaded whole: files over
    # FILE_UPLOAD_MAX_MEMORY_SIZE stay on disk and are read in chunks. A retry that draws a new
    # multipart boundary still matches.
    for name in sorted(request.POST):
        for value in request.POST.getlist(name):
            digest.add(name)
            digest.add(value)
    for name in sorted(request.FILES):
        for upload in request.FILES.getlist(name):
            digest.add(name)
            digest.add(upload.name or "")
            digest.add(upload.content_type or "")
            digest.add_chunks(upload.size or 0, upload.chunks())
            upload.seek(0)


class UnreadableBody(Exception):
    """The body cannot be fingerprinted; the message says why, and holds nothing of the body."""


class LengthRequired(UnreadableBody):
    """The body has no ``Content-Length``, so Django cannot read it whole."""


_BODY_ERROR = "_django_idempotency_body_error"
# Nothing of the request itself: not even the boundary it sent.
_MALFORMED_MULTIPART = "The multipart body is malformed, so the request cannot be compared."


def buffer_body(request: HttpRequest) -> None:
    """Read the body the way the fingerprint needs it, before anything streams it away.

    Small bodies are kept in memory (``request.body``), multipart ones parsed into
    ``request.POST`` and ``request.FILES`` (files on disk): Django and DRF read either later.
    """
    if (request.content_type or "") != "multipart/form-data":
        request.body  # noqa: B018 - caches the body
    elif request.method != "POST" and not request._read_started:  # type: ignore[attr-defined]
        # Django parses multipart only for POST. Parse this body the same way (files
        # stream to disk) and leave the result where Django and DRF look for it.
        try:
            post, files = request.parse_file_upload(request.META, request)  # type: ignore[arg-type]
        except MultiPartParserError as exc:
            setattr(request, _BODY_ERROR, exc)  # the fingerprint reports it
            return
        request._post, request._files = post, files  # type: ignore[attr-defined]


def request_fingerprint(request: HttpRequest, route: str, headers: Iterable[str] = ()) -> str:
    """SHA-256 of the method, route, path, query string, named headers and body of ``request``."""
    digest = _Digest()
    digest.add(request.method or "")
    digest.add(route)
    # The route scopes the key; the path tells which resource it acted on. A key reused for
    # another resource under the same route is a different request, not a replay.
    digest.add(request.path_info)
    digest.add(request.META.get("QUERY_STRING", ""))
    for name in sorted({header.lower() for header in headers}):
        digest.add(name)
        digest.add(request.headers.get(name, ""))
    content_type = request.content_type or ""
    if length_unknown(request):
        # Django would read the body as empty: the fingerprint, and the view, would see another
        # request than the one sent.
        msg = "The body was sent without Content-Length, so it cannot be read whole."
        raise LengthRequired(msg)
    buffer_body(request)
    if content_type == "multipart/form-data":
        digest.add(b"multipart")
        if getattr(request, _BODY_ERROR, None) is not None:
            raise UnreadableBody(_MALFORMED_MULTIPART) from getattr(request, _BODY_ERROR)
        try:
            _add_form(digest, request)
        except MultiPartParserError as exc:
            raise UnreadableBody(_MALFORMED_MULTIPART) from exc
    else:
        body = request.body
        try:
            canonical = _canonical(body) if _is_json(content_type) else None
        except UnfitJSON as exc:
            # Refused here, where every adapter reads a keyed body, rather than passed on to a
            # view whose parser may accept it and whose database write would then fail.
            raise UnreadableBody(f"The JSON body {exc}.") from exc
        digest.add(b"json" if canonical is not None else b"raw")
        digest.add(canonical if canonical is not None else body)
    return digest.hexdigest()
