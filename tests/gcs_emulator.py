"""gcp-storage-emulator, serving in memory, with two more of Google Cloud Storage's behaviours.

``python gcs_emulator.py HOST PORT`` runs the emulator (``pip install gcp-storage-emulator``)
until it is terminated. Beyond the emulator, as GCS does:

* an upload with the precondition ``ifGenerationMatch=0`` (gcsfs's exclusive write,
  ``pipe_file(..., mode="create")``) of a name that already exists gets ``412 Precondition
  Failed``; the emulator serves one request at a time, so the check and the write are one step;
* ``DELETE`` of a resumable upload session cancels it (``499``), where the emulator answers
  ``501``, which gcsfs retries for half a minute.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

Handler = Callable[[Any, Any, Any], Any]


def _object_name(request: Any) -> str | None:
    if "name" in request.query:
        return str(request.query["name"][0])
    data = request.data
    if isinstance(data, dict):
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else data
        name = meta.get("name")
        return str(name) if name else None
    return None


def _create_only(upload: Handler) -> Handler:
    def checked(request: Any, response: Any, storage: Any) -> Any:
        if request.query.get("ifGenerationMatch", [None])[0] == "0":
            name = _object_name(request)
            try:
                storage.get_file_obj(request.params["bucket_name"], name)
            except NotFound:
                pass
            else:
                response.status = HTTPStatus.PRECONDITION_FAILED
                message = f"object {name} exists: ifGenerationMatch=0 not met"
                response.json({"error": {"code": 412, "message": message}})
                return None
        return upload(request, response, storage)

    return checked


def _cancel_resumable_upload(request: Any, response: Any, storage: Any) -> None:
    try:
        storage.delete_resumable_file_obj(request.query["upload_id"][0])
    except (KeyError, NotFound):
        response.status = HTTPStatus.NOT_FOUND
        return
    response.status = _CANCELLED


class _Cancelled:
    value, phrase = 499, "Client Closed Request"


_CANCELLED = _Cancelled()

# insert() looks these up by name at every request
objects._media_upload = _create_only(objects._media_upload)
objects._multipart_upload = _create_only(objects._multipart_upload)
objects._create_resumable_upload = _create_only(objects._create_resumable_upload)

for _pattern, _handlers in server.HANDLERS:
    if _handlers.get(server.PUT) is objects.upload_partial:
        _handlers[server.DELETE] = _cancel_resumable_upload

if __name__ == "__main__":
    host, port = sys.argv[1], int(sys.argv[2])
    server.create_server(host, port, in_memory=True).run()
